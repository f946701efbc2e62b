"""Ledgers: each writer's append-only record of the shards it committed.

One JSON line per shard: its name, the ids it holds, its byte size, row
count and CRC-32, the job's fingerprint and totals, and last the line's own
CRC-32 (``"check"``, over the line's bytes before it), so a line edited into
other valid JSON reads as damaged. A ledger repairs itself:

- on open, anything after the last complete, valid line is cut (and the cut
  fsynced), whatever it is: a torn write, or garbage ending in a newline;
- an append that fails part-way is rolled back to the last good length
  before anything retries it, so a retry never writes after half a line;
- a corrupt line in the middle (damage from outside) is reported with its
  line number; ``python -m jobs repair DIR`` rebuilds the ledger from the
  shards, which carry their ids.
"""

from __future__ import annotations

import errno
import os
import time
import zlib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import orjson


@dataclass
class LedgerEntry:
    """One committed shard.

    Attributes:
        shard: File name in the output folder.
        writer: The writer (rank) that made it.
        ids: The row ids it holds, in order.
        rows, errors, completion_tokens, decode_s, wall_s, steps, accepted:
            Totals of its rows (``wall_s``: the time the shard took to make).
        committed_at: Unix time of the commit.
        bytes: The shard file's size.
        crc32: zlib's CRC-32 of the shard file.
        fingerprint: The job's fingerprint when it was committed.
        samples: Each row's sample index (parallel to ``ids``), or None
            when every row is sample 0 (older ledgers, one completion per
            prompt). A completion's key is ``(id, sample)``.
        warmup_s: Seconds of ``wall_s`` the decoder spent meeting its step
            shapes before the first row (`Decoder.warm_up`; the first shard
            of a run on a GPU), 0 elsewhere.
    """

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
    bytes: int | None = None
    crc32: int | None = None
    fingerprint: str | None = None
    samples: list[int] | None = None
    warmup_s: float = 0.0

    def keys(self) -> list[tuple[str, int]]:
        """The ``(id, sample)`` key of each row, in order."""
        return list(zip(self.ids, self.samples or [0] * len(self.ids)))

    @classmethod
    def from_rows(cls, shard: str, writer: str, rows: list[dict], wall_s: float, warmup_s: float = 0.0,
                  **file) -> "LedgerEntry":
        ok = [r for r in rows if r["finish_reason"] != "error"]
        acc = [r["acceptance"] for r in ok if r["acceptance"] and r["acceptance"].get("steps") is not None]
        samples = [r.get("sample") or 0 for r in rows]
        return cls(
            shard=shard,
            writer=writer,
            ids=[r["id"] for r in rows],
            samples=samples if any(samples) else None,
            rows=len(rows),
            errors=len(rows) - len(ok),
            completion_tokens=sum(r["completion_tokens"] for r in ok),
            decode_s=sum((r["acceptance"] or {}).get("decode_s") or 0.0 for r in ok),
            wall_s=wall_s,
            steps=sum(a["steps"] for a in acc),
            accepted=sum(a["accepted"] for a in acc),
            committed_at=time.time(),
            warmup_s=warmup_s,
            **file,
        )

    @classmethod
    def parse(cls, line: bytes) -> "LedgerEntry":
        """One ledger line; ValueError when it is not a complete entry."""
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("not an object")
        if "check" in data:  # lines written before the check carry none
            body = line[: line.rfind(b',"check":')] + b"}"
            if data["check"] != zlib.crc32(body):
                raise ValueError("its checksum does not match its content (the line was edited or damaged)")
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        try:
            entry = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as e:
            raise ValueError(str(e)) from None
        if not isinstance(entry.shard, str) or not isinstance(entry.ids, list) or entry.rows != len(entry.ids):
            raise ValueError("its shard, ids or row count are malformed")
        if entry.samples is not None and (not isinstance(entry.samples, list) or len(entry.samples) != entry.rows):
            raise ValueError("its samples do not match its ids")
        return entry

    def line(self) -> bytes:
        """The ledger line: the entry's JSON with its CRC-32 appended as ``"check"``."""
        body = orjson.dumps(asdict(self))
        return body[:-1] + b',"check":' + str(zlib.crc32(body)).encode() + b"}\n"


