"""Sampled jobs: n completions per prompt keyed (id, sample), seeds derived
from the job seed, the id and the sample, per-row overrides, the
fingerprint, folders of the older output schema, OpenAI batch files in and
out."""

from __future__ import annotations

import io
import json

import datasets
import orjson
import pytest

from jobs.cli import main as cli_main
from jobs.config import ConfigError
from jobs.output import FingerprintMismatch, OutputFolder
from jobs.prompts import completion_seed
from jobs.readers import PromptSource
from jobs.runner import build_manifest, run_job, scan_dataset
from jobs.status import print_status
from tests.jobs.conftest import PROMPT_TEXTS, job_config, write_jsonl


def rows_by_key(folder) -> dict:
    ds = datasets.load_from_disk(str(folder))
    keys = list(zip(ds["id"], ds["sample"]))
    assert len(keys) == len(set(keys)), "a (id, sample) twice"
    return {(r["id"], r["sample"]): r for r in ds}


def test_n_completions_per_prompt_with_derived_seeds(tmp_path, job_model, job_engine):
    rows = [{"id": f"p{i}", "prompt": t} for i, t in enumerate(PROMPT_TEXTS[:3])]
    out = tmp_path / "out"
    summary = run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, out, temperature=0.9, n=3,
                                 seed=42, batch_size=4), engine=job_engine)
    got = rows_by_key(out)
    assert summary.done == len(got) == 9
    for r in rows:
        completions = set()
        for j in range(3):
            row = got[(r["id"], j)]
            seed = completion_seed(42, r["id"], j)
            assert row["seed"] == seed and row["n"] == 3
            expected = job_engine.generate(r["prompt"], max_tokens=16, temperature=0.9, seed=seed, mode="chain")
            assert row["completion"] == expected.text
            completions.add(row["completion"])
        assert len(completions) > 1, "the samples of a prompt are all the same"


def test_per_row_sampling_overrides_are_validated(tmp_path, job_model, job_engine):
    rows = [
        {"id": "hot", "prompt": PROMPT_TEXTS[0], "temperature": 1.2, "top_k": 5, "n": 2},
        {"id": "seeded", "prompt": PROMPT_TEXTS[1], "temperature": 0.7, "seed": 7},
        {"id": "greedy", "prompt": PROMPT_TEXTS[2]},
        {"id": "bad-temperature", "prompt": "hi", "temperature": -0.5},
        {"id": "bad-top-p", "prompt": "hi", "temperature": 1.0, "top_p": 1.5},
        {"id": "bad-n", "prompt": "hi", "temperature": 1.0, "n": 0},
        {"id": "greedy-n", "prompt": "hi", "n": 3},
        {"id": "bad-seed", "prompt": "hi", "temperature": 1.0, "seed": "seven"},
    ]
    out = tmp_path / "out"
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, out), engine=job_engine)
    got = rows_by_key(out)
    assert sorted(k for k in got if k[0] == "hot") == [("hot", 0), ("hot", 1)]
    hot = job_engine.generate(PROMPT_TEXTS[0], max_tokens=16, temperature=1.2, top_k=5,
                              seed=completion_seed(0, "hot", 1), mode="chain")
    assert got[("hot", 1)]["completion"] == hot.text
    seeded = job_engine.generate(PROMPT_TEXTS[1], max_tokens=16, temperature=0.7, seed=completion_seed(7, "seeded", 0))
    assert got[("seeded", 0)]["completion"] == seeded.text
    assert got[("greedy", 0)]["seed"] == completion_seed(0, "greedy", 0)  # carried though greedy decoding ignores it
    assert got[("bad-n", 0)]["seed"] == completion_seed(0, "bad-n", 0)
    frame = datasets.load_from_disk(str(out)).to_pandas()
    assert str(frame["seed"].dtype) == "int64" and set(frame["seed"]) == {r["seed"] for r in got.values()}
    assert got[("greedy", 0)]["completion"] == job_engine.generate(PROMPT_TEXTS[2], max_tokens=16).text
    errors = {k[0]: r["error"] for k, r in got.items() if r["finish_reason"] == "error"}
    assert errors == {
        "bad-temperature": "invalid_field: temperature must be a finite number >= 0, got -0.5",
        "bad-top-p": "invalid_field: top_p must be in (0, 1], got 1.5",
        "bad-n": "invalid_field: n must be an integer in 1..256, got 0",
        "greedy-n": "invalid_field: n = 3 with temperature 0 would repeat one greedy completion; set a temperature "
                    "above 0",
        "bad-seed": "invalid_field: seed must be an int in 0..2**63-1, got 'seven'",
    }
    # An error row is one row, sample 0, whatever n the row asked for.
    assert ("bad-n", 1) not in got


