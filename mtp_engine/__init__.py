"""Lossless MTP speculative decoding for Qwen3-Next and Qwen3.5 checkpoints on MLX.

The engine loads a checkpoint once (trunk via mlx-lm, MTP head by us) and
decodes prompts; it knows nothing about the files of jobs.

Importing the package does one thing before anything imports MLX: on Linux
it loads the CPU BLAS route (`mtp_engine.kernels.cpu_blas`) into the
process's global symbol scope, so MLX's CPU matmuls run at the same speed
however Python was started. ``MTP_CPU_BLAS=0`` skips it. The public names
below load on first use, so the training tools (`mtp_engine.tools.train`),
which run on machines without MLX, can import their own modules.
"""

from mtp_engine.kernels import cpu_blas as _cpu_blas
from mtp_engine.options import env_flag as _env_flag

_cpu_blas.route_before_mlx(enabled=_env_flag("MTP_CPU_BLAS"))

_PUBLIC = {
    "MTPEngine": "mtp_engine.engine",
    "PromptTooLongError": "mtp_engine.engine",
    "CheckpointError": "mtp_engine.model.loader",
    "MissingMTPHeadError": "mtp_engine.model.loader",
    "MODES": "mtp_engine.modes",
    "DecodeConfig": "mtp_engine.modes",
    "SamplingParams": "mtp_engine.sampling",
    "EngineOptions": "mtp_engine.options",
    "Constraint": "mtp_engine.constraints",
    "ConstraintError": "mtp_engine.constraints",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mtp_engine' has no attribute {name!r}")


__all__ = [
    "MTPEngine",
    "EngineOptions",
    "PromptTooLongError",
    "CheckpointError",
    "MissingMTPHeadError",
    "MODES",
    "DecodeConfig",
    "SamplingParams",
    "Constraint",
    "ConstraintError",
]