@dataclass
class LedgerState:
    """What reading a ledger found.

    Attributes:
        entries: The valid entries, in order.
        good_length: Bytes up to the end of the last valid line.
        tail: Bytes after it (a torn or garbage last part), 0 when clean.
        corrupt_line: 1-based number of an unreadable line that valid lines
            follow (damage in the middle), or None.
        problem: What is wrong with that line.
    """

    entries: list[LedgerEntry] = field(default_factory=list)
    good_length: int = 0
    tail: int = 0
    corrupt_line: int | None = None
    problem: str = ""


class Ledger:
    """One writer's ledger file, ``ledger-<writer>.jsonl``."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> LedgerState:
        """Parse the file: valid entries, where the valid part ends, and a
        corrupt line in the middle if there is one."""
        if not self.path.exists():
            return LedgerState()
        data = self.path.read_bytes()
        state = LedgerState()
        pos, number, bad = 0, 0, None
        while pos < len(data):
            end = data.find(b"\n", pos)
            complete = end >= 0
            line = data[pos : end if complete else len(data)]
            number += 1
            next_pos = end + 1 if complete else len(data)
            if line.strip():
                try:
                    if not complete:
                        raise ValueError("no newline: a torn write")
                    entry = LedgerEntry.parse(line)
                except ValueError as e:
                    if bad is None:
                        bad = (number, str(e))
                    pos = next_pos
                    continue
                if bad is not None:  # a valid line after a bad one: damage in the middle
                    state.corrupt_line, state.problem = bad
                    return state
                state.entries.append(entry)
            if bad is None:
                state.good_length = next_pos
            pos = next_pos
        state.tail = len(data) - state.good_length
        return state

    def cut_tail(self, state: LedgerState) -> int:
        """Cut everything after the last valid line; returns the bytes cut."""
        if state.tail:
            _truncate(self.path, state.good_length)
        return state.tail

    def append(self, entry: LedgerEntry) -> None:
        """Append one line durably. If the write fails part-way, the file is
        cut back to its length before it, then the error is raised."""
        line = entry.line()
        with open_plain(self.path, "ab") as f:
            start = f.seek(0, os.SEEK_END)
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                _rollback(f, start)
                raise

    def rewrite(self, entries: list[LedgerEntry]) -> None:
        """Replace the whole ledger atomically (temp file, fsync, rename)."""
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        try:
            with open_plain(tmp, "wb") as f:
                f.write(b"".join(e.line() for e in entries))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:  # a full disk, say: the ledger keeps its old content
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)


def _rollback(f, length: int) -> None:
    """Cut an open file back to ``length``, durably, even when the disk is full."""
    try:
        f.flush()
    except OSError:
        pass  # the buffered rest of the line is dropped by the truncate below
    os.ftruncate(f.fileno(), length)
    os.fsync(f.fileno())


def _truncate(path: Path, length: int) -> None:
    with open_plain(path, "r+b") as f:
        os.ftruncate(f.fileno(), length)
        os.fsync(f.fileno())


def open_plain(path: Path, mode: str):
    """``open(path, mode)`` for writing a job folder's file, never through a
    symbolic link (one planted in the folder would make the write land
    outside it): a link is an OSError naming the file."""
    return open(path, mode, opener=open_fd)


def open_fd(path, flags: int) -> int:
    """`os.open` with ``O_NOFOLLOW`` and a clear error for a link."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link, and a job folder's files must be plain files "
                          "(remove the link)", str(path)) from None
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    warmup_s: float = 0.0
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
        self.warmup_s += e.warmup_s
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
