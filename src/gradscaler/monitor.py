"""Host-side reporting for one scaler: loggers, parameter names, overflow attribution, collapse detection.

``telemetry`` keeps the device counters; this module decides what to tell the user about them. A
``Monitor`` is fed values by its scaler (counters that have landed on the host, the optimizers of
the last iteration, the clipping pass's norms) and never sees the scaler itself.
"""

from __future__ import annotations

import copy
import json
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler.errors import COLLAPSE_CAUSES, ScaleCollapseError, ScaleCollapseWarning
from gradscaler.grads import WeakById, checkable_view
from gradscaler.rule import INT64_MAX

Logger = Callable[[dict[str, Any]], None]
NormRecord = tuple[list[torch.Tensor], torch.Tensor]
"""Parameters of one device and the norms of their unscaled gradients (1-d, on the device)."""

ON_COLLAPSE = ("raise", "warn")
SHOWN_NAMES = 20


class Monitor:
    """What one scaler reports, and the host-side state it needs to do so.

    ``steps`` counts completed ``update()`` calls. Loggers, parameter names, the last iteration's
    optimizers (weak references) and the clipping norms are per process: pickling drops them,
    ``copy.deepcopy`` keeps them (see ``__getstate__`` and ``__deepcopy__``). Names and norms are
    keyed weakly by the parameter and the optimizer themselves: they keep nothing alive, and go with
    their key (a new object at a dead one's address inherits nothing).
    """

    def __init__(self, collapse_patience: int | None = 50, on_collapse: str = "raise", steps: int = 0) -> None:
        if on_collapse not in ON_COLLAPSE:
            raise ValueError(f"on_collapse must be 'raise' or 'warn', got {on_collapse!r}.")
        if collapse_patience is not None and (
            isinstance(collapse_patience, bool) or not isinstance(collapse_patience, int) or collapse_patience < 1
        ):
            raise ValueError(f"collapse_patience must be an int >= 1 or None, got {collapse_patience!r}.")
        self.collapse_patience = collapse_patience
        self.on_collapse = on_collapse
        self.steps = steps
        self.loggers: list[tuple[Logger, int]] = []
        self.param_names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> name
        self.grad_norms: WeakById[list[NormRecord]] = WeakById()  # by optimizer
        self.last_optimizers: list[weakref.ReferenceType[torch.optim.Optimizer]] = []
        self._collapse_reported_at = -1

    @property
    def wants_counters(self) -> bool:
        """Whether ``after_update`` has anything to do with landed counters."""
        return bool(self.loggers) or self.collapse_patience is not None

    def add_logger(self, callback: Logger, every: int = 1) -> None:
        """Call ``callback(record)`` every ``every`` updates (see ``GradScaler.add_logger``)."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}.")
        self.loggers.append((callback, every))

    def name_parameters(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Remember ``name`` for each ``(name, parameter)``."""
        for name, param in pairs:
            self.param_names[param] = name

    def label(self, param: torch.Tensor, where: str) -> str:
        """The parameter's name, or ``where`` and its shape when it was never named."""
        return self.param_names.get(param) or f"{where} {tuple(param.shape)}"

    def record_update(self, optimizers: list[weakref.ReferenceType[torch.optim.Optimizer]]) -> None:
        """Count one completed update and remember its optimizers for attribution."""
        if self.steps < INT64_MAX:  # saturates: a state dict keeps a loadable count after any number of steps
            self.steps += 1
        self.last_optimizers = optimizers

    def after_update(self, landed: dict[str, Any] | None) -> None:
        """Feed loggers and detect collapse from counters that have landed on the host (no sync).

        Raises ``ScaleCollapseError`` (or warns) once per collapse, after ``collapse_patience``
        consecutive overflowing steps at the minimum scale.
        """
        if landed is None:
            return
        for callback, every in self.loggers:
            if self.steps % every == 0:
                callback({"step": self.steps, **landed})
        run = landed["collapse_run"]
        if self.collapse_patience is None or run < self.collapse_patience:
            self._collapse_reported_at = -1
            return
        if self._collapse_reported_at >= 0:
            return
        self._collapse_reported_at = self.steps
        message = self._collapse_message(run, landed["scale"])
        if self.on_collapse == "raise":
            raise ScaleCollapseError(message)
        warnings.warn(message, ScaleCollapseWarning, stacklevel=4)

    def _collapse_message(self, run: int, scale: float) -> str:
        names = self.nonfinite_parameters()
        shown = ", ".join(names[:SHOWN_NAMES])
        if len(names) > SHOWN_NAMES:
            shown += f" and {len(names) - SHOWN_NAMES} more"
        return (
            f"Loss scale collapsed at step {self.steps}: {run} consecutive overflowing steps at the minimum "
            f"scale {scale:g}; every one of them was skipped. Parameters with non-finite gradients "
            f"now: {shown or 'none (the gradients of the current step are finite)'}. {COLLAPSE_CAUSES} "
            "Call scaler.name_parameters(model) for names; pass on_collapse='warn' or collapse_patience=None "
            "to keep training."
        )

    def nonfinite_parameters(self) -> list[str]:
        """Names of the last iteration's parameters whose gradients hold inf or NaN (one sync)."""
        labelled: list[tuple[str, torch.Tensor]] = []
        for ref in self.last_optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            for gi, group in enumerate(optimizer.param_groups):
                for pi, param in enumerate(group["params"]):
                    if param.grad is None:
                        continue
                    finite = torch.isfinite(checkable_view(param.grad)).all()
                    labelled.append((self.label(param, f"param_groups[{gi}][{pi}]"), finite.logical_not().cpu()))
        if not labelled:
            return []
        bad = torch.stack([flag for _, flag in labelled]).tolist()
        return [name for (name, _), is_bad in zip(labelled, bad, strict=True) if is_bad]

    def last_grad_norms(self) -> dict[str, float]:
        """Unscaled per-parameter norms recorded by the last clipping pass of each optimizer (one sync)."""
        out: dict[str, float] = {}
        for records in self.grad_norms.values():
            for params, norms in records:
                values = norms.tolist()
                labels = [self.label(p, f"parameter {i}") for i, p in enumerate(params)]
                out.update(zip(labels, values, strict=True))
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(loggers=[], param_names=None, grad_norms=None, last_optimizers=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, param_names=WeakIdKeyDictionary(), grad_norms=WeakById())

    def __deepcopy__(self, memo: dict[int, Any]) -> Monitor:
        """A copy that keeps loggers (the same callbacks) and parameter names, unlike a pickle."""
        new = copy.copy(self)
        new.loggers = list(self.loggers)
        new.param_names = WeakIdKeyDictionary(self.param_names)
        new.grad_norms = WeakById()
        new.last_optimizers = []
        return new


class JsonLinesLogger:
    """A ``GradScaler.add_logger`` callback that appends one JSON object per call to ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
