"""The output folder: Arrow shards, ledgers, manifest, and the files that
make it a ``datasets.load_from_disk`` folder at every moment.

Commit order for one shard, each step durable before the next:
1. write ``.tmp-<shard>``, fsync, rename to ``<shard>``, fsync the folder;
2. append one line to this writer's ledger (``ledger-<writer>.jsonl``), fsync;
3. rewrite ``state.json``/``dataset_info.json`` and the manifest atomically.

So ``state.json`` lists only shards in a ledger, and a ledger only shards on
disk. A crash between 1 and 2 leaves an orphan shard, deleted on resume (its
rows were never marked done and are redone). A torn last ledger line is
dropped. Resume keys on row ids recorded in the ledgers, never on positions.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from schemas.arrow import COMPLETION_SCHEMA, dataset_features_dict, rows_to_batch

MANIFEST = "manifest.json"
EMPTY_SHARD = "data-empty.arrow"
_SHARD = re.compile(r"^data-(?P<writer>r\d{3})-(?P<seq>\d{5})\.arrow$")
_LEDGER = re.compile(r"^ledger-(?P<writer>r\d{3})\.jsonl$")

# Transient file-system errors (NFS hiccups, a full disk being cleared) get a
# few tries with bounded backoff before the job gives up.
_retry_io = retry(
    retry=retry_if_exception_type(OSError),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=5.0),
    reraise=True,
)


class OutputError(RuntimeError):
    """The output folder cannot be used as asked."""


class FingerprintMismatch(OutputError):
    """The folder holds results of a differently configured job."""


def writer_name(rank: int) -> str:
    return f"r{rank:03d}"


def shard_name(writer: str, seq: int) -> str:
    return f"data-{writer}-{seq:05d}.arrow"


def _crash_point(stage: str) -> None:
    """Fault injection for the crash tests: ``MTP_JOBS_CRASH_AT=stage:n``
    kills the process with SIGKILL the n-th time ``stage`` is reached."""
    spec = os.environ.get("MTP_JOBS_CRASH_AT")
    if not spec:
        return
    want, _, count = spec.partition(":")
    if want != stage:
        return
    _crash_counts[stage] = _crash_counts.get(stage, 0) + 1
    if _crash_counts[stage] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_crash_counts: dict[str, int] = {}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@_retry_io
def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@_retry_io
def write_shard_file(path: Path, rows: list[dict]) -> None:
    """Write rows as one Arrow IPC stream file: temp name, fsync, rename."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        with pa.ipc.new_stream(f, COMPLETION_SCHEMA) as writer:
            # Always one batch, even empty: datasets cannot cast a chunkless table.
            writer.write_batch(rows_to_batch(rows))
        f.flush()
        os.fsync(f.fileno())
    _crash_point("shard_tmp_written")
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass
class LedgerEntry:
    shard: str
    writer: str
    ids: list[str]
    rows: int
    errors: int
    completion_tokens: int
    decode_s: float
    wall_s: float
    steps: int
    accepted: int
    committed_at: float

    @classmethod
    def from_rows(cls, shard: str, writer: str, rows: list[dict], wall_s: float) -> "LedgerEntry":
        ok = [r for r in rows if r["finish_reason"] != "error"]
        acc = [r["acceptance"] for r in ok if r["acceptance"] and r["acceptance"].get("steps") is not None]
        return cls(
            shard=shard,
            writer=writer,
            ids=[r["id"] for r in rows],
            rows=len(rows),
            errors=len(rows) - len(ok),
            completion_tokens=sum(r["completion_tokens"] for r in ok),
            decode_s=sum((r["acceptance"] or {}).get("decode_s") or 0.0 for r in ok),
            wall_s=wall_s,
            steps=sum(a["steps"] for a in acc),
            accepted=sum(a["accepted"] for a in acc),
            committed_at=time.time(),
        )


@dataclass
class Totals:
    rows: int = 0
    errors: int = 0
    completion_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    accepted: int = 0
    shards: int = 0
    # (start, end) of each shard's making, to count time once where ranks
    # (or writers) worked at the same moment.
    spans: list[tuple[float, float]] = field(default_factory=list)

    def add(self, e: LedgerEntry) -> None:
        self.rows += e.rows
        self.errors += e.errors
        self.completion_tokens += e.completion_tokens
        self.decode_s += e.decode_s
        self.wall_s += e.wall_s
        self.steps += e.steps
        self.accepted += e.accepted
        self.shards += 1
        self.spans.append((e.committed_at - e.wall_s, e.committed_at))

    @property
    def elapsed_s(self) -> float:
        """Seconds during which at least one writer was making a shard."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    @property
    def acceptance_length(self) -> float | None:
        return (self.accepted + self.steps) / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        elapsed = self.elapsed_s
        return self.completion_tokens / elapsed if elapsed > 0 else None

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "errors": self.errors,
            "completion_tokens": self.completion_tokens,
            "decode_s": round(self.decode_s, 3),
            "wall_s": round(self.wall_s, 3),
            "elapsed_s": round(self.elapsed_s, 3),
            "tokens_per_s": self.tokens_per_s,
            "acceptance_length": self.acceptance_length,
            "shards": self.shards,
        }


def read_ledger(path: Path) -> list[LedgerEntry]:
    """Entries of one ledger; a torn (unparsable) last line is ignored."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    entries = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            entries.append(LedgerEntry(**orjson.loads(line)))
        except (orjson.JSONDecodeError, TypeError):
            if i < len(lines) - 1 and any(l.strip() for l in lines[i + 1 :]):
                raise OutputError(f"{path} is corrupt at line {i + 1}") from None
    return entries


