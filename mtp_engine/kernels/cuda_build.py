"""The engine's CUDA kernels, compiled once per machine instead of once per process.

MLX compiles an ``mx.fast.cuda_kernel`` with NVRTC the first time a process
launches it (about 1.3 s a kernel on the H100, most of a short job's first
prefill) and keeps no compiled custom kernel on disk. `CudaKernel` takes the
same arguments and launches the same code, but compiles it with NVRTC (the
library MLX itself loads; the first prefill of a process that compiles the
engine's kernels so cost 0.76 s on the H100, one reading them 0.60 s)
into a cubin kept under the user's cache
(`mtp_engine.backend.kernel_cache_dir`: ``~/.cache/mtp_engine/cuda`` unless
``MTP_KERNEL_CACHE`` or ``XDG_CACHE_HOME`` says otherwise), named by the
SHA-256 of the translation unit, the device's architecture and NVRTC's
version, and runs it through
``mx.fast.precompiled_cuda_kernel``. A later process reads the file.

Each file holds the cubin after its own SHA-256, so a file that does not
match it (truncated, overwritten) is refused and rebuilt; a cache that cannot
be written costs the compile again, nothing else. Where NVRTC or CUDA's headers
cannot be found, or the source reads an input's shape, strides or ndim (which
only MLX's own wrapper passes), the kernel falls back to
``mx.fast.cuda_kernel`` and says why once (`reason`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

from mtp_engine.backend import cuda_homes, kernel_cache_dir

log = logging.getLogger(__name__)

CUDA_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int", mx.uint32: "unsigned int", mx.int64: "long long", mx.uint64: "unsigned long long",
    mx.int8: "signed char", mx.uint8: "unsigned char", mx.int16: "short", mx.uint16: "unsigned short",
    mx.bool_: "bool",
}
PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

"""
"""What the kernels use of MLX's own prelude (``mlx/backend/cuda/device/utils.cuh``,
whose ``<cstdint>`` NVRTC cannot find without MLX's include folders)."""
CUBIN_MAGIC = b"\x7fELF"
FORMAT = "1"  # bump when the translation unit's layout or the file's changes

Compiler = Callable[[str, str], bytes]
"""``compile(translation_unit, architecture) -> cubin``; its ``version``
attribute, where it has one, is part of each file's name."""


def translation_unit(function: str, source: str, header: str, input_names: Sequence[str], input_dtypes,
                     output_names: Sequence[str], output_dtypes, template: Sequence[tuple]) -> str:
    """The kernel as ``mx.fast.cuda_kernel`` would wrap ``source``: inputs
    then outputs as pointers, the template's names as constants, but with C
    linkage so the cubin's symbol is ``function``."""
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in zip(input_names, input_dtypes)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    consts = []
    for name, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};")
        else:
            consts.append(f"  using {name} = {CUDA_TYPES[value]};")
    return (PRELUDE + header + f'\n\nextern "C" __global__ void {function}(\n' + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n\n" + source + "\n}\n")


def reads_shapes(source: str, input_names: Sequence[str]) -> bool:
    """Whether ``source`` reads an input's ``_shape``, ``_strides`` or ``_ndim``."""
    return any(f"{n}{suffix}" in source for n in input_names for suffix in ("_shape", "_strides", "_ndim"))


