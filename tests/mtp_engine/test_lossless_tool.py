"""`python -m mtp_engine.lossless` passes a correct engine and catches a
broken commit (a divergence that is not a near-tie)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine, engine as engine_module
from mtp_engine.cache_ops import commit_verified_prefix
from mtp_engine.lossless import check, main, near_tie_bound


def test_cli_reports_every_mode_identical(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello world"]))
    out = tmp_path / "lossless.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "16",
                 "--modes", "chain-k3", "tree-k3", "paths-k3-p2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["compared"] == 6 and report["identical"] == 6 and report["divergences"] == []


def test_a_commit_one_token_short_is_caught(tiny_path, monkeypatch):
    engine = MTPEngine.load(tiny_path)
    ids = engine.encode("print(i * i)")  # drafts accepted at several lengths

    def short_commit(caches, verified_len, accepted_len):
        # Recurrent state one token behind what was accepted.
        return commit_verified_prefix(caches, verified_len, max(accepted_len - 1, 1))

    monkeypatch.setattr(engine_module, "commit_verified_prefix", short_commit)
    report = check(engine, [ids], ["chain-k3"], 32, log=lambda m: None)
    assert report.failures, "a wrong commit must show as a divergence off any near-tie"
    assert report.failures[0].gap >= report.failures[0].bound


@pytest.mark.parametrize("dtype, logit, bound", [(mx.float32, 12.0, 1e-4), (mx.bfloat16, 12.0, 4 * 2.0**-4),
                                                 (mx.float16, 3.0, 4 * 2.0**-9)])
def test_near_tie_bound_follows_logit_precision(dtype, logit, bound):
    assert near_tie_bound(logit, dtype, 4.0) == pytest.approx(bound)
