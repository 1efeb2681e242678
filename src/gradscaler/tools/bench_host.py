"""``gradscaler bench --sections host``: what a training step costs the host, ours against torch's scaler.

A small model's step on a GPU is host-bound: each ATen op the scaler dispatches is a kernel launch
plus its Python. This section counts them on any machine. Each loop shape runs twice in one process,
torch's scaler (for float16 parameters: the recipe by hand, float32 copies moved and written back
with multi-tensor copies) and ours, their steps alternated, on the device route the CUDA build takes
(``GRADSCALER_KERNEL=generic``: the scaler's device-side telemetry and read passes, run on the CPU). On a
GPU (``--device cuda``) each runs its own route there (``"native"``), each phase timed after the device drained.
Per phase of the step (``scale``, ``unscale_``, ``clip``, ``step``, ``update``, ``zero_grad``;
forward and backward are the model's and not counted) a ``TorchDispatchMode`` counts:

* ``ops``: every ATen op dispatched;
* ``launches``: those that would launch a kernel on CUDA (views, allocations without a fill, profiler
  marks and host reads launch none);
* ``triton``: launches of gradscaler's Triton kernels (on CUDA the read pass is two of them where the
  generic route dispatches torch's ops: ``triton_launches`` gives that route's count);
* ``syncs``: host reads of a tensor (``aten._local_scalar_dense``; an optimizer's CPU step counter
  is one too, for both scalers alike);
* ``cpu_us``: the thread's CPU time, median over the timed steps (on the CPU it includes the kernels'
  own work, small at these sizes).

Counts come from one steady step (exact: ``tests/test_bench_host.py`` holds them), times from the
other steps, uncounted (a dispatch mode's Python would weigh on them); the time ratio (ours / torch)
is the median of per-step ratios with its quartiles, and ``whole`` the ratio of the two runs' summed time
(every step counted, also the one in ``RECORDS_PER_COPY`` that carries the telemetry's batch). Every cell is
reported.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from gradscaler import GradScaler
from gradscaler.record.telemetry import RECORDS_PER_COPY
from gradscaler.tools.harness import gpt2_shapes
from gradscaler.tools.host_counts import TRITON_LAUNCHES, Counts, PhaseCost, device_work, triton_counted

PHASES = ("scale", "unscale_", "clip", "step", "update", "zero_grad")
MAX_NORM = 1.0


@dataclass(frozen=True)
class HostShape:
    """A loop shape: ``model`` ``"mlp"`` (8 tensors) or ``"gpt"`` (147: GPT-2's layout, 12 layers);
    ``optimizer`` ``"adamw"`` (foreach), ``"fused"`` AdamW or ``"sgd"`` (foreach, momentum);
    ``clip`` ``"none"``, ``"unscale"`` (``unscale_`` + torch's clip) or ``"scaler"`` (ours:
    ``scaler.clip_grad_norm_``; torch's scaler has none, so its run unscales and clips);
    ``masters``: float16 parameters through float32 masters (torch: the recipe by hand);
    ``logger``: ours with a logger attached (``add_logger(every=1)``, a callback that keeps each record:
    the scaler's own cost of logging, not a sink's), torch's scaler as it is (it logs nothing)."""

    model: str = "mlp"
    optimizer: str = "adamw"
    clip: str = "none"
    masters: bool = False
    logger: bool = False

    @property
    def name(self) -> str:
        clip = {"none": "", "unscale": " + unscale_ + clip", "scaler": " + scaler clip"}[self.clip]
        extras = (" + masters" if self.masters else "") + (" + logger" if self.logger else "")
        return f"{self.model} {self.optimizer}{clip}{extras}"


SHAPES = [
    HostShape(),
    HostShape(clip="unscale"),
    HostShape(optimizer="fused", clip="scaler"),
    HostShape(masters=True),
    *[HostShape("gpt", opt, clip) for opt in ("adamw", "fused", "sgd") for clip in ("none", "scaler")],
    *[HostShape("gpt", opt, clip, masters=True) for opt in ("adamw", "fused") for clip in ("none", "scaler")],
    HostShape(logger=True),
    HostShape("gpt", logger=True),
]


class Loop:
    """One shape's model, optimizer and scaler, and its step as a user writes it, phase by phase."""

    def __init__(self, shape: HostShape, ours: bool, seed: int = 0, device: torch.device | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        sizes = [(32, 32), (32,)] * 4 if shape.model == "mlp" else gpt2_shapes(32, 12, 64, 16)
        dtype = torch.float16 if shape.masters else torch.float32
        self.device = device = device or torch.device("cpu")
        self.params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device, dtype)) for s in sizes]
        self.weights = [torch.randn(s, generator=gen).to(device, dtype) for s in sizes]  # d(loss)/dp, constant
        self.shape, self.ours = shape, ours
        self.copies = [p.detach().float().requires_grad_() for p in self.params] if shape.masters and not ours else []
        stepped = self.copies or self.params
        if shape.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(stepped, lr=1e-3, momentum=0.9, foreach=True)
        else:
            fused = shape.optimizer == "fused"
            self.optimizer = torch.optim.AdamW(stepped, lr=1e-3, fused=fused, foreach=None if fused else True)
        self.scaler: Any = (
            GradScaler(device.type, growth_interval=1000, master_weights=shape.masters)
            if ours
            else torch.amp.GradScaler(device.type, growth_interval=1000)
        )
        self.logged: list[dict[str, Any]] = []
        self.kernels: int | None = None  # the counted step's device work on CUDA (``step``)
        if shape.logger and ours:
            logged_scaler: Any = self.scaler
            logged_scaler.add_logger(self.logged.append, every=1)

    def loss(self) -> torch.Tensor:
        return sum((p * w).sum().float() for p, w in zip(self.params, self.weights, strict=True))  # type: ignore[return-value]

    def phases(self) -> Iterator[tuple[str, Callable[[], Any]]]:
        """The step after the backward, as (phase, call) pairs in the order the loop makes them."""
        opt, scaler = self.optimizer, self.scaler
        if self.copies:  # the recipe's move, multi-tensor: in the first phase after the backward
            first = "clip" if self.shape.clip != "none" else "step"
            yield first, self._move
        if self.shape.clip == "scaler" and self.ours:
            yield "clip", lambda: scaler.clip_grad_norm_(opt, MAX_NORM)
        elif self.shape.clip != "none":
            yield "unscale_", lambda: scaler.unscale_(opt)
            yield "clip", lambda: torch.nn.utils.clip_grad_norm_(self.copies or self.params, MAX_NORM)
        yield "step", lambda: scaler.step(opt)
        if self.copies:
            yield "step", self._copy_back
        yield "update", scaler.update
        yield "zero_grad", opt.zero_grad

    def _move(self) -> None:
        grads: list[torch.Tensor] = []
        into: list[torch.Tensor] = []
        for copy, param in zip(self.copies, self.params, strict=True):
            assert param.grad is not None
            if copy.grad is None:
                copy.grad = torch.empty_like(copy)
            grads.append(param.grad)
            into.append(copy.grad)
            param.grad = None
        torch._foreach_copy_(into, grads)

    def _copy_back(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(list[torch.Tensor](self.params), list[torch.Tensor](self.copies))

    def step(self, count: bool) -> dict[str, PhaseCost]:
        """One training step; the cost of each phase: its ops when ``count`` (a dispatch mode, whose own
        Python would weigh on the time), else its time. A counted step on CUDA also sets ``kernels``: what the
        device ran outside forward and backward, as its profiler records it (``device_work``)."""
        costs = {phase: PhaseCost(Counter(), 0, 0) for phase in PHASES}
        loss = self.loss()
        profiled = "cuda" if count and self.device.type == "cuda" else None
        scaled, before = device_work(
            lambda: self._measure(costs["scale"], lambda: self.scaler.scale(loss), count), profiled
        )
        scaled.backward()
        _, after = device_work(
            lambda: [self._measure(costs[phase], call, count) for phase, call in self.phases()], profiled
        )
        if count:  # none at all: a profiler that saw nothing (CUPTI refused), as scale's multiply is one
            self.kernels = None if before is None or after is None or before + after == 0 else before + after
        return costs

    def _measure(self, cost: PhaseCost, call: Callable[[], Any], count: bool) -> Any:
        if not count:
            if self.device.type == "cuda":  # a host read in the phase waits for its own kernels, not the backward's
                torch.cuda.synchronize(self.device)
            start = time.thread_time_ns()
            result = call()
            cost.cpu_ns += time.thread_time_ns() - start
            return result
        counts = Counts()
        triton_before = TRITON_LAUNCHES[0]
        with counts:
            result = call()
        cost.ops.update(counts.ops)
        cost.triton += TRITON_LAUNCHES[0] - triton_before
        return result

    def state(self) -> list[torch.Tensor]:
        """The parameters, for the bit-for-bit check between the two runs."""
        return [p.detach().clone() for p in self.params]


ROUTES = ("generic", "triton", "native", "torch-ops")
ON_DEVICE = ("native", "torch-ops")
"""The routes that run on the device measured (the others stand for CUDA on the CPU)."""


@contextmanager
def device_route(route: str = "generic") -> Iterator[None]:
    """The route CUDA takes, taken on the CPU: ``GRADSCALER_KERNEL=generic`` (device-side telemetry, torch's
    read passes: CUDA without Triton); ``"triton"`` also runs the read passes through gradscaler's Triton
    kernels (on the CPU under ``TRITON_INTERPRET=1``, so only its counts mean anything); ``"native"`` leaves
    the scaler its own route on the device it runs on (on a GPU: real launches, and their real host time);
    ``"torch-ops"`` is the device's route without Triton (``GRADSCALER_KERNEL=torch``: torch's multi-tensor ops
    for every pass, as on a GPU where Triton cannot compile)."""
    from gradscaler import kernels

    before = os.environ.get("GRADSCALER_KERNEL")
    if route != "native":
        os.environ["GRADSCALER_KERNEL"] = "torch" if route == "torch-ops" else "generic"
    real_route = kernels._triton_route
    if route == "triton":
        kernels._triton_route = lambda device, choice: "forced"  # type: ignore[assignment]
    try:
        with triton_counted():
            yield
    finally:
        kernels._triton_route = real_route  # type: ignore[assignment]
        if before is None:
            os.environ.pop("GRADSCALER_KERNEL", None)
        else:
            os.environ["GRADSCALER_KERNEL"] = before


def measure(
    shape: HostShape, steps: int, warmup: int, route: str = "generic", device: torch.device | None = None
) -> dict[str, Any]:
    """Both runs of ``shape`` on ``route`` (on ``device``, the CPU by default: only the routes ``ON_DEVICE`` run
    elsewhere), steps alternated: ``warmup`` steps, one counted, ``steps`` timed. Per phase and in all: the
    counts, the median CPU time, and the time ratio: per step (median, quartiles) and of the two runs' sums
    (``whole``). ``same``: the two runs ended bit-identical."""
    device = device or torch.device("cpu")
    if route not in ON_DEVICE and device.type != "cpu":
        raise ValueError(
            f"route={route!r} stands for CUDA on the CPU; on {device} measure route='native' or 'torch-ops'"
        )
    with device_route(route):
        runs = {"torch": Loop(shape, ours=False, device=device), "ours": Loop(shape, ours=True, device=device)}
        counted: dict[str, dict[str, PhaseCost]] = {}
        timed: dict[str, list[dict[str, PhaseCost]]] = {"torch": [], "ours": []}
        for i in range(warmup + 1 + steps):
            for name in ("torch", "ours") if i % 2 else ("ours", "torch"):
                costs = runs[name].step(count=i == warmup)
                if i == warmup:
                    counted[name] = costs
                elif i > warmup:
                    timed[name].append(costs)
    row: dict[str, Any] = {
        "shape": shape.name,
        "route": route,
        "device": str(device),
        "tensors": len(runs["ours"].params),
    }
    step_ns = {name: [sum(c.cpu_ns for c in s.values()) for s in measured] for name, measured in timed.items()}
    for name in ("torch", "ours"):
        cost = counted[name]
        row[name] = {
            phase: {
                "ops": sum(cost[phase].ops.values()),
                "launches": cost[phase].launches,
                "triton": cost[phase].triton,
                "syncs": cost[phase].syncs,
                "cpu_us": statistics.median(s[phase].cpu_ns for s in timed[name]) / 1e3,
            }
            for phase in PHASES
        }
        total = {key: sum(row[name][phase][key] for phase in PHASES) for key in ("ops", "launches", "triton", "syncs")}
        total["cpu_us"] = statistics.median(step_ns[name]) / 1e3
        total["device_kernels"] = runs[name].kernels  # on CUDA: its profiler's count (None elsewhere)
        row[name]["total"] = total
    ratios = [ours / max(1, theirs) for ours, theirs in zip(step_ns["ours"], step_ns["torch"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    # the ratio of the runs' sums counts every step: also the work done once in a while (the telemetry's batch
    # copy, one step in RECORDS_PER_COPY), which the per-step median leaves out
    row["time_ratio"] = {
        "median": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "whole": sum(step_ns["ours"]) / max(1, sum(step_ns["torch"])),
    }
    row["same"] = all(torch.equal(a, b) for a, b in zip(runs["torch"].state(), runs["ours"].state(), strict=True))
    row["logged"] = len(runs["ours"].logged)  # records our logger got (one per step when attached)
    return row


def python_calls(shape: HostShape, ours: bool, steps: int = 32, warmup: int = 20) -> float:
    """Python calls per step of ``shape``'s whole step (loss, backward, the phases), on the route CUDA takes: the
    mean over ``steps`` steps after ``warmup`` of what ``cProfile`` records (each Python function called, each C
    function called from Python). The host work outside the dispatched ops, counted exactly where the CPU time
    is noisy (``steps`` a multiple of ``RECORDS_PER_COPY`` holds whole telemetry batches: the same mean for any)."""
    with device_route("generic"):
        loop = Loop(shape, ours)
        for _ in range(warmup):
            loop.step(False)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            loop.step(False)
        profile.disable()
    # each entry's own count: pstats keys them by (file, line, name), so two functions of one label (dataclass
    # ``__init__``s, comprehensions sharing a line) would count as one, whichever its table kept
    calls = sum(entry.callcount for entry in profile.getstats())
    return float(calls - 1) / steps  # less the profiler's own ``disable``


def host_section(
    steps: int,
    warmup: int,
    shapes: list[HostShape] | None = None,
    route: str = "generic",
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per loop shape on ``route`` and ``device`` (see ``measure``), each announced to ``progress`` as it
    starts. The warm-up is at least enough for the telemetry's first copy to land (its steady state)."""
    warmup = max(warmup, RECORDS_PER_COPY + 2)
    shapes = shapes or SHAPES
    rows = []
    for number, shape in enumerate(shapes, 1):
        if progress is not None:
            progress(f"bench: host: {shape.name} ({route}) {number}/{len(shapes)}")
        rows.append(measure(shape, steps, warmup, route, device))
    return rows


def triton_rows(progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The Triton route's counts, from a process of their own run under ``TRITON_INTERPRET=1`` (the
    interpreter must be chosen before Triton is imported; minutes: it runs the kernels in Python, so
    its times mean nothing). Empty when Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        progress("bench: host section: Triton is not installed, the Triton route is not counted")
        return []
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "gradscaler.tools.bench_host", "--route", "triton"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _route_cell(row: dict[str, Any]) -> str:
    """``generic`` and ``triton`` (the CPU's stand-ins for CUDA), or the route and the device of a row run there."""
    return f"{row['route']}, {row['device']}" if row["route"] in ON_DEVICE else str(row["route"])


def format_host(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: launches per phase (torch / ours), in all, Triton apart, syncs, CPU time and its ratio."""
    if not rows:
        return []
    head = " | ".join(PHASES)
    lines = [
        "",
        "Host cost per step on the CUDA route (generic, triton: its ops on this machine; native: the scaler's own"
        " route on the device named; torch-ops: that route without Triton), counted on this machine (kernel"
        " launches torch / ours per phase;"
        " CPU time: thread time of the phases, median; ratio ours / torch, median [quartiles] of per-step ratios;"
        " whole: ours / torch of the runs' summed time, every step counted, also one now and then doing more)."
        " A row ending in + logger is ours with a logger attached (every step) against torch's scaler, which logs"
        " nothing: the difference from the row without it is what logging costs.",
        "",
        f"| shape | route | tensors | {head} | launches | + Triton | syncs | CPU us torch / ours | ratio | whole"
        " | same |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, o = row["torch"], row["ours"]
        cells = " | ".join(f"{t[p]['launches']} / {o[p]['launches']}" for p in PHASES)
        ratio = row["time_ratio"]
        timed = row["route"] != "triton"  # the interpreter's times mean nothing
        time_cells = (
            f"{t['total']['cpu_us']:.0f} / {o['total']['cpu_us']:.0f} | "
            f"{ratio['median']:.2f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}] | {ratio['whole']:.2f}"
            if timed
            else "- | - | -"
        )
        lines.append(
            f"| {row['shape']} | {_route_cell(row)} | {row['tensors']} | {cells} | "
            f"{t['total']['launches']} / {o['total']['launches']} | "
            f"{t['total']['triton']} / {o['total']['triton']} | {t['total']['syncs']} / {o['total']['syncs']} | "
            f"{time_cells} | {'yes' if row['same'] else 'no (rounding: a one-pass clip)'} |"
        )
    profiled = [row for row in rows if row["ours"]["total"].get("device_kernels") is not None]
    if profiled:
        lines += [
            "",
            "What the device ran per step outside forward and backward, as its profiler records it (kernels, copies"
            " and fills: a multi-tensor op's several kernels and an op's hidden ones included), one steady step:",
            "",
            "| shape | route | device work torch / ours |",
            "|---|---|---|",
        ]
        lines += [
            f"| {row['shape']} | {_route_cell(row)} | {_cell(row['torch']['total'].get('device_kernels'))} / "
            f"{row['ours']['total']['device_kernels']} |"
            for row in profiled
        ]
    return lines


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> None:
    """``python -m gradscaler.tools.bench_host --route triton``: the rows as one JSON line (``triton_rows``)."""
    parser = argparse.ArgumentParser(prog="python -m gradscaler.tools.bench_host")
    parser.add_argument("--route", choices=ROUTES, default="generic")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=RECORDS_PER_COPY + 2)
    args = parser.parse_args(argv)
    print(json.dumps(host_section(args.steps, args.warmup, route=args.route)))


if __name__ == "__main__":
    main()
