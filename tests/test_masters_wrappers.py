"""Optimizers that wrap an optimizer, or hold one of their own, under ``master_weights=True``.

Accelerate's ``AcceleratedOptimizer`` and Lightning Fabric's optimizer share the wrapped optimizer's
``param_groups``: every scaler entry point takes them for the optimizer they wrap (tested with the real
packages). torch's ``ZeroRedundancyOptimizer`` steps through an inner optimizer of its own: refused at the
first step, with what to do, before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradscaler import GradScaler
from integration_helpers import fresh_accelerate_state  # noqa: F401 (an autouse fixture)
from recipe import OPTIMIZERS, SCALER_ARGS, OursScalerClips, RecipeScalerClips, assert_same_trace, new_trace
from test_masters_lifecycle import Experts, data, run

pytestmark = pytest.mark.integration


class Wrapped(OursScalerClips):
    """Ours, with the scaler handed the wrapper a framework gives back."""

    def __init__(self, wrap: Callable[[torch.optim.Optimizer], Any]) -> None:
        super().__init__(Experts(), OPTIMIZERS["adamw_foreach"])
        self.inner, self.optimizer = self.optimizer, wrap(self.optimizer)


def check_wrapper(wrap: Callable[[torch.optim.Optimizer], Any]) -> None:
    ours = Wrapped(wrap)
    reference = RecipeScalerClips(Experts(), OPTIMIZERS["adamw_foreach"], GradScaler("cpu", **SCALER_ARGS))
    assert_same_trace(run(ours, range(8), new_trace(), clip=0.5), run(reference, range(8), new_trace(), clip=0.5))
    pairs = ours.scaler.master_weights(ours.optimizer)
    assert pairs == ours.scaler.master_weights(ours.inner)
    low = [p for p in ours.model.parameters() if p.dtype == torch.float16]
    assert [p for p, _ in pairs] == low
    assert all(m.dtype == torch.float32 and torch.equal(m.half(), p) for p, m in pairs)


def test_accelerated_optimizer_is_taken_for_the_optimizer_it_wraps() -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator = Accelerator(cpu=True)

    def wrap(optimizer: torch.optim.Optimizer) -> Any:
        wrapped = accelerator.prepare_optimizer(optimizer)
        assert isinstance(wrapped, AcceleratedOptimizer)
        return wrapped

    check_wrapper(wrap)


def test_fabric_optimizer_is_taken_for_the_optimizer_it_wraps() -> None:
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=1)

    def wrap(optimizer: torch.optim.Optimizer) -> Any:
        wrapped = fabric.setup_optimizers(optimizer)
        assert wrapped is not optimizer and wrapped.optimizer is optimizer
        return wrapped

    check_wrapper(wrap)


@pytest.fixture
def one_rank() -> Any:
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("later", [False, True], ids=["first_step", "add_param_group"])
def test_zero_redundancy_optimizer_is_refused_before_anything_changes(one_rank: Any, later: bool) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = Experts()
    params = [p for p in model.parameters() if p.requires_grad]
    first = [p for p in params if (p.dtype == torch.float32) == later]  # ZeRO takes one dtype at a time
    optimizer = ZeroRedundancyOptimizer(first, optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", master_weights=True, **SCALER_ARGS)
    if later:  # float32 only at first: nothing to master; then float16 parameters join
        scaler.scale(model(data(1)[0][0], 0).float().sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad()
        optimizer.add_param_group({"params": [p for p in params if p.dtype == torch.float16]})
    else:
        model.norm.requires_grad_(False)
    before = [list(g["params"]) for g in optimizer.param_groups]
    scaler.scale(model(data(1)[0][0], 1).float().sum()).backward()
    with pytest.raises(ValueError, match=r"fully_shard.*cannot train ZeroRedundancyOptimizer: .*'optim'"):
        scaler.step(optimizer)
    after = [list(g["params"]) for g in optimizer.param_groups]
    assert [[id(p) for p in g] for g in after] == [[id(p) for p in g] for g in before]
    assert model.inp.weight.grad is not None and model.head.weight.grad is not None  # still the model's
