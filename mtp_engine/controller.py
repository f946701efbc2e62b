"""The draft controller of mode "auto": before every step it chooses how
many drafts the step verifies (0 = a plain step), to maximise the tokens
committed per second. It measures both sides as the decoder runs:

- **Acceptance** by draft position, per row and over all rows: after a
  step in which a row used ``u`` drafts and accepted ``n``, positions
  ``1..min(n + 1, u)`` were tried and ``1..n`` accepted. A row's rate at
  position ``j`` (accepted given the drafts before it were) blends its own
  counts with the batch's (`PRIOR_WEIGHT` pseudo-observations of it), both
  decaying at each trial of that position so an estimate follows a row
  whose acceptance changes with context (a position no step tries keeps
  its estimate). A position never tried starts at the batch's rate one
  position shallower, so a deeper step looks as good as the evidence
  allows and is tried. A row expects ``E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i`` tokens
  from a step of ``d`` drafts.
- **Cost** of a step of ``rows x (d + 1)`` tokens on this machine and
  model: the wall seconds from the end of the step before it to its own end,
  less the rows joining meanwhile (so work a step leaves lazy, the plain
  pipeline draining before a speculative step, and the caller's own work
  per step all count), the median of its last `RECENT` per
  (rows rounded up to a power of two, width). A shape's first step is not counted (first-use costs:
  kernels compiling, buffers allocated). At the start plain steps and steps
  of one draft are measured; a wider step not measured yet is priced by
  extrapolating the two below it, and tried when that price makes it the
  best choice; one priced more than `IMPLAUSIBLE` times a wider width is
  measured again. A row count not measured at some width borrows the width's
  cost relative to one it has measured from the nearest row count that has
  both (only ratios between widths decide).

It chooses the ``d`` in ``0..K`` with the most expected tokens per second,
``sum_rows E_r(min(d, budget_r)) / cost(rows, d + 1)``. A row's drafts
cost the step's width whether it uses them or not (one padded forward), so
every row uses the step's ``d`` (less only near its token budget). While
it decodes plainly the head's pending pairs grow by one a step; after a run
of plain steps (`PLAIN_RUN` at first) a speculative step consumes them and
measures acceptance again, so a batch whose drafts start to pay is noticed.
Each such probe after which plain steps still pay doubles the run (up to
`MAX_PLAIN_RUN`), so a job whose drafts never pay probes rarely; a depth
chosen on its own figures resets it. Once a probe has found plain steps
still pay and the costs say that even drafts all accepted could not pay
(`HOPELESS`: a step of ``d`` drafts emits at most ``d + 1`` tokens), as on a
CPU whose sampled steps of one draft cost three plain ones, it *settles*:
every later step is plain, and the decoder stops feeding the head (which
would otherwise consume every prompt and token for drafts never taken).
Every `EXPLORE_EVERY` speculative
steps it takes the depth one above or below its best instead (alternately)
where that looks at least `EXPLORE_MARGIN` as good, so an estimate met
once (a slow second use of a shape, a position's early misses) is
measured again rather than kept for the rest of the job.

The controller changes which steps speculate, never a token: every step
emits what plain decoding would (greedy, exact sampler). `row_buckets` gives
the row counts a batch's steps take on a GPU, so the step shapes it prices
(and `Decoder.warm_up` meets) come from a small set.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

SMALLEST_BUCKET = 32
"""Rows below which `row_buckets` stops: on a GPU a step's time is flat in
its rows up to at least 32 (docs/BENCHMARKS.md), so a smaller bucket would
only add step shapes to warm up."""


def row_buckets(size: int) -> list[int]:
    """The row counts a batch of ``size`` places keeps, finished rows
    stepping on as ghosts: ``size`` and each quarter of it down to
    `SMALLEST_BUCKET`. The decoder keeps them on a GPU, where each new step
    shape has a first-use cost and a kept place costs next to nothing; on
    the CPU a new shape costs nothing and a kept place costs its share of
    every step (batched chains 10% slower at B=32: docs/BENCHMARKS.md), so
    rows leave at once."""
    buckets = [size]
    while buckets[-1] // 4 >= SMALLEST_BUCKET:
        buckets.append(buckets[-1] // 4)
    return sorted(buckets)


PRIOR_WEIGHT = 4.0
"""Pseudo-observations of the batch's rate in a row's estimate."""

ROW_DECAY = 0.9
"""Weight a row's past counts at a position keep at each of its steps that
tries the position (about ten such steps of memory)."""

BATCH_DECAY = 0.9
"""Weight the batch's counts at a position keep at each speculative step
that tries the position."""

PLAIN_RUN = 16
"""Plain steps in a row before a speculative one measures acceptance again."""

MAX_PLAIN_RUN = 256
"""The longest run of plain steps between two such probes."""

FIRST_RATE = 0.5
"""The first position's acceptance before anything was measured there."""

