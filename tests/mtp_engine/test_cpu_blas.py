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


def printed_by_preloaded(script: str) -> list[str]:
    """The lines ``python -c script`` prints with the library preloaded."""
    proc = run_preloaded(["-c", script])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_preloaded_shim_serves_mlx_matmuls_correctly():
    # Row counts on both sides of the few-row limit (32), every transposition.
    script = (
        "import mlx.core as mx, numpy as np\n"
        "from mtp_engine.backend import cpu_blas, few_rows\n"
        "rng = np.random.default_rng(0)\n"
        "err = 0.0\n"
        "for m in (1, 5, 32, 40):\n"
        "    a = rng.standard_normal((m, 300)).astype(np.float32)\n"
        "    b = rng.standard_normal((300, 70)).astype(np.float32)\n"
        "    want = a.astype(np.float64) @ b.astype(np.float64)\n"
        "    A, B = mx.array(a), mx.array(b)\n"
        "    for got in (A @ B, A @ mx.array(b.T).T, mx.array(a.T).T @ B, mx.array(a.T).T @ mx.array(b.T).T):\n"
        "        err = max(err, float(np.abs(np.array(got) - want).max()))\n"
        "print(cpu_blas()); print(few_rows()); print(err)\n"
    )
    blas, rows, err = printed_by_preloaded(script)
    assert blas == OPENBLAS
    assert rows == "32"
    assert float(err) < 1e-3


def test_rows_of_a_preloaded_matmul_round_as_one_row_matmuls():
    # Every row count the few-row kernel tiles differently (1..8 rows a tile,
    # then more tiles), depths with and without a tail past the vector width,
    # widths with and without leftover columns, weights stored either way.
    script = (
        "import mlx.core as mx\n"
        "ok = True\n"
        "for m in (2, 3, 4, 5, 7, 8, 9, 13, 32):\n"
        "    for k, n in ((256, 768), (37, 50), (4, 1), (128, 3)):\n"
        "        x = mx.random.normal((m, k), key=mx.random.key(m))\n"
        "        w = mx.random.normal((n, k), key=mx.random.key(k))\n"
        "        wt = mx.contiguous(w.T)\n"
        "        for many, one in ((x @ w.T, lambda r: r @ w.T), (x @ wt, lambda r: r @ wt)):\n"
        "            ok &= all(mx.array_equal(many[i : i + 1], one(x[i : i + 1])).item() for i in range(m))\n"
        "print(ok)\n"
    )
    assert printed_by_preloaded(script) == ["True"]


def test_checkpoints_equal_token_by_token_decoding_bit_for_bit_under_openblas():
    # The bit-exact tests of per-token checkpoints and cache commits, re-run
    # with MLX's matmuls on OpenBLAS: a verify forward's rows round as
    # one-token forwards do there too.
    proc = run_preloaded(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/mtp_engine/test_recurrent.py", "tests/mtp_engine/test_cache_ops.py"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_every_mode_is_lossless_under_openblas(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "print(i * i)", "Hello"]))
    out = tmp_path / "lossless.json"
    proc = run_preloaded(["-m", "mtp_engine.lossless", "--model", str(tiny_path), "--prompts", str(prompts),
                          "--limit", "3", "--max-tokens", "32", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BLAS: openblas" in proc.stdout
    report = json.loads(out.read_text())
    from mtp_engine.lossless import MODES

    assert report["compared"] == 3 * len(MODES) and not [d for d in report["divergences"] if not d["near_tie"]]
