"""Make every spelling of torch's GradScaler build gradscaler's, for third-party code you do not edit.

``patch_torch()`` replaces the class that each of these names refers to::

    torch.amp.GradScaler, torch.amp.grad_scaler.GradScaler, torch.GradScaler  -> gradscaler.GradScaler
    torch.cuda.amp.GradScaler, torch.cuda.amp.grad_scaler.GradScaler         -> CudaAmpGradScaler
    torch.cpu.amp.GradScaler, torch.cpu.amp.grad_scaler.GradScaler           -> CpuAmpGradScaler

so that a training script, Hugging Face Accelerate / Trainer, Lightning, timm's ``NativeScaler`` or
nanoGPT's ``train.py`` builds gradscaler's scaler where it calls one of these names, with the same
arguments. ``unpatch_torch()`` (or leaving the ``with`` block) puts torch's own classes back, the very
same objects. Patching twice is patching once.

Only calls made *while patched* are affected: a module that ran ``from torch.amp import GradScaler``
before the patch keeps torch's class in its own namespace, and a scaler built before the patch stays
torch's. Patch first, then import and build the training code.
"""

from __future__ import annotations

import copyreg
import importlib
import threading
import weakref
from types import TracebackType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradscaler import masters
from gradscaler.errors import warn
from gradscaler.scaler import GradScaler

__all__ = ["CpuAmpGradScaler", "CudaAmpGradScaler", "TorchPatch", "is_torch_patched", "patch_torch", "unpatch_torch"]

_CUDA_DEPRECATION = (
    "`torch.cuda.amp.GradScaler(args...)` is deprecated. Please use `torch.amp.GradScaler('cuda', args...)` instead."
)
_CPU_DEPRECATION = (
    "`torch.cpu.amp.GradScaler(args...)` is deprecated. Please use `torch.amp.GradScaler('cpu', args...)` instead."
)


class _DevicelessSpelling(GradScaler):
    """torch's device-less constructor (``torch.cuda.amp`` / ``torch.cpu.amp``) on a fixed device."""

    _spelled_device = "cuda"
    _deprecation = ""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        **options: Any,
    ) -> None:
        warn(self._deprecation, FutureWarning)
        device = self._spelled_device
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **options)


class CudaAmpGradScaler(_DevicelessSpelling):
    """What ``torch.cuda.amp.GradScaler`` builds while patched: gradscaler's scaler on ``"cuda"``.

    Takes torch's ``torch.cuda.amp.GradScaler`` arguments (no device) and warns torch's
    ``FutureWarning`` about that spelling, as torch does; gradscaler's keyword-only options
    (``hysteresis=``, ``min_scale=``, ...) are accepted too. Without CUDA it warns and disables itself,
    as torch's does.
    """

    _spelled_device = "cuda"
    _deprecation = _CUDA_DEPRECATION
    _torch_class = torch.cuda.amp.GradScaler  # torch's, captured at import (before any patch)


class CpuAmpGradScaler(_DevicelessSpelling):
    """What ``torch.cpu.amp.GradScaler`` builds while patched: gradscaler's scaler on ``"cpu"``.

    Takes torch's ``torch.cpu.amp.GradScaler`` arguments (no device) and warns torch's
    ``FutureWarning`` about that spelling; gradscaler's keyword-only options are accepted too.
    """

    _spelled_device = "cpu"
    _deprecation = _CPU_DEPRECATION
    _torch_class = torch.cpu.amp.GradScaler


# (module, attribute, replacement): every place torch binds a GradScaler class under a public name.
_SPELLINGS: tuple[tuple[str, str, type], ...] = (
    ("torch", "GradScaler", GradScaler),
    ("torch.amp", "GradScaler", GradScaler),
    ("torch.amp.grad_scaler", "GradScaler", GradScaler),
    ("torch.cuda.amp", "GradScaler", CudaAmpGradScaler),
    ("torch.cuda.amp.grad_scaler", "GradScaler", CudaAmpGradScaler),
    ("torch.cpu.amp", "GradScaler", CpuAmpGradScaler),
    ("torch.cpu.amp.grad_scaler", "GradScaler", CpuAmpGradScaler),
)
# torch modules that subclass torch's GradScaler when first imported: imported before patching so that
# they subclass torch's class, not ours.
_SUBCLASSING_MODULES = ("torch.distributed.fsdp.sharded_grad_scaler",)

_lock = threading.Lock()
_originals: dict[tuple[str, str], Any] | None = None
_installed: dict[tuple[str, str], Any] = {}


