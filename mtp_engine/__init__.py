"""Lossless MTP speculative decoding for Qwen3-Next and Qwen3.5 checkpoints on MLX.

The engine loads a checkpoint once (trunk via mlx-lm, MTP head by us) and
decodes prompts; it knows nothing about the files of jobs.

Importing the package does one thing before anything imports MLX: on Linux
it loads the CPU BLAS route (`mtp_engine.kernels.cpu_blas`) into the
process's global symbol scope, so MLX's CPU matmuls run at the same speed
however Python was started. ``MTP_CPU_BLAS=0`` skips it.
"""

from mtp_engine.kernels import cpu_blas as _cpu_blas
from mtp_engine.options import env_flag as _env_flag

_cpu_blas.route_before_mlx(enabled=_env_flag("MTP_CPU_BLAS"))

from mtp_engine.engine import MTPEngine, PromptTooLongError  # noqa: E402  (after the BLAS route)
from mtp_engine.model.loader import CheckpointError, MissingMTPHeadError  # noqa: E402
from mtp_engine.modes import MODES, DecodeConfig  # noqa: E402
from mtp_engine.options import EngineOptions  # noqa: E402

__all__ = [
    "MTPEngine",
    "EngineOptions",
    "PromptTooLongError",
    "CheckpointError",
    "MissingMTPHeadError",
    "MODES",
    "DecodeConfig",
]
