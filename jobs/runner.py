"""The job loop: rows in, completions out, committed in shards.

The runner knows nothing about caches or drafts: it drives the engine's one
decoder (`mtp_engine.decoder`): ``batch_size`` rows at a time, rows joining
as others finish. A prompt with ``n`` completions is prefilled once; each
completion is an output row keyed ``(id, sample)``. A row is committed only
inside a shard; rows in flight when the process dies are redone on the next
run, done keys are skipped.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shlex
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import orjson

from jobs.config import (
    ConfigError,
    JobConfig,
    fingerprint,
    fingerprint_parts,
    model_identity,
)
from jobs import openai_batch
from jobs.lock import FolderInUse
from jobs.output import (
    MANIFEST,
    OutputError,
    OutputFolder,
    checked_entries,
    folder_schema_version,
    ledgers,
    progress_path,
    read_all_ledgers,
    read_manifest,
    writer_name,
)
from jobs.prefixes import WINDOW as PREFIX_WINDOW
from jobs.prefixes import PrefixCache, default_budget_bytes
from jobs.progress import Progress
from jobs.prompts import Preparer, Request, RowError, TemplateStuck, completion_seed, raw_id
from jobs.readers import PromptSource
from mtp_engine import MTPEngine
from mtp_engine.decoder import Decoder
from mtp_engine.model.hub import resolve_model
from mtp_engine.model.loader import load_checkpoint_tokenizer
from schemas.arrow import COMPLETION_SCHEMA, SCHEMA_VERSION, completion_row, error_row, logprob_values


@dataclass
class JobSummary:
    """What a run did.

    Attributes:
        output: The output folder.
        total: Prompts of the dataset (rows of the input; None if unknown).
        done: Completions (output rows) committed in total (this and
            earlier runs).
        completions: Completions the dataset asks for (each prompt's n).
        committed: Rows committed by this run.
        errors: Error rows committed by this run.
        tokens: Completion tokens committed by this run.
        elapsed_s: Wall time of this run's generation loop.
        interrupted: Name of the signal that stopped the run, if any.
    """

    output: Path
    total: int | None
    done: int
    completions: int | None
    committed: int
    errors: int
    tokens: int
    elapsed_s: float = 0.0
    interrupted: str | None = None

    def count(self) -> str:
        """``8/8 rows``, or ``24/24 completions of 8 prompts`` where prompts
        ask for several."""
        if self.completions is None or self.total is None:
            return f"{self.done} rows"
        if self.completions == self.total:
            return f"{self.done}/{self.total} rows"
        return f"{self.done}/{self.completions} completions of {self.total} prompts"


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
        self.warmup_s = 0.0  # the decoder's warm-up, recorded with the next shard

    def warmed(self, seconds: float) -> None:
        self.warmup_s += seconds

    def add(self, row: dict) -> None:
        self.rows.append(row)
        due = time.perf_counter() - self.last_commit >= self.commit_seconds
        if len(self.rows) >= self.rows_per_shard or due:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        self.rows.sort(key=lambda r: (r["index"], r.get("sample") or 0))  # input order within the shard
        now = time.perf_counter()
        self.out.commit(self.rows, wall_s=now - self.last_commit, warmup_s=self.warmup_s)
        self.warmup_s = 0.0
        self.committed += len(self.rows)
        self.errors += sum(r["finish_reason"] == "error" for r in self.rows)
        self.tokens += sum(r["completion_tokens"] or 0 for r in self.rows)
        self.rows = []
        self.last_commit = now


def build_manifest(config: JobConfig, tokenizer, source: PromptSource, scan: "DatasetScan", world: int,
                   schema_version: int = SCHEMA_VERSION) -> dict:
    """The job's manifest; ``tokenizer`` (the model's) gives its chat template."""
    model_id = model_identity(config.model)
    template = config.template_text() or getattr(tokenizer, "chat_template", None)
    kept = kept_columns(config, scan)
    logprobs = config.logprobs is not None or scan.logprobs
    parts = fingerprint_parts(config, model_id, template, schema_version, kept, logprobs)
    return {
        "kept_columns": kept,
        "logprobs": logprobs,
        "schema_version": schema_version,
        "fingerprint": fingerprint(parts),
        "fingerprint_parts": parts,
        "config": config.to_dict(),
        "model": {**model_id, "path": str(resolve_model(config.model).resolve())},
        "dataset": {"path": config.dataset, "rows": scan.prompts, "completions": scan.completions,
                    "identity": source.identity()},
        "world_size": world,
    }


def run_job(
    config: JobConfig,
    *,
    ranks: Ranks = Ranks(),
    engine: MTPEngine | None = None,
    stream=None,
    make_drafter=None,
    hooks=None,
) -> JobSummary:
    """Run (or resume) a generation job.

    Args:
        config: The job.
        ranks: This process's place under mlx.launch (rows are split by a
            hash of their id; rank 0 holds the folder's lock).
        engine: An already loaded engine for ``config.model`` (tests).
        stream: Where progress goes (default stderr).
        make_drafter: Makes the drafter of the job's decoder (benchmarks:
            drafts projected at an acceptance profile, `jobs.bench`);
            default the engine's choice.
        hooks: The decoder's `mtp_engine.decoder.Hooks` (benchmarks: each
            phase timed, `jobs.bench --phase-times`).

    Raises:
        FileNotFoundError, ValueError (bad model, dataset or configuration),
        OutputError (the folder cannot be used: in use, another job, another
        dataset, damaged, or the file system refused; the message names
        the path and what is committed).
    """
    stream = stream or sys.stderr
    rank, world = ranks.rank, ranks.world
    config = config.resolved()
    source = PromptSource(config.dataset)
    scan = scan_dataset(source, config)
    if engine is None:
        finished = _finished_already(config, source, scan, ranks)
        if finished is not None:
            return finished
        engine = MTPEngine.load(config.model, options=config.engine_options())
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    log = lambda m: print(prefix + m, file=stream, flush=True)  # noqa: E731
    out = OutputFolder(Path(config.output), writer_name(rank), log=log)
    version = _schema_version(config)
    manifest = build_manifest(config, engine.tokenizer, source, scan, world, version)
    try:
        _open_folder(out, config, manifest, ranks)
        return _run(config, engine, source, scan, out, ranks, stream, log, version, make_drafter, hooks)
    except OSError as e:
        raise OutputError(_os_error_message(e, out)) from None
    finally:
        out.close()


CLASHING = frozenset(COMPLETION_SCHEMA.names) | {"token_ids", "logprobs", "top_logprobs"}


def kept_columns(config: JobConfig, scan: "DatasetScan") -> list[str]:
    """The input columns the output rows carry: those named, or by default
    every one of the scanned rows whose name no output column has (nor the
    id and prompt fields, written as ``id`` and ``prompt``); a folder's
    resume keeps by default what the job first kept (none for a folder an
    older release wrote, whose manifest has no ``kept_columns``).

    Raises:
        ConfigError: A named column is in no row, or clashes.
    """
    path = Path(config.output) / MANIFEST
    if not config.overwrite and path.is_file():
        try:
            old = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            old = None
        if isinstance(old, dict) and "fingerprint" in old and config.keep_columns is None:
            return list(old.get("kept_columns", []))  # the folder's own: a resume keeps what the job first kept
    own = CLASHING | {config.id_field, config.prompt_field}
    if config.keep_columns is None:
        return [c for c in scan.columns if c not in own]
    for name in config.keep_columns:
        if name in own:
            raise ConfigError(f"keep_columns: {name!r} is already an output column; the output keeps it as such")
        if name not in scan.columns:
            raise ConfigError(f"keep_columns: no row has a column {name!r} (the rows have: "
                              f"{', '.join(scan.columns) or 'none'})")
    return list(config.keep_columns)


def _finished_already(config: JobConfig, source: PromptSource, scan: "DatasetScan", ranks: Ranks) -> JobSummary | None:
    """The summary of a job whose folder already holds every completion it
    asks for, found without loading the model's weights (its tokenizer
    gives the chat template of the fingerprint); None when anything is left
    to do, damaged, in doubt or another job's: the run then goes the usual way."""
    folder = Path(config.output)
    if ranks.world > 1 or config.overwrite or not (folder / MANIFEST).is_file():
        return None
    try:
        old = read_manifest(folder)
        checked = list(checked_entries(folder, checksum=False))
        if any(problem is not None for _, _, problem in checked) or any(ledger.read().tail for ledger in ledgers(folder)):
            return None
        done = {key for _, e, _ in checked for key in e.keys()}
        claims = Preparer(config, None, 0, reserved_ids=scan.ids)  # ids only: the model is not needed yet
        for row in source:
            if config.limit is not None and row.index >= config.limit:
                break
            if not _row_done(claims.claim_id(row)[0], row, config, done):
                return None
        # Everything is committed: now check it is this job's (the tokenizer gives the template).
        manifest = build_manifest(config, load_checkpoint_tokenizer(config.model), source, scan, 1,
                                  _schema_version(config))
    except (OutputError, OSError, ValueError, ConfigError):
        return None
    if old.get("fingerprint") != manifest["fingerprint"] or \
            (old.get("dataset") or {}).get("identity") != manifest["dataset"]["identity"]:
        return None
    print(f"nothing left to do: every row of {config.dataset} is committed in {folder} (the model was not loaded)",
          file=sys.stderr, flush=True)
    return JobSummary(output=folder, total=scan.prompts, done=len(done), completions=scan.completions, committed=0,
                      errors=0, tokens=0)


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


