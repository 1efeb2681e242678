"""The recipe for float16 parameters done by hand: the reference every master-weights test is held to.

``Recipe`` keeps float32 copies of a model's float16/bfloat16 parameters, an optimizer over the copies
(and the float32 parameters as they are) and torch's scaler over that optimizer: before the scaler's
first call of an iteration ``copy.grad = p.grad.float()`` where ``p.grad`` exists, else None, then
``p.grad = None``; after an applied step ``p.copy_(copy)``. ``zero_grad("optimizer")`` clears both
sides, as Megatron-LM's ``Float16OptimizerWithFloat16Params.zero_grad`` does. ``Ours`` drives
``GradScaler(master_weights=True)`` through the same calls, so one loop (``run``) drives either and
the two traces must be equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler

LOW_PRECISION = (torch.float16, torch.bfloat16)
MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, MakeOptimizer] = {
    "sgd_momentum_forloop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}
SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**24, "growth_interval": 3}  # early overflows, then growth


class Boom(Exception):
    """Raised from inside ``optimizer.step`` when a test arms it."""


class System:
    """A model, its optimizer and scaler, and the iteration's calls as a training loop makes them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # the one the scaler steps
    scaler: Any
    armed = False  # raise ``Boom`` inside the next ``optimizer.step``
    raised = 0

    def arm_step_failure(self) -> None:
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self.armed:
                self.armed = False
                self.raised += 1
                raise Boom

        self.optimizer.register_step_pre_hook(hook)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def zero_grad(self, side: str, set_to_none: bool) -> None:
        raise NotImplementedError

    def unscale_(self) -> None:
        raise NotImplementedError

    def clip(self, max_norm: float) -> None:
        """torch's recipe: ``unscale_``, then ``torch.nn.utils.clip_grad_norm_`` of the trained parameters."""
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def update(self) -> None:
        self.scaler.update()

    def trained(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, in its order (masters or copies for low-precision ones)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]


class Ours(System):
    """``GradScaler(master_weights=True)`` over the user's own optimizer."""

    def __init__(self, model: nn.Module, make: MakeOptimizer, scaler: GradScaler | None = None) -> None:
        self.model = model
        self.optimizer = make([p for p in model.parameters() if p.requires_grad])
        self.scaler = scaler or GradScaler("cpu", master_weights=True, **SCALER_ARGS)

    def zero_grad(self, side: str, set_to_none: bool) -> None:
        (self.model if side == "model" else self.optimizer).zero_grad(set_to_none)

    def unscale_(self) -> None:
        self.scaler.unscale_(self.optimizer)

    def clip(self, max_norm: float) -> None:
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> None:
        self.scaler.step(self.optimizer)


class Copies:
    """The recipe's float32 copies of the float16/bfloat16 ones among ``params``, and its two moves."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.all = list(params)
        self.pairs = [(p, p.detach().float().requires_grad_()) for p in self.all if p.dtype in LOW_PRECISION]

    def params(self) -> list[torch.Tensor]:
        """What the optimizer steps: each low-precision parameter's copy in its place, the rest as they are."""
        copy_of = {id(p): c for p, c in self.pairs}
        return [copy_of.get(id(p), p) for p in self.all]

    def move_grads(self) -> None:
        """``copy.grad = p.grad.float()``, or None where ``p`` has none; then ``p.grad = None``."""
        for p, c in self.pairs:
            c.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def copy_back(self) -> None:
        """After an applied step: each parameter takes its copy's values."""
        with torch.no_grad():
            for p, c in self.pairs:
                p.copy_(c)


