"""Every expert's quantized products over its routed tokens, in two CUDA launches.

Two kernels: `switch_glu` for decoding and verify forwards (a few tokens a
row) and `tiles_switch_glu` for prompt prefill (many tokens an expert).

MLX 0.32's CUDA ``gather_qmm`` computes one single-row product per (token,
expert) selection, so each selection reads its expert's weights again: at
top-10 routing a decoding batch of 32 rows reads 320 experts' weights where
about 240 distinct ones would do, and a verify forward of 32 x 4 tokens reads
1280. This kernel (``cuda/moe_products.cu``) runs over the selections sorted
by expert, a few consecutive ones per warp, and reads each expert's weights
among them once. `switch_glu` is the whole ``SwitchGLU``: gate and up
products with the activation in one launch, the down product in a second
that writes the rows back in routing order. The sort and the experts'
positions stay on the device (no read-back), so compiled code can run it.

A selection's value does not depend on which other selections share the
launch, so one-token decoding and a verify forward of the same token give
the same bits (MLX's sorted and unsorted products need not).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU

from mtp_engine.kernels.cuda_build import CudaKernel

SOURCES = Path(__file__).parent / "cuda"

ROWS = 4
"""Consecutive sorted selections a warp runs, reading each expert's weights
among them once. More share fewer reads but hold more registers (the
measured choice: docs/BACKENDS.md, "Tuning constants")."""

WARPS = 8
"""Warps per thread block."""


def _features_per_warp(k: int) -> int:
    # One output feature a warp over long rows (the gate and up products,
    # run together), two over short ones (the down product).
    return 1 if k >= 1024 else 2


def _activation_reason(switch) -> str | None:
    """Why both kernels cannot run ``switch``'s activation (they compute
    mlx-lm's SwiGLU), or None."""
    if not isinstance(switch.activation, SwiGLU):
        return f"experts with a {type(switch.activation).__name__} activation"
    return None


def _affine_reason(linear) -> str | None:
    """Why both kernels cannot run one of the expert products ``linear``
    (they take affine-quantized weights without a bias), or None."""
    if getattr(linear, "mode", "affine") != "affine" or getattr(linear, "biases", None) is None:
        return "experts not affine-quantized"
    if "bias" in linear:
        return "experts with a bias"
    return None


def fits(switch) -> str | None:
    """None when ``switch`` (an mlx-lm ``SwitchGLU``) has experts the kernel
    runs, else why not."""
    if why := _activation_reason(switch):
        return why
    gate, up, down = switch.gate_proj, switch.up_proj, switch.down_proj
    for linear in (gate, up, down):
        if why := _affine_reason(linear):
            return why
        if linear.bits not in (4, 8):
            return f"{linear.bits}-bit experts"
        n, k = linear.output_dims, linear.input_dims
        per_lane = 16 if linear.bits == 4 else 8  # 8 bytes of packed weights a lane
        if k % (32 * per_lane) or linear.group_size % per_lane:
            return f"expert inputs of {k} do not split over a warp"
        if n % (_features_per_warp(k) * WARPS):
            return f"expert outputs of {n} do not split over {WARPS} warps"
    if (gate.bits, gate.group_size, gate.scales.dtype) != (up.bits, up.group_size, up.scales.dtype):
        return "gate and up experts quantized differently"
    return None


INPUT_NAMES = ["x", "perm", "experts", "w0", "s0", "b0", "w1", "s1", "b1"]
OUTPUT_NAMES = ["y"]


def source() -> str:
    return (SOURCES / "moe_products.cu").read_text()


def header() -> str:
    return (SOURCES / "moe_products.cuh").read_text()


@cache
def kernel():
    """The compiled kernel (``mx.fast.cuda_kernel``'s calling convention). It
    reads ``experts_shape``, which only MLX's wrapper passes, so MLX
    compiles it (once a process), not `cuda_build`."""
    return mx.fast.cuda_kernel(name="mtp_moe_products", input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
                               source=source(), header=header())


