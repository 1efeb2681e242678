"""float32 master weights for float16 and bfloat16 parameters: binding an optimizer, and the move.

The recipe of Micikevicius et al. (2018), as Apex O2, Megatron-LM and DeepSpeed keep it, without wrapping
the user's optimizer: at the scaler's first contact, each float16/bfloat16 parameter that requires a
gradient (or trained) is replaced *in the optimizer's ``param_groups``* by a float32 master; the state is
keyed by the masters, and schedulers, ``add_param_group`` and every torch optimizer keep working.

``MasterWeights`` steers the lifecycle; beside it, ``pairs`` (a parameter and its master, an optimizer's
set of them), ``checks`` (which parameters get masters; the refusals), ``checkpoint`` (the state-dict
hooks) and ``wrappers`` (what reaches the masters through the user's own objects). The scaler calls
``move`` at an optimizer's first ``unscale_``, ``clip_grad_norm_`` or fused check of an iteration
(``show`` at the end of the user's ``unscale_``), ``before_step`` and ``finish`` around its
``optimizer.step``, ``end_iteration`` at ``update``, ``release`` at a ``scale()`` that finds an
iteration interrupted and ``end`` for one optimizer whose iteration a new backward replaced.
Everything is derived from the model's own state at those points, whoever cleared or wrote what in
between:

* **Gradients.** ``move`` sets each master's gradient to its parameter's gradient in float32 (times the
  scaler's factor), or to None when the parameter has none, and drops the parameter's gradient (the
  recipe by hand: ``master.grad = p.grad.float() if p.grad is not None else None; p.grad = None``). One
  pass gives the move, the non-finite flag and, when clipping, the norms (``Moved``). So a parameter
  that missed a step is not stepped, whichever ``zero_grad`` the loop calls, and an iteration that
  ends at ``update()`` without ``step`` leaves nothing behind. After the user's own ``unscale_`` the
  parameter's gradient is kept until ``step``, holding the unscaled value (``show``), and a write to
  it that the step would not see is refused (``before_step``). ``optimizer.zero_grad()`` also clears
  the parameters' gradients (a backward whose batch the loop dropped), as for float32 parameters.
* **Values.** ``finish`` copies every master into its parameter after an applied step. Before a move, a
  parameter written since (version counter, or a new storage) refreshes its master wherever it is not the
  master rounded; a write through ``p.data`` in place is unseen (docs/migration.md).
* **Checkpoints.** The optimizer's ``state_dict`` carries the masters and their float32 state
  (``checkpoint``); a saved master is used only where it still rounds to its parameter.
* **Copies.** Each master names its parameter (``PARAM_ATTR``), so a pickled, saved or deep-copied
  (model, optimizer, scaler) binds the copied masters to the copied parameters at its first contact.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from gradscaler import grads
from gradscaler.kernels import NoGrad, move_grads_
from gradscaler.masters import checkpoint, sums
from gradscaler.masters.accumulate import Accumulation
from gradscaler.masters.checkpoint import SAVED_KEY
from gradscaler.masters.checks import (
    PARAM_ATTR,
    WRITTEN_LOW_GRADS_MESSAGE,
    check_inner_optimizers,
    check_params,
    describe,
    low_params,
    needs_master,
    refuse_disabled,
    refuse_held,
    stands_in,
    trained,
)
from gradscaler.masters.ddp import NOT_ACCUMULATING_MESSAGE
from gradscaler.masters.moved import NOTHING, Moved, copied_stats, grad_buffers, movable, one_batch
from gradscaler.masters.pairs import Binding, Pair
from gradscaler.masters.sums import give_way
from gradscaler.masters.wrappers import (
    AddParamGroupChecked,
    ZeroGradBoth,
    close_routes,
    open_routes,
    route,
    route_clipping,
    unwrap,
)


def _end(binding: Binding) -> None:
    """End ``binding``'s iteration (``Binding.end``) and close the clipping route of its parameters."""
    binding.end()
    close_routes(binding.keys)


