"""Opt-in: tell Hugging Face Accelerate (and so the Trainer) which optimizer steps were really skipped.

Accelerate decides ``AcceleratedOptimizer.step_was_skipped`` by whether ``scaler.step`` called
``optimizer.step``. With a fused optimizer (``fused=True``; the Trainer's default ``adamw_torch_fused``)
torch's scaler, and gradscaler's, always call it and the kernel skips the update itself, so Accelerate
reports False on every step and the Trainer advances its LR schedule on skipped steps too. That is
torch's behaviour and it stays the default.

``report_skipped_steps(optimizer_or_accelerator)`` and ``SkippedStepsCallback`` (for the Trainer) make
``step_was_skipped`` say what ``GradScaler.last_step_skipped()`` says: whether the iteration's
``update()`` saw a non-finite gradient. The price is one host read of the overflow flag per optimizer
step (``last_step_skipped()`` syncs with the device), and a run that is no longer the same as one with
torch's scaler whenever a step is skipped (the LR schedule no longer advances on skipped steps).

Works with the scaler's public API only (``last_step_skipped``); on Accelerate's side it sets the
attribute ``step_was_skipped`` reads (``_is_overflow``, tested against accelerate 1.15).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from gradscaler.masters import LOW_PRECISION, unwrap, with_master_weights
from gradscaler.scaler import GradScaler

__all__ = [  # noqa: F822 (the three callbacks: module __getattr__)
    "MasterWeightsCallback",
    "ScaleLogCallback",
    "SkippedStepsCallback",
    "log_scale",
    "report_skipped_steps",
]


_ACCELERATE_FIX = (
    "set `accelerator.scaler = gradscaler.GradScaler(...)` before `accelerator.prepare(...)`, or call "
    "gradscaler.patch_torch() before Accelerator(...)"
)
_TRAINER_FIX = (
    "call gradscaler.patch_torch() before Trainer(...), or set `trainer.accelerator.scaler = "
    "gradscaler.GradScaler(...)` after Trainer(...) and before train()"
)
_SHARDED = (
    "Accelerate's FSDP (version 1) path builds torch's ShardedGradScaler, which gradscaler.patch_torch() does "
    "not replace (docs/integrations.md); with FSDP2 (fsdp_version=2) Accelerate builds torch.amp.GradScaler, "
    "which the patch makes gradscaler's"
)


def _scaler_of(optimizer: Any, helper: str = "report_skipped_steps", fix: str = _ACCELERATE_FIX) -> GradScaler:
    scaler = getattr(optimizer, "scaler", None)
    if not isinstance(scaler, GradScaler):
        why = f" {_SHARDED}." if type(scaler).__name__ == "ShardedGradScaler" else ""
        raise TypeError(
            f"To use gradscaler's scaler, {fix}. {helper} needs an accelerate AcceleratedOptimizer prepared "
            f"with gradscaler's GradScaler; its scaler is {scaler!r}.{why}"
        )
    return scaler


def _tell(optimizer: Any, helper: str = "report_skipped_steps", fix: str = _ACCELERATE_FIX) -> None:
    """Set the Accelerate optimizer's skip flag from its scaler's last update (one host read)."""
    if optimizer.gradient_state.sync_gradients:
        optimizer._is_overflow = _scaler_of(optimizer, helper, fix).last_step_skipped()


class _TruthfulStep:
    """Stands in for an AcceleratedOptimizer's ``step``: the original step, then the true skip flag.

    A plain picklable object (not a closure), so that a patched optimizer still pickles.
    """

    def __init__(self, optimizer: Any, previous: Any | None) -> None:
        self.optimizer = optimizer
        self.previous = previous  # an instance-level step someone installed before us, or None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            retval = self.previous(*args, **kwargs)
        else:
            retval = type(self.optimizer).step(self.optimizer, *args, **kwargs)
        _tell(self.optimizer)
        return retval


def report_skipped_steps(target: Any) -> Any:
    """Make Accelerate's ``step_was_skipped`` true to the scaler, at one host read per step. Opt-in.

    ``target`` is an ``accelerate.Accelerator`` (every optimizer it has prepared so far: call it after
    ``prepare``, ``ValueError`` when there is none) or one ``AcceleratedOptimizer``; their scaler must be
    gradscaler's :class:`~gradscaler.GradScaler` (set ``accelerator.scaler`` before ``prepare``, or
    ``patch_torch()`` before ``Accelerator(...)``; ``TypeError`` otherwise). After each synchronising
    ``optimizer.step()`` the optimizer's ``step_was_skipped`` (and
    ``accelerator.optimizer_step_was_skipped``) is ``scaler.last_step_skipped()``. Idempotent; returns
    ``target``.

    Usage::

        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        report_skipped_steps(accelerator)   # scheduler.step() now holds on skipped steps
    """
    accelerator = hasattr(target, "_optimizers") and hasattr(target, "prepare")
    optimizers = target._optimizers if accelerator else [target]
    if accelerator and not optimizers:  # it patches prepared optimizers: before prepare() there are none
        raise ValueError(
            "Call report_skipped_steps(accelerator) after `accelerator.prepare(...)` (again after preparing "
            "more optimizers): it found no prepared optimizer."
        )
    for optimizer in optimizers:
        _scaler_of(optimizer)
        current = optimizer.__dict__.get("step")
        if isinstance(current, _TruthfulStep):
            continue
        optimizer.step = _TruthfulStep(optimizer, current)
    return target


_callback_class: type | None = None


def _make_callback_class() -> type:
    from transformers import TrainerCallback

    class SkippedStepsCallback(TrainerCallback):  # type: ignore[misc]
        """HF Trainer callback: the LR schedule holds on steps the scaler skipped. Opt-in.

        ``Trainer(..., callbacks=[SkippedStepsCallback()])``. After each optimizer step it sets
        Accelerate's ``step_was_skipped`` from ``GradScaler.last_step_skipped()`` (one host read per
        step), which the Trainer reads before ``lr_scheduler.step()``. Needs gradscaler's scaler in
        ``trainer.accelerator.scaler`` before ``train()`` (``patch_torch()`` before ``Trainer(...)``):
        with torch's, the first optimizer step raises ``TypeError`` saying so. Without any scaler
        (``fp16`` off, or the CPU, where Accelerate builds none) there is nothing to report.
        """

        def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is not None and getattr(optimizer, "scaler", None) is not None:
                _tell(optimizer, "SkippedStepsCallback", _TRAINER_FIX)

    SkippedStepsCallback.__module__ = __name__
    SkippedStepsCallback.__qualname__ = "SkippedStepsCallback"
    return SkippedStepsCallback


def _masters_callback_class() -> type:
    global _masters_class
    if _masters_class is not None:
        return _masters_class
    from transformers import TrainerCallback

    class MasterWeightsCallback(TrainerCallback):  # type: ignore[misc]
        """HF Trainer callback: float32 masters and float32 gradient sums for a bfloat16 model (``bf16=True``,
        where the Trainer builds no scaler), over the Trainer's own optimizer.

        ``Trainer(..., callbacks=[MasterWeightsCallback()])``. At ``on_train_begin``, after the Trainer built
        its optimizer and loaded a checkpoint's (``resume_from_checkpoint``), before the first backward:
        ``gradscaler.with_master_weights(optimizer)``. The Trainer's ``max_grad_norm`` then clips the float32
        sums, and the ``grad_norm`` it logs is theirs. TRL's trainers take it alike (they run the Trainer's
        loop); so does a PEFT model with bfloat16 adapters (``autocast_adapter_dtype=False``): PEFT's default
        keeps the adapters in float32, whose gradients are float32 already, and the callback leaves those alone."""

        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            # an optimizer of float32 parameters only (a float32 model under autocast, PEFT's float32 adapters
            # over a frozen bfloat16 model) steps float32 gradients already: nothing to do, nothing to say
            groups = [] if optimizer is None else unwrap(optimizer).param_groups
            if any(p.dtype in LOW_PRECISION for group in groups for p in group["params"]):
                with_master_weights(optimizer)

    MasterWeightsCallback.__module__ = __name__
    MasterWeightsCallback.__qualname__ = "MasterWeightsCallback"
    _masters_class = MasterWeightsCallback
    return MasterWeightsCallback


def __getattr__(name: str) -> Any:
    # SkippedStepsCallback subclasses transformers.TrainerCallback: built on first use, so importing this
    # module does not import transformers.
    global _callback_class
    if name == "SkippedStepsCallback":
        if _callback_class is None:
            _callback_class = _make_callback_class()
        return _callback_class
    if name == "ScaleLogCallback":
        return _scale_log_callback_class()
    if name == "MasterWeightsCallback":
        return _masters_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- the scale in the framework's own logs


def amp_logs(scaler: Any) -> dict[str, float | int]:
    """``{"amp/scale": ..., "amp/skipped_steps": ...}`` of ``scaler`` (gradscaler's; torch's gives the
    scale only). Reads the device once (``stats()``)."""
    if isinstance(scaler, GradScaler):
        if not scaler.is_enabled():
            return {}
        stats = scaler.stats()
        return {"amp/scale": stats["scale"], "amp/skipped_steps": stats["skipped_steps"]}
    get_scale = getattr(scaler, "get_scale", None)
    return {"amp/scale": get_scale()} if callable(get_scale) else {}


class _LogWithScale:
    """Stands in for ``Accelerator.log``: the caller's values plus ``amp_logs`` of the accelerator's scaler.

    A plain picklable object (not a closure), like ``_TruthfulStep``.
    """

    def __init__(self, accelerator: Any, previous: Any | None) -> None:
        self.accelerator = accelerator
        self.previous = previous  # an instance-level log someone installed before us, or None

    def __call__(self, values: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        scaler = self.accelerator.scaler
        if scaler is not None:
            values = {**values, **amp_logs(scaler)}
        if self.previous is not None:
            return self.previous(values, *args, **kwargs)
        return type(self.accelerator).log(self.accelerator, values, *args, **kwargs)


def log_scale(accelerator: Any) -> Any:
    """Make every ``accelerator.log(values, step)`` also log ``amp/scale`` and ``amp/skipped_steps``.

    They reach every tracker the accelerator logs to (TensorBoard, W&B, ...), at the step the caller
    gives. Each call reads the scaler once (``stats()``, one device sync, at the caller's logging
    frequency). The scaler is ``accelerator.scaler`` at the time of each call (set it before
    ``prepare``); without one, values pass unchanged. Idempotent; returns ``accelerator``.

    Usage::

        accelerator.init_trackers("run")
        log_scale(accelerator)
        accelerator.log({"loss": loss.item()}, step=step)   # + amp/scale, amp/skipped_steps
    """
    if not callable(getattr(accelerator, "log", None)) or not hasattr(accelerator, "scaler"):
        raise TypeError(f"log_scale needs an accelerate.Accelerator, got {type(accelerator).__name__}.")
    current = accelerator.__dict__.get("log")
    if not isinstance(current, _LogWithScale):
        accelerator.log = _LogWithScale(accelerator, current)
    return accelerator


_scale_log_class: type | None = None
_masters_class: type | None = None


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN: a run that goes wrong logs a NaN loss (``logging_nan_inf_filter=False``)."""
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nan or bool(a == b)


