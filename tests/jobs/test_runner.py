"""The job runner: error rows, refusals, batch mode, readable output, retries."""

from __future__ import annotations

import errno
import io
import json
import re
import shutil

import datasets
import pyarrow as pa
import pytest

from jobs.config import DEFAULT_BATCH_SIZE, ConfigError, JobConfig
from jobs.output import FingerprintMismatch, OutputError, read_all_ledgers
from jobs.runner import run_job
from jobs.status import print_status
from mtp_engine import MTPEngine
from tests.jobs.conftest import PROMPT_TEXTS, job_config, prompt_rows, write_jsonl


def load_rows(folder) -> dict:
    ds = datasets.load_from_disk(str(folder))
    assert len(ds["id"]) == len(set(ds["id"]))
    return {r["id"]: r for r in ds}


def test_each_bad_input_yields_exactly_its_error_row(tmp_path, job_model, job_engine):
    good = [{"id": f"ok{i}", "prompt": t} for i, t in enumerate(PROMPT_TEXTS[:4])]
    bad = [
        {"id": "no-prompt", "text": "hello"},
        {"id": "not-a-string", "prompt": ["a", "b"]},
        {"id": "empty", "prompt": "   "},
        {"id": "ok0", "prompt": "same id again"},
        {"id": "too-long", "prompt": "x " * 3000},
        {"id": "bad-max", "prompt": "hi", "max_tokens": -3},
        {"id": "bad-messages", "messages": [{"role": "user"}]},
    ]
    chat = {"id": "chat", "messages": [{"role": "user", "content": "Write a function"}]}
    dataset = write_jsonl(tmp_path / "in.jsonl", good[:2] + bad + [chat] + good[2:], ["{broken json", "[1, 2]"])
    summary = run_job(job_config(dataset, job_model, tmp_path / "out"), engine=job_engine)
    rows = load_rows(tmp_path / "out")
    assert summary.done == len(rows) == 4 + len(bad) + 1 + 2
    errors = {rid: r["error"].split(":")[0] for rid, r in rows.items() if r["finish_reason"] == "error"}
    n = len(good) + len(bad)  # index of the first line after the JSON rows... computed below
    assert errors == {
        "no-prompt": "missing_prompt",
        "not-a-string": "invalid_prompt",
        "empty": "empty_prompt",
        "ok0#dup-row-5": "duplicate_id",
        "too-long": "prompt_too_long",
        "bad-max": "invalid_field",
        "bad-messages": "invalid_messages",
        str(n + 1): "malformed_json",
        str(n + 2): "invalid_row",
    }
    # Lines without an id name their line number.
    assert "line 13" in rows[str(n + 1)]["error"] and rows[str(n + 1)]["line"] == 13
    # Every valid row completed, with the engine's own output.
    for r in good:
        row = rows[r["id"]]
        expected = job_engine.generate(r["prompt"], max_tokens=16)
        assert row["completion"] == expected.text and row["finish_reason"] in ("stop", "length")
        assert row["acceptance"]["mode"] == "chain" and row["acceptance"]["steps"] >= 1
    rendered = job_engine.tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert rows["chat"]["prompt"] == rendered and rows["chat"]["completion"] is not None
    assert summary.errors == len(errors)


def test_per_row_overrides(tmp_path, job_model, job_engine):
    base = job_engine.generate(PROMPT_TEXTS[1], max_tokens=16)
    stop = base.text[6:9]
    rows = [
        {"id": "short", "prompt": PROMPT_TEXTS[1], "max_tokens": 3},
        {"id": "stop", "prompt": PROMPT_TEXTS[1], "stop": stop},
    ]
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, tmp_path / "out"), engine=job_engine)
    out = load_rows(tmp_path / "out")
    assert out["short"]["completion_tokens"] == 3 and out["short"]["finish_reason"] == "length"
    assert out["stop"]["completion"] == base.text[: base.text.find(stop)]
    assert out["stop"]["finish_reason"] == "stop"


