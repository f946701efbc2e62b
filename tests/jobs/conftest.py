"""Fixtures for the job runner: a tiny model, its engine, prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.config import JobConfig
from mtp_engine import MTPEngine
from mtp_engine.io.tiny import make_tiny_checkpoint, tiny_config

PROMPT_TEXTS = [
    "def add(a, b):",
    "Hello, world!",
    "class Point:",
    "import os",
    "for i in range(10):",
    "The quick brown fox",
    "Write a function",
    "print(i * i)",
]


@pytest.fixture(scope="session")
def job_model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("job_model") / "model", tiny_config(), seed=1, predictability=0.4)


@pytest.fixture(scope="session")
def job_engine(job_model) -> MTPEngine:
    return MTPEngine.load(job_model)


def write_jsonl(path: Path, rows: list, extra_lines: list[str] = ()) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def prompt_rows(n: int) -> list[dict]:
    return [{"id": f"row-{i}", "prompt": PROMPT_TEXTS[i % len(PROMPT_TEXTS)] + " " * (i // len(PROMPT_TEXTS))} for i in range(n)]


def job_config(dataset: Path, model: Path, output: Path, **overrides) -> JobConfig:
    values = dict(dataset=str(dataset), model=str(model), output=str(output), max_tokens=16, rows_per_shard=3, mode="chain")
    values.update(overrides)
    return JobConfig(**values)
