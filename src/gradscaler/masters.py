"""float32 master weights for float16 and bfloat16 parameters: the service behind ``master_weights=True``.

The recipe is the first of Micikevicius et al. (2018), as Apex O2, Megatron-LM's
``Float16OptimizerWithFloat16Params`` and DeepSpeed's ``FP16_Optimizer`` keep it, but without wrapping
the user's optimizer: at the scaler's first contact with an optimizer, every float16/bfloat16
parameter that requires a gradient is replaced *in the optimizer's ``param_groups``* by a float32
master (a copy of its value); ``optimizer.state`` is then keyed by the masters, and LR schedulers,
``add_param_group`` (new low-precision parameters get masters at the next contact) and every torch
optimizer keep working on the very object the user built. Each iteration:

1. ``gather``: ``master.grad = param.grad.float() * factor`` in one pass that also gives the flag and,
   when clipping, the norms (``Moved``): the scaler's ``1/S`` at ``unscale_``; no factor when clipping
   (a fused optimizer takes ``S / clip_coef`` as ``grad_scale``, others get one multiply) or at a
   fused step. The results equal the scaler's own passes over float32 parameters bit for bit. The
   low-precision gradient is left in place, its version recorded (``check_untouched``), until
   ``finish``, or ``release`` when ``scale()`` finds the iteration interrupted;
2. the scaler steps the optimizer (on the masters) or skips it;
3. ``finish``: after an applied step ``param.copy_(master)``; the low-precision gradients are set to
   None (``optimizer.zero_grad()`` now reaches only the masters, so they must not accumulate).

The model's parameters always equal their masters rounded, so ``model.state_dict()`` holds float16
values; the masters reach a checkpoint through the optimizer's: a ``state_dict`` post-hook adds, to
each saved param group, the masters of its positions and the float32 state of those masters (the
same tensors as in ``state``: ``torch.save`` stores them once). ``Optimizer.load_state_dict`` keeps
that key (it keeps every saved group key) and casts the state to the dtype of the parameters it is
loaded into: float16, before a resumed optimizer's first contact. First contact then builds the
masters from the saved values and puts the exact float32 state back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler import grads
from gradscaler.kernels import GradStats, grad_stats, move_grads_, moved

LOW_PRECISION = (torch.float16, torch.bfloat16)
SAVED_KEY = "gradscaler_master_weights"
"""The key the optimizer's ``state_dict`` post-hook adds to each saved param group (removed on load)."""

CLIPPED_LOW_GRADS_MESSAGE = (
    "The float16/bfloat16 gradient of {name} was changed after the scaler moved it to its float32 master "
    "(scaler.unscale_(optimizer) followed by torch.nn.utils.clip_grad_norm_(model.parameters(), ...)?). With "
    "master_weights=True the optimizer steps the float32 masters, whose gradients that call does not see. "
    "Call scaler.clip_grad_norm_(optimizer, max_norm) instead (it clips the masters' gradients), or clip "
    "the optimizer's own parameters after scaler.unscale_(optimizer): "
    "torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g['params']], max_norm)."
)


# Low-precision parameters whose gradients are in their masters this iteration -> those masters, for
# every scaler: ``stand_ins`` lets a clipping call over ``model.parameters()`` reach the masters.
_MOVED = WeakIdKeyDictionary()  # weakref's own dictionary compares tensors with ==


