"""Timing each phase of the decoder's steps (benchmarks): `PhaseTimer` is
the decoder's `Hooks` that evaluates what a phase made, waits for the
device and charges the time since the last lap to the phase. Work that
would overlap then runs in turn: for finding where time goes, not for
throughput."""

from __future__ import annotations

import time

import mlx.core as mx

from mtp_engine.decoder import Hooks

PHASES = ("prefill", "head_prefill", "join", "draft", "verify", "head_commit", "leave")
"""What the decoder reports: a joining row's trunk prefill, the head's
prefill over its prompt (the C++ drafter takes a prompt's pairs in its first
draft instead), adding it to the batch's caches; drafting; the verify
forward with acceptance and the trunk caches' commit; the head's commit;
dropping the rows that finished."""


class PhaseTimer(Hooks):
    """Seconds per phase, in ``seconds``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def lap(self, phase: str | None, *arrays, states: list | None = None) -> None:
        mx.eval(*arrays, [c.state for c in states] if states else [])
        mx.synchronize()
        now = time.perf_counter()
        if phase is not None:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._start
        self._start = now
