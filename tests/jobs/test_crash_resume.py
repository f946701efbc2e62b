"""Kill -9 at many points, including inside a shard commit, then resume: the
output equals an uninterrupted run's, row for row, and load_from_disk works
at every point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from jobs.output import read_all_ledgers
from jobs.runner import run_job
from tests.jobs.conftest import job_config, prompt_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


DRIVER = Path(__file__).with_name("crash_driver.py")


def generate_cmd(dataset, model, output) -> list[str]:
    return [
        sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--model", str(model),
        "--output", str(output), "--max-tokens", "16", "--rows-per-shard", "3", "--mode", "tree",
    ]


def rows_by_id(folder: Path) -> dict:
    ds = datasets.load_from_disk(str(folder))
    ids = ds["id"]
    assert len(ids) == len(set(ids)), "duplicated ids"
    return {r["id"]: (r["completion"], r["finish_reason"], r["completion_tokens"]) for r in ds}


def run_until_killed(cmd, output: Path, *, crash_at: str | None = None, kill_after_shards: int | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    if crash_at:
        step, _, n = crash_at.partition(":")
        cmd = [sys.executable, str(DRIVER), step, n or "1", "--", *cmd[3:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if kill_after_shards is not None:
        start = len(read_all_ledgers(output)) if output.exists() else 0
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if output.exists() and len(read_all_ledgers(output)) >= start + kill_after_shards:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out.decode()


@pytest.mark.parametrize("seed", [0])
def test_kill9_anywhere_then_resume_equals_uninterrupted(tmp_path, job_model, job_engine, seed):
    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(40))
    reference = tmp_path / "reference"
    run_job(job_config(dataset, job_model, reference, mode="tree"), engine=job_engine)
    expected = rows_by_id(reference)
    assert len(expected) == 40

    output = tmp_path / "crashed"
    cmd = generate_cmd(dataset, job_model, output)
    # Inside a shard commit at each stage, then external SIGKILLs mid-run.
    plan = [
        dict(crash_at="shard_tmp_written:2"),
        dict(crash_at="shard_renamed:1"),
        dict(crash_at="ledger_appended:2"),
        dict(crash_at="views_written:2"),  # a commit's views written, its ledger line not
        dict(kill_after_shards=2),
        dict(kill_after_shards=1),
    ]
    previous = None
    for step in plan:
        code, log = run_until_killed(cmd, output, **step)
        assert code == -signal.SIGKILL, f"{step}: expected a SIGKILL, got {code}\n{log}"
        if previous == dict(crash_at="views_written:2"):  # the shard the views had is adopted, not redone
            assert "was committed to the views but not to its ledger" in log, log
        previous = step
        # Readable at every point, never a duplicate, only correct rows.
        partial = rows_by_id(output)
        for rid, row in partial.items():
            assert row == expected[rid], f"{step}: row {rid} differs from the uninterrupted run"
        committed = {i for e in read_all_ledgers(output) for i in e.ids}
        assert committed <= set(partial), f"{step}: committed rows missing from load_from_disk"
        for shard in output.glob("data-*.arrow"):
            pa.ipc.open_stream(str(shard)).read_all()

    code, log = run_until_killed(cmd, output)
    assert code == 0, log
    assert rows_by_id(output) == expected
    assert not list(output.glob(".tmp-*"))
    ledgers = read_all_ledgers(output)
    assert sum(e.rows for e in ledgers) == 40


def test_status_shows_a_running_job_live_and_how_its_last_run_ended(tmp_path, job_model):
    """Between commits (every 256 rows or 60 s) status reads the job's live
    status file: running, pid, rows done; once it ends, how and when."""
    from jobs.cli import main

    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(300))
    output = tmp_path / "out"
    proc = subprocess.Popen(generate_cmd(dataset, job_model, output), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    seen = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and seen is None:
            time.sleep(0.5)
            if not (output / "manifest.json").exists():
                continue
            out = subprocess.run([sys.executable, "-m", "jobs", "status", str(output)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60).stdout
            running = [line for line in out.splitlines() if line.startswith("running:")]
            if running and " rows " in running[0] and not running[0].split(" rows ")[1].startswith("0/"):
                seen = running[0]
        assert seen is not None and f"pid {proc.pid} on" in seen and "/300 (" in seen
    finally:
        proc.kill()
        proc.wait(timeout=60)
    import io
    import contextlib

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["status", str(output)])
    assert f"without finishing (pid {proc.pid} on" in text.getvalue()  # killed: said so


def test_sigint_commits_and_prints_how_to_resume(tmp_path, job_model):
    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(60))
    output = tmp_path / "out"
    cmd = generate_cmd(dataset, job_model, output)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        if output.exists() and read_all_ledgers(output):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    text = out.decode()
    assert proc.returncode == 130, text
    printed = [line for line in text.splitlines() if line.startswith("resume with: ")]
    assert len(printed) == 1 and " -m jobs generate " in printed[0]
    done = rows_by_id(output)
    assert 0 < len(done) < 60
    # Rows finished before the signal are all committed: the ledger has them.
    assert sum(e.rows for e in read_all_ledgers(output)) == len(done)
    # The printed command works as printed, in a shell whose PATH has no virtualenv.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if not Path(p, "python").resolve() == Path(sys.executable).resolve())
    resumed = subprocess.run(printed[0].removeprefix("resume with: "), shell=True, cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "PATH": path, "VIRTUAL_ENV": ""})
    assert resumed.returncode == 0, resumed.stderr
    assert len(rows_by_id(output)) == 60


def sampled_rows(folder: Path) -> dict:
    ds = datasets.load_from_disk(str(folder))
    keys = list(zip(ds["id"], ds["sample"]))
    assert len(keys) == len(set(keys)), "a completion (id, sample) twice"
    return {(r["id"], r["sample"]): (r["completion"], r["seed"], r["finish_reason"]) for r in ds}


def killed_twice_then_finished(cmd, output: Path, expected: dict, shards: int) -> str:
    """Run a sampled job killed inside a commit, then after ``shards`` more
    shards, then to the end: every row in the folder at each point is the
    expected one. Returns the last run's log."""
    for step in (dict(crash_at="ledger_appended:2"), dict(kill_after_shards=shards)):
        code, log = run_until_killed(cmd, output, **step)
        assert code == -signal.SIGKILL, f"{step}: expected a SIGKILL, got {code}\n{log}"
        partial = sampled_rows(output)
        assert 0 < len(partial) < len(expected)
        assert all(row == expected[key] for key, row in partial.items())
    code, log = run_until_killed(cmd, output)
    assert code == 0, log
    return log


