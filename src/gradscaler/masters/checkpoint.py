"""The masters through the optimizer's state dict: what is saved, and what of it a binding or a load takes.

Saved: a ``state_dict`` post-hook adds, to each saved param group, the key ``SAVED_KEY`` with the masters
of its positions, their float32 state (the same tensors as in ``state``: ``torch.save`` stores them
once) and the dtype of each master's parameter (``dtypes``: "float16", "bfloat16" or "float32"). Torch
keeps unknown group keys, so a checkpoint passed through a run without masters still holds old ones;
taken back: a saved master only if it rounds to the whole parameter it is loaded for
(``claims``), and its saved state only where it rounds to the state loaded with it at the same step
(``state_for_master``). Plain functions of tensors and dicts; ``lifecycle.MasterWeights`` gives the hooks
what they need as callables and never hands its pairs down.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from gradscaler.errors import warn
from gradscaler.masters.checks import LOW_PRECISION, PARAM_ATTR, low_params

SAVED_KEY = "gradscaler_master_weights"
"""The key the optimizer's ``state_dict`` post-hook adds to each saved param group (removed on load)."""
HOOKS_ATTR = "_gradscaler_hooks"
"""The attribute of a bound optimizer holding its state-dict hooks (left out of its pickles)."""


def master_of(param: torch.Tensor, saved: torch.Tensor | None) -> torch.Tensor:
    """A float32 leaf copy of ``param`` on its device: the saved master value if it rounds to the whole
    parameter (a resumed run keeps its precision), else the parameter's values (an edit since, or any
    training without masters since, changed it: the saved master belongs to another state)."""
    value = None if saved is None else claims(saved, param)
    master = param.detach() if value is None else value
    return master.to(device=param.device, dtype=torch.float32, copy=True).requires_grad_(True)


