"""The output folder: Arrow shards, ledgers, manifest, lock, and the files
that make it a ``datasets.load_from_disk`` folder at every moment.

Opening a folder (`OutputFolder.open`):

1. take the folder's lock (`jobs.lock`): one job at a time;
2. write the manifest first, atomically, so any later kill leaves a folder
   the same command resumes; check the fingerprint and dataset identity of
   a folder that has one;
3. repair the ledgers (`jobs.ledger`): cut torn or garbage tails; refuse a
   ledger damaged in the middle (``python -m jobs repair`` rebuilds it);
4. remove leftovers of an interrupted commit (temporary files, shards no
   ledger lists);
5. verify every listed shard (size and CRC-32): a missing, truncated or
   changed shard is moved to ``quarantine/``, its entry struck, its rows
   redone.

Committing a shard (`OutputFolder.commit`), each step durable before the
next: write ``.tmp-<shard>`` and fsync; rename it to ``<shard>`` and fsync
the folder; append its ledger line (size, CRC-32, ids) and fsync; rewrite
``state.json``, ``dataset_info.json`` and the manifest atomically. So
``state.json`` lists only shards in a ledger, and a ledger only shards on
disk. Resume keys on row ids recorded in the ledgers, never on positions.

Transient file-system errors (a full disk being cleared, an NFS hiccup) are
retried a few times with bounded backoff; permanent ones (read-only, no
permission, not a directory) are not. A failed ledger append is rolled back
before any retry.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from jobs.config import describe_changes, output_parts
from jobs.ledger import Ledger, LedgerEntry, LedgerState, Totals, fsync_dir, open_plain
from jobs.lock import FolderLock
from schemas.arrow import (
    COMPLETION_SCHEMA,
    SCHEMA_VERSIONS,
    completion_schema,
    dataset_features_dict,
    rows_to_batch,
    with_kept_columns,
)

MANIFEST = "manifest.json"
EMPTY_SHARD = "data-empty.arrow"
QUARANTINE = "quarantine"
VIEWS = (MANIFEST, "state.json", "dataset_info.json")
SHARD_PATTERN = re.compile(r"^data-(?P<writer>r\d{3})-(?P<seq>\d{5})\.arrow$")
LEDGER_PATTERN = re.compile(r"^ledger-(?P<writer>r\d{3})\.jsonl$")
PROGRESS_PATTERN = re.compile(r"^progress-(?P<writer>r\d{3})\.json$")
"""Each writer's live status file (`jobs.progress`)."""
OWN_FILES = (*VIEWS, EMPTY_SHARD, ".lock", ".views.lock", QUARANTINE)
"""Names a job writes besides shards and ledgers (a folder holding only
these and no manifest is an interrupted first run)."""

TRANSIENT = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ESTALE, errno.EBUSY,
             errno.ETIMEDOUT}


class OutputError(RuntimeError):
    """The output folder cannot be used as asked."""


class FingerprintMismatch(OutputError):
    """The folder holds results of a differently configured job."""


class DatasetChanged(OutputError):
    """The folder was written from another dataset."""


def _transient(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in TRANSIENT


_retry_io = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=5.0),
    reraise=True,
)


def writer_name(rank: int) -> str:
    return f"r{rank:03d}"


def progress_path(folder: Path, writer: str) -> Path:
    """A writer's live status file."""
    return folder / f"progress-{writer}.json"


def shard_name(writer: str, seq: int) -> str:
    return f"data-{writer}-{seq:05d}.arrow"


def ledger_path(folder: Path, writer: str) -> Path:
    return folder / f"ledger-{writer}.jsonl"


def ledgers(folder: Path) -> list[Ledger]:
    return [Ledger(p) for p in sorted(folder.glob("ledger-*.jsonl")) if LEDGER_PATTERN.match(p.name)]


def read_all_ledgers(folder: Path) -> list[LedgerEntry]:
    """Every valid entry of every ledger (a torn tail is ignored, not cut).

    Raises:
        OutputError: A ledger is damaged in the middle.
    """
    entries = []
    for ledger in ledgers(folder):
        state = ledger.read()
        if state.corrupt_line is not None:
            raise OutputError(corrupt_ledger_message(ledger, state))
        entries += state.entries
    return entries


REPEATED_LINE = "listed twice in the ledgers"