def _products(run, x: mx.array, perm: mx.array, experts: mx.array, first, second) -> mx.array:
    k, n = first.input_dims, first.output_dims
    nw = _features_per_warp(k)
    glu = second is not None
    second = second or first
    selections = experts.size
    return run(
        inputs=[x, perm, experts, first.weight, first.scales, first.biases,
                second.weight, second.scales, second.biases],
        template=[("InT", x.dtype), ("ST", first.scales.dtype), ("K", k), ("N", n), ("BITS", first.bits),
                  ("GROUP", first.group_size), ("NW", nw), ("R", ROWS), ("GLU", int(glu))],
        grid=(32, n // nw, -(-selections // ROWS)),
        threadgroup=(32, WARPS, 1),
        output_shapes=[(selections, n)],
        output_dtypes=[x.dtype],
    )[0]


def switch_glu(switch, x: mx.array, indices: mx.array, run=None) -> mx.array:
    """mlx-lm's ``SwitchGLU`` (quantized experts that `fits` accepts) over
    ``x`` ``[..., dim]`` routed to ``indices`` ``[..., k]``: ``[..., k, dim]``.
    ``run`` stands in for `kernel` (the tests' emulator)."""
    run = run or kernel()
    k, dim = indices.shape[-1], x.shape[-1]
    flat = indices.flatten().astype(mx.int32)
    order = mx.argsort(flat).astype(mx.int32)  # the selections sorted by expert
    experts = flat[order]
    hidden = _products(run, x.reshape(-1, dim), order // k, experts, switch.gate_proj, switch.up_proj)
    y = _products(run, hidden, order, experts, switch.down_proj, None)
    return y.reshape(*indices.shape, y.shape[-1])


TILE_WARPS = 4
"""Warps per thread block of the prefill kernel."""

TILE_FEATURES = {"gate_up": 16, "down": 32}
"""Output features a warp of the prefill kernel owns (16 or 32: one or two
tensor-core products per token fragment it loads), per launch (the
measured choice: docs/BACKENDS.md, "Tuning constants")."""

TILE_INPUT_NAMES = ["x", "perm", "starts", "counts", "w0", "s0", "b0", "w1", "s1", "b1"]


def tiles_fit(switch) -> str | None:
    """None when the prefill kernel (``cuda/moe_tiles.cu``) runs ``switch``'s
    experts, else why not: bfloat16 models with 4-bit affine experts whose
    inputs are whole steps of 128 and outputs whole blocks of
    ``TILE_FEATURES * TILE_WARPS``."""
    if why := _activation_reason(switch):
        return why
    gate, up, down = switch.gate_proj, switch.up_proj, switch.down_proj
    per_warp = TILE_FEATURES["gate_up"]
    for linear, features in ((gate, per_warp), (up, per_warp), (down, TILE_FEATURES["down"])):
        if why := _affine_reason(linear):
            return why
        if linear.bits != 4:
            return f"{linear.bits}-bit experts"
        if linear.scales.dtype != mx.bfloat16:
            return f"{linear.scales.dtype} experts (the tensor cores take bfloat16)"
        n, k = linear.output_dims, linear.input_dims
        if k % 128 or linear.group_size % 32:
            return f"expert inputs of {k} in groups of {linear.group_size} do not split into steps of 128"
        if n % (features * TILE_WARPS):
            return f"expert outputs of {n} do not split over {TILE_WARPS} warps of {features}"
    if gate.group_size != up.group_size:
        return "gate and up experts quantized differently"
    return None


@cache
def tiles_kernel():
    """The compiled prefill kernel (``mx.fast.cuda_kernel``'s calling convention)."""
    return CudaKernel(name="moe_tiles", input_names=TILE_INPUT_NAMES, output_names=OUTPUT_NAMES,
                      source=tiles_source(), header=header())


def tiles_source() -> str:
    return (SOURCES / "moe_tiles.cu").read_text()


def tiles_per_pass(selections: int, experts: int) -> int:
    """Token tiles of 8 a warp runs per pass over its weights: enough for
    an expert's average share of ``selections``, at most 4 (32 tokens; 8
    were slower: docs/BACKENDS.md, "Tuning constants")."""
    mean = -(-selections // experts)
    return next(t for t in (1, 2, 4) if 8 * t >= mean or t == 4)


def _tile_products(run, x, perm, starts, counts, first, second, tiles: int, features: int) -> mx.array:
    k, n = first.input_dims, first.output_dims
    glu = second is not None
    second = second or first
    return run(
        inputs=[x, perm, starts, counts, first.weight, first.scales, first.biases,
                second.weight, second.scales, second.biases],
        template=[("InT", x.dtype), ("ST", first.scales.dtype), ("K", k), ("N", n), ("GROUP", first.group_size),
                  ("GLU", int(glu)), ("FR", features // 16), ("TILES", tiles)],
        grid=(32, n // features, first.num_experts),
        threadgroup=(32, TILE_WARPS, 1),
        output_shapes=[(perm.size, n)],
        output_dtypes=[x.dtype],
    )[0]


def tiles_switch_glu(switch, x: mx.array, indices: mx.array, run=None) -> mx.array:
    """`switch_glu` on the tensor cores, for bfloat16 ``x`` and experts that
    `tiles_fit` accepts: ``[..., k, dim]``. ``run`` stands in for
    `tiles_kernel` (the tests' emulator)."""
    run = run or tiles_kernel()
    k, dim = indices.shape[-1], x.shape[-1]
    experts = switch.gate_proj.num_experts
    flat = indices.flatten().astype(mx.int32)
    order = mx.argsort(flat).astype(mx.int32)  # the selections sorted by expert
    counts = mx.zeros((experts,), mx.int32).at[flat].add(1)
    starts = (mx.cumsum(counts) - counts).astype(mx.int32)
    tiles = tiles_per_pass(flat.size, experts)
    hidden = _tile_products(run, x.reshape(-1, dim), order // k, starts, counts, switch.gate_proj, switch.up_proj,
                            tiles, TILE_FEATURES["gate_up"])
    y = _tile_products(run, hidden, order, starts, counts, switch.down_proj, None, tiles, TILE_FEATURES["down"])
    return y.reshape(*indices.shape, y.shape[-1])
