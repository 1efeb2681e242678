"""Sweep the Triton read-pass kernel's CHUNK / BLOCK / num_warps on GPT-2-medium-shaped gradients.

Run on a CUDA machine from the repository root: ``PYTHONPATH=src python3 benchmarks/tune_kernel.py``.
Prints one line per configuration (median ms of the L2 pass and the check-only pass) and the copy
ceiling, so the defaults in ``gradscaler/kernels/triton_stats.py`` can be chosen from measurements.
"""

from __future__ import annotations

import itertools
import statistics

import torch

from gradscaler.kernels import triton_stats
from gradscaler.tools.harness import gpt2_shapes, sleep_cycles


def median_ms(fn, reps: int = 40) -> float:
    """Median device time: 5 ms of GPU sleep is queued first, so the host's launch time is hidden."""
    for _ in range(5):
        fn()
    times = []
    cycles = sleep_cycles(5.0)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(s, device="cuda", generator=gen) for s in gpt2_shapes(1024, 24, 50257, 1024)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = torch.empty_like(flat)
    copy = median_ms(lambda: out.copy_(flat))
    print(f"copy {copy:.3f} ms -> ideal read {copy / 2:.3f} ms")
    # Time the kernels alone: build the tables once per configuration (cache hit afterwards).
    for chunk, block, warps in itertools.product((32768, 65536, 131072), (1024, 2048, 4096), (4, 8)):
        if block > chunk:
            continue
        triton_stats.CHUNK, triton_stats.BLOCK, triton_stats.NUM_WARPS = chunk, block, warps
        triton_stats._CACHE.clear()
        l2 = median_ms(lambda: triton_stats.grad_stats(grads, 2.0))
        check = median_ms(lambda: triton_stats.grad_stats(grads, None))
        print(
            f"chunk {chunk:6d} block {block:4d} warps {warps}: L2 {l2:.3f} ms ({copy / 2 / l2:.0%}), "
            f"check {check:.3f} ms ({copy / 2 / check:.0%})"
        )


if __name__ == "__main__":
    main()
