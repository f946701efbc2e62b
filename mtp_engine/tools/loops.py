"""Outputs that end in a repeating loop.

A loop is where an MTP head is always right, so speedups measured on looping
outputs overstate what a user generating varied text gets. Benchmarks report
every speedup beside its loop-free figure (the prompts whose plain output
does not end in a loop), and the model card reports the loop rate.

An output ends in a loop when its last ``SPAN`` (48) tokens repeat a cycle of
period at most ``MAX_PERIOD`` (12).
"""

from __future__ import annotations

SPAN = 48
MAX_PERIOD = 12


def find_loop(tokens: list[int], max_period: int = MAX_PERIOD, span: int = SPAN) -> int | None:
    """Period of the cycle the output's last ``span`` tokens repeat, else
    None (also for outputs shorter than ``span``)."""
    if len(tokens) < span:
        return None
    tail = tokens[-span:]
    for period in range(1, max_period + 1):
        if all(tail[i] == tail[i - period] for i in range(period, span)):
            return period
    return None


def loop_start(tokens: list[int]) -> int:
    """Index where the output's final repeating loop begins (len if none)."""
    period = find_loop(tokens)
    if period is None:
        return len(tokens)
    start = len(tokens) - period
    while start > 0 and tokens[start - 1] == tokens[start - 1 + period]:
        start -= 1
    return start
