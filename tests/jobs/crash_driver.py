"""Run ``python -m jobs`` and kill the process with SIGKILL right after the
n-th time one step of a shard commit has run (fault injection lives here,
in the tests, not in the runner).

    python tests/jobs/crash_driver.py STEP N -- generate --dataset ...
"""

from __future__ import annotations

import os
import signal
import sys

from jobs import cli, output

# Commit steps, in order: each name is wrapped so the process dies just after it.
STEPS = {
    "shard_tmp_written": (output, "write_tmp_shard"),
    "shard_renamed": (output, "publish_shard"),
    "ledger_appended": (output.OutputFolder, "_append"),
    "atomic_written": (output, "write_atomic"),
    "views_written": (output.OutputFolder, "refresh_views"),
}


def kill_after(step: str, n: int) -> None:
    owner, name = STEPS[step]
    original = getattr(owner, name)
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        result = original(*args, **kwargs)
        calls += 1
        if calls >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapped)


if __name__ == "__main__":
    step, n, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: crash_driver.py STEP N -- ARGS"
    kill_after(step, int(n))
    sys.exit(cli.main(argv))
