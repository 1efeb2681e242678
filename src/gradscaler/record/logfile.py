"""What can be said of a log file and the figure's path before a line is parsed, without torch.

``gradscaler report`` asks these first: a missing file, a folder, an empty file and a figure that
cannot be written answer before torch is imported (which alone takes seconds, more on a busy
machine). ``scalerlog`` gives the same messages when it meets the same files through ``report``.
"""

from __future__ import annotations

from pathlib import Path

COUNTERS = ("skipped_steps", "consecutive_skips", "growths", "backoffs", "collapse_run")
"""The scaler's counters, as a log record names them (``telemetry`` keeps them; here, torch-free, for the reader)."""
FOLDER = "is a folder, not a log file"
EMPTY = "the log is empty: no records (loggers are called after each scaler.update())"
PROBE = 1 << 16
"""Bytes read to tell an empty log (nothing but blank lines) from one with a record, before parsing."""
PLOT_HINT = "pip install 'matplotlib>=3.7' into the environment that runs gradscaler"
"""What to do when matplotlib is missing. gradscaler is not on PyPI, so ``pip install 'gradscaler[plot]'``
would fail; the ``plot`` extra is matplotlib and nothing else."""


def first_problem(path: Path) -> str | None:
    """``FOLDER`` or ``EMPTY`` when the log is one, else None; ``OSError`` when it cannot be opened."""
    if path.is_dir():
        return FOLDER
    with path.open("rb") as f:
        head = f.read(PROBE + 1)
    return EMPTY if len(head) <= PROBE and not head.strip() else None


def figure_path(out: str | Path) -> Path:
    """The file the figure is written to: ``out``, with ``.png`` added when it has no suffix (as matplotlib
    adds it), so that what is printed is the file that exists."""
    path = Path(out)
    return path if path.suffix else path.with_name(path.name + ".png")
