"""Cache operations: snapshot/restore, commits, tiling and row commits."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.utils import load as mlx_lm_load

from mtp_engine.cache.capture import StateCaptureCache
from mtp_engine.cache.ops import (
    cache_batch_size,
    commit_by_replay,
    commit_tree_row,
    commit_verified_prefix,
    restore,
    snapshot,
    tile_caches,
)
from mtp_engine.model.gated_delta import install_state_capture
from tests.mtp_engine.cache.helpers import begin_capture
from tests.mtp_engine.cache.helpers import prefilled as prefill


@pytest.fixture(scope="module")
def model(tiny_path):
    m, _ = mlx_lm_load(str(tiny_path))
    install_state_capture(m)
    return m


PROMPT = [12, 7, 99, 31, 5, 150, 42, 8]


def prefilled(model, tokens=PROMPT):
    return prefill(model, tokens)


def next_logits(model, caches, token=77):
    out = model(mx.array([[token]]), cache=caches)
    mx.eval(out)
    return out


def assert_same_caches(a, b):
    assert len(a) == len(b)
    for x, y in zip(snapshot(a), snapshot(b)):
        assert x.kind == y.kind and x.offset == y.offset
        for p, q in zip(x.arrays, y.arrays):
            assert (p is None and q is None) or mx.array_equal(p, q)


def test_snapshot_restored_twice_is_not_corrupted(model):
    """Regression: ArraysCache's state setter aliases the list it gets, so a
    forward after a restore must not write into the snapshot."""
    caches = prefilled(model)
    snaps = snapshot(caches)
    restore(caches, snaps)
    first = next_logits(model, caches, 5)
    model(mx.array([[6, 7, 8]]), cache=caches)  # writes into the restored state
    restore(caches, snaps)
    second = next_logits(model, caches, 5)
    assert mx.array_equal(first, second)
    fresh = prefilled(model)
    assert mx.array_equal(next_logits(model, fresh, 5), first)


def test_snapshot_is_a_deep_copy(model):
    caches = prefilled(model)
    snaps = snapshot(caches)
    before = [tuple(mx.array(x) if x is not None else None for x in s.arrays) for s in snaps]
    model(mx.array([[1, 2, 3]]), cache=caches)
    mx.eval([c.state for c in caches])
    for s, b in zip(snaps, before):
        for x, y in zip(s.arrays, b):
            assert (x is None and y is None) or mx.array_equal(x, y)


@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_commit_verified_prefix_equals_feeding_only_the_prefix(model, accepted):
    verify = [40, 41, 42, 43]
    caches = prefilled(model)
    begin_capture(caches)
    model(mx.array([verify]), cache=caches)
    assert commit_verified_prefix(caches, len(verify), accepted)

    expected = prefilled(model)
    model(mx.array([verify[:accepted]]), cache=expected)
    mx.eval([c.state for c in expected])
    assert_same_caches(caches, expected)
    assert mx.array_equal(next_logits(model, caches), next_logits(model, expected))


def test_commit_without_captured_states_refuses_and_replay_recovers(model):
    verify = [40, 41, 42, 43]
    caches = prefilled(model)
    snaps = snapshot(caches)
    model(mx.array([verify]), cache=caches)  # no capture: no captured states
    assert not commit_verified_prefix(caches, 4, 2)
    commit_by_replay(model, caches, snaps, mx.array([verify[:2]]))
    expected = prefilled(model)
    model(mx.array([verify[:2]]), cache=expected)
    assert mx.array_equal(next_logits(model, caches), next_logits(model, expected))


def test_commit_argument_errors(model):
    caches = prefilled(model)
    with pytest.raises(ValueError, match="accepted_len"):
        commit_verified_prefix(caches, 3, 4)
    with pytest.raises(ValueError, match="accepted_len"):
        commit_verified_prefix(caches, 3, 0)


@pytest.mark.parametrize("paths", [1, 2, 3, 4])
def test_tile_then_commit_row_equals_running_the_row_alone(model, paths):
    rows = [[60, 61, 62, 63], [70, 71, 72, 73], [80, 81, 82, 83], [90, 91, 92, 93]][:paths]
    for row in range(paths):
        for accepted in (1, 3, 4):
            caches = prefilled(model)
            tile_caches(caches, paths)
            assert cache_batch_size(caches) == paths
            begin_capture(caches)
            batched = model(mx.array(rows), cache=caches)
            assert commit_tree_row(caches, 4, accepted, row)
            assert cache_batch_size(caches) == 1

            alone = prefilled(model)
            single = model(mx.array([rows[row]]), cache=prefilled(model))
            model(mx.array([rows[row][:accepted]]), cache=alone)
            mx.eval([c.state for c in alone])
            assert mx.array_equal(batched[row : row + 1], single)
            assert_same_caches(caches, alone)
            assert mx.array_equal(next_logits(model, caches), next_logits(model, alone))


def test_tile_caches_covers_kv_and_recurrent(model):
    caches = prefilled(model)
    assert any(isinstance(c, KVCache) for c in caches)
    assert any(isinstance(c, StateCaptureCache) for c in caches)
    tile_caches(caches, 3)
    for c in caches:
        if isinstance(c, KVCache):
            assert c.keys.shape[0] == 3 and c.offset == len(PROMPT)
        else:
            assert all(x.shape[0] == 3 for x in c.cache)
    with pytest.raises(ValueError, match="batch-1"):
        tile_caches(caches, 2)


def test_commit_tree_row_rejects_bad_row(model):
    caches = prefilled(model)
    tile_caches(caches, 2)
    begin_capture(caches)
    model(mx.array([[1, 2], [3, 4]]), cache=caches)
    with pytest.raises(ValueError, match="row 2"):
        commit_tree_row(caches, 2, 1, 2)


def test_plain_arrays_cache_snapshot_and_restore():
    cache = ArraysCache(2)
    cache[0] = mx.ones((1, 3, 4))
    cache[1] = mx.zeros((1, 2, 2, 2))
    snaps = snapshot([cache])
    cache[0] = cache[0] * 5
    restore([cache], snaps)
    assert mx.array_equal(cache[0], mx.ones((1, 3, 4)))
    cache[0][0, 0, 0] = 9.0  # in-place write after a restore
    restore([cache], snaps)
    assert float(cache[0][0, 0, 0]) == 1.0


def test_snapshot_of_empty_kv_cache_restores_empty():
    c = KVCache()
    snaps = snapshot([c])
    c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    restore([c], snaps)
    assert c.keys is None and c.offset == 0
