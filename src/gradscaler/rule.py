"""The scale-update rule, as pure tensor operations (no host sync).

The rule reads one overflow flag per iteration and moves three small device tensors: the scale ``S``
(float32), the growth tracker (int32, clean steps since the last growth or overflow) and the
hysteresis tracker (int32, overflows still allowed before a backoff)::

    if found_inf:                                   # the step was skipped
        tracker = 0
        hysteresis_left -= 1
        if hysteresis_left <= 0:
            S = S * backoff_factor                  # product in float64, rounded once to float32
    else:
        tracker += 1
        if refill == "clean": hysteresis_left = hysteresis
        if tracker == growth_interval:
            tracker = 0
            hysteresis_left = hysteresis
            if isfinite(S * growth_factor): S = S * growth_factor
    S = clamp(S, lower, upper)

``lower`` is ``max(min_scale, 2**-126)`` and ``upper`` is ``min(max_scale, float32 max)``. The floor
2**-126 (the smallest normal float32) is the one place this rule differs from torch's
``_amp_update_scale_``: torch lets S reach 0 after ~150 consecutive overflows, after which
``1/S`` is inf and every unscaled gradient is inf or NaN. With ``hysteresis=1``, no ``min_scale`` or
``max_scale`` and S above the floor, the rule is bit-identical to torch's kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_FLOOR = 2.0**-126
"""Smallest scale the rule ever produces: the smallest normal float32, whose reciprocal is finite."""

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

REFILL_MODES = ("clean", "growth")


@dataclass(frozen=True)
class ScaleRule:
    """Constants of the update rule; validated at construction."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    hysteresis_refill: str = "clean"
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hysteresis, int) or isinstance(self.hysteresis, bool) or self.hysteresis < 1:
            raise ValueError(
                f"hysteresis must be an int >= 1 (the number of consecutive overflowing steps before a "
                f"backoff), got {self.hysteresis!r}."
            )
        if self.hysteresis_refill not in REFILL_MODES:
            raise ValueError(f"hysteresis_refill must be one of {REFILL_MODES}, got {self.hysteresis_refill!r}.")
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float or None, got {type(value).__name__} {value!r}.")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r}).")

    @property
    def lower(self) -> float:
        """The smallest scale the rule produces."""
        return max(float(self.min_scale or 0.0), SCALE_FLOOR)

    @property
    def upper(self) -> float:
        """The largest scale the rule produces."""
        return min(float(self.max_scale or math.inf), FLOAT32_MAX)

    @property
    def is_torch_rule(self) -> bool:
        """True when torch's ``_amp_update_scale_`` kernel computes this rule (before the clamp)."""
        return self.hysteresis == 1


def clamp_scale_(scale: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """Clamp ``scale`` in place into ``[rule.lower, rule.upper]`` (NaN stays NaN: see ``sanitize``)."""
    return scale.clamp_(rule.lower, rule.upper)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    rule: ScaleRule,
) -> None:
    """Apply one step of the rule in place. ``found_inf`` is a 0-d float tensor, nonzero on overflow.

    All four tensors live on one device. Nothing is read back to the host.
    """
    if rule.is_torch_rule:
        # One launch for the common case; the floor/ceiling clamp is the only addition.
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, rule.growth_factor, rule.backoff_factor, rule.growth_interval
        )
        clamp_scale_(scale, rule)
        return
    update_scale_reference_(scale, growth_tracker, hysteresis_tracker, found_inf, rule)


def update_scale_reference_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    rule: ScaleRule,
) -> None:
    """The rule written out with ``torch.where``: any hysteresis, same results as the kernel at 1."""
    found = found_inf != 0
    hyst_after = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    backoff = found & (hyst_after <= 0)
    clean_count = growth_tracker + 1
    grow = (~found) & (clean_count == rule.growth_interval)
    scale64 = scale.double()
    grown = (scale64 * rule.growth_factor).float()
    shrunk = (scale64 * rule.backoff_factor).float()
    new_scale = torch.where(backoff, shrunk, torch.where(grow & torch.isfinite(grown), grown, scale))
    new_tracker = torch.where(found | grow, torch.zeros_like(growth_tracker), clean_count)
    refill = grow if rule.hysteresis_refill == "growth" else ~found
    new_hyst = torch.where(refill, torch.full_like(hysteresis_tracker, rule.hysteresis), hyst_after)
    scale.copy_(new_scale)
    clamp_scale_(scale, rule)
    growth_tracker.copy_(new_tracker)
    hysteresis_tracker.copy_(new_hyst.clamp_(min=0))
