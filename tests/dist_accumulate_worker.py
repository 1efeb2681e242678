"""What ``accumulate_grads_in_fp32=True`` does under DDP and FSDP2 (2 gloo ranks, ``dist_launch``).

* ``fsdp2``: FSDP2 reduce-scatters each backward's gradient itself; the binding finds its sharded
  (DTensor) parameters and refuses, pointing at FSDP2's ``reduce_dtype``, building no master and
  removing the scaler's hooks: the next backward is FSDP2's own.
* ``ddp``: DDP writes its all-reduced gradient into ``p.grad`` after the last micro-batch (outside
  ``no_sync``); without ``scaler.register_ddp(model)`` the move refuses it, pointing at that call, before
  anything is stepped.
* ``trained``: with ``scaler.register_ddp(model)``, DDP with ``no_sync()`` on all micro-batches but the
  last (or synced on every one), each rank its own data, against the recipe by hand on the same rank:
  float32 copies summing each backward's gradient, then at the move one ``all_reduce`` (SUM) of the sums
  flattened in parameter order, divided by the world size, and torch's scaler over the copies. An input
  holding inf on rank 1 in one micro-batch of ``BAD_ITERATION``: both ranks skip that step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
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


ITERATIONS = 4
BAD_ITERATION = 1
MAX_NORM = 0.05
CASES = (  # (optimizer, micro-batches, no_sync on all micro-batches but the last, DDP's gradient_as_bucket_view,
    # unscale_ + torch's clip_grad_norm_ over the model's parameters)
    ("adamw", 1, True, False, False),
    ("adamw", 4, True, False, False),
    ("sgd", 4, True, False, False),
    ("sgd", 1, True, False, False),
    ("adamw", 4, False, False, False),
    ("adamw", 4, True, True, False),
    ("sgd", 4, True, False, True),
)


def case_name(kind: str, micros: int, no_sync: bool, bucket_view: bool, clip: bool) -> str:
    name = f"{kind}-{micros}-{'no_sync' if no_sync else 'synced'}"
    return name + ("-bucket_view" if bucket_view else "") + ("-clip" if clip else "")


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def data(rank: int, iteration: int, micro: int) -> torch.Tensor:
    x = batch(rank, 100 * iteration + micro)
    if rank == 1 and iteration == BAD_ITERATION and micro == 0:
        x[0, 0] = float("inf")  # non-finite gradients on rank 1 only
    return x


def loss_of(out: torch.Tensor, micros: int) -> torch.Tensor:
    return out.float().square().mean() / micros


def trained_ours(rank: int, kind: str, micros: int, no_sync: bool, bucket_view: bool, clip: bool) -> dict[str, Any]:
    model = nn.parallel.DistributedDataParallel(make_net(), gradient_as_bucket_view=bucket_view)
    optimizer = make_optimizer(kind, model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10, master_weights=True, accumulate_grads_in_fp32=True)
    s.register_ddp(model)
    params, scales, skipped, norms = [], [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(micros):
            last = micro == micros - 1
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():
                s.scale(loss_of(model(data(rank, iteration, micro)), micros)).backward()
        if clip:
            s.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        s.step(optimizer)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(s.get_scale())
        skipped.append(s.last_step_skipped())
    grads_left = [p.grad for p in model.parameters()]
    return {"params": params, "scales": scales, "skipped": skipped, "grads_left": grads_left, "norms": norms}


def all_reduce_sums(copies: list[torch.Tensor], world: int) -> None:
    """The recipe's reduction: every copy's float32 sum flattened, one SUM, divided by the world size."""
    flat = torch.cat([c.grad.reshape(-1) for c in copies])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for c in copies:
        c.grad = flat[offset : offset + c.numel()].view(c.shape).clone()
        offset += c.numel()


def add_sums(lows: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """The recipe after a backward: each gradient added into its copy's float32 sum, ``p.grad`` dropped (a
    parameter without a gradient leaves its copy's sum as it is)."""
    for p, c in zip(lows, copies, strict=True):
        if p.grad is not None:
            g = p.grad.float()
            c.grad = g if c.grad is None else c.grad + g
            p.grad = None


def copy_back(lows: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """The recipe's copy back after a step: each float32 copy rounded into its parameter."""
    with torch.no_grad():
        for p, c in zip(lows, copies, strict=True):
            p.copy_(c)


def trained_recipe(rank: int, world: int, kind: str, micros: int, clip: bool) -> dict[str, Any]:
    net = make_net()
    lows = list(net.parameters())
    copies = [p.detach().float().requires_grad_() for p in lows]
    optimizer = make_optimizer(kind, copies)
    s = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    params, scales = [], []
    for iteration in range(ITERATIONS):
        for micro in range(micros):
            s.scale(loss_of(net(data(rank, iteration, micro)), micros)).backward()
            for p, c in zip(lows, copies, strict=True):
                g = p.grad.float()  # type: ignore[union-attr]
                c.grad = g if micro == 0 else c.grad + g
                p.grad = None
        all_reduce_sums(copies, world)
        if clip:
            s.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(copies, MAX_NORM)
        s.step(optimizer)
        if not s._found_inf_per_device(optimizer)[torch.device("cpu")].item():
            copy_back(lows, copies)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in lows])
        scales.append(s.get_scale())
    return {"params": params, "scales": scales}


