"""``gradscaler.report(path)``: the text and the figure of a scaler log.

``scalerlog`` reads the log, ``diagnosis`` says what it means, this module draws it. matplotlib (the ``plot``
extra) is imported when a figure is drawn, as ``frameworks`` imports transformers when it is used, so
``import gradscaler`` never pays for it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradscaler.record.diagnosis import describe, diagnose, top_offenders
from gradscaler.record.logfile import PLOT_HINT, figure_path
from gradscaler.record.scalerlog import LogSummary, summarise_file


@dataclass(frozen=True)
class Report:
    """What ``report`` found: ``text`` (also ``str(report)``), the numbers it opens with, the figure's path."""

    text: str
    steps: int
    skipped: int
    offenders: list[tuple[str, int]]
    findings: list[str]
    figure: Path | None
    summary: LogSummary

    def __str__(self) -> str:
        return self.text


def report(
    path: str | Path,
    out: str | Path | None = None,
    *,
    progress: bool = False,
    rank: int | None = None,
    run: str | None = None,
) -> Report:
    """Read a ``JsonLinesLogger`` log and say what happened to the scale; draw it to ``out`` (PNG) if given.

    The text opens with "N of M steps skipped", names the parameters whose gradients were non-finite
    most often, and gives a diagnosis in plain words: early skips from an ``init_scale`` set too high,
    a collapse (a NaN source, named), backoffs every growth interval (fine) or clustered (the data or
    the learning rate), a scale held at ``max_scale``. The figure: the scale over steps (log axis,
    skipped steps, growths, the policy's bounds), the clipping norm when logged, the parameters that
    overflowed most. The file is streamed in constant memory; ``progress=True`` prints a progress
    line on stderr. Logs of gradscaler 0.1.0 (seven keys) read too, without parameter names. A log
    still being written reads up to its last complete record. ``rank`` / ``run``: read only that
    writer's records, in a file that several wrote to (docs/log-format.md).

    Returns a ``Report`` (``text``, ``steps``, ``skipped``, ``offenders``, ``findings``, ``figure``: the
    file written, ``out`` with ``.png`` added when it has no suffix).
    Raises ``ValueError`` (one line, with the line number and the field) for a file that is not a
    scaler log: empty, not JSON lines, a value no logger writes, several writers' records mixed;
    ``OSError`` when it cannot be read, ``ModuleNotFoundError`` when ``out`` is given and matplotlib
    is missing.
    """
    ticker = _Progress(Path(path).name) if progress else None
    summary = summarise_file(path, ticker, rank=rank, run=run)
    if ticker is not None:
        ticker.finish(summary.records)
    figure = None if out is None else figure_path(out)
    if figure is not None:
        draw(summary, figure, title=Path(path).name)
    return Report(
        text=describe(summary),
        steps=summary.steps,
        skipped=summary.total("skipped_steps"),
        offenders=top_offenders(summary),
        findings=diagnose(summary),
        figure=figure,
        summary=summary,
    )


class _Progress:
    """A progress line on stderr, once per tenth of the file, for logs long enough to reach one tick."""

    def __init__(self, name: str) -> None:
        self.name, self.shown, self.begin = name, -1, time.perf_counter()

    def __call__(self, done: int, size: int) -> None:
        tenth = 10 * done // max(size, 1)
        if tenth > self.shown:
            self.shown = tenth
            end = "\r" if sys.stderr.isatty() else "\n"
            sys.stderr.write(f"reading {self.name}: {min(100, 10 * tenth)}% of {size / 2**20:.0f} MiB{end}")
            sys.stderr.flush()

    def finish(self, records: int) -> None:
        if self.shown >= 0:
            seconds = time.perf_counter() - self.begin
            sys.stderr.write(f"read {self.name}: {records:,} records in {seconds:.1f} s\n")


