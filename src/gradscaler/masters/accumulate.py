"""Gradients of float16/bfloat16 parameters accumulated in float32 across micro-batches
(``GradScaler(..., master_weights=True, accumulate_grads_in_fp32=True)``).

Autograd adds each backward's gradient into ``p.grad`` in the parameter's dtype, rounding at every add.
Here each low-precision parameter gets a post-accumulate-grad hook (``Sum``): as soon as autograd has
written a backward's gradient into the (always empty) ``p.grad``, the hook adds it into a float32 sum
and sets ``p.grad = None``, so no low-precision add ever happens. The recipe by hand with float32
accumulation, after every backward: ``m.grad = p.grad.float()`` on the iteration's first gradient,
``m.grad = m.grad + p.grad.float()`` after it, ``p.grad = None``.

Where the sum lives: in the master's ``.grad`` once the parameter is bound (so ``optimizer.zero_grad()``
clears it as it clears any float32 gradient, and the iteration's first gradient is copied into last
iteration's tensor when it is still there: no second float32 buffer); before the binding (the first
iteration: masters are bound at the scaler's first contact with the optimizer, after its micro-batches)
in the hook itself, which the binding hands to the master, and which ``optimizer.zero_grad()`` clears
(``zeroing``). Which parameters get hooks: those the scaler meets in the graph of a ``scale(loss)`` output
and no other scaler hooked (its ``AccumulateGrad`` leaves that are float16 or
bfloat16 ``nn.Parameter``s, and those a reentrant checkpoint's node hides: ``checkpointed``) until the first
``update()`` (a step that finds others with gradients warns: ``HIDDEN_MESSAGE``), every parameter a master is bound to,
those a bound optimizer's ``add_param_group`` adds, and those a bound optimizer held frozen without a
master once they are unfrozen (at the next ``scale()``). A parameter hooked from the graph that no optimizer
of the scaler binds by then gets its gradient back in its dtype at that ``update()`` (held weakly until
then: a model thrown away in the first iteration goes).

A scaler's hooks belong to the parameters its optimizers step: a hook made from a graph is a claim, taken
over by the scaler whose optimizer binds the parameter (``Sum.take_over``) or given up to one without float32
sums (``give_way``); a scaler's graph never takes over a hook another scaler put on a parameter (a GAN's
G loss runs through D).

``Accumulation`` is what ``MasterWeights`` holds; its ``take`` is the move of an accumulating binding.
Under DDP, ``scaler.register_ddp(ddp_model)`` (``ddp.DataParallel``): at the move the reduced gradient
DDP wrote into ``p.grad`` is dropped and the float32 sums are averaged across DDP's ranks in float32;
without the call that gradient is refused. Refused: FSDP2's sharded parameters at a binding (FSDP2
reduce-scatters each backward's gradient itself: its ``reduce_dtype`` is the setting).
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler import compiled
from gradscaler.errors import warn
from gradscaler.masters import sums
from gradscaler.masters.checks import (
    BOUND_CLIPPING_MESSAGE,
    CREATE_GRAPH_MESSAGE,
    DDP_MESSAGE,
    FSDP2_MESSAGE,
    HELD_DDP_MESSAGE,
    HELD_MESSAGE,
    HIDDEN_MESSAGE,
    LATE_MESSAGE,
    LATER_HOOK_MESSAGE,
    LOW_PRECISION,
    SWAPPED_MESSAGE,
    WRITTEN_MESSAGE,
    low_params,
)
from gradscaler.masters.ddp import DataParallel
from gradscaler.masters.graph import graph_leaves
from gradscaler.masters.pairs import Binding, Pair
from gradscaler.masters.sums import Sum, released
from gradscaler.masters.wrappers import bound_clipping, route

ARGUMENT = "accumulate_grads_in_fp32"
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _orphaned(watched: WeakIdKeyDictionary, found: weakref.WeakValueDictionary[int, Sum]) -> None:
    """A scaler dropped in its first iteration: each parameter its graphs' hooks hold and no optimizer of it
    bound gets its gradient back (``Sum.release``), as at that iteration's ``update()``."""
    for param in list(watched.keys()):
        hook = found.get(id(param))
        if hook is not None and hook.handle is not None:
            hook.release(param)


