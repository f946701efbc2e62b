"""Where a checkpoint lies: a local folder, or a Hugging Face Hub id.

``org/name`` that is not a local path is looked up in the local Hub cache
(``HF_HUB_CACHE`` or huggingface_hub's default), as ``huggingface-cli
download`` or any Hub library left it; where the network allows and
``HF_HUB_OFFLINE`` is not set, a model missing there is downloaded (config,
tokenizer, chat template and safetensors files).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "tiktoken.model", "*.txt"]


def resolve_model(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names.

    Raises:
        FileNotFoundError: Neither a local path nor a Hub id found in the
            cache (or downloadable); the message says where it looked.
    """
    folder = Path(path).expanduser()
    if folder.exists() or not REPO_ID.match(str(path)):
        return folder
    from huggingface_hub import snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(str(path), cache_dir=cache, local_files_only=True))
    except Exception as cached_error:  # not in the cache: huggingface_hub's own error says which
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise FileNotFoundError(f"model {str(path)!r} is not a local folder and not in the local Hub cache "
                                    f"({cache or 'the default cache'}; HF_HUB_OFFLINE is set, so it was not "
                                    f"downloaded): {cached_error}") from None
    try:
        return Path(snapshot_download(str(path), cache_dir=cache, allow_patterns=FILES))
    except Exception as e:
        raise FileNotFoundError(f"model {str(path)!r} is not a local folder, not in the local Hub cache "
                                f"({cache or 'the default cache'}), and downloading it failed: {e}") from None
