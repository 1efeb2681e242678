"""``gradscaler bench --sections accumulation``: what ``accumulate_grads_in_fp32=True`` costs and gains.

Every number but the FSDP2 cell's comes from the library's own path (``GradScaler(master_weights=True)`` with
and without ``accumulate_grads_in_fp32``), nothing summed by hand:

* ``precision``: one float16 or bfloat16 parameter of 1M values (2**18 on the CPU) receives, micro-batch
  after micro-batch, a gradient exact in its dtype (mean 0.3e-3, spread 1e-3; loss ``(p * g).sum()``), through
  ``scaler.scale(loss).backward()``; after ``scaler.unscale_`` the master's gradient is compared with the
  float64 sum of the same gradients (relative error of the whole vector). float16 runs at scale 1024,
  bfloat16 at scale 1.
* ``training``: the demo's model (``TinyGPT``, small) in bfloat16 with 64 micro-batches a step, trained
  with autograd's bfloat16 accumulation and with float32 accumulation, against the same model in float32
  (torch's scaler at scale 1, float32 accumulation): the loss of each step, and its mean gap.
* ``memory``: bytes per model parameter (distinct storages of parameters, gradients, masters and their
  gradients, optimizer state) between micro-batches, in the step (after ``unscale_``) and after the step,
  for today's masters and with the argument (AdamW).
* ``time``: milliseconds per micro-batch (forward + backward) of a GPT-shaped bfloat16 model with many
  parameter tensors, autograd's accumulation against the hooks, run round-robin; the ratio per round.
* ``ddp``: milliseconds per iteration (``no_sync()`` on all micro-batches but the last, then the step) of
  the same model under DistributedDataParallel on 2 gloo processes (on the CPU, whatever the device):
  masters alone (DDP all-reduces the bfloat16 gradients) against ``accumulate_grads_in_fp32=True`` with
  ``scaler.register_ddp`` (the scaler all-reduces the float32 sums), round-robin in the same processes;
  rank 0's times, the ratio per round, and whether the ranks ended with equal weights.
* ``fsdp2``: FSDP2's own setting, where the argument is refused and points at it (no gradscaler involved):
  float32 parameters sharded by ``fully_shard`` and computed in bfloat16, micro-batches without gradient
  sync but the last, for ``reduce_dtype`` float32 and bfloat16 on 2 gloo processes; the relative error of
  the gradient FSDP2 leaves against the float64 average over ranks of the float64 sums of each
  micro-batch's bfloat16 gradient (a bfloat16 copy of the model, summed by hand: the reference).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.tools.harness import spread
from gradscaler.tools.memory import bytes_per_parameter
from gradscaler.tools.toy_model import TinyGPT

DTYPES = {"float16": (torch.float16, 1024.0), "bfloat16": (torch.bfloat16, 1.0)}
MICRO_BATCHES = (8, 64, 256)


def _scaler(device: torch.device, accumulate: bool, scale: float) -> GradScaler:
    return GradScaler(
        device.type, init_scale=scale, growth_interval=2**30, master_weights=True, accumulate_grads_in_fp32=accumulate
    )


def precision_cell(device: torch.device, dtype_name: str, micro: int, accumulate: bool, numel: int) -> float:
    """Relative error of the master's unscaled gradient after ``micro`` backward passes."""
    dtype, scale = DTYPES[dtype_name]
    param = nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = _scaler(device, accumulate, scale)
    gen = torch.Generator().manual_seed(micro)
    exact = torch.zeros(numel, dtype=torch.float64)
    for _ in range(micro):
        grad = (torch.randn(numel, generator=gen) * 1e-3 + 0.3e-3).to(dtype)
        exact += grad.double()
        scaler.scale((param * grad.to(device)).sum()).backward()
    scaler.unscale_(optimizer)
    (_, master), *_ = scaler.master_weights(optimizer)
    assert master.grad is not None
    got = master.grad.double().cpu()
    return float(torch.linalg.vector_norm(got - exact) / torch.linalg.vector_norm(exact))


