"""What ``accumulate_grads_in_fp32=True`` does under DDP and FSDP2 (2 gloo ranks, ``dist_launch``): refused.

* ``fsdp2``: FSDP2 reduce-scatters each backward's gradient itself; the binding finds its sharded
  (DTensor) parameters and refuses, pointing at FSDP2's ``reduce_dtype``, building no master and
  removing the scaler's hooks: the next backward is FSDP2's own.
* ``ddp``: DDP writes its all-reduced gradient into ``p.grad`` after the last micro-batch (outside
  ``no_sync``); the move refuses it, naming DDP, before anything is stepped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)


def batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * rank + micro)).to(torch.bfloat16)


def scaler() -> GradScaler:
    return GradScaler("cpu", init_scale=1.0, master_weights=True, accumulate_grads_in_fp32=True)


def fsdp2(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    fully_shard(net[0])
    fully_shard(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    s = scaler()
    s.scale(net(batch(rank, 0)).float().square().mean()).backward()
    out: dict[str, Any] = {"refused": None}
    try:
        s.step(optimizer)
    except ValueError as error:
        out["refused"] = str(error)
    out["masters"] = len(s.master_weights(optimizer))
    out["plain"] = all(type(p) is not torch.Tensor for g in optimizer.param_groups for p in g["params"])
    optimizer.zero_grad()
    net(batch(rank, 1)).float().square().mean().backward()  # FSDP2's own: every shard gets its gradient
    out["grads"] = all(p.grad is not None for p in net.parameters())
    return out


def ddp(rank: int) -> dict[str, Any]:
    model = nn.parallel.DistributedDataParallel(make_net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s = scaler()
    out: dict[str, Any] = {"refused": None}
    with model.no_sync():
        s.scale(model(batch(rank, 0)).float().square().mean()).backward()
    s.scale(model(batch(rank, 1)).float().square().mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        s.step(optimizer)
    except ValueError as error:
        out["refused"] = str(error)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return out


def scenarios(rank: int, world: int) -> dict[str, Any]:
    return {"fsdp2": fsdp2(rank), "ddp": ddp(rank)}
