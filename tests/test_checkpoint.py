"""checkpoint.py on its own: build and parse state dicts as values, no GradScaler involved."""

from __future__ import annotations

import io
import math

import pytest
import torch

from gradscaler.checkpoint import TORCH_KEYS, ScalerState, build_state_dict, parse_state_dict
from gradscaler.rule import FLOAT32_MAX, SCALE_FLOOR, ScaleRule

RULE = ScaleRule(3.0, 0.25, 17, 3, "growth", 2.0, 2.0**20)
STATE = ScalerState(RULE, 512.0, 5, 2, [7, 1, 4, 3, 0], 99)
PLAIN = ScalerState(ScaleRule(), 2.0**16, 0, 1, [0, 0, 0, 0, 0], 0)


def test_build_then_parse_gives_the_same_values() -> None:
    built = build_state_dict(STATE)
    assert parse_state_dict(built, ScaleRule()) == STATE
    assert all(isinstance(v, (int, float, str)) for v in built.values())


def test_built_dict_loads_with_weights_only() -> None:
    buffer = io.BytesIO()
    torch.save(build_state_dict(STATE), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == build_state_dict(STATE)


def test_a_torch_state_dict_keeps_the_current_extensions() -> None:
    torch_dict = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100}
    parsed = parse_state_dict({**torch_dict, "_growth_tracker": 3}, RULE)
    assert parsed.rule == ScaleRule(2.0, 0.5, 100, 3, "growth", 2.0, 2.0**20)
    assert (parsed.scale, parsed.growth_tracker, parsed.hysteresis_tracker, parsed.steps) == (1024.0, 3, 3, 0)
    assert parsed.counters == [0, 0, 0, 0, 0]


def test_the_legacy_refill_key_of_0_1_0_still_loads() -> None:
    legacy = build_state_dict(STATE)
    del legacy["hysteresis_refill"]
    legacy["hysteresis_refill_on_growth"] = False
    assert parse_state_dict(legacy, ScaleRule()).rule.hysteresis_refill == "clean"


@pytest.mark.parametrize(
    ("scale", "expected"),
    [(1e-45, 2.0), (1e-300, 2.0), (2.0**30, 2.0**20)],
    ids=["subnormal", "zero_in_float32", "above_max_scale"],
)
def test_a_scale_outside_the_policy_is_moved_into_its_bounds(scale: float, expected: float) -> None:
    assert parse_state_dict({**build_state_dict(STATE), "scale": scale}, ScaleRule()).scale == expected


def test_without_bounds_a_tiny_scale_lands_on_the_floor() -> None:
    assert parse_state_dict({**build_state_dict(PLAIN), "scale": 1e-45}, ScaleRule()).scale == SCALE_FLOOR


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("scale", math.nan, ValueError),
        ("scale", 1e300, ValueError),
        ("scale", True, TypeError),
        ("_growth_tracker", 2**31, ValueError),
        ("_growth_tracker", 17, ValueError),  # RULE's growth_interval: the rule would count past it and wrap
        ("_hysteresis_tracker", 4, ValueError),
        ("steps", -1, ValueError),
        ("growths", 2.0, TypeError),
        ("growth_factor", math.inf, ValueError),
        ("backoff_factor", 0.0, ValueError),
        ("growth_interval", 0, ValueError),
        ("max_scale", 1e-40, ValueError),
    ],
)
def test_each_bad_value_is_refused_by_name(key: str, value: object, error: type) -> None:
    with pytest.raises(error, match=key):
        parse_state_dict({**build_state_dict(STATE), key: value}, ScaleRule())


def test_missing_and_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match=r"lacks \['_growth_tracker'\]"):
        parse_state_dict({k: v for k, v in build_state_dict(STATE).items() if k != "_growth_tracker"}, RULE)
    with pytest.raises(ValueError, match=r"Unknown keys .*\['extra'\]"):
        parse_state_dict({**build_state_dict(STATE), "extra": 1}, RULE)
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        parse_state_dict([], RULE)
    assert set(TORCH_KEYS) <= set(build_state_dict(STATE))


def test_float32_max_itself_is_a_valid_scale() -> None:
    assert parse_state_dict({**build_state_dict(PLAIN), "scale": FLOAT32_MAX}, ScaleRule()).scale == FLOAT32_MAX
