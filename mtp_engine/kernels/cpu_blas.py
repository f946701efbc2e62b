"""MLX's CPU matmuls routed to a few-row kernel and OpenBLAS.

MLX's Linux CPU wheel links the reference BLAS, whose sgemm is slow, and
binds ``cblas_sgemm`` when ``mlx.core`` is imported. ``libmtp_cpu_blas.so``
(``native/cpu_blas.c``, built by ``make install``) defines that symbol. Loaded
into the process's global symbol scope *before* MLX, it is what MLX binds:
products of few rows go to ``native/few_rows.c`` (every row rounded as a
one-row product, so verify forwards equal token-by-token decoding bit for
bit), larger ones to OpenBLAS. `route_before_mlx` does that; ``import
mtp_engine`` calls it first thing, so every way of starting Python that
imports the package before MLX runs at the same speed. `configure` then
switches the route at run time (few-row limit, or back to the bundled BLAS).

This module imports no MLX at import time (it must run before it).
"""

from __future__ import annotations

import ctypes
import platform
import sys
import sysconfig
from pathlib import Path

LIBRARY = "libmtp_cpu_blas.so"
OPENBLAS = "openblas"
BUNDLED = "bundled"

IMPORTED_TOO_LATE = "mlx.core was imported before mtp_engine, so MLX bound its own BLAS; import mtp_engine first"

_library: ctypes.CDLL | None = None
_reason: str | None = "not tried yet"


def library_path() -> Path:
    """Where ``make install`` builds the library (this environment's site-packages)."""
    return Path(sysconfig.get_paths()["platlib"]) / LIBRARY


def route_before_mlx(enabled: bool = True) -> None:
    """Load the library into the global symbol scope, unless MLX is already
    imported (then MLX has bound its own BLAS, and the reason is kept)."""
    global _library, _reason
    if _library is not None:
        return
    if not enabled:
        _reason = "off by MTP_CPU_BLAS=0 (read when mtp_engine is imported)"
        return
    if platform.system() != "Linux":
        _reason = "only built for Linux (MLX's macOS wheel uses Accelerate)"
        return
    path = library_path()
    if not path.exists():
        _reason = f"not built ({path} missing); `make install` builds it"
        return
    if "mlx.core" in sys.modules:
        _reason = IMPORTED_TOO_LATE
        return
    try:
        _library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _reason = f"cannot load {path}: {e}"
        return
    _reason = None


def unavailable_reason() -> str | None:
    """Why the route is not in place (None when it is)."""
    return _reason


def _bundled_blas() -> str | None:
    """The file of the BLAS MLX links (it is loaded once mlx.core is)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        name = line.split()[-1]
        if "/libblas" in name and ".so" in name:
            return name
    return None


def configure(enabled: bool, few_rows: int) -> str:
    """Set the route: ``enabled`` takes the few-row kernel (up to
    ``few_rows`` rows, 0 for none) and OpenBLAS; otherwise the bundled BLAS.
    Returns which one serves MLX's matmuls now (`OPENBLAS` or `BUNDLED`)."""
    if _library is None:
        return BUNDLED
    if enabled:
        _library.mtp_cpu_blas_set_route(1, int(few_rows))
        return OPENBLAS
    bundled = _bundled_blas()
    if bundled is None or _library.mtp_cpu_blas_set_reference(bundled.encode()) != 0:
        raise RuntimeError(f"cannot find the BLAS MLX bundles (looked for libblas in /proc/self/maps: {bundled})")
    _library.mtp_cpu_blas_set_route(0, 0)
    return BUNDLED


def active() -> str:
    """Which BLAS serves MLX's CPU matmuls now."""
    if _library is None or _library.mtp_cpu_blas_route() == 0:
        return BUNDLED
    return OPENBLAS


def few_rows() -> int | None:
    """The few-row kernel's row limit, or None when the route is not active."""
    return int(_library.mtp_cpu_blas_few_rows()) if active() == OPENBLAS else None


def calls() -> int:
    """sgemm calls the library has served (0 when it is not loaded): a
    matmul that raises it went through the route."""
    if _library is None:
        return 0
    _library.mtp_cpu_blas_calls.restype = ctypes.c_longlong
    return int(_library.mtp_cpu_blas_calls())


def status(options):
    """What the route ended up as for an engine's ``options`` (a
    `FastPathStatus`), configuring it; a route lost by importing MLX first
    is also a warning (CPU decoding then runs several times slower)."""
    import warnings

    import mlx.core as mx

    from mtp_engine.options import FastPathStatus

    if mx.default_device() != mx.cpu:
        return FastPathStatus("cpu_blas", "unavailable", "not MLX's CPU backend")
    why = unavailable_reason()
    if why == IMPORTED_TOO_LATE and options.cpu_blas:
        warnings.warn(f"cpu_blas fast path unavailable: {why} (CPU decoding runs several times slower)",
                      RuntimeWarning, stacklevel=4)  # the caller of MTPEngine.load
    if why is not None:
        return FastPathStatus("cpu_blas", "off" if why.startswith("off by") else "unavailable", why)
    if configure(options.cpu_blas, options.few_rows) == BUNDLED:
        return FastPathStatus("cpu_blas", "off", "by choice: MLX's bundled BLAS (process-wide)")
    rows = f"products of <= {options.few_rows} rows in the few-row kernel, " if options.few_rows else ""
    return FastPathStatus("cpu_blas", "on", f"{rows}larger ones in OpenBLAS (process-wide)")
