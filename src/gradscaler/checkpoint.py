"""The scaler's state dict: torch's five keys plus ours, built from values and parsed back into values.

``build_state_dict`` writes plain Python numbers and strings only, so ``torch.load(...,
weights_only=True)`` reads a checkpoint of it. ``parse_state_dict`` validates a whole dict (ours or
torch's) and returns what it describes; it mutates nothing, so a refused dict leaves the scaler as it
was. Every value the scaler can write is one ``parse_state_dict`` accepts.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from gradscaler import rule
from gradscaler.record.telemetry import COUNTERS, SATURATE
from gradscaler.rule import ScaleRule

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
EXTENSION_KEYS = (
    "hysteresis",
    "hysteresis_refill",
    "min_scale",
    "max_scale",
    "_hysteresis_tracker",
    "steps",
    *COUNTERS,
)
LEGACY_KEYS = ("hysteresis_refill_on_growth",)
"""Written by gradscaler 0.1.0 (a bool for ``hysteresis_refill == "growth"``); still read."""
INT64_MAX = rule.INT64_MAX


class ScalerState(NamedTuple):
    """Everything a state dict carries, as validated values."""

    rule: ScaleRule
    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    counters: list[int]
    steps: int

    def stats(self) -> dict[str, Any]:
        """What ``GradScaler.stats()`` reports: the scale, steps, every counter, both trackers."""
        counters = dict(zip(COUNTERS, self.counters, strict=True))
        trackers = {"growth_tracker": self.growth_tracker, "hysteresis_tracker": self.hysteresis_tracker}
        return {"scale": self.scale, "steps": self.steps, **counters, **trackers}


def build_state_dict(state: ScalerState) -> dict[str, Any]:
    """torch's five entries, then this scaler's policy, trackers and counters."""
    policy = state.rule
    out: dict[str, Any] = {
        "scale": state.scale,
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "growth_interval": policy.growth_interval,
        "_growth_tracker": state.growth_tracker,
        "hysteresis": policy.hysteresis,
        "hysteresis_refill": policy.hysteresis_refill,
        "min_scale": float(policy.min_scale or 0.0),
        "max_scale": float(policy.max_scale or math.inf),
        "_hysteresis_tracker": state.hysteresis_tracker,
        "steps": state.steps,
    }
    out.update(zip(COUNTERS, state.counters, strict=True))
    return out


def parse_state_dict(state_dict: Any, current: ScaleRule) -> ScalerState:
    """Validate ``state_dict`` whole and return what it describes.

    Keys a torch state dict lacks keep ``current``'s policy and start fresh (trackers full, counters
    0). The loaded scale must be finite and > 0 in float32 terms; it is moved into the policy's
    bounds as ``init_scale`` is. Raises ``TypeError``/``ValueError`` naming the key and the value.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
    known = (*TORCH_KEYS, *EXTENSION_KEYS, *LEGACY_KEYS)
    unknown = sorted(set(state_dict) - set(known), key=str)
    if unknown:
        raise ValueError(f"Unknown keys in the scaler's state_dict: {unknown}. Known: {list(known)}.")
    missing = [key for key in TORCH_KEYS if key not in state_dict]
    if missing:
        raise ValueError(f"Pass a GradScaler's state_dict: the scaler's state_dict lacks {missing}.")
    policy = _parse_rule(state_dict, current)
    scale = rule.positive_finite("state_dict['scale']", state_dict["scale"])
    if scale > rule.FLOAT32_MAX:
        raise ValueError(f"state_dict['scale'] must be <= float32 max ({rule.FLOAT32_MAX:g}), got {scale!r}.")
    hysteresis = state_dict.get("_hysteresis_tracker", policy.hysteresis)
    counters = [_count(state_dict, name, SATURATE) for name in COUNTERS]
    return ScalerState(
        rule=policy,
        scale=policy.clamp(scale),
        growth_tracker=_growth_tracker(state_dict["_growth_tracker"], policy),
        hysteresis_tracker=rule.integer("state_dict['_hysteresis_tracker']", hysteresis, 0, policy.hysteresis),
        counters=counters,
        steps=_count(state_dict, "steps", INT64_MAX),
    )


def _growth_tracker(value: Any, policy: ScaleRule) -> int:
    try:
        return rule.integer("state_dict['_growth_tracker']", value, 0, policy.growth_interval - 1)
    except ValueError as error:
        # One at or past the interval would count up to int32's end and wrap negative (the rule grows
        # and restarts only when it reaches the interval), and the scaler's own state dict would no
        # longer load.
        raise ValueError(
            f"{error} It counts clean steps towards growth_interval ({policy.growth_interval}), where the "
            "scale grows and it restarts at 0."
        ) from error


def _count(state_dict: dict[str, Any], key: str, high: int) -> int:
    return rule.integer(f"state_dict[{key!r}]", state_dict.get(key, 0), 0, high)


def _parse_rule(state_dict: dict[str, Any], current: ScaleRule) -> ScaleRule:
    refill = state_dict.get("hysteresis_refill", current.hysteresis_refill)
    if "hysteresis_refill_on_growth" in state_dict:
        legacy = state_dict["hysteresis_refill_on_growth"]
        if not isinstance(legacy, bool):
            raise TypeError(f"state_dict['hysteresis_refill_on_growth'] must be a bool, got {legacy!r}.")
        refill = "growth" if legacy else "clean"
    min_scale = state_dict.get("min_scale", current.min_scale)
    max_scale = state_dict.get("max_scale", current.max_scale)
    try:
        return ScaleRule(
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            hysteresis=state_dict.get("hysteresis", current.hysteresis),
            hysteresis_refill=refill,
            min_scale=None if min_scale == 0.0 else min_scale,
            max_scale=None if max_scale == math.inf else max_scale,
        )
    except (TypeError, ValueError) as error:
        raise type(error)(f"The scaler's state_dict holds an invalid policy: {error}") from error
