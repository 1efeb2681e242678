"""The state machines run longer than CI runs them: ``python tests/masters_soak.py --examples 500``.

Runs ``masters_machine.MastersMachine`` (every rule against the recipe by hand, bit for bit), or with
``--machine scalers`` ``scalers_machine.ScalersMachine`` (several scalers over one model), for ``--examples``
sequences of up to ``--steps`` rules each, drawn from ``--seed``;
CI runs a fixed budget (tests/test_masters_machine.py).
On a broken invariant Hypothesis shrinks the sequence (``--no-shrink``: not, for a quick yes or no) and prints it
as calls (``state.rule(...)``), and the script exits non-zero; otherwise it prints how many sequences held and how
long they took. A line every 100 sequences says how far it is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from masters_machine import MastersMachine, progress
from scalers_machine import ScalersMachine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200, help="sequences to run (default 200)")
    parser.add_argument("--steps", type=int, default=60, help="rules per sequence at most (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    parser.add_argument(
        "--machine",
        choices=("masters", "scalers"),
        default="masters",
        help="masters: one scaler's master weights (default); scalers: several scalers over one model",
    )
    parser.add_argument(
        "--no-shrink",
        action="store_true",
        help="report the first failing sequence as drawn (seconds, where shrinking can take five minutes)",
    )
    args = parser.parse_args()
    budget = settings(
        max_examples=args.examples,
        stateful_step_count=args.steps,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate) if args.no_shrink else tuple(Phase),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    torch.set_num_threads(1)  # tiny tensors: two threads wait for each other at every operation on a loaded machine
    started = time.perf_counter()
    machine = ScalersMachine if args.machine == "scalers" else MastersMachine
    with progress(lambda line: print(line, flush=True), args.examples, machine=machine, name=f"{args.machine} machine"):
        run_state_machine_as_test(seed(args.seed)(machine), settings=budget)
    seconds = time.perf_counter() - started
    ran = f"{args.machine} machine, {args.examples} sequences of up to {args.steps} rules (seed {args.seed})"
    print(f"{ran}: held ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
