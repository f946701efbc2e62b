"""Shared fixtures: tiny Hub-layout checkpoints and mlx-lm's greedy reference."""

from __future__ import annotations

from pathlib import Path

import mtp_engine  # noqa: F401  (first: it routes MLX's CPU matmuls before MLX loads)
from mtp_engine.backend import exact_float32

# The tests compare float32 decodings within 1e-4: on CUDA, MLX computes float32 products through TF32 (a
# 10-bit mantissa) unless told not to (docs/BACKENDS.md). Before MLX loads.
exact_float32()

# isort: split
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config

# Prompts for the tiny models (tokenized by their BPE tokenizer).
PROMPTS = [
    "def add(a, b):",
    "Hello, world!",
    "class Point:",
    "import os\nimport sys",
    "for i in range(10):",
    "The quick brown fox",
    "Write a function that returns",
    "x",
    "    return a + b\n\n",
    "Speculative decoding drafts tokens",
    "if __name__ == '__main__':\n    main()",
    "print(i * i)",
]


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once per session) a tiny checkpoint for a config name."""
    made: dict[str, Path] = {}

    def make(name: str, config: dict | None = None, **kwargs) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = make_tiny_checkpoint(folder, config or tiny_config(), **kwargs)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_path(checkpoint_factory) -> Path:
    """The default tiny config with a planted structure (partial acceptance)."""
    return checkpoint_factory("default", tiny_config(), seed=1, predictability=0.4)


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    from mtp_engine import MTPEngine

    return MTPEngine.load(tiny_path)


class Reference:
    """mlx-lm's own greedy decoding of a folder (`mlx_lm.load` + `generate_step`)."""

    def __init__(self, path: Path):
        self.model, self.tokenizer = mlx_lm_load(str(path))

    def greedy(self, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """``n`` greedy tokens and, per position, the gap between the top-2
        log-probabilities."""
        tokens, gaps = [], []
        for token, logprobs in generate_step(mx.array(prompt_ids), self.model, max_tokens=n):
            top2 = mx.sort(logprobs)[-2:]
            tokens.append(int(token))
            gaps.append(float(top2[1] - top2[0]))
        return tokens, gaps


@pytest.fixture(scope="session")
def reference_factory():
    cache: dict[Path, Reference] = {}

    def get(path: Path) -> Reference:
        if path not in cache:
            cache[path] = Reference(path)
        return cache[path]

    return get
