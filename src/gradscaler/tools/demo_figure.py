"""The figure of ``gradscaler demo``: gradient histogram, loss curves, loss scale, and the verdicts.

Drawn from the numbers the demo computed (``demo.train``'s runs, ``demo.histogram_data``), so that the
figure and the printed table say the same thing. matplotlib is imported when the figure is drawn.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path
from typing import Any

from gradscaler.tools.demo_fp16 import FP16_PARAMETERS, NO_MASTERS

FP16_MAX = 65504.0
TORCH_GROWTH_INTERVAL = 2000
"""torch.amp.GradScaler's default ``growth_interval``, named on the scale panel beside the demo's."""


def scale_text(scale: float) -> str:
    """A loss scale as people read one: ``2**30`` for a power of two, else ``%g``."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent == int(exponent):
            return f"2**{int(exponent)}"
    return f"{scale:g}"


def plot(
    runs: list[dict[str, Any]],
    hist: dict[str, Any],
    verdicts: list[str],
    growth_interval: int,
    path: Path,
) -> bool:
    """Write the figure to ``path``: three panels, their legends below them, the verdicts at the bottom.

    False when matplotlib is missing. Legends sit in a row of their own so that they never cover data.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lines = [wrapped for line in verdicts for wrapped in textwrap.wrap(line, 210, initial_indent="- ")]
    heights = (3.7, 1.2, 0.19 * (len(lines) + 1))  # inches: panels, legends, verdicts
    fig = plt.figure(figsize=(17, sum(heights) + 1.3))
    grid = fig.add_gridspec(3, 3, height_ratios=heights, hspace=0.22, wspace=0.22)
    axes = [fig.add_subplot(grid[0, i]) for i in range(3)]
    keys = [fig.add_subplot(grid[1, i]) for i in range(3)]
    _histogram(axes[0], hist)
    _losses(axes[1], runs)
    _scales(axes[2], runs, growth_interval)
    for ax, key in zip(axes, keys, strict=True):
        key.axis("off")
        key.legend(*ax.get_legend_handles_labels(), loc="center", fontsize=8.5, frameon=False)
    text = fig.add_subplot(grid[2, :])
    text.axis("off")
    text.text(0, 1, "\n".join(["What the demo found:", *lines]), va="top", ha="left", fontsize=9, wrap=False)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.935, bottom=0.01)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _histogram(ax: Any, hist: dict[str, Any]) -> None:
    edges = hist["edges"]
    centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    scale = hist["scale"]
    shift = math.log2(scale)
    ax.fill_between(centers, hist["before"], step="mid", alpha=0.5, label="as computed (scale 1)")
    ax.fill_between(
        centers,
        hist["after"],
        step="mid",
        alpha=0.5,
        label=f"scaled by the final loss scale, {scale_text(scale)} (shifted up {shift:g} octaves)",
    )
    ax.axvspan(edges[0], -25, color="red", alpha=0.08, label="below 2**-25: rounds to 0 in float16")
    ax.axvspan(-25, -14, color="orange", alpha=0.08, label="float16 subnormals (fewer bits of precision)")
    ax.axvline(math.log2(FP16_MAX), color="black", lw=1, ls="--", label="float16 max (65504): overflow above")
    top = max(max(hist["before"]), max(hist["after"]))
    flushed, kept = hist.get("flushed_before"), hist.get("flushed_after")
    if flushed is not None and kept is not None:
        plain = hist.get("flushed_without_scaling")
        ax.text(
            edges[0] + 1,
            top * 0.97,
            f"flushed to 0 in float16:\nat scale 1: {100 * flushed:.1f}%\nat {scale_text(scale)}: {100 * kept:.1f}%"
            + (
                ""
                if plain is None
                else f"\n\nthe run without scaling,\nits own model: {100 * plain:.1f}%\n(the same batch; that"
                "\nmodel stalled, and its\ngradients are smaller)"
            ),
            va="top",
            fontsize=9,
        )
    ax.set(
        title="Activation gradients of the fp16 + gradscaler run\n(one batch at the end, computed in float32)",
        xlabel="log2 |gradient|",
        ylabel="count (values per 1/4 octave)",
        ylim=(0, top * 1.05),
    )


def _losses(ax: Any, runs: list[dict[str, Any]]) -> None:
    finite_top = 0.0
    for r in runs:
        smooth = smooth_mean(r["losses"], 10)
        style = "--" if r["run"] in FP16_PARAMETERS else "-"
        broken = next((i for i, v in enumerate(r["losses"]) if not math.isfinite(v)), None)
        label = f"{r['run']} (final {r['final_loss']:.2f})"
        # A run whose loss became NaN: its legend entry is the dotted line that marks the step, not its
        # curve, which stops there.
        (line,) = ax.plot(smooth, ls=style, label=label if broken is None else "_nolegend_")
        finite_top = max([finite_top, *(v for v in smooth if math.isfinite(v))])
        if broken is not None:  # the curve stops here: mark the step across the whole panel
            ax.axvline(broken, color=line.get_color(), ls=":", lw=1.5, label=f"{r['run']}: loss NaN from step {broken}")
            ax.annotate(
                f"{r['run']}:\nNaN from step {broken}",
                (broken, 0.1),
                xycoords=("data", "axes fraction"),
                xytext=(6, 0),
                textcoords="offset points",
                color=line.get_color(),
                fontsize=8.5,
                va="center",
            )
    ax.set(title="Training loss", xlabel="step", ylabel="cross-entropy (10-step mean)", ylim=(0, finite_top * 1.08))


def _scales(ax: Any, runs: list[dict[str, Any]], growth_interval: int) -> None:
    for r in runs:
        if not r["scales"] or r["run"] == NO_MASTERS:  # its scale falls to the floor: the verdicts say so
            continue
        (line,) = ax.plot(r["scales"], ls="--" if r["run"] in FP16_PARAMETERS else "-", label=f"loss scale, {r['run']}")
        skipped = [i for i, s in enumerate(r["skipped"]) if s]
        ax.scatter(
            skipped,
            [r["scales"][i] for i in skipped],
            color=line.get_color(),
            marker="x",
            zorder=3,
            label=f"skipped step, {r['run']} ({len(skipped)})",
        )
    ax.set_yscale("log", base=2)
    ax.text(
        0.98,
        0.04,
        f"growth_interval={growth_interval} here (torch's default: {TORCH_GROWTH_INTERVAL}):\n"
        f"the scale doubles after {growth_interval} steps without overflow\n"
        "and halves at a step that overflows (that step is skipped)",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=8.5,
    )
    ax.set(title="gradscaler: loss scale after each step", xlabel="step", ylabel="loss scale (log2 axis)")


def smooth_mean(values: list[float], window: int) -> list[float]:
    """The running mean of the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out
