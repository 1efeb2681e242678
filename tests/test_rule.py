"""The update rule on its own: literal overflow sequences, exact scales (powers of two)."""

from __future__ import annotations

import random

import pytest
import torch

from gradscaler.rule import SCALE_FLOOR, ScaleRule, update_scale_, update_scale_reference_


def trajectory(rule: ScaleRule, flags: list[bool], init: float = 8.0, reference: bool = False) -> list[float]:
    scale = torch.tensor(init)
    tracker = torch.tensor(0, dtype=torch.int32)
    hyst = torch.tensor(rule.hysteresis, dtype=torch.int32)
    step = update_scale_reference_ if reference else update_scale_
    out = []
    for flag in flags:
        step(scale, tracker, hyst, torch.tensor(float(flag)), rule)
        out.append(float(scale))
    return out


T, F = True, False


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "where"])
def test_torch_rule_growth_and_backoff(reference: bool) -> None:
    rule = ScaleRule(growth_interval=3)
    got = trajectory(rule, [F, F, F, F, T, F, F, F, T, T], reference=reference)
    assert got == [8, 8, 16, 16, 8, 8, 8, 16, 8, 4]


def test_growth_refused_when_not_finite() -> None:
    rule = ScaleRule(growth_interval=1)
    big = float(torch.finfo(torch.float32).max) / 1.5
    got = trajectory(rule, [F, F], init=big)
    assert got == [pytest.approx(big), pytest.approx(big)]
    assert all(torch.isfinite(torch.tensor(got)))


def test_scale_never_reaches_zero() -> None:
    got = trajectory(ScaleRule(), [T] * 400, init=1.0)
    assert min(got) == SCALE_FLOOR
    assert torch.isfinite(1 / torch.tensor(got[-1]))


def test_min_and_max_scale_bound_the_scale() -> None:
    rule = ScaleRule(growth_interval=1, min_scale=2.0, max_scale=32.0)
    assert trajectory(rule, [F, F, F, F]) == [16, 32, 32, 32]
    assert trajectory(rule, [T, T, T, T]) == [4, 2, 2, 2]


def test_hysteresis_refilled_by_clean_steps() -> None:
    rule = ScaleRule(growth_interval=100, hysteresis=3)
    # two overflows tolerated, the third consecutive one backs off; a clean step refills.
    assert trajectory(rule, [T, T, F, T, T, T, T]) == [8, 8, 8, 8, 8, 4, 2]


def test_hysteresis_refilled_only_by_growth_megatron() -> None:
    rule = ScaleRule(growth_interval=2, hysteresis=2, hysteresis_refill="growth")
    # T: left 1; F; T: left 0 -> backoff (a clean step did not refill); F, F: growth refills to 2.
    assert trajectory(rule, [T, F, T, F, F, T, T]) == [8, 8, 4, 4, 8, 8, 4]


@pytest.mark.parametrize("seed", range(5))
def test_kernel_and_reference_agree_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    flags = [rng.random() < 0.3 for _ in range(300)]
    rule = ScaleRule(growth_factor=1.7, backoff_factor=0.3, growth_interval=3)
    assert trajectory(rule, flags, init=3000.0) == trajectory(rule, flags, init=3000.0, reference=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"hysteresis_refill": "never"}, "hysteresis_refill must be one of"),
        ({"min_scale": 0.0}, "min_scale must be a finite number > 0, got 0.0"),
        ({"max_scale": float("inf")}, "max_scale must be a finite number > 0, got inf"),
        ({"min_scale": 8.0, "max_scale": 4.0}, r"min_scale \(8.0\) must not exceed max_scale \(4.0\)"),
    ],
)
def test_rule_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScaleRule(**kwargs)
