"""Master weights and ``accumulate_grads_in_fp32`` on a CUDA device, against the recipe by hand (tests/recipe.py)
bit for bit: fused and foreach AdamW, SGD with momentum; float16 and bfloat16 parameters; micro-batches with an
overflow in one of them and torch's clip over ``model.parameters()``; a checkpoint resumed into fresh objects.

Marked ``cuda``: skipped on machines without CUDA (``make gpu-check`` runs it and requires it to run). The CPU
runs of the same loops are tests/test_masters_accumulate.py; here the optimizers' CUDA kernels (fused AdamW's
``_fused_adamw``, the foreach kernels) and the scaler's device-side found-inf decide.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from gradscaler import GradScaler
from recipe import (
    OPTIMIZERS,
    SCALER_ARGS,
    Fp32Recipe,
    Ours,
    Recipe,
    System,
    assert_same_state,
    assert_same_trace,
    new_trace,
    record,
)
from test_masters_accumulate import Net

pytestmark = pytest.mark.cuda

MICRO = 4
OVERFLOW = (3, 1)  # (iteration, micro-batch) whose loss is inf
SCALER = {**SCALER_ARGS, "init_scale": 2.0**14}  # float16 steps are applied from the first iteration on


def cuda_net(dtype: torch.dtype) -> Net:
    return Net(dtype=dtype).cuda()


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(8, 8, generator=g) * 3).cuda(), torch.randn(8, 4, generator=g).cuda()


def iterate(system: System, steps: range, trace: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``MICRO`` micro-batches per iteration, torch's clip over the trained parameters, one overflow."""
    for step in steps:
        system.zero_grad("optimizer", True)
        for k in range(MICRO):
            x, y = batch(step, k)
            loss = ((system.model(x, step, k).float() - y) ** 2).mean() / MICRO
            if (step, k) == OVERFLOW:
                loss = loss * float("inf")
            system.backward(loss)
        system.clip(1.0)
        system.step()
        system.update()
        record(system, trace)
    return trace


def systems(name: str, dtype: torch.dtype, accumulate: bool) -> tuple[Ours, Recipe]:
    make = OPTIMIZERS[name]
    ours = GradScaler("cuda", master_weights=True, accumulate_grads_in_fp32=accumulate, **SCALER)
    recipe = Fp32Recipe if accumulate else Recipe
    reference = recipe(cuda_net(dtype), make, torch.amp.GradScaler("cuda", **SCALER))
    return Ours(cuda_net(dtype), make, ours), reference


@pytest.mark.parametrize("accumulate", [False, True], ids=["low_sums", "fp32_sums"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masters_equal_the_recipe_on_cuda(name: str, dtype: torch.dtype, accumulate: bool) -> None:
    ours, reference = systems(name, dtype, accumulate)
    assert_same_trace(iterate(ours, range(8), new_trace()), iterate(reference, range(8), new_trace()))
    assert_same_state(ours.optimizer, reference.optimizer)
    stats = ours.scaler.stats()
    assert 1 <= stats["skipped_steps"] < stats["steps"]  # the overflow skipped, most steps applied
    masters = ours.scaler.master_weights(ours.optimizer)
    low = [p for p in ours.model.parameters() if p.requires_grad and p.dtype == dtype]
    assert len(masters) == len(low) and all(m.is_cuda and m.dtype == torch.float32 for _, m in masters)


@pytest.mark.parametrize("accumulate", [False, True], ids=["low_sums", "fp32_sums"])
def test_a_resume_into_fresh_objects_on_cuda_equals_the_uninterrupted_run(accumulate: bool) -> None:
    name, dtype = "adamw_fused", torch.float16
    whole, _ = systems(name, dtype, accumulate)
    expected = iterate(whole, range(8), new_trace())
    first, _ = systems(name, dtype, accumulate)
    trace = iterate(first, range(4), new_trace())
    buffer = io.BytesIO()
    torch.save(
        {"model": first.model.state_dict(), "opt": first.optimizer.state_dict(), "scaler": first.scaler.state_dict()},
        buffer,
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, _ = systems(name, dtype, accumulate)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["opt"])
    resumed.scaler.load_state_dict(saved["scaler"])
    assert_same_trace(iterate(resumed, range(4, 8), trace), expected)
    assert_same_state(resumed.optimizer, whole.optimizer)
