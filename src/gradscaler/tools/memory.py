"""``gradscaler bench --sections memory``: bytes per parameter of a training setup, measured.

A GPT-shaped model (``TinyGPT``) takes real training steps under float16 autocast with a scaler,
for each setup: float32 parameters (torch's mixed precision); float16 parameters with float32
masters (``GradScaler(..., master_weights=True)``); float16 parameters stepped by a fused optimizer
without masters (the path torch allows). Each with AdamW and with SGD with momentum.

The measurement is the tensors themselves: the distinct storages (one count per
``untyped_storage().data_ptr()``, so views and tied tensors are counted once) of the parameters,
their gradients, the float32 masters (``scaler.master_weights(optimizer)``) with theirs, and
everything in ``optimizer.state``, divided by the number of model parameters. Gradients are
measured twice: during the step (after ``unscale_``, when the float16 gradients and the masters'
float32 copies are both held) and after it (``step`` drops the float16 ones; ``zero_grad`` has not
run yet). Activations, the allocator's caching and fragmentation are not counted: on a GPU,
``torch.cuda.max_memory_allocated`` adds those, and the table holds what every device pays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradscaler import GradScaler
from gradscaler.tools.toy_model import TinyGPT

SETUPS = ("float32 params + autocast", "float16 params + master weights", "float16 params, no masters (fused)")
OPTIMIZERS = ("AdamW", "SGD momentum")


@dataclass
class Footprint:
    """Bytes per model parameter, by what holds them (0 where the setup holds none)."""

    setup: str
    optimizer: str
    params: int
    param_bytes: float
    grad_bytes_in_step: float
    grad_bytes_after_step: float
    master_bytes: float
    state_bytes: float

    @property
    def total_in_step(self) -> float:
        """Everything held during the step: parameters, both gradients, masters, optimizer state."""
        return self.param_bytes + self.grad_bytes_in_step + self.master_bytes + self.state_bytes

    @property
    def total_after_step(self) -> float:
        """Held between ``step`` and ``zero_grad``: the float16 gradients are gone, the others stay."""
        return self.param_bytes + self.grad_bytes_after_step + self.master_bytes + self.state_bytes


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped) not already in ``seen`` (updated)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def bytes_per_parameter(model: torch.nn.Module, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> float:
    """Bytes per model parameter held now: the parameters, ``masters``, every gradient of both, the optimizer's
    state (distinct storages, each counted once)."""
    params = list(model.parameters())
    grads = [p.grad for p in params] + [m.grad for m in masters]
    return storage_bytes([*params, *masters, *grads, *_state_tensors(optimizer)]) / sum(p.numel() for p in params)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def _optimizer(name: str, params: Iterable[torch.Tensor], fused: bool) -> torch.optim.Optimizer:
    flags: dict[str, Any] = {"fused": True} if fused else {}
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-4, **flags)
    if name == "SGD momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def measure(
    setup: str, optimizer_name: str, device: torch.device, width: int = 128, layers: int = 2, steps: int = 2
) -> Footprint:
    """Train ``steps`` steps of a TinyGPT in ``setup`` with ``optimizer_name`` and measure the last one."""
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    torch.manual_seed(0)
    vocab, context = 256, 64
    model = TinyGPT(vocab, width=width, layers=layers, heads=4, context=context).to(device)
    low = setup != SETUPS[0]
    if low:
        model.half()
    masters = setup == SETUPS[1]
    optimizer = _optimizer(optimizer_name, model.parameters(), fused=setup == SETUPS[2])
    scaler = GradScaler(device.type, master_weights=masters)
    gen = torch.Generator().manual_seed(0)
    in_step: dict[str, int] = {}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        tokens = torch.randint(vocab, (4, context + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        if setup != SETUPS[2]:  # float16 gradients without masters cannot be unscaled; the fused step does it
            scaler.unscale_(optimizer)
        in_step = _held(model, optimizer, scaler)
        scaler.step(optimizer)
        scaler.update()
    after = _held(model, optimizer, scaler)
    count = sum(p.numel() for p in model.parameters())
    return Footprint(
        setup=setup,
        optimizer=optimizer_name,
        params=count,
        param_bytes=after["params"] / count,
        grad_bytes_in_step=in_step["grads"] / count,
        grad_bytes_after_step=after["grads"] / count,
        master_bytes=after["masters"] / count,
        state_bytes=after["state"] / count,
    )


def _held(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: GradScaler) -> dict[str, int]:
    """Bytes held now, by category; a storage is counted once, in the first category that holds it."""
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    masters = [master for _, master in scaler.master_weights(optimizer)]
    return {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes([p.grad for p in params] + [m.grad for m in masters], seen),
        "masters": storage_bytes(masters, seen),
        "state": storage_bytes(_state_tensors(optimizer), seen),
    }


def memory_section(device: torch.device) -> list[dict[str, Any]]:
    """Rows of the bytes-per-parameter table: every setup with every optimizer."""
    width, layers = (768, 12) if device.type == "cuda" else (256, 4)
    rows = []
    for setup in SETUPS:
        for name in OPTIMIZERS:
            footprint = measure(setup, name, device, width=width, layers=layers)
            totals = {"total_in_step": footprint.total_in_step, "total_after_step": footprint.total_after_step}
            rows.append({**asdict(footprint), **totals})
    return rows


def memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table of ``memory_section``'s rows."""
    lines = [
        "",
        f"Bytes per parameter, measured after a training step ({rows[0]['params'] / 1e6:.1f}M parameters; the "
        "distinct storages of parameters, gradients, masters and optimizer state; activations not counted):",
        "",
        "| setup | optimizer | params | grads in step | grads after step | masters | optimizer state "
        "| total in step | total after step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['optimizer']} | {r['param_bytes']:.2f} | {r['grad_bytes_in_step']:.2f} | "
            f"{r['grad_bytes_after_step']:.2f} | {r['master_bytes']:.2f} | {r['state_bytes']:.2f} | "
            f"{r['total_in_step']:.2f} | {r['total_after_step']:.2f} |"
        )
    return lines
