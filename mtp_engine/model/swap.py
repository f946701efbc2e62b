"""Swapping loaded mlx-lm layers for the engine's subclasses, in place.

Nothing is patched at import: each install function walks one loaded model
instance and replaces layers with instances of a subclass that share their
parameters (`share_weights`), so mlx-lm's classes stay untouched.
"""

from __future__ import annotations

import mlx.nn as nn


def share_weights(cls: type, layer: nn.Module) -> nn.Module:
    """An instance of ``cls`` (a subclass of ``type(layer)``) that shares
    ``layer``'s parameters, submodules and settings, copying nothing."""
    new = cls.__new__(cls)
    dict.update(new, layer)  # parameters and submodules
    new.__dict__.update(layer.__dict__)  # shapes, eps, training flag
    return new


def swap_modules(modules, swaps: dict) -> int:
    """Replace every submodule under ``modules`` whose type is exactly a key
    of ``swaps`` with ``swaps[type](child)`` (a None answer keeps the child).
    Returns how many were replaced."""
    swapped = 0
    for module in modules:
        for _, parent in module.named_modules():
            for key, child in parent.children().items():
                make = swaps.get(type(child)) if isinstance(child, nn.Module) else None
                new = make(child) if make else None
                if new is not None:
                    parent[key] = new
                    swapped += 1
    return swapped
