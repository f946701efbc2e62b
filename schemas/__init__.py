"""Record types and Arrow schemas shared by the engine and the job runner.

The names below load on first use, so what only needs the record types or
the schema version (the CLI's parser) does not import pyarrow and datasets.
"""

SCHEMA_VERSION = 3
"""The output schema jobs write (`schemas.arrow` says what each version adds)."""
SCHEMA_VERSIONS = (1, 2, 3)

_PUBLIC = {
    "COMPLETION_SCHEMA": "schemas.arrow",
    "completion_row": "schemas.arrow",
    "error_row": "schemas.arrow",
    "rows_to_batch": "schemas.arrow",
    "GenerationResult": "schemas.records",
    "GenerationStats": "schemas.records",
    "StepTrace": "schemas.records",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'schemas' has no attribute {name!r}")


__all__ = ["SCHEMA_VERSION", "SCHEMA_VERSIONS", *_PUBLIC]
