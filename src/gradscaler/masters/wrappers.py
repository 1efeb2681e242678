"""What ``master_weights=True`` puts around the user's objects so their own calls reach the masters.

* ``unwrap``: the optimizer an Accelerate or Lightning wrapper stands for (it shares its ``param_groups``).
* ``clip_grad_norm_``, ``clip_grad_value_``: torch's two clippings once gradients are in masters
  (``route_clipping`` installs them in ``torch.nn.utils``): a float16 parameter whose gradient a scaler
  moved (``route``) is clipped through its master, every other parameter as torch clips it.
* ``ZeroGradBoth``: a bound optimizer's ``zero_grad``, which also clears the float16/bfloat16 parameters'
  gradients (a backward writes them; the optimizer holds the masters).
* ``AddParamGroupChecked``: a bound optimizer's ``add_param_group``, which refuses a parameter its masters
  stand for as torch refuses one the optimizer holds.
"""

from __future__ import annotations

import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradscaler import compiled, grads
from gradscaler.masters import zeroing
from gradscaler.masters.checks import LOW_PRECISION, PARAM_ATTR

# id of a parameter a scaler's master stands for -> a weak reference to that master, for every scaler, kept
# while the master lives (made once, not at every move); ``_OPEN``: the ids among them whose gradient is in
# the master this iteration. ``stand_ins`` lets a clipping call over ``model.parameters()`` reach those
# masters. Keyed by id and weak on the master only: a weak reference to the parameter itself would make torch
# refuse to swap it (``torch.__future__.set_swap_module_params_on_conversion(True)``: "Cannot swap t1 because
# it has weakref").
_MOVED: dict[int, weakref.ReferenceType[torch.Tensor]] = {}
_OPEN: set[int] = set()
# the ids among the open ones of parameters that are not float16/bfloat16 (``model.float()`` on a bound model)
_WIDE: set[int] = set()
# how many times an entry of ``_MOVED`` was made or dropped: routes checked at the same count still hold
_CHANGES = [0]
torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
"""torch's own ``clip_grad_norm_``, as torch defines it."""
torch_clip_grad_value_ = torch.nn.utils.clip_grad_value_
"""torch's own ``clip_grad_value_``, as torch defines it."""


def route(low: torch.Tensor, master: torch.Tensor) -> None:
    """``low``'s gradient is now ``master``'s: a clipping over ``low`` clips ``master``."""
    key = id(low)
    _make(key, master)
    _OPEN.add(key)
    _mark_wide(key, low)


def _mark_wide(key: int, low: torch.Tensor) -> None:
    """Whether the open route of ``low`` (id ``key``) is of a parameter no longer float16/bfloat16 (``_WIDE``)."""
    if low.dtype in LOW_PRECISION:
        _WIDE.discard(key)
    else:
        _WIDE.add(key)


def _make(key: int, master: torch.Tensor) -> None:
    """The route of the parameter whose id is ``key`` leads to ``master`` (made once, while ``master`` lives)."""
    known = _MOVED.get(key)
    if known is None or known() is not master:

        def gone(ref: weakref.ReferenceType[torch.Tensor]) -> None:
            if _MOVED.get(key) is ref:
                del _MOVED[key]
                _CHANGES[0] += 1
                unroute(key)

        _MOVED[key] = weakref.ref(master, gone)
        _CHANGES[0] += 1


def open_routes(
    opened: list[Any], every: list[Any], keys: list[int], lows: list[torch.Tensor], checked: tuple[int, int]
) -> tuple[int, int]:
    """Route each of ``opened`` (pairs, each with its ``low`` parameter and its ``master``: those of a binding whose
    gradient moved into the master) and open their routes, as ``route`` for each. ``every``: the binding's
    pairs, ``keys`` and ``lows`` their parameters' ids and the parameters, ``checked`` what the last call
    returned: when every pair moved and no route changed anywhere since the routes were made for them all, they
    are not made again. Opening is set updates and a pass reading the dtypes, not a call per parameter. Returns
    ``checked`` for next time."""
    whole = len(opened) == len(every)
    pairs, ids = (every, keys) if whole else (opened, [id(pair.low) for pair in opened])
    if not whole or checked != (_CHANGES[0], len(every)):
        for pair in pairs:
            _make(id(pair.low), pair.master)
    _OPEN.update(ids)
    if set(map(grads.DTYPE, lows if whole else [pair.low for pair in opened])) <= set(LOW_PRECISION):
        if _WIDE:  # mostly empty: no pass over the ids
            _WIDE.difference_update(ids)
    else:  # ``p.data = p.data.float()`` after the backward: a float32 parameter whose gradient was float16
        for pair, key in zip(pairs, ids, strict=True):
            _mark_wide(key, pair.low)
    return (_CHANGES[0], len(every)) if whole else checked


def close_routes(keys: list[int]) -> None:
    """The iteration of the parameters whose ids are ``keys`` is over: a clipping over them clips them again."""
    _OPEN.difference_update(keys)
    if _WIDE:
        _WIDE.difference_update(keys)


def unroute(key: int) -> None:
    """The iteration of the parameter whose id is ``key`` is over: a clipping over it clips it again."""
    _OPEN.discard(key)
    _WIDE.discard(key)


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    key = id(param)
    ref = _MOVED.get(key) if key in _OPEN else None
    master = None if ref is None else ref()
    return master if master is not None and getattr(master, PARAM_ATTR, None) is param else param


