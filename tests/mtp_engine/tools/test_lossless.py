"""`python -m mtp_engine.lossless` passes a correct engine and catches a
broken commit (a divergence that is not a near-tie)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mtp_engine import MTPEngine
from mtp_engine import verify as verify_module
from mtp_engine.cache.batch import commit_rows
from mtp_engine.tools.lossless import (
    NOISE_CAP,
    Divergence,
    Reference,
    check,
    main,
    measure_noise,
    near_tie_bound,
)


def test_cli_reports_every_mode_identical(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "Hello world"]))
    out = tmp_path / "lossless.json"
    code = main(["--model", str(tiny_path), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "16",
                 "--modes", "chain-k3", "tree-k3", "paths-k3-p2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["compared"] == 6 and report["identical"] == 6 and report["divergences"] == []
    assert report["identical_to_plain"] == 6


def test_a_commit_one_token_short_is_caught(tiny_path, monkeypatch):
    engine = MTPEngine.load(tiny_path)
    ids = engine.encode("print(i * i)")  # drafts accepted at several lengths

    def short_commit(caches, width, keep):
        # Caches one token behind what was accepted.
        return commit_rows(caches, width, [max(k - 1, 1) for k in keep])

    monkeypatch.setattr(verify_module, "commit_rows", short_commit)
    report = check(engine, [ids], ["chain-k3"], 32, log=lambda m: None)
    assert report.failures, "a wrong commit must show as a divergence off any near-tie"
    failure = report.failures[0]
    assert failure.gap >= failure.bound
    # The wrong state moved the logits long before it changed a token: far
    # more than arithmetic noise, so the noise test does not excuse it.
    assert failure.noise > NOISE_CAP * failure.bound and not failure.explained_by_noise


def _divergence(gap, engine_gap, noise, bound=0.125, same_as_plain=False):
    return Divergence(0, "chain-k2", 8, 11, 22, gap, bound, engine_gap, noise, same_as_plain)


def test_plain_decoding_explains_only_an_output_it_shares_at_a_small_gap():
    # Flipped past the measured noise (0.25 + 0.25 > 2 * 0.1875) ...
    assert not _divergence(0.25, 0.25, 0.1875).near_tie
    # ... but the engine's one-token decoding emits the very same output:
    # the flip is its one-token arithmetic, not speculation.
    assert _divergence(0.25, 0.25, 0.1875, same_as_plain=True).explained_by_plain
    # A gap of whole units is no arithmetic difference, even when plain
    # decoding shares it (a broken kernel would do that).
    assert not _divergence(1.0, 0.25, 0.1875, same_as_plain=True).near_tie


def test_measured_noise_explains_only_a_flip_within_it():
    # Reference: token 22 leads 11 by 0.25; before position 2 the engine's
    # logits for the shared tokens were up to 0.1875 away from the reference's.
    ref = Reference(tokens=[5, 6, 22], gaps=[1.0, 1.0, 0.25], bounds=[0.125] * 3,
                    tops=[[(5, 9.0)], [(6, 7.0), (22, 6.5)], [(22, 8.25), (11, 8.0)]])
    tops = [None, [(6, 7.1875), (22, 6.5)], [(11, 8.125), (22, 8.0625)]]
    engine_gap, noise = measure_noise(ref, tops, 2, 11)
    assert noise == pytest.approx(0.1875) and engine_gap == pytest.approx(0.0625)
    assert _divergence(0.25, engine_gap, noise).explained_by_noise  # 0.3125 <= 2 * 0.1875
    assert not _divergence(0.25, 0.25, noise).explained_by_noise  # 0.5 > 0.375
    # The reference's token missing from the engine's top logits: not a tie there.
    assert measure_noise(ref, [None, tops[1], [(11, 8.125), (7, 8.0)]], 2, 11)[0] is None
    assert not _divergence(0.25, None, noise).near_tie
    # Noise past NOISE_CAP bounds is a broken state, not rounding.
    assert not _divergence(0.25, 0.0625, 0.6).explained_by_noise


@pytest.mark.parametrize("dtype, logit, bound", [(mx.float32, 12.0, 1e-4), (mx.bfloat16, 12.0, 4 * 2.0**-4),
                                                 (mx.float16, 3.0, 4 * 2.0**-9)])
def test_near_tie_bound_follows_logit_precision(dtype, logit, bound):
    assert near_tie_bound(logit, dtype, 4.0) == pytest.approx(bound)
