# `make demo` and `make test` each build .venv when missing, then run. `make test` type-checks the
# package (mypy, configured in pyproject.toml) before the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU wheel pinned on purpose: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[torch,s3,gcs,progress,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ram.py
	$(BIN)/python benchmarks/bench_object.py

clean:
	rm -rf $(VENV) build *.egg-info
