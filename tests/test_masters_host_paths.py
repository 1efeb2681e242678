"""The masters' step done as comparisons of whole lists and set updates (issue 44) keeps every answer of the call
per parameter it replaced: cases a review of that change found, each failing with the first version of it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import gradscaler
from gradscaler.masters import wrappers


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.randn(3, 4, dtype=model.weight.dtype)).float().pow(2).sum()


def test_a_scaler_that_moves_no_gradient_leaves_another_scalers_route_as_it_is() -> None:
    """Two scalers, an optimizer each over one float16 model: B's move finds no gradient (A moved them), so a
    clipping over ``model.parameters()`` still reaches A's masters (routes are made for the pairs that moved
    only; making them for all of B's pointed the parameters at B's masters, which have no gradient)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).half()
    first, second = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    a, b = (gradscaler.GradScaler("cpu", master_weights=True, init_scale=1.0) for _ in range(2))
    for _ in range(2):
        loss = _loss(model)
        (a.scale(loss) + 0 * b.scale(loss)).backward()
        a.clip_grad_norm_(first, 1e9)
        b.unscale_(second)
        master = first.param_groups[0]["params"][0]
        assert wrappers.stand_ins([model.weight])[0] is master
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        assert float(master.grad.abs().max()) <= float(torch.tensor(1e-3))  # clamped, in float32
        a.step(first)
        a.update()
        b.step(second)
        b.update()
        first.zero_grad()
        second.zero_grad()


def test_an_optimizer_dropped_before_update_takes_its_masters_with_it() -> None:
    """The scaler remembers the bindings that moved until ``update()`` weakly: an optimizer (and model) dropped
    after ``unscale_`` or ``step`` frees its masters at once, as before the list existed."""
    scaler = gradscaler.GradScaler("cpu", master_weights=True)
    for stepped in (False, True):
        model = torch.nn.Linear(64, 64).half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.randn(2, 64, dtype=torch.half)).float().sum()).backward()
        scaler.unscale_(optimizer)
        if stepped:
            scaler.step(optimizer)
        master = weakref.ref(optimizer.param_groups[0]["params"][0])
        del optimizer, model
        gc.collect()
        assert master() is None
        scaler.update()


def test_a_parameter_cast_to_float32_by_hand_after_the_backward_is_clipped_through_its_master() -> None:
    """``p.data = p.data.float()`` between the backward and ``unscale_`` leaves a float16 gradient on a float32
    parameter: its route is wide (from the parameter's dtype, not the gradient's), so torch's clipping over
    ``model.parameters()`` clips the master and the step goes on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gradscaler.GradScaler("cpu", master_weights=True, init_scale=2.0**4)
    for cast in (False, True):
        scaler.scale(_loss(model)).backward()
        if cast:
            for param in model.parameters():
                param.data = param.data.float()
            assert model.weight.grad is not None and model.weight.grad.dtype == torch.float16
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        masters = optimizer.param_groups[0]["params"]
        assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters])) <= 1.001e-3
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_the_copy_back_notes_a_dtype_changed_in_the_same_storage() -> None:
    """``p.data = p.data.view(torch.bfloat16)`` keeps the storage and its address: the copy back notes the new
    dtype as ``Pair.seen`` does (an in-place write after it is then taken as a write in that dtype)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gradscaler.GradScaler("cpu", master_weights=True, init_scale=1.0)

    def iteration() -> None:
        scaler.scale(_loss(model)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    iteration()
    model.weight.data = model.weight.data.view(torch.bfloat16)
    iteration()
    pair = scaler._masters._bindings[optimizer].pairs[0]
    assert pair.low_dtype == torch.bfloat16
    with torch.no_grad():
        model.weight.mul_(1.0)
    iteration()
    assert pair.exact and pair.low_dtype == torch.bfloat16


def _fails_at(call: int) -> Any:
    """``torch.empty_like`` that runs out of memory (raised by hand) at its ``call``-th call."""
    real, made = torch.empty_like, [0]

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        made[0] += 1
        if made[0] == call:
            raise torch.OutOfMemoryError("out of memory (raised by the test)")
        return real(*args, **kwargs)

    return empty_like


def test_running_out_of_memory_for_the_masters_gradients_leaves_the_parameters_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The masters' float32 gradient buffers are allocated before the float16 gradients are dropped: a step whose
    allocation fails (out of memory, raised by hand at the second buffer) leaves every parameter's gradient as the
    backward wrote it, and the same step retried gives the run of a step that never failed."""
    runs = []
    for fail in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = gradscaler.GradScaler("cpu", master_weights=True, init_scale=2.0**4)
        scaler.scale(model(torch.randn(3, 4, dtype=torch.half)).float().pow(2).sum()).backward()
        if fail:
            written = [p.grad.clone() for p in model.parameters()]
            with monkeypatch.context() as patch, pytest.raises(torch.OutOfMemoryError):
                patch.setattr(torch, "empty_like", _fails_at(2))
                scaler.step(optimizer)
            params = list(model.parameters())
            assert [p.grad is not None and torch.equal(p.grad, w) for p, w in zip(params, written, strict=True)] == [
                True
            ] * len(params)
        scaler.step(optimizer)
        scaler.update()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