def read_all_ledgers(folder: Path) -> list[LedgerEntry]:
    entries = []
    for p in sorted(folder.glob("ledger-*.jsonl")):
        if _LEDGER.match(p.name):
            entries += read_ledger(p)
    return entries


@dataclass
class OutputFolder:
    """One writer's view of a job's output folder.

    Args:
        path: The folder.
        writer: This writer's name (``r000`` for a single process; one per
            rank under mlx.launch), part of its shard and ledger names.
    """

    path: Path
    writer: str = "r000"
    done_ids: set[str] = field(default_factory=set)
    totals: Totals = field(default_factory=Totals)
    _seq: int = 0
    _manifest: dict = field(default_factory=dict)

    @property
    def ledger_path(self) -> Path:
        return self.path / f"ledger-{self.writer}.jsonl"

    def open(self, manifest: dict, *, overwrite: bool) -> None:
        """Create or resume the folder for a job with this manifest.

        Raises:
            FingerprintMismatch: The folder holds another configuration's
                results and ``overwrite`` is False.
            OutputError: The folder exists, is not empty and is not a job folder.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        existing = self.path / MANIFEST
        if existing.exists():
            old = orjson.loads(existing.read_bytes())
            if old.get("fingerprint") != manifest["fingerprint"]:
                if not overwrite:
                    from jobs.config import describe_changes

                    changes = describe_changes(old.get("fingerprint_parts", {}), manifest["fingerprint_parts"])
                    raise FingerprintMismatch(
                        f"{self.path} holds results of a different job configuration:\n  "
                        + "\n  ".join(changes or ["(fingerprint differs)"])
                        + "\nTo resume it, rerun with the settings it was written with (the values "
                        "left of each arrow); or rerun with --overwrite to delete those results "
                        "and start over, or write to another --output."
                    )
                self._delete_results()
            elif overwrite:
                self._delete_results()
        elif any(p for p in self.path.iterdir() if not p.name.startswith(".")):
            if not overwrite:
                raise OutputError(
                    f"output folder {self.path} exists, is not empty and holds no {MANIFEST}; "
                    "choose an empty or new folder"
                )
            self._delete_results()
        self._recover()
        entries = read_all_ledgers(self.path)
        own = [e for e in entries if e.writer == self.writer]
        self._seq = 1 + max((int(_SHARD.match(e.shard)["seq"]) for e in own), default=-1)
        old_manifest = orjson.loads(existing.read_bytes()) if existing.exists() else {}
        self._manifest = {**manifest, "created_at": old_manifest.get("created_at", time.time())}
        if not (self.path / EMPTY_SHARD).exists():
            write_shard_file(self.path / EMPTY_SHARD, [])
        self.refresh_views()

    def commit(self, rows: list[dict], wall_s: float) -> str:
        """Durably add rows as one shard; returns its name."""
        name = shard_name(self.writer, self._seq)
        write_shard_file(self.path / name, rows)
        _crash_point("shard_renamed")
        entry = LedgerEntry.from_rows(name, self.writer, rows, wall_s)
        self._append_ledger(entry)
        _crash_point("ledger_appended")
        self._seq += 1
        self.refresh_views()
        _crash_point("views_written")
        return name

    @_retry_io
    def _append_ledger(self, entry: LedgerEntry) -> None:
        with open(self.ledger_path, "ab") as f:
            f.write(orjson.dumps(entry.__dict__) + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def refresh_views(self) -> None:
        """state.json, dataset_info.json and the manifest, from all ledgers
        (other writers' too); the done ids and totals follow them. Writers
        take turns (a lock file), so the last view written is never older
        than another writer's."""
        with open(self.path / ".views.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._write_views()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_views(self) -> None:
        entries = read_all_ledgers(self.path)
        for e in entries:
            self.done_ids.update(e.ids)
        shards = [EMPTY_SHARD] + sorted(e.shard for e in entries)
        state = {
            "_data_files": [{"filename": s} for s in shards],
            "_fingerprint": self._manifest["fingerprint"] + f"-{len(shards)}",
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        info = {
            "citation": "",
            "description": "Completions written by mtp-batch (python -m jobs generate).",
            "features": dataset_features_dict(),
            "homepage": "",
            "license": "",
        }
        totals = Totals()
        for e in entries:
            totals.add(e)
        self.totals = totals
        write_atomic(self.path / "dataset_info.json", orjson.dumps(info, option=orjson.OPT_INDENT_2))
        write_atomic(self.path / "state.json", orjson.dumps(state, option=orjson.OPT_INDENT_2))
        manifest = {**self._manifest, "updated_at": time.time(), "totals": totals.to_dict()}
        write_atomic(self.path / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))

    def _recover(self) -> None:
        """Drop this writer's leftovers of an interrupted commit."""
        views = (MANIFEST, "state.json", "dataset_info.json")
        for p in self.path.glob(".tmp-*"):
            if p.name.startswith(f".tmp-data-{self.writer}-") or p.name[5:].startswith(views):
                p.unlink(missing_ok=True)
        ledger = self.ledger_path
        if ledger.exists():
            data = ledger.read_bytes()
            if data and not data.endswith(b"\n"):
                # A torn last line: the shard it named is an orphan.
                ledger.write_bytes(data[: data.rfind(b"\n") + 1])
        listed = {e.shard for e in read_ledger(ledger)}
        for p in self.path.glob(f"data-{self.writer}-*.arrow"):
            if p.name not in listed:
                p.unlink()

    def _delete_results(self) -> None:
        for p in list(self.path.iterdir()):
            if (
                _SHARD.match(p.name)
                or _LEDGER.match(p.name)
                or p.name in (MANIFEST, "state.json", "dataset_info.json", EMPTY_SHARD)
                or p.name.startswith(".tmp-")
            ):
                p.unlink()
