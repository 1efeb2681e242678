"""GradScaler: the public API, the only owner of scaler state, and the per-optimizer state machine.

Every other module of the library takes values and returns values; this one holds the state, calls
them in order and keeps torch's private surface that other libraries rely on.
"""

from __future__ import annotations

import copy
import weakref
from collections import abc, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from gradscaler import checkpoint, clipping, compiled, distributed, fused, grads, kernels, masters, rule, stale
from gradscaler.errors import warn
from gradscaler.record.monitor import Monitor
from gradscaler.record.telemetry import COUNTERS, Keeper, make_telemetry
from gradscaler.torch_surface import TorchSurface

_CLOSURE_MESSAGE = "Closure use is not currently supported if GradScaler is enabled."
_NO_CUDA_MESSAGE = (
    "gradscaler.GradScaler(device='cuda') is enabled, but CUDA is not available.  Disabling: scale() returns "
    "its input unchanged and step() calls optimizer.step() as it is. Pass device='cpu' to scale on the CPU."
)
_PICKLE_MESSAGE = (
    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after scaler.update()."
)


class GradScaler(TorchSurface, torch.amp.GradScaler):
    """Dynamic loss scaling for float16 training: a drop-in replacement for ``torch.amp.GradScaler``.

    Usage is torch's: ``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(optimizer)`` or
    ``scaler.clip_grad_norm_(optimizer, max_norm)``, then ``scaler.step(optimizer)`` and
    ``scaler.update()``. With default arguments every scale, every skipped step and every parameter
    is bit-identical to a run with torch's scaler, and ``isinstance(scaler, torch.amp.GradScaler)``
    holds (every method is ours; none of torch's runs). The scale ``S`` follows this rule at
    ``update()``, the only statement of it in the library::

        found_inf = any non-finite gradient, in any optimizer, on any device (and any rank of
                    process_group) this iteration
        if found_inf:                                  # step() skipped the optimizer's update
            growth_tracker = 0
            hysteresis_tracker -= 1                    # overflows still tolerated before a backoff
            if hysteresis_tracker <= 0: S = S * backoff_factor
        else:
            growth_tracker += 1
            if hysteresis_refill == "clean": hysteresis_tracker = hysteresis
            if growth_tracker == growth_interval:
                growth_tracker = 0; hysteresis_tracker = hysteresis
                if isfinite(S * growth_factor): S = S * growth_factor
        S = clamp(S, max(min_scale, 2**-126), min(max_scale, float32 max))

    Where torch's result is a defect, ours differs (each difference, with why: docs/migration.md): the
    scale never drops below 2**-126, unworkable policies are refused, a fused optimizer's gradients are
    read, not rewritten, and a retried step, an interrupted iteration and ``unscale_`` at every
    micro-batch never step gradients scaled twice or not at all.

    Args:
        device: device type of the scale (``"cuda"``, ``"cpu"``, ...). ``"cuda"`` without CUDA warns
            and disables the scaler, as torch does.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: torch's meaning.
        hysteresis: overflowing steps tolerated before a backoff (all are still skipped).
        hysteresis_refill: ``"clean"`` (any clean step refills: N *consecutive* overflows back off,
            DeepSpeed's ``consecutive_hysteresis``) or ``"growth"`` (only a growth refills: Megatron).
        min_scale, max_scale: bounds on the scale.
        process_group: the group over which the overflow flag (and clipping norm) is all-reduced.
            Sharded DTensor gradients are reduced over their mesh without it.
        collapse_patience: consecutive overflowing steps at the minimum scale before
            ``on_collapse`` acts (``None`` never acts).
        on_collapse: ``"raise"`` a ``ScaleCollapseError`` or ``"warn"`` with ``ScaleCollapseWarning``.
        history: length of the on-device ring of past scales and skip flags.
        master_weights: train float16/bfloat16 parameters through float32 masters the optimizer steps
            (``gradscaler.masters``; docs/migration.md). False keeps torch's ``ValueError``. Unset: False,
            or what an active ``patch_torch(master_weights=...)`` says.
        accumulate_grads_in_fp32: with ``master_weights``, add each backward's gradient of a float16/bfloat16
            parameter into its master's float32 gradient (``p.grad`` is then None after backward). Unset:
            False, or (with masters) what an active ``patch_torch(accumulate_grads_in_fp32=...)`` says.
    """

    # torch's class whose name this class stands for under ``patch_torch()`` (see ``__setstate__``).
    _torch_class: type = torch.amp.GradScaler
    _in_step = False  # ``step`` calling ``unscale_``: no user code runs before the optimizer steps

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
        master_weights: bool | None = None,
        accumulate_grads_in_fp32: bool | None = None,
    ) -> None:
        self._device = device
        self._enabled = enabled
        compiled.prepare()  # the marks, before any step is traced
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warn(_NO_CUDA_MESSAGE, UserWarning)
            self._enabled = False
        if self._enabled:  # torch's two checks, with torch's type and words
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
        self._rule = rule.ScaleRule().with_changes(  # a disabled scaler checks nothing, as torch's
            self._enabled,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        self._init_scale = self._rule.initial_scale(init_scale, self._enabled)
        self._history = rule.integer("history", history, 1, 2**31 - 1)
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._rule.hysteresis
        self._init_counters = [0] * len(COUNTERS)
        self._process_group = process_group
        self._masters = masters.build(master_weights, accumulate_grads_in_fp32)  # None: an active patch's
        stands_for = self._masters.param_of if self._masters.active else None  # names a master as its parameter
        self._monitor = Monitor(collapse_patience, on_collapse, stands_for=stands_for)
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._telemetry: Keeper | None = None
        self._scale_on_host = False  # set with the scale: reading it costs the host nothing (the CPU)
        self._last_found_inf: torch.Tensor | None = None
        self._param_lists: grads.WeakById[grads.ParamList] = grads.WeakById()  # by optimizer, no longer than it
        # torch annotates the records as plain dicts; ours declare their keys.
        self._per_optimizer_states: dict[int, stale.OptimizerRecord] = defaultdict(  # type: ignore[assignment]
            stale.fresh_record
        )

    @classmethod
    def for_bf16(cls, device: str = "cuda", **kwargs: Any) -> GradScaler:
        """A scaler for bfloat16 runs: scale fixed at 1, non-finite steps still skipped, clipping kept."""
        return cls(device, init_scale=1.0, min_scale=1.0, max_scale=1.0, **kwargs)

    @compiled.eager
    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        """Multiply a tensor, or every tensor in nested lists/tuples/iterables, by the scale.

        Structure is preserved (lists and tuples keep their type; other iterables become ``map``
        objects, as in torch). The scale tensor is created on the first tensor's device.
        """
        if not self._enabled:
            return outputs
        watch = None  # hooks for the stale check on the scaled outputs: only after an interrupted iteration
        if self._per_optimizer_states:
            watch = stale.watch_unscaled(self._per_optimizer_states.values(), self._masters, self._params)
        if isinstance(outputs, torch.Tensor) and self._scale is not None and watch is None:  # no closure, no copies
            return self._masters.watch(outputs * self._scale.to(device=outputs.device, non_blocking=True))
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
                scaled = self._masters.watch(value * factor)
                if watch is not None and scaled.requires_grad:
                    watch.hook(scaled)
                return scaled
            if isinstance(value, abc.Iterable):
                mapped = map(scale_one, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return scale_one(outputs)

    @compiled.eager
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is non-finite.

        One read and one write of every gradient; no host sync. Call at most once per optimizer per
        iteration, before ``step``. float16 gradients are refused (``ValueError``), unless
        ``master_weights=True`` moves them to float32 masters (then they show the unscaled values).
        """
        if self._enabled:
            optimizer = masters.unwrap(optimizer)
            self._check_scale_growth_tracker("unscale_")
            self._unscale(optimizer, self._record(optimizer), keep=not self._in_step)

    def _unscale(self, optimizer: torch.optim.Optimizer, record: stale.OptimizerRecord, keep: bool) -> None:
        """``unscale_``'s work on ``optimizer`` (unwrapped), its ``record``, the scale checked; ``step`` calls it in its
        eager half (no second wrapper). ``keep``: the user's call (gradients show unscaled values until ``step``)."""
        self._check_stage(record, "unscale_()")
        params = self._params(optimizer)  # cached, and the agreement resolved from them
        agreement = self._agreement(optimizer)  # before any gradient is touched: a refusal changes nothing
        inv_scale = self._inv_scale()  # the masters' gradients: moved, checked (and unscaled) in one pass
        custom = self._custom_unscale
        moved = self._masters.move(optimizer, None if custom else inv_scale, keep=keep)
        if custom:  # torch's hook, as torch's unscale_ calls it: every gradient, the masters' too
            per_device = self._unscale_grads_(optimizer, inv_scale, torch.zeros_like(inv_scale), False)
        else:
            if self._masters.active:
                params = self._params(optimizer)  # the masters in their parameters' places, bound at the first move
            rest = moved.rest(params)  # none left: a float16 model, whose move gave every flag
            per_device = dict(moved.flags)  # a copy: ``NOTHING``'s is shared
            if rest:
                flags = grads.unscale_and_check_(grads.group_grads(rest, allow_fp16=False), inv_scale)
                per_device = grads.merge_flags(flags, per_device) if per_device else flags  # no move: its flags
        self._record_found_inf(optimizer, record, per_device, agreement)
        if keep:
            self._masters.show(optimizer)
        record["stage"] = OptState.UNSCALED

    @compiled.eager
    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to total ``norm_type``-norm ``max_norm``, scale-aware.

        Returns the total norm of the *unscaled* gradients as a 0-d float32 tensor (float64 when some
        gradients are float64), without a host sync. One read of every gradient gives the norm and
        the overflow flag. A fused optimizer receives ``grad_scale = S / clip_coef`` and no gradient is
        written; other optimizers' gradients are multiplied once by ``clip_coef / S``. Replaces
        ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``.
        """
        norm_type = clipping.check_clip_arguments(max_norm, norm_type)
        optimizer = masters.unwrap(optimizer)
        if not self._enabled:
            params = [p for p in grads.iter_params(optimizer) if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)  # torch's, as torch would
        with kernels.NoGrad():  # as torch's clip: gradients with a graph (``create_graph=True``) are clipped outside it
            return self._clip_grad_norm(optimizer, max_norm, norm_type)

    def _clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float) -> torch.Tensor:
        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        record = self._record(optimizer)
        self._check_stage(record, "clip_grad_norm_()", allow_unscaled=True)
        if record.get("clipped"):
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")
        if self._custom_unscale and record["stage"] is OptState.READY:
            self.unscale_(optimizer)  # the subclass's unscaling hook sees every gradient, as with unscale_ + clip
        unscaled = record["stage"] is OptState.UNSCALED
        hand_off = fused.supports_amp_scaling(optimizer) and not fused.takes_grad_scaler_kwarg(optimizer)
        params = self._params(optimizer)
        agreement = self._agreement(optimizer)
        inv_scale = None if unscaled else self._inv_scale()
        moved = self._masters.move(optimizer, None, norm_type, inv_scale)  # moved, checked and normed in one pass
        if self._masters.active:
            params = self._params(optimizer)  # the masters in their parameters' places, bound at the first step
            agreement = self._agreement(optimizer)  # so the masters' norms count in their shard class
        owners = grads.new_groups()
        groups = grads.group_grads(moved.rest(params), allow_fp16=hand_off and not unscaled, owners=owners)
        norms, flags = grads.norms_and_check(groups, norm_type, inv_scale)  # norms of the unscaled gradients
        norms, by_device = moved.after(norms, grads.flat_owners(owners), params)
        if not unscaled:
            self._record_found_inf(optimizer, record, grads.merge_flags(flags, moved.flags), agreement)
        total = clipping.global_norm(norms, by_device, norm_type, scale.device, agreement)
        self._monitor.clipped(optimizer, by_device, norms, total)
        coef = clipping.clip_coefficient(total, max_norm, on_host=self._scale_on_host)
        if hand_off and not unscaled:
            grad_scale = scale / coef
            if hasattr(optimizer, "grad_scale"):  # an optimizer's own factor (a multiply by 1 is no launch)
                grad_scale = grad_scale * optimizer.grad_scale
            record["grad_scale"] = grad_scale.float()
        else:
            factor = coef if inv_scale is None else coef * inv_scale
            clipping.scale_grads_(groups, factor)
            clipping.scale_grads_(moved.master_grads, factor)
        record["stage"] = OptState.UNSCALED
        record["clipped"] = True
        return total

    @compiled.eager_frame  # this frame only calls its two eager halves and, between them, optimizer.step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done) and run ``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite.

        Returns what ``optimizer.step`` returns, or None when skipped. ``optimizer.step`` is called on
        exactly the iterations torch's scaler calls it: a fused optimizer always (it gets ``grad_scale``
        and ``found_inf`` and skips inside its kernel, no host sync except one on an optimizer's very
        first step), other optimizers only when every gradient is finite (one host sync). If
        ``optimizer.step`` raises, the record stands: calling ``step`` again steps the gradients as
        they are, unscaled (and clipped) once; a new backward instead is unscaled afresh. Closures
        are refused. In compiled code the scaler's part runs eagerly and ``optimizer.step`` is
        compiled, as with torch's scaler (docs/migration.md, "torch.compile").
        """
        step = self._begin_step(optimizer, args, kwargs)
        if step.fn is not None:
            try:
                step.result = step.fn(*step.args, **step.kwargs)
            except BaseException:
                self._end_step(step, completed=False)
                raise
        return self._end_step(step, completed=True)

    @compiled.eager
    def _begin_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> fused.Step:
        """Everything before ``optimizer.step``: the checks, unscaling (or the fused check), the masters'
        ``before_step``; returns the call to make, none when the step is skipped."""
        if not self._enabled:
            self._masters.refuse_disabled(optimizer)
            return fused.Step(optimizer, None, optimizer.step, args, kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(_CLOSURE_MESSAGE)
        self._check_scale_growth_tracker("step")
        target, optimizer = optimizer, masters.unwrap(optimizer)  # a wrapper's step, the optimizer's record
        record = self._record(optimizer)
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if record.get("mixed"):
            raise RuntimeError(stale.MIXED_MESSAGE.format(call="step()"))
        if fused.supports_amp_scaling(optimizer):
            return self._begin_fused_step(target, optimizer, record, args, kwargs)
        if record["stage"] is OptState.READY:
            if type(self).unscale_ is GradScaler.unscale_:
                self._unscale(optimizer, record, keep=False)
            else:  # a subclass's own unscale_, called as torch's step calls it
                self._in_step = True
                try:
                    self.unscale_(optimizer)
                finally:
                    self._in_step = False
        self._masters.before_step(optimizer)
        if self._custom_opt_step:  # the subclass's hook decides; the masters copy back after a real step
            return fused.Step(optimizer, record, self._maybe_opt_step, (target, record, *args), kwargs, stepped=None)
        if record["found_inf"].item():
            return fused.Step(optimizer, record, None, stepped=False)
        return fused.Step(optimizer, record, target.step, args, kwargs)

    def _begin_fused_step(
        self,
        target: Any,
        optimizer: torch.optim.Optimizer,
        record: stale.OptimizerRecord,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> fused.Step:
        """A fused optimizer always steps: it gets ``grad_scale`` and ``found_inf`` and skips inside its
        kernel (its masters are then unchanged and copy back as they were)."""
        if fused.takes_grad_scaler_kwarg(optimizer):
            fused.warn_legacy_kwarg()
            self._masters.move(optimizer)
            self._masters.before_step(optimizer)
            return fused.Step(optimizer, record, target.step, args, {**kwargs, "grad_scaler": self})
        if record["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        self._masters.before_step(optimizer)
        unscaled = record["stage"] is OptState.UNSCALED
        grad_scale = fused.grad_scale_for(optimizer, record.get("grad_scale"), unscaled, self._scale)
        step = fused.Step(optimizer, record, target.step, args, kwargs)
        fused.hand_over(step, self._params(optimizer), grad_scale, record["found_inf"])
        return step

    @compiled.eager
    def _end_step(self, step: fused.Step, completed: bool) -> Any:
        """After ``optimizer.step`` (or its skip): take back what a fused optimizer was handed (also when
        the step raised after its kernel ran: a step post-hook, a KeyboardInterrupt); after a completed
        step, copy the masters back and mark the optimizer stepped."""
        optimizer, record = step.optimizer, step.record
        if record is None:  # a disabled scaler: optimizer.step as it is
            return step.result
        fused.take_back(step, record["found_inf"])
        if not completed:
            return None
        stepped = step.stepped
        if stepped is None:
            stepped = self._masters.active and not record["found_inf"].item()
        self._masters.finish(optimizer, stepped, record["found_inf"] if step.handed_over else None)
        record["stage"] = OptState.STEPPED
        return step.result

    @compiled.eager
    def update(self, new_scale: float | int | torch.Tensor | None = None) -> None:
        """Update the scale by the rule in the class docstring, or set it to ``new_scale``.

        No host sync. Call once per iteration, after ``step`` for every optimizer. ``new_scale`` is a
        positive float or int, or a 1-element float tensor on the scaler's device type; NaN, inf and
        values <= 0 are refused (``ValueError``), except a tensor on a device whose reads sync (CUDA),
        which leaves the scale unchanged instead. The iteration is over once the scale has moved: an
        error from a logger or the collapse check raised here leaves a scaler ready for the next
        iteration.
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        self._masters.end_iteration()
        if new_scale is not None:
            rule.set_scale_(scale, new_scale, self._rule, self._scale_on_host, self._device)
            assert self._telemetry is not None
            self._telemetry.rebase()
            self._per_optimizer_states = defaultdict(stale.fresh_record)
            return
        records = list(self._per_optimizer_states.values())
        flags = [r["found_inf"] for r in records if "found_inf" in r]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = grads.combine_flags(flags)  # a single flag as it is
        assert self._hysteresis_tracker is not None and self._telemetry is not None
        # ``before``: a float when the scale is in host memory; ``steady``: the update may skip its clamp
        before, steady = self._telemetry.before(scale, growth_tracker, self._rule)
        rule.update_scale_(scale, growth_tracker, self._hysteresis_tracker, found, self._rule, steady=steady)
        tag, carry = self._monitor.record_update(records, found, self._rule)
        landed = self._telemetry.record_(found, before, scale, self._rule.lower, tag, carry)
        self._last_found_inf = found
        self._per_optimizer_states = defaultdict(stale.fresh_record)
        if landed and self._monitor.wants_counters:
            self._monitor.after_update(self._telemetry.landed())

    @compiled.eager
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The factor applied to the scale after ``growth_interval`` clean steps."""
        return self._rule.growth_factor

    @compiled.eager
    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor: a finite number > 1, else ``ValueError`` and no change (disabled: no error)."""
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The factor applied to the scale after an overflow."""
        return self._rule.backoff_factor

    @compiled.eager
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor: a number in (0, 1), else ``ValueError`` and no change (disabled: no error)."""
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The number of consecutive clean steps before the scale grows."""
        return self._rule.growth_interval

    @compiled.eager
    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval: an int >= 1, else ``ValueError`` and no change (disabled: no error).

        Clean steps already counted past the new interval count as ``new_interval - 1``: the next clean
        step grows the scale (torch's tracker would pass the interval and never grow again).
        """
        self._growth_interval = new_interval

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False after ``enabled=False`` or CUDA missing)."""
        return self._enabled

    @compiled.eager
    def last_step_skipped(self) -> bool:
        """Whether the last ``update()`` saw an overflow (its step was skipped). Syncs with the device.

        To step an LR scheduler only on real steps: ``if not scaler.last_step_skipped(): sched.step()``.
        """
        return bool(self._last_found_inf is not None and self._last_found_inf.item())

    def last_found_inf(self) -> torch.Tensor | None:
        """The last ``update()``'s overflow flag as a 0-d float32 device tensor (no sync), or None."""
        return self._last_found_inf

    @compiled.eager
    def stats(self) -> dict[str, Any]:
        """``scale``, ``steps``, ``skipped_steps``, ``consecutive_skips``, ``growths``, ``backoffs``, ...

        Also ``collapse_run``, ``growth_tracker`` and ``hysteresis_tracker``. Reads the device (one
        sync). For a per-step logger without syncs, see ``add_logger``.
        """
        snapshot = self._snapshot()
        if self._telemetry is not None and self._monitor.loggers:  # synced already: log every record issued
            self._monitor.after_update(self._telemetry.landed(wait=True))
        return snapshot.stats()

    @compiled.eager
    def history(self) -> dict[str, list[Any]]:
        """The last ``history`` scales (after each update) and skip flags, oldest first. Syncs."""
        if self._telemetry is None:
            return {"scale": [], "skipped": []}
        scales, skipped = self._telemetry.histories()
        return {"scale": scales, "skipped": skipped}

    @compiled.eager
    def add_logger(self, callback: Callable[[dict[str, Any]], None], every: int = 1) -> None:
        """Call ``callback(stats)`` every ``every`` updates with counters that have reached the host.

        No sync: each update's record reaches the callbacks once its copy has landed on the host (on
        CUDA usually at the next ``update()``; ``stats()`` delivers every record still in flight), in
        order, its ``"step"`` naming the update it describes. ``gradscaler.JsonLinesLogger(path)``
        writes them as JSON lines and documents the fields.
        """
        self._monitor.add_logger(callback, every)
        if self._telemetry is not None:
            self._telemetry.copy_every(1)  # each record on the host a step later, as a logger expects

    @compiled.eager
    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters whose current gradients hold inf or NaN (one sync).

        Call after a skipped step and before ``zero_grad``. Names come from ``name_parameters``;
        unnamed parameters are given as ``param_groups[i][j]`` with their shape.
        """
        return self._monitor.nonfinite_parameters()

    @compiled.eager
    def last_grad_norms(self) -> dict[str, float]:
        """Per-parameter unscaled gradient norms from each optimizer's last ``clip_grad_norm_`` (one sync).

        Kept on the device from the clipping pass itself (nothing is re-read); names as in
        ``nonfinite_parameters``. Empty before the first ``clip_grad_norm_``.
        """
        return self._monitor.last_grad_norms()

    @compiled.eager
    def name_parameters(self, named: Any) -> None:
        """Tell the scaler parameter names for overflow reports: a module or ``named_parameters()``."""
        self._monitor.name_parameters(named)

    @compiled.eager
    def master_weights(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(low-precision parameter, float32 master) for each master ``optimizer`` steps (``master_weights=True``;
        empty before the first ``unscale_``/``step`` of ``optimizer`` or without masters)."""
        return self._masters.masters(optimizer)

    def register_ddp(self, ddp_model: torch.nn.Module) -> None:
        """With ``accumulate_grads_in_fp32=True`` under DDP: average the float32 gradient sums of ``ddp_model``
        (the DDP module, or a framework's wrapper holding exactly one) over its process group at each move.
        Once, after wrapping; the errors and the frameworks' lines: docs/migration.md."""
        self._masters.register_ddp(ddp_model)

    @compiled.eager
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries plus this scaler's policy, trackers and counters; plain Python values."""
        if not self._enabled:
            return {}
        return checkpoint.build_state_dict(self._snapshot())

    @compiled.eager
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict()`` (ours or torch's); validates all before changing anything."""
        if not self._enabled:
            return
        if isinstance(state_dict, dict) and len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        loaded = checkpoint.parse_state_dict(state_dict, self._rule)
        self._rule = loaded.rule
        self._init_scale = loaded.scale
        self._init_growth_tracker = loaded.growth_tracker
        self._init_hysteresis_tracker = loaded.hysteresis_tracker
        self._init_counters = loaded.counters
        self._monitor.steps = loaded.steps
        if self._scale is not None:
            self._scale.fill_(loaded.scale)
        if self._telemetry is not None:
            self._telemetry.rebase()
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(loaded.growth_tracker)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(loaded.hysteresis_tracker)
        if self._telemetry is not None:
            self._telemetry.load(loaded.counters)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(_PICKLE_MESSAGE)
            snapshot = self._snapshot()
            state["_init_scale"] = snapshot.scale
            state["_init_growth_tracker"] = snapshot.growth_tracker
            state["_init_hysteresis_tracker"] = snapshot.hysteresis_tracker
            state["_init_counters"] = snapshot.counters
            for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_telemetry", "_last_found_inf"):
                state[name] = None
        state["_process_group"] = None  # a process group belongs to this process
        state["_param_lists"] = None  # keyed by optimizers of this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_rule" not in state:  # torch's own scaler, pickled by name and unpickled while patch_torch() is on
            self.__class__ = self._torch_class  # type: ignore[assignment]
        self.__dict__.update(state, _param_lists=grads.WeakById())

    def __deepcopy__(self, memo: dict[int, Any]) -> GradScaler:
        """A copy at an iteration boundary that keeps ``process_group``, loggers and parameter names."""
        state = copy.deepcopy(self.__getstate__(), memo)
        state["_process_group"] = self._process_group
        new = type(self).__new__(type(self))
        new.__setstate__(state)
        return new

    def _snapshot(self) -> checkpoint.ScalerState:
        """The scale, trackers and counters as host values (syncs when they live on a device)."""
        if self._telemetry is None or self._hysteresis_tracker is None:
            hysteresis, counters = self._init_hysteresis_tracker, list(self._init_counters)
        else:
            hysteresis, counters = int(self._hysteresis_tracker.item()), list(self._telemetry.read().values())
        return checkpoint.ScalerState(
            self._rule, self.get_scale(), self._get_growth_tracker(), hysteresis, counters, self._monitor.steps
        )

    def _check_stage(self, record: stale.OptimizerRecord, call: str, allow_unscaled: bool = False) -> None:
        if record["stage"] is OptState.UNSCALED and not allow_unscaled:
            raise RuntimeError(f"{call} has already been called on this optimizer since the last update().")
        if record["stage"] is OptState.STEPPED:
            raise RuntimeError(f"{call} is being called after step().")
        if record.get("mixed"):
            raise RuntimeError(stale.MIXED_MESSAGE.format(call=call))

    def _inv_scale(self) -> torch.Tensor:
        assert self._scale is not None, "_check_scale_growth_tracker comes first"
        return rule.inverse_scale(self._scale, self._scale_on_host)

    def _agreement(self, optimizer: torch.optim.Optimizer) -> distributed.Agreement:
        """The collectives over which ``optimizer``'s flag and norm agree (after ``_params(optimizer)``)."""
        cached = self._param_lists.get(optimizer)
        assert cached is not None, "_params(optimizer) comes first"
        return cached.agreed(self._process_group)

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """``optimizer``'s parameters, cached between iterations (see ``grads.ParamList``)."""
        cached = self._param_lists.get(optimizer)
        if cached is None:
            cached = self._param_lists[optimizer] = grads.ParamList()
        return cached.of(optimizer)

    def _record_found_inf(
        self,
        optimizer: torch.optim.Optimizer,
        record: stale.OptimizerRecord,
        per_device: dict[torch.device, torch.Tensor],
        agreement: distributed.Agreement,
    ) -> torch.Tensor:
        """Store the per-device flags and their combination, agreed as ``agreement`` says (on the scale's device)."""
        assert self._scale is not None, "_check_scale_growth_tracker comes first"
        combined = grads.flag_on(per_device, self._scale.device)
        distributed.agree_on_flag_(combined, agreement)
        record["found_inf_per_device"] = per_device
        record["found_inf"] = combined
        record["optimizer"] = weakref.ref(optimizer)
        return combined

    def _record(self, optimizer: torch.optim.Optimizer) -> stale.OptimizerRecord:
        """``optimizer``'s record of this iteration; a fresh one when a new backward made it stale."""
        record = self._per_optimizer_states[id(optimizer)]
        seen = record.pop("grads_seen", None)  # checked once: our own clipping may write the gradients next
        if seen is not None and seen.changed(stale.watched(self._masters, optimizer, self._params(optimizer))):
            if not seen.cleared():  # added to the unscaled gradients: refused by unscale_, clip and step
                record["mixed"] = True
                return record
            record = self._per_optimizer_states[id(optimizer)] = stale.fresh_record()
            self._masters.end(optimizer)  # the new gradients are moved into the masters afresh
        return record

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._scale_on_host = kernels.host_reads_free(self._scale.device)
        self._telemetry = make_telemetry(
            self._scale.device, self._history, self._init_counters, self._scale_on_host, bool(self._monitor.loggers)
        )

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:  # type: ignore[override]
        self._check_scale_growth_tracker("_check_inf_per_device")
        record = self._per_optimizer_states[id(optimizer)]
        self._params(optimizer)  # cached, and the agreement resolved from them
        agreement = self._agreement(optimizer)
        moved = self._masters.move(optimizer)  # the masters' flags come from the move
        if self._custom_unscale:  # torch's hook with inv_scale 1, as torch calls it: every gradient
            ones = torch.ones((), dtype=torch.float32, device=self._scale.device)  # type: ignore[union-attr]
            flags = self._unscale_grads_(optimizer, ones, torch.zeros_like(ones), True)
        else:  # grads.nonfinite_flags, kept for attribution; none left: a float16 model, whose move gave every flag
            rest = moved.rest(self._params(optimizer))
            flags = dict(moved.flags)  # a copy: ``NOTHING``'s is shared
            if rest:
                flags = grads.merge_flags(self._monitor.nonfinite_flags(optimizer, rest, not moved.owners), flags)
        self._record_found_inf(optimizer, record, flags, agreement)
        return record["found_inf_per_device"]
