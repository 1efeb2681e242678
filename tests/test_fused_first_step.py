"""A skipped step leaves the run exactly as if the optimizer had never been called.

torch's scaler lets a skipped FIRST step reach a fused optimizer: the optimizer creates its state,
the kernel returns early, and fused SGD keeps uninitialised momentum buffers that the next step reads.
The reference here is the same run where the skipped step never reaches the optimizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from helpers import OPTIMIZERS, assert_same_state, batches, make_model, make_optimizer, optimizer_state


def train(optimizer: str, skip_steps: set[int], *, reference: bool) -> tuple[list[torch.Tensor], dict]:
    net = make_model("mlp")
    opt = make_optimizer(optimizer, "fused", net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if reference else GradScaler("cpu", init_scale=2.0**8)
    for step, (x, y) in enumerate(batches("mlp", 6)):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
        if step in skip_steps:
            next(net.parameters()).grad.view(-1)[0] = float("inf")
            if reference:
                scaler._check_inf_per_device(opt)  # record the overflow; never call the optimizer
                scaler.update()
                continue
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in net.parameters()], optimizer_state(opt)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("skips", [{0}, {0, 1}, {0, 3}], ids=["first", "first_two", "first_and_later"])
def test_skipped_first_step_equals_never_calling_the_optimizer(optimizer: str, skips: set[int]) -> None:
    ours_params, ours_state = train(optimizer, skips, reference=False)
    ref_params, ref_state = train(optimizer, skips, reference=True)
    for a, b in zip(ours_params, ref_params, strict=True):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()
    assert_same_state(ours_state, ref_state, "optimizer state")


@pytest.mark.parametrize("error", [RuntimeError("logging failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_an_exception_after_the_skipped_kernel_leaves_no_state(error: BaseException) -> None:
    """Issue 20, item 5(a): a step post-hook raising after the skipped first step's kernel ran; the
    loop retries ``step``. The uninitialised momentum buffers must not survive, as without the error."""
    net = make_model("mlp")
    opt = make_optimizer("sgd", "fused", net.parameters())
    raised: list[bool] = []

    def fail_once(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not raised:
            raised.append(True)
            raise error

    opt.register_step_post_hook(fail_once)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    for step, (x, y) in enumerate(batches("mlp", 6)):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
        if step == 0:
            next(net.parameters()).grad.view(-1)[0] = float("inf")
            with pytest.raises(type(error)):
                scaler.step(opt)
            assert not any(opt.state.values())  # the skipped kernel's buffers are gone already
        scaler.step(opt)  # the retry (a no-op skip at step 0)
        scaler.update()
    ref_params, ref_state = train("sgd", {0}, reference=True)
    for a, b in zip([p.detach() for p in net.parameters()], ref_params, strict=True):
        assert torch.equal(a, b)
    assert_same_state(optimizer_state(opt), ref_state, "optimizer state")


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_a_parameter_swapped_in_gets_no_state_from_a_skipped_step(optimizer: str) -> None:
    """Issue 20, item 5(b): the swapped-out parameter's state is still held, so the optimizer holds as
    many states as parameters; the new parameter's first step is skipped and must leave none. (torch's
    fused SGD with momentum refuses a parameter without a buffer beside ones with: TypeError.)"""
    torch.manual_seed(0)
    old, kept, new = (nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = make_optimizer(optimizer, "fused", [old, kept])
    scaler = GradScaler("cpu", init_scale=2.0**8)
    for param in (old, kept):
        param.grad = torch.ones(4)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    opt.param_groups[0]["params"][0] = new  # old's state stays in opt.state
    new.grad, kept.grad = torch.full((4,), float("inf")), torch.ones(4)
    scaler.step(opt)
    scaler.update()
    assert old in opt.state and not opt.state.get(new)
