"""No host sync: ``aten._local_scalar_dense`` (what .item(), bool() and float() call) is counted.

The read pass runs its device-generic torch path here (``GRADSCALER_KERNEL=generic``), the one CUDA
takes without Triton: the CPU path reads its own results once, which costs nothing on the CPU but
would hide a host read in the scaler's code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradscaler import GradScaler


@pytest.fixture(autouse=True)
def generic_read_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSCALER_KERNEL", "generic")


class SyncCounter(TorchDispatchMode):
    """Counts host reads of tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """AdamW when fused; else SGD with momentum, whose CPU step itself reads no tensor value."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if fused:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)


@pytest.mark.parametrize("recipe", ["plain", "unscale", "clip"])
@pytest.mark.parametrize("inject", [False, True], ids=["clean", "overflow"])
def test_fused_path_makes_no_sync(recipe: str, inject: bool) -> None:
    model, opt = make(fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler.name_parameters(model)
    records: list[dict] = []
    scaler.add_logger(records.append, every=1)  # telemetry and attribution on: they must not sync either
    counts = []
    for step in range(6):
        opt.zero_grad()
        counter = SyncCounter()
        with counter:
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            if inject and step >= 3:
                model[0].weight.grad[0, 0] = float("nan")
            if recipe == "unscale":
                scaler.unscale_(opt)
            elif recipe == "clip":
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        counts.append(counter.count)
    # The very first step of a fused optimizer with empty state syncs once (documented); none after.
    assert counts[1:] == [0] * 5, counts
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert counts[0] <= 1
    assert_attributed(records, inject, recipe == "clip")


def assert_attributed(records: list[dict], inject: bool, clipped: bool) -> None:
    """Steps 4-6 overflowed in ``0.weight`` when ``inject``: the log names it and has the clipping norm."""
    assert [r["skipped"] for r in records] == [False] * 3 + [inject] * 3
    assert [r.get("nonfinite") for r in records[3:]] == (
        [["0.weight"]] * 3 if inject else [[], None, []]
    )  # growths at 4 and 6
    assert all(("grad_norm" in r) == clipped for r in records)


@pytest.mark.parametrize("recipe", ["plain", "unscale", "clip"])
def test_non_fused_step_makes_exactly_one_sync(recipe: str) -> None:
    model, opt = make(fused=False)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    records: list[dict] = []
    scaler.add_logger(records.append, every=1)  # attribution by a second read pass: no sync either
    for step in range(3):
        opt.zero_grad()
        counter = SyncCounter()
        with counter:
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            if recipe == "unscale":
                scaler.unscale_(opt)
            elif recipe == "clip":
                scaler.clip_grad_norm_(opt, 1.0)
            if step == 2:
                model[2].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        assert counter.count == 1
    named = ["param_groups[0][3] (2,)"] if recipe == "plain" else None  # else the inf came after the check
    assert [r.get("nonfinite") for r in records] == [None, None, named]
    assert all(("grad_norm" in r) == (recipe == "clip") for r in records)


def test_torch_non_fused_step_syncs_too() -> None:
    """The oracle for the counter itself: torch's scaler syncs once per device per optimizer."""
    model, opt = make(fused=False)
    scaler = torch.amp.GradScaler("cpu")
    counter = SyncCounter()
    with counter:
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        scaler.step(opt)
    assert counter.count == 1
