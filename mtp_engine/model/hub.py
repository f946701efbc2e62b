"""Where a checkpoint lies: a local folder, or a Hugging Face Hub id.

``org/name`` that is not a local path is looked up in the local Hub cache
as ``huggingface-cli download`` or any Hub library left it; where the
network allows, a model missing there is downloaded (config, tokenizer,
chat template and safetensors files). huggingface_hub reads its own
variables (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "tiktoken.model", "*.txt"]


def resolve_model(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names.

    Raises:
        FileNotFoundError: Neither a local path nor a Hub id found in the
            cache (or downloadable); the message says why.
    """
    folder = Path(path).expanduser()
    if folder.exists() or not REPO_ID.match(str(path)):
        return folder
    from huggingface_hub import snapshot_download

    try:  # huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE itself
        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # not in the cache: try the Hub
        pass
    try:
        return Path(snapshot_download(str(path), allow_patterns=FILES))
    except Exception as e:
        raise FileNotFoundError(f"model {str(path)!r} is not a local folder nor in the local Hugging Face Hub "
                                f"cache, and the Hub could not provide it ({type(e).__name__}: {e})") from None
