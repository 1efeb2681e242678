"""``gradscaler bench --sections matrix``: shapes x optimizers x clip, torch vs ours interleaved.

Every cell reports the step phase ((unscale_ + clip) + step + update, gradients refilled untimed)
and the host time per step, as ratios with their spread, plus whole iterations of a large model at
batch 1, where the step phase is a large share of the iteration. Correctness is checked as it times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.tools.harness import BUSY_MS, SCALE, compare, count_params, gpt2_shapes, spread, step_phase, timer
from gradscaler.tools.toy_model import TinyGPT

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "foreach AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "for-loop AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
    "fused Adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, fused=True),
    "foreach SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "fused SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True),
}


def matrix_shapes(device: torch.device, quick: bool) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
    """Parameter layouts: (shape, dtype) per tensor."""
    f32, f16 = torch.float32, torch.float16
    if quick:  # every cell's code path at toy sizes; 50 small tensors cost a test run a third of 200's
        gpt, small, huge = gpt2_shapes(64, 2, 512, 64), [(256,)] * 50, [(1 << 16,)] * 3
    elif device.type == "cuda":
        gpt, small, huge = gpt2_shapes(768, 12, 50257, 1024), [(256,)] * 2000, [(1 << 26,)] * 3
    else:  # ~14M values: the 48 cells fit in ~20 min on 2 shared cores
        gpt, small, huge = gpt2_shapes(384, 6, 8192, 512), [(256,)] * 2000, [(1 << 22,)] * 3
    return {
        f"GPT-2-like ({len(gpt)} tensors)": [(s, f32) for s in gpt],
        f"many small ({len(small)} x {small[0][0]})": [(s, f32) for s in small],
        f"few huge ({len(huge)} x {huge[0][0]})": [(s, f32) for s in huge],
        "mixed fp32 vectors + fp16 matrices": [(s, f16 if len(s) > 1 else f32) for s in gpt],
    }


class _MatrixRun:
    """One copy of the parameters, its optimizer and one scaler ("torch" or "ours")."""

    def __init__(
        self,
        name: str,
        layout: list[tuple[torch.Tensor, torch.Tensor]],
        optimizer: str,
        clip: bool,
        device: torch.device,
    ) -> None:
        self.name, self.clip = name, clip
        self.params = [nn.Parameter(p.clone()) for p, _ in layout]
        self.grads = [g for _, g in layout]
        for p in self.params:
            p.grad = torch.empty_like(p)
        self.opt = OPTIMIZERS[optimizer](self.params)
        big = 10**9
        if name == "torch":
            self.scaler: Any = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=big)
        else:
            self.scaler = GradScaler(device.type, init_scale=SCALE, growth_interval=big)
        self.scaler.scale(torch.ones((), device=device))
        self.scales: list[float] = []

    def load(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad.copy_(g)  # type: ignore[union-attr]

    def step(self) -> None:
        step_phase(self.scaler, self.opt, self.params, self.clip)


def _interleave(
    runs: dict[str, _MatrixRun], device: torch.device, steps: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-step wall ms and host (thread CPU) ms of each run, torch and ours alternating (and which
    goes first alternating too, so neither always runs on a warm cache)."""
    timed = timer(device, BUSY_MS)
    wall: dict[str, list[float]] = {n: [] for n in runs}
    host: dict[str, list[float]] = {n: [] for n in runs}
    order = list(runs)
    for i in range(warmup + steps):
        for name in order if i % 2 == 0 else order[::-1]:
            run = runs[name]
            run.load()
            begin = time.thread_time()
            ms = timed(run.step)
            cpu_ms = (time.thread_time() - begin) * 1e3
            run.scales.append(run.scaler.get_scale())
            if i >= warmup:
                wall[name].append(ms)
                host[name].append(cpu_ms)
    return wall, host


