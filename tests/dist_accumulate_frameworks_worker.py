"""``scaler.register_ddp(model)`` under a framework's DDP, 2 gloo ranks (``dist_launch``): Accelerate's
``MULTI_CPU`` data parallelism with ``accumulate()``, Lightning Fabric's ``strategy="ddp"`` with
``no_backward_sync`` (``fabric_ours``) and the Lightning Trainer's with ``accumulate_grad_batches``
(``trainer_ours``).

Each rank has joined the gloo group ``dist_launch`` made (a FileStore, no port); Accelerate finds it
initialised and uses it (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment make it
``MULTI_CPU``, the Accelerator built with ``cpu=True``). ``accelerator.prepare`` returns the model wrapped
in ``DistributedDataParallel`` (with the ``DistributedDataParallelKwargs`` given): that is the module the
user's one line registers, ``accelerator.scaler.register_ddp(model)``. The fp16 path is turned on as in
tests/test_integration_accumulate.py (``native_amp`` and the scaler set by hand before ``prepare``).

The recipe by hand on the same rank, in the same Accelerate loop: an optimizer over float32 copies,
prepared alone (the model is not wrapped, so nothing reduces its low-precision gradients), the forward
under ``accelerator.autocast()`` (what ``prepare`` wraps the model's forward in), each backward's
gradients added into the copies in float32, then at the window's end one ``all_reduce`` (SUM) of the
sums flattened in parameter order, divided by the world size, before Accelerate's clipping; torch's
scaler; an applied step copied back. Rank 1's input holds an inf in one micro-batch of
``BAD_ITERATION``: both ranks skip that step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from dist_accumulate_worker import all_reduce_sums
from gradscaler import GradScaler
from recipe import Fp32Copies

ITERATIONS = 5
MICRO = 4
BAD_ITERATION = 1
MAX_NORM = 0.05
INIT_SCALE = 2.0**10
CASES = {  # name: (optimizer, DistributedDataParallelKwargs)
    "adamw": ("adamw", {}),
    "adamw_fused-bucket_view": ("adamw_fused", {"gradient_as_bucket_view": True}),
    "sgd_momentum-find_unused": ("sgd", {"find_unused_parameters": True}),
}
FABRIC_CASES = ("adamw", "sgd")


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    flags = {"fused": True} if kind == "adamw_fused" else {"foreach": True}
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags)


def data(rank: int, iteration: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * iteration + micro)
    x, y = torch.randn(4, 4, generator=g).half(), torch.randn(4, 2, generator=g)
    if rank == 1 and iteration == BAD_ITERATION and micro == 0:
        x[0, 0] = float("inf")  # non-finite gradients on rank 1 only
    return x, y


def launched_externally(rank: int, world: int) -> None:
    """What a launcher (torchrun) puts in each process's environment; with the group initialised already,
    Accelerate and Lightning join it and launch nothing."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ["OMP_NUM_THREADS"] = "1"  # else Accelerate sets torch's threads from the core count


