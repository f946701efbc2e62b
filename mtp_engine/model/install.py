"""The engine's layers, installed on a loaded trunk and head in one list.

Each install swaps layers of one model instance for subclasses that share
their weights (nothing is patched at import). Every entry is a fast path of
`mtp_engine.options.EngineOptions` except state capture (per-token recurrent
states, so a verify's commit is a lookup), which speculation needs; all of
them give the tokens mlx-lm's layers give (docs/BACKENDS.md).
Run it after the last change to the weights (cast, quantization): compiled
layers and the CPU recurrence's choice read them as they are.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mtp_engine.kernels import cpu_activations, recurrence
from mtp_engine.model.activations import install_fast_activations
from mtp_engine.model.compiled import install_compiled_layers
from mtp_engine.model.dispatch import CUDA_DISPATCH_MIN_TOKENS, install_layer_dispatch
from mtp_engine.model.gated_delta import gated_delta_layers, install_state_capture
from mtp_engine.model.moe import (
    GPU_MOE_GROUP_MIN,
    GPU_MOE_SORT_MIN,
    GROUP_ROWS,
    MLX_LM_SORT_MIN,
    EngineSparseMoeBlock,
    install_moe_blocks,
)
from mtp_engine.model.quantized import install_flat_quantized
from mtp_engine.model.rope import install_batch_rope
from mtp_engine.model.rowwise import install_rowwise_linears
from mtp_engine.options import MAX_VERIFY_WIDTH, EngineOptions, FastPathStatus
from mtp_engine.backend import is_cuda_backend


def decide(name: str, wanted: bool | None, default: bool, why_not: str | None, on: str) -> FastPathStatus:
    """The status of one fast path: ``wanted`` (None: ``default``), and when
    wanted, ``why_not`` (None when it can run) or ``on`` (what it does)."""
    if wanted is None:
        wanted = default
        if not wanted:
            return FastPathStatus(name, "off", "the default on this backend")
    if not wanted:
        return FastPathStatus(name, "off", "by choice")
    if why_not is not None:
        return FastPathStatus(name, "unavailable", why_not)
    return FastPathStatus(name, "on", on)


def _install_expert_kernel(model: nn.Module, head: nn.Module, options: EngineOptions, on_cuda: bool, name: str,
                           fits, attr: str, on: str) -> FastPathStatus:
    """Decide the expert-kernel fast path ``name`` and, where on, set
    ``attr`` on each `EngineSparseMoeBlock` under ``model`` and ``head``
    whose experts ``fits`` accepts (a mixed quantization may leave some to
    MLX)."""
    blocks = [m for module in (model, head) for m in module.modules() if isinstance(m, EngineSparseMoeBlock)]
    why, reasons = None, []
    if not options.contiguous_moe:
        why = "needs contiguous_moe"
    elif not on_cuda:
        why = "not MLX's CUDA backend"
    elif not blocks:
        why = "the model has no routed experts"
    else:
        reasons = [fits(block.switch_mlp) for block in blocks]
        why = None if None in reasons else reasons[0]
    runs = reasons.count(None)
    some = "" if runs == len(blocks) else f" ({runs} of {len(blocks)} MoE blocks; the rest keep MLX's)"
    status = decide(name, getattr(options, name), on_cuda, why, on + some)
    for block, reason in zip(blocks, reasons):
        setattr(block, attr, status.state == "on" and reason is None)
    return status


def install_moe_kernel(model: nn.Module, head: nn.Module, options: EngineOptions, on_cuda: bool) -> FastPathStatus:
    """Decide the `moe_kernel` fast path and, where on, give it to each
    `EngineSparseMoeBlock` under ``model`` and ``head`` whose experts it runs
    (``cuda_moe.fits``)."""
    # Imported here: importing the packages loads no CUDA module.
    from mtp_engine.kernels import cuda_moe

    return _install_expert_kernel(model, head, options, on_cuda, "moe_kernel", cuda_moe.fits, "expert_kernel",
                                  f"forwards of up to {MAX_VERIFY_WIDTH} tokens a row read each expert's weights once")


def install_prefill_moe_kernel(model: nn.Module, head: nn.Module, options: EngineOptions,
                               on_cuda: bool) -> FastPathStatus:
    """Decide the `prefill_moe_kernel` fast path and, where on, give it to
    each `EngineSparseMoeBlock` whose experts it runs (``cuda_moe.tiles_fit``)."""
    # Imported here: importing the packages loads no CUDA module.
    from mtp_engine.kernels import cuda_moe

    return _install_expert_kernel(model, head, options, on_cuda, "prefill_moe_kernel", cuda_moe.tiles_fit,
                                  "prefill_kernel", "prompt prefill's expert products on the tensor cores")


def install_engine_layers(model: nn.Module, head: nn.Module, options: EngineOptions) -> list[FastPathStatus]:
    """Install the engine's layers on ``model`` (mlx-lm's Qwen3-Next) and
    ``head`` (its `MTPHead`) as ``options`` say; returns what each
    layer-level fast path ended up as."""
    on_cpu = mx.default_device() == mx.cpu
    on_cuda = is_cuda_backend()
    statuses = []
    if on_cuda:  # not a fast path: without it a batch of more than 64 rows can fail to launch
        install_batch_rope(model, head)

    act = decide("cpu_activations", options.cpu_activations, True, cpu_activations.availability() if on_cpu
                 else "not MLX's CPU backend", "SiLU, sigmoid, softmax vectorized")
    statuses.append(act)

    layers = gated_delta_layers(model)
    path, why = (recurrence.MLX_OPS, "the model has no gated-delta layers")
    if layers:
        path, why = recurrence.select(layers[0], options.cuda_recurrence, options.cpu_recurrence)
    install_state_capture(model, path, fast_silu=act.state == "on")
    statuses.append(decide("cuda_recurrence", options.cuda_recurrence, True,
                           None if path == recurrence.CUDA_KERNEL else why if on_cuda else "not MLX's CUDA backend",
                           "one launch per layer and forward"))
    statuses.append(decide("cpu_recurrence", options.cpu_recurrence, True,
                           None if path == recurrence.CPU_PRIMITIVE else why if on_cpu else "not MLX's CPU backend",
                           "one primitive per layer and forward"))
    sort_min = options.moe_sort_min or (MLX_LM_SORT_MIN if on_cpu else GPU_MOE_SORT_MIN)
    statuses.append(decide("contiguous_moe", options.contiguous_moe, True, None,
                           f"routing indices copied once; tokens sorted by expert from {sort_min} selections"))
    grouped = decide("grouped_moe", options.grouped_moe, on_cuda, "needs contiguous_moe" if not options.contiguous_moe
                     else None, f"each expert's tokens in blocks of {GROUP_ROWS} rows from {GPU_MOE_GROUP_MIN} selections")
    statuses.append(grouped)
    if options.contiguous_moe:
        install_moe_blocks(model, head, sort_min=sort_min,
                           group_min=GPU_MOE_GROUP_MIN if grouped.state == "on" else None)
    statuses.append(install_moe_kernel(model, head, options, on_cuda))
    statuses.append(install_prefill_moe_kernel(model, head, options, on_cuda))

    rowwise = decide("rowwise_linears", options.rowwise_linears, on_cuda, None, "few-row dense products row by row")
    statuses.append(rowwise)
    if rowwise.state == "on":
        install_rowwise_linears(model, head)

    flat = decide("flat_quantized", options.flat_quantized, on_cuda, None, "batched rows of quantized products as one matrix")
    statuses.append(flat)
    dequantized = decide("prefill_dequantized", options.prefill_dequantized, on_cuda,
                         None if flat.state == "on" else "needs flat_quantized",
                         f"4-bit products of forwards wider than {MAX_VERIFY_WIDTH} tokens a row as dense products of "
                         "the dequantized weights")
    statuses.append(dequantized)
    if flat.state == "on":
        install_flat_quantized(model, head, dequantize_wide=dequantized.state == "on")

    if act.state == "on":
        install_fast_activations(model, head)

    compiled = decide("compile_layers", options.compile_layers, on_cpu, None, f"decode and verify widths up to {MAX_VERIFY_WIDTH}")
    statuses.append(compiled)
    if compiled.state == "on":
        install_compiled_layers(model, head)

    min_tokens = CUDA_DISPATCH_MIN_TOKENS if on_cuda else 2
    dispatch = decide("layer_dispatch", options.layer_dispatch, True, None,
                      f"in verify forwards of {min_tokens} tokens or more each trunk layer computes while the host "
                      "builds the next")
    statuses.append(dispatch)
    if dispatch.state == "on":
        install_layer_dispatch(model, min_tokens)  # last: it subclasses each layer's class as installed
    return statuses
