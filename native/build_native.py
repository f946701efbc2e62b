"""Build the CPU fast paths into the running environment's site-packages
(``make install`` runs it; ``docs/BACKENDS.md`` describes each):

- ``libmtp_cpu_blas.so`` from `cpu_blas.c` and `few_rows.c`: MLX's CPU sgemm
  routed to a few-row kernel and OpenBLAS (`mtp_engine.kernels.cpu_blas`);
- ``_mtp_cpu_recurrence`` from `cpu_recurrence.cpp`: the gated-delta
  recurrence over T tokens as one MLX CPU primitive
  (`mtp_engine.kernels.cpu_recurrence`);
- ``_mtp_cpp_drafter`` from `cpp_drafter.cpp` and `few_rows.c`: the MTP
  head's draft steps in C++ (`mtp_engine.drafters.cpp_head`);
- ``_mtp_cpu_activations`` from `cpu_activations.cpp`: MLX's float32
  sigmoid, SiLU and softmax, vectorized, bit for bit
  (`mtp_engine.kernels.cpu_activations`).

    python native/build_native.py [NAME ...]

Needs a C/C++20 compiler; the extensions also need MLX's headers and
``libmlx.so`` (the mlx wheel ships them) and nanobind at the ABI MLX's Python
module was built with, and the BLAS library the scipy-openblas32 wheel (the
``cpu`` extra pins both). Exits 1 with the reason when something cannot be
built; the engine then runs the MLX code it replaces and says so at start.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLAS_LIBRARY = "libmtp_cpu_blas.so"

# module: (sources, extra C++ flags, what it is). The recurrence, activations
# and BLAS routes must round exactly as MLX's own CPU ops, which never fuse a
# multiply-add: -ffp-contract=off, so -march=native's FMA cannot fuse them
# either. Drafts need not be bit-exact.
MODULES = {
    "_mtp_cpu_recurrence": (["cpu_recurrence.cpp"], ["-march=native", "-ffp-contract=off"],
                            "the gated-delta recurrence as one MLX CPU primitive"),
    "_mtp_cpp_drafter": (["cpp_drafter.cpp", "few_rows.c"], ["-march=native"], "the MTP head's draft steps in C++"),
    # -fno-trapping-math -fno-math-errno let GCC vectorize the loop (floor, fma and
    # the selects); neither changes a result (no FP traps or errno are read).
    "_mtp_cpu_activations": (["cpu_activations.cpp"],
                             ["-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"],
                             "MLX's float32 sigmoid, SiLU and softmax, vectorized"),
}
TARGETS = ("cpu_blas", *MODULES)


def site_dir() -> Path:
    return Path(sysconfig.get_paths()["platlib"])


def _run(steps: list[list[str]], name: str, target: Path) -> bool:
    for cmd in steps:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"note: cannot build {name} ({shlex.join(cmd[:1])} failed):\n{result.stderr[-2000:]}")
            target.unlink(missing_ok=True)
            return False
    return True


def build_cpu_blas() -> bool:
    """The BLAS route: a plain shared library (no Python module)."""
    target = site_dir() / BLAS_LIBRARY
    try:
        import scipy_openblas32
    except ImportError as e:
        print(f"note: cannot build {BLAS_LIBRARY}: {e}")
        return False
    lib = scipy_openblas32.get_lib_dir()
    cmd = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC",
           str(HERE / "cpu_blas.c"), str(HERE / "few_rows.c"), "-o", str(target),
           f"-L{lib}", "-lscipy_openblas", f"-Wl,-rpath,{lib}", "-ldl"]
    if not _run([cmd], BLAS_LIBRARY, target):
        return False
    print(f"built {target} (MLX's CPU sgemm -> few-row kernel and OpenBLAS)")
    return True


def build(name: str, sources: list[str], flags: list[str], what: str, mlx_dir: Path, nb_dir: Path) -> bool:
    out_dir = site_dir()
    target = out_dir / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    objects, steps = [], []
    for source in sources:
        if source.endswith(".c"):
            obj = out_dir / f"{name}-{Path(source).stem}.o"
            steps.append([os.environ.get("CC", "cc"), "-O3", "-march=native", "-ffp-contract=off", "-fPIC",
                          "-c", str(HERE / source), "-o", str(obj)])
            objects.append(str(obj))
    steps.append([
        os.environ.get("CXX", "c++"), "-O3", *flags, "-std=c++20", "-shared", "-fPIC",
        "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx",  # MLX's bindings live in nanobind's "mlx" domain
        f"-I{HERE}", f"-I{mlx_dir / 'include'}", f"-I{nb_dir / 'include'}",
        f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
        *[str(HERE / s) for s in sources if not s.endswith(".c")], *objects, str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o", str(target),
    ])
    try:
        ok = _run(steps, name, target)
    finally:
        for obj in objects:
            Path(obj).unlink(missing_ok=True)
    if ok:
        print(f"built {target} ({what})")
    return ok


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print(f"error: unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
        return 2
    ok = []
    if "cpu_blas" in names:
        ok.append(build_cpu_blas())
    modules = [n for n in names if n in MODULES]
    if modules:
        try:
            import mlx
            import nanobind
        except ImportError as e:
            print(f"note: cannot build {', '.join(modules)}: {e}")
            return 1
        mlx_dir = Path(mlx.__path__[0])
        nb_dir = Path(nanobind.__file__).parent
        if not (mlx_dir / "include" / "mlx" / "primitives.h").exists() or not (mlx_dir / "lib").is_dir():
            print(f"note: cannot build {', '.join(modules)}: no MLX headers or libmlx under {mlx_dir}")
            return 1
        ok += [build(n, *MODULES[n], mlx_dir, nb_dir) for n in modules]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
