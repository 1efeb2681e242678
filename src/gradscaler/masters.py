"""float32 master weights for float16 and bfloat16 parameters: the service behind ``master_weights=True``.

The recipe is the first of Micikevicius et al. (2018), as Apex O2, Megatron-LM's
``Float16OptimizerWithFloat16Params`` and DeepSpeed's ``FP16_Optimizer`` keep it, but without wrapping
the user's optimizer: at the scaler's first contact with an optimizer, every float16/bfloat16
parameter that requires a gradient is replaced *in the optimizer's ``param_groups``* by a float32
master (a copy of its value); ``optimizer.state`` is then keyed by the masters, and LR schedulers,
``add_param_group`` (new low-precision parameters get masters at the next contact) and every torch
optimizer keep working on the very object the user built.

The lifecycle, all of it here; the scaler calls ``move`` at an optimizer's first ``unscale_``,
``clip_grad_norm_`` or fused check of an iteration (``show`` at the end of the user's ``unscale_``),
``before_step`` and ``finish`` around its ``optimizer.step``, ``end_iteration`` at ``update``,
``release`` at a ``scale()`` that finds an iteration interrupted and ``end`` for one optimizer whose
iteration a new backward replaced. Everything is derived
from the model's own state at those points, whoever cleared or wrote what in between:

* **Gradients.** ``move`` sets each master's gradient to its parameter's gradient in float32 (times the
  scaler's factor), or to None when the parameter has none, and drops the parameter's gradient (the
  recipe by hand: ``master.grad = p.grad.float() if p.grad is not None else None; p.grad = None``). One
  pass gives the move, the non-finite flag and, when clipping, the norms (``Moved``). So a parameter
  that missed a step is not stepped, whichever ``zero_grad`` the loop calls, and an iteration that
  ends at ``update()`` without ``step`` leaves nothing behind. After the user's own ``unscale_`` the
  parameter's gradient is kept until ``step``, holding the unscaled value (``show``), and a write to
  it that the step would not see is refused (``before_step``). ``optimizer.zero_grad()`` also clears
  the parameters' gradients (a backward whose batch the loop dropped), as for float32 parameters.
* **Values.** ``finish`` copies every master into its parameter after an applied step. Before a move,
  a parameter written since (version counter, or a new storage: ``p.data = ...``,
  ``vector_to_parameters``) refreshes its master wherever the parameter is not the master rounded. A
  write through ``p.data`` in place is invisible to both and is overwritten at the next applied step
  (docs/migration.md).
* **Checkpoints.** The optimizer's ``state_dict`` carries the masters: a post-hook adds, to each saved
  param group, the masters of its positions and their float32 state (the same tensors as in
  ``state``: ``torch.save`` stores them once). Torch keeps unknown group keys, so a checkpoint passed
  through a run without masters still holds old ones: a saved master is used only if it rounds to the
  whole parameter it is loaded for, and its saved state only where it rounds to the state loaded with
  it at the same step.
* **Copies.** Each master names its parameter (``PARAM_ATTR``), so a pickled, saved or deep-copied
  (model, optimizer, scaler) binds the copied masters to the copied parameters at its first contact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler import compiled, grads
from gradscaler.kernels import GradStats, grad_stats, move_grads_, moved

LOW_PRECISION = (torch.float16, torch.bfloat16)
SAVED_KEY = "gradscaler_master_weights"
"""The key the optimizer's ``state_dict`` post-hook adds to each saved param group (removed on load)."""
PARAM_ATTR = "_gradscaler_param"
"""The attribute of a master naming its model parameter; it travels with pickles and deep copies."""
HOOKS_ATTR = "_gradscaler_hooks"
"""The attribute of a bound optimizer holding its state-dict hooks (left out of its pickles)."""

WRITTEN_LOW_GRADS_MESSAGE = (
    "The float16/bfloat16 gradient of {name} was written after scaler.unscale_(optimizer) moved it to its "
    "float32 master, which is what the optimizer steps (a clipping over model.parameters() other than "
    "torch.nn.utils.clip_grad_norm_, such as clip_grad_value_ or adaptive clipping, or a function bound "
    "before the scaler's first step?). With master_weights=True that write would be lost. Call "
    "scaler.clip_grad_norm_(optimizer, max_norm), or apply it to the optimizer's own parameters: "
    "[p for g in optimizer.param_groups for p in g['params']] (the masters, whose gradients are stepped)."
)