def accelerator_for(rank: int, world: int, ddp_kwargs: dict[str, Any], scaler: Any) -> Any:
    """A fresh Accelerator on the group ``dist_launch`` made, its fp16 path on with ``scaler``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedDataParallelKwargs

    launched_externally(rank, world)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="fp16",
        gradient_accumulation_steps=MICRO,
        kwargs_handlers=[DistributedDataParallelKwargs(**ddp_kwargs)],
    )
    assert accelerator.num_processes == world and accelerator.process_index == rank
    accelerator.native_amp = True
    accelerator.scaler = scaler
    return accelerator


def accelerate_ours(rank: int, world: int, kind: str, ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, master_weights=True, accumulate_grads_in_fp32=True)
    accelerator = accelerator_for(rank, world, ddp_kwargs, scaler)
    net = make_net()
    model, optimizer = accelerator.prepare(net, make_optimizer(kind, net.parameters()))
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    accelerator.scaler.register_ddp(model)  # the one line
    params, scales, norms, skipped = [], [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(MICRO):
            x, y = data(rank, iteration, micro)
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                optimizer.step()
                optimizer.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped())
    return {
        "params": params,
        "scales": scales,
        "norms": norms,
        "skipped": skipped,
        "grads_left": [p.grad for p in net.parameters()],
    }


def accelerate_recipe(rank: int, world: int, kind: str, ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    accelerator = accelerator_for(rank, world, ddp_kwargs, scaler)
    net = make_net()
    hand = Fp32Copies(net.parameters())
    optimizer = accelerator.prepare(make_optimizer(kind, hand.params()))
    params, scales, norms = [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(MICRO):
            x, y = data(rank, iteration, micro)
            with accelerator.accumulate(net):
                with accelerator.autocast():
                    out = net(x)
                loss = nn.functional.mse_loss(out.float(), y)
                accelerator.backward(loss)
                hand.accumulate()
                before = scaler.get_scale()
                if accelerator.sync_gradients:
                    hand.move_grads()
                    all_reduce_sums([c for _, c in hand.pairs], world)
                    norms.append(float(accelerator.clip_grad_norm_(hand.params(), MAX_NORM)))
                optimizer.step()
                if accelerator.sync_gradients and scaler.get_scale() >= before:  # applied: no back-off
                    hand.copy_back()
                optimizer.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales, "norms": norms, "initial": [p.clone() for p in make_net().parameters()]}


def fabric_ours(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Lightning Fabric, ``strategy="ddp"``, ``precision="16-true"`` (a float16 model, the user's own
    scaler), accumulation with ``no_backward_sync`` on all micro-batches but the last; the one line
    registers what ``fabric.setup`` returned (a ``_FabricModule`` holding the DDP module)."""
    import lightning

    launched_externally(rank, world)
    fabric = lightning.Fabric(accelerator="cpu", devices=world, strategy="ddp", precision="16-true")
    fabric.launch()  # the processes exist (LOCAL_RANK is set): Lightning joins the initialised group
    assert fabric.world_size == world and fabric.global_rank == rank
    net = make_net()
    model, optimizer = fabric.setup(net, make_optimizer(kind, net.parameters()))
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, master_weights=True, accumulate_grads_in_fp32=True)
    scaler.register_ddp(model)  # the one line
    params, scales, norms, skipped = [], [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(MICRO):
            x, y = data(rank, iteration, micro)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                fabric.backward(scaler.scale(nn.functional.mse_loss(model(x), y) / MICRO))
        scaler.unscale_(optimizer)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        scales.append(scaler.get_scale())
        skipped.append(scaler.last_step_skipped())
    return {
        "params": params,
        "scales": scales,
        "norms": norms,
        "skipped": skipped,
        "grads_left": [p.grad for p in net.parameters()],
    }


def fabric_recipe(rank: int, world: int, kind: str) -> dict[str, Any]:
    """The recipe by hand for ``fabric_ours``, without Fabric: ``"16-true"`` gives the model float16 inputs
    and hands its output back in float32 (the default dtype); nothing reduces the low-precision gradients."""
    net = make_net()
    hand = Fp32Copies(net.parameters())
    optimizer = make_optimizer(kind, hand.params())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    params, scales, norms = [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(MICRO):
            x, y = data(rank, iteration, micro)
            scaler.scale(nn.functional.mse_loss(net(x.half()).float(), y) / MICRO).backward()
            hand.accumulate()
        hand.move_grads()
        all_reduce_sums([c for _, c in hand.pairs], world)
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(hand.params(), MAX_NORM)))
        scaler.step(optimizer)
        if not scaler._found_inf_per_device(optimizer)[torch.device("cpu")].item():
            hand.copy_back()
        scaler.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales, "norms": norms, "initial": [p.clone() for p in make_net().parameters()]}