@compiled.eager  # a dictionary of weak references, which Dynamo skips: one break, only with routed parameters
def stand_ins(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` with each parameter whose gradient a scaler has moved this iteration replaced by its
    master (whose gradient is the one the optimizer steps with)."""
    return [_stand_in(p) for p in params]


def _routed(parameters: Any) -> list[torch.Tensor]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if _WIDE or any(p.dtype in LOW_PRECISION for p in params):  # _WIDE: a bound model cast to float32
        params = stand_ins(params)
    return params


def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` once a scaler with masters has moved gradients: float16
    parameters whose gradients are in float32 masters are clipped through those masters
    (``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` as in torch's
    recipe, nanoGPT, Accelerate and the HF Trainer); every other parameter as torch clips it. Without
    a low-precision parameter it is torch's call, traced as such in compiled code."""
    return torch_clip_grad_norm_(_routed(parameters), *args, **kwargs)


def clip_grad_value_(parameters: Any, *args: Any, **kwargs: Any) -> None:
    """``torch.nn.utils.clip_grad_value_`` routed as ``clip_grad_norm_`` is: the gradients of float16
    parameters that are in float32 masters are clamped there (with ``accumulate_grads_in_fp32`` the
    parameters hold none, and torch's call over ``model.parameters()`` would clip nothing)."""
    torch_clip_grad_value_(_routed(parameters), *args, **kwargs)


ROUTED_CLIPPING = {
    "clip_grad_norm_": (torch_clip_grad_norm_, clip_grad_norm_),
    "clip_grad_value_": (torch_clip_grad_value_, clip_grad_value_),
}
"""The name in ``torch.nn.utils`` -> (torch's function, the routed one ``route_clipping`` installs)."""


def route_clipping() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` reach the masters unless someone
    else rebound them. Without it, clipping ``model.parameters()`` after ``unscale_`` would write float16
    gradients the step does not read (refused at ``step``) or, accumulating in float32, find none."""
    for name, (torchs, routed) in ROUTED_CLIPPING.items():
        if getattr(torch.nn.utils, name) is torchs:
            setattr(torch.nn.utils, name, routed)


def bound_clipping() -> list[tuple[str, str, str]]:
    """(module, name, torch's function) for each global name that a module on the caller's stack (torch's and
    gradscaler's aside) binds to torch's own ``clip_grad_norm_`` or ``clip_grad_value_``: a from-import made
    before ``route_clipping``, which that name does not see."""
    originals = {id(torchs): name for name, (torchs, _) in ROUTED_CLIPPING.items()}
    found: list[tuple[str, str, str]] = []
    seen: set[int] = set()
    frame = sys._getframe(1)
    while frame is not None:
        names = frame.f_globals
        module = str(names.get("__name__", "?"))
        if id(names) not in seen and module.partition(".")[0] not in ("torch", "gradscaler"):
            seen.add(id(names))
            found += [(module, key, originals[id(value)]) for key, value in names.items() if id(value) in originals]
        frame = frame.f_back  # type: ignore[assignment]
    return found


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


class ZeroGradBoth:
    """``optimizer.zero_grad`` of a bound optimizer: torch's, then the same for the float16/bfloat16
    parameters its masters stand for (``lows()``), whose gradients a backward writes and the optimizer
    no longer holds.

    Installed on the instance (``Optimizer.__getstate__`` leaves it out of pickles and deep copies,
    which bind afresh); holds the optimizer weakly."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lows: Callable[[], Iterable[torch.Tensor]],
        zeroed: Callable[[bool], None] | None = None,
    ) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._lows = lows
        self._zeroed = zeroed  # told after zeroing, with set_to_none (the kept gradients, the held sums)

    @compiled.eager  # torch's zero_grad, which it calls, is one Dynamo skips too
    def __call__(self, set_to_none: bool = True) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        type(optimizer).zero_grad(optimizer, set_to_none)
        lows = list(self._lows())
        zeroing.clear_waiting(lows, set_to_none)
        held = list(map(grads.GRAD, lows))
        if any(map(operator.is_not, held, itertools.repeat(None))):  # after a step: none, read in one C-level pass
            for low, grad in zip(lows, held, strict=True):
                if grad is None:
                    continue
                if set_to_none:
                    low.grad = None
                    continue
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()
        if self._zeroed is not None:
            self._zeroed(set_to_none)


class AddParamGroupChecked:
    """``optimizer.add_param_group`` of a bound optimizer: torch's, after refusing a group that holds a
    parameter a master of ``optimizer`` already stands for, as torch refuses one it holds (same error,
    nothing added). torch cannot see it: the groups hold the master, not the parameter.

    Installed on the instance like ``ZeroGradBoth``; holds the optimizer weakly. ``added`` is told the
    new group's parameters (``accumulate``: hooked before their first backward)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lows: Callable[[], Iterable[torch.Tensor]],
        added: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._lows = lows
        # weakly: a scaler dropped leaves its hooks dead (a new scaler over the optimizer binds it afresh)
        self._added = None if added is None else weakref.WeakMethod(added)  # type: ignore[arg-type]

    def __call__(self, param_group: dict[str, Any]) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = param_group["params"] = [params]
        elif params is None or isinstance(params, set):  # torch refuses a set (and a group without params)
            params = []
        else:  # read once, here, as torch would read an iterator
            params = param_group["params"] = list(params)
        held = {id(low) for low in self._lows()}
        if any(id(_tensor_of(p)) in held for p in params):
            raise ValueError("some parameters appear in more than one parameter group")  # torch's message
        type(optimizer).add_param_group(optimizer, param_group)
        added = None if self._added is None else self._added()
        if added is not None:
            added([_tensor_of(p) for p in params])


def _tensor_of(entry: Any) -> Any:
    """A group's entry as torch reads it: a parameter, or a ``(name, parameter)`` pair (named groups)."""
    return entry[1] if isinstance(entry, tuple) else entry
