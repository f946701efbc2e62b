"""Record types and Arrow schemas shared by the engine and the job runner."""

from schemas.arrow import (
    COMPLETION_SCHEMA,
    SCHEMA_VERSION,
    completion_row,
    error_row,
    rows_to_batch,
)
from schemas.records import GenerationResult, GenerationStats, StepTrace

__all__ = [
    "COMPLETION_SCHEMA",
    "SCHEMA_VERSION",
    "GenerationResult",
    "GenerationStats",
    "StepTrace",
    "completion_row",
    "error_row",
    "rows_to_batch",
]