class MasterWeights:
    """The float32 masters of the optimizers one scaler steps, bound at first contact.

    Holds, per optimizer, the (low-precision parameter, master) pairs, and the whole lifecycle:
    ``move`` (gradients in), ``finish`` (values out), ``end``/``end_iteration`` and the state-dict
    hooks. A parameter belongs to at most one optimizer's masters.
    """

    active = True

    def __init__(self, accumulate: bool = False) -> None:
        self._bindings: weakref.WeakKeyDictionary[torch.optim.Optimizer, Binding] = weakref.WeakKeyDictionary()
        self._sums = Accumulation() if accumulate else None  # accumulate_grads_in_fp32 (``accumulate``)
        # the bindings moved since the last ``update()``, by id, weakly (an optimizer dropped takes its binding):
        # plain references, where a ``WeakValueDictionary`` costs ~14 us of Python a step (its set, values, clear)
        self._open: dict[int, weakref.ReferenceType[Binding]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterWeights:
        # the copy binds its optimizers at first contact, copied masters included
        return MasterWeights(self._sums is not None)

    def __getstate__(self) -> dict[str, Any]:
        return {"accumulate": self._sums is not None}  # optimizers belong to this process: binds afresh

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("accumulate", False))  # type: ignore[misc]

    def watch(self, output: Any) -> Any:
        """At ``scale()``, ``output`` a scaled tensor: with ``accumulate_grads_in_fp32``, hook the
        parameters of its graph (``accumulate``). Returns ``output``."""
        return output if self._sums is None else self._sums.watch(output, self._lows)

    def _lows(self) -> list[torch.Tensor]:
        return [low for binding in self._bindings.values() for low in binding.lows()]

    def register_ddp(self, module: Any) -> None:
        """``scaler.register_ddp``: average the float32 sums of ``module``'s parameters across its ranks."""
        if self._sums is None:
            raise ValueError(NOT_ACCUMULATING_MESSAGE.format(accumulate=False))
        self._sums.ddp.register(module)

    def masters(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(low-precision parameter, master) for every master of ``optimizer``, in param-group order."""
        binding = self._bindings.get(unwrap(optimizer))
        return [] if binding is None else [(pair.low, pair.master) for pair in binding.pairs]

    def param_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """The model parameter ``master`` stands for; None when it is no master of these optimizers."""
        for binding in self._bindings.values():
            pair = binding.by_master.get(id(master))
            if pair is not None and pair.master is master:
                return pair.low
        return None

    def lows(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The low-precision parameters of ``optimizer``'s masters (their gradients tell a new backward): the
        binding's own list, not to be changed."""
        binding = self._bindings.get(optimizer)
        return [] if binding is None else binding.lows()

    def added_to(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Of ``params`` (``optimizer``'s) and its masters' parameters, those whose gradients a backward adds
        to: a master's own only with float32 sums (else the next move overwrites it), and the parameters'."""
        binding = self._bindings.get(optimizer)
        if binding is None or self._sums is not None:
            return params + ([] if binding is None else binding.lows())
        return [p for p in params if id(p) not in binding.by_master] + binding.lows()

    def move(
        self,
        optimizer: torch.optim.Optimizer,
        factor: torch.Tensor | None = None,
        norm_type: float | None = None,
        norm_inv: torch.Tensor | None = None,
        keep: bool = False,
    ) -> Moved:
        """Bind ``optimizer`` (first contact, new low-precision parameters, copied masters) and, once per
        iteration, give each master its parameter's gradient in float32, times ``factor`` when given, or
        None when the parameter has none; the parameter's gradient is dropped, or with ``keep`` (the
        user's own ``unscale_``, after which their code may read or write it) kept for ``show``.

        The same pass gives the non-finite flag of the moved gradients and, with ``norm_type``, their
        norms times ``norm_inv``: one read of 2 bytes and one write of 4 per value for dense gradients
        (``kernels.move_grads_``); DTensor, sparse and strided ones are copied, read and multiplied by
        torch's ops. The norms come from the move only when its one batch holds every gradient of the
        optimizer (a float16 model): the CPU kernels' per-tensor results depend on which tensors share a
        pass, and clipping by hand norms them all in one. Otherwise the moved gradients are left to the
        caller's pass over the optimizer's float32 gradients (``Moved.owners`` empty). Returns
        ``NOTHING`` when this iteration's gradients were moved already."""
        checkpoint.guard_dcp()
        if self._sums is not None:
            self._sums.contacted = True
        binding = self._bind(optimizer)
        if binding.moved or not binding.pairs:
            return NOTHING
        route_clipping()
        if self._sums is not None:  # the sums are float32 gradients: the scaler's own pass checks them
            self._sums.check_clipping()
            self._sums.refuse(binding, functools.partial(self._name, optimizer))
            with torch.no_grad():
                for pair in binding.written():
                    pair.refresh()
                self._sums.take(binding)
            binding.moved, self._open[id(binding)] = True, weakref.ref(binding)  # ended at update() at the latest
            return Moved({}, {}, {}, grads.new_groups())
        if sums.CLAIMING:  # a scaler's first iteration: its graphs' hooks may hold these parameters' gradients
            give_way(binding.lows())
        with NoGrad():
            for pair in binding.written():  # a model load, an edit, weights copied in since the last step
                pair.refresh()
            held = list(map(grads.GRAD, binding.lows()))
            src = [grad for grad in held if grad is not None]
            if len(src) == len(held):  # every parameter has a gradient: no loop over the pairs
                moving = list(zip(binding.pairs, src, strict=True))
            else:
                moving = []
                for pair, grad in zip(binding.pairs, held, strict=True):
                    if grad is None:
                        pair.master.grad = None  # no gradient this iteration: not stepped, as the recipe by hand
                    else:
                        moving.append((pair, grad))
            whole = src if one_batch(src) else None  # a float16 model's step: every gradient movable, one batch
            # the move's norms are those of one pass over every gradient of the optimizer only if it moves them all
            joint = norm_type is not None and not (whole and all(p.grad is None for p in binding.others(optimizer)))
            result = self._move(binding, moving, whole, factor, None if joint else norm_type, norm_inv, keep)
        binding.moved, self._open[id(binding)] = True, weakref.ref(binding)
        return Moved(result.flags, {}, {}, grads.new_groups()) if joint else result

    def hold(self, optimizer: torch.optim.Optimizer, refresh: bool = True) -> Binding:
        """Bind ``optimizer`` (float32 sums only), now and at each call, for a loop that no scaler steps
        (``standalone``): the sums go straight into the masters' gradients from the next backward on, and
        stay there (no move; ``zero_grad`` clears them, as for any float32 gradient). Each call binds what is
        new, hands a sum a hook held before its binding to the master, refreshes a master whose parameter
        was written (a model load; not with ``refresh`` False: just after the optimizer's own load, whose
        masters wait for the model's), refuses a ``p.grad`` written by hand, and routes clipping over the
        parameters to the masters."""
        assert self._sums is not None, "hold: the masters of an optimizer without a scaler sum in float32"
        self._sums.contacted, self._sums.watching, self._sums.holding = True, False, True
        known = self._bindings.get(optimizer)
        count = -1 if known is None else len(known.pairs)
        binding = self._bind(optimizer)
        settled = refresh and binding is known and len(binding.pairs) == count  # nothing new: sums and routes hold
        self._sums.refuse(binding, functools.partial(self._name, optimizer), before_step=True)
        route_clipping()
        self._sums.check_clipping()  # torch's clipping bound by name on the caller's stack: a warning, once
        with torch.no_grad():
            for pair in binding.written() if refresh else []:
                pair.refresh()
            for pair in [] if settled else binding.pairs:
                self._sums.hand_over(pair)
                route(pair.low, pair.master)
        return binding

    def copy_back(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step of an optimizer ``hold`` keeps: each master the step could have moved (it has a
        gradient) into its parameter. The others are left as they are: a frozen parameter written in place
        inside the step's closure keeps the write (the next step's ``hold`` takes it into its master)."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            with torch.no_grad():
                binding.copy_back(None, [pair for pair in binding.pairs if pair.master.grad is not None])

    @staticmethod
    def _move(
        binding: Binding,
        moving: list[tuple[Pair, torch.Tensor]],
        whole: list[torch.Tensor] | None,
        factor: torch.Tensor | None,
        norm_type: float | None,
        norm_inv: torch.Tensor | None,
        keep: bool,
    ) -> Moved:
        result = Moved({}, {}, {}, grads.new_groups())
        batches: dict[Any, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # by (device, dtype): sources, masters
        if whole is not None:  # ``one_batch``: no check, no grouping, no route per parameter
            every = len(moving) == len(binding.pairs)  # the binding's own lists, which nothing below changes
            batches[None] = (whole, binding.masters() if every else [pair.master for pair, _ in moving])
            opened = binding.pairs if every else [pair for pair, _ in moving]
        else:
            opened = []  # the pairs whose float16/bfloat16 gradient moved: routed together
            for pair, grad in moving:
                master = pair.master
                if movable(grad):
                    key = (grad.device, grad.dtype)
                    batch = batches.get(key)
                    if batch is None:
                        batch = batches[key] = ([], [])
                    batch[0].append(grad)
                    batch[1].append(master)
                    opened.append(pair)
                else:
                    master.grad = grad.to(torch.float32, copy=True)
                    view = grads.checkable_view(master.grad)
                    result.add([master], [view], copied_stats(view, factor, norm_type, norm_inv))
                    route(pair.low, master)
        # the float32 buffers before the parameters' gradients are dropped: running out of memory leaves them
        moves = [(src, owners, grad_buffers(owners, src)) for src, owners in batches.values()]
        binding.after_move(moving, keep)
        binding.routed = open_routes(opened, binding.pairs, binding.keys, binding.lows(), binding.routed)
        for src, owners, dst in moves:
            result.add(owners, dst, move_grads_(src, dst, factor, norm_type, norm_inv))
        return result

    def show(self, optimizer: torch.optim.Optimizer) -> None:
        """After the user's ``unscale_``: each kept float16 gradient takes its master's unscaled value, so
        what ``model.parameters()`` show is never still multiplied by the scale (one write of 2 bytes
        per value; only on this path). ``before_step`` refuses them written since."""
        binding = self._bindings.get(optimizer)
        if binding is None or not binding.kept_any:
            return
        kept = [pair for pair in binding.pairs if pair.kept is not None and pair.master.grad is not None]
        if kept:
            with torch.no_grad():
                torch._foreach_copy_([p.kept for p in kept], [p.master.grad for p in kept])  # type: ignore[misc]
            for pair in kept:
                pair.kept_version = pair.kept._version  # type: ignore[union-attr]

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Just before ``optimizer.step``: drop the kept float16 gradients; ``ValueError`` (the parameter
        named, and the fix) if one was written since ``unscale_``, a change the step would not see."""
        binding = self._bindings.get(optimizer)
        if binding is None:
            return
        if self._sums is not None:
            self._sums.refuse(binding, functools.partial(self._name, optimizer), before_step=True)
        for number, pair in enumerate(binding.pairs if binding.kept_any else []):
            kept, grad = pair.kept, pair.low.grad
            if kept is not None and grad is not None and (grad is not kept or grad._version != pair.kept_version):
                raise ValueError(WRITTEN_LOW_GRADS_MESSAGE.format(name=self._name(optimizer, pair, number)))
        binding.drop_kept()

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """At ``scale()`` after an interrupted iteration: drop the kept float16 gradients, so the coming
        backward writes them afresh instead of adding to them."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            binding.drop_kept()

    def finish(self, optimizer: torch.optim.Optimizer, stepped: bool, skipped: torch.Tensor | None = None) -> None:
        """End ``optimizer``'s iteration at its step: copy the masters into the parameters if the step was
        applied (a skipped step writes nothing); ``skipped``: a fused step's device flag (``Binding.copy_back``)."""
        binding = self._bindings.get(optimizer)
        if binding is None:
            return
        if stepped and binding.moved:
            with NoGrad():
                binding.copy_back(skipped)
        _end(binding)

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        """End ``optimizer``'s iteration without a step (a new backward replaced it)."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            _end(binding)

    def end_iteration(self) -> None:
        """At ``update()``: every optimizer's iteration is over, stepped or not (the bindings that moved since
        the last ``update()`` and were not ended; an optimizer dropped since has taken its binding)."""
        for ref in list(self._open.values()):
            binding = ref()  # None: its optimizer was dropped (an id reused since holds the newer binding)
            if binding is not None and binding.moved:
                _end(binding)
        self._open.clear()  # after: an error leaves the bindings not yet ended to the next update()
        if self._sums is not None:
            self._sums.end_iteration({id(low) for low in self._lows()})

    def refuse_disabled(self, optimizer: torch.optim.Optimizer) -> None:
        """For a disabled scaler asked for masters: ``ValueError`` if ``optimizer`` would step a
        low-precision parameter that has a gradient (float32 runs pass untouched)."""
        refuse_disabled(optimizer)

    def _name(self, optimizer: torch.optim.Optimizer, pair: Pair, number: int) -> str:
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param is pair.master:
                    return describe(group_index, index, pair.low)
        return f"master {number}"

    def _bind(self, optimizer: torch.optim.Optimizer) -> Binding:
        refuse_held(optimizer, self)
        every = self._sums is not None and self._sums.holding  # frozen ones too, with no scaler (``hold``)
        binding = self._bindings.get(optimizer)
        fresh = binding is None
        loaded = any(SAVED_KEY in group for group in optimizer.param_groups)  # a checkpoint's masters not taken
        if binding is None:
            binding = Binding()
        elif not loaded and not any(stands_in(p, every) for p in binding.others(optimizer)):
            return binding  # the common case: nothing new since the last contact
        if not loaded and not any(stands_in(p, every) for p in grads.iter_params(optimizer)):
            # nothing to master (yet): bound when a low-precision parameter appears. Any held now is frozen
            # (else it would stand in): the optimizer counts as one of masters for the distributed-checkpoint
            # refusal, and with float32 sums it is hooked at a scale() once unfrozen, as in a bound optimizer
            if low_params(optimizer):
                checkpoint.pending(optimizer)
                if self._sums is not None:
                    self._sums.asleep(optimizer)
            return binding
        if self._sums is not None:
            self._sums.refuse_sharded(list(grads.iter_params(optimizer)))
        check_inner_optimizers(optimizer)
        check_params(optimizer, binding.by_master, self._owners(), {id(low) for low in binding.lows()})
        continued: list[str] = []
        with torch.no_grad():
            for number, group in enumerate(optimizer.param_groups):
                saved = group.pop(SAVED_KEY, None) or {}
                for index, param in enumerate(group["params"]):
                    if id(param) not in binding.by_master and self._bind_param(optimizer, binding, group, index, saved):
                        continued.append(describe(number, index, param))
        if continued:
            checkpoint.warn_continued(continued)
        if fresh:  # the hooks of an earlier binding (another scaler's) give way: one binding steers
            save = checkpoint.save_hook(binding.saved_value, binding.saved_dtype)
            load = checkpoint.load_hook(binding.restore, binding.unsaved, functools.partial(_end, binding))
            binding.hooks = checkpoint.install_hooks(optimizer, save, load)
            zeroed = functools.partial(self._zeroed, binding)
            optimizer.zero_grad = ZeroGradBoth(optimizer, binding.lows, zeroed)  # type: ignore[method-assign]
            added = None if self._sums is None else self._sums.added
            optimizer.add_param_group = AddParamGroupChecked(optimizer, binding.lows, added)  # type: ignore[method-assign]
            self._bindings[optimizer] = binding
        if self._sums is not None:
            self._sums.bind(binding, optimizer)
            if any(not p.requires_grad for p in low_params(optimizer)):
                self._sums.asleep(optimizer)  # frozen without a master: hooked at a scale() once unfrozen
        else:
            give_way(binding.lows())  # another scaler's hooks on them (its graph met them, or it steered them)
        return binding

    @staticmethod
    def _zeroed(binding: Binding, set_to_none: bool) -> None:
        """After a bound optimizer's ``zero_grad``: zeros in place are no write to the kept float16 gradients.
        (The sums hooks still hold for its parameters, a group added since its last move, are cleared by
        torch's ``zero_grad``, ``zeroing``.)"""
        if not set_to_none:
            binding.zeroed_kept()

    def _bind_param(
        self, optimizer: torch.optim.Optimizer, binding: Binding, group: dict[str, Any], index: int, saved: Any
    ) -> bool:
        """Give ``group["params"][index]`` its master (a low-precision parameter), bind a copied master to
        its parameter, or continue a float32 parameter from its saved master (``checkpoint.continues``) or bind
        it to a saved master it equals where it was float16/bfloat16 when saved (``checkpoint.narrowed``): True
        for these two (``ContinuedWarning``)."""
        param = group["params"][index]
        value = saved.get("masters", {}).get(index)
        kept_wide = value is not None and param.dtype == torch.float32 and checkpoint.same(value, param.detach())
        every = self._sums is not None and self._sums.holding
        continued = False
        if kept_wide or needs_master(param, every or trained(param, optimizer.state) or value is not None):
            # kept_wide: a float32 parameter equal to its saved master, bound in float32 when saved (``block.float()``
            # on a bound model), or float16 then and cast since (peft's load of adapters saved before any applied
            # step: ``narrowed``, it continues in float32): it keeps its master, through a later ``block.half()`` too
            continued = kept_wide and checkpoint.narrowed(value, param, saved.get("dtypes", {}).get(index))
            master = checkpoint.master_of(param, value)
            loaded = optimizer.state.pop(param, None)
            made = checkpoint.constructed(optimizer, master)
            state = checkpoint.state_for_master(loaded, saved.get("state", {}).get(index), param.dtype, made)
            if state is not None:
                optimizer.state[master] = state
            setattr(master, PARAM_ATTR, param)
            group["params"][index] = master
            pair = Pair(master=master, low=param)
            if value is not None:  # a saved master may round to the parameter only through other dtypes
                pair.note_exact()
            pair.seen()
        elif stands_in(param):  # a copied master: bound to its copied parameter, checked first
            pair = Pair(master=param, low=getattr(param, PARAM_ATTR))
        else:
            resumed = None if value is None else checkpoint.continues(value, param)
            if resumed is not None:
                param.copy_(resumed)
                if param in optimizer.state:  # a checkpoint saved before its first move holds the state rounded
                    state = saved.get("state", {}).get(index)
                    optimizer.state[param] = checkpoint.exact_state(optimizer.state[param], state)
            return resumed is not None
        binding.add(pair)
        return continued

    def _owners(self) -> dict[int, weakref.ReferenceType[torch.optim.Optimizer]]:
        """The id of each parameter a master stands for -> a weak reference to that master's optimizer (the
        bindings hold the parameters; no weak reference to a parameter, which torch's swap refuses)."""
        return {
            id(pair.low): weakref.ref(optimizer)
            for optimizer, binding in self._bindings.items()
            for pair in binding.pairs
        }


class NoMasters:
    """The service of a scaler without ``master_weights``: every operation changes nothing."""

    active = False

    def watch(self, output: Any) -> Any:
        return output

    def register_ddp(self, module: Any) -> None:
        raise ValueError(NOT_ACCUMULATING_MESSAGE.format(accumulate=False))

    def masters(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []

    def param_of(self, master: torch.Tensor) -> torch.Tensor | None:
        return None

    def lows(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return []

    def added_to(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return params

    def move(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Moved:
        return NOTHING

    def show(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def finish(self, optimizer: torch.optim.Optimizer, stepped: bool, skipped: torch.Tensor | None = None) -> None:
        pass

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def end_iteration(self) -> None:
        pass

    def refuse_disabled(self, optimizer: torch.optim.Optimizer) -> None:
        pass
