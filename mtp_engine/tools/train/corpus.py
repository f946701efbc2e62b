"""The training corpus: the Python standard library sources of the Python
that runs the script (PSF licence), with a fixed split of held-out modules.

Held-out modules (and their ``test_*`` files) are never trained on; the
example prompts and the held-out metrics come from them.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
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


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(path: Path) -> bool:
    stem = path.stem
    return stem in HELD_OUT_MODULES or stem.removeprefix("test_") in HELD_OUT_MODULES


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), each sorted by path."""
    root = root or stdlib_root()
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_PARTS for part in rel.parts):
            continue
        (held if _is_held_out(p) else train).append(p)
    return train, held


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass(frozen=True)
class FunctionPrompt:
    """A documented function cut into prompt (signature and docstring) and
    reference completion (its body)."""

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
                    prompt = textwrap.dedent("".join(lines[start:doc_end]))
                    indent = len(lines[child.lineno - 1]) - len(lines[child.lineno - 1].lstrip())
                    reference = "".join(l[indent:] if l.strip() else l for l in lines[doc_end:end])
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
    encoded = tokenizer.encode_batch(texts)
    ids = []
    for enc in encoded:
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
