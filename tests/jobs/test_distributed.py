"""Jobs across processes with mlx.launch (ring backend on loopback), and
merging folders written without a shared filesystem."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.merge import MergeError, merge
from jobs.output import read_all_ledgers
from jobs.runner import run_job
from tests.jobs.conftest import job_config, prompt_rows, write_jsonl
from tests.jobs.test_crash_resume import rows_by_id

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))


def launch_cmd(n: int, dataset, model, output, port: int) -> list[str]:
    return [
        LAUNCH, "--backend", "ring", "-n", str(n), "--starting-port", str(port), "--",
        sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--model", str(model),
        "--output", str(output), "--max-tokens", "16", "--rows-per-shard", "2",
    ]


def rank_pids(output: Path) -> dict[int, int]:
    """pid of each rank's python process writing to ``output``."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"jobs" not in cmdline or str(output).encode() not in cmdline:
                continue
            env = dict(
                kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv
            )
        except OSError:
            continue
        if b"MLX_RANK" in env:
            pids[int(env[b"MLX_RANK"])] = int(entry.name)
    return pids


@pytest.fixture(scope="module")
def rows():
    return prompt_rows(24)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, job_model, job_engine, rows):
    folder = tmp_path_factory.mktemp("ref")
    dataset = write_jsonl(folder / "in.jsonl", rows)
    run_job(job_config(dataset, job_model, folder / "out", rows_per_shard=2), engine=job_engine)
    return rows_by_id(folder / "out")


def test_two_ranks_produce_exactly_the_single_process_rows(tmp_path, job_model, rows, reference):
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    proc = subprocess.run(launch_cmd(2, dataset, job_model, out, 52100), cwd=ROOT, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert rows_by_id(out) == reference
    writers = {e.writer for e in read_all_ledgers(out)}
    assert writers == {"r000", "r001"}


def test_kill_one_rank_then_resume_with_three(tmp_path, job_model, rows, reference, rank=0):
    """SIGKILL to rank 0 (which holds the folder's lock for both) once it
    has committed a shard, then the rest: the rows in the folder are the
    uninterrupted job's, and three ranks finish it exactly once."""
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    proc = subprocess.Popen(launch_cmd(2, dataset, job_model, out, 52200 + 10 * rank), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 180
    killed = False
    while time.time() < deadline and proc.poll() is None:
        state = out / "state.json"
        if state.exists() and f"data-r00{rank}-".encode() in state.read_bytes():
            pid = rank_pids(out).get(rank)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.02)
    assert killed, f"rank {rank} was not found running"
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)  # the survivor may wait on the dead rank
    proc.wait(timeout=30)
    partial = rows_by_id(out)
    assert 0 < len(partial) < len(rows)
    for rid, row in partial.items():
        assert row == reference[rid]

    resumed = subprocess.run(launch_cmd(3, dataset, job_model, out, 52300 + 10 * rank), cwd=ROOT, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout.decode() + resumed.stderr.decode()
    assert rows_by_id(out) == reference
    assert sum(e.rows for e in read_all_ledgers(out)) == len(rows)


def test_merge_of_two_machines_equals_one_run(tmp_path, job_model, job_engine, rows, reference):
    a = write_jsonl(tmp_path / "a.jsonl", rows[:12])
    b = write_jsonl(tmp_path / "b.jsonl", rows[12:])
    run_job(job_config(a, job_model, tmp_path / "out_a", rows_per_shard=2), engine=job_engine)
    run_job(job_config(b, job_model, tmp_path / "out_b", rows_per_shard=2), engine=job_engine)
    assert merge([tmp_path / "out_a", tmp_path / "out_b"], tmp_path / "merged") == len(rows)
    assert rows_by_id(tmp_path / "merged") == reference
    # The merged folder is a job folder: resuming the union over it (another
    # dataset than its first input's, on purpose) does nothing.
    union = write_jsonl(tmp_path / "union.jsonl", rows)
    again = run_job(job_config(union, job_model, tmp_path / "merged", rows_per_shard=2, allow_dataset_change=True),
                    engine=job_engine)
    assert again.committed == 0 and again.done == len(rows)


def test_merge_refuses_overlapping_ids_and_other_configs(tmp_path, job_model, job_engine, rows):
    a = write_jsonl(tmp_path / "a.jsonl", rows[:6])
    c = write_jsonl(tmp_path / "c.jsonl", rows[4:8])
    run_job(job_config(a, job_model, tmp_path / "out_a"), engine=job_engine)
    run_job(job_config(c, job_model, tmp_path / "out_c"), engine=job_engine)
    with pytest.raises(MergeError, match="id 'row-[4-5]' is in both"):
        merge([tmp_path / "out_a", tmp_path / "out_c"], tmp_path / "m1")
    assert not (tmp_path / "m1").exists() or not any((tmp_path / "m1").iterdir())
    d = write_jsonl(tmp_path / "d.jsonl", rows[10:12])
    run_job(job_config(d, job_model, tmp_path / "out_d", max_tokens=8), engine=job_engine)
    with pytest.raises(MergeError, match="decoding.max_tokens: 16 -> 8"):
        merge([tmp_path / "out_a", tmp_path / "out_d"], tmp_path / "m2")


def test_every_rank_stops_when_the_folder_is_refused(tmp_path, job_model, job_engine, rows):
    dataset = write_jsonl(tmp_path / "in.jsonl", rows[:4])
    out = tmp_path / "out"
    run_job(job_config(dataset, job_model, out, max_tokens=8), engine=job_engine)
    proc = subprocess.run(launch_cmd(2, dataset, job_model, out, 52400), cwd=ROOT, capture_output=True, timeout=120)
    text = proc.stdout.decode() + proc.stderr.decode()
    # Both ranks stop (none waits forever at the barrier). mlx.launch itself
    # exits 0, reports each rank's status as a warning line, and may end one
    # rank with SIGTERM once the other has exited.
    assert text.count("different job configuration") == 1, text  # rank 0 says why
    assert "rank 0 could not open" in text, text  # rank 1 says who failed
    codes = dict(re.findall(r"rank (\d) exited with code (-?\d+)", text))
    assert set(codes) == {"0", "1"} and set(codes.values()) <= {"1", "-15"} and "1" in codes.values(), text


def test_two_ranks_share_prefixes_within_each_rank_and_write_the_rows_of_one_process(tmp_path, job_model,
                                                                                    job_engine):
    """Rows of two shared system prompts split over two ranks: each rank
    prefills the prefixes its rows need and starts the rest from them, and
    the folder holds the rows one process writes with prefix sharing off."""
    from jobs.prefix_data import make_rows

    dataset = write_jsonl(tmp_path / "in.jsonl", make_rows(24, 120, (4, 12), prefixes=2, seed=7))
    reference = tmp_path / "reference"
    run_job(job_config(dataset, job_model, reference, rows_per_shard=2, prefix_sharing=False), engine=job_engine)
    out = tmp_path / "out"
    proc = subprocess.run(launch_cmd(2, dataset, job_model, out, 52500) + ["--prefix-min-tokens", "64"], cwd=ROOT,
                          capture_output=True, timeout=300)
    text = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, text
    assert rows_by_id(out) == rows_by_id(reference)
    served = re.findall(r"\[rank (\d)/2\] prefixes: (\d+) rows started from a shared prefix", text)
    assert {rank for rank, _ in served} == {"0", "1"} and all(int(n) > 0 for _, n in served), text
