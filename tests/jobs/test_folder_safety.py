"""Job folders that cannot be corrupted: fault injection (in the tests, never
in the runner) at every write of a commit, damaged ledgers and shards, two
jobs on one folder, kills during a first run, unsafe merges, colliding ids,
another dataset, empty datasets, and OS errors. Each case ends in
exactly-once output by id equal to an uninterrupted run's, or in one clear
refusal with nothing lost."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

from jobs import output as output_module
from jobs.cli import main
from jobs.ledger import Ledger
from jobs.lock import FolderInUse, FolderLock
from jobs.merge import MergeError, merge
from jobs.output import DatasetChanged, OutputError, read_all_ledgers
from jobs.repair import repair
from jobs.runner import run_job
from tests.jobs.conftest import job_config, prompt_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("crash_driver.py")
ROWS = prompt_rows(8)


def settings(**overrides) -> dict:
    return {"max_tokens": 8, "rows_per_shard": 2, **overrides}


def rows_by_id(folder: Path) -> dict:
    ds = datasets.load_from_disk(str(folder))
    ids = ds["id"]
    assert len(ids) == len(set(ids)), "duplicated ids"
    return {r["id"]: (r["completion"], r["finish_reason"]) for r in ds}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "in.jsonl", ROWS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset, job_model, job_engine) -> dict:
    out = tmp_path_factory.mktemp("ref") / "out"
    run_job(job_config(dataset, job_model, out, **settings()), engine=job_engine)
    return rows_by_id(out)


def run(dataset, job_model, job_engine, out, **overrides):
    return run_job(job_config(dataset, job_model, out, **settings(**overrides)), engine=job_engine,
                   stream=open(os.devnull, "w"))


# -- faults during a commit ---------------------------------------------------


class FaultyFile:
    """A file whose n-th write writes half its bytes, then fails with ENOSPC."""

    def __init__(self, f, plan):
        self._f, self._plan = f, plan

    def write(self, data):
        self._plan["writes"] += 1
        if self._plan["writes"] in self._plan["fail_at"]:
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def inject(monkeypatch, target: str, fail_at: set[int]) -> dict:
    """Make writes to files whose name contains ``target`` fail (see FaultyFile)."""
    plan = {"writes": 0, "fail_at": fail_at}

    def faulty_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return FaultyFile(f, plan) if target in str(path) and ("w" in mode or "a" in mode) else f

    for module in (output_module, sys.modules["jobs.ledger"]):
        monkeypatch.setattr(module, "open", faulty_open, raising=False)
    return plan


@pytest.mark.parametrize("target", [".tmp-data-r000", "ledger-r000", ".tmp-state.json"])
def test_a_short_write_on_a_full_disk_is_retried_once_space_is_back(
        tmp_path, dataset, job_model, job_engine, reference, monkeypatch, target):
    plan = inject(monkeypatch, target, fail_at={2})  # the second write to that file fails part-way
    run(dataset, job_model, job_engine, tmp_path / "out")
    assert plan["writes"] > 2
    assert rows_by_id(tmp_path / "out") == reference
    for ledger in Ledger(tmp_path / "out" / "ledger-r000.jsonl"), :
        state = ledger.read()
        assert state.tail == 0 and state.corrupt_line is None  # the half line was rolled back


@pytest.mark.parametrize("target", [".tmp-data-r000", "ledger-r000", ".tmp-manifest.json"])
def test_a_disk_that_stays_full_fails_with_one_line_and_the_resume_completes(
        tmp_path, dataset, job_model, job_engine, reference, monkeypatch, target):
    inject(monkeypatch, target, fail_at=set(range(3, 100)))
    out = tmp_path / "out"
    with pytest.raises(OutputError) as info:
        run(dataset, job_model, job_engine, out)
    message = str(info.value)
    assert "No space left on device" in message and "free some space" in message and "\n" not in message
    monkeypatch.undo()
    committed = rows_by_id(out)
    assert all(committed[rid] == reference[rid] for rid in committed)  # nothing committed was touched
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference


# -- damaged ledgers --------------------------------------------------------------


@pytest.mark.parametrize("tail", [b'{"shard": "data-r000-0000', b"garbage that ends in a newline\n", b"{}\n"])
def test_a_torn_or_garbage_ledger_tail_is_cut_on_resume(tmp_path, dataset, job_model, job_engine, reference, tail):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=4)
    with open(out / "ledger-r000.jsonl", "ab") as f:
        f.write(tail)
    assert main(["status", str(out)]) == 1  # the tail is reported
    run(dataset, job_model, job_engine, out)
    run(dataset, job_model, job_engine, out)  # and again: nothing left to repair
    assert rows_by_id(out) == reference
    assert main(["status", str(out)]) == 0


def test_a_repeated_ledger_line_is_dropped_not_taken_for_a_repeating_shard(
        tmp_path, dataset, job_model, job_engine, reference, capsys):
    """A ledger line written twice lists one shard twice: status reports it,
    a resume drops the repeat and keeps the shard (no quarantine, no row
    redone or lost), and the folder loads throughout."""
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=4)
    path = out / "ledger-r000.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:1] + lines[:1] + lines[1:]))
    assert main(["status", str(out)]) == 1
    assert "listed twice" in capsys.readouterr().out
    assert len(rows_by_id(out)) == 4
    summary = run(dataset, job_model, job_engine, out)
    assert summary.committed == len(reference) - 4  # the 4 rows were kept, not redone
    assert rows_by_id(out) == reference and not (out / "quarantine").exists()
    assert main(["status", str(out)]) == 0 and len(path.read_bytes().splitlines()) == len(read_all_ledgers(out))


def _garble_second_ledger_line(out: Path) -> None:
    path = out / "ledger-r000.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"not json at all"
    path.write_bytes(b"\n".join(lines))


def test_a_ledger_damaged_in_the_middle_is_refused_then_rebuilt_by_repair(
        tmp_path, dataset, job_model, job_engine, reference, capsys):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out)
    _garble_second_ledger_line(out)
    with pytest.raises(OutputError, match=r"ledger-r000.jsonl is corrupt at line 2 .*python -m jobs repair"):
        run(dataset, job_model, job_engine, out)
    assert main(["status", str(out)]) == 1
    assert "corrupt at line 2" in capsys.readouterr().err
    assert main(["merge", str(out), "--output", str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt at line 2" in err[0] and not (tmp_path / "merged").exists()
    assert main(["repair", str(out)]) == 0
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference


@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_ledger_line_edited_into_other_valid_json_is_caught_by_its_checksum(
        tmp_path, dataset, job_model, job_engine, reference, where, capsys):
    """An edited line still parses as an entry (its shard exists, its counts
    are plausible); only the line's own CRC-32 tells. In the middle: refused
    until repair; as the last line: cut, and its rows come back exactly once."""
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out)
    path = out / "ledger-r000.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    i = 1 if where == "middle" else len(lines) - 1
    edited = lines[i].replace(b'"completion_tokens":', b'"completion_tokens":1')
    assert edited != lines[i] and json.loads(edited)["shard"]  # other valid JSON, same shard
    lines[i] = edited
    path.write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(["status", str(out)]) == 1
    said = capsys.readouterr()
    assert ("checksum does not match" if where == "middle" else "after its last valid line") in said.out + said.err
    if where == "middle":
        with pytest.raises(OutputError, match=rf"corrupt at line {i + 1} .*checksum does not match"):
            run(dataset, job_model, job_engine, out)
        assert main(["repair", str(out)]) == 0
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference
    assert main(["status", str(out), "--verify"]) == 0


# -- damaged shards -----------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "deleted":
        path.unlink()
    elif how == "bit-flipped":  # same size: only the checksum sees it
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    else:  # overwritten with another shard's bytes
        path.write_bytes((path.parent / "data-r000-00000.arrow").read_bytes())


@pytest.mark.parametrize("how", ["truncated", "deleted", "bit-flipped", "overwritten"])
def test_a_damaged_shard_is_quarantined_and_its_rows_redone(tmp_path, dataset, job_model, job_engine, reference, how,
                                                            capsys):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out)
    _damage(out / "data-r000-00002.arrow", how)
    capsys.readouterr()
    assert main(["status", str(out), "--verify"]) == 1
    assert "damaged: shard data-r000-00002.arrow" in capsys.readouterr().out
    log = []
    run_job(job_config(dataset, job_model, out, **settings()), engine=job_engine,
            stream=type("S", (), {"write": lambda self, m: log.append(m), "flush": lambda self: None,
                                  "isatty": lambda self: False})())
    assert any("shard data-r000-00002.arrow failed its check" in m for m in log)
    assert rows_by_id(out) == reference
    assert main(["status", str(out), "--verify"]) == 0
    if how != "deleted":
        assert list((out / "quarantine").iterdir())


# -- two jobs, kills -----------------------------------------------------------------


def _cmd(dataset, model, out, *extra) -> list[str]:
    return [sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--model", str(model),
            "--output", str(out), "--max-tokens", "8", "--rows-per-shard", "2", *extra]


def test_a_second_job_on_the_folder_is_refused_naming_the_holder(tmp_path, job_model, job_engine):
    many = write_jsonl(tmp_path / "many.jsonl", prompt_rows(400))
    out = tmp_path / "out"
    slow = ("--mode", "tree")  # one row at a time: the job outlasts the second command
    first = subprocess.Popen(_cmd(many, job_model, out, *slow), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "state.json").exists():
            time.sleep(0.05)
        second = subprocess.run(_cmd(many, job_model, out, *slow), cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 1
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and f"pid {first.pid} on host" in error and "in use by another job" in error
        with pytest.raises(FolderInUse):  # in-process too
            run(many, job_model, job_engine, out, mode="tree")
        first.send_signal(signal.SIGKILL)  # the OS releases the lock with the process
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    run(many, job_model, job_engine, out, mode="tree", limit=10)
    done = rows_by_id(out)
    assert len(done) == len(set(done)) >= 10


@pytest.mark.parametrize("step", ["atomic_written:1", "atomic_written:2", "atomic_written:3",
                                  "shard_tmp_written:1", "shard_renamed:1"])
def test_a_kill_at_each_step_of_a_first_run_leaves_a_folder_the_same_command_resumes(
        tmp_path, dataset, job_model, reference, step):
    out = tmp_path / "out"
    name, _, n = step.partition(":")
    killed = subprocess.run([sys.executable, str(DRIVER), name, n, "--", *_cmd(dataset, job_model, out)[3:]],
                            cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = subprocess.run(_cmd(dataset, job_model, out), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert rows_by_id(out) == reference


# -- merge ----------------------------------------------------------------------------


def _two_halves(tmp_path, dataset, job_model, job_engine) -> tuple[Path, Path]:
    """Two folders of one job configuration written from the two halves of
    the rows (as two machines without a shared filesystem would)."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(write_jsonl(tmp_path / "a.jsonl", ROWS[:4]), job_model, job_engine, a)
    run(write_jsonl(tmp_path / "b.jsonl", ROWS[4:]), job_model, job_engine, b)
    return a, b


