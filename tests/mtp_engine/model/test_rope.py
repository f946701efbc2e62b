"""`BatchRoPE`: a batch's rows rotated in launches MLX's CUDA backend can make."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_engine.model.rope import (
    BatchRoPE,
    install_batch_rope,
    is_plain_rope,
    rows_per_launch,
)
from mtp_engine.model.swap import share_weights
from mtp_engine.backend import is_cuda_backend

ON_CUDA = is_cuda_backend()
# (rows, heads, tokens a row, rotated dims): whether one launch failed on the H200 (MLX 0.32.4)
H200 = {(128, 4, 1, 4): True, (128, 1, 1, 16): True, (128, 2, 1, 16): True, (32, 16, 1, 4): True,
        (32, 16, 4, 4): True, (256, 4, 4, 4): True, (64, 4, 1, 16): False, (16, 16, 1, 4): False,
        (32, 16, 4, 16): False, (256, 16, 1, 64): False, (128, 1, 4, 16): False, (64, 2, 4, 4): False}


@pytest.mark.parametrize("case", sorted(H200), ids=str)
def test_launch_rule_predicts_what_failed_on_the_h200(case):
    rows, heads, length, dims = case
    fits = rows_per_launch((rows, heads, length, 4 * dims), dims) == rows
    assert fits != H200[case]


@pytest.mark.parametrize("heads,dims,offset", [(4, 4, "rows"), (16, 16, "rows"), (4, 4, 5), (2, 64, "rows")])
def test_sliced_rows_equal_rows_rotated_alone(heads, dims, offset):
    rope = share_weights(BatchRoPE, nn.RoPE(dims, base=10000.0))
    rows = 137
    x = mx.random.normal((rows, heads, 1, 4 * dims), key=mx.random.key(heads))
    offsets = mx.arange(rows, dtype=mx.int32) * 7 % 300 if offset == "rows" else offset
    got = rope(x, offset=offsets)
    one = lambda i: offsets[i : i + 1] if offset == "rows" else offsets  # noqa: E731
    want = mx.concatenate([nn.RoPE.__call__(rope, x[i : i + 1], one(i)) for i in range(rows)], axis=0)
    assert mx.array_equal(got, want).item()
    if offset == "rows":  # each row at its own position, not the first row's
        assert not mx.allclose(got[1:2], nn.RoPE.__call__(rope, x[1:2], offsets[:1])).item()


def test_install_swaps_every_rope_and_keeps_settings(tiny_engine):
    ropes = [m for _, m in tiny_engine.model.named_modules() if isinstance(m, nn.RoPE)]
    assert ropes and all(type(r) is (BatchRoPE if ON_CUDA else nn.RoPE) for r in ropes)  # installed on CUDA only
    model = type(tiny_engine.model)(tiny_engine.model.args)
    swapped = install_batch_rope(model)
    installed = [m for _, m in model.named_modules() if isinstance(m, nn.RoPE)]
    assert swapped == len(installed) > 0 and all(type(r) is BatchRoPE and is_plain_rope(r) for r in installed)
    first = ropes[0]
    assert (installed[0].dims, installed[0].base, installed[0].traditional) == (first.dims, first.base, first.traditional)