def stand_ins(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` with each low-precision parameter whose gradient a scaler has moved this iteration
    replaced by its master (whose gradient is the one the optimizer steps with)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return [_MOVED.get(p, p) for p in params]


def describe(group: int, index: int, param: torch.Tensor) -> str:
    """How an error names a parameter: its place in the optimizer, shape and dtype."""
    return f"optimizer.param_groups[{group}]['params'][{index}] (shape {tuple(param.shape)}, {param.dtype})"


def needs_master(param: torch.Tensor) -> bool:
    """Whether the optimizer should step a float32 master instead of ``param``."""
    return param.dtype in LOW_PRECISION and param.requires_grad


@dataclass
class Pair:
    """One low-precision parameter and its master, with the versions that tell who wrote them last."""

    low: torch.Tensor
    master: torch.Tensor
    low_version: int = 0
    grad: torch.Tensor | None = None
    grad_version: int = 0


@dataclass
class Binding:
    """The masters of one optimizer and the hooks that carry them through its state dict."""

    pairs: list[Pair] = field(default_factory=list)
    by_master: dict[int, Pair] = field(default_factory=dict)
    gathered: bool = False
    hooks: list[Any] = field(default_factory=list)


@dataclass
class Moved:
    """What one ``gather`` pass found, per device: the non-finite flag of the gradients it moved, their
    per-tensor norms (when asked) with the masters they belong to in the same order, and the masters'
    new gradients (checkable views, by device and dtype) for a later multiply."""

    flags: dict[torch.device, torch.Tensor]
    norms: dict[torch.device, torch.Tensor]
    owners: dict[torch.device, list[torch.Tensor]]
    master_grads: grads.GradGroups

    def add(self, owners: list[torch.Tensor], moved: list[torch.Tensor], stats: GradStats) -> None:
        """Fold in one batch: the ``moved`` gradients of ``owners`` (one device) and their pass's stats."""
        device = moved[0].device
        flag = self.flags.get(device)
        self.flags[device] = stats.nonfinite if flag is None else grads.combine_flags([flag, stats.nonfinite])
        self.master_grads[device][torch.float32].extend(moved)
        if stats.norms is not None:
            before = self.norms.get(device)
            self.norms[device] = stats.norms if before is None else torch.cat([before, stats.norms])
        self.owners.setdefault(device, []).extend(owners)

    def after(
        self, norms: dict[torch.device, torch.Tensor], owners: grads.Owners
    ) -> tuple[dict[torch.device, torch.Tensor], grads.Owners]:
        """Another pass's per-device norms and their owners, followed by this pass's (one order per device)."""
        joined_norms, joined_owners = dict(norms), dict(owners)
        for device, mine in self.norms.items():
            before = joined_norms.get(device)
            joined_norms[device] = mine if before is None else torch.cat([before, mine])
            joined_owners[device] = joined_owners.get(device, []) + self.owners[device]
        return joined_norms, joined_owners

    def rest(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the masters whose gradients this pass moved and checked."""
        if not self.owners:
            return params
        covered = {id(m) for owners in self.owners.values() for m in owners}
        return [p for p in params if id(p) not in covered]


NOTHING = Moved({}, {}, {}, {})
"""What ``gather`` returns when the gradients were moved earlier this iteration: nothing covered."""


def _copied_stats(
    view: torch.Tensor, factor: torch.Tensor | None, norm_type: float | None, norm_inv: torch.Tensor | None
) -> GradStats:
    """The flag (and norm) of a copied master gradient (``view``: its checkable values), read before
    ``factor`` multiplies it in place (torch's check-and-unscale, whose flag serves when no norm is asked)."""
    stats = grad_stats([view], norm_type, norm_inv) if norm_type is not None or factor is None else None
    if factor is not None:
        flag = torch.zeros((), dtype=torch.float32, device=view.device)
        torch._amp_foreach_non_finite_check_and_unscale_([view], flag, moved(factor, view.device, torch.float32))
        if stats is None:
            return GradStats(flag, None)
    assert stats is not None  # asked for above whenever no factor gives the flag
    return stats


def _master_of(param: torch.Tensor, saved: torch.Tensor | None) -> torch.Tensor:
    """A float32 leaf copy of ``param`` (or of the saved master value), on ``param``'s device."""
    source = param.detach() if saved is None else saved.detach()
    master = source.to(device=param.device, dtype=torch.float32, copy=True)
    return master.requires_grad_(True)


def _state_for_master(
    loaded: dict[str, Any] | None, exact: dict[str, Any] | None, low_dtype: torch.dtype
) -> dict[str, Any] | None:
    """The optimizer state of a new master: the saved float32 values where a checkpoint had them, else
    the low-precision parameter's state with its low-precision tensors widened to float32."""
    if loaded is None and exact is None:
        return None
    state = dict(loaded or {})
    for key, value in (exact or {}).items():
        if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
            where = state[key].device if isinstance(state.get(key), torch.Tensor) else value.device
            state[key] = value.to(device=where, copy=True)
    if exact is None:
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.dtype == low_dtype:
                state[key] = value.float()
    return state


def _check_buildable(name: str, param: torch.Tensor) -> None:
    if param.is_meta:
        raise ValueError(
            f"master_weights=True cannot build a float32 master for {name}: it is on the meta device and has no "
            "values. Materialise the model (to_empty() + initialisation, or load its weights) before the first "
            "scaler.step(optimizer)."
        )
    if param.layout is not torch.strided:
        raise ValueError(
            f"master_weights=True cannot build a float32 master for {name}: its layout is {param.layout}. Keep "
            "sparse parameters in float32 (param.data = param.data.float()) or freeze them (requires_grad_(False))."
        )


class MasterWeights:
    """The float32 masters of the optimizers one scaler steps, bound at first contact.

    Holds, per optimizer, the (low-precision parameter, master) pairs; ``gather`` (move gradients),
    ``finish`` (copy back), ``check_untouched`` and the state-dict hooks are its operations. A
    parameter belongs to at most one optimizer's masters.
    """

    def __init__(self) -> None:
        self._bindings: weakref.WeakKeyDictionary[torch.optim.Optimizer, Binding] = weakref.WeakKeyDictionary()
        self._owners = WeakIdKeyDictionary()

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterWeights:
        # The masters live in the optimizers' param_groups: a copied scaler must keep steering them.
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {}  # optimizers belong to this process; a pickled scaler binds afresh

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def masters(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(low-precision parameter, master) for every master of ``optimizer``, in param-group order."""
        binding = self._bindings.get(optimizer)
        return [] if binding is None else [(pair.low, pair.master) for pair in binding.pairs]

    def param_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """The model parameter ``master`` stands for; None when it is no master of these optimizers."""
        for binding in self._bindings.values():
            pair = binding.by_master.get(id(master))
            if pair is not None and pair.master is master:
                return pair.low
        return None

    def gather(
        self,
        optimizer: torch.optim.Optimizer,
        factor: torch.Tensor | None = None,
        norm_type: float | None = None,
        norm_inv: torch.Tensor | None = None,
    ) -> Moved:
        """Bind ``optimizer`` (first contact, or new low-precision parameters) and, once per iteration,
        set each master's gradient to its parameter's gradient in float32, times ``factor`` when given.

        The same pass gives the non-finite flag of the moved gradients and, with ``norm_type``, their
        norms times ``norm_inv``: one read of 2 bytes and one write of 4 per value for dense gradients
        (``kernels.move_grads_``); DTensor, sparse and strided ones are copied, read and multiplied by
        torch's ops. Returns ``NOTHING`` when this iteration's gradients were moved already."""
        binding = self._bind(optimizer)
        if binding.gathered:
            return NOTHING
        result = Moved({}, {}, {}, grads.new_groups())
        batches: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
        with torch.no_grad():
            for pair in binding.pairs:
                low, master = pair.low, pair.master
                if low._version != pair.low_version:  # someone wrote the parameter (a model load, an edit)
                    self._refresh(pair)
                grad = low.grad
                pair.grad = grad
                if grad is None:
                    continue  # as a float32 parameter would: the master keeps what zero_grad left
                if type(grad) is torch.Tensor and grad.layout is torch.strided and grad.is_contiguous():
                    out = master.grad
                    if out is None or type(out) is not torch.Tensor or not out.is_contiguous():
                        out = master.grad = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
                    src, dst, owners = batches.setdefault((grad.device, grad.dtype), ([], [], []))
                    src.append(grad)
                    dst.append(out)
                    owners.append(master)
                else:
                    master.grad = grad.to(torch.float32, copy=True)
                    view = grads.checkable_view(master.grad)
                    result.add([master], [view], _copied_stats(view, factor, norm_type, norm_inv))
                pair.grad_version = grad._version
                _MOVED[low] = master
            for src, dst, owners in batches.values():
                result.add(owners, dst, move_grads_(src, dst, factor, norm_type, norm_inv))
        binding.gathered = True
        return result

    def check_untouched(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse (``ValueError`` with the fix) when a moved low-precision gradient was written since."""
        binding = self._bindings.get(optimizer)
        if binding is None or not binding.gathered:
            return
        for number, pair in enumerate(binding.pairs):
            grad = pair.low.grad
            if pair.grad is not None and (grad is not pair.grad or grad._version != pair.grad_version):
                name = self._name(optimizer, pair, number)
                raise ValueError(CLIPPED_LOW_GRADS_MESSAGE.format(name=name))

    def finish(self, optimizer: torch.optim.Optimizer, stepped: bool) -> None:
        """End ``optimizer``'s iteration: copy the masters into the parameters if the step was applied
        (a skipped step writes nothing) and drop the low-precision gradients."""
        binding = self._bindings.get(optimizer)
        if binding is None:
            return
        with torch.no_grad():
            for pair in binding.pairs:
                if stepped:
                    pair.low.copy_(pair.master)
                    pair.low_version = pair.low._version
                if pair.grad is not None:
                    pair.low.grad = None
                    pair.grad = None
                _MOVED.pop(pair.low, None)
        binding.gathered = False

    def lows(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The low-precision parameters of ``optimizer``'s masters (their gradients tell a new backward)."""
        binding = self._bindings.get(optimizer)
        return [] if binding is None else [pair.low for pair in binding.pairs]

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the low-precision gradients kept since this iteration's move (their values are in the
        masters): after an interrupted iteration, the next backward writes fresh ones instead of adding
        to them, as it would to a float32 parameter's gradient that ``zero_grad`` cleared."""
        binding = self._bindings.get(optimizer)
        if binding is None or not binding.gathered:
            return
        for pair in binding.pairs:
            if pair.grad is not None and pair.low.grad is pair.grad and pair.low.grad._version == pair.grad_version:
                pair.low.grad = None
            pair.grad = None

    def restart(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget this iteration's move: the next ``gather`` copies the untouched gradients again."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            binding.gathered = False
            for pair in binding.pairs:
                _MOVED.pop(pair.low, None)

    def _refresh(self, pair: Pair) -> None:
        """Take the parameter's new values where they differ from the master rounded (a model load of the
        same values keeps the master's precision), and note the version."""
        rounded = pair.master.to(pair.low.dtype)
        changed = rounded != pair.low
        pair.master.copy_(torch.where(changed, pair.low.to(torch.float32), pair.master))
        pair.low_version = pair.low._version

    def _name(self, optimizer: torch.optim.Optimizer, pair: Pair, number: int) -> str:
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param is pair.master:
                    return describe(group_index, index, pair.low)
        return f"master {number}"

    def _bind(self, optimizer: torch.optim.Optimizer) -> Binding:
        binding = self._bindings.get(optimizer)
        fresh = binding is None
        if binding is None:
            binding = Binding()
        elif not any(needs_master(p) and id(p) not in binding.by_master for p in grads.iter_params(optimizer)):
            return binding  # the common case: nothing new since the last contact
        self._check_params(optimizer, binding)
        with torch.no_grad():
            for group in optimizer.param_groups:
                saved = group.pop(SAVED_KEY, None) or {}
                params = group["params"]
                for index, param in enumerate(params):
                    if id(param) in binding.by_master or not needs_master(param):
                        continue
                    master = _master_of(param, saved.get("masters", {}).get(index))
                    exact = saved.get("state", {}).get(index)
                    state = _state_for_master(optimizer.state.pop(param, None), exact, param.dtype)
                    if state is not None:
                        optimizer.state[master] = state
                    params[index] = master
                    pair = Pair(param, master, param._version)
                    binding.pairs.append(pair)
                    binding.by_master[id(master)] = pair
                    self._owners[param] = weakref.ref(optimizer)
        if fresh:
            binding.hooks = [
                optimizer.register_state_dict_post_hook(_save_masters(binding)),
                optimizer.register_load_state_dict_post_hook(_load_masters(binding)),
            ]
            self._bindings[optimizer] = binding
        return binding

    def _check_params(self, optimizer: torch.optim.Optimizer, binding: Binding) -> None:
        """Refuse, before changing anything, a parameter no master can be built for or one held twice."""
        seen: dict[int, str] = {}
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                name = describe(group_index, index, param)
                if id(param) in seen:
                    raise ValueError(
                        f"master_weights=True: the optimizer holds one parameter twice, as {seen[id(param)]} and as "
                        f"{name}. A float32 master can stand for it only once: list each parameter in one place."
                    )
                seen[id(param)] = name
                if not needs_master(param) or id(param) in binding.by_master:
                    continue
                _check_buildable(name, param)
                owner = self._owners.get(param)
                if owner is not None and owner() is not None and owner() is not optimizer:
                    raise ValueError(
                        f"master_weights=True: {name} already has a float32 master in another optimizer stepped "
                        "by this scaler. Give each parameter to one optimizer."
                    )


def _save_masters(binding: Binding) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    """The ``state_dict`` post-hook: each saved group gets its masters and their float32 state."""

    def hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_state = state_dict["state"]
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
            masters: dict[int, torch.Tensor] = {}
            state: dict[int, Any] = {}
            for index, (param, number) in enumerate(zip(group["params"], saved["params"], strict=True)):
                if id(param) in binding.by_master:
                    masters[index] = param.detach()
                    if number in saved_state:
                        state[index] = saved_state[number]  # the same tensors: torch.save writes them once
            if masters:
                saved[SAVED_KEY] = {"masters": masters, "state": state}
        return state_dict

    return hook


def _load_masters(binding: Binding) -> Callable[[torch.optim.Optimizer], None]:
    """The ``load_state_dict`` post-hook of a bound optimizer: its groups hold the masters already, so the
    loaded state kept float32; the saved master values are copied in, and into the parameters."""

    def hook(optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                saved = group.pop(SAVED_KEY, None)
                if not saved:
                    continue
                for index, value in saved["masters"].items():
                    pair = binding.by_master.get(id(group["params"][index]))
                    if pair is None:
                        continue
                    pair.master.copy_(value)
                    pair.low.copy_(pair.master)
                    pair.low_version = pair.low._version
        binding.gathered = False

    return hook


DISABLED_MESSAGE = (
    "GradScaler(master_weights=True, enabled=False) does not scale and keeps no masters: step() calls "
    "optimizer.step() as it is, which would step {name} in {dtype} and lose the updates below its "
    "resolution. Enable the scaler (enabled=True) to train it with float32 master weights, or cast the "
    "model to float32 (model.float()) for a run without loss scaling."
)


def refuse_low_precision(optimizer: torch.optim.Optimizer) -> None:
    """For a disabled scaler asked for masters: ``ValueError`` if ``optimizer`` would step a
    low-precision parameter that has a gradient (float32 runs pass untouched)."""
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            if param.dtype in LOW_PRECISION and param.grad is not None:
                raise ValueError(DISABLED_MESSAGE.format(name=describe(group_index, index, param), dtype=param.dtype))
