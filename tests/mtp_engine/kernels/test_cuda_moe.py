"""The expert-product kernel (`mtp_engine.kernels.cuda_moe`).

Everywhere: its CUDA source runs on the CPU under the SIMT emulator
(`tests/mtp_engine/kernels/simt_emu.h`) and must give mlx-lm's ``SwitchGLU``
values (to the rounding of its own summation order), and a token's rows must
have the same bits whether it comes alone or among many: decoding one token
and verifying it among drafts share that arithmetic, which greedy output
needs. On a CUDA machine the same checks run on the GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models.switch_layers import SwitchGLU

from mtp_engine.kernels import cuda_moe
from mtp_engine.backend import is_cuda_backend
from tests.mtp_engine.kernels import simt

ON_CUDA = is_cuda_backend()
needs_compiler = pytest.mark.skipif(simt.compiler() is None, reason="needs a C++20 compiler for the emulator")


def runs(source, input_names) -> list:
    """The ways to run one of the kernels: ``mx.fast.cuda_kernel``'s call
    run by the emulator everywhere, and the kernel itself (None) on CUDA."""

    def emulated(**launch):
        return simt.run(cuda_moe.header(), source(), input_names, launch["inputs"], cuda_moe.OUTPUT_NAMES,
                        launch["template"], launch["output_shapes"], launch["output_dtypes"],
                        grid=launch["grid"], threadgroup=launch["threadgroup"])

    return [pytest.param(emulated, id="emulated", marks=needs_compiler)] + (
        [pytest.param(None, id="cuda")] if ON_CUDA else [])


RUNS = runs(cuda_moe.source, cuda_moe.INPUT_NAMES)
TILE_RUNS = runs(cuda_moe.tiles_source, cuda_moe.TILE_INPUT_NAMES)


def experts(bits: int, group_size: int, dtype, dim: int = 512, hidden: int = 512, n: int = 8) -> SwitchGLU:
    mx.random.seed(bits + group_size)
    switch = SwitchGLU(dim, hidden, n)
    nn.quantize(switch, group_size=group_size, bits=bits)
    switch.set_dtype(dtype)
    return switch


def in_float32(switch: SwitchGLU, bits: int, group_size: int, dim: int, hidden: int | None = None) -> SwitchGLU:
    """The same experts (their scales exactly) computed in float32."""
    ref = experts(bits, group_size, mx.float32, dim, hidden or dim)
    ref.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                        switch.parameters()))
    return ref


def moe_block(bits: int, dtype):
    """An engine MoE block of the tiny config whose experts are `experts`."""
    from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock

    from mtp_engine.io.tiny import tiny_config
    from mtp_engine.model.moe import EngineSparseMoeBlock
    from mtp_engine.model.swap import share_weights

    block = share_weights(EngineSparseMoeBlock, Qwen3NextSparseMoeBlock(ModelArgs.from_dict(tiny_config())))
    block.switch_mlp = experts(bits, 64, dtype)
    return block


def routing(dim: int, dtype, seed: int = 0):
    """Two tokens routed to 3 of 8 experts: both to experts 0 and 2 (in
    different places), one each to 1 and 5, none to the rest."""
    x = mx.random.normal((2, dim), key=mx.random.key(seed)).astype(dtype)
    return x, mx.array([[0, 1, 2], [2, 0, 5]], dtype=mx.uint32)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("bits, group_size, dtype, dim", [(4, 64, mx.float32, 512), (8, 32, mx.bfloat16, 256)])
def test_kernel_gives_switch_glu_values(run, bits, group_size, dtype, dim):
    """Two tokens routed to 3 of 8 experts (`routing`): mlx-lm's values in float32 (in bfloat16 to its rounding of the
    products and the activation); the first token alone gets the same bits."""
    switch = experts(bits, group_size, dtype, dim, dim)
    assert cuda_moe.fits(switch) is None
    x, indices = routing(dim, dtype, seed=bits)
    ours = cuda_moe.switch_glu(switch, x, indices, run)
    ref = in_float32(switch, bits, group_size, dim)(x.astype(mx.float32), indices)
    assert ours.shape == ref.shape == (2, 3, dim) and ours.dtype == dtype
    scale = mx.abs(ref).max().item()
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.abs(ours.astype(mx.float32) - ref).max().item() <= tol * scale
    alone = cuda_moe.switch_glu(switch, x[:1], indices[:1], run)
    assert mx.array_equal(alone[0], ours[0]).item()


def test_fits_names_what_the_kernel_cannot_run():
    assert cuda_moe.fits(SwitchGLU(512, 512, 4)) == "experts not affine-quantized"
    assert cuda_moe.fits(experts(3, 64, mx.float32)) == "3-bit experts"
    assert cuda_moe.fits(experts(4, 64, mx.float32, dim=384)) == "expert inputs of 384 do not split over a warp"
    assert cuda_moe.fits(experts(4, 64, mx.float32)) is None
    assert cuda_moe.fits(SwitchGLU(512, 512, 4, activation=nn.GELU())) == "experts with a GELU activation"


def test_the_kernel_runs_only_the_blocks_it_fits():
    """A mixed quantization (a 3-bit expert layer beside a 4-bit one): the
    fast path is on for the block it runs and says how many; with none it
    is unavailable and names why."""
    from mtp_engine.model.install import install_moe_kernel
    from mtp_engine.options import EngineOptions

    mixed, head = nn.Module(), nn.Module()
    mixed.layers = [moe_block(4, mx.float32), moe_block(3, mx.float32)]
    status = install_moe_kernel(mixed, head, EngineOptions(), on_cuda=True)
    assert status.state == "on" and "(1 of 2 MoE blocks; the rest keep MLX's)" in status.detail
    assert [b.expert_kernel for b in mixed.layers] == [True, False]
    mixed.layers = mixed.layers[1:]
    status = install_moe_kernel(mixed, head, EngineOptions(), on_cuda=True)
    assert (status.state, status.detail) == ("unavailable", "3-bit experts")
    assert not mixed.layers[0].expert_kernel


def crowded_routing(tokens: int, dim: int, k: int = 3, experts_n: int = 8):
    """``tokens`` routed to ``k`` of ``experts_n`` experts, unevenly: most go
    to experts 0-2 (more than one pass of tiles each), a few to 3-6, none to 7."""
    x = mx.random.normal((tokens, dim), key=mx.random.key(tokens)).astype(mx.bfloat16)
    rows = []
    for i in range(tokens):
        rows.append([0, 1, 2] if i % 4 else [3 + i % 4, 2, 6 - i % 3])
    return x, mx.array(rows, dtype=mx.uint32)[:, :k]


@pytest.mark.parametrize("run", TILE_RUNS)
def test_prefill_kernel_gives_switch_glu_values(run):
    """Tokens crowding three experts (several passes of 8 columns each), a few
    on others, one expert without any: mlx-lm's values to bfloat16's rounding
    of the weights, products and activation; a token's rows have the same
    bits alone as among the rest."""
    dim, hidden = 256, 128
    switch = experts(4, 64, mx.bfloat16, dim, hidden)
    assert cuda_moe.tiles_fit(switch) is None
    x, indices = crowded_routing(36, dim)
    ours = cuda_moe.tiles_switch_glu(switch, x, indices, run)
    want = in_float32(switch, 4, 64, dim, hidden)(x.astype(mx.float32), indices)
    assert ours.shape == want.shape == (36, 3, dim) and ours.dtype == mx.bfloat16
    err = mx.abs(ours.astype(mx.float32) - want).max().item()
    assert err <= 2e-2 * mx.abs(want).max().item(), err
    for i in (0, 5):
        alone = cuda_moe.tiles_switch_glu(switch, x[i:i + 1], indices[i:i + 1], run)
        assert mx.array_equal(alone[0], ours[i]).item()


def test_prefill_kernel_fits_names_what_it_cannot_run():
    assert cuda_moe.tiles_fit(experts(4, 64, mx.bfloat16)) is None
    assert cuda_moe.tiles_fit(experts(4, 64, mx.float32)) == "mlx.core.float32 experts (the tensor cores take bfloat16)"
    assert cuda_moe.tiles_fit(experts(8, 64, mx.bfloat16)) == "8-bit experts"
    assert cuda_moe.tiles_fit(experts(4, 64, mx.bfloat16, dim=320)) == (
        "expert inputs of 320 in groups of 64 do not split into steps of 128")
    per_warp = cuda_moe.TILE_FEATURES["gate_up"]
    block = per_warp * cuda_moe.TILE_WARPS
    assert cuda_moe.tiles_fit(experts(4, 32, mx.bfloat16, hidden=block + 32)) == (
        f"expert outputs of {block + 32} do not split over {cuda_moe.TILE_WARPS} warps of {per_warp}")


def test_the_prefill_kernel_runs_only_the_blocks_it_fits():
    """4-bit bfloat16 experts take the prefill kernel; 8-bit ones beside them
    keep MLX's products, and the status says how many."""
    from mtp_engine.model.install import install_prefill_moe_kernel
    from mtp_engine.options import EngineOptions

    mixed, head = nn.Module(), nn.Module()
    mixed.layers = [moe_block(4, mx.bfloat16), moe_block(8, mx.bfloat16)]
    status = install_prefill_moe_kernel(mixed, head, EngineOptions(), on_cuda=True)
    assert status.state == "on" and "(1 of 2 MoE blocks; the rest keep MLX's)" in status.detail
    assert [b.prefill_kernel for b in mixed.layers] == [True, False]
    status = install_prefill_moe_kernel(mixed, head, EngineOptions(prefill_moe_kernel=False), on_cuda=True)
    assert status.state == "off" and not any(b.prefill_kernel for b in mixed.layers)


