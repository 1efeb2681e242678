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
