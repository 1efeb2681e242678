"""unscale_ at every micro-batch: refused as torch's scaler refuses it, never stepped as a mixed sum.

A loop that unscales after each backward of an accumulation window (``accelerator.clip_grad_norm_``
written outside ``if accelerator.sync_gradients:``, or a per-micro-batch clip by hand) adds scaled
gradients to unscaled ones. torch's scaler raises at the second ``unscale_``; ours took the next
``scale()`` for a new iteration after an interrupted one and stepped ``g0/S^3 + g1/S^2 + g2/S + g3``.
Each loop here runs with torch's scaler too, or against the documented difference (docs/migration.md).
"""

from __future__ import annotations

from typing import Any

import accelerate
import pytest
import torch
from torch import nn

import gradscaler
from gradscaler import GradScaler
from helpers import make_model
from integration_helpers import fresh_accelerate_state  # noqa: F401 (an autouse fixture: used by name)

TORCH_MESSAGE = "unscale_() has already been called on this optimizer since the last update()."
MICRO = 4
CONFIGS = {
    "float32": {},
    "masters": {"master_weights": True},
    "masters_fp32_sums": {"master_weights": True, "accumulate_grads_in_fp32": True},
}


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g)


def build(config: str, cls: Any = GradScaler) -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.dtype]:
    model = make_model("mlp")
    dtype = torch.float32 if config == "float32" else torch.float16
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt, cls("cpu", init_scale=2.0**10, **CONFIGS[config]), dtype


def backward(model: nn.Module, scaler: Any, step: int, dtype: torch.dtype) -> None:
    x, y = batch(step, dtype)
    scaler.scale(nn.functional.mse_loss(model(x).float(), y)).backward()


def grads_of(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> list[torch.Tensor | None]:
    """Every gradient the iteration holds: the model's and, with masters, the masters' float32 ones."""
    masters = [m for _, m in scaler.master_weights(opt)] if isinstance(scaler, GradScaler) else []
    return [None if p.grad is None else p.grad.clone() for p in [*model.parameters(), *masters]]


def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def unscale_every_microbatch(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, dtype: torch.dtype) -> int:
    """The window of MICRO backwards, each followed by ``unscale_``; returns the micro-batch that raised."""
    for micro in range(MICRO):
        backward(model, scaler, micro, dtype)
        try:
            scaler.unscale_(opt)
        except RuntimeError as error:
            assert str(error) == TORCH_MESSAGE
            return micro
    raise AssertionError("no unscale_ was refused")


def test_torchs_scaler_refuses_the_second_unscale_as_ours_does() -> None:
    """The oracle, on a float32 model: the second micro-batch's ``unscale_`` raises."""
    model, opt, scaler, dtype = build("float32", torch.amp.GradScaler)
    assert unscale_every_microbatch(model, opt, scaler, dtype) == 1


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_second_unscale_raises_torchs_error_and_changes_nothing(config: str) -> None:
    model, opt, scaler, dtype = build(config)
    backward(model, scaler, 0, dtype)
    scaler.unscale_(opt)
    backward(model, scaler, 1, dtype)
    before = grads_of(model, opt, scaler)
    with pytest.raises(RuntimeError) as raised:
        scaler.unscale_(opt)
    assert str(raised.value) == TORCH_MESSAGE
    assert same(grads_of(model, opt, scaler), before)  # a refused call changes nothing


@pytest.mark.parametrize("config", list(CONFIGS))
def test_patch_torch_refuses_it_too(config: str) -> None:
    """``patch_torch()`` alone, as the issue found it: the scaler the loop builds is ours and refuses."""
    kwargs = CONFIGS[config]
    with gradscaler.patch_torch(**kwargs):
        model, opt, scaler, dtype = build("float32" if not kwargs else config, torch.amp.GradScaler)
    assert isinstance(scaler, GradScaler)
    assert unscale_every_microbatch(model, opt, scaler, dtype) == 1


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("call", ["step", "clip_grad_norm_"])
def test_a_step_or_clip_of_a_sum_added_to_unscaled_gradients_is_refused(config: str, call: str) -> None:
    """Unscaled at the first micro-batch only: torch steps ``g0/S + g1``; ours refuses, saying what to do."""
    model, opt, scaler, dtype = build(config)
    backward(model, scaler, 0, dtype)
    scaler.unscale_(opt)
    backward(model, scaler, 1, dtype)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"^Call unscale_\(\) \(or clip_grad_norm_\(\)\) once per iteration"):
        if call == "step":
            scaler.step(opt)
        else:
            scaler.clip_grad_norm_(opt, 1.0)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
def test_after_the_refusal_zero_grad_starts_the_iteration_again(config: str, set_to_none: bool) -> None:
    """The way out the message gives: ``zero_grad`` and a new backward are one iteration, unscaled once,
    the same run as one that never went wrong."""
    runs = []
    for refused in (True, False):
        model, opt, scaler, dtype = build(config)
        if refused:
            assert unscale_every_microbatch(model, opt, scaler, dtype) == 1
            opt.zero_grad(set_to_none=set_to_none)
        backward(model, scaler, 7, dtype)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert not all(
        torch.equal(a, b) for a, b in zip(runs[0], make_model("mlp").parameters(), strict=True)
    )  # it trained


def test_two_optimizers_unscaled_in_turn_are_not_taken_for_accumulation() -> None:
    """``unscale_(opt0)`` then a backward that writes only the other model's gradients: opt0 steps as torch's."""
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        models = [make_model("mlp", seed) for seed in (0, 1)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        scaler = cls("cpu", init_scale=2.0**10)
        for step in range(3):
            for opt in opts:
                opt.zero_grad()
            backward(models[0], scaler, step, torch.float32)
            scaler.unscale_(opts[0])
            backward(models[1], scaler, step + 10, torch.float32)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for m in models for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("ours", [True, False], ids=["gradscaler", "torch"])
def test_accelerate_clip_outside_sync_gradients_raises_at_the_second_micro_batch(ours: bool) -> None:
    """The loop as reported: Accelerate's ``clip_grad_norm_`` outside ``if accelerator.sync_gradients:``."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=MICRO)
    accelerator.native_amp = True
    accelerator.scaler = (GradScaler if ours else torch.amp.GradScaler)("cpu", init_scale=2.0**10)
    model = make_model("mlp")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    raised_at = None
    for micro in range(MICRO):
        x, y = batch(micro)
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            try:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            except RuntimeError as error:
                assert str(error) == TORCH_MESSAGE
                raised_at = micro
                break
            optimizer.step()
            optimizer.zero_grad()
    assert raised_at == 1