def _with_master_weights(base: type, accumulate: bool = False) -> type:
    """``base`` building its scalers with ``master_weights=True`` (and, with ``accumulate``,
    ``accumulate_grads_in_fp32=True``) unless told otherwise."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("master_weights", True)
        if accumulate:
            kwargs.setdefault("accumulate_grads_in_fp32", True)
        super(variant, self).__init__(*args, **kwargs)  # type: ignore[arg-type]

    variant = type(base.__name__, (base,), {"__init__": __init__, "__doc__": base.__doc__, "__module__": __name__})
    return variant


_MASTER_VARIANTS: dict[tuple[type, bool], type] = {
    (cls, accumulate): _with_master_weights(cls, accumulate)
    for cls in (GradScaler, CudaAmpGradScaler, CpuAmpGradScaler)
    for accumulate in (False, True)
}


def _rebuild_torch_scaler(module_name: str, name: str, state: dict[str, Any]) -> Any:
    """Unpickle a scaler of torch's own class pickled while patched: torch's class again, patched or not."""
    cls = getattr(importlib.import_module(module_name), name)
    cls = getattr(cls, "_torch_class", cls)  # patched: the name holds our class, which knows torch's
    scaler = cls.__new__(cls)
    scaler.__setstate__(state)
    return scaler


def _reduce_torch_scaler(scaler: Any) -> tuple[Any, ...]:
    # While patched, pickle's by-name look-up of torch's class finds ours and refuses ("not the same
    # object"): torch's scalers are pickled through _rebuild_torch_scaler instead (copyreg).
    cls = type(scaler)
    return (_rebuild_torch_scaler, (cls.__module__, cls.__qualname__, scaler.__getstate__()))


def _spellings() -> list[tuple[Any, str, str, type]]:
    found = []
    for module_name, attr, replacement in _SPELLINGS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - a torch build without that module
            continue
        if hasattr(module, attr):  # torch.GradScaler exists from torch 2.3 on
            found.append((module, module_name, attr, replacement))
    return found


class TorchPatch:
    """The handle ``patch_torch()`` returns: a context manager, and ``undo()``.

    Leaving the ``with`` block (or ``undo()``) restores torch's classes only if this handle's call
    applied the patch and that very patch is still installed: in ``with patch_torch(): ... with
    patch_torch(): ...`` the inner block changes nothing on entry or exit, and the outer one restores
    torch on exit; a handle whose patch ``unpatch_torch()`` already removed leaves a later patch alone.
    """

    def __init__(self, installed: dict[tuple[str, str], Any] | None) -> None:
        self._installed = installed  # the patch this call installed (compared by identity), or None

    @property
    def applied(self) -> bool:
        """Whether this call installed the patch (False when torch was already patched)."""
        return self._installed is not None

    def undo(self) -> None:
        """Restore torch's classes if this handle installed the patch and it is still installed."""
        installed, self._installed = self._installed, None
        if installed is not None:
            with _lock:
                if _originals is installed:
                    _unpatch_locked()

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.undo()


UNREACHED_MESSAGE = (
    "Call gradscaler.with_master_weights(optimizer) before training (the HF Trainer: "
    "callbacks=[gradscaler.frameworks.MasterWeightsCallback()]; docs/bfloat16.md has each framework's line). "
    "gradscaler.patch_torch(master_weights=True) did not reach {name}, which no GradScaler steps (a bfloat16 "
    "mode builds none): its {count} {dtype} parameter(s) with gradients step in {dtype}, without float32 masters."
)


class _Unreached:
    """``patch_torch(master_weights=True)``'s global optimizer step pre-hook: at each optimizer's first step,
    a warning (``UNREACHED_MESSAGE``) when it steps float16/bfloat16 parameters, which no scaler's masters
    stand for; after that a set lookup per step."""

    def __init__(self) -> None:
        self.met: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.handle: Any = None

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self.met:
            return
        self.met.add(optimizer)
        low = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and p.dtype in masters.LOW_PRECISION
        ]
        if low:
            dtype = str(low[0].dtype).replace("torch.", "")
            warn(UNREACHED_MESSAGE.format(name=type(optimizer).__name__, count=len(low), dtype=dtype), UserWarning)


_unreached = _Unreached()


