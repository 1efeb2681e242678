"""``gradscaler bench --sections bf16``: what ``gradscaler.with_master_weights(optimizer)`` costs a bfloat16 model
that no scaler steps, against the same loop without the line.

The model is the accumulation section's GPT-shaped ``TinyGPT`` in bfloat16 (its LayerNorms float32, as the
demo keeps them), trained by a plain loop: ``micro`` micro-batches of forward and backward, torch's
``clip_grad_norm_`` over ``model.parameters()``, AdamW's ``step``, ``zero_grad``.

* ``memory``: bytes per model parameter (distinct storages of the parameters, their gradients, the masters
  and theirs, the optimizer's state) between two micro-batches, just before ``step`` and just after it.
* ``time``: milliseconds per micro-batch (forward + backward) and per step phase (clipping + step +
  ``zero_grad``), the two loops run round-robin in one process; the ratio per round, median and IQR.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gradscaler.masters import torch_clip_grad_norm_, with_master_weights
from gradscaler.tools.bench_accumulate import _loss, _tiny
from gradscaler.tools.harness import spread
from gradscaler.tools.memory import bytes_per_parameter

SYSTEMS = ("without the line", "with_master_weights")


def _held(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes per model parameter now: parameters, masters (the optimizer's parameters), gradients, state."""
    return bytes_per_parameter(model, optimizer, [p for group in optimizer.param_groups for p in group["params"]])


def _system(line: bool, device: torch.device, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _tiny(torch.bfloat16, device, width=width, layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, with_master_weights(optimizer) if line else optimizer


def _clip(line: bool) -> Any:
    """The clipping each loop calls: the routed one with the line; torch's own without it (in this process the
    line installed the route, which a process without it would not have)."""
    return torch.nn.utils.clip_grad_norm_ if line else torch_clip_grad_norm_


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def memory_section(device: torch.device, micro: int = 4, width: int = 128, layers: int = 2) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, line in zip(SYSTEMS, (False, True), strict=True):
        model, optimizer = _system(line, device, width, layers)
        points: dict[str, float] = {}
        for _ in range(2):  # the second step holds what every later one holds
            for k in range(micro):
                tokens = torch.randint(256, (2, 33), generator=gen).to(device)
                (_loss(model, tokens) / micro).backward()
                if k == 1:
                    points["between_micro_batches"] = _held(model, optimizer)
            _clip(line)(model.parameters(), 1.0)
            points["before_step"] = _held(model, optimizer)
            optimizer.step()
            points["after_step"] = _held(model, optimizer)
            optimizer.zero_grad()
        rows.append({"system": name, **points})
    return rows


def time_section(
    device: torch.device, rounds: int, micro: int = 4, width: int = 128, layers: int = 12
) -> dict[str, Any]:
    systems = [_system(line, device, width, layers) for line in (False, True)]
    tokens = torch.randint(256, (4, 33), generator=torch.Generator().manual_seed(0)).to(device)
    micro_ms: list[list[float]] = [[], []]
    step_ms: list[list[float]] = [[], []]
    for round_ in range(rounds + 2):
        for index, (model, optimizer) in enumerate(systems):
            _sync(device)
            begin = time.perf_counter()
            for _ in range(micro):
                (_loss(model, tokens) / micro).backward()
            _sync(device)
            middle = time.perf_counter()
            _clip(bool(index))(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            _sync(device)
            end = time.perf_counter()
            if round_ >= 2:  # two warm-up rounds
                micro_ms[index].append((middle - begin) * 1e3 / micro)
                step_ms[index].append((end - middle) * 1e3)
    model = systems[0][0]
    return {
        "tensors": sum(1 for _ in model.parameters()),
        "params": sum(p.numel() for p in model.parameters()),
        "micro_batches": micro,
        "micro_ms": [spread(times) for times in micro_ms],
        "step_ms": [spread(times) for times in step_ms],
        "micro_ratio": spread([b / a for a, b in zip(*micro_ms, strict=True)]),
        "step_ratio": spread([b / a for a, b in zip(*step_ms, strict=True)]),
    }


def bf16_section(device: torch.device, steps: int) -> dict[str, Any]:
    return {"memory": memory_section(device), "time": time_section(device, max(steps, 5))}


def _cell(values: tuple[float, float, float], digits: int = 2) -> str:
    return f"{values[0]:.{digits}f} [{values[1]:.{digits}f}-{values[2]:.{digits}f}]"


def bf16_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "bfloat16 model without a scaler, AdamW, torch's clip_grad_norm_ over model.parameters(): bytes per "
        "parameter (parameters, masters, gradients, optimizer state)",
        "",
        "| loop | between micro-batches | before step | after step |",
        "|---|---|---|---|",
    ]
    for row in r["memory"]:
        lines.append(
            f"| {row['system']} | {row['between_micro_batches']:.2f} | {row['before_step']:.2f} | "
            f"{row['after_step']:.2f} |"
        )
    t = r["time"]
    lines += [
        "",
        f"Time, bfloat16 GPT of {t['tensors']} tensors ({t['params'] / 1e6:.1f}M parameters), {t['micro_batches']} "
        "micro-batches a step, round-robin, median [IQR]:",
        "",
        "| loop | ms per micro-batch (forward + backward) | ms per step phase (clip + step + zero_grad) |",
        "|---|---|---|",
    ]
    for index, name in enumerate(SYSTEMS):
        lines.append(f"| {name} | {_cell(t['micro_ms'][index])} | {_cell(t['step_ms'][index])} |")
    lines.append(
        f"| ratio, with / without | {_cell(t['micro_ratio'], 3)} | {_cell(t['step_ratio'], 3)} |",
    )
    return lines
