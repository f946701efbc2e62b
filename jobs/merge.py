"""``python -m jobs merge A B ... --output DIR``: combine output folders of
the same job written on machines without a shared filesystem.

Every input must carry the same fingerprint (model, rendering, decoding,
schema). Ids must not overlap: an id in two inputs is refused, since the
rows may differ and exactly-once output is the contract. The merged folder
is itself a job folder (each input's shards become one writer's), so
``load_from_disk``, ``status`` and resuming into it all work.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import orjson

from jobs.config import describe_changes
from jobs.output import (
    MANIFEST,
    LedgerEntry,
    OutputFolder,
    fsync_dir,
    read_all_ledgers,
    shard_name,
    write_atomic,
    writer_name,
)


class MergeError(ValueError):
    """The inputs cannot be merged."""


def merge(inputs: list[Path], output: Path) -> int:
    """Merge job folders; returns the number of rows in the result."""
    if not inputs:
        raise MergeError("nothing to merge")
    manifests = []
    for folder in inputs:
        path = folder / MANIFEST
        if not path.exists():
            raise MergeError(f"{folder} is not a job output folder (no {MANIFEST})")
        manifests.append(orjson.loads(path.read_bytes()))
    first = manifests[0]
    for folder, m in zip(inputs[1:], manifests[1:]):
        if m["fingerprint"] != first["fingerprint"]:
            changes = describe_changes(first["fingerprint_parts"], m["fingerprint_parts"])
            raise MergeError(
                f"{folder} was made by a different job configuration than {inputs[0]}:\n  " + "\n  ".join(changes)
            )
    owner: dict[str, Path] = {}
    entries_by_input = []
    for folder in inputs:
        entries = read_all_ledgers(folder)
        for e in entries:
            for rid in e.ids:
                if rid in owner:
                    raise MergeError(f"id {rid!r} is in both {owner[rid]} and {folder}; refusing to merge overlapping ids")
                owner[rid] = folder
        entries_by_input.append(entries)
    if output.exists() and any(output.iterdir()):
        raise MergeError(f"output folder {output} exists and is not empty")
    output.mkdir(parents=True, exist_ok=True)

    writer = 0
    for folder, entries in zip(inputs, entries_by_input):
        by_writer: dict[str, list[LedgerEntry]] = {}
        for e in entries:
            by_writer.setdefault(e.writer, []).append(e)
        for _, group in sorted(by_writer.items()):
            name = writer_name(writer)
            lines = []
            for seq, e in enumerate(group):
                target = shard_name(name, seq)
                shutil.copyfile(folder / e.shard, output / target)
                lines.append(orjson.dumps({**e.__dict__, "shard": target, "writer": name}))
            (output / f"ledger-{name}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
            writer += 1
    manifest = {**first, "merged_from": [str(p) for p in inputs]}
    write_atomic(output / MANIFEST, orjson.dumps(manifest))
    fsync_dir(output)
    out = OutputFolder(output, writer_name(0))
    out.open(manifest, overwrite=False)
    return len(out.done_ids)


def merge_outputs(inputs: list[Path], output: Path) -> int:
    """CLI wrapper: prints the result; returns an exit status."""
    try:
        rows = merge(inputs, output)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(inputs)} folders: {rows} rows -> {output}", file=sys.stderr)
    return 0
