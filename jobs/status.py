"""``python -m jobs status DIR [--verify]``: what a job's output folder
holds, and whether it is intact (every shard's size always; with
``--verify`` its CRC-32 too). Damage is listed and makes the exit status 1;
a resume repairs it (the damaged shards' rows are redone)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson

from jobs.ledger import Totals
from jobs.lock import FolderLock
from jobs.output import PROGRESS_PATTERN, REPEATED_LINE, OutputError, checked_entries, ledgers, read_manifest


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


def run_lines(folder: Path) -> list[str]:
    """Each writer's last run, from its live status file (`jobs.progress`):
    running now (the folder's lock is held), or how and when it ended."""
    held = FolderLock(folder).is_held()
    lines = []
    for path in sorted(p for p in folder.iterdir() if PROGRESS_PATTERN.match(p.name)):
        try:
            data = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("updated"), (int, float)):
            continue
        who = f"pid {data.get('pid')} on {data.get('host')}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["updated"]))
        if data.get("state") == "running" and held:
            lines.append(f"running:   {who}, {time.time() - data['updated']:.0f} s ago: {data.get('line')}")
        elif data.get("state") == "running":
            lines.append(f"last run:  stopped at {when} without finishing ({who} is gone): {data.get('line')}")
        else:
            lines.append(f"last run:  {data.get('state')} at {when} ({who}): {data.get('line')}")
        p = data.get("prefixes")
        if isinstance(p, dict):
            lines.append(f"prefixes:  {p.get('rows')} rows started from a shared prefix, {p.get('tokens_saved')} "
                         f"prompt tokens not prefilled ({p.get('prefilled')} prefixes prefilled, cache peak "
                         f"{(p.get('peak_bytes') or 0) / 2**20:.1f} MiB)")
    return lines


def count_line(done: int, dataset: dict, cfg: dict) -> str:
    """``8/8 done (100.0%)``, or ``24/24 completions done (100.0%) of 8
    prompts`` where prompts ask for several."""
    prompts = dataset.get("rows")
    expected = dataset.get("completions")
    if expected is None and prompts is not None:  # manifests before the count: every prompt the job's n
        expected = prompts * (cfg.get("n") or 1)
    pct = f" ({100 * done / expected:.1f}%)" if expected else ""
    if expected is None or expected == prompts:
        return f"{done}/{expected if expected is not None else '?'} done{pct}"
    return f"{done}/{expected} completions done{pct} of {prompts} prompts"


def describe_mode(cfg: dict) -> str:
    """The mode and the settings it uses."""
    mode = cfg.get("mode")
    used = {"auto": ["draft_tokens"], "chain": ["draft_tokens"], "adaptive": ["draft_tokens", "tau"],
            "paths": ["draft_tokens", "paths"], "tree": ["draft_tokens", "tree_pos2"],
            "adaptive_tree": ["draft_tokens", "tau"]}.get(mode, [])
    names = {"draft_tokens": "K", "paths": "P"}
    settings = ", ".join(f"{names.get(k, k)}={cfg.get(k)}" for k in used)
    return f"{mode} ({settings})" if settings else str(mode)


def print_status(folder: Path, verify: bool = False, stream=None) -> int:
    stream = stream or sys.stdout
    try:
        manifest, t, damage = folder_state(folder, verify)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = manifest.get("config", {})
    dataset = manifest.get("dataset", {})
    paths = dataset.get("path")
    lines = [
        f"output:    {folder}",
        f"dataset:   {', '.join(map(str, paths)) if isinstance(paths, list) else paths}",
        f"model:     {manifest.get('model', {}).get('path')}",
        f"mode:      {describe_mode(cfg)}",
        f"rows:      {count_line(t.rows, dataset, cfg)} (committed), {t.errors} errors",
        *run_lines(folder),
        f"tokens:    {t.completion_tokens} completion tokens in {t.shards} shards",
        f"speed:     {t.tokens_per_s:.1f} tokens/s (over {t.elapsed_s:.0f} s of work; ranks at work together count once)" if t.tokens_per_s else "speed:     -",
        "acceptance length: - (plain decoding: no drafts)" if cfg.get("mode") == "baseline" else
        f"acceptance length: {t.acceptance_length:.2f} tokens per verify step" if t.acceptance_length else
        "acceptance length: -",
        f"first use: {t.warmup_s:.1f} s warming up the decoder's step shapes "
        f"({100 * t.warmup_s / t.elapsed_s:.1f}% of the work time)" if t.warmup_s and t.elapsed_s else
        "first use: no warm-up recorded (the CPU has no first-use costs; --warm-up)",
        f"fingerprint: {manifest.get('fingerprint')}",
        f"checked:   {'sizes and CRC-32 of every shard' if verify else 'sizes of every shard (--verify adds CRC-32)'}: "
        + (f"{len(damage)} problem(s)" if damage else "intact"),
    ]
    print("\n".join(lines + [f"  damaged: {d}" for d in damage]), file=stream)
    return 1 if damage else 0