RECENT = 9
"""Steps of a shape whose median prices it (one slow step, a collection or
a late compile, moves it little)."""

HOPELESS = 0.9
"""A probe is skipped while the step costs say that drafts all accepted
would still give less than this share of plain steps' tokens per second
(a step of d drafts emits at most d + 1 tokens)."""

IMPLAUSIBLE = 2.0
"""A width priced above this multiple of a wider one at the same rows is
measured again (a first use paid at its second step, as a fresh process's
warm-up can meet: 1.4 s against 18 ms on an H100, docs/BENCHMARKS.md)."""

EXPLORE_EVERY = 32
"""Speculative steps between two steps at a depth next to the best."""

EXPLORE_MARGIN = 0.85
"""How good (expected tokens per second, against the best depth's) a
neighbouring depth must look to be measured again."""


@dataclass
class RowAcceptance:
    """A row's decayed acceptance counts by draft position (1-based)."""

    tried: list[float]
    accepted: list[float]

    @classmethod
    def empty(cls, k: int) -> "RowAcceptance":
        return cls([0.0] * (k + 1), [0.0] * (k + 1))


@dataclass
class Controller:
    """Chooses each step's draft depth (see the module docstring).

    Args:
        k: The most drafts a step (``DecodeConfig.draft_tokens``).
    """

    k: int
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    costs: dict = field(default_factory=dict)  # (rows bucket, width) -> [seen, recent seconds]
    plain_run: int = 0
    plain_limit: int = PLAIN_RUN
    probing: bool = False
    chosen: list[int] = field(default_factory=list)  # steps that chose each depth 0..k
    speculative: int = 0  # speculative steps chosen on their own figures
    settled: bool = False  # drafts cannot pay here: every step from now on is plain

    def __post_init__(self):
        self.tried = [0.0] * (self.k + 1)
        self.accepted = [0.0] * (self.k + 1)
        self.chosen = [0] * (self.k + 1)

    # -- estimates ------------------------------------------------------------

    def batch_rates(self) -> list[float]:
        """The batch's acceptance at each draft position ``j`` (index ``j``;
        index 0 unused) given the drafts before it were accepted."""
        rates, prior = [1.0], FIRST_RATE
        for j in range(1, self.k + 1):
            prior = (self.accepted[j] + prior) / (self.tried[j] + 1.0)
            rates.append(prior)
        return rates

    def rate(self, j: int, row: RowAcceptance | None = None) -> float:
        """Acceptance at draft position ``j``: the batch's, or ``row``'s
        blended with it."""
        batch = self.batch_rates()[j]
        return batch if row is None else (row.accepted[j] + PRIOR_WEIGHT * batch) / (row.tried[j] + PRIOR_WEIGHT)

    def tokens(self, rows: list[RowAcceptance], budgets: list[int], deepest: int) -> list[float]:
        """Tokens the rows expect in all from a step of ``d`` drafts, for
        each ``d`` in ``0..deepest`` (a row's drafts capped by its budget)."""
        batch = self.batch_rates()
        totals = [0.0] * (deepest + 1)
        for row, budget in zip(rows, budgets):
            cap = max(0, min(deepest, budget - 1))
            total = chance = 1.0
            totals[0] += 1.0
            for j in range(1, deepest + 1):
                if j <= cap:
                    chance *= (row.accepted[j] + PRIOR_WEIGHT * batch[j]) / (row.tried[j] + PRIOR_WEIGHT)
                    total += chance
                totals[j] += total
        return totals

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _mean(self, bucket: int, width: int) -> float | None:
        entry = self.costs.get((bucket, width))
        return statistics.median(entry[1]) if entry and entry[1] else None

    def cost(self, rows: int, width: int) -> float | None:
        """Seconds a step of this shape costs: measured, or borrowed (see
        the module docstring); None when nothing tells."""
        b = self.bucket(rows)
        own = self._mean(b, width)
        if own is not None:
            return own
        known = [w for w in range(1, self.k + 2) if self._mean(b, w) is not None]
        others = sorted({o for o, w in self.costs if o != b and self._mean(o, width) is not None},
                        key=lambda o: abs(o.bit_length() - b.bit_length()))
        for o in others:
            shared = [w for w in known if self._mean(o, w) is not None]
            if shared:
                return self._mean(b, shared[0]) * self._mean(o, width) / self._mean(o, shared[0])
        if not known and others:  # nothing measured at this row count: the nearest one's curve
            return self._mean(others[0], width)
        return None

    # -- choosing -------------------------------------------------------------

    def choose(self, rows: list[RowAcceptance], budgets: list[int], places: int | None = None) -> int:
        """The step's draft depth, 0..k, for rows with these acceptances and
        token budgets (tokens each may still emit), in a step of ``places``
        rows (default: these; more where finished rows keep their places)."""
        deepest = min(self.k, max(budgets) - 1)
        if deepest < 1 or self.settled:
            return self._chose(0)
        costs = [self.cost(places or len(rows), d + 1) for d in range(deepest + 1)]
        for d in range(deepest):  # priced far above a wider step: a first use met again; measured anew
            if costs[d] is not None and any(c is not None and c * IMPLAUSIBLE < costs[d] for c in costs[d + 1:]):
                costs[d] = None
        for d in (0, 1):  # plain steps and one draft are measured first
            if costs[d] is None:
                return self._chose(d)
        guess = costs[:2] + [None] * (deepest - 1)  # each width extrapolated from the two below it
        for d in range(2, deepest + 1):
            guess[d] = max(costs[d - 1], 2 * costs[d - 1] - costs[d - 2])
            if costs[d] is None:  # not measured yet: priced by the guess, tried if it looks best
                costs[d] = guess[d]
        candidates = list(range(deepest + 1))
        tokens = self.tokens(rows, budgets, deepest)

        def value(d: int, hopeful: bool = False) -> float:
            """Expected tokens per second; ``hopeful`` prices the step at the
            lower of its measure and its guess."""
            return tokens[d] / (min(costs[d], guess[d]) if hopeful and guess[d] else costs[d])
        best = max(candidates, key=value)
        if best == 0 and self.probing:  # the last probe found drafts still do not pay
            self.plain_limit = min(2 * self.plain_limit, MAX_PLAIN_RUN)
        elif best:
            self.plain_limit = PLAIN_RUN
        self.probing = False
        if best == 0 and self.plain_run >= self.plain_limit:
            perfect = max(sum(min(d, b - 1) + 1 for b in budgets) / costs[d] for d in candidates[1:])
            if self.plain_limit > PLAIN_RUN and perfect < HOPELESS * value(0):  # a probe said plain, and no
                # acceptance could pay: nothing to measure
                self.settled = True
            else:
                self.probing = True
                best = max(candidates[1:], key=value)
        elif best:
            self.speculative += 1
            if self.speculative % EXPLORE_EVERY == 0:  # deeper and shallower by turns
                side = [best + 1, best - 1] if self.speculative // EXPLORE_EVERY % 2 else [best - 1, best + 1]
                near = [d for d in side if 1 <= d <= deepest and value(d, d > best) >= EXPLORE_MARGIN * value(best)]
                best = near[0] if near else best
        return self._chose(best)

    def _chose(self, depth: int) -> int:
        self.plain_run = 0 if depth else self.plain_run + 1
        self.chosen[depth] += 1
        return depth

    def describe(self) -> str:
        """One line of what it chose and measured, for a job's log."""
        k = range(1, self.k + 1)
        shapes = sorted({b for b, _ in self.costs})
        costs = "; ".join(f"{b} rows " + "/".join(f"{c * 1e3:.1f}" if (c := self._mean(b, w)) is not None else "-"
                                                  for w in range(1, self.k + 2)) for b in shapes)
        settled = "; settled on plain steps (drafts could not pay)" if self.settled else ""
        return (f"auto: steps by drafts (0..{self.k}) {'/'.join(map(str, self.chosen))}{settled}; "
                f"acceptance by position {'/'.join(f'{self.rate(j):.2f}' for j in k)}; "
                f"step ms by width (1..{self.k + 1}): {costs or '-'}")

    # -- measuring ------------------------------------------------------------

    def observe_step(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows x width`` tokens took ``seconds`` (its first use
        of a shape is not counted)."""
        entry = self.costs.setdefault((self.bucket(rows), width), [0, []])
        entry[0] += 1
        if entry[0] > 1:
            entry[1] = entry[1][1 - RECENT:] + [seconds]

    def observe_rows(self, rows: list[RowAcceptance], used: list[int], accepted: list[int]) -> None:
        """After a speculative step: row ``b`` used ``used[b]`` drafts and
        ``accepted[b]`` of them were accepted."""
        tried, hits = self.tried, self.accepted
        reached = max((min(n + 1, u) for u, n in zip(used, accepted)), default=0)
        for j in range(1, reached + 1):  # the batch's counts age at the positions tried now
            tried[j] *= BATCH_DECAY
            hits[j] *= BATCH_DECAY
        for row, u, n in zip(rows, used, accepted):
            row_tried, row_hits = row.tried, row.accepted
            for j in range(1, min(n + 1, u) + 1):
                hit = j <= n
                row_tried[j] = row_tried[j] * ROW_DECAY + 1.0
                row_hits[j] = row_hits[j] * ROW_DECAY + hit
                tried[j] += 1.0
                hits[j] += hit
