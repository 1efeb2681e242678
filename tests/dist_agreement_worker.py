"""Worker scenarios for ``test_distributed_agreement.py``, run by ``dist_worker.main`` (see ``dist_launch``).

``empty_ranks`` (2 ranks): ranks whose micro-batch gives no gradient at all, or only some, on the
automatic DTensor agreement. ``refusals`` (2 ranks): a refused call changes nothing, on every rank.
``fsdp2_tp`` (4 ranks): FSDP2 over the dp dimension of a 2x2 mesh, tensor parallel over tp.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_worker import batch, finish_step, full_norm, local_batch, make_model, record, snapshot, whole
from gradscaler import GradScaler

EMPTY_STEPS = 6
# Which parameters get a gradient on which rank at each step ("all", "whole": the Replicate one only,
# "a": the Replicate one and shard_a, "none": backward skipped, as on an empty micro-batch).
EMPTY_PLAN = {1: {1: "none"}, 2: {1: "whole"}, 3: {0: "none"}, 4: {0: "a"}}
EMPTY_BAD = (3, 1)  # (step, rank): an inf in the shard of the only rank with gradients
TP_STEPS = 8
TP_BAD = {3: (3, "0.weight"), 5: (1, "4.weight")}  # step: (rank, parameter) given an inf
SHORT_TIMEOUT = datetime.timedelta(seconds=90)  # the empty-rank launch: a missing collective fails in 90 s


def _empty_rank_run(rank: int, world: int, mesh: Any, fused: bool, clip: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(7)
    whole = nn.Parameter(distribute_tensor(torch.randn(3, generator=gen), mesh, [Replicate()]))
    shard_a = nn.Parameter(distribute_tensor(torch.randn(2 * world, 3, generator=gen), mesh, [Shard(0)]))
    shard_b = nn.Parameter(distribute_tensor(torch.randn(2 * world, 2, generator=gen), mesh, [Shard(0)]))
    params = [whole, shard_a, shard_b]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(EMPTY_STEPS):
        opt.zero_grad(set_to_none=True)
        which = EMPTY_PLAN.get(step, {}).get(rank, "all")
        used = {"all": params, "whole": [whole], "a": [whole, shard_a], "none": []}[which]
        target = torch.randn(3, generator=torch.Generator().manual_seed(100 + step))
        if used:  # an empty micro-batch: no backward, no .grad at all
            loss = ((whole.to_local() - target) ** 2).sum()  # local pieces only: no collective in backward
            for shard in used[1:]:
                loss = loss + (shard.to_local() ** 2).sum() * (1 + rank)
            scaler.scale(loss).backward()
        if (step, rank) == EMPTY_BAD:
            shard_a.grad.to_local().view(-1)[0] = math.inf  # type: ignore[union-attr]
        # The reference: this rank's whole tensor once, plus every rank's shards (a test-side collective).
        squares = torch.zeros((), dtype=torch.float64)
        for p in (shard_a, shard_b):
            if p.grad is not None:
                squares += p.grad.to_local().double().square().sum()
        dist.all_reduce(squares)
        whole_part = whole.grad.to_local().double().square().sum() if whole.grad is not None else 0.0
        trace["norm_ref"].append(float((squares + whole_part).sqrt()) / scaler.get_scale())
        before = snapshot(params, opt)
        if clip:
            trace["norm"].append(float(scaler.clip_grad_norm_(opt, 0.5)))
        scaler.step(opt)
        scaler.update()
        record(trace, scaler, before, params, opt)
    return trace


def empty_ranks(rank: int, world: int) -> dict[str, Any]:
    """A 1-d mesh over a group of its own, so that the collective timeout applies to the scaler's collectives."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.new_group(list(range(world)), timeout=SHORT_TIMEOUT), "cpu")
    out: dict[str, Any] = {}
    for fused in (False, True):
        for clip in (False, True):
            name = f"{'fused' if fused else 'forloop'}-{'clip' if clip else 'noclip'}"
            out[name] = _empty_rank_run(rank, world, mesh, fused, clip)
    return out


