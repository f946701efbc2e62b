"""Decoding modes and their parameters (`DecodeConfig`).

Each speculative mode is a drafting strategy (`mtp_engine.drafters.head`):
``auto`` chains of 0..K drafts, the depth chosen before every step from the
measured acceptance and step costs (`mtp_engine.controller`); ``chain`` K
greedy (or sampled) drafts; ``adaptive`` a chain that stops once
the running product of its top-1 probabilities falls below ``tau``;
``tree`` chain A plus branches from the runner-up at draft positions 1 and 2;
``adaptive_tree`` an adaptive chain plus a position-1 branch; ``paths`` the
top-P first tokens, each continued. Several paths of a row are verified
together, as rows of the verify forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mtp_engine.options import MAX_DRAFT_TOKENS
from schemas.records import GenerationStats

MODES = ("baseline", "auto", "chain", "adaptive", "tree", "adaptive_tree", "paths")
SPECULATIVE_MODES = MODES[1:]
CHAINS = ("auto", "chain")
"""Modes that draft one chain per row ("auto": chains whose depth
`mtp_engine.controller` chooses before every step)."""
DRAFTERS = ("auto", "mlx", "mlx-eager", "cpp", "cuda")
"""Who may draft (`DecodeConfig.drafter`)."""

GREEDY_ONLY = ("cpp",)
"""Drafters that draft greedy rows only."""

UNMASKED_ONLY = ("cpp", "cuda")
"""Drafters that draft no constrained rows."""


def serves(name: str, greedy: bool, masked: bool) -> bool:
    """Whether drafter ``name`` drafts rows that are all greedy (``greedy``)
    or not, some constrained (``masked``) or none."""
    return not (masked and name in UNMASKED_ONLY or not greedy and name in GREEDY_ONLY)


def cannot_draft(name: str) -> ValueError:
    """The error for rows drafter ``name`` does not draft (`serves`)."""
    rows = "sampled and constrained rows" if name in GREEDY_ONLY else "constrained rows"
    what = "greedily, unmasked" if name in GREEDY_ONLY else "unmasked"
    return ValueError(f"the {name} drafter drafts {what}; {rows} draft with the MLX head (drafter='mlx' or 'auto')")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecodeConfig:
    """Validated decoding parameters (a bad value raises ValueError naming it).

    Attributes:
        mode: One of `MODES`.
        draft_tokens: K, draft depth (the maximum depth for the auto and
            adaptive modes).
        tau: Confidence threshold of the adaptive modes, in (0, 1].
        paths: P, candidate first tokens of ``paths`` mode.
        tree_pos2: Whether ``tree`` mode adds the position-2 branch.
        batch_size: Most rows in flight (`MTPEngine.generate_batch`, jobs).
        drafter: Who drafts: "auto", "mlx", "mlx-eager" (the MLX head, not
            compiled), "cpp" or "cuda" (`mtp_engine.drafters.select`). It
            changes speed, never the output.
    """

    mode: str = "chain"
    draft_tokens: int = 3
    tau: float = 0.5
    paths: int = 2
    tree_pos2: bool = True
    batch_size: int = 8
    drafter: str = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not _is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be an int in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau!r}")
        if not _is_int(self.paths) or not 1 <= self.paths <= 8:
            raise ValueError(f"paths must be an int in 1..8, got {self.paths!r}")
        if not isinstance(self.tree_pos2, bool):
            raise ValueError(f"tree_pos2 must be True or False, got {self.tree_pos2!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {self.drafter!r}")

    @property
    def speculative(self) -> bool:
        return self.mode != "baseline"

    @property
    def max_paths(self) -> int:
        """Paths a row may verify in one step."""
        return {"tree": 3 if self.tree_pos2 else 2, "adaptive_tree": 2, "paths": self.paths}.get(self.mode, 1)

    def start_stats(self, sampling, prompt_tokens: int, prefill_s: float) -> GenerationStats:
        """A new row's `GenerationStats`: its parameters as results record
        them, and a counter for each draft count, depth and path it may meet
        (`GenerationStats.count_step`). ``sampling``: its `SamplingParams`."""
        k = self.draft_tokens if self.speculative else 0
        tau = self.tau if self.mode in ("adaptive", "adaptive_tree") else None
        return GenerationStats(mode=self.mode, prompt_tokens=prompt_tokens, temperature=sampling.temperature,
                               seed=None if sampling.greedy else sampling.seed, prefill_s=prefill_s,
                               draft_tokens=k, paths=self.max_paths, tau=tau,
                               histogram=[0] * (k + 1) if k else [], row_wins=[0] * self.max_paths if k else [],
                               depths=[0] * (k + 1) if self.mode == "auto" else [])


FIELDS = tuple(f.name for f in fields(DecodeConfig))
"""The keyword names of `DecodeConfig`."""

HELP = {
    "draft_tokens": "K: draft depth (the most drafts a step, in the auto and adaptive modes)",
    "tau": "confidence threshold of the adaptive modes, in (0, 1]",
    "paths": "P: candidate first tokens in 'paths' mode",
    "tree_pos2": "'tree' mode adds the branch at draft position 2",
    "drafter": "who drafts: " + ", ".join(DRAFTERS) + " (speed only)",
}
"""One line per field for command lines (mode and batch size are the job's)."""
