"""The job loop: rows in, completions out, committed in shards.

The runner knows nothing about caches or drafts: it drives the engine's
batched decoder (modes chain and baseline with a batch size over 1: rows
join as others finish) or asks for one completion at a time (the other
modes). A row is committed only inside a shard; rows in flight when
the process dies are redone on the next run, done ids are skipped.
"""

from __future__ import annotations

import errno
import hashlib
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from jobs.config import JobConfig, fingerprint, fingerprint_parts, model_identity
from jobs.lock import FolderInUse
from jobs.output import OutputError, OutputFolder, read_all_ledgers, writer_name
from jobs.progress import Progress
from jobs.prompts import Preparer, Request, RowError
from jobs.readers import PromptSource
from mtp_engine import MTPEngine
from mtp_engine.batched import BatchedDecoder
from schemas.arrow import SCHEMA_VERSION, completion_row, error_row


@dataclass
class JobSummary:
    """What a run did.

    Attributes:
        output: The output folder.
        total: Rows of the dataset for this process (None if unknown).
        done: Rows committed in total (this and earlier runs).
        committed: Rows committed by this run.
        errors: Error rows committed by this run.
        tokens: Completion tokens committed by this run.
        elapsed_s: Wall time of this run's generation loop.
        interrupted: Name of the signal that stopped the run, if any.
    """

    output: Path
    total: int | None
    done: int
    committed: int
    errors: int
    tokens: int
    elapsed_s: float = 0.0
    interrupted: str | None = None


class StopRequest:
    """SIGINT/SIGTERM set a flag the loop checks between rows; a second
    SIGINT stops at once (uncommitted rows are redone on resume)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        print(
            f"\n{self.signal_name}: finishing the row in flight and committing; "
            "press Ctrl-C again to stop at once",
            file=sys.stderr,
            flush=True,
        )

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of one job under mlx.launch.

    Attributes:
        rank, world: This rank and the number of ranks.
        share: Returns rank 0's value on every rank (waiting for all of them).
    """

    rank: int = 0
    world: int = 1
    share: Callable[[int], int] | None = None

    def barrier(self) -> None:
        self.share(0)


def row_owner(row_id: str, world: int) -> int:
    """Rank that handles a row: a stable hash of its id."""
    if world == 1:
        return 0
    return int.from_bytes(hashlib.sha1(row_id.encode()).digest()[:8], "big") % world


class _Buffer:
    """Finished rows waiting for their shard."""

    def __init__(self, out: OutputFolder, rows_per_shard: int, commit_seconds: float):
        self.out = out
        self.rows: list[dict] = []
        self.rows_per_shard = rows_per_shard
        self.commit_seconds = commit_seconds
        self.last_commit = time.perf_counter()
        self.committed = self.errors = self.tokens = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        due = time.perf_counter() - self.last_commit >= self.commit_seconds
        if len(self.rows) >= self.rows_per_shard or due:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        now = time.perf_counter()
        self.out.commit(self.rows, wall_s=now - self.last_commit)
        self.committed += len(self.rows)
        self.errors += sum(r["finish_reason"] == "error" for r in self.rows)
        self.tokens += sum(r["completion_tokens"] or 0 for r in self.rows)
        self.rows = []
        self.last_commit = now


def build_manifest(config: JobConfig, engine: MTPEngine, source: PromptSource, total: int | None, world: int) -> dict:
    model_id = model_identity(config.model)
    template = getattr(engine.tokenizer, "chat_template", None)
    parts = fingerprint_parts(config, model_id, template)
    return {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fingerprint(parts),
        "fingerprint_parts": parts,
        "config": config.to_dict(),
        "model": {**model_id, "path": str(Path(config.model).expanduser().resolve())},
        "dataset": {"path": config.dataset, "rows": total, "identity": source.identity()},
        "world_size": world,
    }


def run_job(
    config: JobConfig,
    *,
    ranks: Ranks = Ranks(),
    engine: MTPEngine | None = None,
    stream=None,
) -> JobSummary:
    """Run (or resume) a generation job.

    Args:
        config: The job.
        ranks: This process's place under mlx.launch (rows are split by a
            hash of their id; rank 0 holds the folder's lock).
        engine: An already loaded engine for ``config.model`` (tests).
        stream: Where progress goes (default stderr).

    Raises:
        FileNotFoundError, ValueError (bad model, dataset or configuration),
        OutputError (the folder cannot be used: in use, another job, another
        dataset, damaged, or the file system refused; the message names
        the path and what is committed).
    """
    stream = stream or sys.stderr
    rank, world = ranks.rank, ranks.world
    requested = config.mode
    config = config.resolved("cpu" if mx.default_device() == mx.cpu else "gpu")
    engine = engine or MTPEngine.load(config.model, options=config.engine_options())
    source = PromptSource(config.dataset)
    total = len(source)
    if config.limit is not None:
        total = min(total, config.limit)
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    log = lambda m: print(prefix + m, file=stream, flush=True)  # noqa: E731
    out = OutputFolder(Path(config.output), writer_name(rank), log=log)
    manifest = build_manifest(config, engine, source, total, world)
    try:
        _open_folder(out, config, manifest, ranks)
        return _run(config, requested, engine, source, total, out, ranks, stream, log)
    except OSError as e:
        raise OutputError(_os_error_message(e, out)) from None
    finally:
        out.close()