def claims(saved: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """``saved`` as a float32 tensor on ``param``'s device if it rounds to ``param`` everywhere
    (``rounds_to``), else None (at a binding or a load only)."""
    if saved.shape != param.shape:
        return None
    value = saved.detach().to(device=param.device, dtype=torch.float32)
    return value if bool(rounds_to(value, param).all()) else None


def rounds_to(value: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Where ``low`` is the float32 ``value`` rounded to ``low``'s dtype, directly or through up to three casts
    between float16 and bfloat16 before it (the changes of dtype a loop makes between two moves, a bfloat16
    evaluation and back: each rounds the values again)."""
    low = low.detach()
    kept = value.to(low.dtype) == low
    for first, second in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        rounded = value
        for dtype in (first, second, first):
            rounded = rounded.to(dtype)
            kept |= rounded.to(low.dtype) == low
    return kept


def state_for_master(
    loaded: dict[str, Any] | None,
    saved: dict[str, Any] | None,
    low_dtype: torch.dtype,
    made: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """The optimizer state of a new master: ``loaded`` (the low-precision parameter's, as the optimizer
    holds it) widened to float32, except each value given exactly: by the checkpoint's float32 state
    saved at the same step, or, for a state no step has touched, by ``made`` (what the optimizer's
    constructor makes, built on the master: ``constructed``); either only where it rounds to the loaded
    value."""
    if loaded is None:
        return None
    state = dict(loaded)
    same_step = saved is not None and same(saved.get("step"), loaded.get("step"))
    exact = saved if same_step else made if made and _untouched(loaded) else None
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor) or value.dtype not in (*LOW_PRECISION, torch.float32):
            continue  # torch's cast when loaded, to the dtype the parameter had then (float32 after block.float())
        given = exact.get(key) if exact is not None else None
        if isinstance(given, torch.Tensor) and given.shape == value.shape and _rounds_all(given, value):
            state[key] = given.to(device=value.device, dtype=torch.float32, copy=True)
        elif value.dtype in LOW_PRECISION:
            state[key] = value.float()
    return state


def _rounds_all(given: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the float32 state ``given`` rounds to the loaded ``value`` everywhere (``rounds_to``)."""
    if not given.is_floating_point() or not value.is_floating_point():
        return same(given.to(value.dtype), value)
    return bool(rounds_to(given.detach().to(device=value.device, dtype=torch.float32), value).all())


def exact_state(loaded: dict[str, Any] | None, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """The state torch loaded into a bound master (cast to float32 from what was saved) with each value
    the checkpoint also holds in float32 at the same step, where that rounds to it: a checkpoint saved before
    its optimizer's first move holds the state rounded, and its exact values beside the masters."""
    if loaded is None or saved is None or not same(saved.get("step"), loaded.get("step")):
        return loaded
    state = dict(loaded)
    for key, value in loaded.items():
        given = saved.get(key)
        if key == "step" or not isinstance(value, torch.Tensor) or not isinstance(given, torch.Tensor):
            continue
        if given.dtype == torch.float32 and given.shape == value.shape and _rounds_all(given, value):
            state[key] = given.to(device=value.device, dtype=value.dtype, copy=True)
    return state


def constructed(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state ``optimizer``'s constructor makes for a parameter, built on ``master`` as the recipe by
    hand builds it on its float32 copy. In torch.optim only ``Adagrad`` makes state at construction: ``sum``
    filled with ``initial_accumulator_value`` (0.1 in float16 is 0.0999756)."""
    if isinstance(optimizer, torch.optim.Adagrad) and not torch.is_complex(master):
        return {"sum": torch.full_like(master, optimizer.defaults["initial_accumulator_value"])}
    return {}


def _untouched(state: dict[str, Any]) -> bool:
    """Whether no step has touched ``state``: its ``step`` is 0."""
    step = state.get("step")
    return isinstance(step, (torch.Tensor, int, float)) and float(step) == 0


def dtype_name(dtype: torch.dtype) -> str:
    """How a checkpoint names a parameter's dtype (``dtypes``): "float16", "bfloat16", "float32"."""
    return str(dtype).removeprefix("torch.")


def narrowed(saved: torch.Tensor, param: torch.Tensor, dtype: Any) -> bool:
    """For a float32 ``param`` equal to its ``saved`` master (bound to it: ``kept_wide``), whether it was
    float16/bfloat16 when its checkpoint was saved (``dtype``, the name saved with the master) and is float32
    now (peft's load of adapters saved before any applied step): it continues as a float32 parameter. A
    checkpoint without the name (saved before it was recorded): when the master is a float16 or bfloat16 value
    (``continues``), as a float32 parameter saved so is the rarer case (``block.float()`` on a bound model,
    and no applied step since)."""
    if isinstance(dtype, str):
        return dtype in {dtype_name(low) for low in LOW_PRECISION}
    return continues(saved, param) is not None


def continues(saved: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """For a float32 ``param`` at a position whose checkpoint holds a master (a float16/bfloat16 parameter
    then, cast to float32 since: peft loads adapters in float32): ``saved`` if, rounded to float16 or to
    bfloat16, it equals the parameter everywhere (its precision below that is the run's own), else None."""
    if saved.shape != param.shape or param.dtype != torch.float32:
        return None
    value = saved.detach().to(device=param.device, dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        if bool(torch.equal(value.to(dtype).to(torch.float32), param.detach())):
            return value
    return None


class ContinuedWarning(UserWarning):
    """A float32 parameter continued from the master of a float16/bfloat16 run (``continues``)."""


CONTINUED_MESSAGE = (
    "{name} was float16 or bfloat16 when its checkpoint was saved and is float32 now (peft casts adapters to "
    "float32 when it loads them){more}: it continues from its saved float32 master, but trains as a float32 "
    "parameter from here, so the run will not equal one that kept it in float16. To keep it in float16, cast "
    "it back after the loads and before the first step (param.data = param.data.half(); its master and state "
    "are then restored exactly: docs/integrations.md, 'PEFT adapters')."
)


def warn_continued(names: list[str]) -> None:
    """One ``ContinuedWarning`` for the float32 parameters a binding continued from saved masters."""
    more = f", and {len(names) - 1} more parameters" if len(names) > 1 else ""
    warn(CONTINUED_MESSAGE.format(name=names[0], more=more), ContinuedWarning)


def same(a: Any, b: Any) -> bool:
    """Equal values: tensors bit for bit (on ``b``'s device), other values by ``==``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.to(b.device), b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


DCP_MESSAGE = (
    "Save and load optimizer.state_dict() itself beside model.state_dict() (it carries the masters and "
    "their float32 state; with FSDP2 each rank saves its own shards, e.g. "
    "torch.save(optimizer.state_dict(), f'optim.{rank}.pt')), or keep FSDP2's parameters in float32 and "
    "compute in float16 with fully_shard(model, "
    "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)), where no masters are needed and the "
    "distributed-checkpoint helpers work (docs/migration.md, 'Checkpoints'). "
    "torch.distributed.checkpoint.state_dict cannot name the optimizer's state under "
    "GradScaler(master_weights=True): the optimizer steps float32 masters, which are not parameters of "
    "the model, so get_optimizer_state_dict (and set_optimizer_state_dict) find no name for them (a bare "
    "KeyError)."
)
_DCP_MODULE = "torch.distributed.checkpoint.state_dict"


def _called_from_dcp() -> bool:
    """Whether torch's distributed-checkpoint helpers asked for the state dict, however many overrides of
    ``state_dict`` lie between (the whole stack is read: only at a save of an optimizer with masters)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == _DCP_MODULE:
            return True
        frame = frame.f_back
    return False


# optimizers a scaler with master weights has met while each of their float16/bfloat16 parameters was frozen (a
# warm-up: nothing to master yet, masters once unfrozen), weakly
_PENDING: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def pending(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` will step masters once its frozen float16/bfloat16 parameters are unfrozen: it counts as
    holding masters for ``holds_masters``."""
    _PENDING.add(optimizer)


def holds_masters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps a float32 master (bound or copied), holds a checkpoint's masters that wait
    for their binding, or is ``pending`` and still holds a float16/bfloat16 parameter."""
    groups = optimizer.param_groups
    if optimizer in _PENDING and low_params(optimizer):
        return True
    return any(SAVED_KEY in group or any(hasattr(p, PARAM_ATTR) for p in group["params"]) for group in groups)


_GUARD_ATTR = "_gradscaler_refuses_masters"


def guard_dcp() -> None:
    """Refuse torch's distributed-checkpoint helpers before they change anything: their
    ``_init_optim_state``, which both ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` call first,
    steps an optimizer that has neither state nor gradients with zero gradients at lr 0 (Adam's ``step``
    then counts a step no batch made) and clears the gradients, model's included. Put in front of it, once,
    when that module is loaded (``masters`` calls this at each move; importing it here would cost a second)."""
    module = sys.modules.get(_DCP_MODULE)
    init = getattr(module, "_init_optim_state", None)
    if init is None or getattr(init, _GUARD_ATTR, False):
        return

    @functools.wraps(init)
    def refusing(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if holds_masters(optim):
            raise ValueError(DCP_MESSAGE)
        return init(optim, *args, **kwargs)

    setattr(refusing, _GUARD_ATTR, True)
    module._init_optim_state = refusing  # type: ignore[union-attr]


def save_hook(
    value_of: Callable[[torch.Tensor], torch.Tensor | None],
    dtype_of: Callable[[torch.Tensor], torch.dtype | None],
) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    """The ``state_dict`` post-hook: each saved group gets its masters (``value_of(param)``: the value to save
    for a master, None for a parameter that is none), their float32 state and their parameters' dtypes
    (``dtype_of(param)``). ``ValueError`` (``DCP_MESSAGE``) when torch's distributed-checkpoint helpers ask,
    which would fail on the masters with a bare ``KeyError``."""

    def hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_state = state_dict["state"]
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
            # a loaded entry still waiting for its binding (a block frozen since before this binding) is saved
            # again as it was loaded: its parameter has no master yet, and its state here is torch's cast of it
            waiting = saved.get(SAVED_KEY) or {}
            masters: dict[int, torch.Tensor] = dict(waiting.get("masters", {}))
            state: dict[int, Any] = dict(waiting.get("state", {}))
            dtypes: dict[int, str] = dict(waiting.get("dtypes", {}))
            for index, (param, number) in enumerate(zip(group["params"], saved["params"], strict=True)):
                value = value_of(param)
                if value is not None:
                    masters[index] = value
                    state.pop(index, None)
                    dtypes.pop(index, None)
                    if number in saved_state:
                        state[index] = saved_state[number]  # the same tensors: torch.save writes them once
                    dtype = dtype_of(param)
                    if dtype is not None:
                        dtypes[index] = dtype_name(dtype)
            if masters:
                saved[SAVED_KEY] = {"masters": masters, "state": state, "dtypes": dtypes}
        if any(SAVED_KEY in saved for saved in state_dict["param_groups"]) and _called_from_dcp():
            raise ValueError(DCP_MESSAGE)
        return state_dict

    return hook


def load_hook(
    restore: Callable[[torch.Tensor, torch.Tensor], bool],
    unsaved: Callable[[list[torch.Tensor]], None],
    done: Callable[[], None],
) -> Callable[[torch.optim.Optimizer], None]:
    """The ``load_state_dict`` post-hook of a bound optimizer: its groups hold the masters already, so the
    loaded state kept float32 (with the checkpoint's float32 state where torch's copy was rounded:
    ``exact_state``); ``restore(param, saved value)`` for each saved master (False: ``param`` is no master; its
    saved entry stays in the group for the next binding); ``unsaved(params)`` with the optimizer's other
    parameters when the checkpoint carries masters (a gradscaler checkpoint: those had none when it was
    saved, so their masters were their values), with none when it carries no master; then ``done()``."""

    def hook(optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            carries = any(group.get(SAVED_KEY) for group in optimizer.param_groups)
            restored: set[int] = set()
            for group in optimizer.param_groups:
                saved = group.pop(SAVED_KEY, None)
                if not saved:
                    continue
                left = []
                for i, value in saved["masters"].items():
                    param = group["params"][i]
                    if not restore(param, value):
                        left.append(i)
                        continue
                    restored.add(id(param))
                    if param in optimizer.state:
                        optimizer.state[param] = exact_state(optimizer.state[param], saved.get("state", {}).get(i))
                if left:  # a parameter with no master yet (frozen before this binding): taken at the next move
                    state, dtypes = saved.get("state", {}), saved.get("dtypes", {})
                    group[SAVED_KEY] = {
                        "masters": {i: saved["masters"][i] for i in left},
                        "state": {i: state[i] for i in left if i in state},
                        "dtypes": {i: dtypes[i] for i in left if i in dtypes},
                    }
            others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in restored]
            unsaved(others if carries else [])
        done()

    return hook


def install_hooks(optimizer: torch.optim.Optimizer, save: Callable[..., Any], load: Callable[..., Any]) -> list[Any]:
    """Register ``save`` and ``load`` on ``optimizer`` in place of an earlier binding's (another scaler's:
    one binding steers); returns their handles."""
    for handle in vars(optimizer).pop(HOOKS_ATTR, []):
        handle.remove()
    handles = [optimizer.register_state_dict_post_hook(save), optimizer.register_load_state_dict_post_hook(load)]
    setattr(optimizer, HOOKS_ATTR, handles)
    return handles
