"""MLX's float32 SiLU, vectorized, for the engine's forwards on the CPU backend.

On Linux x86-64, MLX's CPU backend computes ``exp`` one element at a time,
with a libm call for each of its polynomial's six fused multiply-adds: about
11 ns an element for ``mx.sigmoid`` and ``nn.silu``, compiled or not. A
prompt's prefill applies SiLU to every gated-delta layer's conv output and
gated norm and to every MoE block's experts; on the shipped model that was a
third of the prefill.

``_mtp_act`` (``native/activations.cpp``, built by ``make install``) computes
the same function, operation for operation, in a vectorized loop: bit for
bit what ``mx.sigmoid`` and ``nn.silu`` give (the tests compare them over
millions of float32 values), about 17x faster on [153, 512].

`install_fast_activations` swaps, on loaded model instances, the MoE blocks'
SwiGLU (routed experts and shared expert) and the gated-delta layers' gated
norms for versions that use it; `mix_tokens` uses `silu` for the conv
output. Float32 arrays on the CPU take it at every width: measured side by
side on the shipped model, prefill of a 150-token prompt 55.8 -> 37.7 ms,
a verify forward over 5 tokens 4.7-5.0 -> 4.3-4.5 ms, one token 2.9-3.1 ->
2.8-3.1 ms (inside the compiled layers it stands between fused kernels,
which still pays). Its derivatives are MLX ops, so training (the head's
distillation) runs through it too. Set ``MTP_CPU_ACTIVATIONS=0`` to turn it
off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextRMSNormGated
from mlx_lm.models.switch_layers import SwiGLU

_extension = None
_loaded = False


def extension():
    """The ``_mtp_act`` module, or None when it is not built, is disabled, or
    does not work with this MLX (checked once with a tiny call)."""
    global _extension, _loaded
    if _loaded:
        return _extension
    _loaded = True
    if os.environ.get("MTP_CPU_ACTIVATIONS", "1") == "0":
        return None
    try:
        import _mtp_act
    except ImportError:
        return None
    try:
        with mx.stream(mx.cpu):
            x = mx.array([-1.0, 0.0, 2.0])
            ok = mx.array_equal(_mtp_act.silu(x), nn.silu(x)).item()
    except (TypeError, RuntimeError, ValueError):
        return None
    _extension = _mtp_act if ok else None
    return _extension


def _takes(x: mx.array) -> bool:
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu and extension() is not None


def silu(x: mx.array) -> mx.array:
    """``nn.silu(x)``, through the primitive where `_takes` says so."""
    return extension().silu(x) if _takes(x) else nn.silu(x)


class FastSwiGLU(SwiGLU):
    """mlx-lm's ``SwiGLU`` (``silu(gate) * x``) with `silu`."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return silu(gate) * x if _takes(gate) else super().__call__(x, gate)


class FastMLP(Qwen3NextMLP):
    """Qwen3-Next's dense MLP (the shared expert) with `silu`."""

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)
        if not _takes(gate):
            return super().__call__(x)
        return self.down_proj(silu(gate) * self.up_proj(x))


class FastGatedNorm(Qwen3NextRMSNormGated):
    """Qwen3-Next's gated RMS norm (``precise_swiglu``) with `silu`."""

    def __call__(self, hidden_states: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is None or mx.default_device() != mx.cpu or extension() is None:
            return super().__call__(hidden_states, gate)
        # precise_swiglu: SiLU of the gate in float32, whatever the model's dtype.
        x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
        return (silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(hidden_states.dtype)


def install_fast_activations(*modules: nn.Module) -> int:
    """Swap the SwiGLU activations, shared-expert MLPs and gated norms under
    ``modules`` (a trunk, an MTP head) for the versions above, sharing their
    weights. Does nothing unless the extension is available on the CPU
    backend. Returns how many were swapped."""
    if mx.default_device() != mx.cpu or extension() is None:
        return 0
    from mtp_engine.recurrent import share_weights

    swapped = 0
    for module in modules:
        for _, parent in module.named_modules():
            for key, child in parent.children().items():
                if type(child) is SwiGLU:
                    parent[key] = FastSwiGLU()
                elif type(child) is Qwen3NextMLP:
                    parent[key] = share_weights(FastMLP, child)
                elif type(child) is Qwen3NextRMSNormGated:
                    parent[key] = share_weights(FastGatedNorm, child)
                else:
                    continue
                swapped += 1
    return swapped
