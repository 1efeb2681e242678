"""Exceptions and warnings of gradscaler."""

from __future__ import annotations


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