def test_the_fingerprint_covers_sampling(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPT_TEXTS[0]}])
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, temperature=0.8, n=2), engine=job_engine)
    for change in (dict(temperature=0.9), dict(n=3), dict(seed=1), dict(top_p=0.5), dict(sampler="rejection")):
        settings = {"temperature": 0.8, "n": 2, **change}
        with pytest.raises(FingerprintMismatch, match="decoding.sampling"):
            run_job(job_config(dataset, job_model, out, **settings), engine=job_engine)
    # The exact sampler's rows do not depend on the mode, K or batch size.
    run_job(job_config(dataset, job_model, out, temperature=0.8, n=2, mode="baseline", batch_size=1),
            engine=job_engine, stream=io.StringIO())
    # The rejection sampler's depend on the mode and K.
    rej = tmp_path / "rejection"
    run_job(job_config(dataset, job_model, rej, temperature=0.8, sampler="rejection", draft_tokens=3),
            engine=job_engine)
    with pytest.raises(FingerprintMismatch, match="draft_tokens"):
        run_job(job_config(dataset, job_model, rej, temperature=0.8, sampler="rejection", draft_tokens=2),
                engine=job_engine)
    run_job(job_config(dataset, job_model, rej, temperature=0.8, sampler="rejection", draft_tokens=3, batch_size=1),
            engine=job_engine)


def test_sampling_config_is_validated():
    base = dict(dataset="d", model="m", output="o")
    with pytest.raises(ConfigError, match="n = 4 with temperature 0"):
        job_config("d", "m", "o", n=4)
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0, got -1"):
        job_config("d", "m", "o", temperature=-1)
    with pytest.raises(ConfigError, match="sampler 'rejection' drafts chains; mode 'tree'"):
        job_config("d", "m", "o", temperature=1.0, sampler="rejection", mode="tree")
    with pytest.raises(SystemExit):
        cli_main(["generate", *[f"--{k}={v}" for k, v in base.items()], "--sampler", "gumbel"])


def _schema1_folder(tmp_path, job_model, job_engine, dataset):
    """A folder as the previous release wrote it: manifest, shards and
    dataset_info of output schema 1 (no sample, n, seed or chat columns)."""
    config = job_config(dataset, job_model, tmp_path / "old")
    source = PromptSource(str(dataset))
    manifest = build_manifest(config.resolved(), job_engine.tokenizer, source, scan_dataset(source, config.resolved()), 1, schema_version=1)
    folder = OutputFolder(tmp_path / "old")
    folder.open(manifest, overwrite=False)
    result = job_engine.generate(PROMPT_TEXTS[0], max_tokens=16, mode="chain", draft_tokens=3)
    from schemas.arrow import completion_row

    folder.commit([completion_row(id="a", index=0, line=1, prompt=PROMPT_TEXTS[0], result=result)], wall_s=0.1)
    folder.close()
    return tmp_path / "old"


