"""torch's private surface of ``GradScaler``, with torch's meaning, kept apart from the owner's logic.

Accelerate, Lightning, timm, FSDP's ``ShardedGradScaler`` and torch's own tests read or call these
names; ``GradScaler`` inherits them (before torch's class, so none of torch's runs). The state they
read is ``GradScaler``'s, declared here for the type checker.
"""

from __future__ import annotations

from typing import Any

import torch

from gradscaler import grads, rule


class TorchSurface:
    """torch's private getters, setters and hooks, over the state ``GradScaler`` owns."""

    _rule: rule.ScaleRule
    _enabled: bool
    _init_growth_tracker: int
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _telemetry: Any  # a ``record.telemetry.Keeper`` once the scale is made
    _per_optimizer_states: Any

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        raise NotImplementedError  # GradScaler's

    @property
    def _growth_factor(self) -> float:
        return self._rule.growth_factor

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self._rule = self._rule.with_changes(self._enabled, growth_factor=value)

    @property
    def _backoff_factor(self) -> float:
        return self._rule.backoff_factor

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self._rule = self._rule.with_changes(self._enabled, backoff_factor=value)

    @property
    def _growth_interval(self) -> int:
        return self._rule.growth_interval

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self._rule = self._rule.with_changes(self._enabled, growth_interval=value)
        highest = self._rule.growth_interval - 1  # the rule grows when the tracker reaches the interval
        self._init_growth_tracker = min(self._init_growth_tracker, highest)
        if self._growth_tracker is not None:
            self._growth_tracker.clamp_(max=highest)
            self._telemetry.rebase()  # the tracker may have moved outside the rule

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    # A subclass that overrides torch's hooks ``_unscale_grads_`` / ``_maybe_opt_step`` (ShardedGradScaler
    # style) has them called where torch's scaler calls them; otherwise the faster paths run.
    @property
    def _custom_unscale(self) -> bool:
        return type(self)._unscale_grads_ is not TorchSurface._unscale_grads_

    @property
    def _custom_opt_step(self) -> bool:
        return type(self)._maybe_opt_step is not TorchSurface._maybe_opt_step

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """torch's: multiply the gradients by ``inv_scale`` in place; per-device flags seeded from ``found_inf``."""
        return grads.unscale_and_check_(
            grads.group_grads(self._params(optimizer), allow_fp16=allow_fp16), inv_scale, found_inf
        )

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's: ``optimizer.step`` unless a recorded per-device flag is nonzero (one sync per device)."""
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