def test_changed_model_template_or_decoding_is_refused(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(4))
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out), engine=job_engine)
    before = load_rows(out)

    for change, pattern in [
        (dict(max_tokens=17), r"decoding.max_tokens: 16 -> 17"),
        (dict(system_prompt="Be brief."), r"rendering.system_prompt"),
    ]:
        with pytest.raises(FingerprintMismatch, match=pattern) as info:
            run_job(job_config(dataset, job_model, out, **change), engine=job_engine)
        assert "--overwrite" in str(info.value)
    # Settings that change only the speed resume the folder (every mode is lossless).
    for change in (dict(mode="tree"), dict(draft_tokens=2), dict(mode="baseline", batch_size=2)):
        again = run_job(job_config(dataset, job_model, out, **change), engine=job_engine)
        assert again.committed == 0 and again.done == 4

    # Another model (a copy with a different chat template).
    other = tmp_path / "other_model"
    shutil.copytree(job_model, other)
    tok_cfg = json.loads((other / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = tok_cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (other / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(FingerprintMismatch, match=r"model:.*\n.*chat_template_sha256"):
        run_job(job_config(dataset, other, out), engine=MTPEngine.load(other))

    assert load_rows(out) == before  # nothing deleted
    # --overwrite starts over.
    run_job(job_config(dataset, job_model, out, max_tokens=5, overwrite=True), engine=job_engine)
    assert all(r["completion_tokens"] <= 5 for r in load_rows(out).values())


def test_refuses_a_non_job_folder(tmp_path, job_model, job_engine):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        run_job(job_config(write_jsonl(tmp_path / "in.jsonl", prompt_rows(2)), job_model, out), engine=job_engine)
    assert (out / "notes.txt").exists()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_batch_mode_equals_one_row_at_a_time(tmp_path, job_model, job_engine, batch_size):
    rows = prompt_rows(10) + [{"id": "stopper", "prompt": PROMPT_TEXTS[2], "max_tokens": 4}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    run_job(job_config(dataset, job_model, tmp_path / "single", mode="baseline"), engine=job_engine)
    run_job(job_config(dataset, job_model, tmp_path / "batch", mode="baseline", batch_size=batch_size),
            engine=job_engine)
    single, batch = load_rows(tmp_path / "single"), load_rows(tmp_path / "batch")
    assert single.keys() == batch.keys()
    for rid in single:
        for col in ("completion", "completion_tokens", "finish_reason", "prompt", "prompt_tokens"):
            assert single[rid][col] == batch[rid][col], (rid, col)
        assert batch[rid]["acceptance"]["mode"] == "baseline"
        assert batch[rid]["acceptance"]["steps"] == single[rid]["acceptance"]["steps"]  # one forward a token


def test_a_backend_that_cannot_batch_falls_back_to_one_row_at_a_time(tmp_path, job_model, job_engine, monkeypatch):
    import io

    from mtp_engine.decoder import Decoder

    calls = {"step": 0}
    step = Decoder.step

    def failing_step(self):  # a backend that fails to run batches of several rows
        if self.decode.batch_size == 1:
            return step(self)
        calls["step"] += 1
        raise RuntimeError("simulated kernel launch failure")

    rows = prompt_rows(9)
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    run_job(job_config(dataset, job_model, tmp_path / "single", mode="baseline"), engine=job_engine)
    monkeypatch.setattr(Decoder, "step", failing_step)
    log = io.StringIO()
    summary = run_job(job_config(dataset, job_model, tmp_path / "batch", mode="baseline", batch_size=2),
                      engine=job_engine, stream=log)
    single, batch = load_rows(tmp_path / "single"), load_rows(tmp_path / "batch")
    assert summary.errors == 0 and single.keys() == batch.keys()
    assert all(single[r]["completion"] == batch[r]["completion"] for r in single)
    assert calls["step"] == 2  # then no more batches
    assert "decoding the remaining rows one at a time" in log.getvalue()


def test_output_is_readable_three_ways(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(7))
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out), engine=job_engine)
    via_disk = datasets.load_from_disk(str(out))
    shards = sorted(out.glob("data-*.arrow"))
    per_shard = [pa.ipc.open_stream(str(s)).read_all() for s in shards]
    assert sum(t.num_rows for t in per_shard) == via_disk.num_rows == 7
    via_builder = datasets.load_dataset("arrow", data_files=[str(s) for s in shards], split="train")
    assert sorted(via_builder["id"]) == sorted(via_disk["id"])
    assert via_disk.features["acceptance"]["histogram"].feature.dtype == "int32"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "arrow", "disk", "glob"])