def checked_entries(folder: Path, checksum: bool):
    """Every ledger's entries in order, each as ``(ledger, entry, problem)``:
    problem None for an intact shard, `REPEATED_LINE` for a line naming a
    shard an earlier line named, else why the shard fails (`check_shard`,
    or rows an earlier shard holds).

    Raises:
        OutputError: A ledger is damaged in the middle.
    """
    seen: set[tuple[str, int]] = set()
    shards: set[str] = set()
    for ledger in ledgers(folder):
        state = ledger.read()
        if state.corrupt_line is not None:
            raise OutputError(corrupt_ledger_message(ledger, state))
        for e in state.entries:
            if e.shard in shards:
                yield ledger, e, REPEATED_LINE
                continue
            shards.add(e.shard)
            problem = check_shard(folder, e, checksum)
            if problem is None and seen & set(e.keys()):
                problem = "it repeats rows (id and sample) of an earlier shard"
            if problem is None:
                seen.update(e.keys())
            yield ledger, e, problem


def corrupt_ledger_message(ledger: Ledger, state: LedgerState) -> str:
    return (f"{ledger.path} is corrupt at line {state.corrupt_line} ({state.problem}); "
            f"rebuild it from the shards with `python -m jobs repair {ledger.path.parent}`")


def serialize_shard(rows: list[dict], schema: pa.Schema = COMPLETION_SCHEMA) -> bytes:
    """Rows as one Arrow IPC stream (always one batch, even empty: datasets
    cannot cast a chunkless table)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(rows_to_batch(rows, schema))
    return sink.getvalue().to_pybytes()


def entry_from_shard(path: Path, fingerprint: str | None) -> LedgerEntry:
    """A ledger entry rebuilt from a shard file, which carries its rows'
    ids (size, CRC-32 and totals recomputed; `repair` and a resume's
    adoption use it).

    Raises:
        pa.ArrowInvalid, OSError, KeyError: The shard is unreadable.
    """
    data = path.read_bytes()
    records = pa.ipc.open_stream(pa.BufferReader(data)).read_all().to_pylist()
    writer = SHARD_PATTERN.match(path.name)["writer"]
    entry = LedgerEntry.from_rows(path.name, writer, records, 0.0, bytes=len(data), crc32=zlib.crc32(data),
                                  fingerprint=fingerprint)
    entry.committed_at = path.stat().st_mtime
    return entry


def read_manifest(folder: Path) -> dict:
    """A job folder's manifest, for the commands that read a folder
    (status, export).

    Raises:
        OutputError: No manifest, or one that is not a JSON object.
    """
    try:
        manifest = orjson.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise OutputError(f"{folder} is not a job output folder (no {MANIFEST})") from None
    except orjson.JSONDecodeError as e:
        raise OutputError(f"{folder / MANIFEST} is corrupt ({e}); rerun the job's command to rebuild it") from None
    if not isinstance(manifest, dict):
        raise OutputError(f"{folder / MANIFEST} is corrupt (a JSON {type(manifest).__name__}, not an object); "
                          "rerun the job's command to rebuild it")
    return manifest


def folder_schema(manifest: dict) -> pa.Schema:
    """The Arrow schema of a folder's shards: its output schema version's,
    plus the input columns it keeps."""
    return with_kept_columns(completion_schema(manifest.get("schema_version", 1)), manifest.get("kept_columns", []),
                             bool(manifest.get("logprobs")))


def folder_schema_version(folder: Path) -> int | None:
    """The output schema version of the results in a folder (its
    manifest's), or None for a new folder or an unreadable manifest."""
    try:
        version = orjson.loads((folder / MANIFEST).read_bytes()).get("schema_version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if version in SCHEMA_VERSIONS else None


@_retry_io
def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open_plain(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@_retry_io
def write_tmp_shard(path: Path, data: bytes) -> Path:
    """Write a shard's bytes to its temporary name, fsynced; returns that path."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open_plain(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


@_retry_io
def publish_shard(tmp: Path, path: Path) -> None:
    """Rename a written shard into place and make the rename durable."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path) -> tuple[int, int]:
    """A file's size and CRC-32."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def check_shard(folder: Path, entry: LedgerEntry, checksum: bool) -> str | None:
    """Why a listed shard is not the one its ledger recorded (None when it
    is): missing, another size, another CRC-32 (with ``checksum``), or, for
    entries of older ledgers without a checksum, unreadable or holding
    other ids."""
    path = folder / entry.shard
    if not SHARD_PATTERN.match(entry.shard) or path.resolve().parent != folder.resolve():
        return f"its name {entry.shard!r} is not a shard of this folder"
    if not path.is_file():
        return "it is missing"
    size = path.stat().st_size
    if entry.bytes is not None and size != entry.bytes:
        return f"it is {size} bytes, the ledger recorded {entry.bytes}"
    if entry.crc32 is not None:
        if checksum:
            _, crc = file_digest(path)
            if crc != entry.crc32:
                return f"its CRC-32 is {crc:08x}, the ledger recorded {entry.crc32:08x}"
        return None
    try:
        ids = pa.ipc.open_stream(str(path)).read_all().column("id").to_pylist()
    except (pa.ArrowInvalid, OSError, KeyError) as e:
        return f"it cannot be read ({e})"
    if ids != entry.ids:
        return "it holds other rows than its ledger lists"
    return None


@dataclass
class OutputFolder:
    """One writer's view of a job's output folder.

    Args:
        path: The folder.
        writer: This writer's name (``r000`` for a single process; one per
            rank under mlx.launch), part of its shard and ledger names.
        log: Where repairs are reported (one line each).
    """

    path: Path
    writer: str = "r000"
    log: object = print
    done: set[tuple[str, int]] = field(default_factory=set)
    totals: Totals = field(default_factory=Totals)
    _seq: int = 0
    _manifest: dict = field(default_factory=dict)
    _schema: pa.Schema = COMPLETION_SCHEMA
    _lock: FolderLock | None = None

    @property
    def ledger(self) -> Ledger:
        return Ledger(ledger_path(self.path, self.writer))

    # -- opening -----------------------------------------------------------

    def open(self, manifest: dict, *, overwrite: bool, token: str = "", allow_dataset_change: bool = False) -> None:
        """Lock, create or resume, repair and verify the folder for a job
        with this manifest (rank 0, or the only process).

        Raises:
            FolderInUse: Another job holds the folder.
            FingerprintMismatch: The folder holds another configuration's
                results and ``overwrite`` is False.
            DatasetChanged: It was written from another dataset and
                ``allow_dataset_change`` is False.
            OutputError: The folder is not a job folder, or a ledger is
                damaged in the middle.
            OSError: The file system refused (the caller names it).
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise OutputError(f"--output {self.path} exists and is not a folder") from None
        self._lock = FolderLock(self.path)
        self._lock.acquire(token)
        try:
            old = self._existing_manifest(manifest, overwrite)
            self._manifest = {**manifest, "created_at": old.get("created_at", time.time())}
            self._schema = folder_schema(self._manifest)
            self._check_dataset(old, manifest, allow_dataset_change)
            write_atomic(self.path / MANIFEST, orjson.dumps(self._manifest, option=orjson.OPT_INDENT_2))
            self._repair_ledgers()
            self._adopt_viewed_shards()
            self._remove_leftovers()
            self._verify_shards(checksum=True)
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def manifest(self) -> dict:
        """The manifest the folder was opened with."""
        return self._manifest

    def join(self, manifest: dict, token: str) -> None:
        """Join a folder that rank 0 of the same job opened (other ranks)."""
        self._lock = FolderLock(self.path)
        self._lock.check_shared(token)
        self._lock = None  # rank 0 holds it
        self._manifest = orjson.loads((self.path / MANIFEST).read_bytes())
        if self._manifest.get("fingerprint") != manifest["fingerprint"]:
            raise FingerprintMismatch(f"{self.path} was opened by rank 0 for another job configuration")
        self._schema = folder_schema(self._manifest)
        self._start()

    def close(self) -> None:
        """Release the folder's lock (the OS does it too when the process dies)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _existing_manifest(self, manifest: dict, overwrite: bool) -> dict:
        """The manifest of the results in the folder ({} for a new folder),
        after the fingerprint check; deletes the results for ``overwrite``."""
        path = self.path / MANIFEST
        if not path.exists():
            foreign = [p.name for p in self.path.iterdir()
                       if not p.name.startswith(".") and p.name not in OWN_FILES
                       and not any(pattern.match(p.name) for pattern in (SHARD_PATTERN, LEDGER_PATTERN,
                                                                          PROGRESS_PATTERN))]
            if foreign and not overwrite:
                raise OutputError(f"output folder {self.path} is not empty ({foreign[0]}, ...) and holds no "
                                  f"{MANIFEST}; choose an empty or new folder")
            if overwrite or foreign:
                self._delete_results()
            elif ledgers(self.path):  # results without their manifest: adopted only if they are this job's
                return self._rebuilt_manifest(manifest, "missing")
            return {}
        try:
            old = orjson.loads(path.read_bytes())
            if not isinstance(old, dict) or "fingerprint" not in old:
                raise ValueError("no fingerprint")
        except ValueError as e:  # orjson.JSONDecodeError is one
            if overwrite:
                self._delete_results()
                return {}
            return self._rebuilt_manifest(manifest, f"corrupt ({e})")
        if old["fingerprint"] != manifest["fingerprint"]:
            if overwrite:
                self._delete_results()
                return {}
            changes = describe_changes(old.get("fingerprint_parts", {}), manifest["fingerprint_parts"])
            if "fingerprint_parts" in old and output_parts(old["fingerprint_parts"]) == output_parts(
                    manifest["fingerprint_parts"]):
                self.log(f"resuming under other speed settings ({'; '.join(changes)}): every mode "
                         "writes the same rows")
                return old
            raise FingerprintMismatch(
                f"{self.path} holds results of a different job configuration:\n  "
                + "\n  ".join(changes or ["(fingerprint differs)"])
                + "\nTo resume it, rerun with the settings it was written with (the values "
                "left of each arrow); or rerun with --overwrite to delete those results "
                "and start over, or write to another --output."
            )
        if overwrite:
            self._delete_results()
            return {}
        return old

    def _rebuilt_manifest(self, manifest: dict, state: str) -> dict:
        """A corrupt or missing manifest (``state`` says which): rebuilt
        when every ledger entry carries this job's fingerprint, else refused."""
        prints = {e.fingerprint for e in read_all_ledgers(self.path)}
        if prints <= {manifest["fingerprint"]}:
            self.log(f"repair: {MANIFEST} was {state}; rebuilt it for this job "
                     f"({'its ledgers carry this job fingerprint' if prints else 'no rows were committed'})")
            return {}
        raise OutputError(
            f"{self.path / MANIFEST} is {state} and the folder's ledgers were written by another "
            f"job configuration (fingerprint {', '.join(sorted(map(str, prints)))}, this job "
            f"{manifest['fingerprint']}); rerun with the settings it was written with, or --overwrite"
        )

    def _check_dataset(self, old: dict, manifest: dict, allow_change: bool) -> None:
        before, now = old.get("dataset", {}).get("identity"), manifest.get("dataset", {}).get("identity")
        if not before or not now or before["files"] == now["files"]:
            return
        if not allow_change:
            raise DatasetChanged(
                f"{self.path} was written from the dataset {_describe(before)}; this run reads "
                f"{_describe(now)}. Rerun with the dataset it was written from, or pass "
                "--allow-dataset-change to add this dataset's rows to it on purpose"
            )
        history = old.get("dataset", {}).get("history", []) + [before]
        self._manifest["dataset"] = {**manifest["dataset"], "history": history}
        self.log(f"dataset changed on purpose: {_describe(before)} -> {_describe(now)}")

    def _repair_ledgers(self) -> None:
        for ledger in ledgers(self.path):
            state = ledger.read()
            if state.corrupt_line is not None:
                raise OutputError(corrupt_ledger_message(ledger, state))
            if cut := ledger.cut_tail(state):
                self.log(f"repair: cut {cut} bytes after the last valid line of {ledger.path.name} "
                         "(an interrupted or damaged write)")

    def _adopt_viewed_shards(self) -> None:
        """Shards the views list but no ledger does (a commit interrupted
        between the two; readers already saw their rows): each readable one
        gets its ledger line back, rebuilt from its rows."""
        try:
            files = orjson.loads((self.path / "state.json").read_bytes())["_data_files"]
            viewed = {f["filename"] for f in files}
        except (OSError, ValueError, KeyError, TypeError):
            return
        listed = {e.shard for e in read_all_ledgers(self.path)}
        for name in sorted(viewed - listed):
            path = self.path / name
            if not SHARD_PATTERN.match(name) or not path.is_file() or path.is_symlink():
                continue
            try:
                entry = entry_from_shard(path, self._manifest.get("fingerprint"))
            except (pa.ArrowInvalid, OSError, KeyError) as e:
                self.log(f"repair: shard {name} was in the views but is unreadable ({e}); its rows will be redone")
                continue
            Ledger(ledger_path(self.path, entry.writer)).append(entry)
            self.log(f"repair: shard {name} ({entry.rows} rows) was committed to the views but not to its "
                     "ledger (an interrupted commit); its ledger line is rebuilt")

    def _remove_leftovers(self) -> None:
        """Temporary files and shards no ledger lists (a commit interrupted
        between rename and ledger line; their rows were never done)."""
        for p in self.path.glob(".tmp-*"):
            p.unlink(missing_ok=True)
        listed = {e.shard for e in read_all_ledgers(self.path)}
        for p in self.path.glob("data-r*.arrow"):
            if SHARD_PATTERN.match(p.name) and p.name not in listed:
                p.unlink()

    def _verify_shards(self, checksum: bool) -> None:
        """Quarantine listed shards that are not what their ledger recorded,
        and shards repeating ids of earlier ones; strike their entries."""
        keep: dict[Path, list[LedgerEntry]] = {ledger.path: [] for ledger in ledgers(self.path)}
        changed: set[Path] = set()
        for ledger, e, problem in checked_entries(self.path, checksum):
            if problem is None:
                keep[ledger.path].append(e)
                if e.crc32 is not None:
                    continue
                e.bytes, e.crc32 = file_digest(self.path / e.shard)  # an older ledger: record what was verified
            elif problem == REPEATED_LINE:  # the shard is listed (and checked) once
                self.log(f"repair: {ledger.path.name} listed shard {e.shard} again; dropped the repeat")
            else:
                self._quarantine(e, problem)
            changed.add(ledger.path)
        for ledger in ledgers(self.path):
            if ledger.path in changed:
                ledger.rewrite(keep[ledger.path])

    def _quarantine(self, entry: LedgerEntry, problem: str) -> None:
        path = self.path / entry.shard
        moved = ""
        if SHARD_PATTERN.match(entry.shard) and path.exists():
            target = self.path / QUARANTINE / f"{entry.shard}.{int(time.time())}"
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
            fsync_dir(self.path)
            moved = f"; moved to {target.relative_to(self.path)}"
        self.log(f"repair: shard {entry.shard} failed its check ({problem}){moved}; "
                 f"its {entry.rows} rows will be redone")

    def _start(self) -> None:
        own = [e for e in self.ledger.read().entries]
        self._seq = 1 + max((int(SHARD_PATTERN.match(e.shard)["seq"]) for e in own), default=-1)
        if not (self.path / EMPTY_SHARD).exists():
            publish_shard(write_tmp_shard(self.path / EMPTY_SHARD, serialize_shard([], self._schema)),
                          self.path / EMPTY_SHARD)
        self.refresh_views()

    # -- committing --------------------------------------------------------

    def commit(self, rows: list[dict], wall_s: float, warmup_s: float = 0.0) -> str:
        """Durably add rows as one shard (``warmup_s``: the decoder's warm-up
        within ``wall_s``); returns its name."""
        name = shard_name(self.writer, self._seq)
        data = serialize_shard(rows, self._schema)
        publish_shard(write_tmp_shard(self.path / name, data), self.path / name)
        entry = LedgerEntry.from_rows(name, self.writer, rows, wall_s, warmup_s=round(warmup_s, 3), bytes=len(data),
                                      crc32=zlib.crc32(data), fingerprint=self._manifest.get("fingerprint"))
        # The views list the shard before the ledger does: a process killed
        # (or a disk filled) between the two leaves the rows readable, and
        # the next open adopts the shard (`_adopt_viewed_shards`).
        self.refresh_views(entry)
        self._append(entry)
        self._seq += 1
        return name

    @_retry_io
    def _append(self, entry: LedgerEntry) -> None:
        self.ledger.append(entry)

    def refresh_views(self, pending: LedgerEntry | None = None) -> None:
        """state.json, dataset_info.json and the manifest, from all ledgers
        (other writers' too) and a shard about to be ledgered (``pending``);
        the done ids and totals follow them. Writers take turns (a lock
        file), so the last view written is never older than another
        writer's."""
        with open_plain(self.path / ".views.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._write_views(pending)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_views(self, pending: LedgerEntry | None) -> None:
        entries = read_all_ledgers(self.path) + ([pending] if pending is not None else [])
        self.done = {key for e in entries for key in e.keys()}
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
            "features": dataset_features_dict(self._schema),
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

    def _delete_results(self) -> None:
        for p in list(self.path.iterdir()):
            if (
                SHARD_PATTERN.match(p.name)
                or LEDGER_PATTERN.match(p.name)
                or p.name in (*VIEWS, EMPTY_SHARD)
                or p.name.startswith(".tmp-")
            ):
                p.unlink()


def _describe(identity: dict) -> str:
    files = identity.get("files", [])
    first = files[0] if files else {}
    more = f" and {len(files) - 1} more files" if len(files) > 1 else ""
    return f"{identity.get('path')!r} ({first.get('bytes')} bytes, sha256 {first.get('sha256')}{more})"