def _layout(
    spec: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device, tiny: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for shape, dtype in spec:
        shape = (1,) if tiny else shape
        param = (torch.randn(shape, generator=gen) * 0.02).to(device, dtype)
        grad = (torch.randn(shape, generator=gen) * SCALE * 1e-3).to(device, dtype)
        out.append((param, grad))
    return out


def _ratio_stats(torch_ms: list[float], ours_ms: list[float]) -> dict[str, float]:
    ratio, q1, q3 = spread([a / b for a, b in zip(torch_ms, ours_ms, strict=True)])
    return {
        "torch_ms": statistics.median(torch_ms),
        "ours_ms": statistics.median(ours_ms),
        "ratio": ratio,
        "ratio_q1": q1,
        "ratio_q3": q3,
    }


def matrix_cell(
    spec: list[tuple[tuple[int, ...], torch.dtype]],
    optimizer: str,
    clip: bool,
    device: torch.device,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """One cell: the step phase at full size, and the host time per step (the same layout with every
    tensor shrunk to one value, so the bytes vanish and the per-step fixed cost remains)."""
    cell: dict[str, Any] = {"optimizer": optimizer, "clip": clip}
    fp16 = any(dtype == torch.float16 for _, dtype in spec)
    if fp16 and clip:
        cell["skipped"] = "torch's unscale_ refuses float16 gradients (its clip recipe cannot run)"
        return cell
    if fp16 and not optimizer.startswith("fused"):
        cell["skipped"] = "float16 parameters need a fused optimizer (both scalers refuse to unscale them)"
        return cell
    for key, tiny in (("step", False), ("host", True)):
        layout = _layout(spec, device, tiny)
        runs = {name: _MatrixRun(name, layout, optimizer, clip, device) for name in ("torch", "ours")}
        wall, host = _interleave(runs, device, steps, warmup)
        cell[key] = _ratio_stats(wall["torch"], wall["ours"])
        if key == "step":
            cell["step_thread_cpu"] = _ratio_stats(host["torch"], host["ours"])
            same_scales = runs["torch"].scales == runs["ours"].scales
            params = compare(runs["ours"].params, runs["torch"].params)
            cell["check"] = f"{'same' if same_scales else 'DIFFERENT'} scales, {params}"
            cell["ok"] = same_scales and (clip or params == "bit-identical")
        del runs, layout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cell


def whole_iteration_rows(device: torch.device, steps: int, warmup: int, quick: bool) -> list[dict[str, Any]]:
    """Whole iterations of a large model at a tiny batch (fine-tuning-like): the optimizer step is a
    large share of the iteration. Reports the ratio vs torch and the step phase's share."""
    if quick:
        cfg, batch = {"vocab": 512, "width": 64, "layers": 2, "heads": 2, "context": 16}, 1
    elif device.type == "cuda":
        cfg, batch = {"vocab": 50257, "width": 1024, "layers": 24, "heads": 16, "context": 128}, 1
    else:
        cfg, batch = {"vocab": 8192, "width": 384, "layers": 6, "heads": 6, "context": 32}, 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(cfg["vocab"], (batch, cfg["context"] + 1), generator=gen).to(device) for _ in range(4)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for optimizer, clip in (("fused AdamW", False), ("fused AdamW", True), ("foreach AdamW", True)):
        runs = {}
        for name in ("torch", "ours"):
            torch.manual_seed(0)
            model = TinyGPT(**cfg).to(device)
            opt = OPTIMIZERS[optimizer](list(model.parameters()))  # type: ignore[arg-type]
            scaler: Any = torch.amp.GradScaler(device.type) if name == "torch" else GradScaler(device.type)
            runs[name] = (model, opt, scaler)
        total: dict[str, list[float]] = {"torch": [], "ours": []}
        phase: dict[str, list[float]] = {"torch": [], "ours": []}
        scales: dict[str, list[float]] = {"torch": [], "ours": []}
        for i in range(warmup + steps):
            for name in ("torch", "ours") if i % 2 == 0 else ("ours", "torch"):
                model, opt, scaler = runs[name]
                tokens = data[i % len(data)]
                sync()
                begin = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
                    logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                scaler.scale(loss).backward()
                sync()
                middle = time.perf_counter()
                step_phase(scaler, opt, list(model.parameters()), clip)
                sync()
                end = time.perf_counter()
                scales[name].append(scaler.get_scale())
                if i >= warmup:
                    total[name].append((end - begin) * 1e3)
                    phase[name].append((end - middle) * 1e3)
        row: dict[str, Any] = {
            "optimizer": optimizer,
            "clip": clip,
            "params": count_params(runs["ours"][0]),
            "batch": batch,
        }
        row.update(cfg)
        stats = _ratio_stats(total["torch"], total["ours"])
        row.update(stats)
        row["torch_step_share"] = statistics.median(phase["torch"]) / stats["torch_ms"]
        row["ours_step_share"] = statistics.median(phase["ours"]) / stats["ours_ms"]
        row["check"] = f"{'same' if scales['torch'] == scales['ours'] else 'DIFFERENT'} scales"
        rows.append(row)
        del runs
    return rows


def matrix_section(
    device: torch.device, steps: int, warmup: int, quick: bool, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Every cell of shapes x optimizers x clip, then the whole-iteration rows."""
    cells = []
    for shape_name, spec in matrix_shapes(device, quick).items():
        numel = sum(math.prod(s) for s, _ in spec)
        for optimizer in OPTIMIZERS:
            for clip in (False, True):
                progress(f"bench matrix: {shape_name} | {optimizer} | clip {'1.0' if clip else 'no'}")
                cell = matrix_cell(spec, optimizer, clip, device, steps, warmup)
                cell.update({"shapes": shape_name, "tensors": len(spec), "numel": numel})
                cells.append(cell)
    progress("bench matrix: whole iterations, large model at batch 1 ...")
    return {"cells": cells, "iteration": whole_iteration_rows(device, steps, warmup, quick)}


def format_matrix(matrix: dict[str, Any] | None) -> list[str]:
    """Markdown for the matrix section (nothing when it did not run)."""
    if matrix is None:
        return []
    lines = [
        "",
        "Matrix: step phase ((unscale_ + clip) + step + update, gradients refilled untimed) and host time "
        "per step (the same step on the same layout with every tensor shrunk to 1 value: the per-step "
        "fixed cost, Python + dispatch + per-op overhead, with the bytes removed). torch vs ours "
        "interleaved in one process; ratio = median of per-step torch/ours ratios [IQR]; > 1 means "
        "gradscaler is faster.",
        "",
        "| shapes | optimizer | clip | torch ms | ours ms | torch/ours [IQR] | host torch ms | host ours ms "
        "| host torch/ours [IQR] | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in matrix["cells"]:
        head = f"| {c['shapes']} | {c['optimizer']} | {'1.0' if c['clip'] else 'no'} |"
        if "skipped" in c:
            lines.append(f"{head} - | - | n/a | - | - | n/a | {c['skipped']} |")
            continue
        s, h = c["step"], c["host"]
        flag = "" if s["ratio_q3"] >= 1.0 else " **<1**"
        lines.append(
            f"{head} {s['torch_ms']:.2f} | {s['ours_ms']:.2f} | {s['ratio']:.2f}{flag} [{s['ratio_q1']:.2f}-"
            f"{s['ratio_q3']:.2f}] | {h['torch_ms']:.3f} | {h['ours_ms']:.3f} | {h['ratio']:.2f} "
            f"[{h['ratio_q1']:.2f}-{h['ratio_q3']:.2f}] | {c['check']}{'' if c['ok'] else ' MISMATCH'} |"
        )
    lines += [
        "",
        "Whole iteration, a large model at batch 1 (the optimizer step a large share of the iteration):",
        "",
        "| model | optimizer | clip | torch ms | ours ms | torch/ours [IQR] | step phase share torch / ours | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in matrix["iteration"]:
        lines.append(
            f"| {r['params'] / 1e6:.1f}M params, batch {r['batch']} x {r['context']} | {r['optimizer']} | "
            f"{'1.0' if r['clip'] else 'no'} | {r['torch_ms']:.2f} | {r['ours_ms']:.2f} | {r['ratio']:.2f} "
            f"[{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] | {100 * r['torch_step_share']:.0f}% / "
            f"{100 * r['ours_step_share']:.0f}% | {r['check']} |"
        )
    return lines