def _schema_version(config: JobConfig) -> int:
    """The output schema the job writes: the folder's own when it resumes
    one written by an older release, else the current one.

    Raises:
        ConfigError: The job samples into a folder of schema 1 (greedy,
            one completion per prompt).
    """
    old = None if config.overwrite else folder_schema_version(Path(config.output))
    if old is None or old == SCHEMA_VERSION:
        return SCHEMA_VERSION
    if old == 1 and (config.n > 1 or config.temperature > 0):
        raise ConfigError(f"{config.output} was written by an older release (output schema {old}: no sample or "
                          "seed columns) and cannot hold sampled rows; write this job to a new --output, or "
                          "--overwrite it")
    return old


def _describe_decoding(config: JobConfig) -> str:
    """The mode, its drafts and the batch size, for the job's first line."""
    drafts = {"baseline": "", "auto": f" (0..{config.draft_tokens} drafts a step, chosen as it runs)"}
    return f"mode {config.mode}{drafts.get(config.mode, f' K={config.draft_tokens}')} | batch {config.batch_size}"


def _os_error_message(e: OSError, out: OutputFolder) -> str:
    what = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename else ""
    hint = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
            errno.EROFS: "the file system is read-only", errno.EACCES: "check the permissions",
            errno.EPERM: "check the permissions", errno.ENOTDIR: "a part of --output is a file",
            errno.EEXIST: "a file is in the way"}.get(e.errno, "")
    try:  # what the ledgers hold (the open may have failed before reading them)
        done = len({key for e in read_all_ledgers(out.path) for key in e.keys()})
    except (OutputError, OSError):
        done = out.totals.rows
    kept = (f"{done} rows were committed before and are intact; rerun the same command to resume"
            if done else "nothing had been committed")
    return f"cannot write to {out.path}: {what}{where}{'; ' + hint if hint else ''}. {kept}"


