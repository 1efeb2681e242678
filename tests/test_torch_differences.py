"""The last differences from torch.amp.GradScaler's API: matched, or pinned as docs/migration.md states them."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from gradscaler import GradScaler
from test_sync import SyncCounter

# Settings torch checks only when the scaler is enabled: a disabled scaler builds with any of them.
UNCHECKED_WHEN_DISABLED = {
    "growth_factor_1": {"growth_factor": 1.0},
    "growth_interval_0": {"growth_interval": 0},
    "backoff_factor_0": {"backoff_factor": 0.0},
    "backoff_factor_2": {"backoff_factor": 2.0},
    "growth_factor_nan": {"growth_factor": math.nan},
    "init_scale_negative": {"init_scale": -1.0},
}


def disabled_scalers(cls: type, settings: dict[str, Any]) -> list[Any]:
    built = [cls("cpu", enabled=False, **settings)]
    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CUDA is not available. Disabling."
            built.append(cls("cuda", **settings))
    return built


@pytest.mark.parametrize("settings", UNCHECKED_WHEN_DISABLED.values(), ids=UNCHECKED_WHEN_DISABLED.keys())
def test_a_disabled_scaler_builds_wherever_torchs_does(settings: dict[str, Any]) -> None:
    assert all(not s.is_enabled() for s in disabled_scalers(torch.amp.GradScaler, settings))
    for scaler in disabled_scalers(GradScaler, settings):
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
        defaults = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
        for name, default in defaults.items():  # torch's raise AttributeError; ours give the default
            assert getattr(scaler, f"get_{name}")() == default
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=0.5)
        loss = param.sum()
        assert scaler.scale(loss) is loss
        loss.backward()
        scaler.step(optimizer)
        scaler.update()
        assert param.tolist() == [0.5, 0.5]
        scaler.set_growth_factor(0.5)  # torch's setters check nothing either
        scaler.set_backoff_factor(2.0)
        scaler.set_growth_interval(0)
    with pytest.raises((AssertionError, ValueError)):
        GradScaler("cpu", **settings)  # enabled: refused, as before


def started(cls: type, **settings: Any) -> Any:
    scaler = cls("cpu", **settings)
    scaler.scale(torch.ones(()))
    return scaler


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -4.0], ids=["nan", "inf", "zero", "negative"])
def test_a_bad_tensor_new_scale_is_refused_like_a_float(bad: float) -> None:
    theirs = started(torch.amp.GradScaler)
    theirs.update(torch.tensor(bad))
    assert theirs.get_scale() == bad or math.isnan(theirs.get_scale())  # torch takes it as it is
    ours = started(GradScaler, init_scale=8.0)
    with pytest.raises(ValueError, match="new_scale must be a finite number > 0"):
        ours.update(torch.tensor(bad))
    assert ours.get_scale() == 8.0
    ours.update(torch.tensor(16.0))
    assert ours.get_scale() == 16.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -4.0], ids=["nan", "inf", "zero", "negative"])
def test_where_reading_the_scale_syncs_a_bad_tensor_new_scale_leaves_the_scale(
    bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path, on the CPU: GRADSCALER_KERNEL=generic keeps the scale off the host fast path."""
    monkeypatch.setenv("GRADSCALER_KERNEL", "generic")
    ours = started(GradScaler, init_scale=8.0)
    with SyncCounter() as counter:
        ours.update(torch.tensor(bad))
        ours.update(torch.tensor(bad))
    assert counter.count == 0
    assert ours.get_scale() == 8.0
    ours.update(torch.tensor([32.0]))
    assert ours.get_scale() == 32.0


def test_a_one_element_1d_new_scale_is_taken_where_torch_refuses_it() -> None:
    """torch's message asks for "a 1-element tensor", then copies it into its 0-d scale and fails."""
    with pytest.raises(RuntimeError, match=r"output with shape \[\] doesn't match the broadcast shape \[1\]"):
        started(torch.amp.GradScaler).update(torch.tensor([4.0]))
    ours = started(GradScaler)
    ours.update(torch.tensor([4.0]))
    assert ours.get_scale() == 4.0


def test_an_init_scale_above_float32_max_starts_at_float32_max() -> None:
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        started(torch.amp.GradScaler, init_scale=1e39)
    ours = started(GradScaler, init_scale=1e39)
    assert ours.get_scale() == float(torch.finfo(torch.float32).max)


def test_a_tensor_init_scale_trains_with_torch_and_is_refused_by_ours() -> None:
    """torch computes with a tensor init_scale as with the float, but echoes the tensor back before the
    first scale() (get_scale, state_dict); ours keeps settings plain numbers and refuses it."""
    theirs = torch.amp.GradScaler("cpu", init_scale=torch.tensor(1024.0))
    assert isinstance(theirs.get_scale(), torch.Tensor)
    assert isinstance(theirs.state_dict()["scale"], torch.Tensor)
    theirs.scale(torch.ones(()))
    assert theirs.get_scale() == 1024.0
    with pytest.raises(TypeError, match="init_scale must be a real number"):
        GradScaler("cpu", init_scale=torch.tensor(1024.0))