def test_every_input_format_gives_the_same_rows(tmp_path, job_model, job_engine, fmt):
    rows = prompt_rows(5)
    ds = datasets.Dataset.from_list(rows)
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "in.jsonl", rows)
    elif fmt == "json":
        path = tmp_path / "in.json"
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        path = tmp_path / "in.csv"
        ds.to_csv(str(path), index=False)
    elif fmt == "parquet":
        path = tmp_path / "in.parquet"
        ds.to_parquet(str(path))
    elif fmt == "arrow":
        path = tmp_path / "in.arrow"
        with pa.ipc.new_stream(str(path), ds.data.schema) as w:
            w.write_table(ds.data.table)
    elif fmt == "disk":
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    else:
        write_jsonl(tmp_path / "part-a.jsonl", rows[:2])
        write_jsonl(tmp_path / "part-b.jsonl", rows[2:])
        path = tmp_path / "part-*.jsonl"
    run_job(job_config(path, job_model, tmp_path / "out"), engine=job_engine)
    out = load_rows(tmp_path / "out")
    assert sorted(out) == sorted(r["id"] for r in rows)
    for r in rows:
        assert out[r["id"]]["completion"] == job_engine.generate(r["prompt"], max_tokens=16).text


def test_ids_default_to_row_numbers(tmp_path, job_model, job_engine):
    rows = [{"prompt": t} for t in PROMPT_TEXTS[:3]]
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, tmp_path / "out"), engine=job_engine)
    assert sorted(load_rows(tmp_path / "out")) == ["0", "1", "2"]


class FlakyEngine(MTPEngine):
    """Raises for prompts holding a marker: once for "flaky", always for "broken"."""

    def __init__(self, checkpoint):
        super().__init__(checkpoint)
        self.calls: dict[str, int] = {}

    def prefill(self, ids, caches, keep_hidden, evaluate=True):  # every prompt's first work in the decoder
        text = self.tokenizer.decode(ids)
        for marker in ("flaky", "broken"):
            if marker in text:
                self.calls[marker] = self.calls.get(marker, 0) + 1
                if marker == "broken" or self.calls[marker] == 1:
                    raise RuntimeError(f"simulated failure on {marker}")
        return super().prefill(ids, caches, keep_hidden, evaluate)


def test_failed_generation_is_retried_once_then_becomes_an_error_row(tmp_path, job_model):
    engine = FlakyEngine(MTPEngine.load(job_model).checkpoint)
    rows = [{"id": "a", "prompt": "flaky row"}, {"id": "b", "prompt": "broken row"}, {"id": "c", "prompt": "fine"}]
    summary = run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, tmp_path / "out", batch_size=1),
                      engine=engine)
    out = load_rows(tmp_path / "out")
    assert out["a"]["finish_reason"] in ("stop", "length")
    assert out["b"]["error"] == "generation_failed: RuntimeError: simulated failure on broken"
    assert out["c"]["completion"] is not None
    assert engine.calls == {"flaky": 2, "broken": 2}
    assert summary.errors == 1


def test_transient_write_errors_are_retried(tmp_path, job_model, job_engine, monkeypatch):
    import jobs.output as output

    real_replace, failures = output.os.replace, {"left": 2}

    def flaky_replace(src, dst):
        if str(dst).endswith(".arrow") and failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EIO, "simulated transient I/O error")
        return real_replace(src, dst)

    monkeypatch.setattr(output.os, "replace", flaky_replace)
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", prompt_rows(4)), job_model, tmp_path / "out"), engine=job_engine)
    assert failures["left"] == 0
    assert len(load_rows(tmp_path / "out")) == 4


