# `make demo` and `make test` each build .venv when missing, then run. `make test` type-checks the
# package (mypy, configured in pyproject.toml) and builds the docs strictly before the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: demo test docs bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch's CPU build on every machine, with a GPU or without (the suite needs none): the +cpu pin is
	# that build exactly, where a plain `torch` on Linux is a CUDA build of several GB. pip takes it from
	# a wheel directory or mirror it is configured with; where none offers it, from PyTorch's CPU index
	# (the README's install line), whose macOS build is plain $(TORCH_VERSION).
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
	    $(BIN)/pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install --quiet -e '.[torch,s3,gcs,progress,dev]'
	# torchtitan's own requirements pin fsspec<=2026.2 (through datasets), which s3fs cannot use; its
	# checkpoint manager needs only tyro (in the dev extra), its OptimizersContainer spmd_types (no requirements)
	$(BIN)/pip install --quiet --no-deps torchtitan==0.3.0 spmd_types==0.2.3
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The suite is most of all processes that start, import torch and exit. Bytecode compiled here is loaded by
# each of them, also where PYTHONDONTWRITEBYTECODE is set; pytest-xdist runs the tests on a worker per core
# (at most 4), each with its own servers, directories and ports.
test: $(STAMP)
	$(BIN)/python -m compileall -q tierfs tests examples benchmarks > /dev/null
	$(BIN)/python -m mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d $(VENV)/site
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 -n auto --maxprocesses=4 --dist worksteal

# the docs site (mkdocs, material theme, API reference from the docstrings) in site/
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d site

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ram.py
	$(BIN)/python benchmarks/bench_object.py

# one CUDA GPU, under 8 minutes: the gpu-marked tests (tests/test_gpu.py), then benchmarks/bench_gpu.py, with
# the machine's own python3 and torch: no .venv, nothing from the network (fastcrc, when missing, from the
# wheel in benchmarks/wheels/). Device, versions, logs and results go to $(GPU_CHECK_OUT). Exits 2 without
# a CUDA device, 1 when the tests or the benchmark failed (benchmarks/gpu_check.sh says more).
GPU_CHECK_OUT ?= benchmarks/results
gpu-check:
	GPU_CHECK_OUT='$(GPU_CHECK_OUT)' bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