@pytest.mark.skipif(not ON_CUDA, reason="runs the kernel on the GPU")
def test_a_prefill_forward_takes_the_tensor_core_kernel():
    """An MoE block of 4-bit bfloat16 experts over a 40-token prefill chunk
    gives mlx-lm's values to bfloat16 rounding."""
    from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock

    from mtp_engine.io.tiny import tiny_config
    from mtp_engine.model.moe import EngineSparseMoeBlock
    from mtp_engine.model.swap import share_weights

    args = ModelArgs.from_dict(tiny_config(num_experts=8, hidden_size=256, moe_intermediate_size=128,
                                           shared_expert_intermediate_size=128))
    theirs = Qwen3NextSparseMoeBlock(args)
    nn.quantize(theirs, group_size=64, bits=4,
                class_predicate=lambda p, m: p.startswith("switch_mlp.") and hasattr(m, "to_quantized"))
    theirs.set_dtype(mx.bfloat16)
    ours = share_weights(EngineSparseMoeBlock, theirs)
    ours.prefill_kernel = True
    x = mx.random.normal((1, 40, 256), key=mx.random.key(7)).astype(mx.bfloat16)
    y, want = ours(x), theirs(x)
    assert y.shape == want.shape and mx.abs(y - want).max().item() <= 3e-2 * mx.abs(want).max().item()