def _open_folder(out: OutputFolder, config: JobConfig, manifest: dict, ranks: Ranks) -> None:
    """Open the folder; under mlx.launch rank 0 opens (and locks) it and the
    others join it once rank 0 says it succeeded."""
    open_kwargs = dict(overwrite=config.overwrite, allow_dataset_change=config.allow_dataset_change)
    if ranks.world == 1:
        out.open(manifest, token=secrets.token_hex(8), **open_kwargs)
        return
    token = f"{ranks.share(secrets.randbelow(2**31 - 1) if ranks.rank == 0 else 0):x}"
    failure = None
    if ranks.rank == 0:
        try:
            out.open(manifest, token=token, **open_kwargs)
        except (OutputError, FolderInUse, OSError) as e:
            failure = e
    if ranks.share(0 if failure is None else 1):
        if failure is not None:
            raise failure
        raise OutputError(f"rank 0 could not open {out.path}; see its message")
    if ranks.rank != 0:
        out.join(manifest, token)


def _os_error_message(e: OSError, out: OutputFolder) -> str:
    what = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename else ""
    hint = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
            errno.EROFS: "the file system is read-only", errno.EACCES: "check the permissions",
            errno.EPERM: "check the permissions", errno.ENOTDIR: "a part of --output is a file",
            errno.EEXIST: "a file is in the way"}.get(e.errno, "")
    try:  # what the ledgers hold (the open may have failed before reading them)
        done = len({rid for e in read_all_ledgers(out.path) for rid in e.ids})
    except (OutputError, OSError):
        done = out.totals.rows
    kept = (f"{done} rows were committed before and are intact; rerun the same command to resume"
            if done else "nothing had been committed")
    return f"cannot write to {out.path}: {what}{where}{'; ' + hint if hint else ''}. {kept}"


def _run(config, requested, engine, source, total, out, ranks, stream, log) -> JobSummary:
    rank, world = ranks.rank, ranks.world
    preparer = Preparer(config, engine.tokenizer, engine.context_length, reserved_ids=_raw_ids(source, config))
    buffer = _Buffer(out, config.rows_per_shard, config.commit_seconds)
    mine_total = total if world == 1 else None
    progress = Progress(
        mine_total,
        done=len(out.done_ids) if world == 1 else 0,
        stream=stream,
        prefix=f"[rank {rank}/{world}] " if world > 1 else "",
    )
    progress.log(
        f"job: {config.dataset} -> {config.output} | model {Path(config.model).name} | "
        f"mode {config.mode}{' (auto)' if requested == 'auto' else ''} | "
        f"{len(out.done_ids)} rows already done"
    )
    if source.empty_reason is not None:
        progress.log(f"note: {source.empty_reason}; nothing to generate")
    if rank == 0:
        for status in engine.fast_paths:
            progress.log(status.line())

    def finish(row: dict, steps: int = 0, accepted: int = 0) -> None:
        buffer.add(row)
        progress.update(
            error=row["finish_reason"] == "error",
            tokens=row["completion_tokens"] or 0,
            steps=steps,
            accepted=accepted,
        )

    started = time.perf_counter()
    with StopRequest() as stop:
        work = _work(source, config, preparer, out.done_ids, rank, world, stop)
        if config.batched:
            _run_batched(engine, config, work, finish, stop, log=progress.log)
        else:
            _run_one_at_a_time(engine, config, work, finish)
        buffer.flush()
        progress.close()
        if world > 1 and not stop.requested:
            ranks.barrier()  # every rank's rows are committed
            if rank == 0:
                out.refresh_views()

    return JobSummary(
        output=out.path,
        total=total,
        done=len(out.done_ids),
        committed=buffer.committed,
        errors=buffer.errors,
        tokens=buffer.tokens,
        elapsed_s=time.perf_counter() - started,
        interrupted=stop.signal_name,
    )