def _scale_log_callback_class() -> type:
    global _scale_log_class
    if _scale_log_class is not None:
        return _scale_log_class
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler

    class ScaleLogCallback(TrainerCallback):  # type: ignore[misc]
        """HF Trainer callback: ``amp/scale`` and ``amp/skipped_steps`` in the Trainer's training logs.

        ``Trainer(..., callbacks=[ScaleLogCallback()])``. Every training log (``logging_steps``)
        then carries them to the ``report_to`` integrations (TensorBoard and W&B write them as
        ``train/amp/scale``), to the console, and to ``trainer.state.log_history`` (so to
        ``trainer_state.json`` in each checkpoint): the Trainer appends a copy of the log to the
        history before the callbacks see it, so this callback adds the values to that entry too.
        The Trainer calls the integrations before the
        callbacks a user passes, so this callback moves itself to the front of the Trainer's callback
        list (at ``on_init_end`` and ``on_train_begin``). One device read per log (``stats()``), where
        the Trainer reads the loss anyway. Reads the scaler of the Trainer's optimizer
        (``trainer.accelerator.scaler``); evaluation and end-of-training summaries are left alone.
        """

        def _go_first(self) -> None:
            # The handler calls each callback from CallbackHandler.call_event: the caller's ``self``.
            handler = sys._getframe(2).f_locals.get("self")
            if isinstance(handler, CallbackHandler) and handler.callbacks and handler.callbacks[0] is not self:
                handler.callbacks.remove(self)
                handler.callbacks.insert(0, self)

        def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._go_first()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._go_first()

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
        ) -> None:
            scaler = getattr(kwargs.get("optimizer"), "scaler", None)
            if logs is None or scaler is None or "loss" not in logs:  # training logs only
                return
            values = amp_logs(scaler)
            # Trainer.log appends {**logs, "step": global_step} and then calls on_log with logs.
            last = state.log_history[-1] if state.log_history else {}
            if last.get("step") == state.global_step and _same(last.get("loss"), logs["loss"]):
                last.update(values)
            logs.update(values)

    ScaleLogCallback.__module__ = __name__
    ScaleLogCallback.__qualname__ = "ScaleLogCallback"
    _scale_log_class = ScaleLogCallback
    return ScaleLogCallback
