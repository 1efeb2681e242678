"""Data-parallel and fully-sharded training with gradscaler, launched by torchrun.

    torchrun --nproc-per-node 2 examples/distributed.py --mode ddp
    torchrun --nproc-per-node 2 examples/distributed.py --mode fsdp2

gloo on CPUs, NCCL on GPUs. DDP: gradients are replicated (an inf on one rank reaches all through
DDP's all-reduce), so the scaler needs no process group. FSDP2: gradients are DTensor shards; the
scaler all-reduces the overflow flag (and the clipping norm) over their mesh by itself. An inf is
injected on the last rank at step 5 to show every rank skipping that step together. Each step
prints one line per rank, in rank order (rank 0 gathers and prints them).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from gradscaler import GradScaler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).to(device)
    if args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler(device.type, init_scale=2.0**12)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        opt.zero_grad()
        x, y = torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 4, generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
            loss = nn.functional.mse_loss(model(x).float(), y)
        first = next(model.parameters())
        hook = None
        if step == 5 and rank == world - 1 and args.mode == "ddp":  # a fault on one rank, before DDP reduces
            hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), math.inf))
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        if step == 5 and rank == world - 1 and args.mode == "fsdp2":  # a fault in one rank's shard
            first.grad.to_local().view(-1)[0] = math.inf
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.last_step_skipped()
        line = (
            f"rank {rank} step {step}: loss {loss.item():.4f} norm {norm.item():.4f} "
            f"scale {scaler.get_scale():g}{' SKIPPED' if skipped else ''}"
        )
        # One line per rank a step, in rank order: rank 0 prints them all (each rank printing its own
        # interleaves them in whatever order the processes reach their print).
        lines: list[str] | None = [""] * world if rank == 0 else None
        dist.gather_object(line, lines, dst=0)
        if lines is not None:
            print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
