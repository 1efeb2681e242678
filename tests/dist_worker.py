"""Worker processes for the distributed tests: gloo on the CPU, loopback only.

``main(rank, world, port, out_dir)`` runs every scenario and saves one result file per rank; the
test process compares them. Scenarios inject an inf into ONE rank's gradient shard at ``BAD_STEP``.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradscaler import GradScaler

STEPS = 8
BAD_STEP = 3
GLOBAL_BATCH = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 2, generator=gen)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], Any]:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return [t.detach().clone() for t in local], copy.deepcopy(opt.state_dict()["state"])


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        a = a.to_local() if hasattr(a, "to_local") else a
        b = b.to_local() if hasattr(b, "to_local") else b
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return bool(a == b)


def record(
    trace: dict[str, list[Any]], scaler: GradScaler, before: Any, params: list[torch.Tensor], opt: torch.optim.Optimizer
) -> None:
    after = snapshot(params, opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    trace["scale"].append(scaler.get_scale())
    trace["skipped"].append(scaler.last_step_skipped())
    trace["unchanged"].append(unchanged and same_state(before[1], after[1]))


def finish_step(
    trace: dict[str, list[Any]],
    scaler: GradScaler,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    clip: bool,
    norm_ref: float | None = None,
) -> None:
    """Optional clipping, step, update, and the record of what the step did."""
    before = snapshot(params, opt)
    if clip:
        if norm_ref is not None:
            trace["norm_ref"].append(norm_ref)
        trace["norm"].append(float(scaler.clip_grad_norm_(opt, 0.5)))
    scaler.step(opt)
    scaler.update()
    record(trace, scaler, before, params, opt)


def full_norm(grads: list[torch.Tensor], scale: float) -> float:
    """float64 L2 norm of whole (unsharded) gradients, unscaled."""
    per_tensor = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
    return float(torch.linalg.vector_norm(per_tensor)) / scale


def hand_sharded(rank: int, world: int, clip: bool) -> dict[str, Any]:
    """Replicated model; parameter i belongs to rank i % world; owners broadcast after stepping."""
    model = make_model()
    params = list(model.parameters())
    owned = [p for i, p in enumerate(params) if i % world == rank]
    opt = torch.optim.AdamW(owned, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, process_group=dist.group.WORLD)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(STEPS):
        model.zero_grad()
        x, y = local_batch(step, rank, world)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        for p in params:  # data-parallel average of the gradients
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        if step == BAD_STEP and rank == world - 1:
            owned[0].grad.view(-1)[0] = math.inf  # only this rank's shard is bad
        reference = full_norm([p.grad for p in params], scaler.get_scale()) if clip else None
        finish_step(trace, scaler, opt, owned, clip, reference)
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % world)
    trace["params"] = [p.detach().clone() for p in params]
    return trace


def ddp(rank: int, world: int, fused: bool, clip: bool) -> dict[str, Any]:
    """DDP: a NaN enters one rank's gradient during backward, before DDP's all-reduce spreads it.

    Replicated gradients agree by construction, so no process_group is given.
    """
    model = nn.parallel.DistributedDataParallel(make_model())
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        handle = None
        if step == BAD_STEP and rank == 0:
            handle = params[2].register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.nan))
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if handle is not None:
            handle.remove()
        finish_step(trace, scaler, opt, params, clip)
    trace["params"] = [p.detach().clone() for p in params]
    return trace


def fsdp2(rank: int, world: int, fused: bool, clip: bool) -> dict[str, Any]:
    """FSDP2: DTensor gradients; the scaler finds the mesh group itself (no process_group)."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local_batch(step, rank, world)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == BAD_STEP and rank == world - 1:
            params[0].grad.to_local().view(-1)[0] = math.inf
        reference = full_norm([p.grad.full_tensor() for p in params], scaler.get_scale()) if clip else None
        finish_step(trace, scaler, opt, params, clip, reference)
    trace["params"] = [p.full_tensor().detach().clone() for p in params]
    return trace


def single_process(clip: bool) -> dict[str, Any]:
    """The parity reference: one process, the whole global batch, the same injected fault."""
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == BAD_STEP:
            params[2].grad[:, 0] = math.nan
        finish_step(trace, scaler, opt, params, clip)
    trace["params"] = [p.detach().clone() for p in params]
    return trace


def scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clip in (False, True):
        tag = "clip" if clip else "noclip"
        out[f"hand_sharded-{tag}"] = hand_sharded(rank, world, clip)
        for fused in (False, True):
            opt_tag = "fused" if fused else "forloop"
            out[f"ddp-{opt_tag}-{tag}"] = ddp(rank, world, fused, clip)
            out[f"fsdp2-{opt_tag}-{tag}"] = fsdp2(rank, world, fused, clip)
        if rank == 0:
            out[f"single-{tag}"] = single_process(clip)
    return out


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result: dict[str, Any] = {"scenarios": scenarios(rank, world)}
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
