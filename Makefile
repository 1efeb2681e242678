# Two entry points, each doing its own set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0: from PyPI pip takes its CUDA build on Linux (about 5 GB installed, Triton 3.7.1 pinned),
# the build a GPU needs; on a machine without a GPU, TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes PyTorch's CPU build instead (a 192 MB wheel, about 1 GB installed). Any other torch:
# `make TORCH_SPEC=torch`, or your own environment: `pip install -e .[dev]`.
TORCH_SPEC ?= torch==2.13.0
# pip keeps no copy of what it downloads (the CUDA build's wheels are about 3 GB more on disk): every install
# here is a fresh machine's one-off, and a CI disk that runs short fails it (a CI run of 2026-11-30 did).
export PIP_NO_CACHE_DIR := 1
TORCH_INDEX ?=
# Two stamps in one .venv: the demo's (torch, gradscaler, matplotlib) and, on top of it, the test
# set-up's (dev tools, Triton, the frameworks the integration tests drive). `make demo` installs only
# the first; `make test` both.
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-triton-ends test-older-torch lint bench gpu-test gpu-check clean

$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[plot]"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install --quiet -e ".[dev,plot,triton,ecosystem]"
	# timm needs torchvision, which has no CPU build for torch 2.13: the tests use the timm modules
	# NativeScaler is made of, none of which imports torchvision (docs/integrations.md).
	$(BIN)/pip install --quiet --no-deps timm==1.0.31
	touch $(STAMP)

# The demo's recorded numbers (docs/demo.md) come from the float16 kernels of an x86 CPU without
# AVX-512; on every x86 CPU make demo asks for those kernels, so that it prints those numbers there too. On an
# AVX-512 machine that costs time: 181-193 s against 117-118 s unpinned, two runs each at load 10-12
# (benchmarks/results/demo-isa-cpu.txt). Elsewhere (ARM, a GPU) the variables change nothing.
DEMO_ISA := $(if $(filter x86_64 amd64,$(shell uname -m)),ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)
demo: $(DEMO_STAMP)
	$(DEMO_ISA) $(BIN)/gradscaler demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs
	$(BIN)/mypy

# One line per test file with the share of the suite done at its end, so that slow is not taken for hung.
test: $(STAMP) lint
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory test-triton-ends

# Opt-in, not part of `make test`: the soak-sized runs (about 5 minutes on 2 cores, docs/development.md). The
# tests marked slow (a 10-million-line log read in bounded memory; make test reads a million), then the two soaks
# at their defaults: tests/soak.py, 20 fault-injection runs of 2,000 steps drawn from seed 0 (make test runs 10
# of 600 steps and 8 of 240), and tests/masters_soak.py, 200 sequences of up to 60 rules of the master weights'
# state machine drawn from seed 0 (make test runs its own 600 derandomized sequences of up to 50).
test-slow: $(STAMP)
	GRADSCALER_SLOW=1 $(BIN)/python -m pytest -m slow
	$(BIN)/python tests/soak.py
	$(BIN)/python tests/masters_soak.py

# Both ends of the Triton range pyproject promises: 3.7.1, what torch 2.13's CUDA build pins (so what
# every GPU user of it runs the kernels with), and 3.9.0, the newest. .venv holds whichever pip chose
# (3.9.0 beside torch's CPU build, 3.7.1 beside its CUDA build) and the run above tested it; the other
# end is installed apart (Triton alone, in .venv/triton-VERSION) and put first on the path to compile
# the kernels for every target and run them in Triton's interpreter again: every kernel test that runs
# Triton, not the torch routes beside them (marked torch_route), which the run above tested and which no
# Triton changes.
TRITON_ENDS ?= 3.7.1 3.9.0
KERNEL_TESTS := tests/test_kernel_compile.py tests/test_kernels.py tests/test_move_kernel.py tests/test_kernel_fallback.py
test-triton-ends: $(STAMP)
	@have=$$($(BIN)/python -c "import triton; print(triton.__version__)"); \
	for v in $(TRITON_ENDS); do \
		if [ "$$v" = "$$have" ]; then echo "Triton $$v: .venv's, tested above"; continue; fi; \
		dir=$(VENV)/triton-$$v; \
		test -f $$dir/.installed || { $(BIN)/pip install --quiet --no-deps --target $$dir "triton==$$v" && touch $$dir/.installed; } || exit 1; \
		got=$$(PYTHONPATH=$$dir $(BIN)/python -c "import triton; print(triton.__version__)"); \
		test "$$got" = "$$v" || { echo "$$dir holds Triton $$got, not $$v: remove it and rerun"; exit 1; }; \
		echo "Triton $$v: the kernel tests that run Triton again ($(KERNEL_TESTS))"; \
		PYTHONPATH=$$dir $(BIN)/python -m pytest -q -p no:cacheprovider -m "not torch_route" $(KERNEL_TESTS) || exit 1; \
	done

# An older torch than .venv's, opt-in (not part of `make test`): OLDER_TORCH (default 2.11.0, the
# release the lent GPU machines run; 2.4.1 is pyproject's floor) in a venv of its own
# (.venv/torch-VERSION: PyPI's CUDA build, about 5 GB with the CUDA libraries it pulls), and the suite
# again without what needs newer releases: the kernel tests and every test of the Triton path (older
# CUDA builds pin a Triton below the kernels' tested range), the frameworks' (pinned releases that need a newer torch), DTensor's public
# API (torch 2.5), torch.compile's counts, and the bench, demo, CLI, report and docs files. Results of
# 2.11.0 and 2.4.1, and what differs there: docs/development.md, "Which torch".
OLDER_TORCH ?= 2.11.0
OLDER_VENV := $(VENV)/torch-$(OLDER_TORCH)
OLDER_LEFT_OUT := $(KERNEL_TESTS) $(wildcard tests/test_integration_*.py) tests/test_ecosystem.py \
	tests/test_masters_wrappers.py tests/test_distributed_accumulate_frameworks.py tests/test_distributed_group.py \
	tests/test_compiled.py tests/test_compiled_inductor.py tests/test_bench_accumulate.py tests/test_demo.py \
	tests/test_readme.py tests/test_cli.py tests/test_docs.py tests/test_example_distributed.py tests/test_gpu_check.py \
	$(wildcard tests/test_report*.py) tests/test_integration_logs.py
OLDER_TESTS := $(filter-out $(OLDER_LEFT_OUT),$(wildcard tests/test_*.py))
test-older-torch:
	@test -f $(OLDER_VENV)/.installed || { $(PYTHON) -m venv $(OLDER_VENV) && \
		$(OLDER_VENV)/bin/pip install --quiet "torch==$(OLDER_TORCH)" "pytest>=8" "hypothesis>=6.100" "numpy>=1.24" && \
		touch $(OLDER_VENV)/.installed; } || exit 1
	@echo "torch $$($(OLDER_VENV)/bin/python -c 'import torch; print(torch.__version__)'): $(words $(OLDER_TESTS)) test files again"
	PYTHONPATH=src $(OLDER_VENV)/bin/python -m pytest -q -p no:cacheprovider -k "not triton" $(OLDER_TESTS)

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
