#!/usr/bin/env bash
# `make gpu-check`: everything that needs a CUDA device, in one call, into one folder ending with
# summary.md. Without a CUDA device it prints one line and exits 0.
#
# Usage (repository root): bash benchmarks/gpu_run.sh [OUT_DIR]
#   PYTHON       the interpreter (default python3); its torch must be a CUDA build
#   BENCH_STEPS  timed steps per bench row (default 30)
#   HOST_STEPS   timed steps per host-cost row (default 100)
#   GPU_CHECK_FULL=1  also the Triton CHUNK/BLOCK sweep and the bench matrix (several more minutes)
#   GPU_CHECK_BUDGET_S  seconds for all steps together (a lent machine's time is short): each step's
#                 limit is cut to what is left, and a step with under 20 s left is recorded as not run
#   GPU_CHECK_STEPS  the steps to run, by name ("cuda-tests accumulation": a rerun of the failed ones)
#
# Steps (each one's output in OUT_DIR/<step>.log, exit codes and seconds in OUT_DIR/steps.tsv):
#   cuda-tests    every test marked cuda, which must run, not skip (GRADSCALER_REQUIRE_CUDA=1):
#                 tests/test_cuda.py (bit-identity with torch, no syncs, whole-step CUDA graph capture
#                 and replay) and tests/test_cuda_kernels.py (kernels against torch's path bit for bit
#                 on GPU memory, the fallback, the telemetry's pinned mirrors and events) and
#                 tests/test_cuda_masters.py (masters and float32 sums against the recipe by hand)
#   gpu-tests     the kernel, move, fallback and differential suites with their tensors on the GPU
#   bench         gradscaler bench: kernel, step, iteration, masters and memory sections
#   accumulation  gradscaler bench --sections accumulation: accumulate_grads_in_fp32's precision (1 M
#                 values), the bfloat16 training gap, bytes per parameter and time per micro-batch
#   host          gradscaler bench --sections host: each loop shape's host cost per step on the GPU, launches
#                 and thread time per phase, ours against torch's scaler (issue 44's target: ratio <= 1.00),
#                 on the scaler's own route and again with torch's ops for its passes (no Triton)
#   demo          gradscaler demo --device cuda
#   compile       gradscaler bench --sections compile: eager, compiled model, compiled step and compiled
#                 step with mode="reduce-overhead" (CUDA graphs), torch's scaler against ours
set -uo pipefail
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    version=$("$py" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not importable")
    triton=$("$py" -c "import triton; print(triton.__version__)" 2>/dev/null || echo "not installed")
    echo "gpu-check: skipped, no CUDA device visible to $py (torch $version, triton $triton)"
    exit 0
fi
out=${1:-${OUT:-benchmarks/results/gpu-check-$(date -u +%Y-%m-%d)}}
mkdir -p "$out"
: >"$out/steps.tsv"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

budget_end=$((SECONDS + ${GPU_CHECK_BUDGET_S:-100000}))
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log it, record its exit code and duration
    local name=$1 limit=$2
    shift 2
    case " ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
    local start=$SECONDS left=$((budget_end - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: not run, GPU_CHECK_BUDGET_S spent"
        printf '%s\t%s\t%s\n' "$name" "not-run" 0 >>"$out/steps.tsv"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name: $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$out/steps.tsv"
    tail -n 3 "$out/$name.log"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
    # Which Triton compiled the kernels (or that none did: the scaler then runs torch's ops throughout).
    "$py" -c "
import torch
try:
    import triton
    version = triton.__version__
except ImportError:
    version = 'not installed (the kernels cannot run: torch ops throughout)'
print('torch', torch.__version__, '| triton', version)"
    echo "commit $(git describe --always --dirty 2>/dev/null || echo unknown)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

pytest_args=(-q -p no:cacheprovider -o addopts="-ra --strict-markers")
step cuda-tests 300 env GRADSCALER_REQUIRE_CUDA=1 "$py" -m pytest "${pytest_args[@]}" -m cuda \
    --junitxml="$out/cuda-tests.xml"
step gpu-tests 300 "$py" -m pytest "${pytest_args[@]}" tests/test_kernels.py tests/test_move_kernel.py \
    tests/test_kernel_fallback.py tests/test_differential.py -k "not transformer" --junitxml="$out/gpu-tests.xml"
step bench 300 "$py" -m gradscaler bench --device cuda --sections kernel,step,iteration,masters,memory \
    --steps "${BENCH_STEPS:-30}" --warmup 5 --out "$out/bench.json"
step accumulation 300 "$py" -m gradscaler bench --device cuda --sections accumulation --steps "${BENCH_STEPS:-30}" \
    --warmup 5 --out "$out/accumulation.json"
step host 300 "$py" -m gradscaler bench --device cuda --sections host --steps "${HOST_STEPS:-100}" --warmup 5 \
    --out "$out/host.json"
step demo 300 "$py" -m gradscaler demo --device cuda --out "$out/demo" --no-progress
# last: the slowest (inductor compiles each loop shape twice), so a short budget loses it first
step compile 300 "$py" -m gradscaler bench --device cuda --sections compile --steps 20 --warmup 5 \
    --out "$out/compile.json"
if [ "${GPU_CHECK_FULL:-0}" = 1 ]; then
    step tune 600 "$py" benchmarks/tune_kernel.py
    step matrix 600 "$py" -m gradscaler bench --sections matrix --steps 11 --warmup 2 --out "$out/matrix.json"
fi
"$py" benchmarks/gpu_summary.py "$out"
