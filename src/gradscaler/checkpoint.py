"""The scaler's state dict: torch's five keys plus ours, validated whole before anything is loaded."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gradscaler.rule import ScaleRule
from gradscaler.telemetry import COUNTERS

if TYPE_CHECKING:
    from gradscaler.scaler import GradScaler

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OUR_KEYS = (
    "hysteresis",
    "hysteresis_refill_on_growth",
    "min_scale",
    "max_scale",
    "_hysteresis_tracker",
    "steps",
    *COUNTERS,
)


def state_dict(scaler: GradScaler) -> dict[str, Any]:
    """Plain Python numbers only, so ``torch.load(..., weights_only=True)`` reads a checkpoint of it."""
    if not scaler._enabled:
        return {}
    r = scaler._rule
    from gradscaler.monitor import stats

    current = stats(scaler)
    out: dict[str, Any] = {
        "scale": current["scale"],
        "growth_factor": r.growth_factor,
        "backoff_factor": r.backoff_factor,
        "growth_interval": r.growth_interval,
        "_growth_tracker": current["growth_tracker"],
        "hysteresis": r.hysteresis,
        "hysteresis_refill_on_growth": r.hysteresis_refill == "growth",
        "min_scale": float(r.min_scale or 0.0),
        "max_scale": float(r.max_scale or math.inf),
        "_hysteresis_tracker": current["hysteresis_left"],
        "steps": current["steps"],
    }
    out.update({name: current[name] for name in COUNTERS})
    return out


def _number(d: dict[str, Any], key: str, *, integer: bool = False) -> Any:
    value = d[key]
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if (isinstance(value, bool) and key != "hysteresis_refill_on_growth") or not isinstance(value, kinds):
        wanted = "an int" if integer else "a float"
        raise TypeError(f"state_dict[{key!r}] must be {wanted}, got {type(value).__name__} {value!r}.")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"state_dict[{key!r}] is NaN.")
    return value


def _validated_rule(scaler: GradScaler, d: dict[str, Any]) -> ScaleRule:
    """The policy ``d`` describes, after checking every key's type and range."""
    if not isinstance(d, dict):
        raise TypeError(f"state_dict must be a dict, got {type(d).__name__}.")
    unknown = sorted(set(d) - set(TORCH_KEYS) - set(OUR_KEYS))
    if unknown:
        raise ValueError(f"Unknown keys in the scaler's state_dict: {unknown}. Known: {[*TORCH_KEYS, *OUR_KEYS]}.")
    missing = [k for k in TORCH_KEYS if k not in d]
    if missing:
        raise ValueError(f"The scaler's state_dict lacks {missing}: is it a GradScaler state_dict?")
    for key in d:
        _number(d, key, integer=key not in ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"))
    if not (math.isfinite(d["scale"]) and d["scale"] > 0):
        raise ValueError(f"state_dict['scale'] must be finite and > 0, got {d['scale']!r}.")
    for key in ("_growth_tracker", "steps", "_hysteresis_tracker", *COUNTERS):
        if key in d and d[key] < 0:
            raise ValueError(f"state_dict[{key!r}] must be >= 0, got {d[key]!r}.")
    min_scale = d.get("min_scale", scaler._rule.min_scale or 0.0)
    max_scale = d.get("max_scale", scaler._rule.max_scale or math.inf)
    refill = scaler._rule.hysteresis_refill
    if "hysteresis_refill_on_growth" in d:
        refill = "growth" if d["hysteresis_refill_on_growth"] else "clean"
    try:
        if d["growth_factor"] <= 1.0 or not d["backoff_factor"] < 1.0 or d["backoff_factor"] <= 0:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        if d["growth_interval"] < 1:
            raise ValueError("growth_interval must be >= 1")
        new_rule = ScaleRule(
            float(d["growth_factor"]),
            float(d["backoff_factor"]),
            int(d["growth_interval"]),
            int(d.get("hysteresis", scaler._rule.hysteresis)),
            refill,
            float(min_scale) if min_scale > 0 else None,
            float(max_scale) if math.isfinite(max_scale) else None,
        )
    except (ValueError, TypeError) as error:
        raise ValueError(f"The scaler's state_dict holds an invalid policy: {error}") from error
    return new_rule


def load_state_dict(scaler: GradScaler, d: dict[str, Any]) -> None:
    """Validate ``d`` whole, then load it; a refused dict leaves the scaler unchanged."""
    if not scaler._enabled:
        return
    if isinstance(d, dict) and len(d) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    scaler._rule = _validated_rule(scaler, d)
    scaler._init_scale = float(d["scale"])
    scaler._init_growth_tracker = int(d["_growth_tracker"])
    scaler._init_hysteresis_tracker = int(d.get("_hysteresis_tracker", scaler._rule.hysteresis))
    counters = [int(d.get(name, 0)) for name in COUNTERS]
    scaler._init_counters = counters
    scaler._steps = int(d.get("steps", scaler._steps))
    if scaler._scale is not None:
        scaler._scale.fill_(scaler._init_scale)
    if scaler._growth_tracker is not None:
        scaler._growth_tracker.fill_(scaler._init_growth_tracker)
    if scaler._hysteresis_tracker is not None:
        scaler._hysteresis_tracker.fill_(scaler._init_hysteresis_tracker)
    if scaler._telemetry is not None:
        scaler._telemetry.counters.copy_(scaler._telemetry.counters.new_tensor(counters))
