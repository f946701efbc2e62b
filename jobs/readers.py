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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

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
    """An opened dataset: ``len()`` (when known) and iteration over rows."""

    def __init__(self, path: str):
        self.path = path
        self.files, self.kind = _resolve(path)
        self._dataset = None
        if self.kind == "datasets":
            self._dataset = _load_with_datasets(self.files)
        elif self.kind == "disk":
            self._dataset = _load_from_disk(self.files[0])

    def __len__(self) -> int:
        if self._dataset is not None:
            return len(self._dataset)
        if self.kind == "json_array":
            return sum(len(_read_json_array(f)) for f in self.files)
        return sum(_count_lines(f) for f in self.files)

    def __iter__(self) -> Iterator[SourceRow]:
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


def _load_with_datasets(files: list[str]):
    import datasets

    builder = DATASETS_BUILDERS[_suffix(files[0])]
    try:
        return datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:  # datasets raises many types for unreadable files
        raise DatasetError(f"cannot read {files[0]!r} as {builder}: {e}") from None


def _load_from_disk(folder: str):
    import datasets

    try:
        return datasets.load_from_disk(folder)
    except Exception as e:
        raise DatasetError(f"cannot load_from_disk {folder!r}: {e}") from None
