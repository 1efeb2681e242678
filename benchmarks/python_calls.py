"""Python calls per step of every loop shape of ``gradscaler bench --sections host``, torch's scaler (for float16
parameters: the recipe by hand) against gradscaler, each with its whole step (loss, backward, the phases). Counts,
not times: the host work outside the ATen ops a step dispatches, which the bench's CPU time measures with its
noise, counted exactly (``bench_host.python_calls``: each Python function call and each call of a C function from
Python, as ``cProfile`` records them; one costs about 0.05-0.5 us). tests/test_bench_host.py holds two rows, each
counted in a process of its own (what a process has run before, a compile, adds calls to both scalers).

    PYTHONPATH=src python benchmarks/python_calls.py [--steps 32]
"""

from __future__ import annotations

import argparse

import torch

from gradscaler.record.telemetry import RECORDS_PER_COPY
from gradscaler.tools.bench_host import SHAPES, python_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2 * RECORDS_PER_COPY, help="steps counted, after 20")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, the route CUDA takes (GRADSCALER_KERNEL=generic), {args.steps} steps counted")
    print()
    print("| shape | Python calls per step: torch / gradscaler | difference |")
    print("|---|---|---|")
    for shape in SHAPES:
        theirs, ours = (python_calls(shape, ours, args.steps) for ours in (False, True))
        print(f"| {shape.name} | {theirs:.0f} / {ours:.0f} | {ours - theirs:+.0f} |")


if __name__ == "__main__":
    main()
