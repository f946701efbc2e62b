"""Every fast-path switch of the engine, in one validated dataclass.

A fast path replaces an MLX or mlx-lm operation with a faster one that gives
the same tokens (``docs/BACKENDS.md`` lists each, what it replaces and the
test that proves it exact). `EngineOptions` holds one switch per fast path;
``MTPEngine.load(path, options=...)``, the engine and ``python -m jobs
--fast-path NAME=VALUE`` take it. A switch left at its default means "on
wherever it is available"; the engine reports what each one ended up as
(`FastPathStatus`), and a job logs that at start.

The environment variables below are the only ones the package reads. Each
maps onto the default of one field (`EngineOptions.from_env`); nothing else
reads ``os.environ`` (but `mlx_settings`, which records MLX's own for
benchmarks). This module imports no MLX (``import mtp_engine`` reads
``MTP_CPU_BLAS`` before MLX is imported).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

ENVIRONMENT: dict[str, tuple[str, str]] = {
    # name: (EngineOptions field, what it does)
    "MTP_CPU_BLAS": ("cpu_blas", "0: leave MLX's CPU matmuls on the BLAS MLX bundles. Read when "
                                 "mtp_engine is imported (the route is set up before MLX loads)."),
    "MTP_FEW_ROWS": ("few_rows", "products of at most this many rows take the few-row kernel (0: none)"),
    "MTP_CPU_RECURRENCE": ("cpu_recurrence", "0: mlx-lm's ops for the gated-delta recurrence on the CPU"),
    "MTP_CPU_ACTIVATIONS": ("cpu_activations", "0: MLX's own SiLU, sigmoid and softmax on the CPU"),
    "MTP_CPP_DRAFTER": ("cpp_drafter", "0: draft with the MLX head instead of the C++ head on the CPU"),
}

MAX_DRAFT_TOKENS = 16
"""Most drafts a chain verifies in one step (K in 1..16)."""

MAX_VERIFY_WIDTH = MAX_DRAFT_TOKENS + 1
"""Widest verify forward, in tokens a row: the last token and K drafts (and
the most pairs a head forward consumes after a commit). Every path that
decoding and verify forwards must share, or that only they take (the MoE
kernel, compiled layers and head, layer dispatch), covers widths up to this
one; wider forwards are prompt prefill."""

CUDA_DISPATCH_MIN_TOKENS = 16
"""Tokens (rows x width) from which a verify forward's layers dispatch on
CUDA (`EngineOptions.layer_dispatch`). On the H200 (80B-A3B shapes) one
sequence's verify forward of 4 tokens took 30 ms a step without dispatch
and 38 ms with it (48 small submissions, no device work to hide); 8 rows of
4 tokens were faster with it (66 against 87 ms). On the CPU every verify
forward dispatches (one sequence: forward(4) 1.09-1.12x forward(1) with,
1.23-1.36x without)."""

GPU_MOE_SORT_MIN = 1024
"""Routed selections from which a GPU's MoE blocks sort their tokens by
expert: prefill chunks do, verify forwards and decoding batches do not."""

GPU_MOE_GROUP_MIN = 1024
"""Routed selections from which `EngineOptions.grouped_moe` runs each
expert's tokens in blocks: at top-10 routing, prompt prefill chunks do (and,
with `EngineOptions.moe_kernel` off, verify forwards of 32 rows x 4 tokens,
1280); decoding batches of 32 rows (320), where MLX's own products were
faster on the H200, do not."""

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"
"""MLX's own switch for cuDNN attention on CUDA, which `apply_process_settings`
sets from `EngineOptions.cudnn_attention` unless the user set it."""

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE + _FALSE)}, got {text!r}")


def env_flag(name: str, default: bool = True) -> bool:
    """A declared boolean environment variable (see `ENVIRONMENT`)."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not a declared environment variable")
    text = os.environ.get(name)
    return default if text is None or text == "" else parse_bool(name, text)