def _run(config, engine, source, scan, out, ranks, stream, log, version, make_drafter=None, hooks=None) -> JobSummary:
    rank, world = ranks.rank, ranks.world
    progress_log = lambda m: progress.log(m)  # noqa: E731  (progress is made below)
    preparer = Preparer(config, engine.tokenizer, engine.context_length, reserved_ids=scan.ids,
                        sampling_allowed=version >= 2, log=progress_log,
                        keep_columns=tuple(out.manifest.get("kept_columns", ())),
                        logprob_columns=bool(out.manifest.get("logprobs")))
    buffer = _Buffer(out, config.rows_per_shard, config.commit_seconds)
    progress = Progress(
        scan.completions if world == 1 else None,
        prompts=scan.prompts if scan.completions != scan.prompts else None,
        done=len(out.done) if world == 1 else 0,
        stream=stream,
        prefix=f"[rank {rank}/{world}] " if world > 1 else "",
        quiet=config.quiet,
        status_file=progress_path(out.path, writer_name(rank)),
        eta_after=config.batch_size,
    )
    progress.info(
        f"job: {config.dataset} -> {config.output} | model {Path(config.model).name} | "
        f"{_describe_decoding(config)} | {_describe_sampling(config)} | "
        f"{len(out.done)} rows already done"
    )
    if source.empty_reason is not None:
        progress.log(f"note: {source.empty_reason}; nothing to generate")
    if rank == 0 and config.verbose:
        for status in engine.fast_paths:
            progress.info(status.line())
    elif rank == 0:
        progress.info(fast_path_summary(engine.fast_paths))

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
        stuck: list[TemplateStuck] = []
        work = _work(source, config, preparer, out.done, rank, world, stop, stuck)
        try:
            _decode(engine, config, work, finish, stop, log=progress.log, info=progress.info, warmed=buffer.warmed,
                report=progress.report, make_drafter=make_drafter, hooks=hooks)
            buffer.flush()
        except BaseException:
            progress.close("failed")
            raise
        if stuck:  # the rows admitted before it were finished and committed
            progress.close("failed")
            raise stuck[0]
        progress.close("interrupted" if stop.requested else "finished")
        if world > 1 and not stop.requested:
            ranks.barrier()  # every rank's rows are committed
            if rank == 0:
                out.refresh_views()

    return JobSummary(
        output=out.path,
        total=scan.prompts,
        done=len(out.done),
        completions=scan.completions,
        committed=buffer.committed,
        errors=buffer.errors,
        tokens=buffer.tokens,
        elapsed_s=time.perf_counter() - started,
        interrupted=stop.signal_name,
    )


