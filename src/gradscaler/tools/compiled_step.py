"""Whole training steps under ``torch.compile``, with torch's scaler or gradscaler: the loop shapes
users write, what Dynamo made of them (recompiles, graph breaks and where) and the state they leave.

One definition serves ``tests/test_compiled.py`` (counts and bits) and ``gradscaler bench --sections
compile`` (time). A step does the forward under float16 autocast (or on a float16 model), the scaled
backward, the shape's clipping, ``step``, ``update`` and ``zero_grad``; ``bad`` (a tensor, so that no
value becomes a guard) multiplies the loss, inf on the steps a run injects an overflow. The reference
for float16 parameters (``masters``) is the recipe by hand: float32 copies, torch's scaler over an
optimizer of the copies, the gradients moved before ``step`` and the copies written back after it (a
skipped step leaves the copies as they were, so writing them back always is the same as after an
applied step only).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradscaler
from gradscaler import GradScaler

WIDTH = 32
DEPTH = 4
MAX_NORM = 0.5
PACKAGE = Path(gradscaler.__file__).resolve().parent  # the library; its tools/ (this file) are user code here


def in_library(filename: str) -> bool:
    """Whether a frame's file is the library's own code (not ``tools/``, whose steps stand for a user's)."""
    path = Path(filename).resolve()
    return path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "tools")


@dataclass(frozen=True)
class Shape:
    """A loop shape: ``fused`` AdamW or the for-loop one; ``clip`` ``"none"``, ``"unscale"``
    (``unscale_`` + ``torch.nn.utils.clip_grad_norm_``) or ``"scaler"`` (``scaler.clip_grad_norm_``;
    torch's scaler has none, so its run makes the two calls); ``masters``: a float16 model trained
    through float32 masters (the recipe by hand for torch's scaler)."""

    fused: bool = False
    clip: str = "none"
    masters: bool = False

    @property
    def name(self) -> str:
        parts = [
            "fused" if self.fused else "adamw",
            {"none": "", "unscale": "unscale+clip", "scaler": "scaler-clip"}[self.clip],
        ]
        if self.masters:
            parts.append("masters")
        return "-".join(p for p in parts if p)


SHAPES = [Shape(fused, clip) for fused in (False, True) for clip in ("none", "unscale", "scaler")] + [
    Shape(False, "none", True),
    Shape(False, "unscale", True),
    Shape(True, "scaler", True),
]


