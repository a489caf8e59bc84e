# Quick start:   make train   (set up, then pre-train the tiny preset on the built-in corpus with EP=2)
#                make test    (set up, then run the test suite; `make test-all` adds the tests marked slow)
#
# Setup installs into .venv. torch is pinned to 2.13.0 on purpose: on CPU-only machines (and CI) that is the CPU
# wheel, while an unpinned `torch` pulls a multi-GB CUDA build. On a GPU machine use e.g. `make train TORCH=torch`.
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Benchmark peers (only `make bench` installs them): TorchTitan into the venv (it does not depend on torch, so the
# pinned torch stays; nothing in src or tests imports it); triton, which TorchTitan's MoE module imports
# unconditionally but moetrain never needs, into a separate directory that only the TorchTitan benchmark processes
# put on sys.path, so no moetrain or test process ever imports a triton.
PEERS_STAMP := .cache/bench-peers/.installed
ARGS ?=
# The default suite leaves out the tests marked slow (larger process counts of checks the suite already runs at
# smaller ones), to stay within CI's time; `make test-all` runs them too.
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup train test test-all bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/moetrain train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

$(PEERS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q "torchtitan==0.3.0"
	$(BIN)/python -m pip install -q --no-deps --target .cache/bench-peers "triton==3.9.0"
	touch $(PEERS_STAMP)

bench: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .cache runs
