"""The master weights as a state machine: every operation a loop can do, in any order, against the recipe by hand.

``MastersMachine`` (Hypothesis's ``RuleBasedStateMachine``) drives one small model (``masters_net.Net``) twice:
``Ours``, through ``GradScaler(master_weights=True)`` over the user's optimizer, and ``Reference``, the recipe by
hand of tests/recipe.py (float32 copies, torch's scaler over an optimizer of the copies, copy back after an
applied step). Every rule runs on both sides; a rule that raises must raise the same error (type and message) on
both, and one that only ours refuses (torch's distributed-checkpoint helpers) must change nothing. After every
rule, refusals included, the invariant compares bit for bit: each parameter (dtype, values, ``requires_grad``),
each master (ours: the master of a bound parameter; the recipe: its copy; either: the parameter in float32 where
there is none), each parameter's ``.grad`` (except after the user's ``unscale_``, where ours keeps the float16
gradients unscaled: documented), each float32 gradient (``OursSide.sums``: the master's ``.grad``; with float32
accumulation before the move, the iteration's sum: held by the hook before the binding, the master's ``.grad``
after; the recipe: its copy's ``.grad``), the optimizer's groups and state by position, and the scaler's scale and
growth tracker; each ``step`` also compares the skip decision.

Each example draws its accumulation mode: micro-batches accumulated in the parameters' dtype on both sides, or
``accumulate_grads_in_fp32=True`` against the recipe with float32 accumulation (``recipe.Fp32Recipe``: after every
backward ``copy.grad = p.grad.float()`` on the iteration's first gradient, ``copy.grad + p.grad.float()`` after it,
``p.grad = None``). Every rule runs in both modes; ``accumulation`` is a whole iteration of 2 to 4 micro-batches.

Rules: ``backward`` (a batch, with or without the ``block`` layer, i.e. a parameter without a gradient, with or
without an inf or NaN injected into one layer's gradient), ``unscale_``, ``scaler.clip_grad_norm_``, torch's
``clip_grad_norm_`` over ``model.parameters()``, ``step``, ``update``, ``zero_grad`` from the optimizer or the model
with ``set_to_none`` both ways, freezing and unfreezing a layer or every float16 layer at once, switching one
layer or all of them to float16, bfloat16 or float32 with torch's swap-tensors future on or off, a round trip
through another dtype and back
(a bfloat16 evaluation: ``model.bfloat16()``, ``model.half()``, with nothing or a skipped step between),
``add_param_group`` in torch's forms (a list, a generator, one tensor per group; ``(name, parameter)`` pairs when
the example builds its optimizer of named parameters) and one holding a parameter the optimizer has (refused as
torch refuses it),
``save`` to bytes (at any point of an iteration: in the middle of an accumulation no checkpoint holds the partial
sum, on either side), loads into fresh objects at any point of an iteration (a pre-emption: a new process; the model's
checkpoint first, the optimizer's first, each after an iteration that bound the fresh optimizer) or, between
iterations, into the bound objects, each optionally followed at once by a save,
``get_optimizer_state_dict``/``set_optimizer_state_dict`` (refused), and arming an exception inside the next
``optimizer.step``; and four rules that are sequences of the others, so that the flows users write lie within a
small budget's reach: ``iteration`` (``zero_grad``, backward, a clipping, ``step``, ``update``), ``accumulation``
(``zero_grad`` from either side, both ways, then 2 to 4 backwards, a frozen layer unfrozen after the first of them
or not, an inf or NaN in one of them, ``block`` without
a gradient in some, all or none of them, a clipping, ``step``, ``update``) and ``save_and_resume`` (a checkpoint
now and a new process resuming from it); and ``unscale_every_micro_batch`` (``unscale_``, and a clipping, after each
backward of a window: the second ``unscale_`` raises torch's error on both sides, and the loop updates and starts
again); and, with float32 sums, ``refused_backward`` (ours refuses ``backward(create_graph=True)`` of a scaled loss
and changes nothing; the recipe makes no call). Optimizers: AdamW (foreach, behind five subclasses that override
``state_dict``, as wrappers stack), fused AdamW, SGD with momentum, Adagrad; starting scales 2**14 (applied steps)
or 2**40 (every step skipped for a long while, so the optimizer has no state).

References other than the recipe by hand, where the docs name them and nowhere else: ``scaler.clip_grad_norm_``
is compared with the recipe clipping its copies with a gradscaler ``GradScaler`` (docs/migration.md, Clipping: its
norms in the optimizer's order), so an example draws which scaler the recipe uses, and that rule runs only when it
is gradscaler's; a fused optimizer's state made on a skipped first step is kept by torch's scaler and dropped by
ours (``recipe.assert_same_state``).

Not driven (named, as the issue asks): a change of dtype between ``unscale_`` and ``step`` (ours keeps the float16
gradients after the user's ``unscale_`` and the conversion rewrites them, which ``step`` refuses: documented);
a cast to float32 while a loaded checkpoint's masters wait for their parameters' first move (the layer
then continues from its master as a float32 parameter, with a ``ContinuedWarning``: documented for peft's
adapters; casts to float16 and bfloat16 there are driven, round trips too, which reaches issue 35's defect 5);
with float32 accumulation, a conversion under the swap future of a layer whose parameters a first iteration (of a
run or a fresh resume) met in a scaled graph before the optimizer's first contact (``first_hooks_held``: they are
held weakly, which torch's swap refuses; documented, found here once casts after fresh loads were driven; the
other layers convert);
a change of dtype of a layer added by ``add_param_group`` before its first move (the
recipe builds its copy when the group is added, ours at the next move: documented);
loads of a checkpoint into bound objects whose layers
have other dtypes than when it was saved (a saved master is used only where it rounds to the parameter:
documented); ``zero_grad``
with ``set_to_none=False`` between ``unscale_`` and ``step`` (it writes the float16 gradients ours keeps after
the user's ``unscale_``, which ``step`` refuses: documented; even ``optimizer.zero_grad``, which zeroes the
masters' too); loads into the bound objects inside an iteration (they happen between iterations here, and a load
clears the gradients on both sides as the loop's next ``zero_grad`` would); ``model.zero_grad`` with parameters
outside the optimizer (every parameter of ``Net`` that has a gradient is the optimizer's);
a run whose first iteration (the binding) has every float16 layer frozen (tried as ``start(warm_up=True)``: the
model does not hold there, since the recipe's copies exist from its construction while ours' masters are made at
the binding, so a cast before it rounds ours', as for ``extra`` below; and an optimizer resumed fresh from such a
run's checkpoint is unknown to the scaler until its first contact, so the distributed-checkpoint helpers run on it
as on any optimizer; ``freeze("all")`` after the first iteration is driven);
the retry of a fused optimizer's step that raised after every gradient was cleared, against torch's scaler
(``rechecks_nothing``: torch's ``update`` asserts, ours counts a clean step: documented);
``torch.nn.utils.clip_grad_value_`` over ``model.parameters()`` without float32 accumulation (``step`` refuses
it, documented; with it, it is driven: (b) below);
activation checkpointing (the model has none: tests/test_masters_activation_checkpoint.py holds both variants
against the recipe, with float32 sums from the first iteration).

An armed exception with fused AdamW is driven against the recipe with one correction where torch's scaler is
at fault (``Reference.step``; docs/migration.md, What differs): torch's scaler leaves ``grad_scale`` and
``found_inf`` on a fused optimizer whose ``step`` raised, and the stale ``grad_scale`` multiplies the next step's
(seed 5, 400 sequences: ``arm_step_failure``, ``step``, ``step``, a float32 parameter 4.8e-7 off) or, stale as
``None`` after ``unscale_``, makes a later step raise TypeError; ours removes them, as the corrected recipe does.

Not driven yet (each excluded where its comment says). A resume that continues a float32 layer from its master
(``OursSide.continues``: documented for peft, with a ``ContinuedWarning``) is not driven either, nor with float32
accumulation a fresh resume with a float32 layer (``resume_driven``).

Driven since their fixes (issue 35x lifted their exclusions one at a time, CI's 300 sequences holding after each):
(a) the swap-tensors future with float32 accumulation, kept on for the rest of the run once a conversion turns it
on, as docs/migration.md says (``convert``; it found two defects, fixed: a parameter frozen when swapped was refused
by torch's hook error from the next backward, and a round trip whose second swap got the first tensor's address back
kept its dead hook); (b) ``clip_grad_value_`` over ``model.parameters()`` (``clip_value_driven``); (c)
``optimizer.zero_grad()`` reaching the sums held before a bound optimizer's next move (``zero_grad``; before the
first binding it reaches none: documented, not driven), a frozen layer in an optimizer not bound yet, and
``add_param_group`` in a fresh resume's first iteration. The "master 8 (the layer ``add_param_group`` added) one
float16 rounding off" that lifting them together found was the machine's model: a checkpoint saved before that
layer's first move holds no master for it, so after a resume its master is made at the next move, from a parameter a
cast before that move rounded (documented: ``extra_waiting`` now spans saves and resumes, ``Config.moved``). The
same runs found a fused AdamW step skipped after a fresh resume from a bfloat16 round trip writing the masters into
the parameters (fixed: ``Pair.exact`` at a binding to a saved master), and with float32 accumulation a layer frozen
without optimizer state at a binding (a fresh resume that binds before its loads), unfrozen later, summed its next
iteration in float16 (fixed: ``Accumulation.wake``). (With fused AdamW a skipped step after a cast of a bound layer
wrote the master into the parameter: found here, fixed by ``Pair.copy_back``, driven since.)
"""

