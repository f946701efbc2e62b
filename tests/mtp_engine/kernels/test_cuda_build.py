"""The engine's CUDA kernels compiled once per machine: a later process reads
the cubin an earlier one compiled, a damaged file is rebuilt, an unwritable
cache only costs the compile. NVRTC runs on a CUDA machine only, so the
cache's behaviour is checked here with a compiler that records its calls,
and the real compile and launch with the GPU tests below."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mtp_engine.backend import is_cuda_backend
from mtp_engine.kernels import cuda_build, cuda_chain, cuda_moe, cuda_recurrence
from mtp_engine.kernels.cuda_build import CUBIN_MAGIC, CudaKernel, translation_unit
from mtp_engine.backend import kernel_cache_dir

SOURCE = "  const int i = threadIdx.x;\n  out[i] = static_cast<InT>(x[i] * SCALE);"
TEMPLATE = [("InT", mx.bfloat16), ("SCALE", 3)]


class RecordingCompiler:
    """Stands in for NVRTC (absent off CUDA): a fake cubin holding the unit."""

    version = "recording 1"

    def __init__(self):
        self.units: list[str] = []

    def __call__(self, unit: str, architecture: str) -> bytes:
        self.units.append(unit)
        return CUBIN_MAGIC + f"{architecture}\n{unit}".encode()


def _kernel(compiler, directory, source=SOURCE):
    return CudaKernel("scale", ["x"], ["out"], source, compiler=compiler, directory=directory)


def _build(kernel, template=TEMPLATE, dtype=mx.bfloat16, architecture="sm_90"):
    return kernel.build([dtype], template, [dtype], architecture)


def test_a_later_process_reads_the_kernel_an_earlier_one_compiled(tmp_path):
    compiler = RecordingCompiler()
    function, cubin = _build(_kernel(compiler, tmp_path))
    later = _kernel(compiler, tmp_path)  # a new object: what a new process builds
    assert _build(later) == (function, cubin)
    assert len(compiler.units) == 1 and later.compiles == 0
    assert (tmp_path / f"{function}.cubin").read_bytes().endswith(cubin)
    assert f'extern "C" __global__ void {function}(' in compiler.units[0]


def test_other_constants_dtypes_architectures_or_sources_get_their_own_cubin(tmp_path):
    compiler = RecordingCompiler()
    names = {
        _build(_kernel(compiler, tmp_path))[0],
        _build(_kernel(compiler, tmp_path), template=[("InT", mx.bfloat16), ("SCALE", 4)])[0],
        _build(_kernel(compiler, tmp_path), template=[("InT", mx.float32), ("SCALE", 3)], dtype=mx.float32)[0],
        _build(_kernel(compiler, tmp_path), architecture="sm_80")[0],
        _build(_kernel(compiler, tmp_path, source=SOURCE + "\n  // changed"))[0],
    }
    assert len(names) == 5 and len(compiler.units) == 5 and len(list(tmp_path.glob("*.cubin"))) == 5


@pytest.mark.parametrize("damage", ["truncated", "byte flipped", "not a cubin"])
def test_a_damaged_cache_file_is_refused_and_rebuilt(tmp_path, damage):
    compiler = RecordingCompiler()
    function, cubin = _build(_kernel(compiler, tmp_path))
    path = tmp_path / f"{function}.cubin"
    kept = path.read_bytes()
    path.write_bytes({"truncated": kept[:-7], "byte flipped": kept[:50] + bytes([kept[50] ^ 1]) + kept[51:],
                      "not a cubin": b"half a file"}[damage])
    assert _build(_kernel(compiler, tmp_path)) == (function, cubin)
    assert len(compiler.units) == 2 and path.read_bytes() == kept


def test_an_unwritable_cache_costs_the_compile_and_nothing_else(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    compiler = RecordingCompiler()
    first, second = _build(_kernel(compiler, blocked / "cuda")), _build(_kernel(compiler, blocked / "cuda"))
    assert first == second and len(compiler.units) == 2


def test_a_compiler_without_a_cubin_is_an_error_not_a_cache_entry(tmp_path):
    kernel = _kernel(lambda unit, arch: b"// PTX text", tmp_path)
    with pytest.raises(RuntimeError, match="no cubin"):
        _build(kernel)
    assert not list(tmp_path.iterdir())


def test_a_compile_that_fails_falls_back_to_mlx_and_says_why(tmp_path, monkeypatch, caplog):
    def broken(unit, architecture):
        raise RuntimeError("nvrtcCompileProgram failed: identifier \"uint32_t\" is undefined")

    monkeypatch.setattr(cuda_build, "device_architecture", lambda: "sm_90")
    kernel = _kernel(broken, tmp_path)
    key = ((mx.bfloat16,), tuple(TEMPLATE), (mx.bfloat16,))
    assert kernel._build(key, TEMPLATE, [mx.bfloat16]) is None
    assert kernel.reason == 'RuntimeError: nvrtcCompileProgram failed: identifier "uint32_t" is undefined'
    assert "the scale kernel is compiled by MLX in every process" in caplog.text
    assert not list(tmp_path.iterdir())


def test_a_source_reading_an_input_shape_stays_with_mlx():
    kernel = CudaKernel("k", ["x"], ["out"], "out[0] = x_shape[0];")
    assert kernel.reason == "its source reads an input's shape, strides or ndim"
    assert CudaKernel("k", ["x"], ["out"], SOURCE).reason is None


def test_the_translation_unit_wraps_the_source_as_mlx_does():
    unit = translation_unit("f", SOURCE, "// helpers", ["x", "n"], [mx.bfloat16, mx.int32], ["out"], [mx.float32],
                            [("InT", mx.bfloat16), ("SCALE", 3), ("GLU", True)])
    params = unit[unit.index("void f(") + len("void f("):unit.index(") {")].split(",")
    assert [p.strip() for p in params] == ["const __nv_bfloat16* x", "const int* n", "float* out"]
    for line in ("using InT = __nv_bfloat16;", "constexpr int SCALE = 3;", "constexpr bool GLU = true;", "// helpers"):
        assert line in unit
    assert unit.index("// helpers") < unit.index("void f(") < unit.index(SOURCE)


def test_the_cache_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MTP_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache_dir() == tmp_path / "mtp_engine" / "cuda"
    monkeypatch.setenv("MTP_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert kernel_cache_dir() == tmp_path / "kernels"


@pytest.mark.skipif(not is_cuda_backend(), reason="needs MLX on a CUDA GPU")
def test_the_cached_kernel_equals_mlx_compile_and_a_later_process_compiles_nothing(tmp_path):
    """NVRTC's cubin of the gated-delta kernel gives MLX's own compile's
    outputs and states bit for bit, in every mode; a second object on the
    same cache (a later process) reads it back."""
    B, T, Hk, Hv, Dk, Dv = 3, 4, 2, 4, 64, 32
    keys = mx.random.split(mx.random.key(0), 6)
    q, k = (mx.random.normal((B, T, Hk, Dk), key=keys[i]).astype(mx.bfloat16) * 0.1 for i in (0, 1))
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(mx.bfloat16)
    g, beta = (mx.random.uniform(0.5, 1.0, (B, T, Hv), key=keys[i]).astype(mx.bfloat16) for i in (3, 4))
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5]) * 0.1
    names = ["q", "k", "v", "g", "beta", "state_in", "n_tokens", "mode", "last"]
    source = (cuda_recurrence.SOURCES / "gated_delta_tokens.cu").read_text()
    header = (cuda_recurrence.SOURCES / "gated_delta_tokens.cuh").read_text()
    mlx_kernel = mx.fast.cuda_kernel(name="test_gated_delta", input_names=names, output_names=["y", "states"],
                                     source=source, header=header)
    cached = CudaKernel("test_gated_delta", names, ["y", "states"], source, header, directory=tmp_path)
    for mode in (cuda_recurrence.FINAL, cuda_recurrence.EVERY, cuda_recurrence.OUTPUTS, cuda_recurrence.AT):
        args = dict(
            inputs=[q, k, v, g, beta, state, mx.array([T], mx.int32), mx.array([mode], mx.int32),
                    mx.array([1, 3, 0], mx.int32)],
            template=[("InT", mx.bfloat16), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
            grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
            output_shapes=[(B, T, Hv, Dv), (T if mode == cuda_recurrence.EVERY else 1, B, Hv, Dv, Dk)],
            output_dtypes=[mx.bfloat16, mx.float32],
        )
        want, got = mlx_kernel(**args), cached(**args)
        assert cached.reason is None
        if mode != cuda_recurrence.AT:  # AT writes no outputs
            assert mx.array_equal(got[0], want[0]).item()
        if mode != cuda_recurrence.OUTPUTS:  # OUTPUTS writes no states
            assert mx.array_equal(got[1], want[1]).item()
    assert cached.compiles == 1
    later = CudaKernel("test_gated_delta", names, ["y", "states"], source, header, directory=tmp_path)
    later(**args)
    assert later.compiles == 0 and later.reason is None


def _nvrtc_or_none():
    try:
        return cuda_build.nvrtc()
    except OSError:
        return None


@pytest.mark.skipif(_nvrtc_or_none() is None, reason="needs NVRTC (MLX's CUDA build, or the nvidia-cuda-nvrtc package)")
@pytest.mark.parametrize("kernel", ["gated_delta_tokens", "moe_tiles", "draft_chain"])
def test_nvrtc_compiles_the_engine_kernels(kernel, tmp_path):
    """The real compiler takes the translation units (no GPU needed): every
    type the sources use is declared, for the 80B-A3B shapes in bfloat16."""
    bf16 = mx.bfloat16
    if kernel == "gated_delta_tokens":
        source = (cuda_recurrence.SOURCES / "gated_delta_tokens.cu").read_text()
        names = ["q", "k", "v", "g", "beta", "state_in", "n_tokens", "mode", "last"]
        built = CudaKernel(kernel, names, ["y", "states"], source,
                           (cuda_recurrence.SOURCES / "gated_delta_tokens.cuh").read_text(), directory=tmp_path)
        args = ([bf16] * 5 + [mx.float32] + [mx.int32] * 3,
                [("InT", bf16), ("Dk", 128), ("Dv", 128), ("Hk", 16), ("Hv", 32)], [bf16, mx.float32])
    elif kernel == "draft_chain":  # the shipped model's head
        built = CudaKernel(kernel, cuda_chain.INPUT_NAMES, cuda_chain.OUTPUT_NAMES, cuda_chain.source(),
                           cuda_chain.header(), directory=tmp_path)
        c = {"dim": 384, "heads": 6, "kv_heads": 2, "head_dim": 64, "rope_dims": 16, "vocab": 3072, "experts": 4,
             "top_k": 2, "expert_dim": 192, "shared_dim": 192, "norm_topk": True}
        template = cuda_chain.ChainKernel.template(SimpleNamespace(config=c, dtype=bf16), bf16, bf16)
        args = ([bf16, mx.int32, mx.int32, mx.int32, mx.float32, mx.float32, bf16, bf16, mx.bool_, mx.float32]
                + [bf16] * len(cuda_chain.WEIGHT_ARGS),
                template, [mx.int32, bf16, bf16, mx.float32])
    else:
        built = CudaKernel(kernel, cuda_moe.TILE_INPUT_NAMES, cuda_moe.OUTPUT_NAMES, cuda_moe.tiles_source(),
                           cuda_moe.header(), directory=tmp_path)
        args = ([bf16, mx.uint32, mx.int32, mx.int32, mx.uint32, bf16, bf16, mx.uint32, bf16, bf16],
                [("InT", bf16), ("ST", bf16), ("K", 2048), ("N", 512), ("GROUP", 64), ("GLU", 1), ("FR", 4),
                 ("TILES", 2)], [bf16])
    function, cubin = built.build(*args, "sm_90")
    assert cubin.startswith(CUBIN_MAGIC) and built.compiles == 1
    assert (tmp_path / f"{function}.cubin").is_file()