def _before_backward(owner: weakref.ReferenceType[Accumulation], grads: Any) -> None:
    """Run by a backward at a scaled output's node, the first it runs when that output is its one root: a
    ``backward(create_graph=True)`` that would accumulate into a parameter ``owner`` sums is refused here,
    before it writes any gradient or sum (a parameter's own hook would refuse it only once autograd reached
    it: the sums and float32 gradients written before stayed, and the plain backward the message advises
    added to them). Its grad mode tells a backward with ``create_graph``; ``torch.autograd.grad`` accumulates
    into no parameter and goes on. The node is the running one (no reference to the output, which may be a
    temporary: ``(scaler.scale(loss) / 2).backward()``)."""
    sums = owner()
    if sums is None or not torch.is_grad_enabled():
        return
    node = torch._C._current_autograd_node()
    if node is None:
        return
    for param in graph_leaves(node, running=True):
        if sums.sum_of(param) is not None:
            raise RuntimeError(CREATE_GRAPH_MESSAGE.format(shape=tuple(param.shape), dtype=param.dtype))


class Accumulation:
    """The float32 sums of one scaler's low-precision parameters (``Sum`` per parameter)."""

    def __init__(self) -> None:
        # id of a hooked parameter -> its Sum, which the parameter's hooks keep alive: no reference to a
        # parameter here (torch's swap_tensors refuses a weakly referenced one)
        self._sums: weakref.WeakValueDictionary[int, Sum] = weakref.WeakValueDictionary()
        # hooked from the scaled graphs and not bound yet, weakly (a model thrown away in the first
        # iteration goes): they are given back at the first update() unless bound by then, or when this
        # scaler is dropped before it (``_orphaned``)
        self._watched = WeakIdKeyDictionary()
        weakref.finalize(self, _orphaned, self._watched, self._sums)
        self.watching = True  # hooks from the scaled graphs, until the first update() after a contact
        self.contacted = False  # an optimizer met the scaler (unscale_/step), bound or not
        self.scaled = 0  # graphs scale() met while watching: with two or more, autograd may have summed
        self.clipping_checked = False  # the loop's modules were looked at for torch's clippings bound by name
        self.subclassed = False  # a tensor subclass is hooked: nn.Module._apply swaps it, future on or off
        # bound pairs whose parameter was frozen at the binding (torch refuses a hook on a tensor that does
        # not require grad), weakly by id: hooked at the first scale() after they are unfrozen
        self._frozen: dict[int, weakref.ReferenceType[Any]] = {}
        # bound optimizers holding frozen low-precision parameters that got no master (no state then) -> those
        # parameters as the last look through its groups found them: each iteration's first scale() looks
        # through the groups again (``wake``), every other scale() at those parameters only (``stir``), and
        # hooks the ones unfrozen since, before their next backward
        self._asleep: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self._wake = False
        # every optimizer bound or met asleep, weakly: its groups' low-precision parameters are hooked again
        # after a swap (``watch``)
        self._met: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # an optimizer no scaler steps (``MasterWeights.hold``): every low-precision parameter in its groups
        # gets a master and a hook at once, frozen or not, since no scale() comes to hook it once unfrozen
        self.holding = False
        self.ddp = DataParallel()  # the parameters of registered DDP modules: their sums averaged at the move

    def watch(self, output: Any, bound: Callable[[], list[torch.Tensor]]) -> Any:
        """At ``scale()``: hook the low-precision parameters of ``output``'s graph (first iteration only);
        with torch's swap-tensors future on (or a tensor subclass hooked), hook again each parameter a
        conversion swapped since (``Sum.rehook``), before this backward reaches it: the ``bound()`` ones
        (the masters') and the low-precision ones in the groups of every optimizer met (unfrozen since a
        binding that gave them no master, or added since: hooked, bound at the next move)."""
        if self.watching and isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self.scaled += 1
            sums.CLAIMING.add(self)
            for param in graph_leaves(output):
                if self.sum_of(param) is not None or not sums.others(param, self):
                    self.hook(param)  # not one another scaler hooked: its optimizer's, or claimed first
        if self.subclassed or torch.__future__.get_swap_module_params_on_conversion():
            self.revive([*bound(), *(p for optimizer in self._met for p in low_params(optimizer))])
        if self._frozen:
            self.thaw()
        if self._wake:
            self.wake()
        elif self._asleep:
            self.stir()
        if self._sums and isinstance(output, torch.Tensor) and output.grad_fn is not None:  # hooks to guard
            output.grad_fn.register_prehook(functools.partial(_before_backward, weakref.ref(self)))
        return output

    def sum_of(self, param: torch.Tensor) -> Sum | None:
        """``param``'s ``Sum``, if it has one."""
        found = self._sums.get(id(param))
        return found if found is not None and found.handle is not None else None

    def hook(self, param: torch.Tensor, watched: bool = True) -> Sum:
        """``param``'s ``Sum``, hooked on first sight (``watched``: met in a scaled graph, given back at
        the first ``update()`` unless bound by then); a gradient it holds already (accumulated by autograd
        before the scaler met it) becomes the start of the sum."""
        found = self.sum_of(param)
        if found is not None:
            found.follow(param)
            return found
        taken = sums.others(param, self, live=False)
        if any(getattr(other.owner(), "holding", False) for other in taken):
            raise ValueError(HELD_MESSAGE)  # the parameter is with_master_weights': nothing taken over
        found = Sum(param, self)
        for other in taken:
            found.take_over(other, param)  # another scaler's: this one's optimizer steps it (one binding steers)
        frozen = not param.requires_grad  # torch refuses a hook on it, and keeps one made before a freeze
        if frozen:
            param.requires_grad_(True)
        try:
            found.handle = param.register_post_accumulate_grad_hook(found)
        finally:
            if frozen:
                param.requires_grad_(False)
        self._sums[id(param)] = found
        self.subclassed = self.subclassed or type(param) not in (torch.Tensor, torch.nn.Parameter)
        if self.watching and watched:
            self._watched[param] = True
        if param.grad is not None and param.grad.layout is torch.strided and not param.grad.requires_grad:
            found(param)
        return found

    @compiled.eager  # reads each parameter's _cdata, which Dynamo does not trace; only with the swap future on
    def revive(self, params: list[torch.Tensor]) -> None:
        """Hook again each of ``params`` whose tensor torch's ``swap_tensors`` replaced since it was hooked."""
        for param in params:
            found = self.sum_of(param)
            if found is not None:
                found.follow(param)

    @compiled.eager  # only while a bound parameter is frozen
    def thaw(self) -> None:
        """Hook each bound parameter that was frozen at its binding and requires grad now."""
        for key, ref in list(self._frozen.items()):
            pair = ref()
            if pair is None:
                del self._frozen[key]
            elif pair.low.requires_grad:
                del self._frozen[key]
                self.hook(pair.low, watched=False).master = weakref.ref(pair.master)

    def asleep(self, optimizer: torch.optim.Optimizer) -> None:
        """At a binding: ``optimizer`` holds frozen low-precision parameters without a master, which
        ``wake`` hooks once they are unfrozen."""
        self._asleep.setdefault(optimizer, [])
        self._met.add(optimizer)
        self._wake = True

    @compiled.eager  # once an iteration, only while a bound optimizer holds a frozen parameter without master
    def wake(self) -> None:
        """Hook each low-precision parameter of the optimizers ``asleep`` that requires grad now and has no
        hook (unfrozen since its binding, where it got no master): its sum is held by the hook until the next
        move binds it, as for a group added to a bound optimizer; keep the frozen ones for ``stir``; an
        optimizer with none frozen left is dropped. (The parameters an optimizer steps as masters are float32
        in its groups.)"""
        self._wake = False
        for optimizer in list(self._asleep.keys()):
            frozen = []
            for param in low_params(optimizer):
                if not param.requires_grad:
                    frozen.append(param)
                elif self.sum_of(param) is None:
                    self.hook(param, watched=False)
            if frozen:
                self._asleep[optimizer] = frozen
            else:
                del self._asleep[optimizer]

    @compiled.eager  # only while a bound optimizer holds a frozen parameter without master
    def stir(self) -> None:
        """At a ``scale()`` inside an iteration: hook each parameter ``wake`` found frozen that requires grad now
        (unfrozen between two micro-batches: its next backward sums in float32, as the recipe's copy does)."""
        for optimizer, frozen in list(self._asleep.items()):
            if not any(map(_REQUIRES_GRAD, frozen)):  # the usual case: a C loop, about 15 ns a parameter
                continue
            for param in frozen:
                if param.requires_grad and self.sum_of(param) is None:
                    self.hook(param, watched=False)
            self._asleep[optimizer] = [param for param in frozen if not param.requires_grad]

    def added(self, params: list[torch.Tensor]) -> None:
        """A bound optimizer's ``add_param_group``: its new low-precision parameters are hooked now, before
        their first backward."""
        for param in params:
            if isinstance(param, torch.Tensor) and param.dtype in LOW_PRECISION and param.requires_grad:
                self.hook(param, watched=False)  # the optimizer's: bound at its next move

    def refuse_sharded(self, params: list[torch.Tensor]) -> None:
        """Before a binding: ``ValueError`` (``FSDP2_MESSAGE``) if a low-precision parameter among
        ``params`` is a DTensor (FSDP2's sharded parameters); every hook is removed first."""
        if any(p.dtype in LOW_PRECISION and type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
            try:
                from torch.distributed.tensor import DTensor
            except ImportError:  # torch before 2.5: the private path
                from torch.distributed._tensor import DTensor

            if any(isinstance(p, DTensor) for p in params):
                for param in [*self._watched.keys(), *params]:
                    found = self.sum_of(param)
                    if found is not None:
                        found.release(param)
                self._watched.clear()
                self.watching = False
                sums.CLAIMING.discard(self)
                raise ValueError(FSDP2_MESSAGE)

    def bind(self, binding: Binding, optimizer: torch.optim.Optimizer) -> None:
        """Hook every parameter of ``optimizer``'s ``binding`` (hooked already or not) and point its sum at its
        master; a warning when low-precision parameters come with gradients autograd may have summed in their
        dtype: new to the scaler after its first iteration (``LATE_MESSAGE``), or in it, hidden from the scaled
        graphs of two or more backwards (``HIDDEN_MESSAGE``). A float32 parameter bound to its saved master
        (``MasterWeights._bind_param``'s ``kept_wide``: peft's float32 adapters, resumed from a checkpoint saved
        before any applied step) was summed by autograd in float32: nothing lost, no warning."""
        self._met.add(optimizer)
        name = type(optimizer).__name__
        late = hidden = 0
        for pair in binding.pairs:
            if not pair.low.requires_grad and self.sum_of(pair.low) is None and not self.holding:
                self._frozen[id(pair)] = weakref.ref(pair)  # hooked when unfrozen (no loop without a scaler)
                continue
            grad = pair.low.grad
            unseen = (
                grad is not None
                and pair.low.dtype in LOW_PRECISION
                and self.sum_of(pair.low) is None
                and not released(grad)  # given back by another scaler's hook, its float32 sum kept
            )
            late += unseen and not self.watching
            hidden += unseen and self.watching and self.scaled > 1
            found = self.hook(pair.low)
            self._watched.pop(pair.low, None)  # the binding holds it now
            if found.master is None or found.master() is not pair.master:
                found.master = weakref.ref(pair.master)
        if late:
            warn(LATE_MESSAGE.format(count=late, optimizer=name), UserWarning)
        if hidden:
            warn(HIDDEN_MESSAGE.format(count=hidden, optimizer=name), UserWarning)

    def refuse(self, binding: Binding, name: Any, before_step: bool = False) -> None:
        """(At the move, the gradients DDP's reducer wrote into registered parameters are dropped first.)
        ``ValueError``, before anything changes, for a parameter whose ``.grad`` is set where its hook
        leaves None (written by hand, or after ``unscale_``: the step reads the master's), or whose
        post-accumulate-grad hooks run one after the scaler's. ``name(pair, number)`` names it."""
        if not before_step and self.ddp:
            self.ddp.drop_reduced(binding.lows())
        for number, pair in enumerate(binding.pairs):
            if pair.low.grad is not None:
                found = self.sum_of(pair.low)
                if found is not None and found.swapped(pair.low):
                    self.revive(binding.lows())
                    raise ValueError(SWAPPED_MESSAGE.format(name=name(pair, number), dtype=pair.low.dtype))
                ddp = torch.distributed.is_available() and torch.distributed.is_initialized()
                reduced = HELD_DDP_MESSAGE if self.holding else DDP_MESSAGE  # no register_ddp without a scaler
                raise ValueError((reduced if ddp else WRITTEN_MESSAGE).format(name=name(pair, number)))
            if before_step:
                continue
            found = self.sum_of(pair.low)
            hooks = getattr(pair.low, "_post_accumulate_grad_hooks", None)
            if found is not None and found.handle is not None and hooks and next(reversed(hooks)) != found.handle.id:
                raise ValueError(LATER_HOOK_MESSAGE.format(name=name(pair, number)))

    def check_clipping(self) -> None:
        """At the first move: a warning (``BOUND_CLIPPING_MESSAGE``) for each name a module of the loop's
        stack binds to torch's own clipping, which would find no gradient in the parameters."""
        if self.clipping_checked:
            return
        self.clipping_checked = True
        for module, name, function in bound_clipping():
            warn(BOUND_CLIPPING_MESSAGE.format(module=module, name=name, function=function), UserWarning)

    def hand_over(self, pair: Pair) -> None:
        """``Sum.hand_over`` for ``pair`` (a loop without a scaler, ``MasterWeights.hold``)."""
        found = self.sum_of(pair.low)
        if found is not None:
            found.hand_over(pair.master)

    def take(self, binding: Binding) -> None:
        """The move of an accumulating binding: each master's gradient becomes its parameter's float32 sum
        of the iteration (None when it got no gradient: not stepped); the scaler's own pass then unscales
        and checks them as float32 gradients, as torch's scaler does the recipe's copies."""
        for pair in binding.pairs:
            found = self.sum_of(pair.low)
            if found is not None:
                found.take(pair.master)
            else:
                pair.master.grad = None
            route(pair.low, pair.master)
        if self.ddp:
            self.ddp.reduce([(pair.low, pair.master) for pair in binding.pairs])

    def end_iteration(self, bound: set[int]) -> None:
        """At the first ``update()`` after an optimizer met the scaler (an ``update()`` before any, which
        torch's rule refuses, changes nothing): stop hooking from the scaled graphs and give the parameters
        no optimizer of the scaler binds (``bound``: their ids) back to autograd, their sum in ``.grad``."""
        self._wake = bool(self._asleep)  # the next iteration's first scale() looks for unfrozen ones
        if not self.watching or not (bound or self.contacted):
            return
        self.watching = False
        sums.CLAIMING.discard(self)
        for param in list(self._watched.keys()):
            found = self.sum_of(param)
            if found is not None and id(param) not in bound:
                found.release(param)
        self._watched.clear()
