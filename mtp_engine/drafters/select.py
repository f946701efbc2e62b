"""What an engine builds once for drafting, and the drafter a decoder gets.

"auto" takes the fastest drafter that serves the mode and the rows'
sampling: the C++ head for greedy chains and adaptive chains where the
engine has it, else the CUDA chain kernel for chains of greedy and sampled
rows (every row's in one launch; the rejection sampler's through the MLX
head), else the MLX head.
Constrained rows (`mtp_engine.constraints`) draft masked chains with the
MLX head: modes baseline, auto and chain. Drafters change speed, never
output.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mtp_engine.drafters.compiled_head import CompiledHead, can_compile_head
from mtp_engine.drafters.cpp_head import CppDrafter, build_cpp_head
from mtp_engine.drafters.head import HeadDrafter
from mtp_engine.model.install import decide
from mtp_engine.modes import CHAINS, DRAFTERS, cannot_draft, serves
from mtp_engine.options import EngineOptions, FastPathStatus

@dataclass
class DrafterParts:
    """What an engine's drafters share: the MLX head's arguments (`HeadDrafter`'s
    ``head, embed, lm_head, prefill_step_size``) and its compiled forward, the
    C++ head, the CUDA chain kernel (None where unavailable), their statuses."""

    head_args: tuple
    statuses: list[FastPathStatus]
    compiled: CompiledHead | None = None
    cpp: object | None = None
    kernel: object | None = None


def build_drafters(head, embed, lm_head, lm_head_module, prefill_step_size: int,
                   options: EngineOptions) -> DrafterParts:
    """Drafting parts for a loaded head: ``head, embed, lm_head,
    prefill_step_size`` as `HeadDrafter` takes them; ``lm_head_module``, the
    module whose weight ``lm_head`` uses (the embedding when tied), for the
    native drafters; ``options``, the fast-path switches."""
    compiles = can_compile_head(head)
    compiled = decide("compile_head", options.compile_head, compiles,
                      None if compiles else "the head's RoPE takes no array offset", "draft forward in 3 traces")
    parts = DrafterParts((head, embed, lm_head, prefill_step_size), [compiled])
    if compiled.state == "on":
        parts.compiled = CompiledHead(head, embed)

    on_gpu = mx.default_device() != mx.cpu
    wanted = options.cpp_drafter_on_gpu if on_gpu else options.cpp_drafter
    parts.cpp, why = build_cpp_head(head, embed, lm_head_module, on_gpu=on_gpu) if wanted else (None, None)
    where = "on the host CPU while the GPU verifies" if on_gpu else "greedy chain and adaptive drafts"
    # Opt-in on a GPU: "off" is then the backend's default, not a choice.
    parts.statuses.append(decide("cpp_drafter", (wanted or None) if on_gpu else wanted, not on_gpu, why, where))

    why = None if on_gpu else "not MLX's CUDA backend"
    if options.cuda_chain_drafter and on_gpu:
        from mtp_engine.drafters.cuda_chain import build_chain_kernel  # CUDA only

        parts.kernel, why = build_chain_kernel(head, embed, lm_head_module)
    parts.statuses.append(decide("cuda_chain_drafter", options.cuda_chain_drafter, True, why,
                                 "every row's chain in one launch"))
    return parts


def pick(parts: DrafterParts, mode: str, choice: str = "auto", greedy: bool = True, masked: bool = False) -> str:
    """The drafter ``choice`` means for ``mode`` and rows that are all
    greedy (``greedy``) or not, some constrained (``masked``) or none:
    "mlx", "mlx-eager", "cpp" or "cuda".

    Raises:
        ValueError: An unknown choice, or one that cannot draft this mode or
            sampler here.
    """
    if choice not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {choice!r}")
    if not serves(choice, greedy, masked):
        raise cannot_draft(choice)
    cpp_ok = parts.cpp is not None and mode in CppDrafter.modes and serves("cpp", greedy, masked)
    cuda_ok = parts.kernel is not None and mode in CHAINS and serves("cuda", greedy, masked)
    if choice == "auto":
        return "cpp" if cpp_ok else "cuda" if cuda_ok else "mlx" if parts.compiled is not None else "mlx-eager"
    if choice == "cpp" and not cpp_ok:
        raise ValueError(f"no C++ drafter for mode {mode!r}: it drafts chain and adaptive modes on the CPU backend "
                         "(or with cpp_drafter_on_gpu) when _mtp_cpp_drafter is built and the head is one it runs")
    if choice == "cuda" and not cuda_ok:
        raise ValueError(f"no cuda chain drafter for mode {mode!r}: it drafts chain modes on MLX's CUDA backend "
                         "for one-layer MoE heads of unquantized weights (mtp_engine.kernels.cuda_chain)")
    return "mlx-eager" if choice == "mlx" and parts.compiled is None else choice


def make_drafter(parts: DrafterParts, kind: str):
    """A fresh drafter of ``kind`` (`pick`), with no rows."""
    if kind == "cpp":
        return CppDrafter(parts.cpp)
    if kind == "cuda":
        from mtp_engine.drafters.cuda_chain import CudaChainDrafter  # CUDA only

        return CudaChainDrafter(*parts.head_args, kernel=parts.kernel, compiled=parts.compiled)
    return HeadDrafter(*parts.head_args, compiled=parts.compiled if kind == "mlx" else None)
