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
