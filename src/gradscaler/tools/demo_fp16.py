"""The demo's two runs with float16 parameters: what each step did to the float16 values.

``gradscaler demo`` trains the model cast to float16 (``model.half()``) twice:

* "fp16 parameters + master weights": ``GradScaler(device, master_weights=True)`` with the same
  AdamW as the float32 runs. The optimizer steps float32 masters; the float16 parameters are the
  masters rounded. A master update smaller than half of float16's spacing at the parameter's value
  moves the master and leaves the float16 value where it was: the master keeps it, and enough of
  them add up to a float16 step later.
* "fp16 parameters, no masters": the way torch lets a float16 model train with a scaler and no
  masters, ``torch.optim.AdamW(..., fused=True)`` on the float16 parameters (a fused optimizer takes
  float16 gradients and the scaler's ``grad_scale`` / ``found_inf``, so neither torch's scaler nor
  ours refuses it; ``unscale_`` would). The fused kernel computes in float32 but stores the
  parameters and both moments in float16. Its gradients are summed over ranks while still scaled,
  in float16, as DDP's all-reduce sums a float16 model's gradients.

``UpdateWatch`` measures, on every applied step, the updates that rounded to nothing in float16
(the float16 value did not move although the optimizer moved the master, or, without masters,
although the parameter had a nonzero gradient), and, without masters, the share of AdamW's
second-moment entries that were 0 after the first applied step although their gradient was not.
"""

from __future__ import annotations

import copy
import math
from typing import Any, TypeVar

import torch
from torch import nn

from gradscaler import GradScaler

MASTERS = "fp16 parameters + master weights"
NO_MASTERS = "fp16 parameters, no masters"
FP16_PARAMETERS = (MASTERS, NO_MASTERS)

Model = TypeVar("Model", bound=nn.Module)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps (with ``master_weights=True``: the float32 masters)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def float32_copy(model: Model) -> Model:
    """A float32 copy of ``model``: its float16 weights, evaluated in float32 arithmetic."""
    return copy.deepcopy(model).float()


class UpdateWatch:
    """Counts, over the applied steps of one float16-parameter run, the updates lost to float16 rounding.

    Call ``before`` after the gradients are ready (and, with masters, after ``unscale_``) and ``after``
    once ``update()`` has run.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: GradScaler) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.updates = 0  # elements the optimizer meant to move, over all applied steps
        self.lost = 0  # of those, elements whose float16 value did not move
        self.second_moment_zero_share: float | None = None
        self.largest_weight = 0.0  # largest finite |float16 weight| seen after a step
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def before(self) -> None:
        """Note the float16 values and, per element, whether the optimizer is meant to move it."""
        pairs = self.scaler.master_weights(self.optimizer)
        with torch.no_grad():
            if pairs:  # masters: the master's value; whether it moved tells an update
                self._saved = [(low, low.detach().clone(), master.detach().clone()) for low, master in pairs]
            else:  # no masters: a nonzero gradient means an update
                self._saved = [
                    (p, p.detach().clone(), p.grad != 0) for p in self.model.parameters() if p.grad is not None
                ]

    def after(self) -> None:
        """Count the lost updates of an applied step (a skipped one changes nothing and is not counted)."""
        saved, self._saved = self._saved, []
        if self.scaler.last_step_skipped():
            return
        masters = {id(low): master for low, master in self.scaler.master_weights(self.optimizer)}
        with torch.no_grad():
            for low, value, reference in saved:
                master = masters.get(id(low))
                meant = reference != master if master is not None else reference
                still = low.detach() == value
                self.updates += int(meant.sum())
                self.lost += int((meant & still).sum())
                finite = low.detach()[torch.isfinite(low.detach())]
                if finite.numel():
                    self.largest_weight = max(self.largest_weight, float(finite.abs().max()))
            if self.second_moment_zero_share is None and not masters:
                self.second_moment_zero_share = self._second_moment_zeros(saved)

    def _second_moment_zeros(self, saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float | None:
        """Share of AdamW's float16 ``exp_avg_sq`` entries that are 0 where the gradient was not."""
        zeros = total = 0
        for param, _, nonzero_grad in saved:
            moment = self.optimizer.state.get(param, {}).get("exp_avg_sq")
            if moment is None:
                return None
            zeros += int(((moment == 0) & nonzero_grad).sum())
            total += int(nonzero_grad.sum())
        return zeros / total if total else None

    def numbers(self) -> dict[str, Any]:
        """What the run reports: the lost-update share and, without masters, the moment underflow."""
        return {
            "lost_update_share": self.lost / self.updates if self.updates else None,
            "second_moment_zero_share": self.second_moment_zero_share,
            "largest_weight": self.largest_weight,
        }


def masters_line(run: dict[str, Any]) -> str:
    """What the masters kept: the applied updates too small to move a float16 value."""
    share = run.get("lost_update_share")
    if share is None:
        return ""
    return (
        f" {100 * share:.2f}% of the masters' updates were below float16's resolution at their parameter "
        "(the float16 value did not move); the masters kept them."
    )


def no_masters_line(run: dict[str, Any], fp32: float, tolerance: float) -> str:
    """The reading of the float16 run without masters, from what it measured."""
    losses = run["losses"]
    broken = next((step for step, loss in enumerate(losses) if not math.isfinite(loss)), None)
    lag = (run["final_loss"] - fp32) / fp32
    if broken is not None or not math.isfinite(lag):
        outcome = "DIVERGED"
    else:
        outcome = "LAGS" if lag > tolerance else "no lag at this size"
    head = f"{NO_MASTERS} (fused AdamW, its moments in float16) ends {100 * lag:+.1f}% from the fp32 loss"
    parts = [f"{head}: {outcome}."]
    zeros = run.get("second_moment_zero_share")
    if zeros:
        parts.append(
            f"After its first applied step {100 * zeros:.0f}% of AdamW's second-moment entries were 0 in float16 "
            "((1 - beta2) * g**2 under 2**-25 rounds to 0) where the gradient was not, so those updates were m / eps;"
        )
        parts.append(f"its largest weight reached {run['largest_weight']:.3g}.")
    if broken is not None:
        parts.append(
            f"The training loss was first non-finite at step {broken}, and {run['skipped_steps']} of "
            f"{len(losses)} steps were skipped."
        )
    share = run.get("lost_update_share")
    if share is not None:
        parts.append(f"Of the updates it applied, {100 * share:.2f}% rounded to nothing in float16.")
    return " ".join(parts)
