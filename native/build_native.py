"""Build the CPU extensions into the running environment's site-packages:

- ``_mtp_gdn`` from `native/gdn_tokens.cpp`: one MLX CPU primitive for the
  gated-delta recurrence over T tokens (`mtp_engine.cpu_recurrence`);
- ``_mtp_draft`` from `native/draft_head.cpp` and `native/few_rows.c`: the
  MTP head's draft steps in plain C++ (`mtp_engine.cpu_drafter`);
- ``_mtp_act`` from `native/activations.cpp`: MLX's float32 sigmoid, SiLU and
  softmax, vectorized, bit for bit (`mtp_engine.cpu_activations`).

    python native/build_native.py        # `make install` runs it

Needs a C++20 compiler, MLX's headers and ``libmlx.so`` (the mlx wheel ships
them) and nanobind at the ABI MLX's Python module was built with (the ``cpu``
extra pins it). Exits 1 with the reason when a module cannot be built; the
engine then runs the MLX ops it replaces.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent

# module: (sources, extra C++ flags, what it is). _mtp_gdn must round exactly
# as MLX's own CPU ops, which never fuse a multiply-add: -ffp-contract=off, so
# -march=native's FMA cannot fuse them either; nor _mtp_act's. Drafts need not be bit-exact.
MODULES = {
    "_mtp_gdn": (["gdn_tokens.cpp"], ["-march=native", "-ffp-contract=off"],
                 "the gated-delta recurrence as one MLX CPU primitive"),
    "_mtp_draft": (["draft_head.cpp", "few_rows.c"], ["-march=native"], "the MTP head's draft steps in C++"),
    # -fno-trapping-math -fno-math-errno let GCC vectorize the loop (floor, fma and
    # the selects); neither changes a result (no FP traps or errno are read).
    "_mtp_act": (["activations.cpp"], ["-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"],
                 "MLX's float32 sigmoid, SiLU and softmax, vectorized"),
}


def build(name: str, sources: list[str], flags: list[str], what: str, mlx_dir: Path, nb_dir: Path) -> bool:
    target = Path(sysconfig.get_paths()["platlib"]) / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    out_dir = Path(sysconfig.get_paths()["platlib"])
    objects, steps = [], []
    for source in sources:
        if source.endswith(".c"):
            # -march=native: built on the machine that runs it (into the venv).
            obj = out_dir / f"{name}-{Path(source).stem}.o"
            steps.append([os.environ.get("CC", "cc"), "-O3", "-march=native", "-ffp-contract=off", "-fPIC",
                          "-c", str(HERE / source), "-o", str(obj)])
            objects.append(str(obj))
    link = [
        os.environ.get("CXX", "c++"), "-O3", *flags, "-std=c++20", "-shared", "-fPIC",
        "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx",  # MLX's bindings live in nanobind's "mlx" domain
        f"-I{HERE}", f"-I{mlx_dir / 'include'}", f"-I{nb_dir / 'include'}",
        f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
        *[str(HERE / s) for s in sources if not s.endswith(".c")], *objects, str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o", str(target),
    ]
    steps.append(link)
    try:
        for cmd in steps:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                print(f"note: cannot build {name} ({shlex.join(cmd[:1])} failed):\n{result.stderr[-2000:]}")
                target.unlink(missing_ok=True)
                return False
    finally:
        for obj in objects:
            Path(obj).unlink(missing_ok=True)
    print(f"built {target} ({what})")
    return True


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"error: unknown module {unknown[0]!r}; choose from {', '.join(MODULES)}")
        return 2
    try:
        import mlx
        import nanobind
    except ImportError as e:
        print(f"note: cannot build {', '.join(names)}: {e}")
        return 1
    mlx_dir = Path(mlx.__path__[0])
    nb_dir = Path(nanobind.__file__).parent
    if not (mlx_dir / "include" / "mlx" / "primitives.h").exists() or not (mlx_dir / "lib").is_dir():
        print(f"note: cannot build {', '.join(names)}: no MLX headers or libmlx under {mlx_dir}")
        return 1
    ok = [build(n, *MODULES[n], mlx_dir, nb_dir) for n in names]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
