# Entry points. `make test` and `make generate` build .venv first when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# MLX backend on Linux: cpu (default) or cuda. macOS gets Metal from plain mlx.
MLX_BACKEND ?= cpu
ifeq ($(shell uname -s),Darwin)
EXTRAS := dev
else
EXTRAS := $(MLX_BACKEND),dev
endif

MODEL ?= models/qwen3-next-tiny-stdlib
DATASET ?=
OUT ?= out/$(basename $(notdir $(DATASET)))
ARGS ?=
NP ?= 1
PYTEST_ARGS ?=

# Linux CPU: MLX's wheel links the reference (netlib) BLAS. native/cblas_openblas.c
# routes MLX's sgemm to OpenBLAS (the scipy-openblas32 wheel) when LD_PRELOADed,
# and products of few rows to its own kernel (native/few_rows.c);
# `make install` builds it when a C compiler is present, `make generate` and
# `make bench` use it when it exists. `make test` runs on MLX's own BLAS, and
# tests/mtp_engine/test_cpu_blas.py re-runs the bit-exact checkpoint tests and a
# lossless check under the shim.
CBLAS_SHIM := $(VENV)/lib/libmtp_cblas.so
ifeq ($(shell uname -s)-$(MLX_BACKEND),Linux-cpu)
SHIM_TARGET := $(CBLAS_SHIM)
endif
WITH_SHIM = env $$(test -f $(CBLAS_SHIM) && echo LD_PRELOAD=$(abspath $(CBLAS_SHIM)))

.PHONY: install test generate bench clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# -march=native: the library is built on the machine that runs it (into .venv).
$(CBLAS_SHIM): native/cblas_openblas.c native/few_rows.c native/few_rows.h $(VENV)/.installed
	@lib=$$($(PY) -c "import scipy_openblas32 as o; print(o.get_lib_dir())") && \
	  $${CC:-cc} -O3 -march=native -ffp-contract=off -shared -fPIC native/cblas_openblas.c native/few_rows.c \
	    -o $@ -L$$lib -lscipy_openblas -Wl,-rpath,$$lib && \
	  echo "built $@ (MLX's CPU sgemm -> OpenBLAS)" || \
	  { rm -f $@; echo "note: could not build $@ (no C compiler?); MLX keeps its reference BLAS"; }

# Linux CPU: native/build_native.py builds three extensions into .venv:
# native/gdn_tokens.cpp, the gated-delta recurrence over T tokens as one MLX
# primitive (mtp_engine/cpu_recurrence.py), native/draft_head.cpp, the MTP
# head's draft steps in C++ (mtp_engine/cpu_drafter.py), and
# native/activations.cpp, MLX's float32 SiLU and softmax vectorized
# (mtp_engine/cpu_activations.py). Without them the engine runs the MLX ops
# they replace.
GDN_STAMP := $(VENV)/.native-built
ifeq ($(shell uname -s)-$(MLX_BACKEND),Linux-cpu)
SHIM_TARGET += $(GDN_STAMP)
endif

$(GDN_STAMP): native/gdn_tokens.cpp native/draft_head.cpp native/activations.cpp native/few_rows.c native/few_rows.h \
		native/build_native.py $(VENV)/.installed
	@$(PY) native/build_native.py; touch $@

install: $(VENV)/.installed $(SHIM_TARGET)

test: $(VENV)/.installed $(SHIM_TARGET)
	$(PY) -m pytest $(PYTEST_ARGS)

generate: $(VENV)/.installed $(SHIM_TARGET)
	@test -n "$(DATASET)" || { echo "usage: make generate DATASET=path [MODEL=dir] [OUT=dir] [ARGS=\"...\"] [NP=n]"; exit 2; }
ifeq ($(NP),1)
	$(WITH_SHIM) $(PY) -m jobs generate --dataset "$(DATASET)" --model "$(MODEL)" --output "$(OUT)" $(ARGS)
else
	$(WITH_SHIM) $(VENV)/bin/mlx.launch --backend ring -n $(NP) -- $(abspath $(PY)) -m jobs generate --dataset "$(DATASET)" --model "$(MODEL)" --output "$(OUT)" $(ARGS)
endif

bench: $(VENV)/.installed $(SHIM_TARGET)
	$(WITH_SHIM) $(PY) -m mtp_engine.bench $(ARGS)

clean-venv:
	rm -rf $(VENV)
