"""Whatever a scaler loads or is set to, its own state dict stays loadable after any number of steps."""

from __future__ import annotations

import pytest
import torch

from gradscaler import GradScaler

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def clean_iterations(scaler: GradScaler, count: int) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for _ in range(count):
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()


def test_a_growth_tracker_at_or_past_the_interval_is_refused_at_load() -> None:
    scaler = GradScaler("cpu", growth_interval=2000)
    for tracker in (2000, INT32_MAX):
        with pytest.raises(
            ValueError, match=r"_growth_tracker'\] must be an int in \[0, 1999\].*growth_interval \(2000\)"
        ):
            scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": tracker})
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 1999})
    clean_iterations(scaler, 1)
    assert scaler.get_scale() == 2.0**17 and scaler.state_dict()["_growth_tracker"] == 0


def test_a_loaded_step_count_at_int64_max_saturates_and_reloads() -> None:
    scaler = GradScaler("cpu")
    scaler.load_state_dict({**scaler.state_dict(), "steps": INT64_MAX})
    clean_iterations(scaler, 2)
    saved = scaler.state_dict()
    assert saved["steps"] == INT64_MAX
    GradScaler("cpu").load_state_dict(saved)


@pytest.mark.parametrize("started", [False, True], ids=["before_scale", "after_scale"])
def test_lowering_the_growth_interval_keeps_the_tracker_below_it(started: bool) -> None:
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=100)
    if started:
        clean_iterations(scaler, 50)
    else:
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 50})
    scaler.set_growth_interval(10)
    assert scaler.state_dict()["_growth_tracker"] == 9
    GradScaler("cpu").load_state_dict(scaler.state_dict())
    clean_iterations(scaler, 1)  # the clean steps already counted reach the new interval
    assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 0