def test_merge_output_under_a_regular_file_is_one_error_line(tmp_path, dataset, job_model, job_engine, capsys):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=2)
    (tmp_path / "file").write_text("x")
    assert main(["merge", str(out), "--output", str(tmp_path / "file" / "merged")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "file" in err and "Traceback" not in err


def test_merge_refuses_a_ledger_entry_that_escapes_its_folder(tmp_path, dataset, job_model, job_engine):
    a, b = _two_halves(tmp_path, dataset, job_model, job_engine)
    secret = tmp_path / "private.txt"
    secret.write_text("not yours")
    ledger = Ledger(b / "ledger-r000.jsonl")
    entries = ledger.read().entries
    entries[0].shard = "../private.txt"
    ledger.rewrite(entries)
    with pytest.raises(MergeError, match="'../private.txt' is damaged .*not a shard of this folder"):
        merge([a, b], tmp_path / "merged", log=lambda m: None)
    assert not (tmp_path / "merged").exists()
    assert not [p for p in tmp_path.iterdir() if ".merging-" in p.name]


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_merge_checks_every_shard_before_writing(tmp_path, dataset, job_model, job_engine, reference, how):
    a, b = _two_halves(tmp_path, dataset, job_model, job_engine)
    shard = read_all_ledgers(b)[0].shard
    _damage(b / shard, how)
    code = main(["merge", str(a), str(b), "--output", str(tmp_path / "merged")])
    assert code == 1 and not (tmp_path / "merged").exists()
    run(tmp_path / "b.jsonl", job_model, job_engine, b)  # the resume repairs b
    assert main(["merge", str(a), str(b), "--output", str(tmp_path / "merged")]) == 0
    assert rows_by_id(tmp_path / "merged") == reference


# -- kills and full disks during merge, repair and export ------------------------------


def _kill_at(step: str, *argv: str) -> None:
    """Run ``python -m jobs ARGV`` and SIGKILL it at ``step`` (crash_driver.py)."""
    name, _, n = step.partition(":")
    killed = subprocess.run([sys.executable, str(DRIVER), name, n, "--", *argv], cwd=ROOT, capture_output=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def _files(*folders: Path) -> dict:
    """Every file's bytes but the lock's (which names its last holder)."""
    return {p: p.read_bytes() for folder in folders for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("step", ["ledger_rewritten:2", "rename_before:1"])
def test_a_killed_merge_leaves_no_output_and_the_next_merge_completes(
        tmp_path, dataset, job_model, job_engine, reference, step):
    a, b = _two_halves(tmp_path, dataset, job_model, job_engine)
    inputs = _files(a, b)
    merged = tmp_path / "merged"
    _kill_at(step, "merge", str(a), str(b), "--output", str(merged))
    assert not merged.exists() and _files(a, b) == inputs
    assert main(["merge", str(a), str(b), "--output", str(merged)]) == 0
    assert rows_by_id(merged) == reference
    assert not [p for p in tmp_path.iterdir() if ".merging-" in p.name]  # the killed merge's staging is gone


@pytest.mark.parametrize("step", ["replace_before:1", "replace_before:2"])
def test_a_killed_repair_is_finished_by_the_next_one(tmp_path, dataset, job_model, job_engine, reference, step):
    """Killed before it quarantines a damaged shard, or before its rebuilt
    ledger replaces the old one: the next repair and a resume give the
    uninterrupted job's rows."""
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out)
    _garble_second_ledger_line(out)
    _damage(out / "data-r000-00002.arrow", "truncated")
    _kill_at(step, "repair", str(out))
    assert main(["repair", str(out)]) == 0
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference
    assert main(["status", str(out), "--verify"]) == 0


def test_a_killed_export_leaves_the_previous_file_and_the_folder_untouched(
        tmp_path, dataset, job_model, job_engine):
    out, target = tmp_path / "out", tmp_path / "results.jsonl"
    run(dataset, job_model, job_engine, out, limit=4)
    assert main(["export", str(out), "--format", "jsonl", "--output", str(target)]) == 0
    previous = target.read_bytes()
    run(dataset, job_model, job_engine, out)
    folder = _files(out)
    _kill_at("replace_before:1", "export", str(out), "--format", "jsonl", "--output", str(target))
    assert target.read_bytes() == previous and _files(out) == folder
    assert main(["export", str(out), "--format", "jsonl", "--output", str(target)]) == 0
    assert len(target.read_bytes().splitlines()) == len(ROWS)
    assert sorted(p.name for p in tmp_path.iterdir() if "results" in p.name) == ["results.jsonl"]


def test_a_full_disk_during_export_merge_or_repair_is_one_error_line_and_changes_nothing(
        tmp_path, dataset, job_model, job_engine, reference, monkeypatch, capsys):
    out, target = tmp_path / "out", tmp_path / "results.jsonl"
    run(dataset, job_model, job_engine, out, limit=4)
    assert main(["export", str(out), "--format", "jsonl", "--output", str(target)]) == 0
    previous = target.read_bytes()
    run(dataset, job_model, job_engine, out)
    a, b = _two_halves(tmp_path, dataset, job_model, job_engine)
    before = _files(out, a, b)
    capsys.readouterr()

    import jobs.export
    full = {"writes": 0, "fail_at": {1}}
    monkeypatch.setattr(jobs.export, "open",
                        lambda p, mode="r", *args, **kw: FaultyFile(builtins.open(p, mode, *args, **kw), full),
                        raising=False)
    assert main(["export", str(out), "--format", "jsonl", "--output", str(target)]) == 1
    monkeypatch.undo()

    copies = []

    def copy_until_full(src, dst, *args, **kwargs):
        if copies:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(dst))
        copies.append(dst)
        return shutil.copyfile(src, dst, *args, **kwargs)

    import jobs.merge
    monkeypatch.setattr(jobs.merge, "shutil", type("S", (), {"copyfile": staticmethod(copy_until_full),
                                                              "rmtree": staticmethod(shutil.rmtree)}))
    assert main(["merge", str(a), str(b), "--output", str(tmp_path / "merged")]) == 1
    monkeypatch.undo()

    inject(monkeypatch, ".tmp-ledger-r000", {1})
    assert main(["repair", str(out)]) == 1
    monkeypatch.undo()

    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") and "No space left" in line for line in err), err
    assert target.read_bytes() == previous and _files(out, a, b) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.jsonl", "b", "b.jsonl", "out", "results.jsonl"]
    assert main(["merge", str(a), str(b), "--output", str(tmp_path / "merged")]) == 0
    assert rows_by_id(tmp_path / "merged") == reference


# -- a chat template that loops ---------------------------------------------------------

LOOPING_TEMPLATE = (
    "{% for m in messages %}{% if 'LOOP' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory, job_model) -> Path:
    """The test model with a chat template that loops ~1e10 times on any
    message containing LOOP (minutes to hours per row)."""
    model = tmp_path_factory.mktemp("looping") / "model"
    shutil.copytree(job_model, model)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = LOOPING_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return model


def _chat(i: int, loop: bool) -> dict:
    return {"id": f"chat-{i}", "messages": [{"role": "user", "content": ("LOOP " if loop else "") + ROWS[i]["prompt"]}]}


def test_a_chat_template_that_loops_on_one_row_makes_that_row_an_error(tmp_path, looping_model, monkeypatch):
    from jobs import prompts
    from mtp_engine import MTPEngine

    monkeypatch.setattr(prompts, "RENDER_LIMIT_S", 0.5)
    rows = [_chat(0, False), _chat(1, True), _chat(2, False)]
    out = tmp_path / "out"
    started = time.perf_counter()
    run(write_jsonl(tmp_path / "in.jsonl", rows), looping_model, MTPEngine.load(looping_model), out)
    assert time.perf_counter() - started < 60
    ds = {r["id"]: r for r in datasets.load_from_disk(str(out))}
    assert ds["chat-1"]["finish_reason"] == "error" and "within 0.5 s" in ds["chat-1"]["error"]
    assert ds["chat-0"]["finish_reason"] != "error" and ds["chat-2"]["finish_reason"] != "error"


def test_a_chat_template_that_loops_on_every_row_stops_the_job_with_one_line(
        tmp_path, dataset, looping_model, monkeypatch, capsys):
    """The job stops after the first chat rows time out instead of waiting on
    each of thousands; the rows before them (plain prompts) are finished and
    committed, and so are the timed-out rows' error rows."""
    from jobs import prompts

    monkeypatch.setattr(prompts, "RENDER_LIMIT_S", 0.5)
    data = write_jsonl(tmp_path / "in.jsonl", ROWS[:2] + [_chat(i, True) for i in range(2, 8)])
    out = tmp_path / "out"
    code = main(["generate", "--dataset", str(data), "--model", str(looping_model), "--output", str(out),
                 "--max-tokens", "8", "--rows-per-shard", "2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 1 and len(err) == 1 and "chat template ran for more than 0.5 s on each of the first 3" in err[0]
    assert set(rows_by_id(out)) == {"row-0", "row-1", "chat-2", "chat-3"}


# -- ids, datasets, empty inputs ---------------------------------------------------------


def test_made_duplicate_ids_never_take_a_real_id(tmp_path, job_model, job_engine):
    rows = [{"id": "x", "prompt": "def a():"}, {"id": "x", "prompt": "def b():"},
            {"id": "x#dup-row-1", "prompt": "def c():"}]
    out = tmp_path / "out"
    run(write_jsonl(tmp_path / "in.jsonl", rows), job_model, job_engine, out)
    done = rows_by_id(out)
    assert set(done) == {"x", "x#dup-row-1", "x#dup-row-1-2"}
    assert done["x#dup-row-1-2"][1] == "error" and done["x#dup-row-1"][1] != "error"


def test_another_dataset_is_refused_unless_allowed(tmp_path, job_model, job_engine):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "def a():"}, {"prompt": "def b():"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "class C:"}, {"prompt": "class D:"}, {"prompt": "x = 1"}])
    out = tmp_path / "out"
    run(a, job_model, job_engine, out)
    with pytest.raises(DatasetChanged, match=r"written from the dataset '.*a.jsonl' .*reads '.*b.jsonl'.*"
                                             r"--allow-dataset-change"):
        run(b, job_model, job_engine, out)
    run(b, job_model, job_engine, out, allow_dataset_change=True)
    assert set(rows_by_id(out)) == {"0", "1", "2"}  # ids are row numbers: rows 0 and 1 were done
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dataset"]["history"][0]["path"].endswith("a.jsonl")


@pytest.mark.parametrize("kind", ["csv", "parquet", "disk"])
def test_an_empty_dataset_gives_zero_rows_and_a_note(tmp_path, job_model, job_engine, kind):
    if kind == "csv":
        path = tmp_path / "in.csv"
        path.write_text("id,prompt\n")
    else:
        empty = datasets.Dataset.from_dict({"id": [], "prompt": []})
        path = tmp_path / ("in.parquet" if kind == "parquet" else "saved")
        empty.to_parquet(str(path)) if kind == "parquet" else empty.save_to_disk(str(path))
    lines = []
    stream = type("S", (), {"write": lambda self, m: lines.append(m), "flush": lambda self: None,
                            "isatty": lambda self: False})()
    summary = run_job(job_config(path, job_model, tmp_path / "out", **settings()), engine=job_engine, stream=stream)
    assert summary.total == 0 and summary.done == 0
    assert any("note: " in m and "no rows" in m for m in lines)
    assert len(datasets.load_from_disk(str(tmp_path / "out"))) == 0


# -- OS errors and damaged views ---------------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_that_is_a_file_gives_one_error_line(tmp_path, dataset, job_model, where, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    out = blocker if where == "a file" else blocker / "out"
    code = main(["generate", "--dataset", str(dataset), "--model", str(job_model), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and str(out) in err[0]


def test_a_read_only_file_system_gives_one_line_without_retries(tmp_path, dataset, job_model, job_engine, monkeypatch):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=2)
    calls = {"n": 0}

    def read_only(path, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            calls["n"] += 1
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(output_module, "open", read_only, raising=False)
    monkeypatch.setattr(sys.modules["jobs.ledger"], "open", read_only, raising=False)
    with pytest.raises(OutputError, match=r"Read-only file system .*2 rows were committed before and are intact"):
        run(dataset, job_model, job_engine, out)
    assert calls["n"] == 1  # permanent: not retried


def test_a_corrupt_manifest_is_rebuilt_by_the_same_job_and_refused_by_another(
        tmp_path, dataset, job_model, job_engine, reference, capsys):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=4)
    (out / "manifest.json").write_text('{"fingerprint": ')
    assert main(["status", str(out)]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(OutputError, match="manifest.json is corrupt .*another job configuration"):
        run(dataset, job_model, job_engine, out, max_tokens=9)
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference


def test_a_deleted_manifest_is_rebuilt_by_the_same_job_and_refused_by_another(
        tmp_path, dataset, job_model, job_engine, reference):
    """Without its manifest a folder's ledgers still say which job wrote
    its rows: another configuration is refused (it would adopt rows of
    other settings), the same job rebuilds the manifest and resumes."""
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=4)
    (out / "manifest.json").unlink()
    with pytest.raises(OutputError, match="manifest.json is missing .*another job configuration"):
        run(dataset, job_model, job_engine, out, max_tokens=9)
    assert len(rows_by_id(out)) == 4  # nothing deleted
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference


@pytest.mark.parametrize("name", [".lock", "ledger-r000.jsonl"])
def test_a_symlink_planted_in_the_folder_is_refused_not_written_through(
        tmp_path, dataset, job_model, job_engine, reference, capsys, name):
    """A link in the folder (to a file outside it) makes the job stop with
    one error naming it; the file it points to is untouched, and the job
    resumes once the link is gone."""
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=4)
    outside = tmp_path / "precious.txt"
    outside.write_bytes((out / name).read_bytes() if name.startswith("ledger") else b"precious\n")
    before = outside.read_bytes()
    (out / name).unlink()
    (out / name).symlink_to(outside)
    code = main(["generate", "--dataset", str(dataset), "--model", str(job_model), "--output", str(out),
                 *[f"--{k.replace('_', '-')}={v}" for k, v in settings().items()]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and "symbolic link" in err[-1] and name in err[-1]
    assert outside.read_bytes() == before
    (out / name).unlink()
    if name.startswith("ledger"):
        os.replace(outside, out / name)
    run(dataset, job_model, job_engine, out)
    assert rows_by_id(out) == reference


@pytest.mark.parametrize("text", ["[]", "5", '"manifest"'])
def test_a_manifest_that_is_json_but_not_an_object_is_one_error_line(tmp_path, dataset, job_model, job_engine,
                                                                     capsys, text):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=2)
    (out / "manifest.json").write_text(text)
    for argv in (["status", str(out)], ["export", str(out), "--format", "jsonl", "--output", str(tmp_path / "x.jsonl")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "not an object" in err and err.count("\n") == 1


def test_repair_needs_the_lock(tmp_path, dataset, job_model, job_engine):
    out = tmp_path / "out"
    run(dataset, job_model, job_engine, out, limit=2)
    held = FolderLock(out)
    held.acquire("someone")
    try:
        with pytest.raises(FolderInUse):
            repair(out, log=lambda m: None)
    finally:
        held.release()
    assert repair(out, log=lambda m: None) == (1, 2, 0)