from __future__ import annotations

import contextlib
import copy
import io
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.amp.grad_scaler import OptState
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from gradscaler import GradScaler
from gradscaler.masters import SAVED_KEY
from gradscaler.masters.checkpoint import rounds_to
from helpers import swap_future
from masters_net import LOW_LAYERS, Net, loss_of
from recipe import Boom, Copies, Fp32Copies, Fp32Recipe, MakeOptimizer, Ours, Recipe, System, untouched
from recipe import named as recipe_named

LAYERS = ("inp", "block", "norm", "head", "extra")
SCALES: dict[str, dict[str, Any]] = {
    "applied": {"init_scale": 2.0**14, "growth_interval": 2},
    "skipping": {"init_scale": 2.0**40, "growth_interval": 2},  # about 25 skipped steps before the first applied
}


def nested_adamw(levels: int = 5) -> type[torch.optim.Optimizer]:
    """AdamW behind ``levels`` subclasses that each override ``state_dict`` (wrappers stack so)."""
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    for level in range(levels):

        def state_dict(self: Any, _base: type = cls) -> dict[str, Any]:
            return _base.state_dict(self)  # type: ignore[no-any-return]

        cls = type(f"AdamWLevel{level}", (cls,), {"state_dict": state_dict})
    return cls


NestedAdamW = nested_adamw()
OPTIMIZERS: dict[str, MakeOptimizer] = {
    "adamw": lambda p: NestedAdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMS = ("list", "generator", "tensor")
THEN = ("", "save", "save, resume")
CLIPS = ("", "torch", "scaler", "value")
ADAGRAD_STATE_AT_CONSTRUCTION = bool(torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))]).state)
"""torch 2.11 and older (2.12 not tried) make Adagrad's state in its constructor only, so a group added later has
none and torch's own step raises ``KeyError: 'sum'``; 2.13 makes it at the first step."""
ABSENT = "absent"  # a parameter without a master (ours) or copy (the recipe): its gradient is compared as such
ORDERS = ("model-first", "optimizer-first", "bound-model-first", "bound-optimizer-first")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().reshape(-1).view(as_int), b.detach().reshape(-1).view(as_int))


@dataclass(frozen=True)
class Plan:
    """One backward: which batch, whether ``block`` takes part (else it gets no gradient), and an inf or NaN
    injected into one layer's weight gradient. (The accumulation mode is the example's: ``MastersMachine.start``.)"""

    number: int
    use_block: bool = True
    inject: str = ""
    layer: str = "block"


@dataclass
class Config:
    """What a model is built as: each layer's dtype and ``requires_grad``, and the form ``extra`` joined in."""

    dtypes: dict[str, torch.dtype]
    trainable: dict[str, bool]
    added: str = ""
    moved: bool = False  # ours has moved since ``extra`` was added (``MastersMachine.extra_waiting``)


def build_net(config: Config, seed: int) -> Net:
    net = Net(seed)
    for name in LAYERS:
        layer = getattr(net, name)
        layer.to(config.dtypes[name])
        layer.requires_grad_(config.trainable[name])
    net.use_extra = bool(config.added)
    return net


def extra_groups(params: list[torch.Tensor], form: str) -> list[dict[str, Any]]:
    """The groups ``add_param_group`` gets for ``extra``'s parameters in ``form`` (``named``: torch's
    ``(name, parameter)`` pairs, which an optimizer built of named parameters takes only)."""
    if form == "named":
        return [{"params": [(f"extra.{i}", p) for i, p in enumerate(params)], "lr": 5e-3}]
    if form == "tensor":
        return [{"params": p, "lr": 5e-3} for p in params]
    if form == "generator":
        return [{"params": (p for p in params), "lr": 5e-3}]
    return [{"params": list(params), "lr": 5e-3}]


class Side:
    """What both sides do the same way; ``OursSide`` and ``Reference`` differ only where the recipe does."""

    system: System

    def backward(self, plan: Plan) -> None:
        model = self.system.model
        self.system.backward(loss_of(model, plan.number, plan.use_block, plan.inject, plan.layer))  # type: ignore[arg-type]

    def convert(self, layers: tuple[str, ...], dtype: torch.dtype, swap: bool) -> None:
        with swap_future(swap):
            for name in layers:
                getattr(self.system.model, name).to(dtype)

    def freeze(self, layer: str, trainable: bool) -> None:
        getattr(self.system.model, layer).requires_grad_(trainable)

    def unscale_(self) -> None:
        self.system.unscale_()

    def update(self) -> None:
        self.system.update()

    def arm(self) -> None:
        self.system.armed = True

    def step(self) -> tuple[bool, bool]:
        """``scaler.step``; whether it skipped (from the scaler's record, as the recipe reads it), and whether
        ``optimizer.step`` raised (an armed failure)."""
        raised = False
        try:
            self.system.step()
        except Boom:
            raised = True
        flags = self.system.scaler._found_inf_per_device(self.system.optimizer)
        return bool(sum(float(flag) for flag in flags.values())), raised


