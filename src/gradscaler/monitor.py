"""What the scaler tells its user: stats, loggers, overflow attribution and collapse detection."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradscaler.errors import COLLAPSE_CAUSES, ScaleCollapseError, ScaleCollapseWarning
from gradscaler.telemetry import COUNTERS

if TYPE_CHECKING:
    from gradscaler.scaler import GradScaler


def stats(scaler: GradScaler) -> dict[str, Any]:
    """The scaler's counters and trackers as Python numbers (reads the device: syncs)."""
    out: dict[str, Any] = {"scale": scaler.get_scale(), "steps": scaler._steps}
    if scaler._telemetry is not None:
        out.update(scaler._telemetry.read())
    else:
        out.update(zip(COUNTERS, scaler._init_counters, strict=True))
    out["growth_tracker"] = scaler._get_growth_tracker()
    tracker = scaler._hysteresis_tracker
    out["hysteresis_left"] = scaler._init_hysteresis_tracker if tracker is None else int(tracker.item())
    return out


def _label(scaler: GradScaler, param: torch.Tensor, where: str) -> str:
    return scaler._param_names.get(id(param)) or f"{where} {tuple(param.shape)}"


def last_grad_norms(scaler: GradScaler) -> dict[str, float]:
    """Unscaled per-parameter norms recorded by the last clipping pass of each optimizer."""
    out: dict[str, float] = {}
    for records in scaler._grad_norms.values():
        for params, norms, factor in records:
            values = (norms * factor.to(norms.device)).tolist()
            out.update(
                {_label(scaler, p, f"parameter {i}"): v for i, (p, v) in enumerate(zip(params, values, strict=True))}
            )
    return out


def nonfinite_parameters(scaler: GradScaler) -> list[str]:
    """Names of parameters of the last iteration's optimizers whose gradients are not finite."""
    labelled: list[tuple[str, torch.Tensor]] = []
    for ref in scaler._last_optimizers or []:
        optimizer = ref()
        if optimizer is None:
            continue
        for gi, group in enumerate(optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                name = _label(scaler, param, f"param_groups[{gi}][{pi}]")
                grad = param.grad
                values = grad.coalesce()._values() if grad.is_sparse else grad
                labelled.append((name, torch.isfinite(values).all().logical_not().cpu()))
    if not labelled:
        return []
    bad = torch.stack([flag for _, flag in labelled]).tolist()
    return [name for (name, _), is_bad in zip(labelled, bad, strict=True) if is_bad]


def after_update(scaler: GradScaler) -> None:
    """Feed loggers and check for collapse, on counters that have landed on the host (no sync)."""
    telemetry = scaler._telemetry
    if telemetry is None or (not scaler._loggers and scaler._collapse_patience is None):
        return
    landed = telemetry.landed()
    if landed is None:
        return
    for callback, every in scaler._loggers:
        if scaler._steps % every == 0:
            callback({"step": scaler._steps, **landed})
    patience = scaler._collapse_patience
    run = landed["collapse_run"]
    if patience is None or run < patience:
        scaler._collapse_reported_at = -1
        return
    if scaler._collapse_reported_at >= 0:
        return
    scaler._collapse_reported_at = scaler._steps
    names = nonfinite_parameters(scaler)
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    message = (
        f"Loss scale collapsed at step {scaler._steps}: {run} consecutive overflowing steps at the minimum "
        f"scale {landed['scale']:g}; every one of them was skipped. Parameters with non-finite gradients "
        f"now: {shown or 'none (the gradients of the current step are finite)'}. {COLLAPSE_CAUSES} "
        "Call scaler.name_parameters(model) for names; pass on_collapse='warn' or collapse_patience=None "
        "to keep training."
    )
    if scaler._on_collapse == "raise":
        raise ScaleCollapseError(message)
    warnings.warn(message, ScaleCollapseWarning, stacklevel=3)


class JsonLinesLogger:
    """A ``GradScaler.add_logger`` callback that appends one JSON object per call to ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
