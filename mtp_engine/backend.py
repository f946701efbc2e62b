"""Backend settings the command-line tools apply before MLX's first kernel.

On MLX's CUDA backend, cuDNN's fused attention builds (and caches) a graph
for every distinct key length it is called with. Plain decoding calls it
rarely (one-query attention uses MLX's own vector kernel until the cache is
long), but a verify forward has K+1 queries and a key length one step longer
than the last, so it builds a new graph every step. On an H200 with the
shipped model, chain K=3 ran at 0.40x plain decoding with cuDNN attention and
1.14x without (`benchmarks/h200/cudnn-*.log`). The tools therefore default
``MLX_CUDA_USE_CUDNN_SDPA`` to 0; a value the user set is kept. Models whose
head dimension is over 128 (Qwen3-Next-80B's is 256) never take the cuDNN
path, so they are unaffected either way. Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"
# Where `make install` builds native/cblas_openblas.c (Linux, CPU backend).
CBLAS_SHIM = Path(sys.prefix) / "lib" / "libmtp_cblas.so"
OPENBLAS = "openblas (scipy-openblas32 via native/cblas_openblas.c)"
BUNDLED = "bundled with mlx"


def prefer_mlx_attention() -> None:
    """Default MLX's CUDA attention to its own kernels (see module doc).

    Call before the first attention runs (MLX reads the variable once)."""
    os.environ.setdefault(CUDNN_ATTENTION, "0")


def cpu_blas() -> str:
    """Which BLAS serves MLX's CPU matmuls in this process: OpenBLAS when
    ``native/cblas_openblas.c`` is preloaded (``make install`` builds it on
    Linux), else the one MLX bundles."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if CBLAS_SHIM.name in maps and "libscipy_openblas" in maps:
        return OPENBLAS
    return BUNDLED


def few_rows() -> int | None:
    """Matmuls of at most this many rows go to the preloaded library's own
    few-row kernel (``native/few_rows.c``; ``MTP_FEW_ROWS``, default 32);
    None when the library is not loaded."""
    if cpu_blas() != OPENBLAS:
        return None
    try:
        return int(ctypes.CDLL(None).mtp_cblas_few_rows())
    except (AttributeError, OSError):
        return None


_extensions: dict[str, ModuleType | None] = {}


def load_extension(name: str, switch: str, works: Callable[[ModuleType], bool] | None = None) -> ModuleType | None:
    """One of the native modules ``make install`` builds (``native/``), loaded
    once per process: None when it is not built, when the environment
    variable ``switch`` is "0", or when ``works(module)`` (a tiny call, run
    on the CPU stream) is false or raises what a nanobind ABI mismatch with
    this MLX raises (TypeError, RuntimeError, ValueError)."""
    if name not in _extensions:
        _extensions[name] = _load(name, switch, works)
    return _extensions[name]


def _load(name: str, switch: str, works) -> ModuleType | None:
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    if works is None:
        return module
    import mlx.core as mx

    try:
        with mx.stream(mx.cpu):
            return module if works(module) else None
    except (TypeError, RuntimeError, ValueError):
        return None
