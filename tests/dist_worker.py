"""Worker processes for the distributed tests: gloo on the CPU, no network ports.

``main(rank, world, out_dir)`` runs every scenario and saves one result file per rank; the test
process compares them. Scenarios inject an inf into ONE rank's gradient shard at ``BAD_STEP`` (the
mixed-placement ones at each of ``MIXED_BAD_STEPS``).

Robustness (every rank, every run): the ranks meet through a FileStore in ``out_dir`` (no port to
collide with); each rank writes its result file atomically BEFORE any teardown; teardown is a barrier,
then ``destroy_process_group``; a hung rank dumps its Python stacks to ``rank<r>.log`` and exits.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradscaler import GradScaler, distributed

STEPS = 8
BAD_STEP = 3
MIXED_BAD_STEPS = (2, 5, 6)
GLOBAL_BATCH = 8
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a collective whose peer never comes fails
HANG_SECONDS = 420  # a rank still running after this dumps its stacks and exits; the test waits longer
DUMP_SIGNAL = signal.SIGUSR1  # the test sends it to a rank it is about to kill: stacks into the log


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


MIXED_ORDERS = ("plain-shard", "shard-plain", "replicate-shard", "shard-replicate")


def mixed_targets(step: int, shapes: tuple[torch.Size, torch.Size]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(shapes[0], generator=gen), torch.randn(shapes[1], generator=gen)


def mixed_initial(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole values of the unsharded parameter ("other": plain or Replicate) and the Shard(0) one."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(5, 3, generator=gen), torch.randn(2 * world, 3, generator=gen)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def mixed(
    rank: int,
    world: int,
    order: str,
    fused: bool,
    clip: bool,
    mesh: Any,
    placements: tuple[Any, Any],
    bad: bool,
) -> dict[str, Any]:
    """One optimizer over a sharded parameter and a plain or Replicate one, in the order ``order`` names.

    Every rank computes the same loss of the whole parameters; ``placements`` are those of the sharded
    and the replicated DTensor parameter; ``bad`` says whether this rank's shard gets the inf at each
    of ``MIXED_BAD_STEPS`` (the test wants every rank to skip exactly those steps). No process_group.
    """
    from torch.distributed.tensor import distribute_tensor

    other_init, shard_init = mixed_initial(world)
    other_kind = order.replace("shard", "").strip("-")
    if other_kind == "plain":
        other = nn.Parameter(other_init.clone())
    else:
        other = nn.Parameter(distribute_tensor(other_init.clone(), mesh, list(placements[1])))
    shard = nn.Parameter(distribute_tensor(shard_init.clone(), mesh, list(placements[0])))
    params = [shard, other] if order.startswith("shard") else [other, shard]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(STEPS):
        opt.zero_grad()
        t_other, t_shard = mixed_targets(step, (other_init.shape, shard_init.shape))
        loss = ((whole(other) - t_other) ** 2).sum() + 0.5 * ((whole(shard) - t_shard) ** 2).sum()
        scaler.scale(loss).backward()
        if step in MIXED_BAD_STEPS and bad:
            shard.grad.to_local().view(-1)[0] = math.inf  # type: ignore[union-attr]
        reference = full_norm([whole(p.grad) for p in params], scaler.get_scale()) if clip else None  # type: ignore[arg-type]
        finish_step(trace, scaler, opt, params, clip, reference)
    trace["params"] = [whole(p).detach().clone() for p in (other, shard)]
    return trace


def mixed_single(fused: bool, clip: bool, world: int) -> dict[str, Any]:
    """The reference of ``mixed``: one process, plain tensors, the inf at the same steps."""
    other_init, shard_init = mixed_initial(world)
    other, shard = nn.Parameter(other_init.clone()), nn.Parameter(shard_init.clone())
    params = [other, shard]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(STEPS):
        opt.zero_grad()
        t_other, t_shard = mixed_targets(step, (other_init.shape, shard_init.shape))
        loss = ((other - t_other) ** 2).sum() + 0.5 * ((shard - t_shard) ** 2).sum()
        scaler.scale(loss).backward()
        if step in MIXED_BAD_STEPS:
            shard.grad.view(-1)[-1] = math.inf  # type: ignore[union-attr]
        finish_step(trace, scaler, opt, params, clip)
    trace["params"] = [p.detach().clone() for p in params]
    return trace


def two_dimension_groups(rank: int, mesh2d: Any) -> dict[str, Any]:
    """Parameters sharded over different dimensions of a 2-d mesh: each dimension's group is reduced over."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def ranks(agreement: distributed.Agreement) -> list[list[int]]:
        return [dist.get_process_group_ranks(group) for group in agreement.groups]

    row = distribute_tensor(torch.ones(4, 2), mesh2d, [Shard(0), Replicate()])
    col = distribute_tensor(torch.ones(4, 2), mesh2d, [Replicate(), Shard(0)])
    dims = [dist.get_process_group_ranks(mesh2d.get_group(dim)) for dim in (0, 1)]
    out: dict[str, Any] = {"row-col": ranks(distributed.resolve([row, col])), "want-row-col": dims}
    out["col-row"] = ranks(distributed.resolve([torch.ones(1), col, row]))
    out["want-col-row"] = dims[::-1]
    explicit = distributed.resolve([row, col], dist.group.WORLD)
    out["explicit"] = explicit.groups == (dist.group.WORLD,)
    # The same mesh layout built twice: distinct group objects over the same ranks are one group.
    twin = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)])
    same = distributed.resolve([torch.ones(1), col, twin, row.redistribute(placements=[Replicate(), Replicate()])])
    out["same-ranks"] = ranks(same)
    out["want-ranks"] = [dims[1]]
    return out