def test_limit_and_resume_extends(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(6))
    out = tmp_path / "out"
    first = run_job(job_config(dataset, job_model, out, limit=2), engine=job_engine)
    assert first.committed == 2
    second = run_job(job_config(dataset, job_model, out, limit=2), engine=job_engine)
    assert second.committed == 0 and second.done == 2


def test_bad_dataset_path_fails_the_job(tmp_path, job_model, job_engine):
    from jobs.readers import DatasetError

    with pytest.raises(DatasetError, match="does not exist"):
        run_job(job_config(tmp_path / "missing.jsonl", job_model, tmp_path / "out"), engine=job_engine)
    (tmp_path / "in.txt").write_text("hi")
    with pytest.raises(DatasetError, match="unsupported dataset format '.txt'"):
        run_job(job_config(tmp_path / "in.txt", job_model, tmp_path / "out"), engine=job_engine)


def test_config_values_are_validated():
    for bad, match in [
        (dict(mode="fast"), "unknown mode 'fast'; choose one of baseline, auto, chain"),
        (dict(draft_tokens=0), "draft_tokens must be an int in 1..16, got 0"),
        (dict(tau=2.0), "tau must be in"),
        (dict(rows_per_shard=-1), "rows_per_shard"),
        (dict(stop=[""]), "stop must be non-empty"),
    ]:
        with pytest.raises(ConfigError, match=match):
            JobConfig(dataset="d", model="m", output="o", **bad)


def test_auto_mode_writes_plain_decodings_rows_and_the_depths_it_chose(tmp_path, job_model, job_engine):
    """Mode auto, the default, chooses each step's drafts as it runs (the
    job's log says so); the rows equal plain batching's and record the
    depths chosen."""
    assert JobConfig.mode == "auto"
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(5))
    config = job_config(dataset, job_model, tmp_path / "auto", mode=JobConfig.mode, max_tokens=24)
    assert config.resolved().batch_size == DEFAULT_BATCH_SIZE
    log = io.StringIO()
    run_job(config, engine=job_engine, stream=log)
    assert "mode auto (0..3 drafts a step, chosen as it runs) | batch 32 |" in log.getvalue()
    run_job(job_config(dataset, job_model, tmp_path / "plain", mode="baseline", max_tokens=24), engine=job_engine)
    auto, plain = load_rows(tmp_path / "auto"), load_rows(tmp_path / "plain")
    assert {k: r["completion"] for k, r in auto.items()} == {k: r["completion"] for k, r in plain.items()}
    for r in auto.values():
        a = r["acceptance"]
        assert a["mode"] == "auto" and len(a["depths"]) == 4 and sum(a["depths"]) == a["steps"]
    assert json.loads((tmp_path / "auto" / "manifest.json").read_text())["config"]["mode"] == "auto"
    assert JobConfig(dataset="d", model="m", output="o", mode="tree").resolved().batch_size == 1
    assert JobConfig(dataset="d", model="m", output="o", batch_size=8).resolved().batch_size == 8


def test_a_verbose_job_logs_one_line_per_fast_path(tmp_path, job_model, job_engine):
    log = io.StringIO()
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", prompt_rows(1)), job_model, tmp_path / "out",
                       max_tokens=4, verbose=True), engine=job_engine, stream=log)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("fast path ")]
    names = [line.split()[2].rstrip(":") for line in lines]
    assert set(names) == {s.name for s in job_engine.fast_paths} and len(names) == len(set(names)) == len(job_engine.fast_paths) == 17


