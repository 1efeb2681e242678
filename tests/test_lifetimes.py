"""Nothing a scaler keeps between iterations holds a model or an optimizer alive (issue 20, item 3).

A scaler reused across sweep trials, or optimizers rebuilt every epoch, must let each old model and
optimizer be collected, and a new object at a reused ``id`` must never inherit an old entry.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from helpers import swap_future


def trial(scaler: GradScaler, mode: str, seed: int) -> tuple[list[weakref.ref], nn.Module, torch.optim.Optimizer]:
    """Three iterations with clipping and named parameters; weak references to what must be freed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    flags = {"fused": True} if mode == "fused" else {"foreach": mode == "foreach"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
    scaler.name_parameters(model)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).square().mean()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    refs = [weakref.ref(model), weakref.ref(opt), *(weakref.ref(p) for p in model.parameters())]
    return refs, model, opt


@pytest.mark.parametrize("mode", ["forloop", "foreach", "fused"])
def test_a_deleted_model_and_optimizer_are_collected(mode: str) -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10)
    refs, model, opt = trial(scaler, mode, seed=0)
    assert len(scaler.last_grad_norms()) == 4
    del model, opt
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    assert scaler.last_grad_norms() == {}  # the dead optimizer's norms went with it
    _refs, _model, _opt = trial(scaler, mode, seed=1)  # the next sweep trial, same scaler (kept alive)
    assert sorted(scaler.last_grad_norms()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_new_parameter_never_inherits_a_dead_ones_name() -> None:
    """Names were keyed by ``id(param)``: a new parameter at a dead one's address took its name."""
    scaler = GradScaler("cpu")
    old = torch.zeros(3, requires_grad=True)
    scaler.name_parameters([("old", old)])
    address = id(old)
    del old
    gc.collect()
    kept = []  # CPython soon reuses the freed address for an object of the same type
    for _ in range(10_000):
        new = torch.zeros(3, requires_grad=True)
        if id(new) == address:
            break
        kept.append(new)
    else:
        pytest.skip("no new parameter took the freed address")
    opt = torch.optim.SGD([new], lr=0.1)
    new.grad = torch.full((3,), float("inf"))
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.nonfinite_parameters() == ["param_groups[0][0] (3,)"]


def test_naming_a_module_keeps_no_weak_reference_to_its_parameters_and_names_them_after_a_swap() -> None:
    """``name_parameters(model)`` held each parameter weakly, so ``model.float()`` under torch's
    swap-tensors future (``torch.utils.swap_tensors`` refuses a weakly referenced tensor) failed."""
    with swap_future(True):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        scaler = GradScaler("cpu")
        scaler.name_parameters(model)
        model.double()
        model.float()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 4)).sum().backward()
        model[2].weight.grad.fill_(float("inf"))
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        assert scaler.nonfinite_parameters() == ["2.weight"]
    assert weakref.getweakrefs(model[0].weight) == []
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None and scaler.nonfinite_parameters() == []


def test_a_model_thrown_away_in_the_first_accumulating_iteration_is_collected() -> None:
    """With float32 sums the first iteration's hooked parameters are held weakly until they are bound:
    a retry that rebuilds the model (after an out-of-memory error, say) does not keep the old one."""
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).half()
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    refs = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    del model
    gc.collect()
    assert [ref() is None for ref in refs] == [True] * len(refs)