def trained(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for kind, micros, no_sync, bucket_view, clip in CASES:
        out[case_name(kind, micros, no_sync, bucket_view, clip)] = {
            "ours": trained_ours(rank, kind, micros, no_sync, bucket_view, clip),
            "recipe": trained_recipe(rank, world, kind, micros, clip),
        }
    return out


class Experts(nn.Module):
    """A shared layer, an expert only rank 0 uses, and one no rank uses (bfloat16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 2)
        self.dead = nn.Linear(4, 2)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        return h.sum(dim=1, keepdim=True) + (self.expert(h) if rank == 0 else 0)


def experts_ours(rank: int) -> dict[str, Any]:
    model = nn.parallel.DistributedDataParallel(Experts(), find_unused_parameters=True)
    optimizer = make_optimizer("adamw", model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10, master_weights=True, accumulate_grads_in_fp32=True)
    s.register_ddp(model)
    params = []
    for iteration in range(3):
        for micro in range(2):
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                s.scale(loss_of(model(batch(rank, 10 * iteration + micro), rank), 2)).backward()
        s.step(optimizer)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"params": params}


def experts_recipe(rank: int, world: int) -> dict[str, Any]:
    net = Experts()
    lows = list(net.parameters())
    copies = [p.detach().float().requires_grad_() for p in lows]
    optimizer = make_optimizer("adamw", copies)
    s = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    params = []
    for iteration in range(3):
        for micro in range(2):
            s.scale(loss_of(net(batch(rank, 10 * iteration + micro), rank), 2)).backward()
            add_sums(lows, copies)
        # zeros where this rank has no sum, a flag per copy: a copy no rank gave a gradient gets none
        flat = torch.cat([c.grad.reshape(-1) if c.grad is not None else torch.zeros(c.numel()) for c in copies])
        flags = torch.tensor([float(c.grad is not None) for c in copies])
        dist.all_reduce(flat)
        dist.all_reduce(flags)
        flat.div_(world)
        offset = 0
        for c, seen in zip(copies, flags.tolist(), strict=True):
            c.grad = flat[offset : offset + c.numel()].view(c.shape).clone() if seen else None
            offset += c.numel()
        s.step(optimizer)
        copy_back(lows, copies)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in lows])
    return {"params": params, "initial": [p.detach().clone() for p in Experts().parameters()]}


def _frozen_at_register(model: nn.Module, frozen: bool) -> None:
    for p in model[0].parameters():
        p.requires_grad_(not frozen)


def unfrozen_later_ours(rank: int) -> dict[str, Any]:
    """Issue 46 item 5: the first layer frozen after DDP wrapped it (DDP reduces it) and before
    ``register_ddp``, unfrozen after the first iteration: its sums are averaged like every other layer's."""
    model = nn.parallel.DistributedDataParallel(make_net(), find_unused_parameters=True)
    optimizer = make_optimizer("adamw", model.parameters())
    _frozen_at_register(model.module, True)
    s = GradScaler("cpu", init_scale=2.0**10, master_weights=True, accumulate_grads_in_fp32=True)
    s.register_ddp(model)
    params = []
    for iteration in range(3):
        if iteration == 1:
            _frozen_at_register(model.module, False)
        for micro in range(2):
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                s.scale(loss_of(model(batch(rank, 10 * iteration + micro)), 2)).backward()
        s.step(optimizer)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return {"params": params}


def unfrozen_later_recipe(rank: int, world: int) -> dict[str, Any]:
    net = make_net()
    lows = list(net.parameters())
    copies = [p.detach().float().requires_grad_() for p in lows]
    optimizer = make_optimizer("adamw", copies)
    _frozen_at_register(net, True)
    s = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    params = []
    for iteration in range(3):
        if iteration == 1:
            _frozen_at_register(net, False)
        for micro in range(2):
            s.scale(loss_of(net(batch(rank, 10 * iteration + micro)), 2)).backward()
            add_sums(lows, copies)
        present = [c for c in copies if c.grad is not None]
        all_reduce_sums(present, world)
        s.step(optimizer)
        copy_back(lows, copies)
        s.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in lows])
    return {"params": params}


def scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        "fsdp2": fsdp2(rank),
        "ddp": ddp(rank),
        "trained": trained(rank, world),
        "experts": {"ours": experts_ours(rank), "recipe": experts_recipe(rank, world)},
        "unfrozen_later": {"ours": unfrozen_later_ours(rank), "recipe": unfrozen_later_recipe(rank, world)},
    }
