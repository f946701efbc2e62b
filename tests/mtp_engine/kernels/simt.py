"""Run an ``mx.fast.cuda_kernel`` source on the CPU under ``simt_emu.h``.

The wrapper is built the way MLX 0.32's CUDA backend builds a custom
kernel (inputs as ``const T*``, outputs as ``T*``, template arguments as
``constexpr`` constants or type aliases ahead of the body), then compiled
with the system's C++ compiler and called through ctypes on numpy copies of
the inputs. The blocks of a grid run one after another; an input whose
``NAME_shape`` the body reads gets its shape as MLX passes it.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).parent
_BUILD = Path(tempfile.gettempdir()) / "mtp-simt"
_TYPES = {mx.float32: "float", mx.int32: "int32_t", mx.uint32: "uint32_t", mx.bfloat16: "__nv_bfloat16",
          mx.bool_: "bool"}
_NUMPY = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32, mx.bfloat16: np.uint16,
          mx.bool_: np.bool_}
_GARBAGE = {mx.float32: np.nan, mx.int32: -1, mx.uint32: 0xFFFFFFFF, mx.bfloat16: 0x7FC0, mx.bool_: True}
"""What an output holds before the kernel writes it (a GPU's outputs start uninitialized): NaN, or -1."""


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def _to_mx(a: np.ndarray, dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _params(body, names, inputs, out_names, out_dtypes) -> list[tuple[str, str]]:
    """The kernel's parameters in MLX's order, as (C type, name): each input,
    with its shape after it where the body reads ``NAME_shape``, then the
    outputs."""
    params = []
    for n, a in zip(names, inputs):
        params.append((f"const {_TYPES[a.dtype]}*", n))
        if f"{n}_shape" in body:
            params.append(("const int32_t*", f"{n}_shape"))
    return params + [(f"{_TYPES[d]}*", n) for n, d in zip(out_names, out_dtypes)]


def _source(header, body, params, template) -> str:
    consts = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            consts.append(f"  using {name} = {_TYPES[value]};")
        elif isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        else:
            consts.append(f"  constexpr int {name} = {value};")
    casts = [f"({ctype})ptrs[{i}]" for i, (ctype, _) in enumerate(params)]
    return "\n".join([
        '#include "simt_emu.h"',
        header,
        "static void kernel(" + ", ".join(f"{ctype} {name}" for ctype, name in params) + ") {",
        *consts,
        body,
        "}",
        'extern "C" void launch(void** ptrs, int gx, int gy, int gz, int bx, int by) {',
        "  simt::run(gx, gy, gz, bx, by, [&] { kernel(" + ", ".join(casts) + "); });",
        "}",
    ])


def run(header, body, names, inputs, out_names, template, shapes, dtypes, threads=64,
        grid=None, threadgroup=None) -> list[mx.array]:
    """The kernel's outputs (as MLX arrays) for one block of ``threads``, or
    for ``grid`` and ``threadgroup`` (in threads, as ``mx.fast.cuda_kernel``
    takes them; blocks of at most two dimensions)."""
    inputs = [mx.contiguous(a) for a in inputs]
    mx.eval(inputs)
    params = _params(body, names, inputs, out_names, dtypes)
    text = _source(header, body, params, template)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    _BUILD.mkdir(exist_ok=True)
    lib = _BUILD / f"k{digest}.so"
    if not lib.exists():
        src = _BUILD / f"k{digest}.cpp"
        src.write_text(text)
        tmp = lib.with_suffix(".tmp")
        subprocess.run(
            [compiler(), "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f"-I{HERE}", str(src), "-o", str(tmp)],
            check=True, capture_output=True, text=True,
        )
        tmp.rename(lib)
    fn = ctypes.CDLL(str(lib)).launch
    outputs = [np.full(s, _GARBAGE[d], dtype=_NUMPY[d]) for s, d in zip(shapes, dtypes)]
    by_name = {n: _numpy(a) for n, a in zip(names, inputs)}
    by_name |= {f"{n}_shape": np.array(a.shape, dtype=np.int32) for n, a in zip(names, inputs)}
    by_name |= dict(zip(out_names, outputs))
    arrays = [by_name[name] for _, name in params]
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    if grid is None:
        grid, threadgroup = (threads, 1, 1), (threads, 1, 1)
    block = [min(t, g) for t, g in zip(threadgroup, grid)]
    if block[2] != 1:
        raise ValueError(f"the emulator runs blocks of at most two dimensions, not {threadgroup}")
    blocks = [-(-g // t) for g, t in zip(grid, block)]
    fn(ptrs, *[ctypes.c_int(v) for v in blocks + block[:2]])
    return [_to_mx(a, d) for a, d in zip(outputs, dtypes)]
