"""Agreement on the overflow flag across processes, through torch.distributed.

Every rank must make the same skip decision: with sharded gradients (FSDP2, ZeRO-style optimizers,
tensor parallel) each rank checks only its shard, so the flag is all-reduced with MAX over the group
before anyone decides. Norms for clipping are reduced as the sum of p-th powers (max for p = inf).
Collectives are issued on the current stream: with NCCL they do not block the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def dtensor_group(tensor: torch.Tensor) -> Any | None:
    """The process group that shards ``tensor``: a DTensor sharded over a mesh dimension of more than
    one rank; None for plain tensors, Replicate-only DTensors and shards over a one-rank dimension."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return None
    return _shard_group(mesh, placements)


def _shard_group(mesh: Any, placements: Any) -> Any | None:
    """``dtensor_group`` from a DTensor's mesh and placements (a shard over one rank is the whole tensor)."""
    dims = [i for i, placement in enumerate(placements) if placement.is_shard() and mesh.size(i) > 1]
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0]) if mesh.ndim > 1 else mesh.get_group()
    raise NotImplementedError(
        "DTensor gradients sharded over several mesh dimensions need an explicit process_group: "
        f"placements {placements!r} on a {mesh.ndim}-d mesh."
    )


def _group_ranks(group: Any) -> list[int] | None:
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # not a registered ProcessGroup (or no default group): compare by identity only
        return None


def _describe(index: int, mesh: Any, placements: Any, ranks: list[int] | None) -> str:
    over = f"ranks {ranks}" if ranks is not None else "an unknown group"
    return f"gradient #{index} ({', '.join(map(repr, placements))} on {mesh!r}) reduces over {over}"


_NEVER_SHARDED = {torch.Tensor, type(None)}


def agreement_group(grads: Iterable[torch.Tensor], explicit: Any | None = None) -> Any | None:
    """The process group over which the overflow flag (and clip norm) of these gradients must be reduced.

    ``explicit`` (the scaler's ``process_group``) wins when given. Otherwise every gradient that is a
    DTensor sharded over a mesh dimension of more than one rank names the group of that dimension
    (as ``dtensor_group`` computes it); Replicate-only DTensors and plain tensors name none, since each
    rank holds all of them. The order of the gradients does not matter: all the named groups must be
    the same group (the same object, or the same ranks), which is returned; ``None`` when none is named.

    Raises:
        ValueError: two gradients are sharded over different groups (e.g. different meshes or mesh
            dimensions): no single reduction makes every rank agree, the user must pass one.
        NotImplementedError: a gradient is sharded over several mesh dimensions (see ``dtensor_group``).

    Cost: one C-level pass over the types when every gradient is a plain tensor (or None); DTensor
    gradients that share a mesh and placements are resolved once per call.
    """
    if explicit is not None:
        return explicit
    grads = list(grads)
    if set(map(type, grads)) <= _NEVER_SHARDED:
        return None
    plain = torch.Tensor
    found: Any | None = None
    found_at: tuple[int, Any, Any] | None = None
    resolved: dict[tuple[int, Any], Any | None] = {}
    for index, grad in enumerate(grads):
        if type(grad) is plain or grad is None:
            continue
        mesh = getattr(grad, "device_mesh", None)
        placements = getattr(grad, "placements", None)
        if mesh is None or placements is None:
            continue
        key = (id(mesh), tuple(placements))
        if key in resolved:
            group = resolved[key]
        else:
            group = resolved[key] = _shard_group(mesh, placements)
        if group is None or group is found:
            continue
        if found_at is None:
            found, found_at = group, (index, mesh, placements)
            continue
        ranks, found_ranks = _group_ranks(group), _group_ranks(found)
        if ranks is not None and ranks == found_ranks:
            continue  # two handles on the same ranks: either gives the same reduction
        raise ValueError(
            "The gradients of this optimizer are sharded over different process groups, so no single "
            f"reduction of the overflow flag makes every rank agree: {_describe(*found_at, found_ranks)}, "
            f"but {_describe(index, mesh, placements, ranks)}. Pass process_group= to GradScaler "
            "explicitly: a group spanning every rank that holds a shard of any of these gradients "
            "(e.g. torch.distributed.group.WORLD)."
        )
    return found


def running() -> bool:
    """Whether torch.distributed has a default process group. Without one nothing is reduced, and no
    gradient can be sharded over a group (a DeviceMesh of several ranks needs one)."""
    return dist.is_available() and dist.is_initialized()


def is_sharded(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a DTensor sharded over a mesh dimension of more than one rank (each rank holds part)."""
    return type(grad) is not torch.Tensor and dtensor_group(grad) is not None


def agree_on_flag_(flag: torch.Tensor, group: Any | None) -> torch.Tensor:
    """All-reduce ``flag`` (0-d float) in place with MAX over ``group``; no-op without a group."""
    if group is not None and running():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def reduce_norm_(total: torch.Tensor, norm_type: float, group: Any | None) -> torch.Tensor:
    """Combine per-rank partial norms of shards into the norm of the whole (in place, 0-d float32)."""
    if group is None or not running():
        return total
    if math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powered = total.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return total.copy_(powered.pow(1.0 / norm_type))
