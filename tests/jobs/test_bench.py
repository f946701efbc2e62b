"""The job benchmark (``python -m jobs.bench``): the same job once per mode,
reported side by side, runs with ``--logprobs`` among them, each decoder
phase timed where asked."""

from __future__ import annotations

import orjson

from jobs import bench

from tests.jobs.conftest import prompt_rows, write_jsonl


def test_the_job_benchmark_compares_modes_with_and_without_logprobs(tmp_path, job_model):
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(4))
    report = tmp_path / "report.json"
    modes = ["baseline", "baseline,logprobs=3", "chain:2"]
    assert bench.main(["--dataset", str(data), "--model", str(job_model), "--max-tokens", "6", "--batch-size", "2",
                       "--rounds", "1", "--modes", *modes, "--phase-times", "--json", str(report)]) == 0
    result = orjson.loads(report.read_bytes())
    summary = result["summary"]
    assert [s["mode"] for s in summary] == modes
    assert all(s["same_completions"] and s["rows_differing"] == 0 and s["tok_s"] > 0 for s in summary)
    assert summary[0]["ratio"] == 1.0
    for run in result["runs"]:  # the phases and the rest account for each job's time
        phases = run["phases_s"]
        assert phases["prefill"] > 0 and phases["verify"] > 0 and phases["other"] >= 0
        assert abs(sum(phases.values()) - run["wall_s"]) < 0.01
        assert (phases["draft"] > 0) == run["mode"].startswith("chain")
