"""Seeded training runs shared by the differential and fault-injection tests."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad")
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
"""(major, minor) of the torch under test: CI tests 2.13; ``make test-older-torch`` another (docs/development.md)."""
MODES = ("forloop", "foreach", "fused")


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (the folder is no package): its code, its ``main`` not run."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def swap_future(on: bool) -> Iterator[None]:
    """torch's ``set_swap_module_params_on_conversion(on)`` for the block, restored after it."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(on)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    """A small MLP or a small transformer block with a linear head, seeded."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if kind == "transformer":
        return nn.Sequential(
            nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True),
            nn.Linear(16, 4),
        )
    raise ValueError(f"unknown model kind {kind!r}")


def make_optimizer(name: str, mode: str, params: Any) -> torch.optim.Optimizer:
    """``name`` in OPTIMIZERS, ``mode`` in MODES (for-loop, foreach or fused implementation)."""
    flags = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[mode]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, **flags)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, **flags)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, **flags)
    raise ValueError(f"unknown optimizer {name!r}")


def batches(kind: str, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (8, 16) if kind == "mlp" else (4, 6, 16)
    out_shape = (8, 4) if kind == "mlp" else (4, 6, 4)
    return [(torch.randn(shape, generator=g), torch.randn(out_shape, generator=g)) for _ in range(steps)]


@dataclass
class Trace:
    """What a run leaves after every step."""

    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    params: list[list[torch.Tensor]] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict()["state"])


def run(
    scaler: Any,
    *,
    model: str = "mlp",
    optimizer: str = "adam",
    mode: str = "foreach",
    steps: int = 50,
    autocast: bool = True,
    recipe: str = "plain",
    inject: dict[int, list[tuple[int, float]]] | None = None,
    max_norm: float = 1.0,
    on_step: Callable[[int], None] | None = None,
) -> Trace:
    """Train ``model`` with ``scaler``; ``inject[step] = [(param_index, value), ...]`` poisons grads.

    ``recipe``: "plain" (step), "unscale" (unscale_ then step), "unscale_clip" (unscale_,
    torch.nn.utils.clip_grad_norm_, step) or "clip" (scaler.clip_grad_norm_, step).
    """
    net = make_model(model)
    opt = make_optimizer(optimizer, mode, net.parameters())
    params = list(net.parameters())
    trace = Trace()
    for step, (x, y) in enumerate(batches(model, steps)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = net(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        for index, value in (inject or {}).get(step, []):
            params[index].grad.view(-1)[0] = value
        if recipe in ("unscale", "unscale_clip"):
            scaler.unscale_(opt)
        if recipe == "unscale_clip":
            trace.norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm))
        if recipe == "clip":
            trace.norms.append(scaler.clip_grad_norm_(opt, max_norm))
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        trace.scales.append(float(scaler._scale))
        trace.skipped.append(all(torch.equal(b, p) for b, p in zip(before, params, strict=True)))
        trace.params.append([p.detach().clone() for p in params])
        trace.states.append(optimizer_state(opt))
        if on_step is not None:
            on_step(step)
    return trace


def assert_same_state(a: Any, b: Any, where: str) -> None:
    """Recursive bit-exact equality of optimizer states (tensors by torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_trace(ours: Trace, theirs: Trace) -> None:
    """Bit-identical scale, skip pattern, parameters and optimizer state after every step."""
    assert ours.scales == theirs.scales
    assert ours.skipped == theirs.skipped
    for step, (p_ours, p_theirs) in enumerate(zip(ours.params, theirs.params, strict=True)):
        for i, (a, b) in enumerate(zip(p_ours, p_theirs, strict=True)):
            assert torch.equal(a, b), f"step {step} param {i}: max diff {(a - b).abs().max()}"
    for step, (s_ours, s_theirs) in enumerate(zip(ours.states, theirs.states, strict=True)):
        assert_same_state(s_ours, s_theirs, f"step {step} optimizer state")