def test_a_finished_job_answers_without_loading_the_model(tmp_path, job_model, job_engine, capsys, monkeypatch):
    """Run again once every row is committed, the command reads the folder
    and the tokenizer only; anything left to do, or a changed setting, loads
    the model as usual."""
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(3))
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, max_tokens=4), engine=job_engine, stream=io.StringIO())
    loads = []
    real_load = MTPEngine.load
    monkeypatch.setattr(MTPEngine, "load", staticmethod(lambda *a, **kw: loads.append(a) or real_load(*a, **kw)))
    summary = run_job(job_config(dataset, job_model, out, max_tokens=4), stream=io.StringIO())
    assert loads == [] and summary.done == 3 and summary.committed == 0
    assert "nothing left to do" in capsys.readouterr().err
    write_jsonl(tmp_path / "in.jsonl", prompt_rows(4))  # one more row (and another dataset identity)
    summary = run_job(job_config(dataset, job_model, out, max_tokens=4, allow_dataset_change=True),
                      stream=io.StringIO())
    assert len(loads) == 1 and summary.committed == 1 and summary.done == 4


def test_batched_speculation_writes_the_rows_one_at_a_time_writes(tmp_path, job_model, job_engine):
    rows = prompt_rows(11) + [{"id": "short", "prompt": PROMPT_TEXTS[3], "max_tokens": 3}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    run_job(job_config(dataset, job_model, tmp_path / "single", batch_size=1), engine=job_engine)
    summary = run_job(job_config(dataset, job_model, tmp_path / "batched", batch_size=5, draft_tokens=3),
                      engine=job_engine)
    single, batched = load_rows(tmp_path / "single"), load_rows(tmp_path / "batched")
    assert single.keys() == batched.keys() and summary.done == 12
    for rid in single:
        for col in ("completion", "completion_tokens", "finish_reason", "prompt_tokens"):
            assert single[rid][col] == batched[rid][col], (rid, col)
        assert batched[rid]["acceptance"]["mode"] == "chain" and batched[rid]["acceptance"]["steps"] >= 1


def test_a_warm_up_is_logged_and_reported_as_the_jobs_first_use_cost(tmp_path, job_model, job_engine):
    """On a GPU a job meets its step shapes before the first row (here
    asked for on the CPU); the log says how long it took, the first shard's
    ledger entry records it and ``jobs status`` reports it. A second job of
    the same engine and settings meets nothing again."""
    job_engine.warmed.clear()  # another test's warm-up of these settings would leave nothing to meet
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(5))
    log = io.StringIO()
    run_job(job_config(dataset, job_model, tmp_path / "out", mode="auto", max_tokens=12, batch_size=4,
                       warm_up=True), engine=job_engine, stream=log)
    assert re.search(r"warm-up: 4 step shapes \(rows 4\) in \d+\.\d s", log.getvalue())  # widths 1..4 at B=4
    entries = read_all_ledgers(tmp_path / "out")
    assert entries[0].warmup_s > 0 and all(e.warmup_s == 0 for e in entries[1:])
    out = io.StringIO()
    assert print_status(tmp_path / "out", stream=out) == 0
    assert re.search(r"first use: \d+\.\d s warming up the decoder's step shapes \(\d+\.\d% of the work time\)",
                     out.getvalue())
    log = io.StringIO()  # a second job of the engine: its shapes were met, their costs measured
    run_job(job_config(dataset, job_model, tmp_path / "again", mode="auto", max_tokens=12, batch_size=4,
                       warm_up=True), engine=job_engine, stream=log)
    assert "warm-up: every step shape (rows 4) met earlier by this engine; its step costs reused" in log.getvalue()
    assert read_all_ledgers(tmp_path / "again")[0].warmup_s < entries[0].warmup_s
    log = io.StringIO()
    run_job(job_config(dataset, job_model, tmp_path / "cpu", max_tokens=12), engine=job_engine, stream=log)
    assert "warm-up" not in log.getvalue()  # the CPU's default: no first-use costs to meet
    out = io.StringIO()
    print_status(tmp_path / "cpu", stream=out)
    assert "first use: no warm-up recorded" in out.getvalue()


