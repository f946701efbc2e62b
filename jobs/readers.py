"""Prompt datasets in: JSONL, JSON, CSV, Parquet, Arrow, ``save_to_disk``
folders, and globs of files.

Every reader yields `SourceRow`s in a stable order with a global row number,
so ids derived from row numbers are the same on every run. JSONL (and JSON
that is not one array) is read line by line: a malformed line becomes a row
with an error instead of failing the file. The columnar formats go through
``datasets``.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import datasets
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATASETS_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class DatasetError(ValueError):
    """The dataset cannot be read at all (a bad path or format)."""


@dataclass(frozen=True)
class SourceRow:
    """One input row.

    Attributes:
        index: Row number across the whole dataset, from 0.
        data: The row's fields, or None when it could not be parsed.
        line: 1-based line number in ``file`` (line-based formats).
        file: The file it came from (line-based formats).
        error: ``"<kind>: <message>"`` when the row could not be parsed.
    """

    index: int
    data: dict | None
    line: int | None = None
    file: str | None = None
    error: str | None = None


class PromptSource:
    """An opened dataset: ``len()``, iteration over rows, and `identity`.

    Attributes:
        empty_reason: Why a dataset holds no rows (a header-only CSV, an
            empty Parquet file or save_to_disk folder), else None.
    """

    def __init__(self, path: str):
        self.path = path
        self.files, self.kind = _resolve(path)
        self._dataset = None
        self.empty_reason: str | None = None
        if self.kind == "datasets":
            self.empty_reason = _empty_columnar(self.files)
            if self.empty_reason is None:
                self._dataset = _load_with_datasets(self.files)
        elif self.kind == "disk":
            if _saved_without_data(self.files[0]):
                self.empty_reason = f"the save_to_disk folder {path!r} has no rows"
            else:
                self._dataset = _load_from_disk(self.files[0])
                if len(self._dataset) == 0:
                    self.empty_reason = f"the save_to_disk folder {path!r} has no rows"
        if self.empty_reason is None and len(self) == 0:
            self.empty_reason = f"{path!r} has no rows"

    def identity(self) -> dict:
        """What identifies the dataset for resume: each file's resolved path,
        size and a SHA-256 of its first and last MiB (the whole file when
        it is under 2 MiB)."""
        files = self.files
        if self.kind == "disk":
            folder = Path(self.files[0])
            files = sorted(str(p) for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        return {
            "path": self.path,
            "files": [{"name": str(Path(f).resolve()), "bytes": os.path.getsize(f), "sha256": _head_tail_sha(f)}
                      for f in files],
        }

    def __len__(self) -> int:
        if self.empty_reason is not None and self._dataset is None and self.kind in ("datasets", "disk"):
            return 0
        if self._dataset is not None:
            return len(self._dataset)
        if self.kind == "json_array":
            return sum(len(_read_json_array(f)) for f in self.files)
        return sum(_count_lines(f) for f in self.files)

    def __iter__(self) -> Iterator[SourceRow]:
        if self.kind in ("datasets", "disk") and self._dataset is None:
            return
        if self._dataset is not None:
            for i, row in enumerate(self._dataset):
                yield SourceRow(index=i, data=dict(row))
            return
        index = 0
        for f in self.files:
            rows = _iter_json_array(f) if self.kind == "json_array" else _iter_jsonl(f)
            for line, data, error in rows:
                yield SourceRow(index=index, data=data, line=line, file=f, error=error)
                index += 1


def _resolve(path: str) -> tuple[list[str], str]:
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "state.json").exists() and (p / "dataset_info.json").exists():
            return [str(p)], "disk"
        if (p / "dataset_dict.json").exists():
            raise DatasetError(
                f"{path!r} is a DatasetDict folder; pass one split's folder (e.g. {path}/train)"
            )
        raise DatasetError(f"{path!r} is a folder but not a datasets save_to_disk folder")
    if p.exists():
        files = [str(p)]
    else:
        files = sorted(glob.glob(os.path.expanduser(path), recursive=True))
        if not files:
            raise DatasetError(f"dataset {path!r} does not exist (no file matches)")
    suffixes = {_suffix(f) for f in files}
    if len(suffixes) > 1:
        raise DatasetError(f"{path!r} mixes formats: {', '.join(sorted(suffixes))}")
    suffix = suffixes.pop()
    if suffix in JSONL_SUFFIXES:
        return files, "jsonl"
    if suffix == ".json":
        # A file holding one JSON array is a list of rows; anything else is
        # read as JSON lines, so a broken line stays one broken row.
        if all(_is_json_array(f) for f in files):
            return files, "json_array"
        return files, "jsonl"
    if suffix in DATASETS_BUILDERS:
        return files, "datasets"
    raise DatasetError(
        f"unsupported dataset format {suffix!r} for {path!r}; use .jsonl, .json, .csv, "
        ".parquet, .arrow or a save_to_disk folder"
    )


def _suffix(f: str) -> str:
    return Path(f).suffix.lower()


def _count_lines(f: str) -> int:
    with open(f, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _iter_jsonl(f: str):
    with open(f, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                yield number, None, f"malformed_json: line {number} of {f}: {e}"
                continue
            if not isinstance(data, dict):
                yield number, None, (
                    f"invalid_row: line {number} of {f} holds a {type(data).__name__}, not an object"
                )
                continue
            yield number, data, None


def _is_json_array(f: str) -> bool:
    with open(f, "rb") as fh:
        head = fh.read(4096).lstrip()
    if not head.startswith(b"["):
        return False
    try:
        return isinstance(orjson.loads(Path(f).read_bytes()), list)
    except orjson.JSONDecodeError:
        return False


def _read_json_array(f: str) -> list:
    return orjson.loads(Path(f).read_bytes())


def _iter_json_array(f: str):
    for i, data in enumerate(_read_json_array(f)):
        if isinstance(data, dict):
            yield None, data, None
        else:
            yield None, None, f"invalid_row: element {i} of {f} is a {type(data).__name__}, not an object"


MIB = 1 << 20


def _head_tail_sha(path: str) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * MIB:
            h.update(f.read())
        else:
            h.update(f.read(MIB))
            f.seek(size - MIB)
            h.update(f.read(MIB))
    return h.hexdigest()[:16]


def _empty_columnar(files: list[str]) -> str | None:
    """Why a CSV, Parquet or Arrow dataset holds no rows, or None when it
    holds some (the datasets loader fails on empty files with its own,
    unclear messages)."""
    suffix = _suffix(files[0])
    try:
        if suffix == ".csv":
            lines = [sum(1 for line in open(f, "rb") if line.strip()) for f in files]
            if all(n <= 1 for n in lines):
                return f"{files[0]!r} has a header but no rows" if any(lines) else f"{files[0]!r} is empty"
        elif suffix == ".parquet":
            if all(pq.ParquetFile(f).metadata.num_rows == 0 for f in files):
                return f"the Parquet file {files[0]!r} has no rows"
        elif suffix == ".arrow":
            rows = 0
            for f in files:
                try:
                    rows += pa.ipc.open_stream(f).read_all().num_rows
                except pa.ArrowInvalid:
                    rows += pa.ipc.open_file(f).read_all().num_rows
            if rows == 0:
                return f"the Arrow file {files[0]!r} has no rows"
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"cannot read {files[0]!r}: {e}") from None
    return None


def _load_with_datasets(files: list[str]):
    builder = DATASETS_BUILDERS[_suffix(files[0])]
    try:
        return datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:  # datasets raises many types for unreadable files
        raise DatasetError(f"cannot read {files[0]!r} as {builder}: {e}") from None


def _saved_without_data(folder: str) -> bool:
    """A save_to_disk folder of an empty dataset (no data files: the
    datasets loader fails on it)."""
    try:
        state = orjson.loads((Path(folder) / "state.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def _load_from_disk(folder: str):
    try:
        return datasets.load_from_disk(folder)
    except Exception as e:
        raise DatasetError(f"cannot load_from_disk {folder!r}: {e}") from None
