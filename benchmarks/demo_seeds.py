"""The demo's verdicts over seeds: ``PYTHONPATH=src python3 benchmarks/demo_seeds.py [SEEDS] > OUT.txt``.

Runs the five CPU runs of ``gradscaler demo`` (``gradscaler.tools.demo.CPU``) for each seed and
prints, per seed, the final losses, each run's gap to the fp32 loss, the verdicts and whether all four
hold: fp16 without scaling lags by more than the tolerance, fp16 + gradscaler and fp16 parameters +
master weights end within it, fp16 parameters without masters diverge. Run it once natively and once
with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (float16 kernels that round differently);
the header says which.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time

import torch

from gradscaler.tools import demo


def holds(runs: list[dict]) -> dict[str, bool]:
    """The four claims of the demo's verdicts, read from the numbers."""
    by_name = {r["run"]: r for r in runs}
    fp32 = by_name["fp32"]["final_loss"]

    def gap(name: str) -> float:
        return (by_name[name]["final_loss"] - fp32) / fp32

    plain = by_name[demo.NO_MASTERS]
    return {
        "no scaling lags": gap("fp16, no scaling") > demo.LOSS_TOLERANCE,
        "gradscaler within": abs(gap(demo.SCALED)) <= demo.LOSS_TOLERANCE,
        "masters within": abs(gap(demo.MASTERS)) <= demo.LOSS_TOLERANCE,
        "no masters diverge": not all(math.isfinite(loss) for loss in plain["losses"]),
    }


def main(seeds: list[int]) -> int:
    setup = demo.CPU
    print(f"# gradscaler demo, CPU setup {setup}, seeds {seeds}")
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, "
        f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')} "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}"
    )
    print("| seed | fp32 | fp16, no scaling | fp16 + gradscaler | fp16 params + masters | no masters | all hold | s |")
    print("|---|---|---|---|---|---|---|---|")
    every = True
    for seed in seeds:
        begin = time.perf_counter()
        batches = demo.Batches(demo.corpus(seed), setup.batch, setup.context, seed, torch.device("cpu"))
        runs = [demo.train(name, setup, batches, seed, progress=False) for name in demo.RUNS]
        fp32 = runs[0]["final_loss"]
        cells = [f"{fp32:.3f}"] + [
            f"{r['final_loss']:.3f} ({100 * (r['final_loss'] - fp32) / fp32:+.1f}%)" for r in runs[1:]
        ]
        claims = holds(runs)
        every &= all(claims.values())
        verdict = "yes" if all(claims.values()) else "NO: " + ", ".join(k for k, v in claims.items() if not v)
        print(f"| {seed} | {' | '.join(cells)} | {verdict} | {time.perf_counter() - begin:.0f} |", flush=True)
    print(f"\nall seeds hold every verdict: {'yes' if every else 'NO'}")
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main([int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 1, 2, 3]))
