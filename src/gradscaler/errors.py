"""Exceptions and warnings of gradscaler, and ``warn``, which issues every warning the package raises."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TOOLS = _PACKAGE + "tools" + os.sep  # the demo, the bench, the command line: they call the scaler as users do


class ScaleCollapseError(RuntimeError):
    """Steps keep overflowing at the minimum scale: training is no longer making progress.

    Raised by ``GradScaler.update`` (or issued as a ``ScaleCollapseWarning`` with
    ``on_collapse="warn"``) after ``collapse_patience`` consecutive overflowing steps at the minimum
    scale. The message names the step, the scale and the parameters whose gradients were non-finite.
    """


class ScaleCollapseWarning(RuntimeWarning):
    """The warning form of ``ScaleCollapseError``."""


COLLAPSE_CAUSES = (
    "Usual causes: the forward pass itself overflows in float16 (activations or logits above 65504; "
    "run the offending layer in float32 or use bfloat16), a model pretrained in bfloat16 whose weights "
    "or activations exceed float16's range, or a real bug that produces NaN (log of 0, division by 0, "
    "a bad input batch)."
)


def _passed_through(filename: str, torch_dir: str | None) -> bool:
    """Whether a frame of ``filename`` lies between the warning and the user's line: the library's own
    code (not its ``tools/``), or torch's (the ``torch.compiler.disable`` wrappers ``compiled.prepare``
    puts around the scaler's methods, an optimizer's ``load_state_dict`` running the masters' hooks)."""
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE):
        return not path.startswith(_TOOLS)
    return torch_dir is not None and path.startswith(torch_dir)


def _skipped_by_warnings(filename: str) -> bool:
    """The import machinery's frames, which ``warnings.warn`` steps over without counting them."""
    return "importlib" in filename and "_bootstrap" in filename


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the user's line: the first frame up the stack that is
    neither gradscaler's nor torch's, however many of either lie between (the same warning can come
    from ``scaler.step`` or from an ``optimizer.load_state_dict`` hook, and the scaler's methods are
    wrapped once ``compiled.prepare`` has run). With no such frame, the outermost one."""
    torch_module = sys.modules.get("torch")
    torch_file = getattr(torch_module, "__file__", None)
    torch_dir = os.path.dirname(os.path.abspath(torch_file)) + os.sep if torch_file else None
    frame = sys._getframe(0)  # stacklevel 1 names this frame
    level = 1
    while frame.f_back is not None:
        frame = frame.f_back
        filename = frame.f_code.co_filename
        if _skipped_by_warnings(filename):
            continue
        level += 1
        if not _passed_through(filename, torch_dir):
            break
    warnings.warn(message, category, stacklevel=level)
