"""One options object for every fast path: validation, the declared
environment variables, what the engine reports, what a job logs, and that
importing the packages loads no extension or CUDA module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_engine import EngineOptions, MTPEngine
from mtp_engine.options import ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
FAST_PATHS = {"cpu_blas", "cpu_recurrence", "cpu_activations", "cpp_drafter", "cuda_recurrence",
              "cuda_chain_drafter", "compile_layers", "compile_head", "rowwise_linears", "flat_quantized", "prefill_dequantized",
              "contiguous_moe",
              "grouped_moe", "moe_kernel", "prefill_moe_kernel", "layer_dispatch",
              "cudnn_attention"}


def test_bad_switches_are_named():
    with pytest.raises(ValueError, match="few_rows must be an int in 0..256, got 300"):
        EngineOptions(few_rows=300)
    with pytest.raises(ValueError, match="cpp_drafter must be True or False, got 'yes'"):
        EngineOptions(cpp_drafter="yes")
    with pytest.raises(ValueError, match="unknown fast-path switch 'cpu_drafter'"):
        EngineOptions().with_switches(cpu_drafter=False)
    with pytest.raises(ValueError, match="--fast-path takes NAME=VALUE"):
        EngineOptions.parse_switch("cpp_drafter")
    assert EngineOptions.parse_switch("compile-layers=auto") == ("compile_layers", None)
    assert EngineOptions.parse_switch("few_rows=16") == ("few_rows", 16)
    with pytest.raises(ValueError, match="unknown fast-path switch 'draft_kernel'"):  # no aliases
        EngineOptions().with_switches(draft_kernel=False)


def test_environment_variables_map_onto_the_defaults(monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert EngineOptions.from_env() == EngineOptions()
    monkeypatch.setenv("MTP_CPP_DRAFTER", "0")
    monkeypatch.setenv("MTP_FEW_ROWS", "8")
    options = EngineOptions.from_env(compile_layers=False)
    assert (options.cpp_drafter, options.few_rows, options.compile_layers) == (False, 8, False)
    monkeypatch.setenv("MTP_CPU_RECURRENCE", "maybe")
    with pytest.raises(ValueError, match="MTP_CPU_RECURRENCE must be one of .*got 'maybe'"):
        EngineOptions.from_env()


def test_no_module_reads_the_environment_but_the_options():
    readers = []
    for path in list((ROOT / "mtp_engine").rglob("*.py")) + list((ROOT / "jobs").rglob("*.py")):
        text = path.read_text()
        if "os.environ" in text or "getenv(" in text:
            readers.append(path.relative_to(ROOT).as_posix())
    # options.py declares the fast paths' variables; backend.py sets and records MLX's own and reads where
    # CUDA's headers and the compiled kernels are.
    assert readers == ["mtp_engine/backend.py", "mtp_engine/options.py"]


def test_the_engine_reports_every_fast_path(tiny_path):
    engine = MTPEngine.load(tiny_path, options=EngineOptions(compile_head=False))
    states = {s.name: s for s in engine.fast_paths}
    assert set(states) == FAST_PATHS
    assert states["compile_head"].state == "off" and states["compile_head"].detail == "by choice"
    assert states["cuda_chain_drafter"].state in ("on", "unavailable")
    assert all(s.state in ("on", "off", "unavailable") for s in engine.fast_paths)


def test_an_extension_that_is_missing_is_reported_with_its_import_error(tiny_path):
    script = (
        "import sys; sys.modules['_mtp_cpp_drafter'] = None\n"  # as if it were not built
        "from mtp_engine import MTPEngine\n"
        f"e = MTPEngine.load({str(tiny_path)!r})\n"
        "print([s.line() for s in e.fast_paths if s.name == 'cpp_drafter'][0])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("fast path cpp_drafter: unavailable (not built (import of _mtp_cpp_drafter")


def test_importing_the_packages_loads_no_extension_or_cuda_module():
    script = (
        "import sys, mtp_engine, jobs\n"
        "print(sorted(m for m in sys.modules if m.startswith('_mtp') or m.startswith('mtp_engine.kernels.cuda')"
        " or m.startswith('mtp_engine.drafters.cuda')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
