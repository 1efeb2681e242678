"""torch's ``zero_grad`` reaching the gradients that float32 sums keep outside ``p.grad``.

With float32 gradient sums a float16/bfloat16 parameter's ``p.grad`` is None after every backward: its
gradient is in its hook (``sums.Sum``) until its master is bound, then in the master's ``.grad``. torch's
``zero_grad`` clears ``p.grad`` only, so two of torch's methods are wrapped, once such gradients exist, to
clear them as the recipe by hand clears its float32 copies:

* ``Optimizer.zero_grad`` clears the sums hooks hold for the optimizer's parameters (``waiting``): a scaler's
  first iteration, before it binds them (G's backward through D leaves sums in D's hooks, which D's
  ``zero_grad`` clears), and a group added to a bound optimizer since its last move. A bound optimizer's
  masters are its own parameters, which torch's method clears.
* ``Module.zero_grad`` clears the masters of ``with_master_weights`` (``held``), which hold the gradients of
  the module's parameters from the wrap on (the HF Trainer clears with ``model.zero_grad()``). A scaler's
  masters are cleared by their optimizer's ``zero_grad`` and started afresh at each move, as the recipe's.

Both registries are keyed by the parameter's id (no reference to a parameter: torch's ``swap_tensors``
refuses a weakly referenced one) and hold their values weakly. An optimizer class that overrides
``zero_grad`` without calling torch's is not reached (docs/migration.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from gradscaler import compiled
from gradscaler.masters.checks import PARAM_ATTR


class Waiting(Protocol):
    """A sum held by a hook: ``clear`` as a ``zero_grad`` does (None, or zeros the next gradient adds to)."""

    def clear(self, set_to_none: bool) -> None: ...


# id of a parameter whose hook holds a sum before its binding -> that hook (``sums.Sum``), weakly
_WAITING: dict[int, weakref.ReferenceType[Any]] = {}
# id of a parameter whose gradient a master of ``with_master_weights`` holds -> that master, weakly
_HELD: dict[int, weakref.ReferenceType[torch.Tensor]] = {}

_module_zero_grad = torch.nn.Module.zero_grad
"""torch's own ``Module.zero_grad``."""
_optimizer_zero_grad = torch.optim.Optimizer.zero_grad
"""torch's own ``Optimizer.zero_grad``."""


def _enter(table: dict[int, Any], key: int, value: Any) -> None:
    def gone(ref: weakref.ReferenceType[Any], key: int = key) -> None:
        if table.get(key) is ref:
            del table[key]

    table[key] = weakref.ref(value, gone)


def waiting(param: torch.Tensor, found: Waiting) -> None:
    """``found``, ``param``'s hook, holds a sum before ``param`` is bound: ``optimizer.zero_grad()`` clears it."""
    _enter(_WAITING, id(param), found)
    if torch.optim.Optimizer.zero_grad is _optimizer_zero_grad:
        torch.optim.Optimizer.zero_grad = _zero_grad_optimizer  # type: ignore[method-assign]


def held(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (parameter, master) of ``with_master_weights``: ``model.zero_grad()`` clears the master's gradient."""
    for low, master in pairs:
        _enter(_HELD, id(low), master)
    if torch.nn.Module.zero_grad is _module_zero_grad:
        torch.nn.Module.zero_grad = _zero_grad_module  # type: ignore[method-assign]


@compiled.eager  # torch's, which it calls, is one Dynamo skips too
def _zero_grad_optimizer(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``torch.optim.Optimizer.zero_grad`` once a hook held a sum before its binding: torch's, then the sums
    hooks hold for this optimizer's parameters."""
    _optimizer_zero_grad(self, set_to_none)
    if _WAITING:
        clear_waiting((param for group in self.param_groups for param in group["params"]), set_to_none)


def clear_waiting(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """The sums hooks hold for ``params`` cleared as a ``zero_grad`` clears gradients (a bound optimizer's
    ``zero_grad`` calls it for the parameters its masters stand for: another scaler's graph may have
    hooked them)."""
    if not _WAITING:
        return
    for param in params:
        ref = _WAITING.get(id(param))
        found = None if ref is None else ref()
        if found is not None:
            found.clear(set_to_none)


def _zero_grad_module(self: torch.nn.Module, set_to_none: bool = True) -> None:
    """``torch.nn.Module.zero_grad`` while an optimizer has masters from ``with_master_weights``: torch's, then
    the same for the masters' float32 sums of this module's parameters (their ``.grad`` is None: the sums
    are the gradients ``model.zero_grad()`` means to clear)."""
    _module_zero_grad(self, set_to_none)
    if not _HELD:
        return
    for param in self.parameters():
        ref = _HELD.get(id(param))
        master = None if ref is None else ref()
        if master is None or master.grad is None or getattr(master, PARAM_ATTR, None) is not param:
            continue
        if set_to_none:
            master.grad = None
        else:
            master.grad.requires_grad_(False)
            master.grad.zero_()
