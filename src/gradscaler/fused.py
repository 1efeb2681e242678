"""The fused-optimizer protocol: how a scaler hands ``grad_scale`` and ``found_inf`` to an optimizer;
and ``Step``, one ``scaler.step`` between its two halves, for every optimizer.

An optimizer with ``_step_supports_amp_scaling = True`` (torch's Adam, AdamW, SGD and Adagrad with
``fused=True``) divides gradients by ``optimizer.grad_scale`` inside its own kernel and skips the update
where ``optimizer.found_inf`` is nonzero, with no host sync. Older optimizers instead accept a
``grad_scaler`` keyword argument in ``step`` (deprecated by torch, still honoured with its warning).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch

from gradscaler.errors import warn
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
    warn(LEGACY_KWARG_WARNING, FutureWarning)


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


class Step:
    """One ``step`` of one optimizer, between its two halves: the call to make (``fn(*args, **kwargs)``,
    none when skipped) and its ``result``, and what ``_end_step`` needs.

    ``record``: the scaler's record of the optimizer this iteration, None for a disabled scaler.
    ``stepped``: whether the masters copy back (True for a call made, a fused optimizer's included;
    None: the subclass's ``_maybe_opt_step`` decided, read from the flag afterwards). ``fresh``: the
    parameters a fused optimizer's first step gives state to; ``handed_over``: ``grad_scale`` and
    ``found_inf`` set on the optimizer for its kernel (``hand_over``, ``take_back``).
    """

    __slots__ = ("args", "fn", "fresh", "handed_over", "kwargs", "optimizer", "record", "result", "stepped")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        record: Any,
        fn: Callable[..., Any] | None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        stepped: bool | None = True,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = {} if kwargs is None else kwargs
        self.result: Any = None
        self.optimizer = optimizer
        self.record = record
        self.stepped = stepped
        self.fresh: list[torch.Tensor] = []
        self.handed_over = False


def grad_scale_for(
    optimizer: torch.optim.Optimizer, clipped: torch.Tensor | None, unscaled: bool, scale: torch.Tensor | None
) -> torch.Tensor | None:
    """The ``grad_scale`` a fused optimizer's kernel divides by: ``clipped`` (the scale over the clipping
    coefficient) when clipping set one; after ``unscale_`` (``unscaled``) the optimizer's own, if any;
    else the scale, times a multiplier the user set as ``optimizer.grad_scale`` (torch honours it)."""
    if clipped is not None:
        return clipped
    theirs = getattr(optimizer, "grad_scale", None)
    if unscaled:
        return theirs
    assert scale is not None
    return scale if theirs is None else scale * theirs


def hand_over(step: Step, params: list[torch.Tensor], grad_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
    """Set ``grad_scale`` and ``found_inf`` on ``step``'s optimizer for its kernel, and note the
    parameters (of ``params``, the optimizer's) whose first state this step creates (``take_back``)."""
    optimizer = step.optimizer
    if has_fresh_state(optimizer, params):
        step.fresh = params_without_state(optimizer)
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    step.handed_over = True


def take_back(step: Step, found_inf: torch.Tensor) -> None:
    """After the fused step (also one that raised after its kernel ran): remove what ``hand_over`` set,
    and drop the state a skipped first step created (one host read, on a parameter's first step only)."""
    if not step.handed_over:
        return
    optimizer = step.optimizer
    del optimizer.grad_scale  # type: ignore[attr-defined]
    del optimizer.found_inf  # type: ignore[attr-defined]
    if step.fresh and found_inf.item():
        forget_new_state(optimizer, step.fresh)