class CudaKernel:
    """``mx.fast.cuda_kernel(name=..., ...)``, compiled once per machine.

    Args:
        name, input_names, output_names, source, header: As ``mx.fast.cuda_kernel`` takes them.
        compiler: Turns a translation unit into a cubin for an architecture
            (default NVRTC through ctypes; tests pass their own).
        directory: The cache (default `mtp_engine.backend.kernel_cache_dir`).
    """

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", compiler: Compiler | None = None, directory: Path | None = None):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self.compiler = compiler
        self.directory = directory
        self.reason: str | None = None  # why it falls back to MLX's per-process compile
        self.compiles = 0  # cubins compiled by this object (not read from the cache)
        self._built: dict[tuple, tuple[str, bytes]] = {}
        self._fallback = None
        if reads_shapes(source, input_names):
            self.reason = "its source reads an input's shape, strides or ndim"
        elif not hasattr(mx.fast, "precompiled_cuda_kernel"):
            self.reason = f"MLX {mx.__version__} has no mx.fast.precompiled_cuda_kernel"

    def __call__(self, *, inputs: list[mx.array], template: list[tuple], grid: tuple[int, int, int],
                 threadgroup: tuple[int, int, int], output_shapes: list, output_dtypes: list) -> list[mx.array]:
        if self.reason is None:
            key = (tuple(x.dtype for x in inputs), tuple(template), tuple(output_dtypes))
            built = self._built.get(key) or self._build(key, template, output_dtypes)
            if built is not None:  # a launch that fails to load raises at evaluation; the cubin is checksummed
                function, cubin = built
                return mx.fast.precompiled_cuda_kernel(
                    name=function, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
                    output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                    ensure_row_contiguous=True)
        if self._fallback is None:
            self._fallback = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                                 output_names=self.output_names, source=self.source,
                                                 header=self.header)
        return self._fallback(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                              output_shapes=output_shapes, output_dtypes=output_dtypes)

    def build(self, input_dtypes, template: list[tuple], output_dtypes, architecture: str) -> tuple[str, bytes]:
        """The kernel's symbol and cubin for these dtypes and constants, from
        the cache or compiled (and then kept there). Raises what the compiler
        raises."""
        probe = translation_unit("KERNEL", self.source, self.header, self.input_names, input_dtypes,
                                 self.output_names, output_dtypes, template)
        compiler = self.compiler or nvrtc()
        digest = hashlib.sha256(
            "\0".join([FORMAT, architecture, getattr(compiler, "version", ""), probe]).encode()).hexdigest()
        function = f"mtp_{self.name}_{digest[:16]}"
        path = (self.directory or kernel_cache_dir()) / f"{function}.cubin"
        try:
            cubin = _checked(path.read_bytes())
            if cubin is not None:
                return function, cubin
            log.warning("refusing %s (damaged); compiling the kernel again", path)
        except OSError:
            pass
        unit = translation_unit(function, self.source, self.header, self.input_names, input_dtypes,
                                self.output_names, output_dtypes, template)
        cubin = compiler(unit, architecture)
        self.compiles += 1
        if not cubin.startswith(CUBIN_MAGIC):
            raise RuntimeError(f"the compiler gave no cubin for {function}")
        _write(path, hashlib.sha256(cubin).digest() + cubin)
        return function, cubin

    def _build(self, key, template, output_dtypes) -> tuple[str, bytes] | None:
        try:
            built = self.build(key[0], template, output_dtypes, device_architecture())
        except (OSError, RuntimeError, KeyError, AttributeError) as e:
            self.reason = f"{type(e).__name__}: {e}"
            log.warning("the %s kernel is compiled by MLX in every process: %s", self.name, self.reason)
            return None
        self._built[key] = built
        return built


def _checked(data: bytes) -> bytes | None:
    """The cubin of a cache file, or None when the file does not match its checksum."""
    digest, cubin = data[:32], data[32:]
    return cubin if cubin.startswith(CUBIN_MAGIC) and hashlib.sha256(cubin).digest() == digest else None


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all; a cache that cannot be
    written is skipped (the kernel still runs from memory)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from its other users
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log.warning("cannot keep the compiled kernel in %s (%s); it is compiled again next process",
                    path.parent, e)


def device_architecture() -> str:
    """``sm_XY`` of the default CUDA device (MLX's ``device_info``)."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if "compute_capability_major" not in info:
        raise RuntimeError("MLX reports no CUDA compute capability")
    return f"sm_{info['compute_capability_major']}{info['compute_capability_minor']}"


class _Nvrtc:
    """NVRTC through ctypes: the library this process's MLX loaded, else the
    ``nvidia-cuda-nvrtc`` package's, else the loader's search."""

    def __init__(self):
        self.lib = ctypes.CDLL(_nvrtc_path())
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.include = _cuda_include(major.value)
        self.options = ["--include-path=" + self.include, "--device-as-default-execution-space"]
        self.version = f"nvrtc {major.value}.{minor.value} {' '.join(self.options)}"  # in each cubin's name

    def _check(self, result: int, call: str, program=None) -> None:
        if result != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            message = self.lib.nvrtcGetErrorString(result).decode()
            if program is not None:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value)
                self.lib.nvrtcGetProgramLog(program, text)
                message += ": " + text.value.decode(errors="replace")[:2000]  # the first errors
            raise RuntimeError(f"{call} failed: {message}")

    def __call__(self, unit: str, architecture: str) -> bytes:
        program = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), unit.encode(), b"kernel.cu", 0, None, None),
                    "nvrtcCreateProgram")
        try:
            options = [f"--gpu-architecture={architecture}"] + self.options
            array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            self._check(self.lib.nvrtcCompileProgram(program, len(options), array), "nvrtcCompileProgram", program)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))


@functools.cache
def nvrtc() -> _Nvrtc:
    """The process's NVRTC compiler (loaded on first use)."""
    return _Nvrtc()


def _nvrtc_path() -> str:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvrtc.so" in line and "builtins" not in line:
                    return line.split()[-1]
    except OSError:
        pass
    for root in map(Path, sys.path):
        for found in sorted(root.glob("nvidia/*/lib/libnvrtc.so*")):
            if "builtins" not in found.name:
                return str(found)
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise OSError("NVRTC (libnvrtc.so) not found")


def _cuda_include(major: int) -> str:
    """The folder holding CUDA's ``cuda_bf16.h``, searched as MLX searches it
    (the ``nvidia`` package of NVRTC's major version first)."""
    subs = ("cu13", "cuda_runtime") if major >= 13 else ("cuda_runtime", "cu13")
    candidates = [root / "nvidia" / sub / "include" for root in map(Path, sys.path) for sub in subs]
    candidates += [Path(home) / "include" for home in cuda_homes()]
    for path in candidates:
        if (path / "cuda_bf16.h").is_file():
            return str(path)
    raise OSError("CUDA's headers (cuda_bf16.h) not found; set CUDA_HOME")
