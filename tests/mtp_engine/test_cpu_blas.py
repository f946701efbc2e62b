"""The OpenBLAS route for MLX's CPU matmuls (native/cblas_openblas.c, built
by `make install` on Linux and preloaded by `make generate` / `make bench`):
it is really used when preloaded, matmuls stay right, and the lossless
contract holds under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_engine.backend import CBLAS_SHIM, OPENBLAS

pytestmark = pytest.mark.skipif(
    not CBLAS_SHIM.exists(), reason=f"{CBLAS_SHIM} not built (`make install` on Linux with a C compiler builds it)"
)
ROOT = Path(__file__).resolve().parents[2]


def run_preloaded(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_PRELOAD": str(CBLAS_SHIM)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_preloaded_shim_serves_mlx_matmuls_correctly():
    script = (
        "import mlx.core as mx, numpy as np\n"
        "from mtp_engine.backend import cpu_blas\n"
        "a = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32)\n"
        "b = np.random.default_rng(1).standard_normal((300, 70)).astype(np.float32)\n"
        "got = np.array(mx.array(a) @ mx.array(b))\n"
        "want = a.astype(np.float64) @ b.astype(np.float64)\n"
        "print(cpu_blas()); print(float(np.abs(got - want).max()))\n"
    )
    proc = run_preloaded(["-c", script])
    assert proc.returncode == 0, proc.stderr
    blas, err = proc.stdout.split("\n")[:2]
    assert blas == OPENBLAS
    assert float(err) < 1e-3


def test_every_mode_is_lossless_under_openblas(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "print(i * i)", "Hello"]))
    out = tmp_path / "lossless.json"
    proc = run_preloaded(["-m", "mtp_engine.lossless", "--model", str(tiny_path), "--prompts", str(prompts),
                          "--limit", "3", "--max-tokens", "32", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BLAS: openblas" in proc.stdout
    report = json.loads(out.read_text())
    assert report["compared"] == 24 and not [d for d in report["divergences"] if not d["near_tie"]]