@dataclass(frozen=True)
class EngineOptions:
    """Fast-path switches. None means "the backend's default" (given with
    each field); True or False forces it (a forced path that cannot run is
    reported unavailable, never an error).

    Attributes:
        cpu_blas: MLX's CPU sgemm through the few-row kernel and OpenBLAS
            (process-wide; ``native/cpu_blas.c``).
        few_rows: Most rows a product may have to take the few-row kernel.
        cpu_recurrence: The gated-delta recurrence over T tokens as one MLX
            CPU primitive (``native/cpu_recurrence.cpp``).
        cpu_activations: MLX's float32 SiLU, sigmoid and softmax vectorized
            (``native/cpu_activations.cpp``).
        cpp_drafter: Chain and adaptive drafts with the C++ head on the CPU
            backend (``native/cpp_drafter.cpp``).
        cpp_drafter_on_gpu: On a GPU, draft with the C++ head on the host CPU
            while the GPU verifies (pays only for small heads).
        cuda_recurrence: The gated-delta recurrence over T tokens in one CUDA
            launch (``kernels/cuda/gated_delta_tokens.cu``).
        cuda_chain_drafter: A whole chain of drafts in one CUDA launch
            (``kernels/cuda/draft_chain.cu``), for small one-layer MoE heads.
        compile_layers: Compiled decoder layers (None: on the CPU backend).
        compile_head: The MLX head's draft forward compiled (None: where the
            head's RoPE allows it).
        rowwise_linears: Few-row dense products as batched matrix-vector
            products (None: on CUDA).
        flat_quantized: Quantized products over batched rows as one matrix
            (None: on CUDA).
        prefill_dequantized: With ``flat_quantized``, forwards wider than
            `MAX_VERIFY_WIDTH` tokens a row (prompt prefill) take dense
            products of the dequantized weights (None: on CUDA).
        contiguous_moe: MoE routing indices made contiguous once per block.
        moe_sort_min: With ``contiguous_moe``, sort the experts' tokens from
            this many routed (token, expert) selections (None: mlx-lm's 64 on
            the CPU, `GPU_MOE_SORT_MIN` on GPUs).
        grouped_moe: With ``contiguous_moe``, from `GPU_MOE_GROUP_MIN` routed
            selections each expert's tokens run in blocks of rows, so an
            expert's weights are read once per block (None: on CUDA, whose
            ``gather_qmm`` reads them once per selection).
        moe_kernel: With ``contiguous_moe``, forwards of up to
            `MAX_VERIFY_WIDTH` tokens a row (decoding, drafts, verify forwards) run the expert products
            of 4- and 8-bit experts in the engine's CUDA kernel, which reads
            an expert's weights once for several of its tokens (None: on
            CUDA); prefill takes ``prefill_moe_kernel`` or ``grouped_moe``.
        prefill_moe_kernel: With ``contiguous_moe``, forwards wider than
            `MAX_VERIFY_WIDTH` tokens a row (prompt prefill) run the expert
            products of bfloat16 models with 4-bit experts on the tensor
            cores (``kernels/cuda/moe_tiles.cu``), each expert's weights read
            once for up to 32 of its tokens (None: on CUDA); else
            ``grouped_moe``.
        layer_dispatch: In verify forwards (2 to `MAX_VERIFY_WIDTH` tokens a row;
            on CUDA only those of `CUDA_DISPATCH_MIN_TOKENS` tokens or
            more) each trunk decoder layer hands its output to the device as
            soon as it is built (``mx.async_eval``), so the device computes a
            layer while the host builds the next (not inside ``mx.grad`` or
            ``mx.compile``).
        state_capture: Verify forwards record per-token recurrent states, so
            a commit is a lookup; False snapshots and replays instead.
        cudnn_attention: cuDNN's fused attention on CUDA (MLX's default);
            off by default, see docs/BACKENDS.md.
    """

    cpu_blas: bool = True
    few_rows: int = 32
    cpu_recurrence: bool = True
    cpu_activations: bool = True
    cpp_drafter: bool = True
    cpp_drafter_on_gpu: bool = False
    cuda_recurrence: bool = True
    cuda_chain_drafter: bool = True
    compile_layers: bool | None = None
    compile_head: bool | None = None
    rowwise_linears: bool | None = None
    flat_quantized: bool | None = None
    prefill_dequantized: bool | None = None
    contiguous_moe: bool = True
    moe_sort_min: int | None = None
    grouped_moe: bool | None = None
    moe_kernel: bool | None = None
    prefill_moe_kernel: bool | None = None
    layer_dispatch: bool = True
    state_capture: bool = True
    cudnn_attention: bool = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "few_rows":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 256:
                    raise ValueError(f"few_rows must be an int in 0..256, got {value!r}")
            elif f.name == "moe_sort_min":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"moe_sort_min must be a positive int or None, got {value!r}")
            elif f.type == "bool | None":
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be True, False or None, got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")

    @classmethod
    def from_env(cls, **overrides) -> "EngineOptions":
        """Defaults, then the declared environment variables, then ``overrides``."""
        values: dict = {}
        for name, (field_name, _) in ENVIRONMENT.items():
            text = os.environ.get(name)
            if text is None or text == "":
                continue
            if field_name == "few_rows":
                try:
                    values[field_name] = int(text)
                except ValueError:
                    raise ValueError(f"{name} must be an integer, got {text!r}") from None
            else:
                values[field_name] = parse_bool(name, text)
        return cls(**values).with_switches(**overrides)

    def with_switches(self, **switches) -> "EngineOptions":
        """A copy with some switches changed; unknown names are a ValueError
        (the older keyword names in `RENAMED` are taken too)."""
        switches = {RENAMED.get(k, k): v for k, v in switches.items()}
        known = {f.name for f in fields(self)}
        unknown = sorted(set(switches) - known)
        if unknown:
            raise ValueError(f"unknown fast-path switch {unknown[0]!r}; choose from {', '.join(sorted(known))}")
        return replace(self, **switches)

    @classmethod
    def parse_switch(cls, text: str) -> tuple[str, object]:
        """``NAME=VALUE`` (the CLI's ``--fast-path``) as a field and a value:
        on/off/true/false/1/0 for switches, ``auto`` for the backend
        default of the None-able ones, an integer for ``few_rows``."""
        name, sep, value = text.partition("=")
        name = name.strip().replace("-", "_")
        types = {f.name: f.type for f in fields(cls)}
        if not sep or name not in types:
            raise ValueError(f"--fast-path takes NAME=VALUE with NAME one of {', '.join(types)}; got {text!r}")
        if name in ("few_rows", "moe_sort_min"):
            if name == "moe_sort_min" and value.strip().lower() == "auto":
                return name, None
            try:
                return name, int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if types[name] == "bool | None" and value.strip().lower() == "auto":
            return name, None
        return name, parse_bool(name, value)