INNER_OPTIMIZER_MESSAGE = (
    "master_weights=True cannot train {kind}: it steps its parameters through an optimizer of its own "
    "(its attribute {attr!r}), which would keep stepping the float16/bfloat16 parameters while the float32 "
    "masters are never stepped. Build it over float32 copies of the parameters by hand (docs/migration.md, "
    "'float16 parameters: master weights'), keep the model in float32 under torch.autocast, or shard with "
    "FSDP2 (torch.distributed.fsdp.fully_shard), whose parameters get float32 masters."
)


# Low-precision parameters whose gradients are in their masters this iteration -> those masters, for
# every scaler: ``stand_ins`` lets a clipping call over ``model.parameters()`` reach the masters.
_MOVED = WeakIdKeyDictionary()  # weakref's own dictionary compares tensors with ==
torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
"""torch's own ``clip_grad_norm_``, as torch defines it."""


@compiled.eager  # a weak dictionary, which Dynamo skips: one break, only for low-precision parameters
def stand_ins(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` with each low-precision parameter whose gradient a scaler has moved this iteration
    replaced by its master (whose gradient is the one the optimizer steps with)."""
    return [_MOVED.get(p, p) for p in params]


def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` once a scaler with masters has moved gradients: float16
    parameters whose gradients are in float32 masters are clipped through those masters
    (``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` as in torch's
    recipe, nanoGPT, Accelerate and the HF Trainer); every other parameter as torch clips it. Without
    a low-precision parameter it is torch's call, traced as such in compiled code."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(p.dtype in LOW_PRECISION for p in params):
        params = stand_ins(params)
    return torch_clip_grad_norm_(params, *args, **kwargs)


def route_clipping() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` reach the masters (``clip_grad_norm_``) unless someone else
    rebound it. Without it, clipping ``model.parameters()`` after ``unscale_`` would find no gradients."""
    if torch.nn.utils.clip_grad_norm_ is torch_clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def describe(group: int, index: int, param: torch.Tensor) -> str:
    """How an error names a parameter: its place in the optimizer, shape and dtype."""
    return f"optimizer.param_groups[{group}]['params'][{index}] (shape {tuple(param.shape)}, {param.dtype})"


def needs_master(param: torch.Tensor) -> bool:
    """Whether the optimizer should step a float32 master instead of ``param``."""
    return param.dtype in LOW_PRECISION and param.requires_grad


def unwrap(optimizer: Any) -> Any:
    """The optimizer a wrapper stands for: Accelerate's ``AcceleratedOptimizer`` and Lightning's
    optimizers hold it as ``.optimizer`` (or ``._optimizer``) and share its ``param_groups``."""
    while True:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or getattr(inner, "param_groups", None) is not optimizer.param_groups:
            inner = getattr(optimizer, "_optimizer", None)
            if inner is None or getattr(inner, "param_groups", None) is not optimizer.param_groups:
                return optimizer
        optimizer = inner


def _storage(tensor: torch.Tensor) -> int | None:
    """Where a plain tensor's values live (a ``p.data = ...`` moves it); None for subclasses (DTensor)."""
    return tensor.data_ptr() if type(tensor) in (torch.Tensor, torch.nn.Parameter) else None


@dataclass
class Pair:
    """One low-precision parameter and its master, with what tells whether the parameter was written
    since the master was last equal to it rounded (its version counter and storage)."""

    low: torch.Tensor
    master: torch.Tensor
    low_version: int = -1
    low_storage: int | None = None
    pending: torch.Tensor | None = None  # a master value loaded from a checkpoint, checked at the next move
    kept: torch.Tensor | None = None  # the parameter's gradient after the user's ``unscale_``, until ``step``
    kept_version: int = 0

    def written(self) -> bool:
        """Whether the parameter may differ from its master rounded."""
        return self.low._version != self.low_version or _storage(self.low) != self.low_storage

    def seen(self) -> None:
        """Note the parameter's version and storage: it now equals its master rounded."""
        self.low_version = self.low._version
        self.low_storage = _storage(self.low)


@dataclass
class Binding:
    """The masters of one optimizer, whether this iteration's gradients are in them, and the hooks that
    carry them through its state dict."""

    pairs: list[Pair] = field(default_factory=list)
    by_master: dict[int, Pair] = field(default_factory=dict)
    moved: bool = False
    hooks: list[Any] = field(default_factory=list)


@dataclass
class Moved:
    """What one ``move`` pass found, per device: the non-finite flag of the gradients it moved, their
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
        self, norms: dict[torch.device, torch.Tensor], owners: grads.Owners, order: list[torch.Tensor]
    ) -> tuple[dict[torch.device, torch.Tensor], grads.Owners]:
        """Another pass's per-device norms and their owners joined with this pass's, each device's in
        the order of ``order`` (the optimizer's parameters), as clipping the masters by hand sums them."""
        joined_norms, joined_owners = dict(norms), dict(owners)
        position = {id(p): i for i, p in enumerate(order)} if self.norms else {}
        for device, mine in self.norms.items():
            before = joined_norms.get(device)
            joined_norms[device] = mine if before is None else torch.cat([before, mine])
            joined_owners[device] = joined_owners.get(device, []) + self.owners[device]
            places = [position[id(p)] for p in joined_owners[device]]
            if places != sorted(places):
                permutation = sorted(range(len(places)), key=places.__getitem__)
                index = torch.tensor(permutation).to(device, non_blocking=True)
                joined_norms[device] = joined_norms[device].index_select(0, index)
                joined_owners[device] = [joined_owners[device][i] for i in permutation]
        return joined_norms, joined_owners

    def rest(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the masters whose gradients this pass moved and checked."""
        if not self.owners:
            return params
        covered = {id(m) for owners in self.owners.values() for m in owners}
        return [p for p in params if id(p) not in covered]


NOTHING = Moved({}, {}, {}, {})
"""What ``move`` returns when there is nothing to move: no masters, or moved earlier this iteration."""


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
    """A float32 leaf copy of ``param`` on its device: the saved master value if it rounds to the whole
    parameter (a resumed run keeps its precision), else the parameter's values (an edit since, or any
    training without masters since, changed it: the saved master belongs to another state)."""
    value = None if saved is None else _claims(saved, param)
    master = param.detach() if value is None else value
    return master.to(device=param.device, dtype=torch.float32, copy=True).requires_grad_(True)


def _claims(saved: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """``saved`` as a float32 tensor on ``param``'s device if it rounds to ``param`` everywhere, else None
    (one comparison, at a binding or a load only)."""
    if saved.shape != param.shape:
        return None
    value = saved.detach().to(device=param.device, dtype=torch.float32)
    return value if bool(torch.equal(value.to(param.dtype), param.detach())) else None


def _state_for_master(
    loaded: dict[str, Any] | None, saved: dict[str, Any] | None, low_dtype: torch.dtype
) -> dict[str, Any] | None:
    """The optimizer state of a new master: ``loaded`` (the low-precision parameter's, as the optimizer
    holds it) widened to float32, except each value the checkpoint's float32 state gives exactly: one
    that rounds to the loaded value, saved at the same step."""
    if loaded is None:
        return None
    state = dict(loaded)
    same_step = saved is not None and _same(saved.get("step"), loaded.get("step"))
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor) or value.dtype != low_dtype:
            continue
        exact = saved.get(key) if same_step and saved is not None else None
        if isinstance(exact, torch.Tensor) and exact.shape == value.shape and _same(exact.to(value.dtype), value):
            state[key] = exact.to(device=value.device, dtype=torch.float32, copy=True)
        else:
            state[key] = value.float()
    return state


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors bit for bit (on ``b``'s device), other values by ``==``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.to(b.device), b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


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


def _check_inner_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps its parameters through an inner optimizer of its own (torch's
    ``ZeroRedundancyOptimizer``): the masters would replace them only in the outer ``param_groups``."""
    for attr, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value.param_groups is not optimizer.param_groups:
            raise ValueError(INNER_OPTIMIZER_MESSAGE.format(kind=type(optimizer).__name__, attr=attr))


class ZeroGradBoth:
    """``optimizer.zero_grad`` of a bound optimizer: torch's, then the same for the float16/bfloat16
    parameters its masters stand for, whose gradients a backward writes and the optimizer no longer holds.

    Installed on the instance (``Optimizer.__getstate__`` leaves it out of pickles and deep copies,
    which bind afresh); holds the optimizer weakly."""

    def __init__(self, optimizer: torch.optim.Optimizer, binding: Binding) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._binding = binding

    @compiled.eager  # torch's zero_grad, which it calls, is one Dynamo skips too
    def __call__(self, set_to_none: bool = True) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        type(optimizer).zero_grad(optimizer, set_to_none)
        for pair in self._binding.pairs:
            grad = pair.low.grad
            if grad is None:
                continue
            if set_to_none:
                pair.low.grad = None
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()


class MasterWeights:
    """The float32 masters of the optimizers one scaler steps, bound at first contact.

    Holds, per optimizer, the (low-precision parameter, master) pairs, and the whole lifecycle:
    ``move`` (gradients in), ``finish`` (values out), ``end``/``end_iteration`` and the state-dict
    hooks. A parameter belongs to at most one optimizer's masters.
    """

    active = True

    def __init__(self) -> None:
        self._bindings: weakref.WeakKeyDictionary[torch.optim.Optimizer, Binding] = weakref.WeakKeyDictionary()
        self._owners = WeakIdKeyDictionary()

    def __deepcopy__(self, memo: dict[int, Any]) -> MasterWeights:
        return MasterWeights()  # the copy binds its optimizers at first contact, copied masters included

    def __getstate__(self) -> dict[str, Any]:
        return {}  # optimizers belong to this process; an unpickled scaler binds afresh

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

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
        """The low-precision parameters of ``optimizer``'s masters (their gradients tell a new backward)."""
        binding = self._bindings.get(optimizer)
        return [] if binding is None else [pair.low for pair in binding.pairs]

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
        binding = self._bind(optimizer)
        if binding.moved or not binding.pairs:
            return NOTHING
        route_clipping()
        with torch.no_grad():
            moving: list[tuple[Pair, torch.Tensor]] = []
            for pair in binding.pairs:
                if pair.written():  # a model load, an edit, weights copied in since the last step
                    self._refresh(pair)
                if pair.low.grad is None:
                    pair.master.grad = None  # no gradient this iteration: not stepped, as the recipe by hand
                else:
                    moving.append((pair, pair.low.grad))
            joint = norm_type is not None and not _one_pass(optimizer, binding, moving)
            result = self._move(moving, factor, None if joint else norm_type, norm_inv, keep)
        binding.moved = True
        return Moved(result.flags, {}, {}, grads.new_groups()) if joint else result

    @staticmethod
    def _move(
        moving: list[tuple[Pair, torch.Tensor]],
        factor: torch.Tensor | None,
        norm_type: float | None,
        norm_inv: torch.Tensor | None,
        keep: bool,
    ) -> Moved:
        result = Moved({}, {}, {}, grads.new_groups())
        batches: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
        for pair, grad in moving:
            master = pair.master
            if _dense(grad):
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
            if keep and _dense(grad):
                pair.kept = grad
            else:
                pair.low.grad = None
            _MOVED[pair.low] = master
        for src, dst, owners in batches.values():
            result.add(owners, dst, move_grads_(src, dst, factor, norm_type, norm_inv))
        return result

    def show(self, optimizer: torch.optim.Optimizer) -> None:
        """After the user's ``unscale_``: each kept float16 gradient takes its master's unscaled value, so
        what ``model.parameters()`` show is never still multiplied by the scale (one write of 2 bytes
        per value; only on this path). ``before_step`` refuses them written since."""
        binding = self._bindings.get(optimizer)
        if binding is None:
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
        for number, pair in enumerate(binding.pairs):
            kept, grad = pair.kept, pair.low.grad
            if kept is not None and grad is not None and (grad is not kept or grad._version != pair.kept_version):
                raise ValueError(WRITTEN_LOW_GRADS_MESSAGE.format(name=self._name(optimizer, pair, number)))
        self._drop_kept(binding)

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """At ``scale()`` after an interrupted iteration: drop the kept float16 gradients, so the coming
        backward writes them afresh instead of adding to them."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            self._drop_kept(binding)

    def finish(self, optimizer: torch.optim.Optimizer, stepped: bool) -> None:
        """End ``optimizer``'s iteration at its step: copy the masters into the parameters if the step was
        applied (a skipped step writes nothing)."""
        binding = self._bindings.get(optimizer)
        if binding is None:
            return
        if stepped and binding.moved:
            with torch.no_grad():
                for pair in binding.pairs:
                    pair.low.copy_(pair.master)
                    pair.seen()
        self._end(binding)

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        """End ``optimizer``'s iteration without a step (a new backward replaced it)."""
        binding = self._bindings.get(optimizer)
        if binding is not None:
            self._end(binding)

    def end_iteration(self) -> None:
        """At ``update()``: every optimizer's iteration is over, stepped or not."""
        for binding in list(self._bindings.values()):
            if binding.moved:
                self._end(binding)

    def refuse_disabled(self, optimizer: torch.optim.Optimizer) -> None:
        """For a disabled scaler asked for masters: ``ValueError`` if ``optimizer`` would step a
        low-precision parameter that has a gradient (float32 runs pass untouched)."""
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param.dtype in LOW_PRECISION and param.grad is not None:
                    name = describe(group_index, index, param)
                    raise ValueError(DISABLED_MESSAGE.format(name=name, dtype=param.dtype))

    @staticmethod
    def _end(binding: Binding) -> None:
        binding.moved = False
        MasterWeights._drop_kept(binding)
        for pair in binding.pairs:
            _MOVED.pop(pair.low, None)

    @staticmethod
    def _drop_kept(binding: Binding) -> None:
        """Drop each kept float16 gradient the parameter still holds (a new backward's is not touched)."""
        for pair in binding.pairs:
            if pair.kept is not None and pair.low.grad is pair.kept:
                pair.low.grad = None
            pair.kept = None

    def _name(self, optimizer: torch.optim.Optimizer, pair: Pair, number: int) -> str:
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                if param is pair.master:
                    return describe(group_index, index, pair.low)
        return f"master {number}"

    @staticmethod
    def _refresh(pair: Pair) -> None:
        """Make the master a loaded master value that rounds to the whole parameter as it is now, else the
        parameter's values wherever the master does not round to them (a model load of the same values
        keeps the master's precision), and note the parameter's version and storage."""
        loaded = None if pair.pending is None else _claims(pair.pending, pair.low)
        if loaded is not None:
            pair.master.copy_(loaded)
        else:
            rounded = pair.master.to(pair.low.dtype)
            pair.master.copy_(torch.where(rounded != pair.low, pair.low.to(torch.float32), pair.master))
        pair.pending = None
        pair.seen()

    def _bind(self, optimizer: torch.optim.Optimizer) -> Binding:
        binding = self._bindings.get(optimizer)
        fresh = binding is None
        if binding is None:
            binding = Binding()
        elif not any(id(p) not in binding.by_master and _stands_in(p) for p in grads.iter_params(optimizer)):
            return binding  # the common case: nothing new since the last contact
        if not any(_stands_in(p) for p in grads.iter_params(optimizer)):
            return binding  # nothing to master (yet): bound when a low-precision parameter appears
        _check_inner_optimizers(optimizer)
        self._check_params(optimizer, binding)
        with torch.no_grad():
            for group in optimizer.param_groups:
                saved = group.pop(SAVED_KEY, None) or {}
                params = group["params"]
                for index, param in enumerate(params):
                    if id(param) in binding.by_master:
                        continue
                    if needs_master(param):
                        master = _master_of(param, saved.get("masters", {}).get(index))
                        state = _state_for_master(
                            optimizer.state.pop(param, None), saved.get("state", {}).get(index), param.dtype
                        )
                        if state is not None:
                            optimizer.state[master] = state
                        setattr(master, PARAM_ATTR, param)
                        params[index] = master
                        pair = Pair(master=master, low=param)
                        pair.seen()
                    elif _stands_in(param):  # a copied master: bound to its copied parameter, checked first
                        pair = Pair(master=param, low=getattr(param, PARAM_ATTR))
                    else:
                        continue
                    binding.pairs.append(pair)
                    binding.by_master[id(pair.master)] = pair
                    self._owners[pair.low] = weakref.ref(optimizer)
        if fresh:  # the hooks of an earlier binding (another scaler's) give way: one binding steers
            for handle in vars(optimizer).pop(HOOKS_ATTR, []):
                handle.remove()
            binding.hooks = [
                optimizer.register_state_dict_post_hook(_save_masters(binding)),
                optimizer.register_load_state_dict_post_hook(_load_masters(binding)),
            ]
            setattr(optimizer, HOOKS_ATTR, binding.hooks)
            optimizer.zero_grad = ZeroGradBoth(optimizer, binding)  # type: ignore[method-assign]
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
                if not _stands_in(param) or id(param) in binding.by_master:
                    continue
                if needs_master(param):
                    _check_buildable(name, param)
                low = getattr(param, PARAM_ATTR, param)
                owner = self._owners.get(low)
                if owner is not None and owner() is not None and owner() is not optimizer:
                    raise ValueError(
                        f"master_weights=True: {name} already has a float32 master in another optimizer stepped "
                        "by this scaler. Give each parameter to one optimizer."
                    )


def _dense(grad: torch.Tensor) -> bool:
    """Whether ``kernels.move_grads_`` takes ``grad`` (a plain contiguous tensor)."""
    return type(grad) is torch.Tensor and grad.layout is torch.strided and grad.is_contiguous()


def _one_pass(optimizer: torch.optim.Optimizer, binding: Binding, moving: list[tuple[Pair, torch.Tensor]]) -> bool:
    """Whether the move's norms are those of one pass over every gradient of ``optimizer``: all moved
    gradients dense and of one device and dtype, and no other parameter of ``optimizer`` has one."""
    kinds = {(grad.device, grad.dtype) for _, grad in moving}
    if len(kinds) > 1 or not all(_dense(grad) for _, grad in moving):
        return False
    return all(p.grad is None for p in grads.iter_params(optimizer) if id(p) not in binding.by_master)


def _stands_in(param: torch.Tensor) -> bool:
    """Whether ``param`` needs a master, or is one (a copied optimizer's) that still needs its binding."""
    return needs_master(param) or (param.dtype == torch.float32 and hasattr(param, PARAM_ATTR))


class NoMasters:
    """The service of a scaler without ``master_weights``: every operation changes nothing."""

    active = False

    def masters(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []

    def param_of(self, master: torch.Tensor) -> torch.Tensor | None:
        return None

    def lows(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return []

    def move(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Moved:
        return NOTHING

    def show(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def finish(self, optimizer: torch.optim.Optimizer, stepped: bool) -> None:
        pass

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def end_iteration(self) -> None:
        pass

    def refuse_disabled(self, optimizer: torch.optim.Optimizer) -> None:
        pass


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
    loaded state kept float32; each saved master value is taken if it rounds to the parameter
    everywhere (the model's checkpoint loaded first), and again at the next move against the parameter as
    it is then (the model's checkpoint loaded after the optimizer's)."""

    def hook(optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                saved = group.pop(SAVED_KEY, None)
                if not saved:
                    continue
                for index, value in saved["masters"].items():
                    pair = binding.by_master.get(id(group["params"][index]))
                    if pair is None or value.shape != pair.master.shape:
                        continue
                    pair.pending = value.detach().to(device=pair.master.device, dtype=torch.float32, copy=True)
                    loaded = _claims(pair.pending, pair.low)
                    if loaded is not None:
                        pair.master.copy_(loaded)
                    pair.low_version = -1
        MasterWeights._end(binding)

    return hook


DISABLED_MESSAGE = (
    "GradScaler(master_weights=True, enabled=False) does not scale and keeps no masters: step() calls "
    "optimizer.step() as it is, which would step {name} in {dtype} and lose the updates below its "
    "resolution. Enable the scaler (enabled=True) to train it with float32 master weights, or cast the "
    "model to float32 (model.float()) for a run without loss scaling."
)
