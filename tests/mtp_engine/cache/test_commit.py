"""Commits of a verify forward on the batch's caches (`mtp_engine.cache.batch`):
a row keeps a prefix of the inputs it fed, as if it had fed only those; a
row verifying several paths (its caches gathered into a row per path) keeps
its winner's, as if it had run that path alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine.cache.batch import BatchKVCache, append_row, commit_rows, filter_rows, make_batch_cache
from mtp_engine.cache.capture import StateCaptureCache
from mtp_engine.model.gated_delta import install_state_capture
from tests.mtp_engine.cache.helpers import begin_capture, prefilled

PROMPT = [12, 7, 99, 31, 5, 150, 42, 8]


@pytest.fixture(scope="module")
def model(tiny_path):
    m, _ = mlx_lm_load(str(tiny_path))
    install_state_capture(m)
    return m


def one_row(model, tokens=PROMPT) -> list:
    """The batch's caches holding one row prefilled with ``tokens``."""
    caches = make_batch_cache(model)
    append_row(caches, prefilled(model, tokens), 0)
    return caches


def next_logits(model, caches, token=77):
    out = model(mx.array([[token]]), cache=caches)
    mx.eval(out)
    return out


def assert_same_caches(a, b):
    for x, y in zip(a, b):
        if isinstance(x, BatchKVCache):
            assert x.idx == y.idx and x.positions == y.positions and not x.holes and not y.holes
            assert mx.array_equal(x.keys[..., : x.idx, :], y.keys[..., : y.idx, :])
            assert mx.array_equal(x.values[..., : x.idx, :], y.values[..., : y.idx, :])
        else:
            assert all(mx.array_equal(p, q) for p, q in zip(x.cache, y.cache))


@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_commit_equals_feeding_only_the_prefix(model, accepted):
    verify = [40, 41, 42, 43]
    caches = one_row(model)
    begin_capture(caches)
    model(mx.array([verify]), cache=caches)
    commit_rows(caches, len(verify), [accepted])
    expected = one_row(model)
    model(mx.array([verify[:accepted]]), cache=expected)
    mx.eval([c.state for c in expected])
    assert_same_caches(caches, expected)  # a batch of one: the rejected suffix is trimmed, no holes
    assert mx.array_equal(next_logits(model, caches), next_logits(model, expected))


def test_commit_without_captured_states_is_refused(model):
    caches = one_row(model)
    model(mx.array([[40, 41, 42]]), cache=caches)  # no capture
    with pytest.raises(ValueError, match="captured no states"):
        commit_rows(caches, 3, [2])


def test_keep_counts_are_checked(model):
    caches = one_row(model)
    begin_capture(caches)
    model(mx.array([[40, 41, 42]]), cache=caches)
    with pytest.raises(ValueError, match="keep counts must be in 1..3"):
        commit_rows(caches, 3, [4])


@pytest.mark.parametrize("paths", [1, 2, 3, 4])
def test_paths_gathered_then_the_winner_kept_equals_running_the_path_alone(model, paths):
    rows = [[60, 61, 62, 63], [70, 71, 72, 73], [80, 81, 82, 83], [90, 91, 92, 93]][:paths]
    for row in range(paths):
        for accepted in (1, 3, 4):
            caches = one_row(model)
            filter_rows(caches, [0] * paths, trim=False)  # a row per path
            assert all(len(c.positions) == paths for c in caches if isinstance(c, BatchKVCache))
            assert all(x.shape[0] == paths for c in caches if isinstance(c, StateCaptureCache) for x in c.cache)
            begin_capture(caches)
            batched = model(mx.array(rows), cache=caches)
            commit_rows(caches, 4, [accepted] * paths)
            filter_rows(caches, [row], trim=False)

            alone = one_row(model)
            single = model(mx.array([rows[row]]), cache=one_row(model))
            model(mx.array([rows[row][:accepted]]), cache=alone)
            mx.eval([c.state for c in alone])
            assert mx.array_equal(batched[row : row + 1], single)
            assert mx.array_equal(next_logits(model, caches), next_logits(model, alone))