class OursSide(Side):
    def __init__(
        self, make: MakeOptimizer, config: Config, scales: dict[str, Any], seed: int = 0, accumulate: bool = False
    ) -> None:
        model = build_net(config, seed)
        scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=accumulate, **scales)
        self.system = Ours.__new__(Ours)
        self.system.model, self.system.scaler = model, scaler
        self.system.optimizer = make(model.base_params())
        if config.added:
            for group in extra_groups(list(model.extra.parameters()), config.added):
                self.system.optimizer.add_param_group(group)
        self.system.arm_step_failure()

    def clip_scaler(self, max_norm: float) -> None:
        self.system.scaler.clip_grad_norm_(self.system.optimizer, max_norm)

    def clip_torch(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.system.model.parameters(), max_norm)

    def clip_value(self, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(self.system.model.parameters(), clip_value)

    def continues(self) -> bool:
        """Whether a float32 parameter has a master it differs from (a bound layer cast to float32 before its
        next applied step): resumed from a checkpoint saved now, with the layer float32, it continues from its
        saved master as a float32 parameter of its own, with a ``ContinuedWarning`` (documented for peft's
        adapters: that run does not equal the recipe's, which keeps a copy; its gradient stays in ``p.grad``)."""
        pairs = self.system.scaler.master_weights(self.system.optimizer)
        return any(low.dtype == torch.float32 and not same_bits(low, master) for low, master in pairs)

    def bound(self) -> bool:
        """Whether the scaler has bound masters of the optimizer (a fresh resume binds at its first move)."""
        return bool(self.system.scaler.master_weights(self.system.optimizer))

    def held_sums(self) -> bool:
        """Whether a float32 sum is held by its hook, not yet by a master (before the parameter's binding)."""
        accumulation = self.system.scaler._masters._sums
        return accumulation is not None and any(found.total is not None for found in accumulation._sums.values())

    def sums(self, pending: bool) -> list[torch.Tensor | str | None]:
        """Each parameter's float32 gradient: with ``accumulate_grads_in_fp32``, before the move (``pending``),
        the iteration's float32 sum (None before its first gradient; held by the hook before the binding, else
        the master's ``.grad``); otherwise the master's ``.grad``; ``ABSENT`` where there is no master."""
        scaler = self.system.scaler
        masters = {id(low): master for low, master in scaler.master_weights(self.system.optimizer)}
        accumulation = scaler._masters._sums
        found: list[torch.Tensor | str | None] = []
        for p in self.system.model.parameters():
            hook = None if accumulation is None else accumulation.sum_of(p)
            master = masters.get(id(p))
            if pending and hook is not None and hook.handle is not None:
                held = None if hook.master is None else hook.master()
                if hook.fresh:
                    found.append(None)
                elif hook.total is not None:
                    found.append(hook.total)
                else:
                    found.append(None if held is None else held.grad)
            else:
                found.append(ABSENT if master is None else master.grad)
        return found

    def add(self, form: str, held: bool) -> None:
        model = self.system.model
        params = [model.inp.weight] if held else list(model.extra.parameters())
        for group in extra_groups(params, form):
            self.system.optimizer.add_param_group(group)
        model.use_extra = True

    def waiting(self) -> set[int]:
        """The ids of the optimizer's tensors whose master a load left for the next move (documented: a saved
        master is taken at the next move where the model was loaded after the optimizer, or the parameter had
        no master yet; a parameter written since its master's last copy refreshes it there); from that move on
        they are compared bit for bit. Reads the binding's pairs."""
        optimizer = self.system.optimizer
        found = {
            id(group["params"][index])
            for group in optimizer.param_groups
            for index in (group.get(SAVED_KEY) or {}).get("masters", {})
        }
        binding = self.system.scaler._masters._bindings.get(optimizer)
        if binding is not None:
            found |= {id(pair.master) for pair in binding.pairs if pair.pending is not None or pair.written()}
        return found

    def masters(self) -> list[torch.Tensor | None]:
        """Each parameter's master, or the parameter in float32 where it has none; None where a loaded
        checkpoint's master waits for the next move (``waiting``)."""
        pairs = self.system.scaler.master_weights(self.system.optimizer)
        found = {id(low): master for low, master in pairs}
        waiting = self.waiting()
        return [
            None if id(found.get(id(p), p)) in waiting else found.get(id(p), p).detach().float()
            for p in self.system.model.parameters()
        ]

    def save(self) -> bytes:
        buffer = io.BytesIO()
        system = self.system
        state = {"model": system.model.state_dict(), "optimizer": system.optimizer.state_dict()}
        torch.save({**state, "scaler": system.scaler.state_dict()}, buffer)
        return buffer.getvalue()

    def load(self, blob: bytes, optimizer_first: bool) -> None:
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        system = self.system
        if optimizer_first:
            system.optimizer.load_state_dict(saved["optimizer"])
        system.model.load_state_dict(saved["model"])
        if not optimizer_first:
            system.optimizer.load_state_dict(saved["optimizer"])
        system.scaler.load_state_dict(saved["scaler"])
        system.zero_grad("optimizer", True)


class Reference(Side):
    """The recipe by hand (``recipe.Recipe``), with ``extra``'s copies made when it is added."""

    def __init__(
        self, make: MakeOptimizer, config: Config, scales: dict[str, Any], scaler: str, accumulate: bool = False
    ) -> None:
        model = build_net(config, 0)
        reference: Any = torch.amp.GradScaler("cpu", **scales) if scaler == "torch" else GradScaler("cpu", **scales)
        kind = Fp32Recipe if accumulate else Recipe  # with float32 accumulation: its copies sum every backward
        self.system = kind.__new__(kind)
        self.system.model, self.system.scaler, self.system.moved = model, reference, False
        self.system.copies = (Fp32Copies if accumulate else Copies)(model.base_params())
        self.system.optimizer = make(self.system.copies.params())
        self.system.arm_step_failure()

    @property
    def recipe(self) -> Recipe:
        assert isinstance(self.system, Recipe)
        return self.system

    def step(self) -> tuple[bool, bool]:
        """``Side.step``; after an armed failure inside a fused optimizer's step, removes the ``grad_scale`` and
        ``found_inf`` torch's scaler left on it (it removes them only when ``step`` returns; left, they
        multiply the next step's scale or make it raise TypeError: a torch defect, docs/migration.md)."""
        skipped, raised = super().step()
        if raised and hasattr(self.system.optimizer, "found_inf"):
            del self.system.optimizer.grad_scale, self.system.optimizer.found_inf
        return skipped, raised

    def move(self) -> None:
        """The recipe's move: ``copy.grad = p.grad.float()`` or None, then ``p.grad = None``; with float32
        accumulation (``Fp32Copies``) the sum of the iteration's backwards, or None where it had none."""
        self.recipe.move()

    def clip_scaler(self, max_norm: float) -> None:
        self.move()
        self.recipe.scaler.clip_grad_norm_(self.recipe.optimizer, max_norm)

    def clip_torch(self, max_norm: float) -> None:
        copy_of = {id(p): c for p, c in self.recipe.copies.pairs}
        torch.nn.utils.clip_grad_norm_([copy_of.get(id(p), p) for p in self.recipe.model.parameters()], max_norm)

    def clip_value(self, clip_value: float) -> None:
        copy_of = {id(p): c for p, c in self.recipe.copies.pairs}
        torch.nn.utils.clip_grad_value_([copy_of.get(id(p), p) for p in self.recipe.model.parameters()], clip_value)

    def sums(self, pending: bool) -> list[torch.Tensor | str | None]:
        """``OursSide.sums`` of the recipe: its copies' ``.grad`` (with float32 accumulation before the move,
        None for a copy its parameter gave no gradient this iteration)."""
        copies = self.recipe.copies
        copy_of = {id(p): c for p, c in copies.pairs}
        found: list[torch.Tensor | str | None] = []
        for p in self.recipe.model.parameters():
            c = copy_of.get(id(p))
            if c is None:
                found.append(ABSENT)
            elif pending and isinstance(copies, Fp32Copies) and id(c) not in copies.touched:
                found.append(None)
            else:
                found.append(c.grad)
        return found

    def add(self, form: str, held: bool) -> None:
        model = self.recipe.model
        if held:
            params = [dict((id(p), c) for p, c in self.recipe.copies.pairs)[id(model.inp.weight)]]
        else:
            copies = type(self.recipe.copies)(model.extra.parameters())
            params = copies.params()
        for group in extra_groups(params, form):
            self.recipe.optimizer.add_param_group(group)
        if not held:
            self.recipe.copies.all += copies.all
            self.recipe.copies.pairs += copies.pairs
        model.use_extra = True

    def masters(self) -> list[torch.Tensor]:
        found = {id(p): c for p, c in self.recipe.copies.pairs}
        return [found.get(id(p), p).detach().float() for p in self.recipe.model.parameters()]

    def snapshot(self) -> tuple[Any, ...]:
        """The recipe's whole state, for a load to restore (its checkpoint, with the copies' values); the scaler by
        its state dict (torch's refuses a copy in the middle of an iteration, where a checkpoint may be taken)."""
        r = self.recipe
        return (*copy.deepcopy((r.model, r.copies, r.optimizer)), type(r.scaler), r.scaler.state_dict())

    def restore(self, snapshot: tuple[Any, ...], into_bound: bool) -> None:
        """A load: the uninterrupted run from the save on. ``into_bound``: the values and state go into the
        objects the recipe has (their layers' dtypes as when saved), else the snapshot's objects replace them."""
        model, copies, optimizer = copy.deepcopy(snapshot[:3])
        scaler = snapshot[3]("cpu")
        scaler.load_state_dict(snapshot[4])
        r = self.recipe
        if into_bound:
            r.model.load_state_dict(model.state_dict())
            with torch.no_grad():
                for (_, mine), (_, saved) in zip(r.copies.pairs, copies.pairs, strict=True):
                    mine.copy_(saved)
            r.optimizer.load_state_dict(optimizer.state_dict())
            r.scaler.load_state_dict(scaler.state_dict())
        else:
            r.model, r.copies, r.optimizer, r.scaler = model, copies, optimizer, scaler
            # a deep copy of a fused optimizer loses torch's ``_step_supports_amp_scaling`` (set in its __init__, not
            # kept by Optimizer.__setstate__), and torch's scaler would then step it as an unfused one
            if optimizer.defaults.get("fused"):
                optimizer._step_supports_amp_scaling = True
            r.arm_step_failure()
        if isinstance(r.copies, Fp32Copies):
            r.copies.touched.clear()  # a partial sum is in no checkpoint: the next backward starts a new one
        r.moved = False
        r.zero_grad("optimizer", True)


def outcome(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """``call()``'s result, or what it raised (type and message)."""
    try:
        return call(), None
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"


class MastersMachine(RuleBasedStateMachine):
    ours: OursSide
    reference: Reference
    ended: Callable[[], None] | None = None  # called after every sequence (progress in CI and in the soak script)

    def __init__(self) -> None:
        super().__init__()
        self.phase = "idle"  # idle -> backward -> moved (unscale_/clip) -> stepped -> idle (update)
        self.grads = False  # some gradient exists (else torch's scaler asserts "No inf checks were recorded")
        self.saved: tuple[bytes, tuple[Any, ...], Config] | None = None
        self.saved_continues = False  # a resume from ``saved`` would continue a float32 layer (``OursSide.continues``)
        self.swap_run = False  # with float32 sums: the swap-tensors future on for the rest of the run (``convert``)
        self.future = torch.__future__.get_swap_module_params_on_conversion()

    def teardown(self) -> None:
        torch.__future__.set_swap_module_params_on_conversion(self.future)
        if MastersMachine.ended is not None:
            MastersMachine.ended()

    # set-up ----------------------------------------------------------------------------------------------------

    @initialize(
        optimizer=st.sampled_from(sorted(OPTIMIZERS)),
        scales=st.sampled_from(sorted(SCALES)),
        scaler=st.sampled_from(["torch", "gradscaler"]),
        accumulate=st.booleans(),
        named=st.booleans(),
    )
    def start(self, optimizer: str, scales: str, scaler: str, accumulate: bool, named: bool) -> None:
        """``accumulate``: ours with ``accumulate_grads_in_fp32=True`` against the recipe with float32
        accumulation (``recipe.Fp32Recipe``), else both accumulating micro-batches in the parameters' dtype;
        ``named``: the optimizer built of ``(name, parameter)`` pairs, its added groups too."""
        self.make, self.scales, self.scaler_kind = OPTIMIZERS[optimizer], SCALES[scales], scaler
        self.adagrad, self.named = optimizer == "adagrad", named
        if named:
            self.make = recipe_named(self.make)
        self.accumulate = accumulate
        self.config = Config(
            {name: torch.float32 if name == "norm" else torch.float16 for name in LAYERS}, dict.fromkeys(LAYERS, True)
        )
        self.ours = OursSide(self.make, self.config, self.scales, accumulate=accumulate)
        self.reference = Reference(self.make, self.config, self.scales, scaler, accumulate)
        self.number = 0
        self.backward(use_block=True, inject="", layer="block")  # a first iteration binds ours
        self.step()
        self.update()

    def both(self, name: str, *args: Any) -> Any:
        """``name(*args)`` on each side: the same result, or the same error."""
        mine, error = outcome(lambda: getattr(self.ours, name)(*args))
        theirs, their_error = outcome(lambda: getattr(self.reference, name)(*args))
        assert error == their_error, f"{name}{args}: ours {error!r}, the recipe {their_error!r}"
        assert mine == theirs, f"{name}{args}: ours {mine!r}, the recipe {theirs!r}"
        return error

    # the iteration ---------------------------------------------------------------------------------------------

    @precondition(lambda self: self.phase != "moved")  # torch's scaler then steps the new gradients scaled
    @rule(
        use_block=st.booleans(),
        inject=st.sampled_from(["", "", "", "inf", "nan"]),
        layer=st.sampled_from(LOW_LAYERS[:3]),
    )
    def backward(self, use_block: bool, inject: str, layer: str) -> None:
        self.number += 1
        plan = Plan(self.number, use_block, inject, layer)
        if self.both("backward", plan) is None:
            self.grads = True
            self.phase = "backward" if self.phase == "idle" else self.phase

    def refuses_create_graph(self) -> bool:
        """Whether ours refuses a ``backward(create_graph=True)`` of the loss: a float16 parameter every loss
        reaches (``inp``'s, ``head``'s) trains and has its float32 sum's hook."""
        accumulation = self.ours.system.scaler._masters._sums
        model = self.ours.system.model
        reached = [p for name in ("inp", "head") for p in getattr(model, name).parameters()]
        return accumulation is not None and any(
            p.requires_grad and p.dtype == torch.float16 and accumulation.sum_of(p) is not None for p in reached
        )

    @precondition(lambda self: self.accumulate and self.refuses_create_graph())
    @rule(use_block=st.booleans())
    def refused_backward(self, use_block: bool) -> None:
        """Issue 46 item 4: ours refuses ``scale(loss).backward(create_graph=True)`` and changes nothing, the
        float32 ``norm`` layer's gradient and every sum included; the recipe makes no call, and the invariant
        compares every parameter, gradient and master after it as after any rule."""
        scaled = self.ours.system.scaler.scale(loss_of(self.ours.system.model, self.number + 1, use_block))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on create_graph's reference cycle
            _, error = outcome(lambda: scaled.backward(create_graph=True))
        assert error is not None and error.startswith("RuntimeError: Take the penalty's gradient"), error

    @precondition(lambda self: self.grads)
    @rule(clip=st.sampled_from([None, None, 1e-3, 0.5]))
    def unscale_(self, clip: float | None) -> None:
        """``scaler.unscale_``, then with ``clip`` torch's recipe: ``torch.nn.utils.clip_grad_norm_`` over
        ``model.parameters()`` (the recipe: over its copies in the model's order)."""
        if self.both("unscale_") is None:
            self.phase = "moved"
            self.moved()
            if clip is not None:
                self.both("clip_torch", clip)

    @precondition(lambda self: self.grads and self.scaler_kind == "gradscaler")
    @rule(max_norm=st.sampled_from([1e-3, 0.5]))
    def clip_scaler(self, max_norm: float) -> None:
        if self.both("clip_scaler", max_norm) is None:
            self.phase = "moved"
            self.moved()

    @precondition(lambda self: self.grads or self.phase == "moved")
    @rule()
    def step(self) -> None:
        if not self.grads and self.rechecks_nothing():
            return  # torch's update would then assert: a documented difference (``rechecks_nothing``)
        raised = self.ours.system.raised
        if self.both("step") is None:
            self.moved()
            self.phase = "moved" if self.ours.system.raised > raised else "stepped"  # a retry steps unscaled

    @precondition(lambda self: self.phase == "idle")
    @rule(
        clip=st.sampled_from(["", "torch", "scaler"]),
        inject=st.sampled_from(["", "", "inf"]),
        use_block=st.booleans(),
    )
    def iteration(self, clip: str, inject: str, use_block: bool) -> None:
        """A whole training iteration, as a loop writes it: ``optimizer.zero_grad()``, backward, the clipping
        (torch's recipe after ``unscale_``, or ``scaler.clip_grad_norm_``), ``step``, ``update``."""
        self.zero_grad("optimizer", True)
        self.backward(use_block=use_block, inject=inject, layer="head")
        if clip == "torch":
            self.unscale_(clip=0.5)
        elif clip == "scaler" and self.scaler_kind == "gradscaler":
            self.clip_scaler(max_norm=0.5)
        self.step()
        self.update()

    @precondition(lambda self: self.phase == "idle")
    @rule(
        micro=st.integers(2, 4),
        zero=st.sampled_from(["optimizer", "model"]),
        set_to_none=st.booleans(),
        clip=st.sampled_from(CLIPS),
        bad=st.sampled_from(["", "", "inf", "nan"]),
        where=st.integers(0, 3),
        without_block=st.sets(st.integers(0, 3), max_size=4),
        thaw=st.booleans(),
    )
    def accumulation(
        self,
        micro: int,
        zero: str,
        set_to_none: bool,
        clip: str,
        bad: str,
        where: int,
        without_block: set[int],
        thaw: bool,
    ) -> None:
        """An iteration of ``micro`` micro-batches, as a loop with gradient accumulation writes it: ``zero_grad``
        (``zero``, ``set_to_none``), the backwards (``bad`` injected into micro-batch ``where``; ``block`` left out
        of the micro-batches in ``without_block``, so that it gets a gradient in some, all or none; ``thaw``: the
        first frozen layer unfrozen before the second, as a schedule counting micro-batches does), the
        clipping, ``step``, ``update``."""
        self.zero_grad(zero, set_to_none)
        for number in range(micro):
            if thaw and number == 1:
                frozen = [name for name in ("inp", "block", "head") if not self.config.trainable[name]]
                if frozen:
                    self.freeze(frozen[0], True)
            self.backward(
                use_block=number not in without_block, inject=bad if number == where % micro else "", layer="inp"
            )
        if clip == "torch":
            self.unscale_(clip=0.5)
        elif clip == "scaler" and self.scaler_kind == "gradscaler":
            self.clip_scaler(max_norm=0.5)
        elif clip == "value" and self.clip_value_driven():
            self.clip_value(clip_value=1e-3)
        self.step()
        self.update()

    @precondition(lambda self: self.phase == "idle")
    @rule(micro=st.integers(2, 3), clip=st.sampled_from([None, 0.5]), set_to_none=st.booleans())
    def unscale_every_micro_batch(self, micro: int, clip: float | None, set_to_none: bool) -> None:
        """A loop that unscales (and clips) after every backward of its window, as Accelerate's
        ``clip_grad_norm_`` written outside ``if accelerator.sync_gradients:`` does: the second ``unscale_``
        raises torch's error on both sides, changing nothing (issue 46, item 1: ours stepped a sum unscaled
        again at each micro-batch); the loop, catching it, ends the iteration with ``update`` and starts
        again with ``zero_grad``."""
        self.zero_grad("optimizer", True)
        for number in range(micro):
            self.number += 1
            assert self.both("backward", Plan(self.number, True, "", "inp")) is None
            self.grads = True
            error = self.both("unscale_")
            if number == 0:
                assert error is None, error
                self.phase = "moved"
                self.moved()
                if clip is not None:
                    self.both("clip_torch", clip)
            else:
                assert error is not None and "unscale_() has already been called" in error, error
                break
        self.update()
        self.zero_grad("optimizer", set_to_none)

    def rechecks_nothing(self) -> bool:
        """Whether a ``step`` now would be the retry of a fused optimizer's step that raised, with torch's scaler
        on the recipe's side: torch's scaler checks the gradients again then (its record stays READY after
        the raise), and when none is left (a ``model.zero_grad()`` since) its ``update`` asserts "No inf checks
        were recorded prior to update." where ours counts a clean step (docs/migration.md, What differs: an
        optimizer none of whose parameters has a gradient). Not driven (found by the machine, seed 8)."""
        if self.scaler_kind != "torch" or not getattr(self.ours.system.optimizer, "defaults", {}).get("fused"):
            return False
        scaler, optimizer = self.reference.system.scaler, self.reference.system.optimizer
        record = scaler._per_optimizer_states.get(id(optimizer), {})
        return self.phase == "moved" and record.get("stage") is OptState.READY

    def clip_value_driven(self) -> bool:
        """``unscale_`` then ``torch.nn.utils.clip_grad_value_`` over ``model.parameters()``: without float32
        accumulation it writes the float16 gradients ours keeps after ``unscale_``, which ``step`` refuses
        (documented), so it is driven with float32 accumulation only (routed to the masters' gradients, as
        the recipe clips its copies; defect (b) of issue 35m's brief, fixed)."""
        return self.accumulate

    @precondition(lambda self: self.grads and self.clip_value_driven())
    @rule(clip_value=st.sampled_from([1e-3, 0.05]))
    def clip_value(self, clip_value: float) -> None:
        if self.both("unscale_") is None:
            self.phase = "moved"
            self.moved()
            self.both("clip_value", clip_value)

    @rule()
    def update(self) -> None:
        if self.phase == "idle" and not self.grads:
            return  # torch's update asserts "No inf checks were recorded prior to update."
        error = self.both("update")
        if error is None:
            self.phase = "idle"

    @rule(where=st.sampled_from(["optimizer", "model"]), set_to_none=st.booleans())
    def zero_grad(self, where: str, set_to_none: bool) -> None:
        if self.phase == "moved" and not set_to_none:
            return  # zeroing the float16 gradients kept after unscale_ is a write that step refuses (documented)
        if where == "optimizer" and self.ours.held_sums() and not self.ours.bound():
            # before the binding (a fresh resume's first iteration) optimizer.zero_grad() is torch's own and
            # does not reach the float32 sums the hooks hold, where the recipe's clears its copies' sums
            # (documented: docs/migration.md, "What to read instead of p.grad"); a bound optimizer's does
            # (defect (c) of issue 35m's brief, fixed in 9fe8f69: driven)
            return
        for side in (self.ours, self.reference):
            side.system.zero_grad(where, set_to_none)
        if set_to_none:
            self.grads = False

    # the model -------------------------------------------------------------------------------------------------

    @rule(layer=st.sampled_from(["inp", "block", "head", "all"]), trainable=st.booleans())
    def freeze(self, layer: str, trainable: bool) -> None:
        """``layer``'s ``requires_grad_(trainable)``; ``all``: every float16 layer of the base model (a warm-up
        that trains the float32 LayerNorm only, so that a binding then has nothing to master)."""
        for name in ("inp", "block", "head") if layer == "all" else (layer,):
            self.both("freeze", name, trainable)
            self.config.trainable[name] = trainable

    @precondition(lambda self: self.phase != "moved" and not self.extra_waiting())
    @rule(
        layers=st.sampled_from([("block",), ("head",), LOW_LAYERS]), dtype=st.sampled_from(DTYPES), swap=st.booleans()
    )
    def convert(self, layers: tuple[str, ...], dtype: torch.dtype, swap: bool) -> None:
        if dtype == torch.float32 and self.loaded_waiting():
            return  # the layer would continue from its saved master as a float32 parameter (documented)
        if self.accumulate and (swap or self.swap_run) and self.first_hooks_held(layers):
            return  # torch's swap refuses them (documented: convert before training or between steps)
        if self.accumulate and (swap or self.swap_run):
            # with float32 sums a loop keeps the swap-tensors future on for the run once it turns it on
            # (docs/migration.md: turned on around the conversion only, the next step refuses, saying so, and
            # changes nothing; the scaler hooks the swapped parameters again at the next scale() only while the
            # future is on): on from here to the end of the example (``teardown`` restores it)
            self.swap_run = swap = True
            torch.__future__.set_swap_module_params_on_conversion(True)
        self.both("convert", layers, dtype, swap)
        for name in layers:
            self.config.dtypes[name] = dtype

    @precondition(lambda self: self.phase != "moved" and not self.extra_waiting())
    @rule(
        layers=st.sampled_from([("block",), LOW_LAYERS]),
        via=st.sampled_from(DTYPES),
        skipped=st.booleans(),
        swap=st.booleans(),
    )
    def round_trip(self, layers: tuple[str, ...], via: torch.dtype, skipped: bool, swap: bool) -> None:
        """An evaluation in another dtype and back, as a loop writes it (``model.bfloat16()``, evaluate,
        ``model.half()``): ``layers`` cast to ``via`` and back to the dtypes they had, with nothing between or
        (``skipped``, between iterations) an iteration whose step is skipped (an inf in ``head``'s gradient).
        The parameters then hold their values rounded through ``via``, which the next move must keep as
        roundings of the masters (issue 35's defect 6), as the recipe keeps its copies."""
        before = {name: self.config.dtypes[name] for name in layers}
        self.convert(layers, via, swap)
        if skipped and self.phase == "idle":
            self.iteration(clip="", inject="inf", use_block=True)
        for name, dtype in before.items():
            self.convert((name,), dtype, swap)

    def first_hooks_held(self, layers: tuple[str, ...]) -> bool:
        """Whether ours holds weakly, with float32 sums, a parameter of ``layers`` that it met in a scaled graph
        of its first iteration (of a run or a fresh resume) and has not bound yet (so that a model thrown away
        then is freed): ``torch.utils.swap_tensors`` refuses a weakly referenced tensor, so a conversion of that
        layer under the swap future fails there with torch's error (documented in docs/migration.md, found by
        this machine once casts were driven after fresh loads); the other layers convert."""
        sums = self.ours.system.scaler._masters._sums
        if sums is None:
            return False
        model = self.ours.system.model
        return any(param in sums._watched for name in layers for param in getattr(model, name).parameters())

    def loaded_waiting(self) -> bool:
        """Whether a loaded checkpoint's masters wait in ours' groups for parameters without one yet: a layer
        cast to float32 now continues as a float32 parameter from its saved master (documented, with a
        ``ContinuedWarning``; the recipe keeps a copy), so such casts are not driven."""
        return any(SAVED_KEY in group for group in self.ours.system.optimizer.param_groups)

    def extra_waiting(self) -> bool:
        """Whether ``extra`` was added and ours has not made its master yet (at its first move, from the
        parameter's values: documented). Bound is not enough: a checkpoint saved before that move holds no
        master for it, and a fresh resume that binds before the loads (``bound-*`` orders) binds it to the
        fresh model's values, which the model's load then writes over: its master is made at the next move
        from the parameter as it is then, rounded through a cast made before it (found as "master 8 one
        float16 rounding off": the machine's model, not a defect). ``Config.moved`` says whether that move
        was made, in the run and in the checkpoint."""
        return bool(self.config.added) and (not self.config.moved or not self.extra_bound())

    def extra_bound(self) -> bool:
        """Whether ours has bound each of ``extra``'s parameters (to a master)."""
        lows = {id(low) for low, _ in self.ours.system.scaler.master_weights(self.ours.system.optimizer)}
        return all(id(p) in lows for p in self.ours.system.model.extra.parameters())

    def moved(self) -> None:
        """Ours met the optimizer (``unscale_``, a clipping, ``step``): ``extra``'s master is made if that
        contact bound it (a ``step`` after a clipping moves nothing again: a group added between waits for
        the next iteration's move; found by seed 4 when this said so after any contact)."""
        if self.config.added and self.extra_bound():
            self.config.moved = True

    @rule(form=st.sampled_from(FORMS), held=st.booleans())
    def add_param_group(self, form: str, held: bool) -> None:
        if not held and self.config.added:
            return  # added once
        if self.named:
            form = "named"  # torch: every group of a named optimizer is named
        if self.adagrad and ADAGRAD_STATE_AT_CONSTRUCTION:
            return  # torch's own Adagrad cannot step an added group there (KeyError: 'sum')
        if self.both("add", form, held) is None and not held:
            self.config.added = form

    @rule()
    def arm_step_failure(self) -> None:
        self.both("arm")

    # checkpoints -----------------------------------------------------------------------------------------------

    @rule()
    def save(self) -> None:
        """A checkpoint at any point of an iteration; in the middle of an accumulation (after some backwards,
        before the move) it holds no partial sum on either side, so a run resumed from it steps the sum of the
        backwards after the save only, on both; the run that saved goes on unchanged."""
        self.saved = (self.ours.save(), self.reference.snapshot(), copy.deepcopy(self.config))
        self.saved_continues = self.ours.continues()

    def resume_driven(self, config: Config) -> bool:
        """Whether a fresh resume of a checkpoint of ``config`` is driven. With float32 accumulation no layer is
        float32 in a fresh resume: ours' float32 parameter (bound to its saved master at the first move)
        accumulates in its own ``.grad`` until that move, where the recipe's copy holds the sum (the same
        values; a ``model.zero_grad()`` before that move clears ours' only: found by this machine, reported).
        (A frozen layer there, whose binding raised torch's hook error, is driven since its fix in 9fe8f69.)"""
        if not self.accumulate:
            return True
        return all(config.dtypes[name] != torch.float32 for name in LOW_LAYERS)

    @precondition(
        lambda self: self.saved is not None and self.resume_driven(self.saved[2]) and not self.saved_continues
    )
    @rule(
        order=st.sampled_from(ORDERS),
        then=st.sampled_from(THEN),
    )
    def load_fresh(self, order: str, then: str) -> None:
        self.resume(order)
        self.then(then)

    def then(self, then: str) -> None:
        """After a load: nothing, a save right away (a pre-emption handler's, a save-on-start), or that save
        and a new process resuming from it."""
        if then:
            self.save()
        if then == "save, resume":
            self.resume("model-first")

    def resume(self, order: str) -> None:
        """A new process: fresh objects built as the checkpoint's were, then the loads in ``order``."""
        assert self.saved is not None
        blob, snapshot, config = self.saved
        armed = self.ours.system.armed
        fresh = OursSide(self.make, config, self.scales, seed=7, accumulate=self.accumulate)
        fresh.system.armed = armed
        if order.startswith("bound"):  # an iteration that binds the fresh optimizer and steps nothing
            fresh.backward(Plan(0))
            fresh.system.unscale_()
            fresh.system.update()
        fresh.load(blob, optimizer_first=order.endswith("optimizer-first"))
        self.ours = fresh
        self.reference.restore(snapshot, into_bound=False)
        self.config, self.grads, self.phase = copy.deepcopy(config), False, "idle"  # a new process

    @precondition(lambda self: self.resume_driven(self.config) and not self.ours.continues())
    @rule(order=st.sampled_from(ORDERS), then=st.sampled_from(THEN))
    def save_and_resume(self, order: str, then: str) -> None:
        """A checkpoint now and a new process resuming from it (a pre-emption), in ``order``."""
        self.save()
        self.load_fresh(order=order, then=then)

    @precondition(
        lambda self: (
            self.phase == "idle"
            and self.saved is not None
            and self.saved[2].dtypes == self.config.dtypes
            and self.saved[2].added == self.config.added
        )
    )
    @rule(optimizer_first=st.booleans(), then=st.sampled_from(THEN))
    def load_bound(self, optimizer_first: bool, then: str) -> None:
        assert self.saved is not None
        if then == "save, resume" and not (
            self.resume_driven(self.config) and not self.ours.continues() and not self.saved_continues
        ):
            # a save right after the load keeps the loaded checkpoint's waiting masters (issue 35's defect 1),
            # so it continues a float32 layer as the loaded one would (found by shrinking: it read the state
            # before the load only)
            then = "save"
        blob, snapshot, config = self.saved
        self.ours.load(blob, optimizer_first)
        self.reference.restore(snapshot, into_bound=True)
        self.config.moved = config.moved  # a checkpoint saved before extra's first move holds no master for it
        self.grads = False
        self.then(then)

    @rule(helper=st.sampled_from(["get", "set"]))
    def distributed_checkpoint(self, helper: str) -> None:
        system = self.ours.system
        before = fingerprint(system)
        if helper == "get":
            call: Callable[[], Any] = lambda: get_optimizer_state_dict(system.model, system.optimizer)  # noqa: E731
        else:
            call = lambda: set_optimizer_state_dict(system.model, system.optimizer, system.optimizer.state_dict())  # noqa: E731
        _, error = outcome(call)
        assert error is not None and error.startswith("ValueError: Save and load optimizer.state_dict()"), error
        assert "torch.distributed.checkpoint.state_dict cannot name" in error, error  # the fix first, then why
        assert_fingerprint(before, fingerprint(system))

    # the invariant ---------------------------------------------------------------------------------------------

    @invariant()
    def same_as_the_recipe(self) -> None:
        if not hasattr(self, "ours"):
            return
        a, b = self.ours.system, self.reference.system
        for index, (x, y) in enumerate(zip(a.model.parameters(), b.model.parameters(), strict=True)):
            assert same_bits(x, y), f"parameter {index}: {x.dtype} {y.dtype}, {describe(x, y)}"
            assert x.requires_grad == y.requires_grad, f"parameter {index}: requires_grad"
        for index, (x, y) in enumerate(zip(self.ours.masters(), self.reference.masters(), strict=True)):
            assert x is None or same_bits(x, y), f"master {index}: {describe(x, y)}"
        if self.phase != "moved":  # after the user's unscale_ ours keeps the float16 gradients unscaled (documented)
            for index, (x, y) in enumerate(zip(a.model.parameters(), b.model.parameters(), strict=True)):
                assert same_grad(x.grad, y.grad), f"gradient of parameter {index}: {describe_grads(x.grad, y.grad)}"
        pending = self.phase == "backward"
        for index, (s, t) in enumerate(zip(self.ours.sums(pending), self.reference.sums(pending), strict=True)):
            if ABSENT not in (s, t):
                assert same_grad(s, t), f"float32 gradient of parameter {index}: {describe_grads(s, t)}"
        assert len(a.optimizer.param_groups) == len(b.optimizer.param_groups), "param groups"
        for index, (g, h) in enumerate(zip(a.optimizer.param_groups, b.optimizer.param_groups, strict=True)):
            assert len(g["params"]) == len(h["params"]), f"group {index}"
            assert {k: v for k, v in g.items() if k not in ("params", SAVED_KEY)} == {
                k: v for k, v in h.items() if k != "params"
            }, f"group {index}"
        assert_same_state_by_position(a.optimizer, b.optimizer, self.ours.waiting())
        mine, theirs = a.scaler.state_dict(), b.scaler.state_dict()
        assert mine["scale"] == theirs["scale"] and mine["_growth_tracker"] == theirs["_growth_tracker"], "scale"


def assert_same_state_by_position(
    ours: torch.optim.Optimizer, reference: torch.optim.Optimizer, waiting: set[int]
) -> None:
    """``recipe.assert_same_state`` where ours steps a float32 master or parameter; where it still holds a
    float16/bfloat16 parameter or one whose saved master waits (``OursSide.waiting``: a fresh load before its
    first move, which restores the master and its float32 state), its state is torch's cast of the recipe's:
    a rounding of it (``checkpoint.rounds_to``)."""
    wide_ours: dict[int, Any] = {}
    wide_reference: dict[int, Any] = {}
    mine = [p for g in ours.param_groups for p in g["params"]]
    theirs = [p for g in reference.param_groups for p in g["params"]]
    assert len(mine) == len(theirs), "parameters"
    for index, (p, q) in enumerate(zip(mine, theirs, strict=True)):
        if (p.dtype in (torch.float16, torch.bfloat16) or id(p) in waiting) and q.dtype == torch.float32:
            a, b = ours.state.get(p, {}), reference.state.get(q, {})
            for key, value in a.items():
                if isinstance(value, torch.Tensor) and key != "step" and key in b:
                    given = b[key].float()
                    assert bool(rounds_to(given, value).all()), (index, key, "rounded")
            continue
        wide_ours[index] = ours.state.get(p, {})
        wide_reference[index] = reference.state.get(q, {})
    for index in wide_ours:
        x = {k: v for k, v in wide_ours[index].items() if isinstance(v, torch.Tensor)}
        y = {k: v for k, v in wide_reference[index].items() if isinstance(v, torch.Tensor)}
        if not x or not y:
            assert untouched(x) and untouched(y), index
            continue
        assert x.keys() == y.keys(), index
        for key in x:
            assert same_bits(x[key], y[key]), (index, key)


def same_grad(a: Any, b: Any) -> bool:
    """Both None, or the same bits."""
    return (a is None and b is None) or (a is not None and b is not None and same_bits(a, b))


def describe_grads(a: Any, b: Any) -> str:
    if a is None or b is None:
        return f"ours {'None' if a is None else 'set'}, the recipe {'None' if b is None else 'set'}"
    return describe(a, b)


def describe(x: torch.Tensor, y: torch.Tensor) -> str:
    if x.shape != y.shape or x.dtype != y.dtype:
        return "shape or dtype"
    return f"{int((x != y).sum())} of {x.numel()} differ, by up to {float((x.float() - y.float()).abs().max()):.3g}"


def fingerprint(system: System) -> list[Any]:
    """What a refused call must leave as it was: parameters and gradients (model and masters), the groups'
    hyper-parameters, the optimizer's state."""
    found: list[Any] = []
    for param in system.model.parameters():
        found += [param.detach().clone(), None if param.grad is None else param.grad.clone()]
    for group in system.optimizer.param_groups:
        found.append({k: v for k, v in group.items() if k not in ("params", SAVED_KEY)})
        for param in group["params"]:
            found += [param.detach().clone(), None if param.grad is None else param.grad.clone()]
            found.append({k: v.clone() for k, v in system.optimizer.state.get(param, {}).items()})
    return found


def assert_fingerprint(before: list[Any], after: list[Any]) -> None:
    assert len(before) == len(after), "refused, yet changed"
    for index, (a, b) in enumerate(zip(before, after, strict=True)):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and same_bits(a, b), f"refused, yet changed: {index}"
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), f"refused, yet changed: {index}"
            for key, x in a.items():
                y = b[key]
                assert same_bits(x, y) if isinstance(x, torch.Tensor) else x == y, f"refused, yet changed: {index}"
        else:
            assert b is None, f"refused, yet changed: {index}"


def ci_settings(examples: int, steps: int) -> settings:
    """A machine's budget in CI: a fixed seed (the same sequences every run), ``examples`` sequences of up to
    ``steps`` rules, no deadline, no example database."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class OneThread:
    """Set-up of a machine's ``TestCase``: one torch thread while it runs (the machines' tensors are tiny, and on a
    loaded machine two threads wait for each other at every operation), restored after."""

    def setUp(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def tearDown(self) -> None:
        torch.set_num_threads(self.threads)


@contextlib.contextmanager
def terminal_progress(request: Any, budget: int, machine: Any = None, name: str = "masters machine") -> Iterator[None]:
    """``progress`` on the terminal of the pytest run ``request`` belongs to (past its output capture); nothing
    where it has none."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        yield
        return

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"  {line}")

    with progress(say, budget, machine=machine, name=name):
        yield


@contextlib.contextmanager
def progress(
    say: Callable[[str], None], budget: int, every: int = 100, machine: Any = None, name: str = "masters machine"
) -> Iterator[None]:
    """While open, ``say`` gets a line every ``every`` sequences ``machine`` (``MastersMachine`` by default: any
    class with an ``ended`` hook its teardown calls) has run (Hypothesis also runs some it discards, and shrinks a
    failure: the count can pass ``budget``), so that a run of minutes shows where it is."""
    machine = MastersMachine if machine is None else machine
    started, count = time.perf_counter(), 0

    def ended() -> None:
        nonlocal count
        count += 1
        if count % every == 0:
            where = f"of {budget}" if count <= budget else f"({budget} to draw; Hypothesis also ran some it discards)"
            say(f"{name}: {count} sequences {where}, {time.perf_counter() - started:.0f} s")

    machine.ended = ended
    try:
        yield
    finally:
        machine.ended = None
