"""A float16 LoRA run resumed through peft's own load (issue 46 item 6), on the CPU, in a plain loop.

A tiny float16 model whose base is frozen and whose LoRA adapters (``get_peft_model`` with
``autocast_adapter_dtype=False``) train in float16 under ``GradScaler(..., master_weights=True,
accumulate_grads_in_fp32=True)``, three micro-batches a step. A checkpoint saved before any applied step (every
early step skipped by a huge initial scale, so the masters still equal their adapters): the adapters through
``save_pretrained``, the optimizer and the scaler through ``torch.save``. The resume loads the adapters with
``PeftModel.from_pretrained``, which casts them to float32 (``autocast_adapter_dtype=True``, its default): the
first step warns once with ``ContinuedWarning`` (docs/integrations.md, 'PEFT adapters in float16'), and the
adapters cast back to float16 after the loads resume bit for bit, in silence.
"""

from __future__ import annotations

import io
import pathlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.masters.checkpoint import ContinuedWarning

peft = pytest.importorskip("peft")

MICRO = 3  # micro-batches a step: the scaler warns of hidden parameters only after two or more scaled graphs
SCALES: dict[str, Any] = {"init_scale": 2.0**40, "backoff_factor": 2.0**-10, "growth_interval": 3}
# every step skipped until the scale reaches 2**10 (the fourth iteration)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x)))


def base() -> nn.Module:
    return Base().half()


def trained(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def system(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    optimizer = torch.optim.AdamW(trained(model), lr=1e-2)
    return model, optimizer, GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, **SCALES)


def steps(run: tuple[nn.Module, torch.optim.Optimizer, GradScaler], numbers: range) -> None:
    """``MICRO`` micro-batches a step under float16 autocast (float32 adapters compute in float16, as under the
    Trainer), then step, update and zero_grad."""
    model, optimizer, scaler = run
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=generator) for _ in range(MICRO * (max(numbers) + 1))]
    for number in numbers:
        for micro in range(MICRO):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batches[MICRO * number + micro].half()).float().pow(2).mean()
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def caught(action: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        action()
    return list(found)


def saved_run(path: pathlib.Path) -> tuple[tuple[nn.Module, torch.optim.Optimizer, GradScaler], dict[str, Any]]:
    """The float16 LoRA run after one (skipped) step, its adapters saved under ``path`` and its optimizer and
    scaler state dicts as ``torch.load(weights_only=True)`` gives them back."""
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["lin"], init_lora_weights=False)
    run = system(peft.get_peft_model(base(), config, autocast_adapter_dtype=False))
    assert {p.dtype for p in trained(run[0])} == {torch.float16}
    steps(run, range(1))
    assert run[2].get_scale() > 2.0**15  # skipped: the masters equal their adapters
    run[0].save_pretrained(path)
    buffer = io.BytesIO()
    torch.save({"optimizer": run[1].state_dict(), "scaler": run[2].state_dict()}, buffer)
    return run, torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def resumed(path: pathlib.Path, saved: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    model = peft.PeftModel.from_pretrained(base(), path, is_trainable=True)
    assert {p.dtype for p in trained(model)} == {torch.float32}  # peft's cast, which the test is about
    run = system(model)
    run[1].load_state_dict(saved["optimizer"])
    run[2].load_state_dict(saved["scaler"])
    return run


def test_peft_float32_adapters_resumed_before_any_applied_step_continue_with_one_continued_warning(
    tmp_path: pathlib.Path,
) -> None:
    first, saved = saved_run(tmp_path)
    masters = [master.detach().clone() for _, master in first[2].master_weights(first[1])]
    again = resumed(tmp_path, saved)
    found = caught(lambda: steps(again, range(1, 2)))
    assert [w.category for w in found] == [ContinuedWarning], [str(w.message) for w in found]
    assert "torch.float32) was float16 or bfloat16 when its checkpoint was saved" in str(found[0].message)
    assert ", and 1 more parameters" in str(found[0].message)  # lora_A and lora_B, named once
    assert all(torch.equal(p, m) for p, m in zip(trained(again[0]), masters, strict=True))  # skipped: the masters
    assert not caught(lambda: steps(again, range(2, 6)))


def test_peft_adapters_cast_back_to_float16_resume_bit_for_bit(tmp_path: pathlib.Path) -> None:
    """docs/integrations.md's callback, in a plain loop: each float32 ``lora_`` parameter cast back to float16
    after the loads and before the first step."""
    first, saved = saved_run(tmp_path)
    again = resumed(tmp_path, saved)
    for name, param in again[0].named_parameters():
        if "lora_" in name and param.dtype == torch.float32:
            param.data = param.data.half()
    before = [p.detach().clone() for p in trained(first[0])]
    steps(first, range(1, 7))
    assert not caught(lambda: steps(again, range(1, 7)))
    assert not all(torch.equal(a, b) for a, b in zip(trained(first[0]), before, strict=True))  # steps applied
    assert all(torch.equal(a, b) for a, b in zip(trained(first[0]), trained(again[0]), strict=True))
    ours = [m for _, m in first[2].master_weights(first[1])]
    theirs = [m for _, m in again[2].master_weights(again[1])]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for a, b in zip(first[1].state.values(), again[1].state.values(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)
