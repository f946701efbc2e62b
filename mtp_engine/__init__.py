"""Lossless MTP speculative decoding for Qwen3-Next checkpoints on MLX.

The engine loads a checkpoint once (trunk via mlx-lm, MTP head by us) and
decodes prompts; it knows nothing about the files of jobs.
"""

from mtp_engine.engine import MTPEngine, PromptTooLongError
from mtp_engine.loader import CheckpointError, MissingMTPHeadError
from mtp_engine.modes import MODES, DecodeConfig

__all__ = [
    "MTPEngine",
    "PromptTooLongError",
    "CheckpointError",
    "MissingMTPHeadError",
    "MODES",
    "DecodeConfig",
]
