"""What the benchmark sections share: the constants, the timer, the step phase as users write it.

``bench.py``, ``bench_masters.py`` and ``matrix.py`` import it; it imports none of them, so the
sections can import each other's entry points without a circle. ``gpt2_shapes`` and ``sleep_cycles``
are public helpers for ``benchmarks/`` and the CUDA tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler

SCALE = 2.0**16
BUSY_MS = 5.0
"""GPU work queued ahead of each timed kernel/step call on CUDA (see ``timer``)."""


def gpt2_shapes(width: int, layers: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 model (tied embeddings): 12 tensors a layer plus 3."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,)]


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs to keep the device busy for ``ms``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / start.elapsed_time(end))


def timer(device: torch.device, busy_ms: float = 0.0) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call: CUDA events on CUDA, the host clock elsewhere.

    ``busy_ms`` > 0 puts that much GPU work (a sleep kernel) before the start event, so the host has
    queued the timed work before the GPU reaches it: device time, as inside a training loop where
    the backward pass still runs when the host calls ``step()``. Without it the host's Python time
    before the first launch is counted too.
    """
    cycles = sleep_cycles(busy_ms) if device.type == "cuda" and busy_ms > 0 else 0

    def timed(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if cycles:
                torch.cuda._sleep(cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return timed


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range (q1, q3)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


def step_phase(
    scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], clip: bool
) -> None:
    """The step phase as each scaler's users write it: torch's ``unscale_`` + ``clip_grad_norm_``
    recipe, or gradscaler's one-pass ``clip_grad_norm_``; then ``step`` and ``update``."""
    if clip and isinstance(scaler, GradScaler):
        scaler.clip_grad_norm_(opt, 1.0)
    elif clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()


def compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> str:
    if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        return "bit-identical"
    worst = max(
        float(
            torch.linalg.vector_norm((x - y).detach().double())
            / torch.linalg.vector_norm(y.detach().double()).clamp_min(1e-30)
        )
        for x, y in zip(a, b, strict=True)
    )
    return f"rel diff {worst:.1e}"


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
