"""Gradient grouping and checking: sparse, complex, float16, several dtypes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.grads import WeakById, group_grads, nonfinite_flags


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
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\. .*torch\.autocast") as caught:
        scaler.unscale_(opt)
    # both ways to train float16 parameters: the argument, and the one line for code one does not edit
    assert "GradScaler(..., master_weights=True)" in str(caught.value)
    assert "gradscaler.patch_torch(master_weights=True) before it builds its scaler" in str(caught.value)
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
    groups = group_grads(list(opt.param_groups[0]["params"]), allow_fp16=True)
    assert set(groups[torch.device("cpu")]) == {torch.float32, torch.float64, torch.bfloat16}
    flags = nonfinite_flags(groups)
    assert float(flags[torch.device("cpu")]) == 1.0
    assert torch.equal(a.grad, torch.full((3,), 3.0)) and float(b.grad[0]) == 3.0


# The scaler caches each optimizer's parameter list between iterations (grads.ParamList); gradients
# are read afresh every time. Each event below must be seen exactly as an uncached run (torch's) sees it.
def _event_run(scaler_cls: type, event: str) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    opt = torch.optim.SGD(first.parameters(), lr=0.1, foreach=True)
    scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=1)
    scales = []
    for step in range(5):
        opt.zero_grad(set_to_none=event != "zero_in_place")
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
        if event == "dtype_changed" and step == 3:  # the parameters (so the gradients) become float64
            first.double(), second.double()
        if event == "dtype_changed" and step >= 3:
            x = x.double()
        loss = second(first(x)).sum() if event != "grad_appears" or step >= 2 else first(x).sum()
        if event == "grad_appears" and step < 2:
            second.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if step == 2 and event == "group_added":
            opt.add_param_group({"params": list(second.parameters())})
        if step == 2 and event == "param_replaced":
            opt.param_groups[0]["params"][0] = second.weight
        if step == 2 and event == "grad_appears":
            opt.add_param_group({"params": list(second.parameters())})
        if step in (2, 3) and event != "dtype_changed":
            second.weight.grad[0, 0] = float("inf")  # seen only if the cache follows the change
        if step == 4 and event == "dtype_changed":
            first.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in (*first.parameters(), *second.parameters())]


@pytest.mark.parametrize(
    "event", ["group_added", "param_replaced", "grad_appears", "dtype_changed", "zero_in_place", "set_to_none"]
)
def test_cached_parameter_lists_follow_every_change(event: str) -> None:
    ours_scales, ours_params = _event_run(GradScaler, event)
    torch_scales, torch_params = _event_run(torch.amp.GradScaler, event)
    assert ours_scales == torch_scales
    for a, b in zip(ours_params, torch_params, strict=True):
        assert torch.equal(a, b)


def test_param_list_rebuilds_on_identity_not_on_equality() -> None:
    from gradscaler.grads import ParamList

    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([a], lr=0.1)
    cache = ParamList()
    assert cache.of(opt) == [a] and cache.of(opt) is cache.of(opt)
    opt.param_groups[0]["params"][0] = b  # equal values, another tensor
    assert cache.of(opt)[0] is b
    opt.add_param_group({"params": [a]})
    assert [id(p) for p in cache.of(opt)] == [id(b), id(a)]


def test_weak_by_id_keeps_nothing_alive_and_matches_identity() -> None:
    cache: WeakById[str] = WeakById()
    a, b = torch.zeros(2), torch.zeros(2)
    cache[a] = "a"
    assert (cache.get(a), cache.get(b), cache.values()) == ("a", None, ["a"])
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None and cache.values() == [] and cache._data == {}


@pytest.mark.parametrize("empty_group", [False, True])
def test_peaks_are_the_inf_norms_of_the_check(empty_group: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grads.peaks`` (a logged update's read for the names) gives the inf-norms ``norms_and_check`` gives, in its
    order and dtype, for every dtype, with inf, NaN, -inf and empty gradients, and for a dtype whose gradients are
    all empty. On the device route without Triton, the one route where it runs ops of its own (elsewhere it is
    ``grad_stats``' own call); a NaN may carry other payload bits there (nothing reads them: a NaN is non-finite)."""
    from gradscaler.grads import norms_and_check, peaks

    monkeypatch.setenv("GRADSCALER_KERNEL", "generic")
    gen = torch.Generator().manual_seed(0)
    params = []
    cases = (
        [((0,), None), ((0, 4), None)]
        if empty_group
        else [
            ((5, 3), None),
            ((0,), None),
            ((7,), float("inf")),
            ((4,), float("nan")),
            ((3,), -float("inf")),
        ]
    )
    dtypes = (torch.float16,) if empty_group else (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for dtype in dtypes:  # one dtype alone: no cat across dtypes to promote what it returns
        for shape, poison in cases:
            p = nn.Parameter(torch.zeros(shape, dtype=dtype))
            p.grad = (torch.randn(shape, generator=gen) * 1000).to(dtype)
            if poison is not None:
                p.grad[1] = poison
            params.append(p)
    groups = group_grads(params, allow_fp16=True)
    expected = norms_and_check(groups, float("inf"))[0]
    got = peaks(groups)
    assert got.keys() == expected.keys()
    for device, values in expected.items():
        torch.testing.assert_close(got[device], values, rtol=0, atol=0, equal_nan=True)  # dtype, inf, NaN, values
