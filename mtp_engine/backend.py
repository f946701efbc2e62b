"""Which MLX backend computes, the process settings MLX reads from the
environment, and where CUDA compiles from and into. The bottom of the package: it imports nothing of it, and MLX
only inside functions (``import mtp_engine`` routes the CPU BLAS before MLX
loads)."""

from __future__ import annotations

import os
from pathlib import Path

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"
"""MLX's own switch for cuDNN attention on CUDA, which `apply_process_settings`
sets from `EngineOptions.cudnn_attention` unless the user set it."""

TF32 = "MLX_ENABLE_TF32"
"""MLX's own switch (default on) for computing float32 matrix products on
CUDA through TF32, a 10-bit mantissa (docs/BACKENDS.md)."""


def is_cuda_backend() -> bool:
    """Whether MLX computes on its CUDA backend (the default device is a GPU
    and MLX was built for CUDA), where the CUDA fast paths can run."""
    import mlx.core as mx  # here, not at the top: `mtp_engine` routes the CPU BLAS before MLX loads

    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def kernel_cache_dir() -> Path:
    """Where the engine's compiled CUDA kernels are kept (`mtp_engine.kernels.cuda_build`):
    ``$MTP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/mtp_engine/cuda`` (``~/.cache/mtp_engine/cuda``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp_engine" / "cuda"
    return Path(os.environ.get("MTP_KERNEL_CACHE") or cache)


def cuda_homes() -> list[str]:
    """CUDA toolkits whose headers a kernel compile may use, in MLX's order:
    ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``."""
    return [home for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if home] + ["/usr/local/cuda"]


def cudnn_attention_on() -> bool:
    """Whether MLX's CUDA backend uses cuDNN attention (its own default: on)."""
    return os.environ.get(CUDNN_ATTENTION, "1") != "0"


def mlx_settings() -> dict[str, str]:
    """MLX's own environment settings (``MLX_*``) of this process, for a
    benchmark's record: some (``MLX_MAX_OPS_PER_BUFFER``, the CUDA graph
    size) move host time per forward on CUDA."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}


def attention_status():
    """What cuDNN attention ended up as (a `FastPathStatus`)."""
    from mtp_engine.options import FastPathStatus

    if not is_cuda_backend():
        return FastPathStatus("cudnn_attention", "unavailable", "not MLX's CUDA backend")
    on = cudnn_attention_on()
    return FastPathStatus("cudnn_attention", "on" if on else "off", "" if on else "by choice: MLX's own kernels")


def apply_process_settings(options) -> None:
    """Settings MLX reads from the environment once, before its first kernel:
    cuDNN attention on CUDA (a value the user exported is kept)."""
    os.environ.setdefault(CUDNN_ATTENTION, "1" if options.cudnn_attention else "0")


def exact_float32() -> None:
    """Have MLX's CUDA backend compute float32 products in float32, not TF32
    (a value the user exported is kept), before the process's first float32
    product: comparisons of float32 decodings (`jobs audit`) need it."""
    os.environ.setdefault(TF32, "0")
