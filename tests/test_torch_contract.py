"""PyTorch's own device-generic grad-scaling checks, in our words, run against gradscaler's scaler.

Each test names the torch test it mirrors (pytorch/pytorch test/test_torch.py ``TestTorchDeviceType``
``test_grad_scaling_*`` and test/test_optim.py's grad-scaler cases). The checks are torch's; the code
is ours. Some need the scaler owner's pending changes: ``_unscale_grads_`` with torch's semantics,
``isinstance(ours, torch.amp.GradScaler)``, and ``gradscaler.OptState is torch.amp.grad_scaler.OptState``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.amp.grad_scaler import OptState as TorchOptState

import gradscaler
from gradscaler import GradScaler

DEVICE = "cpu"


def models_and_data(fused: bool = False, steps: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused or None)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]
    return model, optimizer, data


def test_is_a_torch_grad_scaler() -> None:
    """Mirrors the type checks ecosystem code makes (``isinstance(scaler, torch.amp.GradScaler)``)."""
    assert isinstance(GradScaler(DEVICE), torch.amp.GradScaler)


def test_opt_state_is_torchs() -> None:
    """Mirrors test_torch.py's checks of ``_per_optimizer_states[id(opt)]["stage"]`` against torch's enum."""
    assert gradscaler.OptState is TorchOptState
    model, optimizer, data = models_and_data()
    scaler = GradScaler(DEVICE)
    x, y = data[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is TorchOptState.READY
    scaler.unscale_(optimizer)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is TorchOptState.UNSCALED
    scaler.step(optimizer)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is TorchOptState.STEPPED


def test_grad_scaling_unscale() -> None:
    """Mirrors test_torch.py test_grad_scaling_unscale: ``_unscale_grads_(opt, inv_scale, found_inf,
    allow_fp16)`` multiplies grads by inv_scale, flags non-finite ones, refuses fp16 unless allowed."""
    scaler = GradScaler(DEVICE)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((4,), 4.0)
    optimizer = torch.optim.SGD(params, lr=1.0)
    inv_scale = torch.full((1,), 0.25)
    found_inf = torch.zeros((1,))
    per_device = scaler._unscale_grads_(optimizer, inv_scale, found_inf, False)
    assert per_device[torch.device(DEVICE)].item() == 0.0
    for p in params:
        assert torch.equal(p.grad, torch.ones(4))
    params[1].grad[2] = float("inf")
    per_device = scaler._unscale_grads_(optimizer, inv_scale, torch.zeros((1,)), False)
    assert per_device[torch.device(DEVICE)].item() == 1.0
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler._unscale_grads_(torch.optim.SGD([half], lr=1.0), inv_scale, torch.zeros((1,)), False)
    per_device = scaler._unscale_grads_(torch.optim.SGD([half], lr=1.0), inv_scale, torch.zeros((1,)), True)
    assert per_device[torch.device(DEVICE)].item() == 0.0
    assert torch.equal(half.grad, torch.full((2,), 0.25, dtype=torch.float16))


def test_grad_scaling_update_scale() -> None:
    """Mirrors test_torch.py test_grad_scaling_update_scale: growth after the interval, backoff on inf."""
    scaler = GradScaler(DEVICE, init_scale=2.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=1)
    model, optimizer, data = models_and_data()
    for inject, expected in ((False, 4.0), (True, 1.0)):
        x, y = data[0]
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if inject:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == expected


def test_grad_scaling_scale() -> None:
    """Mirrors test_torch.py test_grad_scaling_scale: tensors and nested lists/tuples/iterables."""
    scaler = GradScaler(DEVICE, init_scale=2.0)
    t = torch.full((1,), 4.0)
    assert scaler.scale(t).item() == 8.0
    nested = scaler.scale([t, (t, [t]), iter([t])])
    assert nested[0].item() == 8.0 and isinstance(nested[1], tuple) and nested[1][1][0].item() == 8.0
    assert next(iter(nested[2])).item() == 8.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(1.0)


def test_grad_scaling_state_dict() -> None:
    """Mirrors test_torch.py test_grad_scaling_state_dict: values round-trip, also with lazy init."""
    for lazy in (True, False):
        a = GradScaler(DEVICE, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        b = GradScaler(DEVICE, init_scale=6.0, growth_factor=5.0, backoff_factor=0.8, growth_interval=1)
        if not lazy:
            b.scale(torch.ones(1))
        b.load_state_dict(a.state_dict())
        assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (
            3.0,
            4.0,
            0.5,
            2,
        )
        torch_b = torch.amp.GradScaler(DEVICE)
        torch_b.load_state_dict(a.state_dict())
        assert torch_b.get_scale() == 3.0


def test_pickle_gradscaler() -> None:
    """Mirrors test_torch.py test_pickle_gradscaler: settings survive pickling, before and after use."""
    a = GradScaler(DEVICE, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    for used in (False, True):
        if used:
            a.scale(torch.ones(1))
        b = pickle.loads(pickle.dumps(a))
        assert b.is_enabled() == a.is_enabled()
        assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (
            3.0,
            4.0,
            0.5,
            2,
        )


def test_grad_scaling_state_machine_errors() -> None:
    """Mirrors test_torch.py's stage checks: unscale_ twice, unscale_ after step, step twice."""
    model, optimizer, data = models_and_data()
    scaler = GradScaler(DEVICE)
    x, y = data[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("recipe", ["plain", "clipping", "accumulation", "multiple"])
def test_grad_scaling_recipes_match_torchs_scaler(fused: bool, recipe: str) -> None:
    """Mirrors test_torch.py test_grad_scaling_autocast / _clipping / _accumulation / _multiple and
    test_optim.py's grad-scaler optimizer cases: the same run with torch's scaler and ours, inf
    injected at step 2, identical parameters and scales."""

    def run(cls: type) -> tuple[list[torch.Tensor], float]:
        model, optimizer, data = models_and_data(fused=fused, steps=5)
        second, second_opt, _ = models_and_data(fused=fused)
        scaler = cls(DEVICE, init_scale=2.0**4, growth_interval=2)
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            second_opt.zero_grad()
            with torch.autocast(DEVICE, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                if recipe == "multiple":
                    loss = loss + torch.nn.functional.mse_loss(second(x).float(), y)
            if recipe == "accumulation":
                scaler.scale(loss / 2).backward(retain_graph=True)
            scaler.scale(loss / (2 if recipe == "accumulation" else 1)).backward()
            if step == 2:
                model[0].weight.grad[0, 0] = float("inf")
            if recipe == "clipping":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            if recipe == "multiple":
                scaler.step(second_opt)
            scaler.update()
        params = [p.detach().clone() for p in list(model.parameters()) + list(second.parameters())]
        return params, scaler.get_scale()

    theirs, ours = run(torch.amp.GradScaler), run(GradScaler)
    assert theirs[1] == ours[1]
    for a, b in zip(theirs[0], ours[0], strict=True):
        assert torch.equal(a, b)


def test_grad_scale_disabled_is_a_passthrough() -> None:
    """Mirrors test_torch.py's enabled=False checks: scale, step and update pass through."""
    scaler = GradScaler(DEVICE, enabled=False)
    t = torch.ones(2)
    assert scaler.scale(t) is t and scaler.get_scale() == 1.0 and not scaler.is_enabled()
    model, optimizer, data = models_and_data()
    x, y = data[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.state_dict() == {}


def test_cuda_scaler_without_cuda_warns_and_disables() -> None:
    """Mirrors torch's behaviour on machines without CUDA; the message must not name torch.cuda.amp."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.warns(UserWarning, match="CUDA is not available") as caught:
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()
    assert not any("torch.cuda.amp.GradScaler" in str(w.message) for w in caught)


@pytest.mark.parametrize("master_weights", [False, True], ids=["plain", "masters"])
def test_step_calls_a_subclass_unscale_(master_weights: bool) -> None:
    """torch's ``step`` unscales through ``self.unscale_``: a subclass that overrides it (to log, to count) is
    called once per step that unscales, not at all after its own call, and the run is the one without it."""

    class Counting(GradScaler):
        calls = 0

        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            type(self).calls += 1
            super().unscale_(optimizer)

    runs = []
    for cls in (GradScaler, Counting):
        model, optimizer, data = models_and_data(steps=3)
        if master_weights:
            model.half()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = cls(DEVICE, init_scale=2.0**8, master_weights=master_weights)
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            out = model(x.to(next(model.parameters()).dtype)).float()
            scaler.scale(torch.nn.functional.mse_loss(out, y)).backward()
            if step == 1:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert Counting.calls == 3  # steps 0 and 2 through step, step 1 the loop's own call (step then skips it)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