@dataclass(frozen=True)
class DatasetScan:
    """One pass over the dataset before the job starts.

    Attributes:
        ids: Every id the dataset gives itself, so ids made for duplicates
            never take one of them.
        prompts: Its rows (prompts) up to ``--limit``.
        completions: The completions they ask for: each row's n (the job's
            unless the row sets a valid one).
        columns: The rows' field names, in order of first appearance.
        logprobs: Whether a row asks for log-probabilities itself.
    """

    ids: set[str]
    prompts: int
    completions: int
    columns: tuple[str, ...] = ()
    logprobs: bool = False


def scan_dataset(source: PromptSource, config: JobConfig) -> DatasetScan:
    ids, prompts, completions, columns, logprobs = set(), 0, 0, {}, False
    for row in source:
        if config.limit is not None and row.index >= config.limit:
            break
        if isinstance(row.data, dict) and not openai_batch.is_request(row.data):
            columns.update(dict.fromkeys(row.data))
            logprobs = logprobs or row.data.get("logprobs") is not None
        elif isinstance(row.data, dict) and isinstance(row.data.get("body"), dict):
            logprobs = logprobs or bool(row.data["body"].get("logprobs"))
        prompts += 1
        completions += 1 if row.error is not None else _row_n_hint(row, config)  # an unreadable row: one error row
        raw = raw_id(row.data, config.id_field)
        if isinstance(raw, (str, int)) and not isinstance(raw, bool):
            ids.add(str(raw))
    return DatasetScan(ids, prompts, completions, tuple(columns), logprobs)


def _describe_sampling(config: JobConfig) -> str:
    if config.temperature == 0:
        return "greedy" + (" (rows may sample)" if config.n == 1 else "")
    filters = [f"{k} {v}" for k, v, off in (("top_p", config.top_p, 1.0), ("top_k", config.top_k, 0),
                                            ("min_p", config.min_p, 0.0)) if v != off]
    return (f"sampling T={config.temperature}{', ' + ', '.join(filters) if filters else ''}, n={config.n}, "
            f"seed {config.seed}, {config.sampler} sampler")


@dataclass(frozen=True)
class Work:
    """A prepared row and the completions (sample indices) it still needs."""

    request: Request
    samples: tuple[int, ...]


def _row_n_hint(row, config: JobConfig) -> int:
    """The row's n without preparing it (the job's unless the row sets a
    valid one), to skip finished prompts cheaply on resume."""
    data = row.data or {}
    n = (data.get("body") or {}).get("n") if isinstance(data.get("body"), dict) else data.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else config.n


def _row_done(rid: str, row, config: JobConfig, done) -> bool:
    """Whether every completion the row asks for is committed (its n read
    without preparing it)."""
    return all((rid, j) in done for j in range(_row_n_hint(row, config)))


