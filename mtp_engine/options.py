"""Every fast-path switch of the engine, in one validated dataclass.

A fast path replaces an MLX or mlx-lm operation with a faster one that gives
the same tokens (``docs/BACKENDS.md`` lists each, what it replaces and the
test that proves it exact). A switch left at its default means "on wherever
it is available"; the engine reports what each one ended up as
(`FastPathStatus`). `ENVIRONMENT` declares the only environment variables
the package reads. This module imports no MLX (``import mtp_engine`` reads
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
"""Widest verify forward, in tokens a row (and the most pairs a head forward
consumes after a commit). Every fast path of decoding and verify forwards
covers widths up to this one; wider forwards are prompt prefill."""

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def env_flag(name: str) -> bool:
    """A declared boolean environment variable (`ENVIRONMENT`), or its field's default when unset."""
    field = ENVIRONMENT[name][0]
    text = os.environ.get(name)
    return _parse(field, text, name) if text else getattr(EngineOptions, field)


@dataclass(frozen=True)
class EngineOptions:
    """Fast-path switches (docs/BACKENDS.md says what each replaces, where it
    is on and the test that proves it exact). None means "the backend's
    default" (given with each field); True or False forces it (a forced path
    that cannot run is reported unavailable, never an error)."""

    cpu_blas: bool = True  # MLX's CPU sgemm through the few-row kernel and OpenBLAS, process-wide
    few_rows: int = 32  # products of at most this many rows take the few-row kernel
    cpu_recurrence: bool = True  # the gated-delta recurrence over T tokens as one CPU primitive
    cpu_activations: bool = True  # MLX's float32 SiLU, sigmoid and softmax vectorized
    cpp_drafter: bool = True  # greedy chain and adaptive drafts with the C++ head on the CPU backend
    cpp_drafter_on_gpu: bool = False  # the same on the host CPU of a GPU
    cuda_recurrence: bool = True  # the gated-delta recurrence as one CUDA launch
    cuda_chain_drafter: bool = True  # every row's chain of drafts (greedy, exact sampler) in one CUDA launch
    compile_layers: bool | None = None  # compiled decoder layers (None: on the CPU backend)
    compile_head: bool | None = None  # compiled draft forward (None: where the head's RoPE allows it)
    rowwise_linears: bool | None = None  # few-row dense products (None: on CUDA)
    flat_quantized: bool | None = None  # batched quantized products (None: on CUDA)
    prefill_dequantized: bool | None = None  # prefill's 4-bit products as dense ones (None: on CUDA)
    contiguous_moe: bool = True  # MoE routing indices made contiguous once
    moe_sort_min: int | None = None  # tokens sorted by expert from this many selections (None: 64 CPU, 1024 GPU)
    grouped_moe: bool | None = None  # experts' tokens in blocks (None: on CUDA)
    moe_kernel: bool | None = None  # the expert kernel of decoding widths (None: on CUDA)
    prefill_moe_kernel: bool | None = None  # the expert kernel of prefill (None: on CUDA)
    layer_dispatch: bool = True  # verify forwards hand each trunk layer to the device as soon as it is built
    cudnn_attention: bool = False  # cuDNN's fused attention on CUDA (MLX's default)

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), _KINDS.get(f.name, f.type)
            if kind == "count":
                ok = not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= 256
            elif kind == "count | None":
                ok = value is None or (not isinstance(value, bool) and isinstance(value, int) and value >= 1)
            else:
                ok = isinstance(value, bool) or (value is None and kind == "bool | None")
            if not ok:
                raise ValueError(f"{f.name} must be {_EXPECTED[kind]}, got {value!r}")

    @classmethod
    def from_env(cls, **overrides) -> "EngineOptions":
        """Defaults, then the declared environment variables, then ``overrides``."""
        values = {name: _parse(name, os.environ[var], var) for var, (name, _) in ENVIRONMENT.items()
                  if os.environ.get(var)}
        return cls(**values).with_switches(**overrides)

    def with_switches(self, **switches) -> "EngineOptions":
        """A copy with some switches changed; unknown names are a ValueError."""
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
        if not sep or name not in {f.name for f in fields(cls)}:
            raise ValueError(f"--fast-path takes NAME=VALUE with NAME one of "
                             f"{', '.join(f.name for f in fields(cls))}; got {text!r}")
        return name, _parse(name, value)


_KINDS = {"few_rows": "count", "moe_sort_min": "count | None"}
_EXPECTED = {"count": "an int in 0..256", "count | None": "a positive int or None",
             "bool": "True or False", "bool | None": "True, False or None"}


def _parse(name: str, text: str, label: str | None = None) -> int | bool | None:
    """A field's value from text (``label``, default the field's name, names
    it in errors): an integer for counts, a boolean for switches, ``auto``
    (None) where the field takes None."""
    label = label or name
    kind = _KINDS.get(name) or next(f.type for f in fields(EngineOptions) if f.name == name)
    value = text.strip().lower()
    if kind.endswith("None") and value == "auto":
        return None
    if kind.startswith("count"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{label} must be an integer, got {text!r}") from None
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{label} must be one of {'/'.join(_TRUE + _FALSE)}, got {text!r}")
    return value in _TRUE


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
