# Two entry points, each doing its own set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on disk on these machines; with a GPU, install torch your usual way
# first (e.g. `make TORCH_SPEC=torch`) or in your own environment: `pip install -e .[dev]`.
TORCH_SPEC ?= torch==2.13.0
# Two stamps in one .venv: the demo's (torch, gradscaler, matplotlib) and, on top of it, the test
# set-up's (dev tools, Triton, the frameworks the integration tests drive). `make demo` installs only
# the first; `make test` both.
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench gpu-test gpu-check clean

$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[plot]"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install --quiet -e ".[dev,plot,triton,ecosystem]"
	# timm needs torchvision, which has no CPU build for torch 2.13: the tests use the timm modules
	# NativeScaler is made of, none of which imports torchvision (docs/integrations.md).
	$(BIN)/pip install --quiet --no-deps timm==1.0.31
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/gradscaler demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs
	$(BIN)/mypy

# One line per test file with the share of the suite done at its end, so that slow is not taken for hung.
test: $(STAMP) lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/gradscaler bench

# On a CUDA machine: the CUDA-marked tests must run, not skip.
gpu-test: $(STAMP)
	GRADSCALER_REQUIRE_CUDA=1 $(BIN)/python -m pytest -q -m cuda

# On a CUDA machine: everything that needs a GPU into one folder ending with summary.md (under 10
# minutes on one H100; benchmarks/gpu_run.sh lists the steps). Without a CUDA device: one line, exit 0.
# Runs .venv's python when there is one, else python3 (GPU_PYTHON=... picks another: its torch must
# be a CUDA build); GPU_CHECK_OUT picks the folder (default benchmarks/results/gpu-check-DATE).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	@PYTHON="$(GPU_PYTHON)" bash benchmarks/gpu_run.sh $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
