"""The demo's progress: a bar per run, redrawn in place, with the time left of the run and of the demo."""

from __future__ import annotations

import sys
import time


class Progress:
    """The demo's clock: the time left of all its runs.

    A float16 run costs several times the fp32 run a step on a CPU without AVX-512, so the runs still to
    come are timed at the speed of the float16 run in progress or last finished (the float16 runs are
    alike); until one has run (during the fp32 run) the demo's time left is unknown.
    """

    def __init__(self, runs: tuple[str, ...], steps: int) -> None:
        self.runs, self.steps = runs, steps
        self.run, self.run_begin, self.run_done = "", time.perf_counter(), 0
        self.fp16_rate: float | None = None  # steps a second of the latest float16 run

    def start(self, name: str) -> None:
        """A run begins (its first step is about to)."""
        self.run, self.run_begin, self.run_done = name, time.perf_counter(), 0

    def step(self) -> None:
        """A step of the run in progress is done."""
        self.run_done += 1
        if self.run != "fp32":
            self.fp16_rate = self.run_done / max(time.perf_counter() - self.run_begin, 1e-9)

    def left(self) -> float | None:
        """Seconds left of the demo's runs, or None before any float16 step was timed."""
        if self.fp16_rate is None or self.run not in self.runs:
            return None
        later = len(self.runs) - 1 - self.runs.index(self.run)
        rate = self.run_done / max(time.perf_counter() - self.run_begin, 1e-9)
        return (self.steps - self.run_done) / rate + later * self.steps / self.fp16_rate


def bar(name: str, done: int, total: int, loss: float, begin: float, clock: Progress | None = None) -> None:
    """A progress bar redrawn in place on a terminal; one line per 10% when stderr is a file or pipe.

    It shows the time left of this run and, with ``clock``, of the whole demo.
    """
    interactive = sys.stderr.isatty()
    if not interactive and done % max(total // 10, 1) and done != total:
        return
    width = 30
    filled = int(width * done / total)
    rate = done / max(time.perf_counter() - begin, 1e-9)
    left = f"{(total - done) / rate:.0f}s left of this run"
    demo_left = None if clock is None else clock.left()
    if demo_left is not None:
        left += f", {demo_left:.0f}s of the demo"
    sys.stderr.write(
        ("\r" if interactive else "")
        + f"{name:<32} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
        + f"loss {loss:.3f}  {rate:.1f} it/s  {left} "
        + ("\n" if done == total or not interactive else "")
    )
    sys.stderr.flush()
