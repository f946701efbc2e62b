"""Building an engine's drafters and picking one per generation.

"auto" takes the fastest drafter that serves the mode: the C++ head for
chain and adaptive drafts where the engine has it, else the CUDA chain
kernel for chains, else the MLX head. Drafters change speed, never output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mtp_engine.drafters.base import Drafter
from mtp_engine.drafters.compiled_head import can_compile_head
from mtp_engine.drafters.cpp_head import CppDrafter, build_cpp_head
from mtp_engine.drafters.mlx_head import MLXDrafter
from mtp_engine.model.install import decide
from mtp_engine.options import EngineOptions, FastPathStatus
from mtp_engine.sampling import GREEDY, SamplingParams

DRAFTERS = ("auto", "mlx", "mlx-eager", "cpp", "cuda")
"""Who may draft (``generate(drafter=...)``); "c++" is taken as "cpp"."""


@dataclass
class EngineDrafters:
    """The drafters one engine holds.

    Attributes:
        mlx: The MLX head (compiled where `EngineOptions.compile_head` allows).
        mlx_eager: The MLX head, never compiled (the same object as ``mlx``
            when that is not compiled).
        cpp: The C++ head, or None.
        cuda: The CUDA chain kernel's drafter, or None.
        statuses: What the drafting fast paths ended up as.
    """

    mlx: MLXDrafter
    mlx_eager: MLXDrafter
    cpp: CppDrafter | None = None
    cuda: Drafter | None = None
    statuses: list[FastPathStatus] = field(default_factory=list)


def build_drafters(head, embed, lm_head, lm_head_module, prefill_step_size: int,
                   options: EngineOptions) -> EngineDrafters:
    """Drafters for a loaded head.

    Args:
        head: The `MTPHead`; embed: the trunk's embedding.
        lm_head: Hiddens to logits (the trunk's LM head, tied or not).
        lm_head_module: The module whose weight ``lm_head`` uses (the
            embedding when tied), for the native drafters.
        prefill_step_size: Pending pairs per forward at most.
        options: The fast-path switches.
    """
    compiles = can_compile_head(head)
    compiled = decide("compile_head", options.compile_head, compiles,
                      None if compiles else "the head's RoPE takes no array offset", "draft forward in 3 traces")
    mlx = MLXDrafter(head, embed, lm_head, prefill_step_size, compiled=compiled.state == "on")
    eager = MLXDrafter(head, embed, lm_head, prefill_step_size) if mlx.compiled is not None else mlx
    statuses = [compiled]

    on_gpu = mx.default_device() != mx.cpu
    wanted = options.cpp_drafter_on_gpu if on_gpu else options.cpp_drafter
    cpp, why = (None, None)
    if wanted:
        native, why = build_cpp_head(head, embed, lm_head_module, on_gpu=on_gpu)
        cpp = CppDrafter(native) if native is not None else None
    where = "on the host CPU while the GPU verifies" if on_gpu else "chain and adaptive drafts"
    if on_gpu:  # opt-in there: "off" is the backend's default, not a choice
        statuses.append(decide("cpp_drafter", True if wanted else None, False, why, where))
    else:
        statuses.append(decide("cpp_drafter", wanted, True, why, where))

    cuda, why = None, None
    if options.cuda_chain_drafter:
        from mtp_engine.drafters.cuda_chain import (  # CUDA only
            CudaChainDrafter,
            build_chain_kernel,
        )

        kernel, why = build_chain_kernel(head, embed, lm_head_module) if on_gpu else (None, "not MLX's CUDA backend")
        if kernel is not None:
            cuda = CudaChainDrafter(head, embed, lm_head, kernel, prefill_step_size)
    statuses.append(decide("cuda_chain_drafter", options.cuda_chain_drafter, True, why, "a chain in one launch"))
    return EngineDrafters(mlx=mlx, mlx_eager=eager, cpp=cpp, cuda=cuda, statuses=statuses)


def select_drafter(drafters: EngineDrafters, mode: str, choice: str = "auto", sampling: SamplingParams = GREEDY) -> Drafter:
    """The drafter for ``mode``: "auto" (see the module docstring), "mlx",
    "mlx-eager", "cpp" or "cuda" (a ValueError where the engine has none
    for that mode). Sampled drafts come from the MLX head (the native
    drafters draft greedily)."""
    choice = "cpp" if choice == "c++" else choice
    if choice not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(map(repr, DRAFTERS))}, got {choice!r}")
    if not sampling.greedy and choice in ("cpp", "cuda"):
        raise ValueError(f"the {choice} drafter drafts greedily; sampling drafts with the MLX head (drafter='mlx')")
    cpp_ok = drafters.cpp is not None and mode in drafters.cpp.modes and sampling.greedy
    cuda_ok = drafters.cuda is not None and mode in drafters.cuda.modes and sampling.greedy
    if choice == "auto":
        if cpp_ok:
            return drafters.cpp
        return drafters.cuda if cuda_ok else drafters.mlx
    if choice == "mlx":
        return drafters.mlx
    if choice == "mlx-eager":
        return drafters.mlx_eager
    if choice == "cpp":
        if not cpp_ok:
            raise ValueError(
                f"no C++ drafter for mode {mode!r}: it drafts chain and adaptive modes on the CPU backend "
                "(or with cpp_drafter_on_gpu) when _mtp_cpp_drafter is built and the head is one it runs"
            )
        return drafters.cpp
    if not cuda_ok:
        raise ValueError(
            f"no cuda chain drafter for mode {mode!r}: it drafts chain mode on MLX's CUDA backend "
            "for one-layer MoE heads of unquantized weights (mtp_engine.kernels.cuda_chain)"
        )
    return drafters.cuda
