"""A longer fault-injection soak than CI runs: ``python tests/soak.py --runs 40 --steps 3000``.

Each run draws an optimizer (fused or foreach AdamW/SGD), a policy, clipping on or off, a fault rate
and a starting scale from ``--seed``, then checks the invariants of ``tests/test_fault_injection.py``
every step: skips exactly where faults are (or where the scaled gradients overflowed on their own, at a
scale near float32's max), a skip changes no parameter and no optimizer state, the scale stays finite within
its bounds, and a run resumed mid-way from a ``weights_only`` checkpoint
ends bit-identical. Prints one line per run; exits non-zero on the first broken invariant.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from gradscaler.rule import SCALE_FLOOR
from test_fault_injection import POLICIES, Run, check_run, schedule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="number of runs (default 20)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run draws (default 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: two threads wait for each other at every operation on a loaded machine
    rng = random.Random(args.seed)
    total = 0
    for number in range(args.runs):
        optimizer, mode = rng.choice([("adamw", "fused"), ("adamw", "foreach"), ("sgd", "fused"), ("sgd", "foreach")])
        policy = rng.choice(list(POLICIES))
        clip = rng.choice([None, 1.0])
        rate = rng.choice([0.02, 0.1, 0.4, 0.8])
        init_scale = rng.choice([2.0**10, 2.0**24, SCALE_FLOOR])
        plan = schedule(rng.randrange(2**31), args.steps, rate=rate, burst_rate=rate / 2)
        started = time.perf_counter()
        natural = check_run(lambda: Run(optimizer, mode, POLICIES[policy], clip, init_scale), plan)  # noqa: B023
        total += args.steps
        print(
            f"run {number + 1}/{args.runs}: {optimizer}-{mode} policy={policy} clip={clip} rate={rate} "
            f"init_scale={init_scale:g}: {sum(1 for f in plan if f)} of {args.steps} steps faulted, "
            f"{natural} overflowed on their own, invariants held ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    print(f"{args.runs} runs, {total} steps: every invariant held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