def test_rows_are_stored_in_input_order_within_each_commit(tmp_path, job_model, job_engine):
    """Rows finish out of order (a short row leaves the batch first); each
    shard stores its rows by input index, so one commit reads in order."""
    rows = [dict(r, max_tokens=12 - i) for i, r in enumerate(prompt_rows(10))]
    out = tmp_path / "out"
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, out, mode="baseline", batch_size=10,
                       rows_per_shard=256), engine=job_engine)
    assert datasets.load_from_disk(str(out))["index"] == list(range(10))


def test_jobs_run_takes_the_cli_settings_from_python(tmp_path, job_model, job_engine):
    import jobs
    from jobs.config import ConfigError

    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(3))
    (tmp_path / "job.json").write_text(json.dumps({"max_tokens": 9, "mode": "chain"}))
    summary = jobs.run(str(tmp_path / "job.json"), dataset=str(dataset), model=str(job_model),
                       output=str(tmp_path / "out"), max_tokens=5, engine=job_engine, stream=io.StringIO())
    assert summary.done == summary.committed == 3
    rows = datasets.load_from_disk(str(tmp_path / "out"))
    assert max(rows["completion_tokens"]) <= 5 and rows[0]["acceptance"]["mode"] == "chain"
    with pytest.raises(ConfigError, match="unknown key 'max_token'"):
        jobs.run(dataset=str(dataset), model=str(job_model), output=str(tmp_path / "o2"), max_token=5)


def test_a_chat_template_file_and_template_variables_render_chat_rows(tmp_path, job_model, job_engine):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}{% if shout %} LOUD{% endif %}] {{ m.content }}\n"
                        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    rows = [{"id": "c", "messages": [{"role": "user", "content": PROMPT_TEXTS[0]}]}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, max_tokens=4, chat_template=str(template),
                       chat_template_kwargs={"shout": True}), engine=job_engine, stream=io.StringIO())
    row = datasets.load_from_disk(str(out))[0]
    assert row["prompt"] == f"[user LOUD] {PROMPT_TEXTS[0]}\n[assistant]" and row["chat"]
    with pytest.raises(FingerprintMismatch, match="chat_template_kwargs"):  # another rendering: refused
        run_job(job_config(dataset, job_model, out, max_tokens=4, chat_template=str(template),
                           chat_template_kwargs={"shout": False}), engine=job_engine, stream=io.StringIO())
    template.write_text(template.read_text().replace("[assistant]", "[bot]"))
    with pytest.raises(FingerprintMismatch, match="chat_template_sha256"):
        run_job(job_config(dataset, job_model, out, max_tokens=4, chat_template=str(template),
                           chat_template_kwargs={"shout": True}), engine=job_engine, stream=io.StringIO())
    with pytest.raises(ConfigError, match="chat_template '.*absent.jinja' cannot be read"):
        run_job(job_config(dataset, job_model, tmp_path / "o2", chat_template=str(tmp_path / "absent.jinja")),
                engine=job_engine, stream=io.StringIO())


def completions(folder) -> dict:
    return {rid: (r["completion"], r["finish_reason"]) for rid, r in load_rows(folder).items()}


