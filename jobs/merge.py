"""``python -m jobs merge A B ... --output DIR``: combine output folders of
the same job written on machines without a shared filesystem.

Every input must carry the same fingerprint (model, rendering, decoding,
schema) and be intact: every shard a ledger lists must match the pattern
of shard names, lie in its folder, and have the size and CRC-32 its ledger
recorded. Ids must not overlap: an id in two inputs is refused, since the
rows may differ and exactly-once output is the contract. All of that is
checked before anything is written; the result is built in a temporary
folder beside ``--output`` and renamed into place only when complete (a
killed merge leaves no ``--output``; the next merge into it removes the
killed one's temporary folder). The
merged folder is itself a job folder (each input's writers become writers of
it), so ``load_from_disk``, ``status`` and resuming into it all work.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import orjson

from jobs.config import describe_changes, output_parts
from jobs.ledger import Ledger, LedgerEntry, fsync_dir
from jobs.output import (
    MANIFEST,
    OutputError,
    OutputFolder,
    check_shard,
    read_all_ledgers,
    shard_name,
    write_atomic,
    writer_name,
)


class MergeError(ValueError):
    """The inputs cannot be merged."""


def _manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.exists():
        raise MergeError(f"{folder} is not a job output folder (no {MANIFEST})")
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise MergeError(f"{path} is corrupt ({e}); resume that job once (same command) to rebuild it") from None
    if not isinstance(data, dict) or "fingerprint" not in data:
        raise MergeError(f"{path} holds no fingerprint; it is not a job manifest")
    return data


def _checked_entries(folder: Path) -> list[LedgerEntry]:
    try:
        entries = read_all_ledgers(folder)
    except OutputError as e:
        raise MergeError(str(e)) from None
    for e in entries:
        problem = check_shard(folder, e, checksum=True)
        if problem is not None:
            raise MergeError(f"{folder}: shard {e.shard!r} is damaged ({problem}); resume that job once "
                             "(it quarantines the shard and redoes its rows), then merge again")
    return entries


def merge(inputs: list[Path], output: Path, log=print) -> int:
    """Merge job folders; returns the number of rows in the result."""
    if not inputs:
        raise MergeError("nothing to merge")
    manifests = [_manifest(folder) for folder in inputs]
    first = manifests[0]
    for folder, m in zip(inputs[1:], manifests[1:]):
        if m["fingerprint"] != first["fingerprint"] and output_parts(m.get("fingerprint_parts", {})) != output_parts(
                first.get("fingerprint_parts", {})):
            changes = describe_changes(first.get("fingerprint_parts", {}), m.get("fingerprint_parts", {}))
            raise MergeError(
                f"{folder} was made by a different job configuration than {inputs[0]}:\n  " + "\n  ".join(changes)
            )
    owner: dict[tuple[str, int], Path] = {}
    entries_by_input = []
    for folder in inputs:
        entries = _checked_entries(folder)
        for e in entries:
            for key in e.keys():
                if key in owner:
                    rid, sample = key
                    what = f"id {rid!r}" + (f" (sample {sample})" if sample else "")
                    raise MergeError(f"{what} is in both {owner[key]} and {folder}; refusing to merge overlapping ids")
                owner[key] = folder
        entries_by_input.append(entries)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise MergeError(f"output {output} exists and is not an empty folder")

    _remove_stale_staging(output)
    staging = output.parent / f".{output.name}.merging-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        writer = 0
        for folder, entries in zip(inputs, entries_by_input):
            by_writer: dict[str, list[LedgerEntry]] = {}
            for e in entries:
                by_writer.setdefault(e.writer, []).append(e)
            for _, group in sorted(by_writer.items()):
                name = writer_name(writer)
                merged = []
                for seq, e in enumerate(group):
                    target = shard_name(name, seq)
                    shutil.copyfile(folder / e.shard, staging / target)
                    merged.append(LedgerEntry(**{**e.__dict__, "shard": target, "writer": name}))
                Ledger(staging / f"ledger-{name}.jsonl").rewrite(merged)
                writer += 1
        manifest = {**first, "dataset": _merged_dataset(manifests), "merged_from": [str(p) for p in inputs]}
        write_atomic(staging / MANIFEST, orjson.dumps(manifest))
        # Views and a full check of the copies, still in the staging folder.
        out = OutputFolder(staging, writer_name(0), log=log)
        out.open(manifest, overwrite=False)
        rows = len(out.done)
        out.close()
        if output.exists():
            output.rmdir()
        os.rename(staging, output)
        fsync_dir(output.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return rows


def _merged_dataset(manifests: list[dict]) -> dict:
    """The merged folder's dataset: the inputs' one where they share it,
    else every input's path, with their prompts and completions summed."""
    each = [m.get("dataset") or {} for m in manifests]
    if all(d.get("identity") == each[0].get("identity") for d in each):
        return each[0]

    def total(key):
        values = [d.get(key) for d in each]
        return None if None in values else sum(values)
    return {**each[0], "path": [d.get("path") for d in each], "rows": total("rows"),
            "completions": total("completions"), "inputs": each}


def _remove_stale_staging(output: Path) -> None:
    """Remove the staging folders of merges into ``output`` that were killed
    on this host (their process is gone); a live merge's is left alone."""
    prefix = f".{output.name}.merging-{socket.gethostname()}-"
    for path in output.parent.glob(f".{output.name}.merging-*"):
        pid = path.name[len(prefix):] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def merge_outputs(inputs: list[Path], output: Path) -> int:
    """CLI wrapper: prints the result; returns an exit status."""
    try:
        rows = merge(inputs, output, log=lambda m: print(m, file=sys.stderr))
    except (MergeError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the file system refused: a part of --output is a file, permissions, a full disk
        print(f"error: {e.strerror or e} ({e.filename})" if e.filename else f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(inputs)} folders: {rows} rows -> {output}", file=sys.stderr)
    return 0
