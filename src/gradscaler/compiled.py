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
Called eagerly (no compiler watching the thread's frames, the usual loop), an ``eager`` method calls the
function itself: torch's wrapper would set and restore Dynamo's frame callback around every call, about
a microsecond and a half a call, four calls a step. docs/migration.md ("torch.compile") lists the breaks
and their reasons.
"""

from __future__ import annotations

import functools
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
            recursive = getattr(method, _MARK) == "eager"
            try:
                wrapped = torch.compiler.disable(method, recursive=recursive, **why)
            except Exception:  # torch._dynamo failed to import: nothing compiles in this process
                return
            setattr(owner, name, _direct_when_eager(method, wrapped) if recursive else wrapped)
            _unapplied.pop()


def _direct_when_eager(method: F, disabled: F) -> F:
    """``disabled`` (``method`` under ``torch.compiler.disable``) as Dynamo sees it, calling ``method`` itself
    while Dynamo's frame callback is unset in this thread (no compiled code is running: the call comes
    from eager code), ``disabled`` otherwise (eager code that a compiled frame resumed after its break:
    the callback is set, and would compile the method's frames). Traced, it is ``disabled``: Dynamo reads
    the same marks and breaks the graph at the call. Without the Dynamo internals this needs, ``disabled``
    itself (``_dynamo_internals``)."""
    internals = _dynamo_internals()
    if internals is None:
        return disabled
    get_eval_frame_callback, skip_code = internals

    def eager(*args: Any, **kwargs: Any) -> Any:
        if get_eval_frame_callback() is None:
            return method(*args, **kwargs)
        return disabled(*args, **kwargs)

    skip_code(eager.__code__)  # with the callback set, this frame runs as it is, never compiled
    functools.update_wrapper(eager, method)
    for mark, value in vars(disabled).items():
        if mark.startswith("_torchdynamo"):
            setattr(eager, mark, value)
    eager._torchdynamo_wrapper_id = id(eager)  # type: ignore[attr-defined]  # unwrapped to ``method``
    return eager  # type: ignore[return-value]


FIRST_SOUND_READER = "2.8"
"""The first torch whose ``get_eval_frame_callback`` returns a new reference: 2.6 and 2.7 return a borrowed one,
and each call then takes one reference from the callback (None in an eager loop, freed after some 26,000 steps
on Python 3.11; Dynamo's callback in a compiled one, a crash at the first step); 2.4 and 2.5 have no such
function."""


def _dynamo_internals() -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """What ``_direct_when_eager`` needs of Dynamo, where torch has it sound: ``get_eval_frame_callback`` (this
    thread's frame callback) and ``skip_code`` (a code object whose frames Dynamo runs as they are)."""
    if torch.torch_version.TorchVersion(torch.__version__) < FIRST_SOUND_READER:
        return None
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    return get_eval_frame_callback, skip_code
