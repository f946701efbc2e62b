"""Outputs that end in a repeating loop.

A loop is where an MTP head is always right, so speedups measured on looping
outputs overstate what a user generating varied text gets. Benchmarks report
every speedup beside its loop-free figure (the prompts whose plain output
does not end in a loop).
"""

from __future__ import annotations


def find_loop(tokens: list[int], max_period: int = 24, repeats: int = 3) -> int | None:
    """Period of a repetition the output ends in (the last ``repeats`` periods
    identical, at least 24 tokens), else None."""
    for period in range(1, max_period + 1):
        span = max(period * repeats, 24)
        if len(tokens) < span:
            break
        tail = tokens[-span:]
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