def test_a_folder_of_the_older_schema_resumes_greedy_and_refuses_sampling(tmp_path, job_model, job_engine):
    rows = [{"id": "a", "prompt": PROMPT_TEXTS[0]}, {"id": "b", "prompt": PROMPT_TEXTS[1]},
            {"id": "c", "prompt": PROMPT_TEXTS[2], "temperature": 0.8}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    old = _schema1_folder(tmp_path, job_model, job_engine, dataset)
    with pytest.raises(ConfigError, match="older release .output schema 1"):
        run_job(job_config(dataset, job_model, old, temperature=0.7), engine=job_engine)
    run_job(job_config(dataset, job_model, old), engine=job_engine)
    ds = datasets.load_from_disk(str(old))
    assert "sample" not in ds.column_names and sorted(ds["id"]) == ["a", "b", "c"]
    rows_out = {r["id"]: r for r in ds}
    assert rows_out["b"]["completion"] == job_engine.generate(PROMPT_TEXTS[1], max_tokens=16).text
    assert rows_out["c"]["error"].startswith("invalid_field: this output folder was written by an older release")
    assert orjson.loads((old / "manifest.json").read_bytes())["schema_version"] == 1


def test_a_folder_of_schema_2_resumes_sampled_jobs_without_the_depths_column(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPT_TEXTS[0]},
                                                  {"id": "b", "prompt": PROMPT_TEXTS[1]}])
    config = job_config(dataset, job_model, tmp_path / "v2", temperature=0.7, mode="auto")
    source = PromptSource(str(dataset))
    folder = OutputFolder(tmp_path / "v2")
    folder.open(build_manifest(config.resolved(), job_engine.tokenizer, source, scan_dataset(source, config.resolved()), 1, schema_version=2),
                overwrite=False)
    folder.close()
    run_job(config, engine=job_engine)
    ds = datasets.load_from_disk(str(tmp_path / "v2"))
    assert sorted(ds["id"]) == ["a", "b"] and "depths" not in ds.features["acceptance"]
    assert orjson.loads((tmp_path / "v2" / "manifest.json").read_bytes())["schema_version"] == 2
    run_job(job_config(dataset, job_model, tmp_path / "v3", temperature=0.7, mode="auto"), engine=job_engine)
    v3 = {r["id"]: r for r in datasets.load_from_disk(str(tmp_path / "v3"))}
    assert {r["id"]: r["completion"] for r in ds} == {k: r["completion"] for k, r in v3.items()}
    assert all(sum(r["acceptance"]["depths"]) == r["acceptance"]["steps"] for r in v3.values())


def openai_lines() -> list[dict]:
    return [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": PROMPT_TEXTS[0]}],
                  "max_completion_tokens": 8, "temperature": 0.9, "n": 2, "seed": 3, "logprobs": True}},
        {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o-mini", "prompt": PROMPT_TEXTS[1], "max_tokens": 6, "stop": ["\n\n"],
                  "logprobs": 2}},
        {"custom_id": "chat-parts", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT_TEXTS[2]}]}]}},
        {"custom_id": "bad-method", "method": "GET", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": "image", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
    ]


