"""What the move of a float16/bfloat16 parameter's gradient into its master finds (``Moved``), and which
gradients its one pass takes (``movable``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from gradscaler import grads
from gradscaler.kernels import GradStats, grad_stats, moved
from gradscaler.masters.checks import LOW_PRECISION

_LAYOUT = operator.attrgetter("layout")


@dataclass
class Moved:
    """What one ``move`` pass found, per device: the non-finite flag of the gradients it moved, their
    per-tensor norms (when asked) with the masters they belong to in the same order, and the masters'
    new gradients (checkable views, by device and dtype) for a later multiply."""

    flags: dict[torch.device, torch.Tensor]
    norms: dict[torch.device, torch.Tensor]
    owners: dict[torch.device, list[torch.Tensor]]
    master_grads: grads.GradGroups

    def add(self, owners: list[torch.Tensor], moved: list[torch.Tensor], stats: GradStats) -> None:
        """Fold in one batch: the ``moved`` gradients of ``owners`` (one device) and their pass's stats."""
        device = moved[0].device
        flag = self.flags.get(device)
        self.flags[device] = stats.nonfinite if flag is None else grads.combine_flags([flag, stats.nonfinite])
        self.master_grads[device][torch.float32].extend(moved)
        if stats.norms is not None:
            before = self.norms.get(device)
            self.norms[device] = stats.norms if before is None else torch.cat([before, stats.norms])
        self.owners.setdefault(device, []).extend(owners)

    def after(
        self, norms: dict[torch.device, torch.Tensor], owners: grads.Owners, order: list[torch.Tensor]
    ) -> tuple[dict[torch.device, torch.Tensor], grads.Owners]:
        """Another pass's per-device norms and their owners joined with this pass's, each device's in
        the order of ``order`` (the optimizer's parameters), as clipping the masters by hand sums them."""
        joined_norms, joined_owners = dict(norms), dict(owners)
        position = {id(p): i for i, p in enumerate(order)} if self.norms else {}
        for device, mine in self.norms.items():
            before = joined_norms.get(device)
            joined_norms[device] = mine if before is None else torch.cat([before, mine])
            joined_owners[device] = joined_owners.get(device, []) + self.owners[device]
            places = [position[id(p)] for p in joined_owners[device]]
            if places != sorted(places):
                permutation = sorted(range(len(places)), key=places.__getitem__)
                index = torch.tensor(permutation).to(device, non_blocking=True)
                joined_norms[device] = joined_norms[device].index_select(0, index)
                joined_owners[device] = [joined_owners[device][i] for i in permutation]
        return joined_norms, joined_owners

    def rest(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the masters whose gradients this pass moved and checked."""
        if not self.owners:
            return params
        moved = [m for owners in self.owners.values() for m in owners]
        if len(moved) == len(params) and all(map(operator.is_, moved, params)):
            return []  # every parameter, in their order (a float16 model's step): no set of ids to build
        covered = {id(m) for m in moved}
        return [p for p in params if id(p) not in covered]


NOTHING = Moved({}, {}, {}, {})
"""What ``move`` returns when there is nothing to move: no masters, or moved earlier this iteration."""


def copied_stats(
    view: torch.Tensor, factor: torch.Tensor | None, norm_type: float | None, norm_inv: torch.Tensor | None
) -> GradStats:
    """The flag (and norm) of a copied master gradient (``view``: its checkable values), read before
    ``factor`` multiplies it in place (torch's check-and-unscale, whose flag serves when no norm is asked)."""
    stats = grad_stats([view], norm_type, norm_inv) if norm_type is not None or factor is None else None
    if factor is not None:
        flag = torch.zeros((), dtype=torch.float32, device=view.device)
        torch._amp_foreach_non_finite_check_and_unscale_([view], flag, moved(factor, view.device, torch.float32))
        if stats is None:
            return GradStats(flag, None)
    assert stats is not None  # asked for above whenever no factor gives the flag
    return stats


def dense(grad: torch.Tensor) -> bool:
    """Whether ``kernels.move_grads_`` takes ``grad`` (a plain contiguous tensor)."""
    return type(grad) is torch.Tensor and grad.layout is torch.strided and grad.is_contiguous()


def movable(grad: torch.Tensor) -> bool:
    """Whether the move's one pass takes ``grad``: dense, and float16 or bfloat16 (after ``model.float()``
    a bound parameter's gradient is float32, copied as it is)."""
    return dense(grad) and grad.dtype in LOW_PRECISION


def one_batch(moving: list[torch.Tensor]) -> bool:
    """Whether the gradients ``moving`` are all plain contiguous tensors of one device and one dtype,
    float16 or bfloat16 (each ``movable``, all in one batch), asked of the whole list at once."""
    if not moving or set(map(type, moving)) != {torch.Tensor} or set(map(_LAYOUT, moving)) != {torch.strided}:
        return False
    if not all(map(torch.Tensor.is_contiguous, moving)):  # one C-level pass, no bytecode per gradient
        return False
    kinds = torch._C._group_tensors_by_device_and_dtype([moving], False)  # type: ignore[list-item]
    return len(kinds) == 1 and next(iter(kinds))[1] in LOW_PRECISION


def grad_buffers(masters: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where each of ``grads`` moves in float32: its master's gradient if that is a plain contiguous tensor, else a
    new one like the gradient, set as the master's (dense, contiguous: ``empty_like``, a quarter of the host time
    of ``torch.empty(shape, ...)``). One loop, no call per master."""
    outs = [master.grad for master in masters]
    for index, out in enumerate(outs):
        if out is None or type(out) is not torch.Tensor or not out.is_contiguous():
            outs[index] = masters[index].grad = torch.empty_like(grads[index], dtype=torch.float32)
    return outs  # type: ignore[return-value]  # every None replaced above
