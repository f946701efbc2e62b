"""The draft controller of mode "auto": before every step it chooses how
many drafts the step verifies (0 = a plain step), to maximise the tokens
committed per second. It measures both sides as the decoder runs:

- **Acceptance** by draft position, per row and over all rows: after a
  step in which a row used ``u`` drafts and accepted ``n``, positions
  ``1..min(n + 1, u)`` were tried and ``1..n`` accepted. A row's rate at
  position ``j`` (accepted given the drafts before it were) blends its own
  counts with the batch's (`PRIOR_WEIGHT` pseudo-observations of it), both
  decaying so an estimate follows a row whose acceptance changes with
  context. A row expects ``E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i`` tokens
  from a step of ``d`` drafts.
- **Cost** of a step of ``rows x (d + 1)`` tokens on this machine and
  model: wall seconds of the step, averaged per (rows rounded up to a power
  of two, width). A shape's first step is not counted (first-use costs:
  kernels compiling, buffers allocated). At the start plain steps and steps
  of one draft are measured; a wider step not measured yet is priced by
  extrapolating the two below it, and tried when that price makes it the
  best choice. A row count not measured at some width borrows the width's
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
chosen on its own figures resets it.

The controller changes which steps speculate, never a token: every step
emits what plain decoding would (greedy, exact sampler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_WEIGHT = 4.0
"""Pseudo-observations of the batch's rate in a row's estimate."""

ROW_DECAY = 0.9
"""Weight a row's past counts keep at each of its steps (about ten steps
of memory)."""

BATCH_DECAY = 0.9
"""Weight the batch's counts keep at each speculative step."""

PLAIN_RUN = 16
"""Plain steps in a row before a speculative one measures acceptance again."""

MAX_PLAIN_RUN = 256
"""The longest run of plain steps between two such probes."""

FIRST_RATE = 0.5
"""A position's acceptance before anything was measured there."""


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
    costs: dict = field(default_factory=dict)  # (rows bucket, width) -> [seen, counted, mean seconds]
    plain_run: int = 0
    plain_limit: int = PLAIN_RUN
    probing: bool = False
    chosen: list[int] = field(default_factory=list)  # steps that chose each depth 0..k

    def __post_init__(self):
        self.tried = [0.0] * (self.k + 1)
        self.accepted = [0.0] * (self.k + 1)
        self.chosen = [0] * (self.k + 1)

    # -- estimates ------------------------------------------------------------

    def rate(self, j: int, row: RowAcceptance | None = None) -> float:
        """Acceptance at draft position ``j`` given the drafts before it were
        accepted: the batch's, or ``row``'s blended with it."""
        batch = (self.accepted[j] + FIRST_RATE) / (self.tried[j] + 1.0)
        if row is None:
            return batch
        return (row.accepted[j] + PRIOR_WEIGHT * batch) / (row.tried[j] + PRIOR_WEIGHT)

    def expected(self, row: RowAcceptance, depth: int) -> float:
        """Tokens ``row`` expects from a step of ``depth`` drafts."""
        total, chance = 1.0, 1.0
        for j in range(1, depth + 1):
            chance *= self.rate(j, row)
            total += chance
        return total

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _mean(self, bucket: int, width: int) -> float | None:
        entry = self.costs.get((bucket, width))
        return entry[2] if entry and entry[1] else None

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
        if deepest < 1:
            return self._chose(0)
        costs = [self.cost(places or len(rows), d + 1) for d in range(deepest + 1)]
        for d in (0, 1):  # plain steps and one draft are measured first
            if costs[d] is None:
                return self._chose(d)
        for d in range(2, deepest + 1):  # wider steps not measured yet: extrapolated, to be tried if they look best
            if costs[d] is None:
                costs[d] = max(costs[d - 1], 2 * costs[d - 1] - costs[d - 2])
        candidates = list(range(deepest + 1))

        def value(d: int) -> float:
            tokens = sum(self.expected(r, max(0, min(d, b - 1))) for r, b in zip(rows, budgets))
            return tokens / costs[d]
        best = max(candidates, key=value)
        if best == 0 and self.probing:  # the last probe found drafts still do not pay
            self.plain_limit = min(2 * self.plain_limit, MAX_PLAIN_RUN)
        elif best:
            self.plain_limit = PLAIN_RUN
        self.probing = False
        if best == 0 and self.plain_run >= self.plain_limit:
            self.probing = True
            best = max(candidates[1:], key=value)
        return self._chose(best)

    def _chose(self, depth: int) -> int:
        self.plain_run = 0 if depth else self.plain_run + 1
        self.chosen[depth] += 1
        return depth

    # -- measuring ------------------------------------------------------------

    def observe_step(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows x width`` tokens took ``seconds`` (its first use
        of a shape is not counted)."""
        entry = self.costs.setdefault((self.bucket(rows), width), [0, 0, 0.0])
        entry[0] += 1
        if entry[0] == 1:
            return
        entry[1] += 1
        weight = max(1.0 / entry[1], 0.1)  # the mean, then a moving average
        entry[2] += weight * (seconds - entry[2])

    def observe_rows(self, rows: list[RowAcceptance], used: list[int], accepted: list[int]) -> None:
        """After a speculative step: row ``b`` used ``used[b]`` drafts and
        ``accepted[b]`` of them were accepted."""
        _decay(self, BATCH_DECAY)
        for row, u, n in zip(rows, used, accepted):
            _decay(row, ROW_DECAY)
            for j in range(1, min(n + 1, u) + 1):
                for counts in (row, self):
                    counts.tried[j] += 1.0
                    counts.accepted[j] += j <= n


def _decay(counts, weight: float) -> None:
    counts.tried[:] = [t * weight for t in counts.tried]
    counts.accepted[:] = [a * weight for a in counts.accepted]
