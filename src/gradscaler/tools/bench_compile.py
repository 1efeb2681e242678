"""``gradscaler bench --sections compile``: training steps with torch's scaler and gradscaler, eagerly,
with the model compiled and with the whole step compiled (inductor), in one process.

Each cell times whole steps of ``compiled_step``'s loop shapes (its MLP, wider here), the two scalers'
runs interleaved step by step, median of ``steps`` after ``warmup`` (the first compiles fall in the
warm-up). Every cell is reported, with whether the two runs ended bit-identical. Each run's step has
a code object of its own (``compiled_step.own_code``), so the two compiled steps keep separate Dynamo
caches, as in two processes: sharing one, each call looked through the other's entries, and the
compiled fused step with the scaler's clipping timed torch's at 71 ms against ours at 32 (a "2.26x"
that measured alone was 1.0x). Recompiles are counted by ``benchmarks/compile_counts.py``, one
scaler at a time. On CUDA the compiled step also runs with ``mode="reduce-overhead"`` (CUDA graphs).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch

from gradscaler.tools.compiled_step import Shape, build, inputs
from gradscaler.tools.harness import timer

SHAPES = [Shape(), Shape(clip="unscale"), Shape(fused=True, clip="scaler"), Shape(masters=True)]


def _modes(device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    modes: list[tuple[str, dict[str, Any]]] = [("eager", {}), ("compiled model", {}), ("compiled step", {})]
    if device.type == "cuda":
        modes.append(("compiled step, reduce-overhead", {"mode": "reduce-overhead"}))
    return modes


def compile_section(device: torch.device, steps: int, warmup: int, width: int = 512) -> list[dict[str, Any]]:
    """One row per (shape, mode): both scalers' median step time, their ratio, and whether their
    states match bit for bit."""
    timed = timer(device)
    rows = []
    batches = inputs(warmup + steps, width=width, batch=64, device=device.type)
    for shape in SHAPES:
        for mode, options in _modes(device):
            torch._dynamo.reset()
            runs, steppers = {}, {}
            for name in ("torch", "ours"):
                run = build(
                    shape,
                    name == "ours",
                    width=width,
                    device=device.type,
                    compile_model="inductor" if mode == "compiled model" else None,
                )
                runs[name] = run
                steppers[name] = (
                    run.step
                    if not mode.startswith("compiled step")
                    else torch.compile(run.step, backend="inductor", **options)
                )
            times: dict[str, list[float]] = {"torch": [], "ours": []}
            for i, (x, bad) in enumerate(batches):
                for name in ("torch", "ours"):
                    ms = timed(functools.partial(steppers[name], x, bad))
                    if i >= warmup:
                        times[name].append(ms)
            same = all(torch.equal(a, b) for a, b in zip(runs["torch"].state(), runs["ours"].state(), strict=True))
            med = {name: statistics.median(t) for name, t in times.items()}
            rows.append(
                {
                    "shape": shape.name,
                    "mode": mode,
                    "torch_ms": med["torch"],
                    "ours_ms": med["ours"],
                    "speedup": med["torch"] / med["ours"],
                    "bit_identical": same,
                }
            )
    return rows


def compile_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "Training steps under torch.compile (inductor; an MLP under float16 autocast, or a float16 MLP "
        "with master weights, by hand for torch's scaler; an overflow every 9 steps):",
        "",
        "| loop shape | mode | torch scaler ms | gradscaler ms | speedup | bit-identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['mode']} | {r['torch_ms']:.3f} | {r['ours_ms']:.3f} | {r['speedup']:.2f}x "
            f"| {'yes' if r['bit_identical'] else 'NO'} |"
        )
    return lines
