"""Shared prompt prefixes prefilled once per job (a system prompt, a
few-shot block, a chat template's header repeated on every row).

The runner decodes rows one after another, having read up to `WINDOW`
rows ahead (an offline job knows its rows before it decodes them). For each
row, `PrefixCache.find` returns the longest kept prefix its prompt
continues; failing that, it compares the prompt with the last `WINDOW`
prompts and the rows read ahead, and where `AGREE` of them share at least
``min_tokens`` tokens with it, it prefills the shortest
such shared run (the part they all have in common) once
(`MTPEngine.prefill_prefix`) and keeps it. A row served by a prefix prefills only its own suffix, from a copy of
the prefix's caches (`mtp_engine.prefix`). Kept prefixes live within a byte
budget, the least recently used evicted first; one over the whole budget is
not kept, with a note. A resumed job rebuilds what it needs the same way;
under ``mlx.launch`` each rank keeps its own (rows go to ranks by id, so a
prefix is prefilled once per rank that has its rows).
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Iterable

WINDOW = 32
"""Recent prompts, and prompts read ahead, a new one is compared with (so
the first row of a group already starts from its prefix)."""
AGREE = 2
"""Recent prompts that must share a run with a new one before it becomes a
prefix: the run three prompts share is the common part (a system prompt),
rarely more (two prompts may also share their suffixes' first words)."""


def default_budget_bytes() -> int:
    """5% of the machine's memory, at most 4 GiB."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 << 30
    return min(4 << 30, memory // 20)


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Kept prefixes of one job, and what they saved.

    Args:
        engine: The job's `MTPEngine`.
        min_tokens: The shortest run of shared tokens worth a prefix.
        budget_bytes: The most the kept prefixes may hold together.
        log: Where notes go.

    Attributes:
        hits: Rows that started from a kept prefix.
        made: Prefixes prefilled.
        saved_tokens: Prompt tokens those rows did not prefill.
        peak_bytes: The most the kept prefixes held at once.
    """

    def __init__(self, engine, min_tokens: int, budget_bytes: int, log=lambda m: None):
        self.engine = engine
        self.min_tokens = min_tokens
        self.budget = budget_bytes
        self.log = log
        self.kept: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self.recent: deque[list[int]] = deque(maxlen=WINDOW)
        self.bytes = self.peak_bytes = 0
        self.hits = self.made = self.saved_tokens = 0
        self._noted = False

    def find(self, ids: list[int], upcoming: Iterable[list[int]] = ()):
        """The `PrefixState` this prompt should start from, or None
        (``upcoming``: the prompts of the rows read ahead, at most
        `WINDOW`; read only where no kept prefix serves)."""
        best = max((p for p in self.kept.values() if p.continues(ids)), key=len, default=None)
        if best is not None:
            self.kept.move_to_end(best.tokens)
            self.hits += 1
            self.saved_tokens += len(best)
            return best
        others = [*self.recent, *upcoming]
        shared = [n for n in (_shared(ids, r) for r in others) if n >= self.min_tokens]
        self.recent.append(ids)
        if len(shared) < AGREE:
            return None
        n = min(min(shared), len(ids) - 1)
        if n < self.min_tokens:
            return None
        state = self.engine.prefill_prefix(ids[:n])
        self.made += 1
        if state.nbytes > self.budget:
            if not self._noted:
                self.log(f"note: a shared prefix of {n} tokens needs {state.nbytes / 2**20:.1f} MiB, over the "
                         f"prefix cache's {self.budget / 2**20:.1f} MiB (--prefix-cache-gb); rows prefill it "
                         "themselves")
                self._noted = True
            return None
        while self.kept and self.bytes + state.nbytes > self.budget:
            _, old = self.kept.popitem(last=False)
            self.bytes -= old.nbytes
        self.kept[state.tokens] = state
        self.bytes += state.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return state  # this row prefills the prefix's tokens too: nothing saved yet

    def summary(self) -> dict:
        return {"rows": self.hits, "prefilled": self.made, "tokens_saved": self.saved_tokens,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget}

    def describe(self) -> str:
        return (f"prefixes: {self.hits} rows started from a shared prefix, {self.saved_tokens} prompt tokens not "
                f"prefilled; {self.made} prefixes prefilled, cache peak {self.peak_bytes / 2**20:.1f} MiB of "
                f"{self.budget / 2**20:.0f} MiB")
