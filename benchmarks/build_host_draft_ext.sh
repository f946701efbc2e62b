#!/usr/bin/env bash
# Build _mtp_draft (native/draft_head.cpp + native/few_rows.c) for the H200
# machine: Python 3.12 and MLX's CUDA wheel, into .gpu-stage/b/ext, which
# travels with the second staging call (`benchmarks/h200.sh host-drafts`
# copies it into /root/site). Run after ../shared/gpu/stage-mlx-cuda.sh.
#
# Needs a Python 3.12 with its headers here (PY312, default pyenv's 3.12.1)
# and the venv's nanobind (the ABI MLX 0.32 was built with). x86-64-v3
# (AVX2, FMA) rather than -march=native: it runs on another machine's CPU.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
py312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
pyinc=$("$py312" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
nb=$(.venv/bin/python -c "import nanobind, os; print(os.path.dirname(nanobind.__file__))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat .gpu-stage/a/part.aa .gpu-stage/b/part.ab > "$tmp/cuda.whl"
(cd "$tmp" && python3 -c "
import zipfile
z = zipfile.ZipFile('cuda.whl')
for n in z.namelist():
    if n.startswith(('mlx/include/', 'mlx/lib/')):
        z.extract(n, '.')
")
mkdir -p .gpu-stage/b/ext
cc -O3 -march=x86-64-v3 -ffp-contract=off -fPIC -c native/few_rows.c -o "$tmp/few_rows.o"
c++ -O3 -march=x86-64-v3 -std=c++20 -shared -fPIC -fvisibility=hidden -DNDEBUG -DNB_DOMAIN=mlx \
  -Inative -I"$tmp/mlx/include" -I"$nb/include" -I"$nb/ext/robin_map/include" -I"$pyinc" \
  native/draft_head.cpp "$tmp/few_rows.o" "$nb/src/nb_combined.cpp" \
  -L"$tmp/mlx/lib" -lmlx -Wl,--allow-shlib-undefined -Wl,-rpath,'$ORIGIN/mlx/lib' \
  -o .gpu-stage/b/ext/_mtp_draft.cpython-312-x86_64-linux-gnu.so
ls -la .gpu-stage/b/ext
