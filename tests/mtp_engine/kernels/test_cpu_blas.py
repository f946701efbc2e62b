"""The CPU BLAS route (`mtp_engine.kernels.cpu_blas`, `native/cpu_blas.c`):
a plain ``python -c`` process that imports mtp_engine has MLX's matmuls on
it (no environment variable, no preload), matmuls stay right, rows of a
few-row product round as one-row products, it can be switched at run time,
and the lossless contract holds on either BLAS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_engine.kernels import cpu_blas

pytestmark = pytest.mark.skipif(
    not cpu_blas.library_path().exists(),
    reason=f"{cpu_blas.library_path()} not built (`make install` on Linux with a C compiler builds it)",
)
ROOT = Path(__file__).resolve().parents[3]


def run_python(args: list[str], **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MTP_") and k != "LD_PRELOAD"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**environ, **env},
                          capture_output=True, text=True, timeout=600)


def printed(script: str, **env) -> list[str]:
    """The lines ``python -c script`` prints."""
    proc = run_python(["-c", script], **env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_plain_process_routes_mlx_matmuls_and_they_stay_right():
    # Row counts on both sides of the few-row limit (32), every transposition.
    script = (
        "import mtp_engine\n"
        "import mlx.core as mx, numpy as np\n"
        "from mtp_engine.kernels import cpu_blas\n"
        "before = cpu_blas.calls()\n"
        "rng = np.random.default_rng(0)\n"
        "err = 0.0\n"
        "for m in (1, 5, 32, 40):\n"
        "    a = rng.standard_normal((m, 300)).astype(np.float32)\n"
        "    b = rng.standard_normal((300, 70)).astype(np.float32)\n"
        "    want = a.astype(np.float64) @ b.astype(np.float64)\n"
        "    A, B = mx.array(a), mx.array(b)\n"
        "    for got in (A @ B, A @ mx.array(b.T).T, mx.array(a.T).T @ B, mx.array(a.T).T @ mx.array(b.T).T):\n"
        "        err = max(err, float(np.abs(np.array(got) - want).max()))\n"
        "print(cpu_blas.active()); print(cpu_blas.calls() - before); print(err)\n"
    )
    blas, calls, err = printed(script)
    assert blas == cpu_blas.OPENBLAS
    assert int(calls) == 16  # every matmul above went through the route
    assert float(err) < 1e-3


def test_rows_of_a_few_row_matmul_round_as_one_row_matmuls():
    # Every row count the few-row kernel tiles differently (1..8 rows a tile,
    # then more tiles), depths with and without a tail past the vector width,
    # widths with and without leftover columns, weights stored either way.
    script = (
        "import mtp_engine\n"
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
    assert printed(script) == ["True"]


def test_when_the_route_cannot_be_set_up_the_reason_is_kept():
    script = (
        "import mtp_engine\n"
        "from mtp_engine.kernels import cpu_blas\n"
        "print(cpu_blas.active()); print(cpu_blas.unavailable_reason())\n"
    )
    assert printed(script, MTP_CPU_BLAS="0") == [cpu_blas.BUNDLED, "off by MTP_CPU_BLAS=0 (read when mtp_engine is imported)"]
    late = "import mlx.core\n" + script
    blas, reason = printed(late)
    assert blas == cpu_blas.BUNDLED and reason.startswith("mlx.core was imported before mtp_engine")


def test_loading_an_engine_after_mlx_warns_that_the_route_is_lost(tiny_path):
    # Importing MLX first is the one accidental way to lose the route (a
    # several-fold slower CPU engine): loading says so, once per engine.
    load = f"e = MTPEngine.load({str(tiny_path)!r})\n"
    proc = run_python(["-c", "import mlx.core\nfrom mtp_engine import MTPEngine\n" + load])
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning: cpu_blas fast path unavailable: mlx.core was imported before mtp_engine" in proc.stderr
    proc = run_python(["-c", "from mtp_engine import MTPEngine\nimport mlx.core\n" + load])
    assert proc.returncode == 0 and "cpu_blas" not in proc.stderr, proc.stderr


def test_the_route_switches_at_run_time(tiny_path):
    script = (
        "import mtp_engine, time\n"
        "import mlx.core as mx\n"
        "from mtp_engine import MTPEngine\n"
        "from mtp_engine.kernels import cpu_blas\n"
        f"e = MTPEngine.load({str(tiny_path)!r}, cpu_blas=False)\n"
        "print(cpu_blas.active())\n"
        "print([s.line() for s in e.fast_paths if s.name == 'cpu_blas'][0])\n"
        "a = mx.random.normal((64, 512), key=mx.random.key(0)); b = mx.random.normal((512, 512), key=mx.random.key(1))\n"
        "slow = a @ b\n"
        "cpu_blas.configure(True, 0)\n"
        "print(cpu_blas.active(), cpu_blas.few_rows(), mx.allclose(slow, a @ b, atol=1e-3).item())\n"
    )
    assert printed(script) == [
        cpu_blas.BUNDLED,
        "fast path cpu_blas: off (by choice: MLX's bundled BLAS (process-wide))",
        f"{cpu_blas.OPENBLAS} 0 True",
    ]


def test_captured_states_equal_token_by_token_decoding_bit_for_bit_on_the_bundled_blas():
    # The bit-exact tests of per-token captured states and cache commits,
    # re-run with MLX's matmuls on the BLAS MLX bundles (the suite itself runs
    # on the route).
    proc = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                       "tests/mtp_engine/model/test_gated_delta.py", "tests/mtp_engine/cache/test_commit.py"],
                      MTP_CPU_BLAS="0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_every_mode_is_lossless_on_the_bundled_blas(tmp_path, tiny_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "print(i * i)", "Hello"]))
    out = tmp_path / "lossless.json"
    proc = run_python(["-m", "mtp_engine.lossless", "--model", str(tiny_path), "--prompts", str(prompts),
                       "--limit", "3", "--max-tokens", "32", "--json", str(out)], MTP_CPU_BLAS="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"BLAS: {cpu_blas.BUNDLED}" in proc.stdout
    report = json.loads(out.read_text())
    from mtp_engine.tools.lossless import MODES

    assert report["compared"] == 3 * len(MODES) and not [d for d in report["divergences"] if not d["near_tie"]]
