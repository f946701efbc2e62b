"""The training corpus: the Python standard library of the Python that runs
the script (PSF licence) plus the Python sources of the packages the project
installs (its dependencies, found from the installed distributions'
metadata), deduplicated, with a fixed split of held-out modules.

Held-out modules (their ``test_*`` files, and every copy of them anywhere in
the corpus) are never trained on; the example prompts and the held-out
metrics come from them. A copy is a file whose name is a held-out module's
or whose long lines are mostly held-out lines.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

HELD_OUT_MODULES = (
    "textwrap",
    "difflib",
    "shlex",
    "fractions",
    "heapq",
    "calendar",
    "statistics",
    "graphlib",
    "sched",
    "ipaddress",
)
SKIP_PARTS = ("site-packages", "__pycache__")
FILE_SEPARATOR = "<|endoftext|>"
# The distribution whose dependencies make the corpus, and the extras taken.
PROJECT = "mtp-batch"
PROJECT_EXTRAS = ("cpu",)
# Distributions a virtual environment holds that are not the project's.
NOT_DEPENDENCIES = {"pip", "setuptools", "wheel", "mtp-batch"}
# A line at least this long (stripped) counts toward copy detection.
LONG_LINE = 30
# A file with more than this share of its long lines in a held-out module is a copy.
COPY_SHARE = 0.3
# A file with more than this share of its long lines already in the corpus is a near duplicate.
NEAR_DUPLICATE_SHARE = 0.7
MAX_FILE_BYTES = 1_000_000  # generated tables, not code


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out_name(path: Path) -> bool:
    stem = path.stem
    return stem in HELD_OUT_MODULES or stem.removeprefix("test_") in HELD_OUT_MODULES


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, each sorted by path."""
    root = root or stdlib_root()
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_PARTS for part in rel.parts):
            continue
        (held if _is_held_out_name(p) else train).append(p)
    return train, held


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(project: str = PROJECT, extras: tuple[str, ...] = PROJECT_EXTRAS) -> list[metadata.Distribution]:
    """The installed distributions ``project`` (with ``extras``) needs,
    directly or through others, sorted by name. Requirements whose markers do
    not hold here, and ones not installed, are skipped."""
    from packaging.requirements import Requirement

    installed = {_canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    seen: dict[str, metadata.Distribution] = {}
    todo = [(_canonical(project), set(extras))]
    while todo:
        name, wanted = todo.pop()
        dist = installed.get(name)
        if dist is None:
            continue
        if name not in NOT_DEPENDENCIES:
            seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            dep = _canonical(req.name)
            if dep not in seen and dep not in NOT_DEPENDENCIES:
                todo.append((dep, set(req.extras)))
    return [seen[k] for k in sorted(seen)]


def license_of(dist: metadata.Distribution) -> str:
    """A distribution's licence as its metadata states it (expression, field
    or classifier), shortened to one line."""
    meta = dist.metadata
    value = meta.get("License-Expression") or ""
    if not value:
        field = (meta.get("License") or "").strip()
        if field and "\n" not in field and len(field) < 80:
            value = field
    if not value:
        classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
        value = ", ".join(classifiers)
    return value or "see the package"


def package_files(dists: list[metadata.Distribution]) -> list[tuple[str, Path]]:
    """(distribution name, path) of every installed ``.py`` file of ``dists``."""
    out = []
    for dist in dists:
        for f in dist.files or []:
            if f.suffix == ".py" and "__pycache__" not in f.parts:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    out.append((dist.metadata["Name"], path))
    return out


def read_source(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _long_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= LONG_LINE}


@dataclass
class Corpus:
    """The files to train on and to hold out, and what was dropped and why."""

    train: list[tuple[str, Path]]  # (source: "stdlib" or a distribution name, path)
    held_out: list[Path]
    dropped: dict[str, int]  # reason -> files
    sources: list[dict]  # name, version, licence, files kept


def build_corpus(stdlib: Path | None = None, dists: list[metadata.Distribution] | None = None) -> Corpus:
    """The standard library plus the dependencies' sources: exact duplicates
    (same text after stripping trailing spaces) kept once, near duplicates
    (most long lines already kept, such as a fork of a standard module or a
    model file copied from another) dropped, held-out modules and their
    copies dropped. Files are taken in order: the standard library first."""
    train_std, held = stdlib_files(stdlib)
    dists = dependency_closure() if dists is None else dists
    held_lines: set[str] = set()
    for p in held:
        held_lines |= _long_lines(read_source(p) or "")
    candidates = [("stdlib", p) for p in train_std] + package_files(dists)
    seen: set[bytes] = set()
    kept_lines: set[str] = set()
    dropped = {"duplicate": 0, "near duplicate": 0, "held-out copy": 0, "unreadable or too large": 0}
    kept: list[tuple[str, Path]] = []
    for source, path in candidates:
        text = read_source(path)
        if text is None or not text.strip():
            dropped["unreadable or too large"] += 1
            continue
        if source != "stdlib" and _is_held_out_name(path):
            dropped["held-out copy"] += 1
            continue
        long = _long_lines(text)
        if long and len(long & held_lines) > COPY_SHARE * len(long):
            dropped["held-out copy"] += 1
            continue
        digest = hashlib.sha256("\n".join(l.rstrip() for l in text.splitlines()).encode()).digest()
        if digest in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(digest)
        if long and len(long & kept_lines) > NEAR_DUPLICATE_SHARE * len(long):
            dropped["near duplicate"] += 1
            continue
        kept_lines |= long
        kept.append((source, path))
    counts: dict[str, int] = {}
    for source, _ in kept:
        counts[source] = counts.get(source, 0) + 1
    sources = [{"name": "Python standard library", "version": sys.version.split()[0], "license": "PSF-2.0",
                "files": counts.get("stdlib", 0)}]
    sources += [{"name": d.metadata["Name"], "version": d.version, "license": license_of(d),
                 "files": counts.get(d.metadata["Name"], 0)} for d in dists]
    return Corpus(kept, held, dropped, sources)


@dataclass(frozen=True)
class FunctionPrompt:
    """A documented function cut into prompt (signature and docstring, up to
    the docstring's closing quotes) and reference completion (a line break,
    then its body)."""

    id: str
    prompt: str
    reference: str


def function_prompts(path: Path, module: str) -> list[FunctionPrompt]:
    """Every function with a docstring and a body beyond it, dedented."""
    source = read_source(path)
    if source is None:
        return []
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    out = []

    def visit(node, qual):
        for child in ast.iter_child_nodes(node):
            name = f"{qual}.{child.name}" if hasattr(child, "name") else qual
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if ast.get_docstring(child) and len(body) > 1:
                    start = (child.decorator_list[0].lineno if child.decorator_list else child.lineno) - 1
                    doc_end = body[0].end_lineno
                    end = child.end_lineno
                    # The prompt stops before the docstring's line break, which the
                    # completion starts with: a BPE tokenizer joins a line break to
                    # the next line's indentation, so a prompt ending in a bare
                    # "\n" token is one the model never saw in training.
                    prompt = textwrap.dedent("".join(lines[start:doc_end])).rstrip("\n")
                    indent = len(lines[child.lineno - 1]) - len(lines[child.lineno - 1].lstrip())
                    reference = "\n" + "".join(l[indent:] if l.strip() else l for l in lines[doc_end:end])
                    out.append(FunctionPrompt(name, prompt, reference))
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, name)

    visit(tree, module)
    return out


def held_out_prompts(root: Path | None = None) -> list[FunctionPrompt]:
    root = root or stdlib_root()
    prompts = []
    for module in HELD_OUT_MODULES:
        p = root / f"{module}.py"
        if p.exists():
            prompts += function_prompts(p, module)
    return prompts


def tokenize_files(tokenizer, files: list[Path]) -> np.ndarray:
    """Token ids of the files, each followed by the separator token."""
    sep = tokenizer.token_to_id(FILE_SEPARATOR)
    texts = [t for t in (read_source(p) for p in files) if t]
    ids: list[int] = []
    for start in range(0, len(texts), 512):
        for enc in tokenizer.encode_batch(texts[start : start + 512]):
            ids.extend(enc.ids)
            ids.append(sep)
    dtype = np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.uint32
    return np.array(ids, dtype=dtype)


def describe() -> dict:
    """Where the corpus came from (for the model card)."""
    return {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "held_out_modules": list(HELD_OUT_MODULES),
    }