def test_rows_sharing_a_system_prompt_prefill_it_once_and_write_the_same_rows(tmp_path, job_model, job_engine,
                                                                               capsys):
    """Rows of two system prompts (chat rows and plain prompts): with prefix
    sharing the job writes the rows it writes without, in plain batching and
    batched speculation; the log and status say how many rows a prefix
    served; a budget too small for one prefix is a note, not an error; a
    resumed job rebuilds its prefixes."""
    from jobs.prefix_data import make_rows

    rows = make_rows(24, 120, (4, 12), prefixes=2, seed=3)
    rows += [{"id": f"chat-{i}", "messages": [{"role": "system", "content": rows[0]["prompt"].split("\n\n")[0]},
                                              {"role": "user", "content": f"question {i}"}]} for i in range(6)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    common = dict(max_tokens=6, rows_per_shard=4, prefix_min_tokens=64)
    for mode in ("baseline", "chain"):
        off = tmp_path / f"off-{mode}"
        run_job(job_config(dataset, job_model, off, mode=mode, prefix_sharing=False, **common), engine=job_engine,
                stream=io.StringIO())
        on, log = tmp_path / f"on-{mode}", io.StringIO()
        run_job(job_config(dataset, job_model, on, mode=mode, limit=10, **common), engine=job_engine, stream=log)
        run_job(job_config(dataset, job_model, on, mode=mode, **common), engine=job_engine, stream=log)  # resumed
        assert completions(on) == completions(off)
        lines = [line.split() for line in log.getvalue().splitlines() if line.startswith("prefixes: ")]
        served, made = [int(w[1]) for w in lines], [int(w[w.index("prefixes", 2) - 1]) for w in lines]
        # rows read ahead: each group's first row prefills its prefix, every other row starts from it
        assert made == [2, 3] and [s + m for s, m in zip(served, made)] == [10, 20], log.getvalue()
        print_status(on)
        assert "prefixes:  " in capsys.readouterr().out
    tiny, log = tmp_path / "tiny-budget", io.StringIO()
    run_job(job_config(dataset, job_model, tiny, prefix_cache_gb=1e-6, **common), engine=job_engine, stream=log)
    assert log.getvalue().count("over the prefix cache's") == 1 and completions(tiny) == completions(off)


def test_shared_prefix_rows_have_the_lengths_asked_for_in_tokens():
    from jobs.prefix_data import make_rows

    split = lambda text: sum(1 + len(w) // 3 for w in text.split())  # noqa: E731  (a tokenizer that splits words)
    rows = make_rows(8, 2048, (64, 256), seed=1, count=split)
    system = rows[0]["prompt"].split("\n\n")[0]
    assert all(r["prompt"].startswith(system + "\n\n") for r in rows)
    assert 2048 <= split(system) <= 2048 * 1.02  # "System prompt 0. " and the last word's tokens past it
    assert all(64 <= split(r["prompt"].split("\n\n")[1]) <= 256 * 1.1 for r in rows)


def test_input_columns_are_kept_as_text_and_a_resume_keeps_the_same(tmp_path, job_model, job_engine):
    rows = [{"id": "a", "prompt": PROMPT_TEXTS[0], "reference": "return a + b", "score": 3, "tags": ["x", "y"]},
            {"id": "b", "messages": [{"role": "user", "content": PROMPT_TEXTS[1]}], "reference": None},
            {"id": "c", "prompt": "", "reference": "kept on error rows too"}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, max_tokens=4, limit=2), engine=job_engine, stream=io.StringIO())
    run_job(job_config(dataset, job_model, out, max_tokens=4), engine=job_engine, stream=io.StringIO())
    got = load_rows(out)
    assert got["a"]["reference"] == "return a + b" and got["a"]["score"] == "3" and got["a"]["tags"] == '["x","y"]'
    assert json.loads(got["b"]["messages"]) == rows[1]["messages"] and got["a"]["messages"] is None
    assert got["c"]["finish_reason"] == "error" and got["c"]["reference"] == "kept on error rows too"
    assert json.loads((out / "manifest.json").read_text())["kept_columns"] == ["reference", "score", "tags", "messages"]
    only = tmp_path / "only"
    run_job(job_config(dataset, job_model, only, max_tokens=4, keep_columns="reference"), engine=job_engine,
            stream=io.StringIO())
    assert "score" not in datasets.load_from_disk(str(only)).column_names
    with pytest.raises(FingerprintMismatch, match="kept_columns"):  # other columns: another output layout
        run_job(job_config(dataset, job_model, only, max_tokens=4, keep_columns="none"), engine=job_engine)
    with pytest.raises(ConfigError, match="no row has a column 'answer'"):
        run_job(job_config(dataset, job_model, tmp_path / "x", keep_columns=["answer"]), engine=job_engine)