def _work(source, config, preparer, done, rank, world, stop, stuck: list) -> Iterator[Work | RowError]:
    """Rows still to do, prepared, in dataset order (stops when asked, or
    when the chat template is stuck: the error goes into ``stuck``)."""
    for row in source:
        if config.limit is not None and row.index >= config.limit:
            return
        rid, error = preparer.claim_id(row)
        if row_owner(rid, world) != rank or _row_done(rid, row, config, done):
            continue
        if stop.requested:
            return
        try:
            item = error if error is not None else preparer.prepare(row, rid)
        except TemplateStuck as e:
            stuck.append(e)
            return
        if isinstance(item, RowError):
            if (rid, 0) not in done:  # a row that cannot be generated: one error row, sample 0
                yield item
            continue
        samples = tuple(j for j in range(item.n) if (rid, j) not in done)
        if samples:
            yield Work(item, samples)


def _error_to_row(e: RowError, job_seed: int) -> dict:
    """An input's error row; its seed is the one sample 0 would have had
    (every row carries a seed, so readers keep the column as integers)."""
    return {**error_row(id=e.id, index=e.index, line=e.line, kind=e.kind, message=e.message, prompt=e.prompt,
                        chat=e.chat, seed=completion_seed(job_seed, e.id, 0)), **e.kept}


def _request_result(req: Request, sample: int, result, failure: str | None) -> dict:
    if failure is not None:
        row = error_row(
            id=req.id, index=req.index, line=req.line, kind="generation_failed", message=failure, prompt=req.prompt,
            sample=sample, n=req.n, seed=req.seed(sample), chat=req.chat,
        )
    else:
        row = {**completion_row(id=req.id, index=req.index, line=req.line, prompt=req.prompt, result=result,
                                sample=sample, n=req.n, chat=req.chat, seed=req.seed(sample)), **logprob_values(result)}
    return {**row, **req.kept}


def _finish_result(finish, req: Request, sample: int, result, failure: str | None) -> None:
    stats = result.stats if result is not None else None
    speculative = stats is not None and stats.draft_tokens > 0
    finish(_request_result(req, sample, result, failure), steps=stats.steps if speculative else 0,
           accepted=stats.accepted if speculative else 0)


# Whole-batch failures in a row after which the rest of the job decodes one
# row at a time (a backend that cannot run batched prefill for this model
# would otherwise fail, and redo, every batch).
BATCH_FAILURES_BEFORE_FALLBACK = 2


def _alone(engine, config, item: Work, finish, attempts: int = 2) -> None:
    """A prompt's completions in a batch of their own, tried ``attempts``
    times (MLX's cache freed after a failure); then an error row per
    completion (a broken row must not end the job)."""
    req = item.request
    failure = None
    for _ in range(attempts):
        decoder = Decoder(engine, replace(config.decode_config(), batch_size=len(item.samples)))
        try:
            decoder.add(req.id, req.prompt_ids, [req.sample_params(j) for j in item.samples],
                        max_tokens=req.max_tokens, stop=list(req.stop) or None, logprobs=req.logprobs,
                        constraint=req.constraint)
            results = {}
            while decoder.pending:
                results.update(decoder.step())
            for i, sample in enumerate(item.samples):
                _finish_result(finish, req, sample, results[(req.id, i)], None)
            return
        except Exception as e:  # a broken row must not end the job
            failure = f"{type(e).__name__}: {e}"
            mx.clear_cache()
        finally:
            decoder.close()
    for sample in item.samples:
        _finish_result(finish, req, sample, None, failure)


