"""``python -m jobs export DIR --format parquet|jsonl|openai-batch --output FILE``.

Writes a job folder's committed rows, in input order (``index``, then
``sample``), as one file most tools open directly: Parquet (pandas, polars,
duckdb, ``pyarrow.dataset``), JSON lines, or an OpenAI batch output file
(`jobs.openai_batch.batch_lines`). The folder is checked first (every
shard's size and CRC-32); the file is written beside its target and renamed
into place, so a kill or a full disk leaves the previous file. An output
inside the job folder is refused: only the job writes there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.openai_batch import batch_lines
from jobs.output import OutputError, check_shard, read_all_ledgers, read_manifest

FORMATS = ("parquet", "jsonl", "openai-batch")


def committed_table(folder: Path) -> tuple[dict, pa.Table]:
    """The manifest and every committed row of an intact job folder, in
    input order.

    Raises:
        OutputError: Not a job folder, or a shard is damaged.
    """
    manifest = read_manifest(folder)
    tables = []
    for entry in read_all_ledgers(folder):
        problem = check_shard(folder, entry, checksum=True)
        if problem is not None:
            raise OutputError(f"shard {entry.shard} is damaged ({problem}); resume the job once (it redoes "
                              "those rows), then export again")
        tables.append(pa.ipc.open_stream(str(folder / entry.shard)).read_all())
    if not tables:
        from schemas.arrow import completion_schema

        return manifest, completion_schema(manifest.get("schema_version", 1)).empty_table()
    table = pa.concat_tables(tables, promote_options="default")
    keys = [("index", "ascending")] + ([("sample", "ascending")] if "sample" in table.column_names else [])
    return manifest, table.sort_by(keys)


def export(folder: Path, output: Path, fmt: str) -> tuple[int, str]:
    """Write ``folder``'s committed rows to ``output`` as ``fmt``; returns
    (what was written, a note: rows or prompts, and what was left out)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if folder.resolve() == output.resolve() or folder.resolve() in output.resolve().parents:
        raise OutputError(f"--output {output} is inside the job folder {folder}, whose files only the job "
                          "writes; choose a path outside it")
    manifest, table = committed_table(folder)
    tmp = output.with_name(f".tmp-{output.name}")
    try:
        if fmt == "parquet":
            pq.write_table(table, tmp)
            _fsync(tmp)
            written, note = table.num_rows, "rows"
        else:
            rows = table.to_pylist()
            lines, incomplete = (batch_lines(manifest, rows, _token_text(manifest, rows)) if fmt == "openai-batch"
                                 else (rows, 0))
            with open(tmp, "wb") as f:
                for line in lines:
                    f.write(orjson.dumps(line) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            written = len(lines)
            note = "requests" if fmt == "openai-batch" else "rows"
            if incomplete:
                note += f"; {incomplete} prompts left out until all their completions are committed"
        os.replace(tmp, output)
    except BaseException:  # a full disk, say: the output keeps its old content and no half file stays
        tmp.unlink(missing_ok=True)
        raise
    return written, note


def _token_text(manifest: dict, rows: list[dict]):
    """A token id's text, from the job's tokenizer, where rows carry
    log-probabilities (the API names tokens by their text); else None."""
    if not any(r.get("logprobs") for r in rows):
        return None
    from mtp_engine.model.loader import load_checkpoint_tokenizer

    path = (manifest.get("model") or {}).get("path")
    try:
        tokenizer = load_checkpoint_tokenizer(path)
    except (OSError, ValueError) as e:
        raise OutputError(f"the rows carry log-probabilities, whose tokens the API names by their text; the "
                          f"job's tokenizer ({path}) cannot be read: {e}") from None
    return lambda token: tokenizer.decode([token])


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def export_folder(folder: Path, output: Path, fmt: str) -> int:
    """CLI wrapper: prints the result; returns an exit status."""
    try:
        written, note = export(folder, output, fmt)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OutputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    what, _, rest = note.partition(";")
    print(f"exported {written} {what} -> {output}{';' + rest if rest else ''}", file=sys.stderr)
    return 0