def refusals(rank: int, world: int) -> dict[str, Any]:
    """A Partial parameter is refused by unscale_, step and clip_grad_norm_ on every rank, before any
    gradient is touched; once the optimizer holds a Replicate parameter instead, a retry unscales once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(11 + rank)
    shard = nn.Parameter(distribute_tensor(torch.ones(2 * world, 3), mesh, [Shard(0)]))
    partial = nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Partial()]))
    shard.grad = DTensor.from_local(torch.randn(2, 3, generator=gen) * 1000, mesh, [Shard(0)])
    partial.grad = DTensor.from_local(torch.randn(4, generator=gen), mesh, [Partial()])
    opt = torch.optim.SGD([shard, partial], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    before = [p.grad.to_local().clone() for p in (shard, partial)]  # type: ignore[union-attr]
    calls = {
        "unscale_": lambda: scaler.unscale_(opt),
        "step": lambda: scaler.step(opt),
        "clip_grad_norm_": lambda: scaler.clip_grad_norm_(opt, 1.0),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
        after = [p.grad.to_local() for p in (shard, partial)]  # type: ignore[union-attr]
        out[f"{name}-unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The fix: the Partial parameter summed into a Replicate one, with its gradient; the same scaler retries.
    fixed = nn.Parameter(partial.detach().redistribute(mesh, [Replicate()]))
    fixed.grad = partial.grad.redistribute(mesh, [Replicate()])  # type: ignore[union-attr]
    opt.param_groups[0]["params"][1] = fixed
    fixed_before = fixed.grad.to_local().clone()
    scaler.unscale_(opt)
    inv_scale = 1.0 / scaler.get_scale()  # a power of two: exact
    out["retry-once"] = torch.equal(shard.grad.to_local(), before[0] * inv_scale) and torch.equal(  # type: ignore[union-attr]
        fixed.grad.to_local(), fixed_before * inv_scale
    )
    scaler.step(opt)
    scaler.update()
    out["retry-stepped"] = not scaler.last_step_skipped()
    return out


def _tp_steps(
    model: nn.Module,
    params: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    rank: int | None,
    dp: int | None,
    clip: bool,
) -> dict[str, Any]:
    """The shared loop: ``rank`` None is the one-process reference (the whole batch; every inf lands in it),
    otherwise the data-parallel index ``dp`` picks this rank's half of the batch."""
    named = dict(model.named_parameters())
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trace: dict[str, list[Any]] = {"scale": [], "skipped": [], "unchanged": [], "norm": [], "norm_ref": []}
    for step in range(TP_STEPS):
        opt.zero_grad()
        x, y = batch(step) if dp is None else local_batch(step, dp, 2)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step in TP_BAD and rank in (None, TP_BAD[step][0]):
            grad = named[TP_BAD[step][1]].grad
            assert grad is not None
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf
        reference = None
        if clip:
            reference = full_norm([whole(p.grad) for p in params], scaler.get_scale())  # type: ignore[arg-type]
        finish_step(trace, scaler, opt, params, clip, reference)
    trace["params"] = [whole(p).detach().clone() for p in params]
    return trace


def fsdp2_tp(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` over dp) + tensor parallel (Colwise, Rowwise over tp) on a 2x2 mesh, and the
    one-process run of the same global batch. No process_group: the scaler reduces over dp and tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    out: dict[str, Any] = {}
    for clip in (False, True):
        tag = "clip" if clip else "noclip"
        model = make_model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        out[tag] = _tp_steps(model, params, opt, rank, coordinate[0], clip)
        out[f"placements-{tag}"] = [repr(p.placements) for p in params]  # type: ignore[attr-defined]
        if rank == 0:
            single = make_model()
            single_params = list(single.parameters())
            single_opt = torch.optim.AdamW(single_params, lr=1e-2, foreach=False)
            out[f"single-{tag}"] = _tp_steps(single, single_params, single_opt, None, None, clip)
    return out
