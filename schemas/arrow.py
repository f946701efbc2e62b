"""Arrow schema of the job runner's output rows.

One row per completion: the completion, or an error row with
``finish_reason`` "error" and ``error`` set to ``"<kind>: <message>"``.
``acceptance`` holds the speculative-decoding statistics (null for error
rows). Version 3 adds ``acceptance.depths`` (mode "auto": steps by the
number of drafts the controller chose, `GenerationStats.depths`). Version 2 adds
``sample`` (0..n-1, the completion's index among its prompt's), ``n``
(how many completions the prompt gets; 1 for a row that cannot be
generated, whose single error row is sample 0), ``seed``
(the completion's derived seed; greedy rows carry the one sampling would
use, so the column has no nulls and readers keep it as integers) and ``chat`` (whether the prompt was rendered from
chat messages); folders written with an older version keep it when they resume
(`completion_schema`).
"""

from __future__ import annotations

import datasets
import pyarrow as pa

from schemas import SCHEMA_VERSION, SCHEMA_VERSIONS  # noqa: F401  (defined there, read here too)
from schemas.records import GenerationResult

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
ACCEPTANCE_TYPE_V3 = pa.struct(list(ACCEPTANCE_TYPE) + [pa.field("depths", pa.list_(pa.int32()))])

_FIELDS_V1 = [
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
]
_FIELDS_V2 = (_FIELDS_V1[:1] + [pa.field("sample", pa.int32()), pa.field("n", pa.int32()), pa.field("seed", pa.int64())]
              + _FIELDS_V1[1:4]
              + [pa.field("chat", pa.bool_())] + _FIELDS_V1[4:])


def completion_schema(version: int = SCHEMA_VERSION) -> pa.Schema:
    """The output schema of one version (`SCHEMA_VERSIONS`)."""
    if version not in SCHEMA_VERSIONS:
        raise ValueError(f"unknown output schema version {version!r}; this release reads {SCHEMA_VERSIONS}")
    fields = _FIELDS_V1 if version == 1 else _FIELDS_V2
    if version >= 3:
        fields = [pa.field("acceptance", ACCEPTANCE_TYPE_V3) if f.name == "acceptance" else f for f in fields]
    return pa.schema(fields, metadata={"mtp_batch_schema_version": str(version)})


COMPLETION_SCHEMA = completion_schema()


LOGPROB_FIELDS = [
    pa.field("token_ids", pa.list_(pa.int32())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("top_logprobs", pa.list_(pa.list_(pa.struct([pa.field("token", pa.int32()),
                                                          pa.field("logprob", pa.float32())])))),
]
"""With ``--logprobs``: the generated token ids, each one's log-probability,
and its alternatives best first (`mtp_engine.sampling.token_logprobs`)."""


def with_kept_columns(schema: pa.Schema, names: list[str] | tuple[str, ...], logprobs: bool = False) -> pa.Schema:
    """``schema`` with the log-probability columns where the job stores
    them, then the input columns it keeps, as text (a non-text value is
    stored as its JSON text: `jobs.prompts.kept_value`)."""
    extra = (LOGPROB_FIELDS if logprobs else []) + [pa.field(name, pa.string()) for name in names]
    return pa.schema(list(schema) + extra, metadata=schema.metadata)


def logprob_values(result: GenerationResult) -> dict:
    """A result's log-probability columns."""
    if result.logprobs is None:
        return {"token_ids": None, "logprobs": None, "top_logprobs": None}
    return {"token_ids": list(result.tokens), "logprobs": [lp for lp, _ in result.logprobs],
            "top_logprobs": [[{"token": t, "logprob": v} for t, v in alternatives] for _, alternatives in result.logprobs]}

def completion_row(
    *, id: str, index: int, line: int | None, prompt: str, result: GenerationResult, sample: int = 0,
    n: int = 1, chat: bool | None = None, seed: int | None = None,
) -> dict:
    """An output row for a finished generation (``seed``: the completion's
    derived seed, default the one it sampled with)."""
    s = result.stats
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
        "depths": s.depths,
    }
    return {
        "id": id,
        "sample": sample,
        "n": n,
        "seed": s.seed if seed is None else seed,
        "index": index,
        "line": line,
        "prompt": prompt,
        "chat": chat,
        "completion": result.text,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": len(result.tokens),
        "finish_reason": result.finish_reason,
        "error": f"constraint_incomplete: {result.note}" if result.note else None,
        "acceptance": acceptance,
    }


def error_row(
    *, id: str, index: int, line: int | None, kind: str, message: str, prompt: str | None = None, sample: int = 0,
    n: int = 1, seed: int | None = None, chat: bool | None = None,
) -> dict:
    """An output row for an input that could not be generated."""
    return {
        "id": id,
        "sample": sample,
        "n": n,
        "seed": seed,
        "index": index,
        "line": line,
        "prompt": prompt,
        "chat": chat,
        "completion": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "finish_reason": "error",
        "error": f"{kind}: {message}",
        "acceptance": None,
    }


def rows_to_batch(rows: list[dict], schema: pa.Schema = COMPLETION_SCHEMA) -> pa.RecordBatch:
    """Build a RecordBatch against ``schema`` (missing keys are null)."""
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.RecordBatch.from_pydict(columns, schema=schema)


def dataset_features_dict(schema: pa.Schema = COMPLETION_SCHEMA) -> dict:
    """The ``features`` entry of ``dataset_info.json`` for ``schema``."""
    return datasets.Features.from_arrow_schema(schema).to_dict()