def test_openai_batch_file_in_and_out(tmp_path, job_model, job_engine):
    dataset = write_jsonl(tmp_path / "batch.jsonl", openai_lines())
    out, log = tmp_path / "out", io.StringIO()
    run_job(job_config(dataset, job_model, out), engine=job_engine, stream=log)
    text = log.getvalue()
    # Fields not honoured are named once each, however many lines carry them.
    assert "'logprobs' is ignored" not in text and text.count("'model' is ignored") == 1
    got = rows_by_key(out)
    assert sorted(got) == [("bad-method", 0), ("chat-1", 0), ("chat-1", 1), ("chat-parts", 0), ("image", 0),
                           ("text-1", 0)]
    chat_prompt = job_engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_TEXTS[0]}],
                                                           add_generation_prompt=True, tokenize=False)
    expected = job_engine.generate(chat_prompt, max_tokens=8, temperature=0.9, seed=completion_seed(3, "chat-1", 1))
    assert got[("chat-1", 1)]["completion"] == expected.text and got[("chat-1", 1)]["chat"] is True
    assert got[("text-1", 0)]["completion"] == job_engine.generate(PROMPT_TEXTS[1], max_tokens=6, stop="\n\n").text
    assert got[("bad-method", 0)]["error"] == "invalid_request: method must be 'POST', got 'GET'"
    assert got[("image", 0)]["error"].startswith("invalid_request: message 0 has a 'image_url' content part")

    status = io.StringIO()
    print_status(out, stream=status)  # one line asks for n = 2: completions and prompts counted apart
    assert "rows:      6/6 completions done (100.0%) of 5 prompts" in status.getvalue()

    export = tmp_path / "results.jsonl"
    assert cli_main(["export", str(out), "--format", "openai-batch", "--output", str(export)]) == 0
    lines = {line["custom_id"]: line for line in map(json.loads, export.read_text().splitlines())}
    assert list(lines) == ["chat-1", "text-1", "chat-parts", "bad-method", "image"]  # input order
    chat = lines["chat-1"]["response"]
    assert chat["status_code"] == 200 and lines["chat-1"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == job_model.name
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][1]["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["completion_tokens"] == sum(got[("chat-1", j)]["completion_tokens"] for j in (0, 1))
    assert lines["text-1"]["response"]["body"]["object"] == "text_completion"
    assert "text" in lines["text-1"]["response"]["body"]["choices"][0]
    assert lines["bad-method"]["response"] is None
    assert lines["bad-method"]["error"] == {"code": "invalid_request", "message": "method must be 'POST', got 'GET'"}


def test_export_writes_parquet_and_jsonl_in_input_order_that_common_readers_open(tmp_path, job_model, job_engine,
                                                                                capsys):
    rows = [{"id": f"p{i}", "prompt": PROMPT_TEXTS[i % len(PROMPT_TEXTS)], "n": 1 + i % 2} for i in range(6)]
    out = tmp_path / "out"
    run_job(job_config(write_jsonl(tmp_path / "in.jsonl", rows), job_model, out, temperature=0.8, max_tokens=6,
                       rows_per_shard=2), engine=job_engine)
    stored = datasets.load_from_disk(str(out)).to_pandas()
    order = [(r["id"], r["sample"]) for r in rows_by_key(out).values()]  # 9 completions of 6 prompts
    expected = sorted(order, key=lambda k: (int(k[0][1:]), k[1]))
    capsys.readouterr()
    assert cli_main(["export", str(out), "--format", "parquet", "--output", str(tmp_path / "all.parquet")]) == 0
    assert cli_main(["export", str(out), "--format", "jsonl", "--output", str(tmp_path / "all.jsonl")]) == 0
    assert capsys.readouterr().err.splitlines() == [f"exported 9 rows -> {tmp_path / 'all.parquet'}",
                                                    f"exported 9 rows -> {tmp_path / 'all.jsonl'}"]
    import pandas as pd
    import pyarrow.dataset

    frame = pd.read_parquet(tmp_path / "all.parquet")
    assert list(zip(frame["id"], frame["sample"])) == expected
    assert str(frame["seed"].dtype) == "int64"
    by_key = stored.set_index(["id", "sample"])
    assert all(frame["completion"] == [by_key.loc[k, "completion"] for k in expected])
    assert pyarrow.dataset.dataset(str(tmp_path / "all.parquet")).to_table().num_rows == 9
    polars = pytest.importorskip("polars")  # installed by .ci/run; not a dependency of the runner
    duckdb = pytest.importorskip("duckdb")
    assert polars.read_parquet(tmp_path / "all.parquet")["id"].to_list() == [k[0] for k in expected]
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path / 'all.parquet'}'").fetchall() == [(9,)]
    lines = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in lines] == expected
    assert lines[0]["acceptance"]["mode"] == frame["acceptance"][0]["mode"]
    with pytest.raises(SystemExit, match="2"):  # argparse names the formats
        cli_main(["export", str(out), "--format", "csv", "--output", str(tmp_path / "x.csv")])


def test_export_refuses_to_write_inside_the_job_folder(tmp_path, job_model, job_engine, capsys):
    """An export over the folder's own ledger would cut it on the next
    resume (every row redone): any path inside the folder is refused and
    the folder stays whole."""
    dataset = write_jsonl(tmp_path / "batch.jsonl", openai_lines())
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out), engine=job_engine)
    ledger = out / "ledger-r000.jsonl"
    before = ledger.read_bytes()
    for target in (ledger, out / "export.jsonl", out / "sub" / "x.jsonl"):
        assert cli_main(["export", str(out), "--format", "openai-batch", "--output", str(target)]) == 1
        assert "is inside the job folder" in capsys.readouterr().err
    assert ledger.read_bytes() == before and not (out / "export.jsonl").exists()
    summary = run_job(job_config(dataset, job_model, out), engine=job_engine)
    assert summary.committed == 0 and len(rows_by_key(out)) == 6  # nothing redone


