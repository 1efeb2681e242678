"""Worker scenarios for ``test_distributed_masters.py``: ``master_weights=True`` on 2 gloo ranks.

Run by ``dist_worker.main`` through ``dist_launch.launch(2, out, scenarios)``. The model is float16 but
for one LayerNorm kept in float32 (``make_net``); the optimizer is AdamW (foreach) or SGD with momentum
(for-loop), with or without ``scaler.clip_grad_norm_``.

* ``ddp``: DDP all-reduces the float16 gradients during backward; the scaler moves them into the float32
  masters at ``unscale_``/``step``, after the reduction. The NaN of ``BAD_STEP`` enters rank 0's gradient
  in backward (DDP spreads it), or, with ``process_group``, rank 1's reduced gradient after backward.
* ``fsdp2``: ``fully_shard`` makes every parameter a Shard(0) DTensor; each float16 one gets a float32
  DTensor master of its local shard. The NaN enters rank 1's shard after backward; no process_group.
* ``reference`` (rank 0 only): one process, the same global batch as the ranks' halves, each half's loss
  divided by the world size and the gradients accumulated: the sum the ranks' reduction computes.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_worker import local_batch
from gradscaler import GradScaler

STEPS = 8
BAD_STEP = 3
MAX_NORM = 0.5
CHECKPOINT_STEP = 4  # the checkpoint scenario saves before this step, then replays it after a load
OPTIMIZERS = ("adamw", "sgd")


class Net(nn.Module):
    """float16 Linear layers around a LayerNorm that stays float32 (its input is cast up, its output down)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 12)
        self.out = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.norm(h.float()).to(torch.float16)
        return self.out(torch.tanh(self.mid(h)))


def make_net() -> Net:
    torch.manual_seed(0)
    net = Net().half()
    net.norm.float()
    with torch.no_grad():  # not the ones and zeros of a fresh LayerNorm: its gradients then move it visibly
        net.norm.weight.add_(torch.randn(16) * 0.1)
        net.norm.bias.add_(torch.randn(16) * 0.1)
    return net


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    assert kind == "sgd", kind
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it in the same order); any other tensor itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None, f"no gradient on a {tuple(tensor.shape)} {tensor.dtype} tensor"
    return tensor.grad


