# Quick start:   make train   (set up, then pre-train the tiny preset on the built-in corpus with EP=2)
#                make test    (set up, then run the test suite; `make test-all` adds the tests marked slow)
#
# Setup installs into .venv. torch is pinned to 2.13.0 on purpose: on CPU-only machines (and CI) that is the CPU
# wheel, while an unpinned `torch` pulls a multi-GB CUDA build. On a GPU machine use e.g. `make train TORCH=torch`.
#
# On a machine that already has PyTorch and the packages of pyproject.toml (a GPU image, no registry):
#                make gpu-train   /   make gpu-test
# run the code from src/ with that machine's own python3 (SYS_PY) and install nothing.
#
# `make test-torch211` runs the suite again on the oldest supported stack, torch 2.11 (the GPU image's) on
# Python 3.12 where this machine has it, in .cache/venv-torch211; CI runs it after `make test`.
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SYS_PY ?= python3
# The packages moetrain imports at run time (pyproject.toml's dependencies); gpu-test also needs pytest.
RUNTIME_MODULES := torch numpy safetensors tokenizers pyarrow tensorboard matplotlib rich
TORCH211 ?= torch==2.11.0
VENV211 := .cache/venv-torch211
# Python 3.12 (the GPU image's) for the torch 2.11 pass: python3.12 on the PATH, or pyenv's newest 3.12; else $(PY).
PYENV312 := $(shell pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$$' | tail -1)
PY211 ?= $(shell python3.12 --version >/dev/null 2>&1 && echo python3.12 || \
                 { [ -n "$(PYENV312)" ] && echo "env PYENV_VERSION=$(PYENV312) python3.12"; } || echo $(PY))
# Benchmark peers (only `make bench` installs them): TorchTitan into the venv (it does not depend on torch, so the
# pinned torch stays; nothing in src or tests imports it); triton, which TorchTitan's MoE module imports
# unconditionally but moetrain never needs, into a separate directory that only the TorchTitan benchmark processes
# put on sys.path, so no moetrain or test process ever imports a triton.
PEERS_STAMP := .cache/bench-peers/.installed
ARGS ?=
# The default suite leaves out the tests marked slow (larger process counts of checks the suite already runs at
# smaller ones), to stay within CI's time; `make test-all` runs them too.
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup train test test-all test-torch211 gpu-check-env gpu-train gpu-test bench clean

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

$(VENV211)/.installed: pyproject.toml
	$(PY211) -m venv $(VENV211)
	$(VENV211)/bin/python -m pip install -q "$(TORCH211)"
	$(VENV211)/bin/python -m pip install -q -e ".[dev]"
	touch $@

test-torch211: $(VENV211)/.installed
	$(VENV211)/bin/python -c "import sys, torch; print('torch', torch.__version__, 'on Python', sys.version.split()[0])"
	$(VENV211)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# One line, and a non-zero exit, when SYS_PY lacks a package moetrain needs (nothing is installed here).
gpu-check-env:
	@$(SYS_PY) -c "import importlib.util as u, sys; m = [n for n in sys.argv[1:] if u.find_spec(n) is None]; \
	sys.exit('$(SYS_PY) lacks ' + ', '.join(m) + ': carry them as wheels (pip download elsewhere, pip install --no-index here)' \
	if m else 0)" $(RUNTIME_MODULES) $(EXTRA_MODULES)

gpu-train:
	@$(MAKE) --no-print-directory gpu-check-env
	PYTHONPATH=src $(SYS_PY) -m moetrain train $(ARGS)

# The suite is CI's: gloo processes checked against one CPU process, so it runs with the GPUs hidden (a test that
# launches 2 workers would otherwise need 2 GPUs); what only a GPU shows is benchmarks/gpu_check.py's.
gpu-test:
	@$(MAKE) --no-print-directory gpu-check-env EXTRA_MODULES=pytest
	CUDA_VISIBLE_DEVICES= PYTHONPATH=src $(SYS_PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

$(PEERS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q "torchtitan==0.3.0"
	$(BIN)/python -m pip install -q --no-deps --target .cache/bench-peers "triton==3.9.0"
	touch $(PEERS_STAMP)

bench: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .cache runs
