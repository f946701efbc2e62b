"""``python -m jobs repair DIR``: rebuild a job folder's ledgers from its
shards, which carry their ids.

For a ledger damaged in the middle (a resume refuses those) or any other
doubt: every shard file of the writer pattern is read; a readable one
becomes a ledger line (ids, size, CRC-32 and totals recomputed from its
rows), an unreadable one or one repeating ids of an earlier shard is moved
to ``quarantine/``. The job's lock is held throughout. A resume then redoes
whatever rows no shard holds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import orjson
import pyarrow as pa

from jobs.ledger import Ledger, LedgerEntry, fsync_dir
from jobs.lock import FolderInUse, FolderLock
from jobs.output import LEDGER_PATTERN, MANIFEST, QUARANTINE, SHARD_PATTERN, entry_from_shard, ledger_path


def repair(folder: Path, log=print) -> tuple[int, int, int]:
    """Rebuild every ledger of ``folder``; returns (shards kept, rows kept,
    shards quarantined)."""
    if not (folder / MANIFEST).exists() and not any(LEDGER_PATTERN.match(p.name) for p in folder.iterdir()):
        raise ValueError(f"{folder} is not a job output folder (no {MANIFEST} and no ledger)")
    lock = FolderLock(folder)
    lock.acquire("repair")
    try:
        try:
            fingerprint = orjson.loads((folder / MANIFEST).read_bytes()).get("fingerprint")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            fingerprint = None
        shards = sorted(p for p in folder.glob("data-r*.arrow") if SHARD_PATTERN.match(p.name))
        by_writer: dict[str, list[LedgerEntry]] = {}
        seen: set[tuple[str, int]] = set()
        kept = rows = quarantined = 0
        for path in shards:
            writer = SHARD_PATTERN.match(path.name)["writer"]
            try:
                entry = entry_from_shard(path, fingerprint)
                keys = set(entry.keys())
                if seen & keys:
                    raise ValueError("it repeats rows (id and sample) of an earlier shard")
            except (pa.ArrowInvalid, OSError, KeyError, ValueError) as e:
                target = folder / QUARANTINE / f"{path.name}.{int(time.time())}"
                target.parent.mkdir(exist_ok=True)
                os.replace(path, target)
                log(f"repair: shard {path.name} moved to {target.relative_to(folder)} ({e})")
                quarantined += 1
                continue
            by_writer.setdefault(writer, []).append(entry)
            seen.update(keys)
            kept += 1
            rows += entry.rows
        for p in folder.glob("ledger-*.jsonl"):
            if LEDGER_PATTERN.match(p.name) and LEDGER_PATTERN.match(p.name)["writer"] not in by_writer:
                Ledger(p).rewrite([])
        for writer, entries in by_writer.items():
            Ledger(ledger_path(folder, writer)).rewrite(entries)
        fsync_dir(folder)
    finally:
        lock.release()
    return kept, rows, quarantined


def repair_folder(folder: Path) -> int:
    """CLI wrapper: prints the result; returns an exit status."""
    try:
        kept, rows, quarantined = repair(folder, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, FolderInUse, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"repaired {folder}: ledgers rebuilt from {kept} shards ({rows} rows)"
          + (f", {quarantined} shard(s) quarantined" if quarantined else "")
          + "; resume the job to redo missing rows and refresh its views", file=sys.stderr)
    return 0
