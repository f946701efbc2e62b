"""Progress of a job: a bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time


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
    """

    def __init__(
        self, total: int | None, done: int = 0, stream=None, interval: float = 10.0, prefix: str = "",
        prompts: int | None = None, quiet: bool = False,
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
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(1)
            return
        if self.quiet:
            return
        now = time.perf_counter()
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
        eta = ""
        if self.total and self._rows_this_run:
            left = (self.total - self.done) * elapsed / self._rows_this_run
            eta = f" | ETA {_clock(left)}"
        what = f"completions {self.done}{total}{pct} of {self.prompts} prompts" if self.prompts else \
            f"rows {self.done}{total}{pct}"
        return f"{what} | {self._postfix()}{eta} | elapsed {_clock(elapsed)}"

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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