def draw(summary: LogSummary, out: str | Path, title: str = "") -> None:
    """Write the report's figure (PNG) for ``summary`` to ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ModuleNotFoundError(f"drawing the report needs matplotlib: {PLOT_HINT}") from error
    s = summary
    with_norms, named = s.norms > 0, bool(s.names)
    fig = plt.figure(figsize=(13 if named else 9.5, 7.2 if with_norms else 4.6))
    grid = fig.add_gridspec(
        2 if with_norms else 1, 2 if named else 1, width_ratios=(2.4, 1) if named else None, hspace=0.35, wspace=0.28
    )
    ax = fig.add_subplot(grid[0, 0])
    _scale_panel(ax, s)
    if with_norms:
        _norm_panel(fig.add_subplot(grid[1, 0], sharex=ax), s)
    if named:
        _offender_panel(fig.add_subplot(grid[:, 1]), s)
    else:
        why = "no parameter named in this log" if s.version >= 2 else "parameters are not named in a 0.1.0 log"
        fig.text(0.99, 0.01, why, ha="right", va="bottom", fontsize=8, color="gray")
    headline = describe(s).split(";")[0]
    fig.suptitle(f"{title}: {headline}" if title else headline, fontsize=12)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _scale_panel(ax: Any, s: LogSummary) -> None:
    buckets = s.buckets
    steps = [b.last for b in buckets]
    ax.plot(steps, [b.scale for b in buckets], drawstyle="steps-post", color="C0", lw=1.2, label="scale")
    if s.span > 1:
        ax.fill_between(
            steps,
            [b.low for b in buckets],
            [b.high for b in buckets],
            step="post",
            color="C0",
            alpha=0.25,
            label=f"min-max per {s.span} steps",
        )
    skipped = [(i, b) for i, b in enumerate(buckets) if b.skips]
    if skipped:
        # At the scale the skipped step ran with, where its backoff's marker starts: one event, one place.
        ax.scatter(
            [b.last for _, b in skipped],
            [ran_with(s, i) for i, _ in skipped],
            marker="x",
            color="red",
            zorder=4,
            label=f"skipped ({s.total('skipped_steps')})",
        )
    if s.span == 1:  # one bucket per record: mark each event where it happened
        for what, (points, label) in events(s).items():
            if points:
                x, y = zip(*points, strict=True)
                if what == "growths":
                    ax.scatter(x, y, marker="^", s=22, color="green", zorder=3, label=label)
                else:  # around the skip's cross, which sits on the same point
                    ax.scatter(
                        x,
                        y,
                        marker="v",
                        s=90,
                        facecolors="none",
                        edgecolors="darkorange",
                        lw=1.4,
                        zorder=3,
                        label=label,
                    )
    policy = s.policy or {}
    for key, style in (("max_scale", "--"), ("min_scale", ":")):
        bound = policy.get(key)
        if isinstance(bound, (int, float)):
            ax.axhline(bound, color="black", lw=1, ls=style, label=f"{key} {bound:g}")
    ax.set_yscale("log", base=2)
    ax.set(title="loss scale after each update", xlabel="step", ylabel="scale (log2 axis)")
    ax.legend(fontsize=8, loc="best")


def events(s: LogSummary) -> dict[str, tuple[list[tuple[int, float]], str]]:
    """The growths' and backoffs' markers (step, scale before the change) and their legend labels.

    A marker per record that holds one; the label counts the events, and says so when a record (a log
    written ``every=N``) holds several.
    """
    out = {}
    for what in ("growths", "backoffs"):
        points: list[tuple[int, float]] = []
        count = 0
        for i, b in enumerate(s.buckets):
            n = getattr(b, what)
            if n:
                points.append((b.last, ran_with(s, i)))
                count += n
        label = f"{what[:-1]} ({count})" if count == len(points) else f"{what} ({count}, in {len(points)} records)"
        out[what] = (points, label)
    return out


def ran_with(s: LogSummary, i: int) -> float:
    """The scale bucket ``i``'s last step ran with: the one before its update (the previous record's), where
    that step's skip, growth and backoff are drawn; the first record's is not in the log (its own, then).
    A bucket of several records: its highest scale, which a backoff in it started from."""
    b = s.buckets[i]
    if s.span > 1:
        return b.high
    return s.buckets[i - 1].scale if i else b.scale


def _norm_panel(ax: Any, s: LogSummary) -> None:
    with_norm = [b for b in s.buckets if b.norm_high >= b.norm_low]
    steps = [b.last for b in with_norm]
    ax.plot(steps, [b.norm_high for b in with_norm], color="C2", lw=1, label="total norm (unscaled)")
    if s.span > 1:
        low = [b.norm_low for b in with_norm]
        ax.fill_between(steps, low, [b.norm_high for b in with_norm], color="C2", alpha=0.25, label="min-max")
    ax.set_yscale("log")
    ax.set(title="gradient norm at clip_grad_norm_", xlabel="step", ylabel="norm")
    ax.legend(fontsize=8, loc="best")


def _offender_panel(ax: Any, s: LogSummary) -> None:
    top = top_offenders(s)
    ax.set_title("parameters with non-finite gradients")
    counts = [count for _, count in reversed(top)]
    ax.barh(range(len(top)), counts, height=0.45, color="firebrick")
    for y, (name, count) in enumerate(reversed(top)):
        ax.text(0, y + 0.26, name if len(name) <= 44 else "..." + name[-41:], fontsize=8, va="bottom")
        ax.text(count, y, f" {count}", va="center", fontsize=8)
    # The bars share the panel's height (a row each, three rows at least so that one or two are not slabs).
    rows = max(len(top), 3)
    ax.set(xlabel="records naming it", yticks=[], ylim=(len(top) - rows - 0.5, len(top) - 0.3))
    ax.set_xlim(0, max(counts) * 1.15)
