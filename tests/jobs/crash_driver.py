"""Run ``python -m jobs`` and kill the process with SIGKILL right after the
n-th time one step of a shard commit, a merge, a repair or an export has run
(or, for ``*_before`` steps, just before it): fault injection lives here, in
the tests, not in the runner.

    python tests/jobs/crash_driver.py STEP N -- generate --dataset ...
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

from jobs import cli, ledger, output

# Steps: each name is wrapped so the process dies just after it (just
# before it for names ending in ``_before``).
STEPS = {
    # a shard commit, in order
    "shard_tmp_written": (output, "write_tmp_shard"),
    "shard_renamed": (output, "publish_shard"),
    "ledger_appended": (output.OutputFolder, "_append"),
    "atomic_written": (output, "write_atomic"),
    "views_written": (output.OutputFolder, "refresh_views"),
    # merge, repair and export
    "shard_copied": (shutil, "copyfile"),
    "ledger_rewritten": (ledger.Ledger, "rewrite"),
    "replace_before": (os, "replace"),
    "rename_before": (os, "rename"),
}


def kill_after(step: str, n: int) -> None:
    owner, name = STEPS[step]
    original = getattr(owner, name)
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls >= n and step.endswith("_before"):
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapped)


if __name__ == "__main__":
    step, n, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: crash_driver.py STEP N -- ARGS"
    kill_after(step, int(n))
    sys.exit(cli.main(argv))
