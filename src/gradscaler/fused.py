"""The fused-optimizer protocol: how a scaler hands ``grad_scale`` and ``found_inf`` to an optimizer.

An optimizer with ``_step_supports_amp_scaling = True`` (torch's Adam, AdamW, SGD and Adagrad with
``fused=True``) divides gradients by ``optimizer.grad_scale`` inside its own kernel and skips the update
where ``optimizer.found_inf`` is nonzero, with no host sync. Older optimizers instead accept a
``grad_scaler`` keyword argument in ``step`` (deprecated by torch, still honoured with its warning).
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any

import torch

from gradscaler.grads import iter_params

LEGACY_KWARG_WARNING = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed "
    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly."
)

# One entry per distinct optimizer class's ``step`` function: bounded by the classes a program defines.
_LEGACY_CACHE: dict[Any, bool] = {}


def supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales and skips inside its own step (the fused protocol)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def takes_grad_scaler_kwarg(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has the legacy ``grad_scaler`` parameter (cached per step function)."""
    step = getattr(type(optimizer), "step", None) or optimizer.step
    cached = _LEGACY_CACHE.get(step)
    if cached is None:
        cached = "grad_scaler" in inspect.signature(optimizer.step).parameters
        _LEGACY_CACHE[step] = cached
    return cached


def warn_legacy_kwarg() -> None:
    """torch's FutureWarning for the ``grad_scaler`` keyword, verbatim."""
    warnings.warn(LEGACY_KWARG_WARNING, FutureWarning, stacklevel=3)


def has_fresh_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether some parameter with a gradient has no optimizer state yet (its first step is next).

    ``params``: the optimizer's parameters. A fused step that is skipped on a parameter's first step
    still lets the optimizer create state, and torch's fused SGD leaves that state (momentum buffers)
    uninitialised. See ``forget_new_state``. Every parameter must be a key, not just as many states
    as parameters: the state of a parameter swapped out of the optimizer may still be held. C-level
    passes only (a tensor's ``__hash__`` is a Python call: ``state.get`` per parameter costs 3x more).
    """
    state = optimizer.state
    # As many non-empty states as parameters, and every parameter a key: states are created in
    # parameter order, so the keys begin with the parameters (else compare the sets of ids).
    if (
        len(state) >= len(params)
        and all(state.values())
        and (all(map(operator.is_, state, params)) or set(map(id, params)) <= set(map(id, state)))
    ):
        return False
    return bool(params_without_state(optimizer))


def params_without_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters with a gradient that have no optimizer state yet."""
    state = optimizer.state
    return [p for p in iter_params(optimizer) if p.grad is not None and not state.get(p)]


def forget_new_state(optimizer: torch.optim.Optimizer, fresh: list[torch.Tensor]) -> None:
    """Drop the state a skipped step created for ``fresh`` parameters, as if it had never run.

    Their next real step then initialises state from scratch, whatever the skipped kernel left
    behind (torch's fused SGD allocates momentum buffers uninitialised and returns early on
    ``found_inf``; reading them later corrupts the weights).
    """
    for param in fresh:
        optimizer.state.pop(param, None)