class Recipe(System):
    """The recipe by hand, with torch's scaler (or ``scaler``) over an optimizer of float32 copies."""

    def __init__(self, model: nn.Module, make: MakeOptimizer, scaler: Any = None) -> None:
        self.model = model
        self.copies = Copies(p for p in model.parameters() if p.requires_grad)
        self.optimizer = make(self.copies.params())
        self.scaler = scaler or torch.amp.GradScaler("cpu", **SCALER_ARGS)
        self.moved = False

    def zero_grad(self, side: str, set_to_none: bool) -> None:
        self.model.zero_grad(set_to_none)  # "optimizer": both sides; "model": the copies are set at the move
        if side == "optimizer":
            self.optimizer.zero_grad(set_to_none)

    def move(self) -> None:
        if not self.moved:
            self.copies.move_grads()
            self.moved = True

    def unscale_(self) -> None:
        self.move()
        self.scaler.unscale_(self.optimizer)

    def clip(self, max_norm: float) -> None:
        self.unscale_()
        torch.nn.utils.clip_grad_norm_(self.trained(), max_norm)

    def step(self) -> None:
        self.move()
        self.scaler.step(self.optimizer)
        flags = self.scaler._found_inf_per_device(self.optimizer)
        if not sum(flag.item() for flag in flags.values()):
            self.copies.copy_back()

    def update(self) -> None:
        self.scaler.update()
        self.moved = False

    def edit(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """A user's edit of ``param`` under the recipe: the parameter and its copy take the new values."""
        with torch.no_grad():
            param.copy_(value)
            for p, c in self.copies.pairs:
                if p is param:
                    c.copy_(p)


class OursScalerClips(Ours):
    """``Ours`` clipping with ``scaler.clip_grad_norm_(optimizer, max_norm)``."""

    def clip(self, max_norm: float) -> None:
        self.scaler.clip_grad_norm_(self.optimizer, max_norm)


class RecipeScalerClips(Recipe):
    """The recipe clipping its copies with a gradscaler scaler's ``clip_grad_norm_`` (torch's has none):
    build it with ``GradScaler`` (default arguments: torch's decisions, bit for bit)."""

    def clip(self, max_norm: float) -> None:
        self.move()
        self.scaler.clip_grad_norm_(self.optimizer, max_norm)


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state_by_position(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """The optimizer's state, parameter by parameter in param-group order (masters and copies alike)."""
    return [
        {k: v.clone() for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
        for g in optimizer.param_groups
        for p in g["params"]
    ]


def assert_same_trace(ours: dict[str, list[Any]], reference: dict[str, list[Any]]) -> None:
    """Scales, skips and every parameter after every iteration equal, bit for bit."""
    assert ours["scales"] == reference["scales"], "scales"
    assert len(ours["params"]) == len(reference["params"])
    for step, (a, b) in enumerate(zip(ours["params"], reference["params"], strict=True)):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.dtype == y.dtype and torch.equal(x, y), f"parameter {index} after iteration {step}"


def untouched(state: dict[str, torch.Tensor]) -> bool:
    """A state a fused optimizer made on skipped steps only: ``step`` 0 and zero moments."""
    return all(not torch.any(value) for value in state.values())


def assert_same_state(ours: torch.optim.Optimizer, reference: torch.optim.Optimizer) -> None:
    """Equal state, parameter by parameter; where one side has none, the other's was only ever made on
    skipped steps (torch's scaler keeps what a fused optimizer creates on a skipped first step, ours drops
    it: docs/migration.md)."""
    a, b = state_by_position(ours), state_by_position(reference)
    assert len(a) == len(b)
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if not x or not y:
            assert untouched(x) and untouched(y), index
            continue
        assert x.keys() == y.keys(), index
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), (index, key)


def record(system: System, trace: dict[str, list[Any]]) -> None:
    trace["scales"].append(system.scaler.get_scale())
    trace["params"].append(snapshot(system.model))


def new_trace() -> dict[str, list[Any]]:
    return {"scales": [], "params": []}


class Fp32Copies(Copies):
    """The recipe's copies with float32 accumulation (``accumulate_grads_in_fp32``): after every backward,
    ``c.grad = p.grad.float()`` on the iteration's first gradient (or when ``c.grad`` is None), else
    ``c.grad = c.grad + p.grad.float()``, then ``p.grad = None``; at the move, a copy whose parameter got
    no gradient this iteration has none (it is not stepped), and the next gradient starts a new sum."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__(params)
        self.touched: set[int] = set()

    def accumulate(self) -> None:
        for p, c in self.pairs:
            if p.grad is None:
                continue
            g = p.grad.float()
            c.grad = g if id(c) not in self.touched or c.grad is None else c.grad + g
            self.touched.add(id(c))
            p.grad = None

    def move_grads(self) -> None:
        for _, c in self.pairs:
            if id(c) not in self.touched:
                c.grad = None
        self.touched.clear()


class Fp32Recipe(Recipe):
    """The recipe by hand with float32 accumulation (``Fp32Copies``) and torch's scaler."""

    def __init__(self, model: nn.Module, make: MakeOptimizer, scaler: Any = None) -> None:
        super().__init__(model, make, scaler)
        self.copies = Fp32Copies(self.copies.all)
        self.optimizer = make(self.copies.params())

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        self.copies.accumulate()


class Fp32RecipeScalerClips(Fp32Recipe):
    """``Fp32Recipe`` clipping its copies with a gradscaler scaler's ``clip_grad_norm_`` (``RecipeScalerClips``)."""

    def clip(self, max_norm: float) -> None:
        self.move()
        self.scaler.clip_grad_norm_(self.optimizer, max_norm)


def named(make: MakeOptimizer) -> MakeOptimizer:
    """``make`` given ``(name, parameter)`` pairs (torch's named groups: then every group must be named)."""
    return lambda params: make([(f"p{i}", p) for i, p in enumerate(params)])


def fp32_scaler(**kwargs: Any) -> GradScaler:
    """``GradScaler(master_weights=True, accumulate_grads_in_fp32=True)`` with the tests' settings."""
    return GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, **{**SCALER_ARGS, **kwargs})