def test_sampled_job_killed_and_resumed_equals_uninterrupted_and_baseline(tmp_path, job_model, job_engine):
    """T = 0.8, n = 4 over the first 60 prompts of examples/prompts.jsonl
    (five shards of rows): a chain-mode job killed twice and resumed writes
    the rows of an uninterrupted run, which equal the same job's rows in
    baseline mode."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join((ROOT / "examples" / "prompts.jsonl").read_text().splitlines(keepends=True)[:60]))
    sampling = dict(temperature=0.8, n=4, max_tokens=12, rows_per_shard=50)
    baseline = tmp_path / "baseline"
    run_job(job_config(dataset, job_model, baseline, mode="baseline", batch_size=16, **sampling), engine=job_engine)
    chain = tmp_path / "chain"
    run_job(job_config(dataset, job_model, chain, mode="chain", batch_size=16, draft_tokens=3, **sampling),
            engine=job_engine)
    expected = sampled_rows(chain)
    assert expected == sampled_rows(baseline)
    lines = sum(1 for line in open(dataset) if line.strip())
    assert len(expected) >= 4 * (lines - 2)

    output = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--model", str(job_model),
           "--output", str(output), "--mode", "chain", "--batch-size", "16", "--draft-tokens", "3",
           "--temperature", "0.8", "--n", "4", "--max-tokens", "12", "--rows-per-shard", "50"]
    killed_twice_then_finished(cmd, output, expected, shards=2)
    assert sampled_rows(output) == expected


def test_prefix_sharing_job_killed_and_resumed_equals_the_job_without_sharing(tmp_path, job_model, job_engine):
    """Rows of two shared system prompts, T = 0.8, n = 2, batched chains
    (the MLX head drafts sampled rows, from each prefix's head caches): a
    job killed twice and resumed rebuilds its prefixes and writes the rows
    the same job writes with prefix sharing off."""
    from jobs.prefix_data import make_rows

    dataset = write_jsonl(tmp_path / "in.jsonl", make_rows(24, 120, (4, 12), prefixes=2, seed=5))
    sampling = dict(temperature=0.8, n=2, max_tokens=8, rows_per_shard=6, batch_size=8, draft_tokens=2)
    off = tmp_path / "off"
    run_job(job_config(dataset, job_model, off, prefix_sharing=False, **sampling), engine=job_engine)
    expected = sampled_rows(off)
    assert len(expected) == 48

    output = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--model", str(job_model),
           "--output", str(output), "--mode", "chain", "--batch-size", "8", "--draft-tokens", "2",
           "--temperature", "0.8", "--n", "2", "--max-tokens", "8", "--rows-per-shard", "6",
           "--prefix-min-tokens", "64"]
    log = killed_twice_then_finished(cmd, output, expected, shards=1)
    assert "rows started from a shared prefix" in log, log
    assert sampled_rows(output) == expected
