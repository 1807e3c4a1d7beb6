# The two set-up commands are `make install` and `make test`; `make help` lists the rest.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BENCH_ARGS ?=

.PHONY: help install test test-slow test-gpu gpu-check bench lint clean

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
	$(BIN)/python -m pytest -q -m gpu

gpu-check:  ## the GPU slot's one script (<= 8 min): gpu tier, CUDA kill+resume, sync debug, ResNet-50 pack vs raw, 2+ GPUs: bench -> bench-results/gpu-report.{json,md}; exit 1 on any failed check
	$(BIN)/python -m ddp_recipes.bench.gpucheck

bench:  ## single- vs multi-device speedup with a raw-PyTorch DDP baseline (writes bench-results/)
	$(BIN)/python -m ddp_recipes.bench $(BENCH_ARGS)

lint:  ## ruff check
	$(BIN)/ruff check ddp_recipes recipes tests examples

clean:  ## remove build and run outputs (keeps .venv)
	rm -rf build *.egg-info bench-results runs .pytest_cache
