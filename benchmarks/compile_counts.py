"""What Dynamo makes of a whole training step compiled with torch's scaler and with gradscaler: graph
breaks per step (where, and why) and recompiles over 200 steps, for every loop shape of
``gradscaler.tools.compiled_step``. Counts, not times (docs/migration.md, "torch.compile", quotes
this table; ``gradscaler bench --sections compile`` times the same steps).

    python benchmarks/compile_counts.py [--steps 200]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from gradscaler.tools.compiled_step import SHAPES, breaks, build, drive, inputs, recompiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, backend aot_eager (Dynamo's breaks and guards are the backend's input)")
    print()
    print(
        "| loop shape | breaks per step: torch / gradscaler | in gradscaler's code | recompiles: torch / gradscaler |"
    )
    print("|---|---|---|---|")
    reasons: Counter[str] = Counter()
    for shape in SHAPES:
        counted, recompiled = {}, {}
        for ours in (False, True):
            torch._dynamo.reset()
            found = breaks(build(shape, ours), inputs(2))
            counted[ours] = found
            if ours:
                reasons.update(b.reason for b in found)
            torch._dynamo.reset()
            with recompiles() as messages:
                drive(build(shape, ours), inputs(args.steps), "aot_eager")
            recompiled[ours] = len(messages)
        inside = sum(b.in_library for b in counted[True])
        print(
            f"| {shape.name} | {len(counted[False])} / {len(counted[True])} | {inside} "
            f"| {recompiled[False]} / {recompiled[True]} |"
        )
    print()
    print("gradscaler's breaks by Dynamo's reason, over all shapes:")
    for reason, count in reasons.most_common():
        print(f"  {count:3d}  {reason}")


if __name__ == "__main__":
    main()
