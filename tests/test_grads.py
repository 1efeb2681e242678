"""Gradient grouping and checking: sparse, complex, float16, several dtypes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.grads import group_grads, nonfinite_flags


def test_sparse_gradients_are_unscaled_like_torch() -> None:
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=8.0)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor([1, 2, 2, 7])).sum()).backward()
            if step == 1:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        results.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == 4.0


@pytest.mark.parametrize("scaler_cls", [GradScaler, torch.amp.GradScaler], ids=["ours", "torch"])
def test_fp16_sparse_gradients_are_coalesced_before_the_check(scaler_cls) -> None:
    param = nn.Parameter(torch.zeros(4, 2, dtype=torch.float16))
    # Two entries for row 1 that are finite apart but sum past float16's max.
    indices = torch.tensor([[1, 1]])
    values = torch.full((2, 2), 60000.0, dtype=torch.float16)
    param.grad = torch.sparse_coo_tensor(indices, values, (4, 2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = scaler_cls("cpu")
    scaler.scale(torch.ones(()))
    found = scaler._check_inf_per_device(opt)
    assert float(found[torch.device("cpu")]) == 1.0
    assert param.grad.is_coalesced()


def test_complex_gradients_checked_on_real_and_imaginary_parts() -> None:
    param = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu", init_scale=16.0)
    loss = (param * torch.tensor([2 - 1j, 1 + 1j])).real.sum()
    scaler.scale(loss).backward()
    expected = param.grad / 16
    scaler.unscale_(opt)
    assert torch.equal(param.grad, expected)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 16.0
    scaler.scale(loss.detach() * 0 + (param * 1).real.sum()).backward()
    param.grad.imag[1] = float("inf")
    before = param.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), before) and scaler.get_scale() == 8.0


def test_fp16_gradients_are_refused_with_advice() -> None:
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\. .*torch\.autocast"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\."):
        _torch_refuses(opt)


def _torch_refuses(opt: torch.optim.Optimizer) -> None:
    theirs = torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(()))
    theirs.unscale_(opt)


def test_groups_by_device_and_dtype_and_check_writes_nothing() -> None:
    a = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(2, dtype=torch.float64))
    c = nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    for p in (a, b, c):
        p.grad = torch.full_like(p, 3.0)
    b.grad[1] = float("nan")
    opt = torch.optim.SGD([a, b, c], lr=0.1)
    groups = group_grads(opt, allow_fp16=True)
    assert set(groups[torch.device("cpu")]) == {torch.float32, torch.float64, torch.bfloat16}
    flags = nonfinite_flags(groups)
    assert float(flags[torch.device("cpu")]) == 1.0
    assert torch.equal(a.grad, torch.full((3,), 3.0)) and float(b.grad[0]) == 3.0
