"""Decoding modes and their parameters.

Each speculative mode is a small drafting strategy with one interface:
``propose(drafter, state, depth) -> paths``: equal-length token lists (one
path is a chain, several are verified together as a batch), or for chain
mode with the MLX drafter a lazy ``[1, K]`` array the verify forward reads
back with its targets. Any `mtp_engine.drafters.base.Drafter` whose
``modes`` include the mode can draft it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mtp_engine.options import MAX_DRAFT_TOKENS

MODES = ("baseline", "chain", "adaptive", "tree", "adaptive_tree", "paths")
SPECULATIVE_MODES = MODES[1:]


@dataclass(frozen=True)
class DecodeConfig:
    """Validated decoding parameters.

    Attributes:
        mode: One of `MODES`.
        draft_tokens: K, draft depth (the maximum depth for adaptive modes).
        tau: Confidence threshold of the adaptive modes, in (0, 1].
        paths: P, candidate first tokens of ``paths`` mode.
        tree_pos2: Whether ``tree`` mode adds the position-2 branch.
    """

    mode: str = "chain"
    draft_tokens: int = 4
    tau: float = 0.5
    paths: int = 2
    tree_pos2: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be an int in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}")
        if not 0.0 < float(self.tau) <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau!r}")
        if not isinstance(self.paths, int) or not 1 <= self.paths <= 8:
            raise ValueError(f"paths must be an int in 1..8, got {self.paths!r}")

    @property
    def speculative(self) -> bool:
        return self.mode != "baseline"

    @property
    def max_paths(self) -> int:
        """Rows a verify forward may have."""
        return {
            "baseline": 1,
            "chain": 1,
            "adaptive": 1,
            "tree": 3 if self.tree_pos2 else 2,
            "adaptive_tree": 2,
            "paths": self.paths,
        }[self.mode]

    def stats_params(self) -> dict:
        """The parameters recorded with results."""
        if self.mode == "baseline":
            return {"draft_tokens": 0, "paths": 1, "tau": None}
        tau = self.tau if self.mode in ("adaptive", "adaptive_tree") else None
        return {"draft_tokens": self.draft_tokens, "paths": self.max_paths, "tau": tau}

    def propose(self, drafter, state, depth: int) -> list[list[int]] | mx.array:
        """Draft for one verify step, at most ``depth`` tokens deep (>= 1)."""
        k = min(self.draft_tokens, depth)
        if self.mode == "chain":
            return drafter.draft(state, k)
        if self.mode == "adaptive":
            return [drafter.draft_adaptive(state, k, self.tau)]
        if self.mode == "tree":
            return drafter.draft_tree(state, k, pos2=self.tree_pos2)
        if self.mode == "adaptive_tree":
            return drafter.draft_adaptive_tree(state, k, self.tau)
        if self.mode == "paths":
            return drafter.draft_paths(state, k, self.paths)
        raise ValueError(f"mode {self.mode!r} does not draft")
