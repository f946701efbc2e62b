"""`BatchKVCache`'s RoPE offsets: one int while every row is at the same
position, else one per row."""

import mlx.core as mx

from mtp_engine.cache.batch import BatchKVCache


def _write(cache: BatchKVCache, rows: int, n: int) -> None:
    cache.update_and_fetch(mx.zeros((rows, 2, n, 4)), mx.zeros((rows, 2, n, 4)))


def test_offsets_follow_each_rows_kept_entries_and_layers_share_one_array():
    layers = [BatchKVCache(3) for _ in range(2)]
    for c in layers:
        _write(c, 3, 4)
    assert layers[0].offset == layers[1].offset == 4  # every row at one position
    for c in layers:
        c.settle([4, 1, 2], 4)
    assert layers[0].offset.tolist() == [4, 1, 2]
    assert layers[1].offset is layers[0].offset
    _write(layers[0], 3, 2)  # one layer ahead of the other within a forward
    assert layers[0].offset.tolist() == [6, 3, 4]
    assert layers[1].offset.tolist() == [4, 1, 2]
    layers[0].rewind(4, [4, 1, 2])
    assert layers[0].offset.tolist() == [4, 1, 2]
