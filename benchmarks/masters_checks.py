"""What the master weights' per-step checks cost the host: each masters shape of ``gradscaler bench --sections host``
run twice against the recipe by hand, as shipped and with the move's checks replaced by the answers they give in a
steady loop. A measurement only, never a mode: the checks guard tested cases (docs/architecture.md, "Master
weights: what the checks cost"), and a run without them is correct only while nothing they look for happens.

The checks replaced (``WITHOUT``): the distributed-checkpoint guard, the optimizer's binding (its param groups read
for new or loaded parameters), the clipping route, the written-parameter check (version counters and storages),
the one-batch check (types, layouts, contiguity, one device and dtype) and the routes' opening and closing. What
remains over the recipe is the rest of a scaler's step: its records, the telemetry, the flag's reduction, its
wrappers, and with the scaler's clip the choice of one joint norm pass (the optimizer's other parameters read).

    PYTHONPATH=src python benchmarks/masters_checks.py [--steps 600] [--shapes "mlp adamw + masters"]
"""

from __future__ import annotations

import argparse
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradscaler.masters import checkpoint, lifecycle, pairs
from gradscaler.tools.bench_host import SHAPES, measure


def _cached_bind(bind: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``MasterWeights._bind`` that binds each optimizer once and then returns its binding unread."""
    bound: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def cached(self: Any, optimizer: Any) -> Any:
        binding = bound.get(optimizer)
        if binding is None:
            binding = bound[optimizer] = bind(self, optimizer)
        return binding

    return cached


WITHOUT: list[tuple[Any, str, Callable[[Any], Any]]] = [
    # (owner, name, the stand-in made from what it replaces): each name must exist, or nothing would be replaced
    (checkpoint, "guard_dcp", lambda _: lambda: None),
    (lifecycle.MasterWeights, "_bind", _cached_bind),
    (lifecycle, "route_clipping", lambda _: lambda: None),
    (pairs.Binding, "written", lambda _: lambda self: []),
    (lifecycle, "one_batch", lambda _: lambda moving: True),
    (lifecycle, "open_routes", lambda _: lambda opened, every, keys, lows, checked: checked),
    (lifecycle, "close_routes", lambda _: lambda keys: None),  # none was opened
]


@contextlib.contextmanager
def without_checks() -> Iterator[None]:
    """The checks of ``WITHOUT`` replaced, and put back on the way out."""
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in WITHOUT]  # a KeyError names a check gone
    try:
        for owner, name, stand_in in WITHOUT:
            setattr(owner, name, stand_in(getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps timed per run (default 600)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: every masters shape)")
    args = parser.parse_args()
    masters = [s.name for s in SHAPES if s.masters]
    names = args.shapes.split(",") if args.shapes else masters
    shapes = {s.name: s for s in SHAPES}
    for name in names:
        if name not in shapes:
            parser.error(f"--shapes: no host-bench shape {name!r}; the masters shapes are {', '.join(masters)}")
    print(f"torch {torch.__version__}, the route CUDA takes (generic), {args.steps} steps, thread CPU time per step")
    print("ratio: ours / the recipe by hand, median [quartiles] of per-step ratios; whole: of the runs' sums")
    print()
    print("| shape | checks | CPU us recipe / ours | ratio | whole | same as the recipe |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for label, context in (("as shipped", contextlib.nullcontext()), ("replaced", without_checks())):
            with context:
                row = measure(shapes[name], args.steps, 10)
            spread = row["time_ratio"]
            print(
                f"| {name} | {label} | {row['torch']['total']['cpu_us']:.0f} / {row['ours']['total']['cpu_us']:.0f} "
                f"| {spread['median']:.3f} [{spread['q1']:.2f}-{spread['q3']:.2f}] | {spread['whole']:.3f} "
                f"| {'yes' if row['same'] else 'no (the clip shapes: a one-pass clip rounds apart)'} |"
            )


if __name__ == "__main__":
    main()
