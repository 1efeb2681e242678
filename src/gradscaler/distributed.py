"""Agreement on the overflow flag and the clip norm across processes, through torch.distributed.

Every rank must make the same skip decision: with sharded gradients (FSDP2, tensor parallel,
ZeRO-style optimizers) each rank checks only its part, so the flag is all-reduced with MAX before
anyone decides, and the clip norm is summed from every rank's part (MAX for the inf-norm).

Which collectives run is decided by ``resolve`` from the *parameters* alone: their meshes and
placements, which are the same on every rank holding the same model. Never from the gradients: a
rank whose micro-batch was empty (no ``.grad`` at all, or only some) issues exactly the collectives
its peers issue, with nothing to contribute. Collectives are issued on the current stream: with NCCL
they do not block the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class Agreement:
    """The collectives that make every rank agree on one optimizer's overflow flag and clip norm.

    Built by ``resolve`` from the parameters, so every rank holding the same parameters builds the
    same one, whatever gradients it holds. Valid while those parameters are.

    Attributes:
        groups: the process groups to reduce over, in the order every rank issues them. The flag is
            MAX-reduced over each in turn (the MAX over a product of groups).
        classes: for each class of parameters, the indices into ``groups`` over which its gradients
            are sharded: the product of those groups holds each of them exactly once. ``()``: whole
            on every rank (plain tensors, Replicate), counted once.
        class_of: ``id(param)`` -> index into ``classes``, for parameters not of class ``default``.
        default: the class of every other parameter.
        explicit: the user's ``process_group`` this was built from; None when found from the meshes.
    """

    groups: tuple[Any, ...] = ()
    classes: tuple[tuple[int, ...], ...] = ((),)
    class_of: Mapping[int, int] = field(default_factory=dict)
    default: int = 0
    explicit: Any | None = None

    def reduces(self) -> bool:
        """Whether any collective runs (a group to reduce over, and torch.distributed initialised)."""
        return bool(self.groups) and running()

    def class_labels(self, params: Sequence[torch.Tensor]) -> list[int]:
        """The index into ``classes`` of each of ``params``."""
        return [self.class_of.get(id(p), self.default) for p in params]


LOCAL = Agreement()
"""Nothing to agree on: this process alone decides (plain or Replicate parameters, or no process group)."""

_PLAIN = {torch.Tensor, torch.nn.Parameter}


def explicit_agreement(group: Any) -> Agreement:
    """The user's ``process_group``: every gradient is taken as partitioned over it."""
    return Agreement(groups=(group,), classes=((0,),), explicit=group)


def resolve(params: Sequence[torch.Tensor], explicit: Any | None = None) -> Agreement:
    """The collectives over which ``params``' gradients must agree, from the parameters alone.

    ``explicit`` (the scaler's ``process_group``) wins when given: nothing is inspected. Otherwise
    every DTensor parameter sharded over mesh dimensions of more than one rank names the groups of
    those dimensions (FSDP2: the data-parallel dimension; FSDP2 + tensor parallel: both); plain
    tensors and Replicate DTensors name none, since each rank holds all of them. Groups over the same
    ranks (a 2-d mesh's dimension and the 1-d mesh sliced from it) are one group. Every rank must
    pass the same parameters in the same order (as FSDP2 and DTensor tensor parallelism make them).

    Raises:
        ValueError: a parameter has a Partial placement over more than one rank: its local values
            are addends of the gradient, not a part of it. Raised from the parameters, so on every rank.

    Cost: one C-level pass over the types when every parameter is a plain tensor; DTensor parameters
    that share a mesh and placements are resolved once.
    """
    if explicit is not None:
        return explicit_agreement(explicit)
    if set(map(type, params)) <= _PLAIN:
        return LOCAL
    groups: list[Any] = []
    ranks: list[list[int] | None] = []
    classes: list[tuple[int, ...]] = [()]
    class_of: dict[int, int] = {}
    seen: dict[tuple[int, tuple[Any, ...]], int] = {}
    for index, param in enumerate(params):
        mesh = getattr(param, "device_mesh", None)
        placements = getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        key = (id(mesh), tuple(placements))
        label = seen.get(key)
        if label is None:
            over = tuple(sorted({_index_of(groups, ranks, group) for group in _shard_groups(index, mesh, placements)}))
            if over not in classes:
                classes.append(over)
            label = seen[key] = classes.index(over)
        if label:
            class_of[id(param)] = label
    if not groups:
        return LOCAL
    return Agreement(tuple(groups), tuple(classes), class_of)