@dataclass
class Run:
    """A model, its optimizer and scaler, and ``step(x, bad)``, the iteration as the loop writes it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    step: Callable[[torch.Tensor, torch.Tensor], None]

    def state(self) -> list[torch.Tensor]:
        """Parameters, optimizer state tensors and the scale, for a bit-for-bit comparison."""
        out = [p.detach().clone() for p in self.model.parameters()]
        for tensor in [p for g in self.optimizer.param_groups for p in g["params"]]:  # masters once bound
            for value in self.optimizer.state[tensor].values():
                if isinstance(value, torch.Tensor):
                    out.append(value.detach().clone())
        out.append(torch.tensor(self.scaler.get_scale(), dtype=torch.float64))
        return out


def build(
    shape: Shape,
    ours: bool,
    seed: int = 0,
    growth_interval: int = 4,
    width: int = WIDTH,
    device: str = "cpu",
    compile_model: str | None = None,
) -> Run:
    """``shape``'s model, optimizer, scaler (gradscaler if ``ours``, else torch's) and step;
    ``compile_model``: a backend to compile the model alone with (the scaler's calls then run eagerly)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(DEPTH)]).to(device)
    if shape.masters:
        model.half()
    net = model if compile_model is None else torch.compile(model, backend=compile_model)
    kwargs: dict[str, Any] = {"growth_interval": growth_interval}
    scaler: Any
    if ours:
        scaler = GradScaler(device, master_weights=shape.masters, **kwargs)
    else:
        scaler = torch.amp.GradScaler(device, **kwargs)
    params = list(model.parameters())
    copies = [p.detach().float().requires_grad_() for p in params] if shape.masters and not ours else []
    optimizer = torch.optim.AdamW(copies or params, lr=1e-3, fused=shape.fused)

    def forward(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        if shape.masters:
            return net(x.half()).float().pow(2).mean() * bad
        with torch.autocast(device, dtype=torch.float16):
            return net(x).float().pow(2).mean() * bad

    def move_to_copies() -> None:  # the recipe by hand: gradients to the float32 copies
        for p, c in zip(params, copies, strict=True):
            c.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def step(x: torch.Tensor, bad: torch.Tensor) -> None:
        scaler.scale(forward(x, bad)).backward()
        if copies:
            move_to_copies()
        if shape.clip == "scaler" and ours:
            scaler.clip_grad_norm_(optimizer, MAX_NORM)
        elif shape.clip != "none":
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(copies or params, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if copies:
            with torch.no_grad():
                for p, c in zip(params, copies, strict=True):
                    p.copy_(c)

    return Run(model, optimizer, scaler, own_code(step, "step_gradscaler" if ours else "step_torch"))


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` over a copy of its code object, named ``name``. Dynamo keeps its compiled entries on the
    code object, and every ``step`` that ``build`` makes is a closure over one code object: two runs
    compiled in one process (the bench interleaves torch's and ours) would share one cache: the second
    run's graph a recompile of the first's, and each call looking through the other's entries. A copy
    per run keeps apart what the two scalers compile, as two processes would."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def inputs(
    steps: int, seed: int = 1, overflow_every: int = 9, width: int = WIDTH, batch: int = 8, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A new batch every step (so the clipping norm changes every step) and an overflow every
    ``overflow_every`` steps (so the scale backs off, and grows again in between)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        x = torch.randn(batch, width, generator=gen).to(device)
        bad = torch.tensor(float("inf") if i % overflow_every == overflow_every - 1 else 1.0).to(device)
        out.append((x, bad))
    return out


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _logged(artifact: str, logger: str) -> Iterator[list[str]]:
    handler = _Messages()
    torch._logging.set_logs(**{artifact: True})  # type: ignore[arg-type]
    logging.getLogger(logger).addHandler(handler)
    try:
        yield handler.messages
    finally:
        logging.getLogger(logger).removeHandler(handler)
        torch._logging.set_logs()


def recompiles() -> Any:
    """A block's recompilation messages, as ``TORCH_LOGS=recompiles`` prints them."""
    return _logged("recompiles", "torch._dynamo.guards.__recompiles")


@dataclass(frozen=True)
class Break:
    """One graph break as ``TORCH_LOGS=graph_breaks`` reports it: where, and Dynamo's explanation."""

    where: str  # file:line of the frame Dynamo broke in
    reason: str  # Dynamo's one-line name of it, e.g. "Skip inlining `torch.compiler.disable()`d function"
    explanation: str

    @property
    def in_library(self) -> bool:
        return in_library(self.where.rsplit(":", 1)[0])

    @property
    def on_purpose(self) -> bool:
        """One of the library's marked methods (``gradscaler.compiled``), called from the user's code."""
        return "gradscaler's bookkeeping runs eagerly" in self.explanation


def _parse_break(message: str) -> Break:
    lines = message.splitlines()
    where = lines[0].rsplit(" in user code at ", 1)[-1].strip()  # also "(user stack suppressed ...)" repeats
    body = [line.strip() for line in lines[2:] if line.strip()]
    explanation = next((line for line in body if line.startswith("Explanation:")), "")
    return Break(where, body[0] if body else "", explanation)


def breaks(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]], backend: str = "aot_eager") -> list[Break]:
    """The graph breaks of ``run.step`` compiled: the first batch eagerly (the lazy state of the scaler
    and the optimizer, as in a loop's second step), the second compiled."""
    run.step(*batches[0])
    with _logged("graph_breaks", "torch._dynamo.symbolic_convert.__graph_breaks") as messages:
        torch.compile(run.step, backend=backend)(*batches[1])
    found: list[Break] = []
    for message in messages:  # a break inside an inlined call is logged in the caller, then in its own frame
        parsed = _parse_break(message)
        if not found or found[-1] != parsed:
            found.append(parsed)
    return found


def drive(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]], backend: str | None, **options: Any) -> None:
    """Every batch through ``run.step``, compiled with ``backend`` (None: eagerly)."""
    step = run.step if backend is None else torch.compile(run.step, backend=backend, **options)
    for x, bad in batches:
        step(x, bad)
