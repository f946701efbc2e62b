"""Cache operations for speculative decoding.

Works on mlx-lm's cache objects (``KVCache``: ``state == (keys, values,
offset)``; ``ArraysCache``: ``state == (cache_list, left_padding, lengths)``)
and on `StateCaptureCache`. All functions take the list of a model's
caches, one per layer, and change them in place.

Snapshots are deep copies, and restoring installs a copy: ``ArraysCache``'s
state setter aliases the list it is given, and the next forward writes into
that list, which would corrupt a snapshot restored twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mtp_engine.cache.capture import StateCaptureCache


@dataclass(frozen=True)
class CacheSnapshot:
    """Deep copy of one cache's state. ``kind`` is "kv" or "arrays"."""

    kind: str
    arrays: tuple[Any, ...]
    offset: int = 0


def _copy(x):
    return None if x is None else mx.array(x)


def _check_supported(cache) -> None:
    if not isinstance(cache, (KVCache, ArraysCache)):
        raise TypeError(f"unsupported cache type {type(cache).__name__}")


def snapshot(caches: list) -> list[CacheSnapshot]:
    """Deep-copy the state of every cache (evaluated, so later in-place
    writes cannot reach it)."""
    snaps, arrays = [], []
    for c in caches:
        _check_supported(c)
        if isinstance(c, KVCache):
            if c.keys is None:
                snaps.append(CacheSnapshot("kv", (None, None), 0))
                continue
            k = mx.array(c.keys[..., : c.offset, :])
            v = mx.array(c.values[..., : c.offset, :])
            snaps.append(CacheSnapshot("kv", (k, v), c.offset))
            arrays += [k, v]
        else:
            if c.left_padding is not None or c.lengths is not None:
                raise ValueError("snapshot of a padded batch cache is not supported")
            copies = tuple(_copy(x) for x in c.cache)
            snaps.append(CacheSnapshot("arrays", copies))
            arrays += [x for x in copies if x is not None]
    if arrays:
        mx.eval(arrays)
    return snaps


def restore(caches: list, snaps: list[CacheSnapshot]) -> None:
    """Install copies of a snapshot; the snapshot stays reusable."""
    if len(caches) != len(snaps):
        raise ValueError(f"{len(snaps)} snapshots for {len(caches)} caches")
    for c, s in zip(caches, snaps):
        if s.kind == "kv":
            k, v = s.arrays
            c.keys, c.values, c.offset = _copy(k), _copy(v), s.offset
        else:
            c.cache = [_copy(x) for x in s.arrays]
        if isinstance(c, StateCaptureCache):
            c.clear_captured()


def can_commit_from_captured(caches: list, accepted_len: int) -> bool:
    """Whether every cache can keep exactly ``accepted_len`` tokens of the
    last forward without a replay."""
    for c in caches:
        if c.is_trimmable():
            continue
        if not isinstance(c, StateCaptureCache) or c.captured is None:
            return False
        if len(c.captured) < accepted_len:
            return False
    return True


def commit_verified_prefix(caches: list, verified_len: int, accepted_len: int) -> bool:
    """Keep the first ``accepted_len`` of the ``verified_len`` tokens that the
    last forward fed.

    Attention caches trim the rejected suffix; recurrent caches take the
    state captured after token ``accepted_len - 1``.

    Returns:
        False (and changes nothing) when a recurrent cache captured no states
        in that forward; the caller then restores a snapshot and replays.
    """
    return _commit(caches, verified_len, accepted_len, row=None)


def commit_by_replay(model, caches: list, snaps: list[CacheSnapshot], tokens: mx.array) -> mx.array:
    """Fallback commit: restore the pre-verify snapshot and feed the accepted
    tokens again.

    Args:
        model: Callable ``model(inputs, cache=...)`` (the main trunk).
        caches: The caches to rebuild.
        snaps: Snapshot taken before the verify forward.
        tokens: Accepted inputs, ``[1, n]``.

    Returns:
        The model's output for ``tokens`` (evaluated lazily by the caller).
    """
    restore(caches, snaps)
    return model(tokens, cache=caches)


def tile_caches(caches: list, paths: int) -> None:
    """Repeat every batch-1 cache along the batch axis to ``paths`` rows."""
    if paths < 1:
        raise ValueError(f"paths must be >= 1, got {paths}")
    for c in caches:
        _check_supported(c)
        if isinstance(c, KVCache):
            if c.keys is None:
                continue
            _require_batch1(c.keys, c)
            # Whole buffers, spare capacity included, so the verify forward's
            # write fits without another reallocation.
            c.keys = mx.repeat(c.keys, paths, axis=0)
            c.values = mx.repeat(c.values, paths, axis=0)
        else:
            for x in c.cache:
                if x is not None:
                    _require_batch1(x, c)
            c.cache = [None if x is None else mx.repeat(x, paths, axis=0) for x in c.cache]


def commit_tree_row(caches: list, verified_len: int, accepted_len: int, row: int) -> bool:
    """Keep row ``row`` of a batched verify forward, ``accepted_len`` tokens
    long; caches return to batch 1.

    Returns:
        False (and changes nothing) when a recurrent cache captured no states.
    """
    return _commit(caches, verified_len, accepted_len, row=row)


def _commit(caches: list, verified_len: int, accepted_len: int, row: int | None) -> bool:
    """Shared commit: trim KV, take the recurrent state captured after token ``accepted_len - 1``;
    with ``row``, keep only that batch row."""
    _check_lengths(verified_len, accepted_len)
    if not can_commit_from_captured(caches, accepted_len):
        return False
    rejected = verified_len - accepted_len
    for c in caches:
        if c.is_trimmable():
            c.trim(rejected)
            if row is not None and c.keys is not None:
                _check_row(row, c.keys.shape[0])
                c.keys = c.keys[row : row + 1]
                c.values = c.values[row : row + 1]
        else:
            conv, ssm = c.captured[accepted_len - 1]
            if row is not None:
                _check_row(row, ssm.shape[0])
                conv, ssm = conv[row : row + 1], ssm[row : row + 1]
            c.cache = [conv, ssm]
            c.clear_captured()
    return True


def cache_batch_size(caches: list) -> int:
    for c in caches:
        if isinstance(c, KVCache) and c.keys is not None:
            return c.keys.shape[0]
        if isinstance(c, ArraysCache) and c.cache[0] is not None:
            return c.cache[0].shape[0]
    return 1


def _check_lengths(verified_len: int, accepted_len: int) -> None:
    if not 1 <= accepted_len <= verified_len:
        raise ValueError(
            f"accepted_len must be in 1..verified_len ({verified_len}), got {accepted_len}"
        )


def _check_row(row: int, rows: int) -> None:
    if not 0 <= row < rows:
        raise ValueError(f"row {row} out of range for a batch of {rows}")


def _require_batch1(x: mx.array, cache) -> None:
    if x.shape[0] != 1:
        raise ValueError(
            f"tile_caches needs batch-1 caches; {type(cache).__name__} has batch {x.shape[0]}"
        )
