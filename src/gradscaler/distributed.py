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
    """The process group that shards ``tensor`` when it is a DTensor with a sharded placement."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return None
    dims = [i for i, placement in enumerate(placements) if placement.is_shard()]
    if not dims:
        return None
    if len(dims) == 1 and mesh.ndim > 1:
        return mesh.get_group(dims[0])
    if mesh.ndim == 1:
        return mesh.get_group()
    raise NotImplementedError(
        "DTensor gradients sharded over several mesh dimensions need an explicit process_group: "
        f"placements {placements!r} on a {mesh.ndim}-d mesh."
    )


def agreement_group(grads: Iterable[torch.Tensor], explicit: Any | None = None) -> Any | None:
    """The group over which these gradients' overflow flag and clip norm are reduced (``explicit`` wins)."""
    if explicit is not None:
        return explicit
    for grad in grads:
        return dtensor_group(grad)
    return None


def agree_on_flag_(flag: torch.Tensor, group: Any | None) -> torch.Tensor:
    """All-reduce ``flag`` (0-d float) in place with MAX over ``group``; no-op without a group."""
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def reduce_norm_(total: torch.Tensor, norm_type: float, group: Any | None) -> torch.Tensor:
    """Combine per-rank partial norms of shards into the norm of the whole (in place, 0-d float32)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return total
    if math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powered = total.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return total.copy_(powered.pow(1.0 / norm_type))