def patch_torch(*, master_weights: bool = False, accumulate_grads_in_fp32: bool = False) -> TorchPatch:
    """Make ``torch.amp.GradScaler`` and its other spellings build gradscaler's scaler, until undone.

    ``torch.amp.GradScaler``, ``torch.amp.grad_scaler.GradScaler`` and ``torch.GradScaler`` become
    :class:`gradscaler.GradScaler` (same constructor: ``device`` first); ``torch.cuda.amp.GradScaler``
    becomes :class:`CudaAmpGradScaler` and ``torch.cpu.amp.GradScaler`` :class:`CpuAmpGradScaler`
    (torch's device-less constructors and deprecation warnings). Returns a :class:`TorchPatch`; use it
    as a context manager, or call :func:`unpatch_torch`. Idempotent: a second call changes nothing and
    returns a handle whose exit changes nothing. Affects scalers built after the call only.

    ``master_weights=True``: the scalers built default to ``master_weights=True`` (float16 models train
    through float32 masters), and ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` clip the
    masters' gradients in place of the float16 parameters' (``gradscaler.masters.clip_grad_norm_``,
    ``clip_grad_value_``; a scaler with masters routes them so at its first step too).
    ``accumulate_grads_in_fp32=True`` (with ``master_weights=True``): they also default to
    ``accumulate_grads_in_fp32=True`` (gradients summed in float32 across micro-batches; ``GradScaler``).
    A loop that builds no scaler (a framework's bfloat16 mode) is not reached: its optimizer's first step
    warns, in one line, to call ``gradscaler.with_master_weights(optimizer)``.
    """
    global _originals
    if accumulate_grads_in_fp32 and not master_weights:
        raise ValueError(masters.WITHOUT_MASTERS_MESSAGE.replace("GradScaler(", "patch_torch(", 1))
    with _lock:
        if _originals is not None:
            patched, accumulating = masters.DEFAULTS  # the installed patch's arguments
            if (patched, accumulating) != (master_weights, accumulate_grads_in_fp32):
                raise ValueError(
                    "Call gradscaler.unpatch_torch() first. patch_torch(master_weights="
                    f"{master_weights}, accumulate_grads_in_fp32={accumulate_grads_in_fp32}): torch is already "
                    f"patched with master_weights={patched}, accumulate_grads_in_fp32={accumulating}."
                )
            return TorchPatch(None)
        for name in _SUBCLASSING_MODULES:
            if torch.distributed.is_available():
                importlib.import_module(name)
        originals: dict[tuple[str, str], Any] = {}
        targets: list[tuple[Any, str, str, Any]] = list(_spellings())
        if master_weights:
            variants = {cls: _MASTER_VARIANTS[(cls, accumulate_grads_in_fp32)] for _, _, _, cls in targets}
            targets = [(m, name, attr, variants[cls]) for m, name, attr, cls in targets]
            targets += [
                (torch.nn.utils, "torch.nn.utils", name, ours) for name, (_, ours) in masters.ROUTED_CLIPPING.items()
            ]
        torchs = {ours: torch_function for torch_function, ours in masters.ROUTED_CLIPPING.values()}
        for module, module_name, attr, replacement in targets:
            original = getattr(module, attr)
            torchs_own = torchs.get(replacement) if original is replacement else None  # routed by a scaler already
            originals[(module_name, attr)] = original if torchs_own is None else torchs_own
            setattr(module, attr, replacement)
            if isinstance(originals[(module_name, attr)], type):  # a scaler class, not a clipping
                copyreg.pickle(originals[(module_name, attr)], _reduce_torch_scaler)
            _installed[(module_name, attr)] = replacement
        _originals = originals
        masters.DEFAULTS[:] = [master_weights, accumulate_grads_in_fp32]  # every scaler built now takes them
        if master_weights:
            _unreached.handle = register_optimizer_step_pre_hook(_unreached)
        return TorchPatch(originals)


def unpatch_torch() -> None:
    """Put torch's own GradScaler classes back under every spelling ``patch_torch`` replaced.

    A no-op when not patched. A name that someone else rebound while patched is left as they set it,
    with a ``RuntimeWarning``.
    """
    with _lock:
        _unpatch_locked()


def _unpatch_locked() -> None:
    global _originals
    if _originals is None:
        return
    for (module_name, attr), original in _originals.items():
        if copyreg.dispatch_table.get(original) is _reduce_torch_scaler:
            del copyreg.dispatch_table[original]
        module = importlib.import_module(module_name)
        if getattr(module, attr) is _installed.pop((module_name, attr), None):
            setattr(module, attr, original)
        else:
            warn(
                f"{module_name}.{attr} was rebound while gradscaler's patch was installed; left as it is.",
                RuntimeWarning,
            )
    _originals = None
    masters.DEFAULTS[:] = [False, False]
    if _unreached.handle is not None:
        _unreached.handle.remove()
        _unreached.handle = None


def is_torch_patched() -> bool:
    """Whether ``patch_torch()`` is in effect: torch's GradScaler spellings build gradscaler's scaler."""
    return _originals is not None