def test_penalties_from_the_job_and_from_rows_are_applied_in_every_mode(tmp_path, job_model, job_engine):
    """A job's --presence-penalty, and an OpenAI batch body's
    frequency_penalty, give the engine's plain decoding with those
    penalties, in the chain mode as in plain batching; the fingerprint
    covers the job's."""
    rows = [{"id": "job", "prompt": PROMPT_TEXTS[6]},  # a prompt whose plain completion repeats a token
            {"custom_id": "body", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": PROMPT_TEXTS[5], "frequency_penalty": 1.5}}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    want = {("job", 0): job_engine.generate(PROMPT_TEXTS[6], max_tokens=16, mode="baseline", presence_penalty=1.2),
            ("body", 0): job_engine.generate(PROMPT_TEXTS[5], max_tokens=16, mode="baseline", presence_penalty=1.2,
                                             frequency_penalty=1.5)}
    assert want[("job", 0)].tokens != job_engine.generate(PROMPT_TEXTS[6], max_tokens=16, mode="baseline").tokens
    for mode in ("baseline", "chain"):
        out = tmp_path / mode
        run_job(job_config(dataset, job_model, out, mode=mode, presence_penalty=1.2), engine=job_engine)
        got = rows_by_key(out)
        assert {k: r["completion"] for k, r in got.items()} == {k: r.text for k, r in want.items()}
    with pytest.raises(FingerprintMismatch, match="presence_penalty"):
        run_job(job_config(dataset, job_model, tmp_path / "chain", presence_penalty=0.5), engine=job_engine)


def test_logprobs_are_stored_per_token_and_exported_in_the_openai_shape(tmp_path, job_model, job_engine):
    """--logprobs 2 stores each token's id, log-probability and 2
    alternatives, equal (within 1e-4) to the engine's plain decoding in
    every mode; an OpenAI chat body's logprobs/top_logprobs and a
    completions body's logprobs come back in the API's shapes."""
    rows = [{"id": "plain", "prompt": PROMPT_TEXTS[0]}, {"id": "own", "prompt": PROMPT_TEXTS[1], "logprobs": 0},
            {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": PROMPT_TEXTS[2]}], "logprobs": True,
                      "top_logprobs": 1}}]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    want = job_engine.generate(PROMPT_TEXTS[0], max_tokens=16, mode="baseline", logprobs=2)
    for mode in ("baseline", "chain", "auto"):
        out = tmp_path / mode
        run_job(job_config(dataset, job_model, out, mode=mode, logprobs=2), engine=job_engine)
        got = rows_by_key(out)
        plain = got[("plain", 0)]
        assert plain["token_ids"] == want.tokens and len(plain["logprobs"]) == len(want.tokens)
        assert all(abs(a - b) < 1e-4 for a, (b, _) in zip(plain["logprobs"], want.logprobs))
        assert [[a["token"] for a in top] for top in plain["top_logprobs"]] == \
            [[t for t, _ in alts] for _, alts in want.logprobs]
        assert all(top == [] for top in got[("own", 0)]["top_logprobs"])  # the row's own logprobs: 0
        assert all(len(top) <= 1 for top in got[("chat", 0)]["top_logprobs"])
    export = tmp_path / "batch.jsonl"
    assert cli_main(["export", str(tmp_path / "chain"), "--format", "openai-batch", "--output", str(export)]) == 0
    lines = {line["custom_id"]: line for line in map(json.loads, export.read_text().splitlines())}
    content = lines["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content and {"token", "logprob", "bytes", "top_logprobs"} <= content[0].keys()
    assert "".join(c["token"] for c in content) == lines["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    text = lines["plain"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(text["tokens"]) == len(text["token_logprobs"]) == len(want.tokens) and len(text["top_logprobs"][0]) == 2
    with pytest.raises(FingerprintMismatch, match="logprobs"):
        run_job(job_config(dataset, job_model, tmp_path / "chain", mode="chain", logprobs=3), engine=job_engine)
