"""Record types and Arrow schemas shared by the engine and the job runner."""

from schemas.records import GenerationResult, GenerationStats, StepTrace

__all__ = ["GenerationResult", "GenerationStats", "StepTrace"]
