"""Arrow schema of the job runner's output rows.

One row per input row: the completion, or an error row with ``finish_reason``
"error" and ``error`` set to ``"<kind>: <message>"``. ``acceptance`` holds the
speculative-decoding statistics (null for error rows; only ``mode`` and the
timings are set in batch mode).
"""

from __future__ import annotations

import pyarrow as pa

from schemas.records import GenerationResult

SCHEMA_VERSION = 1

ACCEPTANCE_TYPE = pa.struct(
    [
        pa.field("mode", pa.string()),
        pa.field("draft_tokens", pa.int32()),
        pa.field("paths", pa.int32()),
        pa.field("tau", pa.float64()),
        pa.field("steps", pa.int32()),
        pa.field("drafted", pa.int32()),
        pa.field("accepted", pa.int32()),
        pa.field("acceptance_length", pa.float64()),
        pa.field("histogram", pa.list_(pa.int32())),
        pa.field("rescued", pa.int32()),
        pa.field("prefill_s", pa.float64()),
        pa.field("decode_s", pa.float64()),
    ]
)

COMPLETION_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("index", pa.int64()),
        pa.field("line", pa.int64()),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("acceptance", ACCEPTANCE_TYPE),
    ],
    metadata={"mtp_batch_schema_version": str(SCHEMA_VERSION)},
)

FINISH_REASONS = ("stop", "length", "error")


def completion_row(
    *, id: str, index: int, line: int | None, prompt: str, result: GenerationResult
) -> dict:
    """An output row for a finished generation."""
    s = result.stats
    if s.mode == "batch":
        acceptance = {"mode": "batch", "prefill_s": s.prefill_s, "decode_s": s.decode_s}
    else:
        acceptance = {
            "mode": s.mode,
            "draft_tokens": s.draft_tokens,
            "paths": s.paths,
            "tau": s.tau,
            "steps": s.steps,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance_length": s.acceptance_length,
            "histogram": s.histogram,
            "rescued": s.rescued,
            "prefill_s": s.prefill_s,
            "decode_s": s.decode_s,
        }
    return {
        "id": id,
        "index": index,
        "line": line,
        "prompt": prompt,
        "completion": result.text,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": len(result.tokens),
        "finish_reason": result.finish_reason,
        "error": None,
        "acceptance": acceptance,
    }


def error_row(
    *, id: str, index: int, line: int | None, kind: str, message: str, prompt: str | None = None
) -> dict:
    """An output row for an input that could not be generated."""
    return {
        "id": id,
        "index": index,
        "line": line,
        "prompt": prompt,
        "completion": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "finish_reason": "error",
        "error": f"{kind}: {message}",
        "acceptance": None,
    }


def rows_to_batch(rows: list[dict]) -> pa.RecordBatch:
    """Build a RecordBatch against `COMPLETION_SCHEMA` (missing keys are null)."""
    columns = {name: [row.get(name) for row in rows] for name in COMPLETION_SCHEMA.names}
    return pa.RecordBatch.from_pydict(columns, schema=COMPLETION_SCHEMA)


def dataset_features_dict() -> dict:
    """The ``features`` entry of ``dataset_info.json`` for this schema."""
    import datasets

    return datasets.Features.from_arrow_schema(COMPLETION_SCHEMA).to_dict()