def _shard_groups(index: int, mesh: Any, placements: Any) -> list[Any]:
    """The groups of the mesh dimensions of more than one rank over which a parameter is not
    replicated: every placement but Replicate (refused: Partial) splits it. A shard over one rank is
    the whole tensor."""
    out = []
    for dim, placement in enumerate(placements):
        if mesh.size(dim) == 1 or placement.is_replicate():
            continue
        if placement.is_partial():
            raise ValueError(
                "Give the parameter Shard or Replicate placements (DTensor.redistribute) before building "
                f"the optimizer. Parameter #{index} of this optimizer is a DTensor with a Partial placement "
                f"({', '.join(map(repr, placements))} on {mesh!r}): its local values are addends of the "
                "gradient, not a part of it, so no rank can check them for overflow or take their norm."
            )
        # Shard, and _StridedShard (FSDP2 over a tensor-parallel shard), whose is_shard() is False.
        out.append(mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group())
    return out


def _index_of(groups: list[Any], ranks: list[list[int] | None], group: Any) -> int:
    """The index of ``group`` in ``groups`` (the same object, or the same ranks), appended if new."""
    for i, known in enumerate(groups):
        if known is group:
            return i
    own = _group_ranks(group)
    for i, known_ranks in enumerate(ranks):
        if own is not None and own == known_ranks:
            return i  # two handles on the same ranks: either gives the same reduction
    groups.append(group)
    ranks.append(own)
    return len(groups) - 1


def _group_ranks(group: Any) -> list[int] | None:
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # not a registered ProcessGroup (or no default group): compare by identity only
        return None


def running() -> bool:
    """Whether torch.distributed has a default process group. Without one nothing is reduced, and no
    gradient can be sharded over a group (a DeviceMesh of several ranks needs one)."""
    return dist.is_available() and dist.is_initialized()


def agree_on_flag_(flag: torch.Tensor, agreement: Agreement) -> torch.Tensor:
    """All-reduce ``flag`` (0-d float) in place with MAX over each of ``agreement.groups``; no-op without one."""
    if agreement.reduces():
        for group in agreement.groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def reduce_norms(parts: torch.Tensor, norm_type: float, agreement: Agreement) -> torch.Tensor:
    """The norm over every rank, from this rank's norm of each class's gradients (``parts[k]`` for
    ``agreement.classes[k]``; 0 where it holds none), as a 0-d tensor of ``parts``' dtype.

    Each class's p-th power is summed over exactly the groups that shard it (MAX for the inf-norm),
    so a tensor sharded over one mesh dimension and replicated over another counts once. The
    reduction runs in float64 (one dtype on every rank, and no over- or underflow of the powers).
    Issues one collective per group, the same on every rank.
    """
    if not agreement.reduces():
        return torch.linalg.vector_norm(parts, norm_type)
    infinite = math.isinf(norm_type)
    wire = parts.double() if infinite else parts.double().pow(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for g, group in enumerate(agreement.groups):
        members = [k for k, over in enumerate(agreement.classes) if g in over]
        if len(members) == len(agreement.classes):
            dist.all_reduce(wire, op=op, group=group)
        else:
            picked = wire[members]
            dist.all_reduce(picked, op=op, group=group)
            wire[members] = picked
    total = wire.amax() if infinite else wire.sum().pow(1.0 / norm_type)
    return total.to(parts.dtype)