def precision_section(
    device: torch.device, numel: int, micro_batches: tuple[int, ...] = MICRO_BATCHES
) -> list[dict[str, Any]]:
    """One row per dtype and micro-batch count: the relative error of either accumulation."""
    rows = []
    for dtype_name in DTYPES:
        for micro in micro_batches:
            low = precision_cell(device, dtype_name, micro, False, numel)
            fp32 = precision_cell(device, dtype_name, micro, True, numel)
            rows.append(
                {"dtype": dtype_name, "micro_batches": micro, "numel": numel, "low_precision": low, "float32": fp32}
            )
    return rows


def _tiny(dtype: torch.dtype, device: torch.device, width: int = 64, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, width=width, layers=layers, heads=4, context=32)
    for module in model.modules():
        if not isinstance(module, nn.LayerNorm):  # LayerNorms stay float32, as in the demo
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
    return model.to(device)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; a low-precision model's forward under autocast in its dtype, so that its
    float32 LayerNorms take its activations (CUDA's layer_norm refuses bfloat16 input with float32 weights)."""
    dtype = next(model.parameters()).dtype  # the token embedding's (a DDP wrapper has no .tok)
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _train(device: torch.device, dtype: torch.dtype, accumulate: bool, steps: int, micro: int) -> list[float]:
    model = _tiny(dtype, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler: Any = (
        torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)
        if dtype == torch.float32
        else _scaler(device, accumulate, 1.0)
    )
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(micro):
            tokens = (torch.arange(33).repeat(2, 1) * torch.randint(1, 8, (2, 1), generator=gen)) % 256
            loss = _loss(model, tokens.to(device)) / micro
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(total)
    return losses


def training_section(device: torch.device, steps: int = 12, micro: int = 64) -> dict[str, Any]:
    """Losses of the float32 model and of the bfloat16 one with either accumulation, step by step."""
    fp32 = _train(device, torch.float32, False, steps, micro)
    low = _train(device, torch.bfloat16, False, steps, micro)
    acc = _train(device, torch.bfloat16, True, steps, micro)

    def gap(run: list[float]) -> float:
        return statistics.fmean(abs(a - b) for a, b in zip(run, fp32, strict=True))

    return {
        "steps": steps,
        "micro_batches": micro,
        "float32_model": fp32,
        "bfloat16_accumulation": low,
        "float32_accumulation": acc,
        "gap_bfloat16_accumulation": gap(low),
        "gap_float32_accumulation": gap(acc),
    }


def _held(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: GradScaler) -> float:
    """Bytes per model parameter now: parameters, every gradient, masters, optimizer state."""
    return bytes_per_parameter(model, optimizer, [m for _, m in scaler.master_weights(optimizer)])


def memory_section(device: torch.device, micro: int = 4, width: int = 256, layers: int = 4) -> list[dict[str, Any]]:
    rows = []
    for accumulate in (False, True):
        model = _tiny(torch.float16, device, width=width, layers=layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = _scaler(device, accumulate, 2.0**8)
        gen = torch.Generator().manual_seed(0)
        points: dict[str, float] = {}
        for _ in range(2):  # the second step holds what every later one holds
            optimizer.zero_grad(set_to_none=True)
            for k in range(micro):
                tokens = torch.randint(256, (2, 33), generator=gen).to(device)
                scaler.scale(_loss(model, tokens) / micro).backward()
                if k == 1:
                    points["between_micro_batches"] = _held(model, optimizer, scaler)
            scaler.unscale_(optimizer)
            points["in_step"] = _held(model, optimizer, scaler)
            scaler.step(optimizer)
            scaler.update()
            points["after_step"] = _held(model, optimizer, scaler)
        rows.append({"accumulation": "float32" if accumulate else "autograd (low precision)", **points})
    return rows


def time_section(
    device: torch.device, rounds: int, micro: int = 8, width: int = 128, layers: int = 12
) -> dict[str, Any]:
    systems = []
    for accumulate in (False, True):
        model = _tiny(torch.bfloat16, device, width=width, layers=layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        systems.append((model, optimizer, _scaler(device, accumulate, 1.0)))
    tokens = torch.randint(256, (4, 33), generator=torch.Generator().manual_seed(0)).to(device)
    times: list[list[float]] = [[], []]
    for round_ in range(rounds + 2):
        for index, (model, optimizer, scaler) in enumerate(systems):
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()  # the last step's kernels are not this round's
            begin = time.perf_counter()
            for _ in range(micro):
                scaler.scale(_loss(model, tokens) / micro).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - begin) * 1e3 / micro
            scaler.step(optimizer)
            scaler.update()
            if round_ >= 2:  # two warm-up rounds
                times[index].append(elapsed)
    ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
    tensors = sum(1 for _ in systems[0][0].parameters())
    return {
        "tensors": tensors,
        "params": sum(p.numel() for p in systems[0][0].parameters()),
        "micro_batches": micro,
        "autograd_ms": spread(times[0]),
        "float32_ms": spread(times[1]),
        "ratio": spread(ratios),
    }


DDP_WAIT_SECONDS = 600  # the whole cell; a rank still running then is killed and the cell says so


def _ddp_rank(rank: int, world: int, store: str, shape: dict[str, int], results: Any) -> None:
    """One rank of ``ddp_section``: both systems round-robin; rank 0 puts its times on ``results``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        micro, rounds = shape["micro"], shape["rounds"]
        systems = []
        for accumulate in (False, True):
            model = nn.parallel.DistributedDataParallel(
                _tiny(torch.bfloat16, torch.device("cpu"), width=shape["width"], layers=shape["layers"])
            )
            scaler = _scaler(torch.device("cpu"), accumulate, 1.0)
            if accumulate:
                scaler.register_ddp(model)
            systems.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), scaler))
        gen = torch.Generator().manual_seed(rank)
        times: list[list[float]] = [[], []]
        for round_ in range(rounds + 2):
            tokens = torch.randint(256, (micro, 4, 33), generator=gen)
            for index, (model, optimizer, scaler) in enumerate(systems):
                dist.barrier()
                begin = time.perf_counter()
                for k in range(micro):
                    with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
                        scaler.scale(_loss(model, tokens[k]) / micro).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if round_ >= 2:  # two warm-up rounds
                    times[index].append((time.perf_counter() - begin) * 1e3)
        flat = torch.cat([p.detach().float().reshape(-1) for p in systems[1][0].parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            params = list(systems[0][0].parameters())
            results.put(
                {
                    "times": times,
                    "tensors": len(params),
                    "params": sum(p.numel() for p in params),
                    "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_ranks(target: Any, world: int, shape: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int | None]]:
    """``target(rank, world, store, shape, results)`` on ``world`` spawned processes meeting through a file (no
    port); what rank 0 put on ``results`` (None if nothing came within ``DDP_WAIT_SECONDS``), and the exit codes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, shape, results)) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + DDP_WAIT_SECONDS
        got: dict[str, Any] | None = None
        try:
            while got is None and time.monotonic() < deadline and any(p.is_alive() for p in procs):
                with contextlib.suppress(Exception):
                    got = results.get(timeout=0.5)
            if got is None:
                with contextlib.suppress(Exception):
                    got = results.get(timeout=1.0)  # put just before the rank exited
            for proc in procs:
                proc.join(max(1.0, deadline - time.monotonic()) if got is not None else 1.0)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
    return got, [proc.exitcode for proc in procs]


