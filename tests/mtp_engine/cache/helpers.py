"""Cache set-up shared by the cache, checkpoint and compiled-layer tests."""

from __future__ import annotations

import mlx.core as mx

from mtp_engine.cache.capture import StateCaptureCache, make_main_cache


def prefilled(model, tokens: list[int]) -> list:
    """The engine's caches for ``model`` after a forward over ``tokens``."""
    caches = make_main_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def begin_capture(caches: list) -> None:
    """Make the next forward capture per-token states."""
    for c in caches:
        if isinstance(c, StateCaptureCache):
            c.begin_capture()