def trainer_ours(rank: int, world: int) -> dict[str, Any]:
    """The Lightning Trainer, ``strategy="ddp"``, ``accumulate_grad_batches=MICRO``, its AMP plugin given
    our scaler, a float16 network; the one line, in ``on_fit_start`` (after the strategy wrapped the model):
    ``scaler.register_ddp(self.trainer.strategy.model)``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    launched_externally(rank, world)
    net = make_net()
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, master_weights=True, accumulate_grads_in_fp32=True)
    scales: list[float] = []
    skipped: list[bool] = []
    norms: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def on_fit_start(self) -> None:
            scaler.register_ddp(self.trainer.strategy.model)  # the one line

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after unscale_, before the clip
            trained = [p for g in optimizer.param_groups for p in g["params"]]
            assert all(p.dtype == torch.float32 for p in trained)  # the masters, holding the averaged sums
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in trained if p.grad is not None])))

        def on_train_batch_end(self, *args: Any) -> None:
            if (args[-1] + 1) % MICRO == 0:  # the window's last batch: after the step
                scales.append(scaler.get_scale())
                skipped.append(scaler.last_step_skipped())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer("adamw", self.parameters())

    params: list[list[torch.Tensor]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % MICRO == 0:
                params.append([p.detach().clone() for p in net.parameters()])

    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp", max_steps=ITERATIONS, accumulate_grad_batches=MICRO,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], gradient_clip_val=MAX_NORM,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()], default_root_dir=os.environ.get("TMPDIR", "/tmp"),
    )  # fmt: skip
    assert trainer.world_size == world and trainer.global_rank == rank
    batches = [(x.float(), y) for x, y in (data(rank, i, m) for i in range(ITERATIONS) for m in range(MICRO))]
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    return {
        "params": params,
        "scales": scales,
        "norms": norms,
        "skipped": skipped,
        "grads_left": [p.grad for p in net.parameters()],
    }


def trainer_recipe(rank: int, world: int) -> dict[str, Any]:
    """The recipe by hand for ``trainer_ours``, without Lightning: its AMP plugin's float16 autocast around
    the forward, the loss divided by the window, the float32 sums all-reduced, ``unscale_``, torch's clip
    over the optimizer's parameters (the copies), the step, an applied step copied back."""
    net = make_net()
    hand = Fp32Copies(net.parameters())
    optimizer = make_optimizer("adamw", hand.params())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    params, scales, norms = [], [], []
    for iteration in range(ITERATIONS):
        for micro in range(MICRO):
            x, y = data(rank, iteration, micro)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(net(x.float()), y)
            scaler.scale(loss / MICRO).backward()
            hand.accumulate()
        hand.move_grads()
        all_reduce_sums([c for _, c in hand.pairs], world)
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.get_total_norm([c.grad for c in hand.params() if c.grad is not None])))
        torch.nn.utils.clip_grad_norm_(hand.params(), MAX_NORM)
        scaler.step(optimizer)
        if not scaler._found_inf_per_device(optimizer)[torch.device("cpu")].item():
            hand.copy_back()
        scaler.update()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales, "norms": norms, "initial": [p.clone() for p in make_net().parameters()]}


class TwoReplicas(nn.Module):
    """A module holding two DDP modules: ``register_ddp`` cannot tell which one is meant."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.parallel.DistributedDataParallel(make_net())
        self.second = nn.parallel.DistributedDataParallel(make_net())


def refusals(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True)
    try:
        scaler.register_ddp(TwoReplicas())
    except TypeError as error:
        out["two"] = str(error)
    out["registered"] = bool(scaler._masters._sums.ddp)
    return out


def scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: {
            "ours": accelerate_ours(rank, world, kind, ddp_kwargs),
            "recipe": accelerate_recipe(rank, world, kind, ddp_kwargs),
        }
        for name, (kind, ddp_kwargs) in CASES.items()
    }
    for kind in FABRIC_CASES:
        out[f"fabric-{kind}"] = {"ours": fabric_ours(rank, world, kind), "recipe": fabric_recipe(rank, world, kind)}
    out["trainer"] = {"ours": trainer_ours(rank, world), "recipe": trainer_recipe(rank, world)}
    out["refusals"] = refusals(rank)
    return out