def masters_of(scaler: GradScaler, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [master for _, master in scaler.master_weights(opt)]


def snapshot(model: nn.Module, scaler: GradScaler, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], Any]:
    """This rank's values of the model's parameters and the masters, and the optimizer's state."""
    tensors = [local(p).detach().clone() for p in model.parameters()]
    tensors += [local(m).detach().clone() for m in masters_of(scaler, opt)]
    state = {
        k: {n: local(v).clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in opt.state_dict()["state"].items()
    }
    return tensors, state


def unchanged(before: tuple[list[torch.Tensor], Any], after: tuple[list[torch.Tensor], Any]) -> bool:
    """Whether two snapshots hold the same tensors, bit for bit (NaN equal to NaN), and the same state."""
    if len(before[0]) != len(after[0]) or before[1].keys() != after[1].keys():
        return False
    same = all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    for key, state in before[1].items():
        other = after[1][key]
        same = same and state.keys() == other.keys()
        same = same and all(
            torch.equal(v, other[n]) if isinstance(v, torch.Tensor) else v == other[n] for n, v in state.items()
        )
    return same


def halves(step: int, rank: int | None, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's half of the global batch, or (``rank`` None) every rank's half, in float16."""
    ranks = range(world) if rank is None else [rank]
    return [(x.half(), y.half()) for x, y in (local_batch(step, r, world) for r in ranks)]


def train(
    model: nn.Module,
    net: Net,
    kind: str,
    clip: bool,
    rank: int | None,
    world: int,
    inject: str,
    process_group: Any = None,
) -> dict[str, Any]:
    """``STEPS`` iterations with float32 masters; ``rank`` None is the one-process reference.

    ``model`` runs the forward (the DDP wrapper, or ``net`` itself); ``net``'s parameters are the optimizer's.
    ``inject``: ``"hook"`` puts a NaN into a float16 gradient during backward (before DDP's all-reduce;
    rank 0 only), ``"after"`` into a float16 gradient (shard) after backward (rank ``world - 1`` only).
    """
    low_params: list[torch.Tensor] = list(net.parameters())
    opt = make_optimizer(kind, low_params)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, master_weights=True, process_group=process_group)
    target = net.mid.weight  # float16, and the NaN's place
    trace: dict[str, Any] = {"scale": [], "skipped": [], "unchanged": [], "norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        bad = step == BAD_STEP
        handle = None
        if bad and inject == "hook" and rank in (None, 0):
            handle = target.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.nan))
        pieces = halves(step, rank, world)
        for x, y in pieces:
            loss = nn.functional.mse_loss(model(x), y) / len(pieces)
            scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if bad and inject == "after" and rank in (None, world - 1):
            local(grad_of(target)).view(-1)[0] = math.nan
        if step == 0:
            trace["low_grads"] = [local(grad_of(p)).clone() for p in low_params if p.dtype == torch.float16]
        before = snapshot(net, scaler, opt)
        if clip:
            trace["norm"].append(float(scaler.clip_grad_norm_(opt, MAX_NORM)))
        scaler.step(opt)
        if step == 0:
            record_first_contact(trace, scaler, opt, low_params, clip)
        scaler.update()
        trace["scale"].append(scaler.get_scale())
        trace["skipped"].append(scaler.last_step_skipped())
        trace["unchanged"].append(unchanged(before, snapshot(net, scaler, opt)))
    pairs = scaler.master_weights(opt)
    trace["params"] = [whole(p).detach().clone() for p in low_params]
    trace["masters"] = [whole(m).detach().clone() for _, m in pairs]
    trace["rounded"] = all(torch.equal(local(low), local(m).to(low.dtype)) for low, m in pairs)
    return trace


def record_first_contact(
    trace: dict[str, Any], scaler: GradScaler, opt: torch.optim.Optimizer, low_params: list[torch.Tensor], clip: bool
) -> None:
    """What the first step built: which parameters got masters, of what kind, and the masters' gradients."""
    pairs = scaler.master_weights(opt)
    in_groups = [p for group in opt.param_groups for p in group["params"]]
    trace["mastered"] = [any(low is p for low, _ in pairs) for p in low_params]
    trace["masters_in_groups"] = all(any(m is p for p in in_groups) for _, m in pairs)
    trace["low_in_groups"] = any(any(low is p for p in in_groups) for low, _ in pairs)
    trace["state_dtypes"] = sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim() > 0})
    trace["kinds"] = [
        {
            "type": type(m).__name__,
            "dtype": m.dtype,
            "low_type": type(low).__name__,
            "placements": repr(getattr(m, "placements", None)),
            "low_placements": repr(getattr(low, "placements", None)),
            "same_mesh": getattr(m, "device_mesh", None) is getattr(low, "device_mesh", None),
            "local_shape": tuple(local(m).shape),
            "low_local_shape": tuple(local(low).shape),
        }
        for low, m in pairs
    ]
    if not clip:  # the optimizers here leave .grad as the scaler set it: the reduced gradient over the scale
        inv = 1.0 / scaler.get_scale()  # a power of two: exact
        trace["master_grads"] = [local(grad_of(m)).clone() for _, m in pairs]
        trace["moved_exactly"] = all(
            torch.equal(local(grad_of(m)), g.float() * inv) for (_, m), g in zip(pairs, trace["low_grads"], strict=True)
        )


def ddp(rank: int, world: int, kind: str, clip: bool, inject: str) -> dict[str, Any]:
    """DDP over the float16 model; with ``inject="after"`` the scaler agrees over the world group (for the
    flag only: ``process_group`` means partitioned gradients, so its clip norm would count DDP's replicated
    ones once per rank; ``scenarios`` runs that variant without clipping)."""
    model = nn.parallel.DistributedDataParallel(make_net())
    group = dist.group.WORLD if inject == "after" else None
    return train(model, model.module, kind, clip, rank, world, inject, group)