def _decode(engine, config, work, finish, stop, log=None, info=None, warmed=lambda seconds: None,
            report=lambda name, value: None, make_drafter=None, hooks=None) -> None:
    """Rows decoded ``batch_size`` at once (`mtp_engine.decoder`): as one
    finishes, the next joins; a prompt's completions share its prefill. If
    a whole batch fails, its rows are redone in batches of their own, and
    after `BATCH_FAILURES_BEFORE_FALLBACK` such failures in a row every
    prompt is."""
    warm = config.warm_up or (config.warm_up is None and mx.default_device() != mx.cpu)
    # a warm-up meets the step shapes of row-count buckets (finished rows keep their places down to a bucket)
    decoder = Decoder(engine, config.decode_config(), hooks, drafter=make_drafter() if make_drafter else None,
                      buckets=warm)
    prefixes = None
    if config.prefix_sharing:
        budget = int(config.prefix_cache_gb * 2**30) if config.prefix_cache_gb else default_budget_bytes()
        prefixes = PrefixCache(engine, config.prefix_min_tokens, budget, log=log or (lambda m: None))
    if warm:
        seconds, shapes, reused = decoder.warm_up(config.sampling())
        warmed(seconds)
        if info is not None:
            rows = ", ".join(map(str, decoder.buckets))
            info(f"warm-up: {shapes} step shapes (rows {rows}) in {seconds:.1f} s" if shapes else
                 f"warm-up: every step shape (rows {rows}) met earlier by this engine; its step costs reused"
                 if reused == len(decoder.buckets) else
                 f"warm-up: no step shape met (rows {rows}): its rows ended at their first token; the job meets them")
    in_flight: dict[str, list] = {}  # id -> [Work, sample indices still running]
    failures = 0

    def drain_one_step() -> None:
        nonlocal failures
        try:
            finished = decoder.step()
        except Exception as e:
            failures += 1
            mx.clear_cache()
            decoder.close()
            for item, running in list(in_flight.values()):  # the batch was their first try: one retry
                _alone(engine, config, Work(item.request, tuple(running)), finish, attempts=1)
            in_flight.clear()
            if failures == BATCH_FAILURES_BEFORE_FALLBACK and log is not None:
                log(f"batch decoding failed {failures} times in a row ({type(e).__name__}: {e}); "
                    "decoding the remaining rows one at a time")
            return
        failures = 0
        for (rid, j), result in finished:
            item, running = in_flight[rid]
            sample = item.samples[j]
            running.remove(sample)
            if not running:
                del in_flight[rid]
            _finish_result(finish, item.request, sample, result, None)

    items, ahead = iter(work), deque()  # rows read ahead: a shared prefix is found at its group's first row
    read_ahead = 1 + (PREFIX_WINDOW if prefixes is not None else 0)

    def next_item():
        while len(ahead) < read_ahead and (item := next(items, None)) is not None:
            ahead.append(item)
        return ahead.popleft() if ahead else None

    try:
        while (item := next_item()) is not None and not stop.requested:
            if isinstance(item, RowError):
                finish(_error_to_row(item, config.seed))
                continue
            while decoder.pending and decoder.pending + len(item.samples) > config.batch_size:
                drain_one_step()
            if failures >= BATCH_FAILURES_BEFORE_FALLBACK:  # batching given up; nothing in flight
                _alone(engine, config, item, finish)
                continue
            req = item.request
            try:
                prefix = None if prefixes is None else prefixes.find(
                    req.prompt_ids, (w.request.prompt_ids for w in ahead if isinstance(w, Work)))
                decoder.add(req.id, req.prompt_ids, [req.sample_params(j) for j in item.samples],
                            max_tokens=req.max_tokens, stop=list(req.stop) or None, prefix=prefix,
                            logprobs=req.logprobs, constraint=req.constraint)
            except Exception:  # the row alone names what is wrong with it
                _alone(engine, config, item, finish)
                continue
            in_flight[req.id] = [item, list(item.samples)]
        while decoder.pending and not stop.requested:
            drain_one_step()
        if stop.requested:
            decoder.close()  # rows in flight are redone on resume
        if decoder.controller is not None and info is not None:
            info(decoder.controller.describe())
        if prefixes is not None and prefixes.made:
            if info is not None:
                info(prefixes.describe())
            report("prefixes", prefixes.summary())
    finally:
        decoder.close()


def fast_path_summary(statuses) -> str:
    """The engine's fast paths in one line (``--verbose``: one line each)."""
    by_state: dict[str, list[str]] = {}
    for status in statuses:
        by_state.setdefault(status.state, []).append(status.name)
    parts = [f"{len(by_state[s])} {s} ({', '.join(by_state[s])})" if s == "on" else f"{len(by_state[s])} {s}"
             for s in ("on", "off", "unavailable") if s in by_state]
    return f"fast paths: {'; '.join(parts)} (--verbose for each)"


def resume_hint() -> str:
    """The command that resumes this job, with the interpreter running it
    (relative to the working folder where it lies below it, as ``.venv/bin/python``
    does), so it works as printed outside the virtualenv too."""
    python = sys.executable
    relative = os.path.relpath(python) if os.path.isabs(python) else python
    if not relative.startswith(".."):
        python = relative
    return f"{shlex.quote(python)} -m jobs " + shlex.join(sys.argv[1:])