def ddp_section(rounds: int, world: int = 2, micro: int = 4, width: int = 128, layers: int = 6) -> dict[str, Any]:
    """The DDP cell: ``world`` gloo processes, each timing both systems."""
    shape = {"micro": micro, "rounds": rounds, "width": width, "layers": layers}
    got, codes = _run_ranks(_ddp_rank, world, shape)
    cell: dict[str, Any] = {"world": world, "micro_batches": micro, "exit_codes": codes}
    if got is None:
        return {**cell, "failed": f"no result from rank 0 (exit codes {codes})"}
    times = got["times"]
    ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
    return {
        **cell,
        "tensors": got["tensors"],
        "params": got["params"],
        "ranks_agree": got["ranks_agree"],
        "masters_ms": spread(times[0]),
        "float32_ms": spread(times[1]),
        "ratio": spread(ratios),
    }


def _fsdp2_rank(rank: int, world: int, store: str, shape: dict[str, Any], results: Any) -> None:
    """One rank of ``fsdp2_section``: float32 parameters sharded by FSDP2 and computed in bfloat16
    (``MixedPrecisionPolicy``), micro-batches without gradient sync but the last, for each ``reduce_dtype``;
    the relative error of the gradient FSDP2 leaves (its sharded ``.grad``, gathered) against the float64
    average over ranks of the float64 sums of each micro-batch's bfloat16 gradient (a bfloat16 copy of the
    model: what either accumulation adds up). Rank 0 puts the errors on ``results``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    width = shape["width"]

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * rank + k)
        return torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)

    try:
        rows = []
        for micro in shape["micro_batches"]:
            copy = net().to(torch.bfloat16)
            exact = [torch.zeros_like(p, dtype=torch.float64) for p in copy.parameters()]
            for k in range(micro):
                copy.zero_grad()
                x, y = batch(k)
                (copy(x.to(torch.bfloat16)).float() - y).square().mean().backward()
                for total, p in zip(exact, copy.parameters(), strict=True):
                    total += p.grad.double()  # type: ignore[union-attr]
            for total in exact:
                dist.all_reduce(total)
                total /= world
            row: dict[str, Any] = {"micro_batches": micro}
            for reduce in (torch.float32, torch.bfloat16):
                model = net()
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
                for layer in (model[0], model[2], model):
                    fully_shard(layer, mp_policy=policy)
                for k in range(micro):
                    model.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
                    x, y = batch(k)
                    (model(x).float() - y).square().mean().backward()
                got = [p.grad.full_tensor().double() for p in model.parameters()]  # type: ignore[union-attr]
                diff = torch.linalg.vector_norm(
                    torch.cat([(g - e).reshape(-1) for g, e in zip(got, exact, strict=True)])
                )
                row[str(reduce).removeprefix("torch.")] = float(
                    diff / torch.linalg.vector_norm(torch.cat([e.reshape(-1) for e in exact]))
                )
            rows.append(row)
        if rank == 0:
            results.put({"rows": rows})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fsdp2_section(world: int = 2, micro_batches: tuple[int, ...] = (8, 64), width: int = 64) -> dict[str, Any]:
    """The FSDP2 cell: what FSDP2's own ``reduce_dtype`` gives across micro-batches (our argument is refused
    there and points at it), ``world`` gloo processes."""
    got, codes = _run_ranks(_fsdp2_rank, world, {"micro_batches": micro_batches, "width": width})
    cell: dict[str, Any] = {"world": world, "width": width, "exit_codes": codes}
    if got is None:
        return {**cell, "failed": f"no result from rank 0 (exit codes {codes})"}
    return {**cell, "rows": got["rows"]}


def accumulation_section(device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """Every cell of the six tables (``format``: ``accumulation_lines``)."""
    return {
        "precision": precision_section(device, 1_000_000 if device.type == "cuda" else 2**18),
        "training": training_section(device),
        "memory": memory_section(device),
        "time": time_section(device, max(steps, 5)),
        "ddp": ddp_section(max(steps, 5)),
        "fsdp2": fsdp2_section(),
    }


def accumulation_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "Gradient accumulation (accumulate_grads_in_fp32): relative error of the summed gradient against a "
        f"float64 sum, {r['precision'][0]['numel']} values, the library's own path:",
        "",
        "| parameters | micro-batches | autograd's accumulation | float32 accumulation |",
        "|---|---|---|---|",
    ]
    for row in r["precision"]:
        scale = " (scale 1024)" if row["dtype"] == "float16" else ""
        lines.append(
            f"| {row['dtype']}{scale} | {row['micro_batches']} | {row['low_precision']:.1e} | {row['float32']:.1e} |"
        )
    t = r["training"]
    lines += [
        "",
        f"bfloat16 TinyGPT, {t['micro_batches']} micro-batches a step, {t['steps']} steps: mean |loss - loss of the "
        f"float32 model| {t['gap_bfloat16_accumulation']:.2e} with bfloat16 accumulation, "
        f"{t['gap_float32_accumulation']:.2e} with float32 accumulation (last loss: float32 model "
        f"{t['float32_model'][-1]:.4f}, bf16 accumulation {t['bfloat16_accumulation'][-1]:.4f}, "
        f"fp32 accumulation {t['float32_accumulation'][-1]:.4f}).",
        "",
        "| float16 params + masters, AdamW | B/param between micro-batches | in step (after unscale_) | after step |",
        "|---|---|---|---|",
    ]
    for row in r["memory"]:
        lines.append(
            f"| {row['accumulation']} | {row['between_micro_batches']:.2f} | {row['in_step']:.2f} | "
            f"{row['after_step']:.2f} |"
        )
    m = r["time"]
    lines += [
        "",
        f"Time per micro-batch (forward + backward), bfloat16 GPT, {m['tensors']} tensors, "
        f"{m['params'] / 1e6:.1f}M parameters, median [IQR]: autograd's accumulation "
        f"{m['autograd_ms'][0]:.2f} ms [{m['autograd_ms'][1]:.2f}-{m['autograd_ms'][2]:.2f}], float32 "
        f"accumulation {m['float32_ms'][0]:.2f} ms [{m['float32_ms'][1]:.2f}-{m['float32_ms'][2]:.2f}]; ratio "
        f"{m['ratio'][0]:.3f} [{m['ratio'][1]:.3f}-{m['ratio'][2]:.3f}].",
    ]
    return lines + ddp_lines(r["ddp"]) + fsdp2_lines(r["fsdp2"])


def ddp_lines(d: dict[str, Any]) -> list[str]:
    """The DDP cell, reported whatever happened (a failed cell says so)."""
    head = f"DDP, {d['world']} gloo processes on the CPU, {d['micro_batches']} micro-batches (no_sync but the last)"
    if "failed" in d:
        return ["", f"{head}: FAILED, {d['failed']}."]
    return [
        "",
        f"{head}, bfloat16 GPT, {d['tensors']} tensors, {d['params'] / 1e6:.1f}M parameters, time per iteration "
        f"on rank 0, median [IQR]: masters alone (DDP's bfloat16 all-reduce) {d['masters_ms'][0]:.1f} ms "
        f"[{d['masters_ms'][1]:.1f}-{d['masters_ms'][2]:.1f}], float32 accumulation + register_ddp (float32 "
        f"all-reduce of the sums) {d['float32_ms'][0]:.1f} ms [{d['float32_ms'][1]:.1f}-{d['float32_ms'][2]:.1f}]; "
        f"ratio {d['ratio'][0]:.3f} [{d['ratio'][1]:.3f}-{d['ratio'][2]:.3f}]; ranks "
        f"{'agree' if d['ranks_agree'] else 'DISAGREE'} on the weights.",
    ]


def fsdp2_lines(d: dict[str, Any]) -> list[str]:
    """The FSDP2 cell, reported whatever happened (a failed cell says so)."""
    head = (
        f"FSDP2 (accumulate_grads_in_fp32 refused there; its own setting instead), {d['world']} gloo processes, "
        f"float32 parameters computed in bfloat16, gradient sync on the last micro-batch only"
    )
    if "failed" in d:
        return ["", f"{head}: FAILED, {d['failed']}."]
    lines = [
        "",
        f"{head}, width {d['width']}: relative error of the gradient against the float64 average over ranks of "
        "the float64 sums of each micro-batch's bfloat16 gradient:",
        "",
        "| micro-batches | reduce_dtype=float32 | reduce_dtype=bfloat16 |",
        "|---|---|---|",
    ]
    for row in d["rows"]:
        lines.append(f"| {row['micro_batches']} | {row['float32']:.1e} | {row['bfloat16']:.1e} |")
    return lines
