"""GradScaler: the public API and the per-optimizer state machine (READY -> UNSCALED -> STEPPED)."""

from __future__ import annotations

import math
import warnings
import weakref
from collections import abc, defaultdict
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from gradscaler import distributed, grads, optim, rule
from gradscaler.telemetry import COUNTERS, Telemetry

_CLOSURE_MESSAGE = "Closure use is not currently supported if GradScaler is enabled."
_NO_CUDA_MESSAGE = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
_NEW_SCALE_REASON = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False."
)


class OptState(Enum):
    """Where an optimizer is in the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


class GradScaler:
    """Dynamic loss scaling for float16 training: a drop-in replacement for ``torch.amp.GradScaler``.

    Usage is torch's: ``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(optimizer)`` or
    ``scaler.clip_grad_norm_(optimizer, max_norm)``, then ``scaler.step(optimizer)`` and
    ``scaler.update()``. With default arguments every scale, every skipped step and every parameter
    is bit-identical to a run with torch's scaler. The scale ``S`` follows this rule at ``update()``::

        found_inf = any non-finite gradient, in any optimizer, on any device (and any rank of
                    process_group) this iteration
        if found_inf:                                  # step() skipped the optimizer
            tracker = 0
            hysteresis_left -= 1
            if hysteresis_left <= 0: S = S * backoff_factor
        else:
            tracker += 1
            if hysteresis_refill == "clean": hysteresis_left = hysteresis
            if tracker == growth_interval:
                tracker = 0; hysteresis_left = hysteresis
                if isfinite(S * growth_factor): S = S * growth_factor
        S = clamp(S, max(min_scale, 2**-126), min(max_scale, float32 max))

    Differences from torch, each where torch's result is a defect: the scale never drops below
    2**-126 (torch reaches 0, and every parameter becomes NaN); an optimizer without gradients is
    stepped rather than refused; a fused optimizer's gradients are checked by a read-only pass, not
    rewritten; a step skipped on an optimizer's first step never reaches the optimizer (torch's fused
    SGD keeps uninitialised momentum buffers); ``update(new_scale)`` takes an int; ``step`` refuses a
    positional closure; several overflowing devices tell a fused optimizer ``found_inf = 1`` not their
    sum (torch's fused Adam then rolls its step counter back too far).

    Args:
        device: device type of the scale (``"cuda"``, ``"cpu"``, ...). ``"cuda"`` without CUDA warns
            and disables the scaler, as torch does.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: torch's meaning.
        hysteresis: overflowing steps tolerated before a backoff (all are still skipped).
        hysteresis_refill: ``"clean"`` (any clean step refills: N *consecutive* overflows back off,
            DeepSpeed's ``consecutive_hysteresis``) or ``"growth"`` (only a growth refills: Megatron).
        min_scale, max_scale: bounds on the scale.
        process_group: the group over which the overflow flag (and clipping norm) is all-reduced.
            DTensor gradients are reduced over their mesh without it.
        collapse_patience: consecutive overflowing steps at the minimum scale before
            ``on_collapse`` acts (``None`` never acts).
        on_collapse: ``"raise"`` a ``ScaleCollapseError`` or ``"warn"`` with ``ScaleCollapseWarning``.
        history: length of the on-device ring of past scales and skip flags.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        hysteresis_refill: str = "clean",
        min_scale: float | None = None,
        max_scale: float | None = None,
        process_group: Any | None = None,
        collapse_patience: int | None = 50,
        on_collapse: str = "raise",
        history: int = 1024,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(_NO_CUDA_MESSAGE, stacklevel=2)
            self._enabled = False
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
        self._rule = rule.ScaleRule(
            growth_factor, backoff_factor, growth_interval, hysteresis, hysteresis_refill, min_scale, max_scale
        )
        init_scale = _positive_finite("init_scale", init_scale)
        if on_collapse not in ("raise", "warn"):
            raise ValueError(f"on_collapse must be 'raise' or 'warn', got {on_collapse!r}.")
        if collapse_patience is not None and (not isinstance(collapse_patience, int) or collapse_patience < 1):
            raise ValueError(f"collapse_patience must be an int >= 1 or None, got {collapse_patience!r}.")
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be an int >= 1, got {history!r}.")
        self._init_scale = min(max(init_scale, self._rule.lower), self._rule.upper)
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        self._init_counters = [0] * len(COUNTERS)
        self._process_group = process_group
        self._collapse_patience = collapse_patience
        self._on_collapse = on_collapse
        self._history = history
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._telemetry: Telemetry | None = None
        self._steps = 0
        self._last_found_inf: torch.Tensor | None = None
        self._last_optimizers: list[weakref.ReferenceType[torch.optim.Optimizer]] = []
        self._param_names: dict[int, str] = {}
        self._grad_norms: dict[int, list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]] = {}
        self._loggers: list[tuple[Callable[[dict[str, Any]], None], int]] = []
        self._collapse_reported_at = -1
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)

    @classmethod
    def for_bf16(cls, device: str = "cuda", **kwargs: Any) -> GradScaler:
        """A scaler for bfloat16 runs: scale fixed at 1, non-finite steps still skipped, clipping kept."""
        return cls(device, init_scale=1.0, min_scale=1.0, max_scale=1.0, **kwargs)

    # ----------------------------------------------------------------------------------- internals
    @property
    def _growth_factor(self) -> float:
        return self._rule.growth_factor

    @property
    def _backoff_factor(self) -> float:
        return self._rule.backoff_factor

    @property
    def _growth_interval(self) -> int:
        return self._rule.growth_interval

    def _set_rule(self, **changes: Any) -> None:
        fields = {name: getattr(self._rule, name) for name in rule.ScaleRule.__dataclass_fields__}
        fields.update(changes)
        self._rule = rule.ScaleRule(**fields)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._telemetry = Telemetry(self._scale.device, self._history, self._init_counters)

    def _inv_scale(self) -> torch.Tensor:
        scale, _ = self._check_scale_growth_tracker("unscale_")
        return scale.double().reciprocal().float()

    def _group(self, optimizer: torch.optim.Optimizer) -> Any | None:
        if self._process_group is not None:
            return self._process_group
        for param in grads.iter_params(optimizer):
            if param.grad is not None:
                return distributed.dtensor_group(param.grad)
        return None

    def _record_found_inf(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], per_device: dict[torch.device, torch.Tensor]
    ) -> torch.Tensor:
        """Store the per-device flags and their agreed combination (on the scale's device, all ranks)."""
        scale, _ = self._check_scale_growth_tracker("step")
        flags = [flag.to(scale.device, non_blocking=True) for flag in per_device.values()]
        if not flags:
            combined = torch.zeros((), dtype=torch.float32, device=scale.device)
        elif len(flags) == 1:
            combined = flags[0]
        else:
            combined = torch.stack(flags).amax()
        distributed.agree_on_flag_(combined, self._group(optimizer))
        state["found_inf_per_device"] = per_device
        state["found_inf"] = combined
        state["optimizer"] = weakref.ref(optimizer)
        return combined

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        self._record_found_inf(optimizer, state, grads.check(grads.group_grads(optimizer, allow_fp16=True)))
        return state["found_inf_per_device"]  # type: ignore[no-any-return]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[no-any-return]

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    # ---------------------------------------------------------------------------------- public API
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor in nested lists/tuples/iterables, by the scale.

        Structure is preserved (lists and tuples keep their type; other iterables become ``map``
        objects, as in torch). The scale tensor is created on the first tensor's device.
        """
        if not self._enabled:
            return outputs
        copies: dict[torch.device, torch.Tensor] = {}

        def scale_one(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(value.device)
                assert self._scale is not None
                factor = copies.get(value.device)
                if factor is None:
                    factor = self._scale.to(device=value.device, non_blocking=True)
                    copies[value.device] = factor
                return value * factor
            if isinstance(value, abc.Iterable):
                mapped = map(scale_one, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return scale_one(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is non-finite.

        One read and one write of every gradient; no host sync. Call at most once per optimizer per
        iteration, before ``step``. float16 gradients are refused (``ValueError``).
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        groups = grads.group_grads(optimizer, allow_fp16=False)
        self._record_found_inf(optimizer, state, grads.unscale_and_check_(groups, self._inv_scale()))
        state["stage"] = OptState.UNSCALED

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to total ``norm_type``-norm ``max_norm``, scale-aware.

        Returns the total norm of the *unscaled* gradients as a 0-d float32 tensor, without a host
        sync. One read of every gradient gives the norm and the overflow flag. A fused optimizer
        receives ``grad_scale = S / clip_coef`` and no gradient is written; other optimizers' gradients
        are multiplied once by ``clip_coef / S``. Replaces ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``.
        """
        from gradscaler.clipping import clip_grad_norm_

        return clip_grad_norm_(self, optimizer, max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done) and run ``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite.

        Returns what ``optimizer.step`` returns, or None when skipped. A fused optimizer gets
        ``grad_scale`` and ``found_inf`` and skips inside its kernel: no host sync (except one on an
        optimizer's very first step, so a skipped first step never reaches it). Other optimizers: one
        host sync, however many devices. Closures are refused.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(_CLOSURE_MESSAGE)
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if optim.supports_amp_scaling(optimizer):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        retval = None
        if not state["found_inf"].item():
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if optim.takes_grad_scaler_kwarg(optimizer):
            optim.warn_legacy_kwarg()
            retval = optimizer.step(*args, **kwargs, grad_scaler=self)  # type: ignore[call-overload]
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        found_inf = state["found_inf"]
        if "grad_scale" in state:
            grad_scale = state["grad_scale"]
        elif state["stage"] is OptState.UNSCALED:
            grad_scale = getattr(optimizer, "grad_scale", None)
        else:
            assert self._scale is not None
            grad_scale = self._scale * getattr(optimizer, "grad_scale", 1)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = None
            if not (optim.has_fresh_state(optimizer) and found_inf.item()):
                retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | int | torch.Tensor | None = None) -> None:
        """Update the scale by the rule in the class docstring, or set it to ``new_scale``.

        No host sync. Call once per iteration, after ``step`` for every optimizer. ``new_scale`` is a
        positive float or int, or a 1-element float tensor on the scaler's device type.
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(scale, new_scale)
        else:
            flags = [s["found_inf"] for s in self._per_optimizer_states.values() if "found_inf" in s]
            if not flags:
                raise AssertionError("No inf checks were recorded prior to update.")
            found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
            before = scale.clone()
            assert self._hysteresis_tracker is not None and self._telemetry is not None
            rule.update_scale_(scale, growth_tracker, self._hysteresis_tracker, found, self._rule)
            self._telemetry.record_(found, before, scale, self._rule.lower)
            self._steps += 1
            self._last_found_inf = found
            self._last_optimizers = [s["optimizer"] for s in self._per_optimizer_states.values() if "optimizer" in s]
            self._after_update()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _set_scale(self, scale: torch.Tensor, new_scale: Any) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError(_NEW_SCALE_REASON)
            scale.copy_(new_scale.reshape(()))
            torch.nan_to_num_(scale, nan=self._rule.lower)
        else:
            scale.fill_(_positive_finite("new_scale", new_scale))
        rule.clamp_scale_(scale, self._rule)

    def _after_update(self) -> None:
        """Non-blocking host work: loggers and collapse detection on the counters that have landed."""
        from gradscaler import monitor

        monitor.after_update(self)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The factor applied to the scale after ``growth_interval`` clean steps."""
        return self._rule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._set_rule(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor applied to the scale after an overflow."""
        return self._rule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (< 1)."""
        self._set_rule(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The number of consecutive clean steps before the scale grows."""
        return self._rule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval."""
        self._set_rule(growth_interval=new_interval)

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False after ``enabled=False`` or CUDA missing)."""
        return self._enabled

    def last_step_skipped(self) -> bool:
        """Whether the last ``update()`` saw an overflow (its step was skipped). Syncs with the device.

        To step an LR scheduler only on real steps: ``if not scaler.last_step_skipped(): sched.step()``.
        """
        return bool(self._last_found_inf is not None and self._last_found_inf.item())

    def last_found_inf(self) -> torch.Tensor | None:
        """The last ``update()``'s overflow flag as a 0-d float32 device tensor (no sync), or None."""
        return self._last_found_inf

    def stats(self) -> dict[str, Any]:
        """``scale``, ``steps``, ``skipped_steps``, ``consecutive_skips``, ``growths``, ``backoffs``, ...

        Reads the device (one sync). For a per-step logger without syncs, see ``add_logger``.
        """
        from gradscaler import monitor

        return monitor.stats(self)

    def history(self) -> dict[str, list[Any]]:
        """The last ``history`` scales (after each update) and skip flags, oldest first. Syncs."""
        if self._telemetry is None:
            return {"scale": [], "skipped": []}
        scales, skipped = self._telemetry.histories()
        return {"scale": scales, "skipped": skipped}

    def add_logger(self, callback: Callable[[dict[str, Any]], None], every: int = 1) -> None:
        """Call ``callback(stats)`` every ``every`` updates with counters that have reached the host.

        No sync: the numbers are those of the latest update whose copy has landed (on CUDA usually
        the previous step). ``gradscaler.JsonLinesLogger(path)`` writes them as JSON lines.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}.")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}.")
        self._loggers.append((callback, every))

    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters whose current gradients hold inf or NaN (one sync).

        Call after a skipped step and before ``zero_grad``. Names come from ``name_parameters``;
        unnamed parameters are given as ``param_groups[i][j]`` with their shape.
        """
        from gradscaler import monitor

        return monitor.nonfinite_parameters(self)

    def last_grad_norms(self) -> dict[str, float]:
        """Per-parameter unscaled gradient norms from each optimizer's last ``clip_grad_norm_`` (one sync).

        Kept on the device from the clipping pass itself (nothing is re-read); names as in
        ``nonfinite_parameters``. Empty before the first ``clip_grad_norm_``.
        """
        from gradscaler import monitor

        return monitor.last_grad_norms(self)

    def name_parameters(self, named: Any) -> None:
        """Tell the scaler parameter names for overflow reports: a module or ``named_parameters()``."""
        pairs = named.named_parameters() if isinstance(named, torch.nn.Module) else named
        self._param_names.update({id(p): name for name, p in pairs})

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries plus this scaler's policy, trackers and counters; plain Python numbers."""
        from gradscaler.checkpoint import state_dict

        return state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict()`` (ours or torch's); validates all before changing anything."""
        from gradscaler.checkpoint import load_state_dict

        load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            if self._hysteresis_tracker is not None:
                state["_init_hysteresis_tracker"] = int(self._hysteresis_tracker.item())
            if self._telemetry is not None:
                state["_init_counters"] = list(self._telemetry.read().values())
            for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_telemetry", "_last_found_inf"):
                state[name] = None
        state["_last_optimizers"] = []
        state["_param_names"] = {}
        state["_process_group"] = None
        state["_loggers"] = []
        state["_grad_norms"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
