"""``GradScaler.clip_grad_norm_`` against torch's unscale_ + clip_grad_norm_ recipe and float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.scaler import OptState
from helpers import assert_same_trace, run

# Per step, our norm and torch's differ only in float32 summation order (a few ulps; the single-step
# tests below hold them to 1e-5 against float64). Over a 30-step trajectory those ulps feed back
# through the parameters: 1e-3 bounds the drift seen with SGD and AdamW (3.7e-5). Adagrad is left
# out of the trajectory comparison: its per-coordinate normalisation turns ulps in near-zero
# accumulators into 2% differences within 30 steps, for any two float32 summation orders.
RTOL = 1e-3


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("max_norm", [1e9, 1.0, 0.05], ids=["no_clip", "clip", "hard_clip"])
def test_matches_torch_recipe(optimizer: str, mode: str, max_norm: float) -> None:
    faults = {4: [(0, math.inf)], 11: [(2, math.nan)]}
    kwargs = {"optimizer": optimizer, "mode": mode, "inject": faults, "steps": 30, "max_norm": max_norm}
    settings = {"init_scale": 2.0**12, "growth_interval": 4}
    ours = run(GradScaler("cpu", **settings), recipe="clip", **kwargs)
    theirs = run(torch.amp.GradScaler("cpu", **settings), recipe="unscale_clip", **kwargs)
    assert ours.scales == theirs.scales and ours.skipped == theirs.skipped
    for step, (a, b) in enumerate(zip(ours.norms, theirs.norms, strict=True)):
        if theirs.skipped[step]:
            assert not torch.isfinite(a)
            continue
        torch.testing.assert_close(a, b, rtol=RTOL, atol=0)
    for a, b in zip(ours.params[-1], theirs.params[-1], strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5)


def test_no_clip_is_bit_identical_to_plain_run() -> None:
    """With a max_norm that never clips, the coefficient is exactly 1 and nothing else changes."""
    kwargs = {"optimizer": "adamw", "mode": "foreach", "steps": 20, "max_norm": 1e30}
    ours = run(GradScaler("cpu", init_scale=2.0**10, growth_interval=3), recipe="clip", **kwargs)
    theirs = run(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3), recipe="plain", **kwargs)
    assert_same_trace(ours, theirs)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.5, math.inf], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_norm_against_float64_and_the_result_of_the_step(p: float, fused: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = (
        torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
        if fused
        else torch.optim.SGD(model.parameters(), lr=1.0, foreach=True)
    )
    scaler = GradScaler("cpu", init_scale=2.0**9)
    scaler.scale(model(torch.randn(4, 16)).pow(2).sum()).backward()
    scaled = [p_.grad.double().clone() for p_ in model.parameters()]
    before = [p_.detach().double().clone() for p_ in model.parameters()]
    total = scaler.clip_grad_norm_(opt, 0.5, p)
    unscaled = [g / 2.0**9 for g in scaled]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, p) for g in unscaled]), p)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=0)
    if fused:  # nothing was written before the optimizer runs
        assert all(torch.equal(p_.grad.double(), g) for p_, g in zip(model.parameters(), scaled, strict=True))
    scaler.step(opt)
    scaler.update()
    coef = min(1.0, 0.5 / (float(expected) + 1e-6))
    for p_, b, g in zip(model.parameters(), before, unscaled, strict=True):
        torch.testing.assert_close(p_.detach().double(), b - g * coef, rtol=1e-5, atol=1e-6)


def test_misuse() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.raises(ValueError, match=r"max_norm must be a number >= 0, got -1\.0"):
        scaler.clip_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match=r"norm_type must be a p > 0 or inf, got 0"):
        scaler.clip_grad_norm_(opt, 1.0, 0)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) has already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) is being called after step\(\)"):
        scaler.clip_grad_norm_(opt, 1.0)


def test_after_explicit_unscale_clips_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=64.0)
    scaler.scale(model(torch.randn(3, 4)).sum() * 100).backward()
    scaler.unscale_(opt)
    reference = [p.grad.clone() for p in model.parameters()]
    ref_params = [nn.Parameter(torch.zeros_like(p)) for p in model.parameters()]
    for rp, g in zip(ref_params, reference, strict=True):
        rp.grad = g
    expected = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    total = scaler.clip_grad_norm_(opt, 1.0)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for p, rp in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-6, atol=0)


def test_disabled_scaler_clips_like_torch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().mul(50).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    total = GradScaler("cpu", enabled=False).clip_grad_norm_(opt, 1.0)
    torch.testing.assert_close(total, expected)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(1.0), rtol=1e-5, atol=0)


# The pure functions of clipping.py, with no scaler.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_clip_coefficient_on_host_has_the_tensor_ops_bits(dtype: torch.dtype) -> None:
    """The Python factor (a CPU scale) rounds as the four tensor ops do, edge cases included."""
    from gradscaler.clipping import clip_coefficient

    gen = torch.Generator().manual_seed(5)
    totals = torch.cat(
        [
            torch.exp(torch.empty(4000, dtype=torch.float64).uniform_(-30, 30, generator=gen)),
            torch.tensor([0.0, 1e-7, 1.0, 1.0 - 1e-6, math.inf, math.nan, 3e38, 1e-45]),
        ]
    ).to(dtype)
    for max_norm in (1.0, 0.5, 3.0, 0.1, 0.0, 1e30):
        for total in totals:
            on_device = clip_coefficient(total.clone(), max_norm)
            on_host = clip_coefficient(total.clone(), max_norm, on_host=True)
            assert on_host.dtype == on_device.dtype == dtype
            assert on_host.view(-1).view(torch.int64 if dtype == torch.float64 else torch.int32).item() == (
                on_device.view(-1).view(torch.int64 if dtype == torch.float64 else torch.int32).item()
            ), (float(total), max_norm)


def test_clip_coefficient_is_torchs_factor() -> None:
    from gradscaler.clipping import clip_coefficient

    assert clip_coefficient(torch.tensor(4.0), 1.0).item() == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(float("inf")), 1.0).item() == 0.0


def test_total_norm_combines_devices_and_handles_none() -> None:
    from gradscaler.clipping import total_norm

    cpu = torch.device("cpu")
    norms = {cpu: torch.tensor([3.0, 4.0])}
    assert total_norm(norms, 2.0, cpu).item() == 5.0
    assert total_norm(norms, float("inf"), cpu).item() == 4.0
    assert total_norm({}, 2.0, cpu).item() == 0.0


def test_scale_grads_multiplies_every_group_in_place() -> None:
    from gradscaler.clipping import scale_grads_
    from gradscaler.grads import new_groups

    groups = new_groups()
    a, b = torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64)
    groups[a.device][a.dtype].append(a)
    groups[b.device][b.dtype].append(b)
    scale_grads_(groups, torch.tensor(0.5))
    assert a.tolist() == [0.5] * 3 and b.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "error"),
    [(-1.0, 2.0, ValueError), (float("nan"), 2.0, ValueError), (1.0, "2", TypeError), (1.0, True, TypeError)],
)
def test_check_clip_arguments(max_norm: object, norm_type: object, error: type) -> None:
    from gradscaler.clipping import check_clip_arguments

    with pytest.raises(error):
        check_clip_arguments(max_norm, norm_type)
    assert check_clip_arguments(1, 2) == 2.0


def test_global_norm_without_a_reduction_is_the_norm_of_every_tensor() -> None:
    from gradscaler import distributed
    from gradscaler.clipping import global_norm, total_norm

    cpu = torch.device("cpu")
    norms = {cpu: torch.tensor([3.0, 4.0, 12.0])}
    owners = {cpu: [torch.ones(1), torch.ones(1), torch.ones(1)]}
    for agreement in (distributed.LOCAL, distributed.explicit_agreement(object())):  # no process group here
        for norm_type in (1.0, 2.0, 3.0, math.inf):
            assert torch.equal(global_norm(norms, owners, norm_type, cpu, agreement), total_norm(norms, norm_type, cpu))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_global_norm_reduces_each_class_over_exactly_its_groups(
    monkeypatch: pytest.MonkeyPatch, norm_type: float
) -> None:
    """Two groups of two identical ranks (a SUM doubles, a MAX keeps): a whole tensor counts once, a
    tensor sharded over group 0 twice, one sharded over both groups four times; one collective per group."""
    from gradscaler import distributed
    from gradscaler.clipping import global_norm

    calls: list[object] = []

    def all_reduce(tensor: torch.Tensor, op: object, group: object) -> None:
        calls.append(group)
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(2)

    monkeypatch.setattr(distributed, "running", lambda: True)
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    cpu = torch.device("cpu")
    whole, dp, both = torch.ones(1), torch.ones(1), torch.ones(1)
    groups = (object(), object())
    agreement = distributed.Agreement(groups, ((), (0,), (0, 1)), {id(dp): 1, id(both): 2})
    norms = {cpu: torch.tensor([3.0, 4.0, 12.0, 5.0], dtype=torch.float64)}
    owners = {cpu: [both, whole, dp, whole]}
    got = global_norm(norms, owners, norm_type, cpu, agreement)
    if math.isinf(norm_type):
        want = 12.0
    else:
        want = (4 * 3.0**norm_type + 4.0**norm_type + 2 * 12.0**norm_type + 5.0**norm_type) ** (1 / norm_type)
    assert got.dtype == torch.float64 and got.item() == pytest.approx(want, rel=1e-12)
    assert calls == list(groups)
    # A rank holding none of the gradients issues the same collectives and contributes nothing.
    calls.clear()
    assert global_norm({}, {}, norm_type, cpu, agreement).item() == 0.0
    assert calls == list(groups)


SMALL_CASES = {"floor": (2.0**-126, 1e-3), "near_min_normal": (2.0**16, 4 * torch.finfo(torch.float32).tiny)}


@pytest.mark.parametrize("kernel", ["auto", "generic", "triton"])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.5, math.inf], ids=str)
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_clip_at_small_scales_and_values_matches_torchs_recipe(
    kernel: str, p: float, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20, item 4: at the scale floor 2**-126, and for gradients near float32's smallest normal,
    the norm is the float64 norm of the unscaled gradients and the step is torch's unscale_ +
    clip_grad_norm_ + step (which squares the unscaled values, so it is right at the floor; its own
    norm of gradients near the smallest normal underflows, but its clip factor is 1 either way)."""
    if kernel == "triton":
        pytest.importorskip("triton")
    if kernel != "auto":
        monkeypatch.setenv("GRADSCALER_KERNEL", kernel)
    scale, magnitude = SMALL_CASES[case]
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 16), (64,), (8, 64), (8,)] + [(4,)] * 8  # the CPU route's shared buffer too
    grads = [(torch.randn(s, generator=gen, dtype=torch.float64) * magnitude * scale).float() for s in shapes]
    unscaled = [g.double() / scale for g in grads]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, p) for g in unscaled]), p)
    max_norm = 0.5 * float(expected)  # clips: the coefficient is about 0.5 (floor) or tiny (near_min_normal)
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s)) for s in shapes]
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = cls("cpu", init_scale=scale)
        scaler.scale(torch.ones(()))  # sets the scale up; the gradients below stand for a backward
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        if cls is GradScaler:
            total = scaler.clip_grad_norm_(opt, max_norm, p)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, max_norm, p)
        scaler.step(opt)
        scaler.update()
        results.append([param.detach().clone() for param in params])
    tolerance = 1e-5 if p >= 1 else 1e-4  # float32 sums; for p < 1 their error grows by 1/p
    if case == "near_min_normal" and p == 2.0:  # per-tensor norms ~1e-37: their float32 squares underflow
        assert float(total) == 0.0  # as torch's total does; CLIP_EPSILON hides it from the clip factor
    else:
        torch.testing.assert_close(total.double(), expected, rtol=tolerance, atol=0)
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
