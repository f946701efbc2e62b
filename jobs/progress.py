"""Progress of a job: a bar on a terminal, plain log lines otherwise, and
a small file in the output folder (``progress-<writer>.json``) rewritten
every `STATUS_EVERY_S` seconds, which ``jobs status`` reads while the job
runs (commits come far less often)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import orjson

from jobs.ledger import open_plain

STATUS_EVERY_S = 2.0


class Progress:
    """Reports output rows done, tokens/s, acceptance length and ETA.

    Args:
        total: Output rows (completions) the job makes (None if unknown).
        prompts: The prompts they come from, where prompts ask for several
            completions (``--n``), else None: the lines then count
            completions and name the prompts.
        done: Output rows already done before this run.
        stream: Where to write (default stderr).
        interval: Seconds between log lines when not on a terminal.
        prefix: Put before every line (the rank under mlx.launch).
        quiet: Show no progress and no `info` lines (`log` still prints).
        status_file: Where to keep the live status (None: nowhere).
        eta_after: Rows this run must finish before an ETA is given (the
            batch size: rows finish in bursts, the first ones after about as
            long as a whole batch takes).
    """

    def __init__(
        self, total: int | None, done: int = 0, stream=None, interval: float = 10.0, prefix: str = "",
        prompts: int | None = None, quiet: bool = False, status_file: Path | None = None, eta_after: int = 1,
    ):
        self.stream = stream or sys.stderr
        self.prefix = prefix
        self.total = total
        self.prompts = prompts
        self.done = done
        self.errors = 0
        self.tokens = 0
        self.steps = 0
        self.accepted = 0
        self.started = time.perf_counter()
        self.interval = interval
        self._last_log = 0.0
        self._rows_this_run = 0
        self._bar = None
        self.quiet = quiet
        self.status_file = status_file
        self.eta_after = max(1, eta_after)
        self._last_status = 0.0
        self._since = time.time()
        self._reports: dict = {}
        self._write_status("running")
        if self.stream.isatty() and not prefix and not quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="completion" if prompts else "row", file=self.stream,
                             dynamic_ncols=True)

    def update(self, *, error: bool, tokens: int = 0, steps: int = 0, accepted: int = 0) -> None:
        self.done += 1
        self._rows_this_run += 1
        self.errors += error
        self.tokens += tokens
        self.steps += steps
        self.accepted += accepted
        now = time.perf_counter()
        if now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            self._write_status("running")
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(1)
            return
        if self.quiet:
            return
        if now - self._last_log >= self.interval or (self.total and self.done >= self.total):
            self._last_log = now
            self.log(self.line())

    def _postfix(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        parts = [f"{self.tokens / elapsed:.1f} tok/s"]
        if self.steps:
            parts.append(f"AL {(self.accepted + self.steps) / self.steps:.2f}")
        if self.errors:
            parts.append(f"{self.errors} errors")
        return ", ".join(parts)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        total = f"/{self.total}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        left = self.eta_s()
        eta = "" if left is None else f" | ETA {_clock(left)}"
        what = f"completions {self.done}{total}{pct} of {self.prompts} prompts" if self.prompts else \
            f"rows {self.done}{total}{pct}"
        return f"{what} | {self._postfix()}{eta} | elapsed {_clock(elapsed)}"

    def eta_s(self) -> float | None:
        """Seconds left at this run's pace, once it has finished `eta_after` rows."""
        if not self.total:
            return None
        left = self.total - self.done
        if left <= 0:
            return 0.0
        if self._rows_this_run < min(self.eta_after, left + self._rows_this_run):
            return None
        return left * (time.perf_counter() - self.started) / self._rows_this_run

    def _write_status(self, state: str) -> None:
        """Rewrite the live status file (advisory: never fsynced, and a
        failure to write it is ignored; commits hold what counts)."""
        if self.status_file is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        data = {"state": state, "pid": os.getpid(), "host": socket.gethostname(), "since": self._since,
                "updated": time.time(), "done": self.done, "total": self.total, "prompts": self.prompts,
                "errors": self.errors, "tokens": self.tokens, "tokens_per_s": round(self.tokens / elapsed, 1),
                "acceptance_length": round((self.accepted + self.steps) / self.steps, 3) if self.steps else None,
                "eta_s": self.eta_s(), "line": self.line(), **self._reports}
        tmp = self.status_file.with_name(f".tmp-{self.status_file.name}")
        try:
            with open_plain(tmp, "wb") as f:
                f.write(orjson.dumps(data))
            os.replace(tmp, self.status_file)
        except OSError:
            pass

    def report(self, name: str, value) -> None:
        """Keep ``value`` in the status file under ``name`` (figures of the
        run that `jobs status` shows, e.g. the prefix cache's)."""
        self._reports[name] = value

    def info(self, message: str) -> None:
        """A line that ``quiet`` leaves out (what the job is, how it goes)."""
        if not self.quiet:
            self.log(message)

    def log(self, message: str) -> None:
        message = self.prefix + message
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self, state: str = "finished") -> None:
        """End the bar and leave the status file saying how the run ended
        ("finished", "interrupted" or "failed")."""
        self._write_status(state)
        if self._bar is not None:
            self._bar.close()


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
