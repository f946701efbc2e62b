"""``python -m jobs status DIR [--verify]``: what a job's output folder
holds, and whether it is intact (every shard's size always; with
``--verify`` its CRC-32 too). Damage is listed and makes the exit status 1;
a resume repairs it (the damaged shards' rows are redone)."""

from __future__ import annotations

import sys
from pathlib import Path

from jobs.ledger import Totals
from jobs.output import REPEATED_LINE, OutputError, checked_entries, ledgers, read_manifest


def folder_state(folder: Path, verify: bool) -> tuple[dict, Totals, list[str]]:
    """The manifest, totals over every ledger, and what is damaged.

    Raises:
        OutputError: Not a job folder, a corrupt manifest, or a ledger
            damaged in the middle.
    """
    if not folder.is_dir():
        raise OutputError(f"{folder} is not a folder")
    manifest = read_manifest(folder)
    damage = []
    for ledger in ledgers(folder):
        if tail := ledger.read().tail:
            damage.append(f"{ledger.path.name}: {tail} bytes after its last valid line (cut on resume)")
    totals = Totals()
    for _, e, problem in checked_entries(folder, checksum=verify):
        if problem == REPEATED_LINE:
            damage.append(f"shard {e.shard}: {REPEATED_LINE} (a resume drops the repeat)")
            continue
        if problem is not None:
            damage.append(f"shard {e.shard}: {problem} ({e.rows} rows; a resume quarantines it and redoes them)")
            continue
        totals.add(e)
    return manifest, totals, damage


def print_status(folder: Path, verify: bool = False, stream=None) -> int:
    stream = stream or sys.stdout
    try:
        manifest, t, damage = folder_state(folder, verify)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = manifest.get("config", {})
    total = manifest.get("dataset", {}).get("rows")
    pct = f" ({100 * t.rows / total:.1f}%)" if total else ""
    lines = [
        f"output:    {folder}",
        f"dataset:   {manifest.get('dataset', {}).get('path')}",
        f"model:     {manifest.get('model', {}).get('path')}",
        f"mode:      {cfg.get('mode')} (K={cfg.get('draft_tokens')}, P={cfg.get('paths')}, tau={cfg.get('tau')})",
        f"rows:      {t.rows}/{total if total is not None else '?'} done{pct}, {t.errors} errors",
        f"tokens:    {t.completion_tokens} completion tokens in {t.shards} shards",
        f"speed:     {t.tokens_per_s:.1f} tokens/s (over {t.elapsed_s:.0f} s of work; ranks at work together count once)" if t.tokens_per_s else "speed:     -",
        f"acceptance length: {t.acceptance_length:.2f} tokens per verify step" if t.acceptance_length else "acceptance length: -",
        f"first use: {t.warmup_s:.1f} s warming up the decoder's step shapes "
        f"({100 * t.warmup_s / t.elapsed_s:.1f}% of the work time)" if t.warmup_s and t.elapsed_s else
        "first use: no warm-up recorded (the CPU has no first-use costs; --warm-up)",
        f"fingerprint: {manifest.get('fingerprint')}",
        f"checked:   {'sizes and CRC-32 of every shard' if verify else 'sizes of every shard (--verify adds CRC-32)'}: "
        + (f"{len(damage)} problem(s)" if damage else "intact"),
    ]
    print("\n".join(lines + [f"  damaged: {d}" for d in damage]), file=stream)
    return 1 if damage else 0
