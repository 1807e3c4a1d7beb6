# The two set-up commands are `make install` and `make test`; `make help` lists the rest.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BENCH_ARGS ?=
# Where there is no .venv (a lent GPU machine holding only the working tree), the machine's own python3.
RUN_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
# The lent GPU machine's stack on CPU (.ci/gpu-stack.txt), built from scratch by `make test-stack`.
STACK_VENV ?= .venv-gpu-stack
STACK_PY ?= $(shell .ci/find-python 3.12)

.PHONY: help install test test-slow test-gpu test-stack gpu-check bench lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

install:  ## create .venv and install the package with its dev extras
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# Plain pip: torch/torchvision come as ordinary wheels (never uv or poetry: torch must resolve through plain pip).
	$(BIN)/pip install -e '.[dev]'

test:  ## the fast CPU suite (gloo, 2 processes); < 10 min on 2 cores
	$(BIN)/python -m pytest -q

test-slow:  ## the slow CPU tests (accuracy targets, longer runs)
	$(BIN)/python -m pytest -q -m slow

test-gpu:  ## the GPU tier: 1-GPU tests, and 2+-GPU (NCCL) tests that skip below 2 GPUs; skips cleanly on CPU
	$(RUN_PY) -m pytest -q -m gpu

test-stack: $(STACK_VENV)/.installed  ## the fast suite on the lent GPU machine's stack (Python 3.12, .ci/gpu-stack.txt), on CPU, from source
	$(STACK_VENV)/bin/python -m pip list --format=freeze | grep -iE '^(torch|torchvision|torchmetrics|lightning|numpy)=='
	# ../shared hidden, as on the lent machine (only the working tree travels): its tests skip, saying so.
	DDP_RECIPES_SHARED_DATA=none $(STACK_VENV)/bin/python -m pytest -q

# Built from scratch (about 3 GB: torch's CUDA wheels), again whenever the pins change.
$(STACK_VENV)/.installed: .ci/gpu-stack.txt
	@test -n "$(STACK_PY)" || { echo "make test-stack: no Python 3.12 (pass STACK_PY=/path/to/python3.12)" >&2; exit 2; }
	rm -rf $(STACK_VENV)
	$(STACK_PY) -m venv $(STACK_VENV)
	# Plain pip, exactly the pinned set; the pack itself is not installed: it runs from this checkout.
	$(STACK_VENV)/bin/pip install --no-input -r .ci/gpu-stack.txt
	touch $@

gpu-check:  ## the GPU slot's checks (~5 of 7 min, no install): sync-debug, ResNet-50 pack vs raw with MFU, gpu tier, CUDA kill+resume -> report + log bundle in GPU_CHECK_OUT (default: a temp dir); exit 0 pass, 1 fail, 3 incomplete, 4 no verdict
	$(RUN_PY) -m tests.gpucheck $(if $(GPU_CHECK_OUT),--out-dir $(GPU_CHECK_OUT)) $(GPU_CHECK_ARGS)

bench:  ## single- vs multi-device speedup with a raw-PyTorch DDP baseline (writes bench-results/)
	$(BIN)/python -m ddp_recipes.bench $(BENCH_ARGS)

lint:  ## ruff check
	$(BIN)/ruff check ddp_recipes recipes benchmarks tests examples

clean:  ## remove build and run outputs (keeps .venv and .venv-gpu-stack)
	rm -rf build *.egg-info bench-results runs .pytest_cache