def mixed_scenarios(rank: int, world: int) -> dict[str, Any]:
    """D12: skip decisions must not depend on which parameter comes first (no process_group given)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    out: dict[str, Any] = {}
    meshes = [("mesh1d", init_device_mesh("cpu", (world,)), (Shard(0),), (Replicate(),), rank == world - 1)]
    if world == 4:  # HSDP-like: replicas along dim 0, shards along dim 1; the inf is in both replicas
        mesh2d = init_device_mesh("cpu", (2, 2))
        coordinate = mesh2d.get_coordinate()
        assert coordinate is not None
        bad = coordinate[1] == 1
        meshes.append(("mesh2d", mesh2d, (Replicate(), Shard(0)), (Replicate(), Replicate()), bad))
        out["two-dims"] = two_dimension_groups(rank, mesh2d)
    for mesh_tag, mesh, shard_placements, replicate_placements, bad in meshes:
        for order in MIXED_ORDERS:
            for fused in (False, True):
                if fused and "plain" in order:
                    continue  # torch's fused AdamW refuses a mix of plain tensors and DTensors
                for clip in (False, True):
                    name = f"mixed-{mesh_tag}-{order}-{'fused' if fused else 'forloop'}-{'clip' if clip else 'noclip'}"
                    placements = (shard_placements, replicate_placements)
                    out[name] = mixed(rank, world, order, fused, clip, mesh, placements, bad)
    for fused in (False, True):
        for clip in (False, True):
            out[f"mixed-single-{'fused' if fused else 'forloop'}-{'clip' if clip else 'noclip'}"] = mixed_single(
                fused, clip, world
            )
    return out


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
    out.update(mixed_scenarios(rank, world))
    return out


def result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pt")


def log_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.log")


def store_path(out_dir: str) -> str:
    return os.path.join(out_dir, "store")


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """Write then rename: the test never reads a half-written file."""
    final = result_path(out_dir, rank)
    tmp = f"{final}.tmp"
    torch.save(result, tmp)
    os.replace(tmp, final)


def main(
    rank: int,
    world: int,
    out_dir: str,
    run: Callable[[int, int], dict[str, Any]] = scenarios,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> None:
    """Rank ``rank`` of ``world``: ``run(rank, world)`` under a gloo group whose collectives time out
    after ``timeout``; its result (or its traceback) written to ``result_path``."""
    # Python stacks of a crash (fatal signal) or a hang land in rank<r>.log, which the test shows.
    log = open(log_path(out_dir, rank), "w")  # noqa: SIM115 - kept open for faulthandler until exit
    faulthandler.enable(file=log)
    faulthandler.register(DUMP_SIGNAL, file=log, all_threads=True)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=log)
    torch.set_num_threads(1)
    ok = False
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path(out_dir)}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        result: dict[str, Any] = {"scenarios": run(rank, world)}
        ok = True
    except BaseException:
        result = {"error": traceback.format_exc()}
    write_result(out_dir, rank, result)
    try:
        if dist.is_initialized():
            if ok:  # every rank has left its last collective before any tears its connections down
                dist.barrier()
            dist.destroy_process_group()
    except Exception:  # the result is written: report the teardown failure, the test decides
        traceback.print_exc(file=log)
        log.flush()
    faulthandler.cancel_dump_traceback_later()
    if not ok:
        sys.exit(1)  # the traceback is in the result file, which the test shows
