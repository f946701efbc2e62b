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
# The suite's files spread over up to 4 processes (pytest-xdist); each file runs whole in one, so its
# module fixtures are built once.
PYTEST_ARGS ?= -n auto --maxprocesses 4 --dist loadfile

# Linux CPU: native/build_native.py builds the CPU fast paths into .venv
# (docs/BACKENDS.md). The package loads them itself; without them the engine
# runs the MLX code they replace and says so when a job starts.
NATIVE_STAMP := $(VENV)/.native-built
ifeq ($(shell uname -s)-$(MLX_BACKEND),Linux-cpu)
NATIVE_TARGET := $(NATIVE_STAMP)
endif

.PHONY: install test generate bench clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

$(NATIVE_STAMP): native/*.c native/*.cpp native/*.h native/build_native.py $(VENV)/.installed
	@$(PY) native/build_native.py; touch $@

install: $(VENV)/.installed $(NATIVE_TARGET)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

generate: install
	@test -n "$(DATASET)" || { echo "usage: make generate DATASET=path [MODEL=dir] [OUT=dir] [ARGS=\"...\"] [NP=n]"; exit 2; }
ifeq ($(NP),1)
	$(PY) -m jobs generate --dataset "$(DATASET)" --model "$(MODEL)" --output "$(OUT)" $(ARGS)
else
	$(VENV)/bin/mlx.launch --backend ring -n $(NP) -- $(abspath $(PY)) -m jobs generate --dataset "$(DATASET)" --model "$(MODEL)" --output "$(OUT)" $(ARGS)
endif

bench: install
	$(PY) -m mtp_engine.bench $(ARGS)

clean-venv:
	rm -rf $(VENV)
