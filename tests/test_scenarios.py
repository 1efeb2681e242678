"""torch's AMP recipes, run with both scalers and compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from helpers import TORCH_VERSION

Loop = Callable[[object, list[nn.Module], list[torch.optim.Optimizer], int], None]


def compare(loop: Loop, *, models: int = 1, fused: bool = False, steps: int = 12, **scaler_kwargs: object) -> None:
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        nets = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)) for _ in range(models)]
        opts = [torch.optim.Adam(n.parameters(), lr=1e-2, fused=fused) for n in nets]
        scaler = cls("cpu", **({"init_scale": 2.0**10, "growth_interval": 3} | scaler_kwargs))
        torch.manual_seed(1)
        scales = []
        for step in range(steps):
            loop(scaler, nets, opts, step)
            scales.append(float(scaler._scale))
        results.append((scales, [p.detach().clone() for n in nets for p in n.parameters()]))
    (ours_scales, ours_params), (theirs_scales, theirs_params) = results
    assert ours_scales == theirs_scales
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert torch.equal(a, b)


def test_gradient_penalty() -> None:
    def loop(scaler, nets, opts, step):
        net, opt = nets[0], opts[0]
        opt.zero_grad()
        loss = net(torch.randn(4, 8)).pow(2).mean()
        scaled = torch.autograd.grad(scaler.scale(loss), list(net.parameters()), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        penalty = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled]).sum().sqrt()
        scaler.scale(loss + penalty).backward()
        scaler.step(opt)
        scaler.update()

    compare(loop)


CREATE_GRAPH_WARNING = "ignore:Using backward\\(\\) with create_graph=True"  # torch's, about the loop itself


@pytest.mark.filterwarnings(CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("route", ["auto", "generic"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_backward_with_create_graph(monkeypatch: pytest.MonkeyPatch, route: str, fused: bool) -> None:
    """``backward(create_graph=True)`` leaves gradients with a graph: the flags read from them (on the route CUDA
    takes without Triton, torch's ops) carry none into the scale, whose update would then fail at the next
    backward; torch's check, a non-differentiable op, carries none either."""
    monkeypatch.setenv("GRADSCALER_KERNEL", route)

    def loop(scaler, nets, opts, step):
        opts[0].zero_grad()
        scaler.scale(nets[0](torch.randn(4, 8)).pow(2).mean()).backward(create_graph=True)
        if step == 5:
            next(nets[0].parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opts[0])
        scaler.update()
        assert not scaler._scale.requires_grad

    compare(loop, fused=fused)


@pytest.mark.filterwarnings(CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("route", ["auto", "generic"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_clip_after_backward_with_create_graph(monkeypatch: pytest.MonkeyPatch, route: str, fused: bool) -> None:
    """``clip_grad_norm_`` runs outside the gradients' graph, as torch's clipping does: its norm, its factor and
    the scale have none, and the run is torch's ``unscale_`` + ``clip_grad_norm_`` to rounding (one pass)."""
    monkeypatch.setenv("GRADSCALER_KERNEL", route)
    runs = []
    for ours in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused)
        graphs: list[list[str]] = []
        scaler = (GradScaler if ours else torch.amp.GradScaler)("cpu", init_scale=2.0**10, growth_interval=3)
        torch.manual_seed(1)
        for _ in range(6):
            opt.zero_grad()
            scaler.scale(net(torch.randn(4, 8)).pow(2).mean()).backward(create_graph=True)
            if ours:
                total = scaler.clip_grad_norm_(opt, 0.1)
            else:
                scaler.unscale_(opt)
                total = torch.nn.utils.clip_grad_norm_(list(net.parameters()), 0.1)
            assert not total.requires_grad
            graphs.append([type(p.grad.grad_fn).__name__ for p in net.parameters()])  # the multiply is not in it
            scaler.step(opt)
            scaler.update()
            assert not scaler._scale.requires_grad
        runs.append((float(scaler._scale), [p.detach().clone() for p in net.parameters()], graphs))
    (ours_scale, ours_params, ours_graphs), (torch_scale, torch_params, torch_graphs) = runs
    assert ours_scale == torch_scale
    assert ours_graphs == torch_graphs
    for a, b in zip(ours_params, torch_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation() -> None:
    def loop(scaler, nets, opts, step):
        opts[0].zero_grad()
        for _ in range(3):
            scaler.scale(nets[0](torch.randn(4, 8)).pow(2).mean() / 3).backward()
        if step == 5:
            next(nets[0].parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opts[0])
        scaler.update()

    compare(loop)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_two_losses_two_optimizers_one_update(fused: bool) -> None:
    def loop(scaler, nets, opts, step):
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(4, 8)
        out0, out1 = nets[0](x), nets[1](x)
        loss0 = (out0 + out1).pow(2).mean()
        loss1 = (out0 - out1).abs().mean()
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if step in (4, 7):
            next(nets[step % 2].parameters()).grad.view(-1)[0] = float("nan")
        scaler.unscale_(opts[0])
        scaler.step(opts[0])
        scaler.step(opts[1])
        scaler.update()

    compare(loop, models=2, fused=fused)


@pytest.mark.skipif(
    TORCH_VERSION < (2, 11),
    reason="torch 2.4's scaler drops a grad_scale preset on a fused optimizer (2.11 and 2.13 multiply it, as ours "
    "does on every torch: docs/migration.md); releases between were not tried",
)
def test_preset_grad_scale_on_fused_optimizer_is_honoured() -> None:
    def loop(scaler, nets, opts, step):
        opts[0].zero_grad()
        scaler.scale(nets[0](torch.randn(4, 8)).pow(2).mean()).backward()
        opts[0].grad_scale = torch.tensor(4.0)
        scaler.step(opts[0])
        scaler.update()

    compare(loop, fused=True)


def test_growth_refused_when_scale_times_growth_factor_is_not_finite() -> None:
    def loop(scaler, nets, opts, step):
        opts[0].zero_grad()
        scaler.scale(nets[0](torch.randn(4, 8)).mean() * 0.0).backward()
        scaler.step(opts[0])
        scaler.update()

    big = float(torch.finfo(torch.float32).max) / 3
    compare(loop, init_scale=big, growth_interval=1, steps=4)


def test_optimizer_without_gradients_is_stepped_not_refused() -> None:
    model = nn.Linear(2, 2)
    unused = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert scaler.step(unused) is None
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0
    theirs = torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(1))
    with pytest.raises(AssertionError, match=r"No inf checks were recorded for this optimizer\."):
        theirs.step(unused)
