"""Training checkpoints that survive a lost machine: small files, atomic steps.

A checkpoint folder holds ``config.json`` (the model's Hub config), a
``latest`` file naming the newest complete step folder, and step folders
``step-00001234/`` with:

- ``progress.json``: step, tokens seen, elapsed seconds, the evaluations so
  far, the run's settings and the names of the files below;
- ``weights-NN.safetensors``: every parameter in float32 (``trunk.*`` and
  ``head.*``), in files of at most ``MAX_FILE_BYTES``;
- ``optimizer-NN.safetensors``: AdamW's moments (optional: a run resumed
  without them restarts the moments with a short warm-up).

A Hub-layout model folder (what ``export`` writes, the shipped model) reads
as a checkpoint too: its weights, no optimizer state, so a run resumed from it
starts a new schedule from the model's weights.

A step folder is written under a temporary name and renamed when complete,
then ``latest`` is replaced atomically, then older steps are deleted: a
process killed at any point leaves the previous step readable. The files are
plain safetensors read and written with numpy here, so the same checkpoint
moves between the PyTorch trainer and the MLX exporter.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

MAX_FILE_BYTES = 16 * 2**20
LATEST = "latest"
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U16": np.uint16}


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def save_file(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
              bf16: bool = False) -> None:
    """Write one safetensors file (float32, or bfloat16 with ``bf16``)."""
    header: dict = {"__metadata__": metadata or {}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if bf16 and a.dtype == np.float32:
            data, dtype = _to_bf16_bits(a).tobytes(), "BF16"
        else:
            dtype = next(k for k, v in _DTYPES.items() if v == a.dtype)
            data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def load_file(path: Path) -> dict[str, np.ndarray]:
    """Read a safetensors file (bfloat16 comes back as float32).

    Raises:
        ValueError: The file is truncated or its header is not safetensors.
    """
    data = Path(path).read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    body = memoryview(data)[8 + size :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if end > len(body):
            raise ValueError(f"{path}: truncated at tensor {name}")
        if info["dtype"] == "BF16":
            bits = np.frombuffer(body[start:end], dtype=np.uint16).astype(np.uint32) << 16
            a = bits.view(np.float32)
        else:
            a = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]]).copy()
        out[name] = a.reshape(info["shape"])
    return out


PIECE = "::"  # a tensor larger than a file is stored as row ranges "name::0", "name::1", ...


def _pieces(name: str, a: np.ndarray, limit: int) -> list[tuple[str, np.ndarray]]:
    if a.nbytes <= limit or a.ndim == 0 or a.shape[0] < 2:
        return [(name, a)]
    rows = max(1, limit // max(1, a.nbytes // a.shape[0]))
    return [(f"{name}{PIECE}{i}", a[start : start + rows]) for i, start in enumerate(range(0, a.shape[0], rows))]


def join_pieces(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensors stored in row ranges (`PIECE`) put back together."""
    out, pieces = {}, {}
    for name, a in tensors.items():
        if PIECE in name:
            base, index = name.rsplit(PIECE, 1)
            pieces.setdefault(base, {})[int(index)] = a
        else:
            out[name] = a
    for base, parts in pieces.items():
        out[base] = np.concatenate([parts[i] for i in range(len(parts))])
    return out


def save_sharded_files(folder: Path, stem: str, tensors: dict[str, np.ndarray], bf16: bool = False) -> list[str]:
    """``tensors`` in files ``{stem}-NN.safetensors`` of at most
    `MAX_FILE_BYTES` each (a larger tensor is cut into row ranges).
    Returns the file names."""
    limit = MAX_FILE_BYTES - 2**16  # room for the header
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        scale = 0.5 if bf16 and tensors[name].dtype == np.float32 else 1.0
        for piece, a in _pieces(name, tensors[name], int(limit / scale)):
            nbytes = int(a.nbytes * scale)
            if groups[-1] and size + nbytes > limit:
                groups.append({})
                size = 0
            groups[-1][piece] = a
            size += nbytes
    names = []
    for i, group in enumerate(groups):
        name = f"{stem}-{i:02d}.safetensors"
        save_file(folder / name, group, bf16=bf16)
        names.append(name)
    return names


