"""The scaler inside ``torch.compile``: what Dynamo traces of it and what runs eagerly, on purpose.

Dynamo skips torch's ``GradScaler`` (its methods run eagerly: one graph break per call, and nothing it
reads becomes a guard), but traces gradscaler like user code. Traced, the scaler's host reads
(``.item()``), its Python containers and its per-step Python numbers would break graphs at places
nobody chose, and every new scale or clipping norm read as a number would be a guard that fails: a
recompile, and after ``torch._dynamo.config.recompile_limit`` of them, a frame left eager for good.
So each public method of ``GradScaler`` is marked with one decision, here:

- ``eager``: called from code Dynamo traces, the method runs eagerly, and so does all it calls
  (``torch.compiler.disable``): one graph break at the call, as torch's scaler makes, and no guard on
  anything it reads.
- ``eager_frame``: Dynamo skips the method's own frame but compiles the frames it calls: ``step``,
  whose frame only calls its ``eager`` halves and, between them, ``optimizer.step``, which Dynamo
  then compiles as it compiles the optimizer step torch's skipped ``step`` calls (the two scalers
  step with the same compiled kernels).

Unmarked methods (``get_growth_factor``, ``is_enabled``, ...) read settings only and are traced.
``torch.compiler.disable`` imports ``torch._dynamo`` (over a second), so ``prepare`` applies the marks,
wherever in the package they sit, when the first scaler is made, before any step can be traced, not
when ``gradscaler`` is imported.
Called eagerly, a marked method costs under a microsecond more. docs/migration.md ("torch.compile")
lists the breaks and their reasons.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

REASON = "gradscaler's bookkeeping runs eagerly in compiled code, as torch's GradScaler does (docs/migration.md)"
_MARK = "_gradscaler_compile"
_unapplied: list[Callable[..., Any]] = []  # marked functions not yet replaced where they are defined
_lock = threading.Lock()


def _marked(method: F, how: str) -> F:
    if "<locals>" in method.__qualname__:
        raise ValueError(f"{method.__qualname__}: only a module's functions and its classes' methods can be marked")
    setattr(method, _MARK, how)
    _unapplied.append(method)
    return method


def eager(method: F) -> F:
    """Mark ``method`` to run eagerly, with everything it calls, when called from traced code."""
    return _marked(method, "eager")


def eager_frame(method: F) -> F:
    """Mark ``method``'s own frame to run eagerly; the frames it calls are Dynamo's as usual."""
    return _marked(method, "frame")


def prepare() -> None:
    """Replace every marked function not yet replaced, in the module or class that defines it (found
    from its ``__module__`` and ``__qualname__``), by its ``torch.compiler.disable`` wrapper. Without
    Dynamo (a Python that ``torch._dynamo`` refuses) nothing can be traced, and they stay as they are."""
    with _lock:
        # an older torch (2.4) takes no ``reason``: leave the word out, not the marks
        why = (
            {"reason": REASON}
            if _unapplied and "reason" in inspect.signature(torch.compiler.disable).parameters
            else {}
        )
        while _unapplied:
            method = _unapplied[-1]
            owner: Any = sys.modules[method.__module__]
            *path, name = method.__qualname__.split(".")
            for part in path:
                owner = getattr(owner, part)
            try:
                wrapped = torch.compiler.disable(method, recursive=getattr(method, _MARK) == "eager", **why)
            except Exception:  # torch._dynamo failed to import: nothing compiles in this process
                return
            setattr(owner, name, wrapped)
            _unapplied.pop()