RENAMED = {"use_checkpoints": "state_capture", "host_drafts": "cpp_drafter_on_gpu", "draft_kernel": "cuda_chain_drafter"}
"""Keyword names the engine took before `EngineOptions` existed."""


@dataclass(frozen=True)
class FastPathStatus:
    """What one fast path ended up as in a loaded engine.

    Attributes:
        name: The `EngineOptions` field.
        state: "on", "off" (by choice, or the backend's default) or
            "unavailable" (wanted, but it cannot run here).
        detail: What it does here, or why it is off or unavailable.
    """

    name: str
    state: str
    detail: str = ""

    def line(self) -> str:
        return f"fast path {self.name}: {self.state}" + (f" ({self.detail})" if self.detail else "")


def is_cuda_backend() -> bool:
    """Whether MLX computes on its CUDA backend (the default device is a GPU
    and MLX was built for CUDA), where the CUDA fast paths can run."""
    import mlx.core as mx  # here, not at the top: `mtp_engine` routes the CPU BLAS before MLX loads

    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def cudnn_attention_on() -> bool:
    """Whether MLX's CUDA backend uses cuDNN attention (its own default: on)."""
    return os.environ.get(CUDNN_ATTENTION, "1") != "0"


def mlx_settings() -> dict[str, str]:
    """MLX's own environment settings (``MLX_*``) of this process, for a
    benchmark's record: some (``MLX_MAX_OPS_PER_BUFFER``, the CUDA graph
    size) move host time per forward on CUDA."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}


def apply_process_settings(options: EngineOptions) -> None:
    """Settings MLX reads from the environment once, before its first kernel:
    cuDNN attention on CUDA (a value the user exported is kept)."""
    os.environ.setdefault(CUDNN_ATTENTION, "1" if options.cudnn_attention else "0")
