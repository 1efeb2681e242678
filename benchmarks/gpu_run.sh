#!/usr/bin/env bash
# One call on the GPU machine: the CUDA tests, the kernel tests on the GPU, then the benchmark.
# Usage (repository root): bash benchmarks/gpu_run.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp/gradscaler-gpu}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
GRADSCALER_REQUIRE_CUDA=1 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_cuda.py tests/test_kernels.py tests/test_differential.py -x -k "not transformer" \
    2>&1 | tee "$out/tests.log" | tail -25
python3 benchmarks/tune_kernel.py 2>&1 | tee "$out/tune.txt"
python3 -m gradscaler bench --steps "${BENCH_STEPS:-40}" --warmup 5 --out "$out/bench.json" 2>&1 | tee "$out/bench.txt"
# The matrix (issue 12): shapes x optimizers x clip with host time, and whole iterations at batch 1.
python3 -m gradscaler bench --sections matrix --steps 11 --warmup 2 --out "$out/matrix.json" 2>&1 | tee "$out/matrix.txt"
