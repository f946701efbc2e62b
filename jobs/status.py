"""``python -m jobs status DIR``: what a job's output folder holds."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from jobs.output import MANIFEST, Totals, read_all_ledgers


def folder_totals(folder: Path) -> tuple[dict, Totals]:
    """The manifest and totals summed over every ledger of the folder."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{folder} is not a job output folder (no {MANIFEST})")
    manifest = orjson.loads(manifest_path.read_bytes())
    totals = Totals()
    for entry in read_all_ledgers(folder):
        totals.add(entry)
    return manifest, totals


def print_status(folder: Path, stream=None) -> int:
    stream = stream or sys.stdout
    try:
        manifest, t = folder_totals(folder)
    except FileNotFoundError as e:
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
        f"fingerprint: {manifest.get('fingerprint')}",
    ]
    print("\n".join(lines), file=stream)
    return 0
