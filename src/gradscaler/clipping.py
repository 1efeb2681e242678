"""Scale-aware gradient clipping from one read of the gradients (``GradScaler.clip_grad_norm_``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from gradscaler import distributed, grads, optim

if TYPE_CHECKING:
    from gradscaler.scaler import GradScaler


def _check_arguments(max_norm: float, norm_type: float) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}.")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a float (a p > 0 or inf), got {type(norm_type).__name__}.")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type must be a p > 0 or inf, got {norm_type!r}.")
    return float(norm_type)


def total_norm(norms: dict[torch.device, torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of per-tensor norms spread over devices, as a 0-d float32 on ``device``."""
    parts = [torch.linalg.vector_norm(n, norm_type).to(device, non_blocking=True) for n in norms.values()]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), norm_type)


def clip_grad_norm_(
    scaler: GradScaler, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """See ``GradScaler.clip_grad_norm_``."""
    from gradscaler.scaler import OptState

    norm_type = _check_arguments(max_norm, norm_type)
    if not scaler._enabled:
        params = [p for p in grads.iter_params(optimizer) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    scale, _ = scaler._check_scale_growth_tracker("clip_grad_norm_")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("clip_grad_norm_() is being called after step().")
    if state.get("clipped"):
        raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")
    unscaled = state["stage"] is OptState.UNSCALED
    fused = optim.supports_amp_scaling(optimizer) and not optim.takes_grad_scaler_kwarg(optimizer)
    owners = grads.new_groups()
    groups = grads.group_grads(optimizer, allow_fp16=fused and not unscaled, owners=owners)
    norms, flags = grads.norms_and_check(groups, norm_type)
    if not unscaled:
        scaler._record_found_inf(optimizer, state, flags)
    total = distributed.reduce_norm_(total_norm(norms, norm_type, scale.device), norm_type, scaler._group(optimizer))
    inv_scale = torch.ones((), device=scale.device) if unscaled else scaler._inv_scale()
    total = total * inv_scale
    scaler._grad_norms[id(optimizer)] = [
        ([p for params in owners[device].values() for p in params], device_norms, inv_scale)
        for device, device_norms in norms.items()
    ]
    coef = (max_norm / (total + 1e-6)).clamp_(max=1.0)
    if fused and not unscaled:
        state["grad_scale"] = scale / coef * getattr(optimizer, "grad_scale", 1)
    else:
        factor = coef * inv_scale
        for device, by_dtype in groups.items():
            device_factor = factor.to(device, non_blocking=True)
            for tensors in by_dtype.values():
                torch._foreach_mul_(tensors, device_factor)
    state["stage"] = OptState.UNSCALED
    state["clipped"] = True
    return total