def write_step(folder: Path, config: dict, step: int, weights: dict[str, np.ndarray],
               optimizer: dict[str, np.ndarray] | None, progress: dict, keep: int = 1) -> Path:
    """Write step ``step`` of a run atomically and make it the latest;
    delete all but the newest ``keep`` steps. Returns the step folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    name = f"step-{step:08d}"
    tmp = folder / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {"weights": save_sharded_files(tmp, "weights", weights)}
    if optimizer is not None:
        files["optimizer"] = save_sharded_files(tmp, "optimizer", optimizer)
    (tmp / "progress.json").write_text(json.dumps({**progress, "step": step, "files": files}, indent=1))
    final = folder / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = folder / (LATEST + ".tmp")
    pointer.write_text(name + "\n")
    pointer.replace(folder / LATEST)
    steps = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_step(folder: Path) -> Path | None:
    """The newest complete step folder of a checkpoint folder, or None.

    A step folder holds the step itself (``folder`` may name one directly)."""
    folder = Path(folder)
    if (folder / "progress.json").exists():
        return folder
    pointer = folder / LATEST
    if pointer.exists():
        step = folder / pointer.read_text().strip()
        if (step / "progress.json").exists():
            return step
    steps = sorted(p for p in folder.glob("step-*") if (p / "progress.json").exists())
    return steps[-1] if steps else None


def is_model_folder(folder: Path) -> bool:
    """A Hub-layout model folder (config and safetensors, no training steps)."""
    folder = Path(folder)
    return ((folder / "config.json").exists() and any(folder.glob("model*.safetensors"))
            and latest_step(folder) is None)


def read_model_folder(folder: Path) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(config, weights, progress) of a Hub-layout Qwen3-Next folder, the
    weights under the trainer's names (``trunk.*``, ``head.*`` from
    ``mtp.*``) in the MLX layout the trainer keeps. The progress keeps the
    runs that made the model (its ``training.json``), so a run started from
    it records them before its own."""
    from mtp_engine.weights import MTP_PREFIX, hub_to_mlx

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(path))
    weights = {}
    for key, value in hub_to_mlx(tensors).items():
        name = "head." + key[len(MTP_PREFIX):] if key.startswith(MTP_PREFIX) else "trunk." + key
        weights[name] = np.ascontiguousarray(value, dtype=np.float32)
    progress = {"kind": "model", "step": 0, "source": str(folder)}
    training = folder / "training.json"
    if training.exists():
        made = json.loads(training.read_text())
        progress["runs"] = made.get("runs", [])
        if made.get("status") != "done" and made.get("history"):  # exported mid-run: that run too, so far
            progress["runs"].append({"kind": made.get("kind"), "steps": made.get("step"), "tokens": made.get("tokens"),
                                     "seconds": made.get("seconds"), "settings": made.get("settings"),
                                     "final": made["history"][-1], "status": made.get("status")})
    return config, weights, progress


def read_checkpoint(folder: Path, with_optimizer: bool = True) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(config, weights, progress) of the latest step (or of a model folder,
    `read_model_folder`); with ``with_optimizer`` the optimizer's tensors (if
    stored) come back in ``progress["optimizer_state"]``.

    Raises:
        FileNotFoundError: No complete step or no ``config.json``.
    """
    if is_model_folder(folder):
        return read_model_folder(folder)
    step = latest_step(folder)
    if step is None:
        raise FileNotFoundError(f"{folder}: no checkpoint step (no 'latest', no step-*/progress.json)")
    config_path = step / "config.json" if (step / "config.json").exists() else step.parent / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found")
    config = json.loads(config_path.read_text())
    progress = json.loads((step / "progress.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for name in progress["files"]["weights"]:
        weights.update(load_file(step / name))
    weights = join_pieces(weights)
    if with_optimizer and progress["files"].get("optimizer"):
        state: dict[str, np.ndarray] = {}
        for name in progress["files"]["optimizer"]:
            path = step / name
            if not path.exists():
                state = {}
                break
            state.update(load_file(path))
        progress["optimizer_state"] = join_pieces(state)
    return config, weights, progress


def write_portable(step_folder: Path, out: Path) -> list[Path]:
    """A copy of a step's weights in bfloat16 (half the bytes) plus its
    progress and config, for moving a run off a machine: ``fit --resume``
    reads it (the optimizer's moments restart)."""
    config, weights, progress = read_checkpoint(step_folder, with_optimizer=False)
    out.mkdir(parents=True, exist_ok=True)
    names = save_sharded_files(out, "weights", weights, bf16=True)
    progress = {**progress, "files": {"weights": names}, "portable": True}
    (out / "progress.json").write_text(json.dumps(progress, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return [out / n for n in names] + [out / "progress.json", out / "config.json"]