def fsdp2(rank: int, world: int, kind: str, clip: bool) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per layer, then the root) over the float16 model; no process_group."""
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    for layer in (net.inp, net.norm, net.mid, net.out):
        fully_shard(layer)
    fully_shard(net)
    return train(net, net, kind, clip, rank, world, "after")


def reference(world: int, kind: str, clip: bool, inject: str) -> dict[str, Any]:
    net = make_net()
    return train(net, net, kind, clip, None, world, inject)


def through_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` saved with ``torch.save`` and loaded back (DTensors and all)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def fsdp2_checkpoint(rank: int, world: int) -> dict[str, Any]:
    """A bound optimizer's state dict round-trips under FSDP2: saved before ``CHECKPOINT_STEP`` (with the
    scaler's), two steps trained, both loaded; the masters, parameters and state are back, bit for bit,
    and the replayed step equals the first one; so does the step of a new model, optimizer and scaler
    that load the checkpoint before their first contact (the masters built from the saved values). Then
    ``get_optimizer_state_dict`` of the bound optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from gradscaler.masters import SAVED_KEY

    def build() -> tuple[Net, torch.optim.Optimizer, GradScaler]:
        net = make_net()
        for layer in (net.inp, net.norm, net.mid, net.out):
            fully_shard(layer)
        fully_shard(net)
        opt = make_optimizer("adamw", list(net.parameters()))
        return net, opt, GradScaler("cpu", init_scale=2.0**10, growth_interval=2, master_weights=True)

    def one_step(net: Net, opt: torch.optim.Optimizer, scaler: GradScaler, step: int) -> None:
        opt.zero_grad()
        for x, y in halves(step, rank, world):
            scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    net, opt, scaler = build()
    for step in range(CHECKPOINT_STEP):
        one_step(net, opt, scaler, step)
    saved, saved_model = through_bytes(opt.state_dict()), through_bytes(net.state_dict())
    saved_scaler = scaler.state_dict()
    at_save = snapshot(net, scaler, opt)
    one_step(net, opt, scaler, CHECKPOINT_STEP)
    first = snapshot(net, scaler, opt)
    one_step(net, opt, scaler, CHECKPOINT_STEP + 1)
    moved_on = not unchanged(at_save, snapshot(net, scaler, opt))
    net.load_state_dict(saved_model)
    opt.load_state_dict(through_bytes(saved))  # a copy: torch's load keeps the dict's tensors as the state
    scaler.load_state_dict(saved_scaler)
    restored = unchanged(at_save, snapshot(net, scaler, opt))
    one_step(net, opt, scaler, CHECKPOINT_STEP)
    replayed = unchanged(first, snapshot(net, scaler, opt))
    # A resumed run: a new model, optimizer and scaler load the checkpoint before their first contact.
    new_net, new_opt, new_scaler = build()
    new_net.load_state_dict(saved_model)
    new_opt.load_state_dict(through_bytes(saved))
    new_scaler.load_state_dict(saved_scaler)
    one_step(new_net, new_opt, new_scaler, CHECKPOINT_STEP)
    saved_masters = [m for group in saved["param_groups"] for m in group.get(SAVED_KEY, {}).get("masters", {}).values()]
    try:  # torch's distributed-checkpoint helper cannot name the masters: refused, saying what to use instead
        get_optimizer_state_dict(new_net, new_opt)
        dcp: tuple[str, bool] = ("no error", False)
    except Exception as error:
        dcp = (type(error).__name__, "optimizer.state_dict()" in str(error) and "MixedPrecisionPolicy" in str(error))
    return {
        "dcp": dcp,
        "saved_masters": [(type(m).__name__, m.dtype, repr(getattr(m, "placements", None))) for m in saved_masters],
        "moved_on": moved_on,
        "restored": restored,
        "replayed": replayed,
        "resumed": unchanged(first, snapshot(new_net, new_scaler, new_opt)),
        "beyond_half": any(not torch.equal(local(m), local(m).half().float()) for m in saved_masters),
        "rounded": all(torch.equal(local(low), local(m).to(low.dtype)) for low, m in scaler.master_weights(opt)),
    }


def scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in OPTIMIZERS:
        for clip in (False, True):
            tag = f"{kind}-{'clip' if clip else 'noclip'}"
            out[f"ddp-{tag}"] = ddp(rank, world, kind, clip, "hook")
            out[f"fsdp2-{tag}"] = fsdp2(rank, world, kind, clip)
            if rank == 0:
                out[f"reference-{tag}"] = reference(world, kind, clip, "hook")
    out["ddp-sgd-noclip-group"] = ddp(rank, world, "sgd", False, "after")
    out["fsdp2-checkpoint"] = fsdp2_checkpoint(rank, world)
    return out