def _raw_ids(source: PromptSource, config: JobConfig) -> set[str]:
    """Every id the dataset itself gives (a pass over its rows), so ids made
    for duplicates never take one of them."""
    ids = set()
    for row in source:
        if config.limit is not None and row.index >= config.limit:
            break
        raw = (row.data or {}).get(config.id_field)
        if isinstance(raw, (str, int)) and not isinstance(raw, bool):
            ids.add(str(raw))
    return ids


def _work(source, config, preparer, done_ids, rank, world, stop) -> Iterator[Request | RowError]:
    """Rows still to do, prepared, in dataset order (stops when asked)."""
    for row in source:
        if config.limit is not None and row.index >= config.limit:
            return
        rid, error = preparer.claim_id(row)
        if rid in done_ids or row_owner(rid, world) != rank:
            continue
        if stop.requested:
            return
        yield error if error is not None else preparer.prepare(row, rid)


def _error_to_row(e: RowError) -> dict:
    return error_row(id=e.id, index=e.index, line=e.line, kind=e.kind, message=e.message, prompt=e.prompt)


def _generate_with_retry(engine: MTPEngine, config: JobConfig, req: Request):
    """Generate; on an exception free MLX's cache and try once more."""
    kwargs = dict(
        max_tokens=req.max_tokens,
        mode="baseline" if config.mode == "batch" else config.mode,
        draft_tokens=config.draft_tokens,
        tau=config.tau,
        paths=config.paths,
        stop=list(req.stop) or None,
    )
    for attempt in (1, 2):
        try:
            return engine.generate(req.prompt_ids, **kwargs), None
        except Exception as e:  # a broken row must not end the job
            if attempt == 2:
                return None, f"{type(e).__name__}: {e}"
            mx.clear_cache()


def _request_result(req: Request, result, failure: str | None) -> dict:
    if failure is not None:
        return error_row(
            id=req.id, index=req.index, line=req.line, kind="generation_failed",
            message=failure, prompt=req.prompt,
        )
    return completion_row(id=req.id, index=req.index, line=req.line, prompt=req.prompt, result=result)


def _run_one_at_a_time(engine, config, work, finish) -> None:
    for item in work:
        if isinstance(item, RowError):
            finish(_error_to_row(item))
            continue
        result, failure = _generate_with_retry(engine, config, item)
        _finish_result(finish, item, result, failure)


def _finish_result(finish, req: Request, result, failure: str | None) -> None:
    stats = result.stats if result is not None else None
    speculative = stats is not None and stats.draft_tokens > 0
    finish(_request_result(req, result, failure), steps=stats.steps if speculative else 0,
           accepted=stats.accepted if speculative else 0)


# Whole-batch failures in a row after which the rest of the job decodes one
# row at a time (a backend that cannot run batched prefill for this model
# would otherwise fail, and redo, every batch).
BATCH_FAILURES_BEFORE_FALLBACK = 2


def _run_batched(engine, config, work, finish, stop, log=None) -> None:
    """Rows decoded ``batch_size`` at once (`mtp_engine.batched`): as one
    finishes, the next joins."""
    mode = "chain" if config.mode == "chain" else "baseline"
    decoder = BatchedDecoder(engine, config.batch_size, mode, config.draft_tokens, label=config.mode)
    in_flight: dict[str, Request] = {}
    failures = 0

    def one_row(req: Request) -> None:
        _finish_result(finish, req, *_generate_with_retry(engine, config, req))

    def drain_one_step() -> None:
        nonlocal failures
        try:
            finished = decoder.step()
        except Exception as e:
            # The whole batch failed: redo its rows one at a time, with a retry.
            failures += 1
            mx.clear_cache()
            for key in decoder.drop_all():
                one_row(in_flight.pop(key))
            if failures == BATCH_FAILURES_BEFORE_FALLBACK and log is not None:
                log(f"batch decoding failed {failures} times in a row ({type(e).__name__}: {e}); "
                    "decoding the remaining rows one at a time")
            return
        failures = 0
        for key, result in finished:
            _finish_result(finish, in_flight.pop(key), result, None)

    try:
        for item in work:
            if isinstance(item, RowError):
                finish(_error_to_row(item))
                continue
            while decoder.pending >= config.batch_size:
                drain_one_step()
            if failures >= BATCH_FAILURES_BEFORE_FALLBACK:  # batching given up; nothing in flight
                one_row(item)
                continue
            in_flight[item.id] = item
            decoder.add(item.id, item.prompt_ids, max_tokens=item.max_tokens, stop=list(item.stop) or None)
        while decoder.pending and not stop.requested:
            drain_one_step()
        if stop.requested:
            decoder.drop_all()  # rows in flight are redone on resume
    finally:
        decoder.close()


def resume_hint() -> str:
    return "python -m jobs " + shlex.join(sys.argv[1:])
