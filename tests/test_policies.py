"""Policies beyond torch, end to end through GradScaler: hysteresis, bounds, collapse, bf16 guard."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradscaler import GradScaler, ScaleCollapseError, ScaleCollapseWarning


def drive(scaler: GradScaler, flags: list[bool], model: nn.Module | None = None) -> list[float]:
    """One step per flag (True: a NaN is injected); returns the scale after each update."""
    model = model or nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for bad in flags:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        if bad:
            model.weight.grad[0, 0] = math.nan
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


T, F = True, False


def test_hysteresis_backs_off_after_n_consecutive_overflows() -> None:
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2, growth_interval=1000)
    assert drive(scaler, [T, F, T, T, T]) == [64, 64, 64, 32, 16]
    assert scaler.stats()["skipped_steps"] == 4


def test_hysteresis_megatron_refill_on_growth_only() -> None:
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2, hysteresis_refill="growth", growth_interval=3)
    # T (left 1), F, T (left 0: backoff), F, F, F (growth refills), T (left 1), T (backoff)
    assert drive(scaler, [T, F, T, F, F, F, T, T]) == [64, 64, 32, 32, 32, 64, 64, 32]


def test_min_and_max_scale() -> None:
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=32.0, collapse_patience=None)
    assert drive(scaler, [F, F, F, T, T, T, T]) == [16, 32, 32, 16, 8, 4, 2]
    assert drive(scaler, [T, T]) == [2, 2]


def test_init_scale_is_clamped_into_the_bounds() -> None:
    assert GradScaler("cpu", init_scale=2.0**20, max_scale=1024.0).get_scale() == 1024.0


def test_scale_never_reaches_zero_with_defaults() -> None:
    scaler = GradScaler("cpu", init_scale=1.0, collapse_patience=None)
    scales = drive(scaler, [T] * 160)
    assert min(scales) == 2.0**-126 and all(s > 0 and math.isfinite(1 / s) for s in scales)


def test_torch_reaches_zero_where_we_do_not() -> None:
    """The defect we fix, observed: torch's scale becomes 0 after enough overflows."""
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(160):
        opt.zero_grad()
        theirs.scale(model(torch.ones(2, 3)).sum()).backward()
        model.weight.grad[0, 0] = math.nan
        theirs.step(opt)
        theirs.update()
    assert theirs.get_scale() == 0.0


def test_collapse_raises_with_names_step_scale_and_causes() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=1.0, collapse_patience=3)
    scaler.name_parameters(model)
    with pytest.raises(ScaleCollapseError) as excinfo:
        drive(scaler, [F] * 10, model=_poisoned(model))
    message = str(excinfo.value)
    assert "3 consecutive overflowing steps at the minimum scale 1" in message
    assert "at step 5" in message  # 2 backoffs reach the floor, then 3 overflows at it
    assert "0.weight" in message and "1.bias" not in message
    assert "bfloat16" in message and "float16" in message and "NaN" in message


def _poisoned(model: nn.Sequential) -> nn.Sequential:
    """Every backward leaves a NaN in the first layer's weight gradient."""
    model[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.nan))
    return model


def test_collapse_warns_once_per_episode() -> None:
    model = _poisoned(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)))
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, collapse_patience=2, on_collapse="warn")
    with pytest.warns(ScaleCollapseWarning, match="param_groups\\[0\\]\\[0\\] \\(4, 3\\)") as record:
        drive(scaler, [F] * 6, model=model)
    assert len([w for w in record if issubclass(w.category, ScaleCollapseWarning)]) == 1


def test_bf16_guard_keeps_scale_one_and_still_skips() -> None:
    scaler = GradScaler.for_bf16("cpu", growth_interval=1)
    assert drive(scaler, [F, F, T, F]) == [1.0, 1.0, 1.0, 1.0]
    stats = scaler.stats()
    assert stats["skipped_steps"] == 1 and stats["growths"] == 0 and stats["backoffs"] == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"hysteresis": 0}, ValueError, "hysteresis must be an int in \\[1, 2147483647\\]"),
        ({"min_scale": -1.0}, ValueError, "min_scale must be a finite number > 0, got -1.0"),
        ({"max_scale": "big"}, TypeError, "max_scale must be a real number \\(int or float\\), got str 'big'"),
        ({"on_collapse": "ignore"}, ValueError, "on_collapse must be 'raise' or 'warn', got 'ignore'"),
        ({"collapse_patience": 0}, ValueError, "collapse_patience must be an int >= 1 or None, got 0"),
        ({"history": 0}, ValueError, "history must be an int in \\[1, 2147483647\\], got 0"),
    ],
)
def test_bad_policy_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GradScaler("cpu", **kwargs)
