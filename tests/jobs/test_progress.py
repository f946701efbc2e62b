"""Progress on a non-terminal stream is plain log lines with rate and ETA."""

from __future__ import annotations

import io

from jobs.progress import Progress


def test_log_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(total=4, done=1, stream=stream, interval=0.0)
    progress.update(error=False, tokens=10, steps=4, accepted=6)
    progress.update(error=True)
    lines = stream.getvalue().strip().splitlines()
    assert len(lines) == 2
    assert lines[-1].startswith("rows 3/4 (75.0%)")
    assert "tok/s" in lines[-1] and "AL 2.50" in lines[-1] and "1 errors" in lines[-1] and "ETA" in lines[-1]


def test_no_eta_until_a_batch_worth_of_rows_finished():
    """Rows of a batch finish together after about as long as the whole
    batch takes: an ETA from the first of them would be ~batch-size times
    too long."""
    stream = io.StringIO()
    progress = Progress(total=100, stream=stream, interval=0.0, eta_after=8)
    for _ in range(7):
        progress.update(error=False, tokens=10)
    assert progress.eta_s() is None and "ETA" not in stream.getvalue()
    progress.update(error=False, tokens=10)
    assert progress.eta_s() is not None and "ETA" in stream.getvalue().splitlines()[-1]
    short = Progress(total=3, stream=io.StringIO(), interval=0.0, eta_after=8)  # fewer rows than a batch
    short.update(error=False)
    assert short.eta_s() is None
    short.update(error=False)
    short.update(error=False)
    assert short.eta_s() == 0


def test_the_live_status_file_says_how_far_and_how_the_run_ended(tmp_path):
    import json

    status = tmp_path / "progress-r000.json"
    progress = Progress(total=4, stream=io.StringIO(), status_file=status, prompts=2)
    assert json.loads(status.read_text())["state"] == "running"
    progress.update(error=False, tokens=5)
    progress.close("interrupted")
    data = json.loads(status.read_text())
    assert data["state"] == "interrupted" and data["done"] == 1 and data["total"] == 4 and data["pid"] > 0
    assert data["line"].startswith("completions 1/4 (25.0%) of 2 prompts")
