"""Loading the C++ extensions that ``make install`` builds (``native/``).

Each is loaded at most once per process, on first use (never by ``import
mtp_engine``), and when it cannot be used the reason is kept so the engine
can say why at start (`unavailable_reason`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import mlx.core as mx

_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}


def load_extension(name: str, works: Callable[[ModuleType], bool] | None = None) -> ModuleType | None:
    """The extension module ``name``, or None when it is not built or fails
    ``works(module)`` (a tiny call on MLX's CPU stream; a nanobind ABI
    mismatch with this MLX raises TypeError, RuntimeError or ValueError)."""
    if name not in _loaded:
        _loaded[name] = _load(name, works)
    return _loaded[name][0]


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` could not be loaded (None when it loaded or was never tried)."""
    return _loaded.get(name, (None, None))[1]


def _load(name: str, works) -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        return None, f"not built ({e}); `make install` builds it"
    if works is None:
        return module, None

    try:
        with mx.stream(mx.cpu):
            if works(module):
                return module, None
            return None, f"{name} gives wrong results with this MLX {mx.__version__}; rebuild it (make install)"
    except (TypeError, RuntimeError, ValueError) as e:
        return None, f"{name} does not run with this MLX {mx.__version__} ({type(e).__name__}: {e}); rebuild it"
