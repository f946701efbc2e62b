"""Build `native/gdn_tokens.cpp` into the running environment's site-packages
as ``_mtp_gdn`` (an MLX C++ extension: one CPU primitive for the gated-delta
recurrence over T tokens; see `mtp_engine.cpu_recurrence`).

    python native/build_gdn.py        # `make install` runs it

Needs a C++20 compiler, MLX's headers and ``libmlx.so`` (the mlx wheel ships
them) and nanobind at the ABI MLX's Python module was built with (the ``cpu``
extra pins it). Exits 1 with the reason when it cannot build; the engine then
runs mlx-lm's recurrence ops.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        import mlx
        import nanobind
    except ImportError as e:
        print(f"note: cannot build _mtp_gdn: {e}")
        return 1
    mlx_dir = Path(mlx.__path__[0])
    nb_dir = Path(nanobind.__file__).parent
    source = Path(__file__).with_name("gdn_tokens.cpp")
    target = Path(sysconfig.get_paths()["platlib"]) / ("_mtp_gdn" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not (mlx_dir / "include" / "mlx" / "primitives.h").exists() or not (mlx_dir / "lib").is_dir():
        print(f"note: cannot build _mtp_gdn: no MLX headers or libmlx under {mlx_dir}")
        return 1
    cmd = [
        os.environ.get("CXX", "c++"), "-O3", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
        "-DNDEBUG", "-DNB_DOMAIN=mlx",  # MLX's bindings live in nanobind's "mlx" domain
        f"-I{mlx_dir / 'include'}", f"-I{nb_dir / 'include'}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(source), str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o", str(target),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"note: cannot build _mtp_gdn ({shlex.join(cmd[:1])} failed):\n{result.stderr[-2000:]}")
        target.unlink(missing_ok=True)
        return 1
    print(f"built {target} (the gated-delta recurrence as one MLX CPU primitive)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
