"""``gradscaler bench``: torch.amp.GradScaler and gradscaler side by side, in one process.

Three sections, each checking correctness while it times:

* ``kernel``: one read pass over GPT-2-medium-shaped gradients (non-finite flag + L2 norms) against
  ``torch._foreach_norm`` and a device copy (bandwidth ceiling).
  On CUDA these two sections time device work: 5 ms of GPU sleep is queued ahead of each timed call
  so that host (Python) time is hidden, as it is inside a training loop.
* ``step``: the optimizer step phase on GPT-2-medium-shaped parameters (355M on CUDA, 33M on the CPU):
  fused / foreach AdamW x no clip / clip 1.0; columns: optimizer alone, + torch scaler, + gradscaler.
  Variants run round-robin, each from its own copy of the same parameters, gradients restored
  (untimed) before every timed step; after the run the parameters of both scalers are compared.
* ``iteration``: whole training iterations of a GPT-2-small-shaped model under float16 autocast
  (CUDA: 124M, batch 8 x 1024; CPU: a small one), clip 1.0, fused and foreach AdamW.

On request (``--sections``): ``matrix`` (``matrix.py``), ``masters`` (``bench_masters.py``),
``compile`` (``bench_compile.py``: eager, compiled model, compiled step) and ``memory``
(``memory.py``: bytes per parameter measured from the storages, nothing timed) and ``accumulation``
(``bench_accumulate.py``: ``accumulate_grads_in_fp32``'s precision, training, memory and time).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.kernels import grad_stats
from gradscaler.tools.harness import BUSY_MS, SCALE, compare, count_params, gpt2_shapes, spread, step_phase, timer
from gradscaler.tools.toy_model import TinyGPT


def _median_ms(timed: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(steps))


def kernel_section(device: torch.device, shapes: list[tuple[int, ...]], steps: int, warmup: int) -> dict[str, Any]:
    """The one read pass against torch's per-tensor norms and the copy ceiling."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [(torch.randn(s, generator=gen) * SCALE * 1e-3).to(device) for s in shapes]
    numel = sum(g.numel() for g in grads)
    views = [g.reshape(-1) for g in grads]
    flat = torch.cat(views)
    out = torch.empty_like(flat)
    timed = timer(device, BUSY_MS)
    ours = grad_stats(grads, 2.0)
    assert ours.norms is not None
    expected = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]).float()
    error = float(((ours.norms - expected).abs() / expected).max())
    # Every pass is timed right after a copy_ of the whole buffer: each starts from the same cache
    # state (a pass timed after another read would find part of the gradients cached), and its
    # percentage is taken against the copy timed a moment before, robust to other load on the machine.

    def copy() -> torch.Tensor:
        return out.copy_(flat)

    passes: dict[str, Callable[[], Any]] = {
        "ours": lambda: grad_stats(grads, 2.0),
        "ours_check_only": lambda: grad_stats(grads, None),
        "foreach_norm": lambda: torch._foreach_norm(grads, 2.0),
        "flat_norm": lambda: torch.linalg.vector_norm(flat),
        "dots": lambda: [torch.dot(v, v) for v in views],
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    copies: dict[str, list[float]] = {name: [] for name in passes}
    for i in range(warmup + steps):
        for name, fn in passes.items():
            copy_ms, ms = timed(copy), timed(fn)
            if i >= warmup:
                copies[name].append(copy_ms)
                times[name].append(ms)
    copy_ms = statistics.median([ms for per_pass in copies.values() for ms in per_pass])
    result: dict[str, Any] = {
        "numel": numel,
        "tensors": len(grads),
        "copy_ms": copy_ms,
        "copy_bandwidth_GBps": 8 * numel / copy_ms / 1e6,
        "ideal_read_ms": copy_ms / 2,
        "max_rel_error_vs_float64": error,
    }
    for name in passes:
        result[f"{name}_ms"] = statistics.median(times[name])
        # Percent of copy bandwidth: (bytes read / pass time) / (bytes moved by copy_ / copy time).
        share, q1, q3 = spread([c / 2 / t for c, t in zip(copies[name], times[name], strict=True)])
        result[f"{name}_fraction_of_copy_bandwidth"] = share
        result[f"{name}_fraction_iqr"] = [q1, q3]
    return result


def step_section(device: torch.device, shapes: list[tuple[int, ...]], steps: int, warmup: int) -> list[dict[str, Any]]:
    """Rows of the step-phase table."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    scaled = [(torch.randn(s, generator=gen) * SCALE * 1e-3).to(device) for s in shapes]
    unscaled = [g / SCALE for g in scaled]
    timed = timer(device, BUSY_MS)
    rows = []
    for fused in (True, False):
        for clip in (False, True):
            names = ("alone", "handoff", "torch", "ours") if fused else ("alone", "torch", "ours")
            variants = {name: _StepVariant(name, init, fused, clip, device) for name in names}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for i in range(warmup + steps):
                for name, variant in variants.items():
                    variant.load(unscaled if name == "alone" else scaled)
                    ms = timed(variant.step)
                    if i >= warmup:
                        times[name].append(ms)
            medians = {name: statistics.median(t) for name, t in times.items()}
            check = compare(variants["ours"].params, variants["torch"].params)
            rows.append(
                {
                    "optimizer": f"{'fused' if fused else 'foreach'} AdamW",
                    "clip": clip,
                    "alone_ms": medians["alone"],
                    "handoff_ms": medians.get("handoff"),
                    "torch_ms": medians["torch"],
                    "ours_ms": medians["ours"],
                    "torch_overhead_ms": medians["torch"] - medians["alone"],
                    "ours_overhead_ms": medians["ours"] - medians["alone"],
                    "speedup": medians["torch"] / medians["ours"],
                    "check": check,
                }
            )
            del variants
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


class _StepVariant:
    """One copy of the parameters with its optimizer and scaler ("alone": no scaler)."""

    def __init__(self, name: str, init: list[torch.Tensor], fused: bool, clip: bool, device: torch.device) -> None:
        self.name, self.clip = name, clip
        self.params = [nn.Parameter(p.clone()) for p in init]
        for p in self.params:
            p.grad = torch.empty_like(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=fused or None, foreach=None if fused else True)
        big = 10**9
        self.scaler: Any = None
        if name == "torch":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=big)
        elif name == "ours":
            self.scaler = GradScaler(device.type, init_scale=SCALE, growth_interval=big)
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=device))
        # "handoff": the fused optimizer given grad_scale and found_inf by hand, no check at all:
        # the floor for any scaler on the fused path.
        self.grad_scale = torch.full((), SCALE, device=device)
        self.found_inf = torch.zeros((), device=device)

    def load(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            assert p.grad is not None
            p.grad.copy_(g)

    def step(self) -> None:
        if self.name == "handoff":
            self.opt.grad_scale, self.opt.found_inf = self.grad_scale, self.found_inf  # type: ignore[attr-defined]
            self.opt.step()
            del self.opt.grad_scale, self.opt.found_inf  # type: ignore[attr-defined]
            return
        if self.scaler is None:
            self.opt.step()
            return
        step_phase(self.scaler, self.opt, self.params, self.clip)


def iteration_section(device: torch.device, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Whole fp16-autocast iterations, torch vs ours: fused and foreach AdamW with clip 1.0, and fused
    AdamW without clipping (where the two runs must be bit-identical)."""
    if device.type == "cuda":
        cfg, batch = {"vocab": 50257, "width": 768, "layers": 12, "heads": 12, "context": 1024}, 8
    else:  # float16 matmuls are emulated on CPUs (seconds per step): a small model, float32 forward
        cfg, batch = {"vocab": 4096, "width": 256, "layers": 4, "heads": 4, "context": 128}, 8
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(cfg["vocab"], (batch, cfg["context"] + 1), generator=gen).to(device) for _ in range(4)]
    timed = timer(device)
    rows = []
    for fused, clip in ((True, True), (False, True), (True, False)):
        runs = {}
        for name in ("torch", "ours"):
            torch.manual_seed(0)
            model = TinyGPT(**cfg).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused or None, foreach=None if fused else True)
            scaler = torch.amp.GradScaler(device.type) if name == "torch" else GradScaler(device.type)
            runs[name] = (model, opt, scaler)
        times: dict[str, list[float]] = {"torch": [], "ours": []}
        losses: dict[str, list[torch.Tensor]] = {"torch": [], "ours": []}
        scales: dict[str, list[float]] = {"torch": [], "ours": []}
        for i in range(warmup + steps):
            for name, (model, opt, scaler) in runs.items():
                tokens = data[i % len(data)]
                step = functools.partial(_iteration, model, opt, scaler, tokens, device, losses[name], clip)
                ms = timed(step)
                scales[name].append(scaler.get_scale())  # after the timed call: its sync is not timed
                if i >= warmup:
                    times[name].append(ms)
        med = {name: statistics.median(t) for name, t in times.items()}
        same_scales = scales["ours"] == scales["torch"]
        loss_diff = max(
            abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(losses["ours"], losses["torch"], strict=True)
        )
        check = f"{'same' if same_scales else 'DIFFERENT'} scales, loss rel diff <= {loss_diff:.1e}"
        rows.append(
            {
                "optimizer": f"{'fused' if fused else 'foreach'} AdamW",
                "clip": clip,
                "params": count_params(runs["ours"][0]),
                "torch_ms": med["torch"],
                "ours_ms": med["ours"],
                "speedup": med["torch"] / med["ours"],
                "check": check,
            }
        )
        del runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _iteration(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    tokens: torch.Tensor,
    device: torch.device,
    losses: list[torch.Tensor],
    clip: bool,
) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    losses.append(loss.detach())
    scaler.scale(loss).backward()
    step_phase(scaler, opt, list(model.parameters()), clip)


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": name,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "dtype": "float32 params/grads (matrix: also fp16 matrices), float16 autocast on CUDA",
        "seed": 0,
        "threads": torch.get_num_threads(),
        "gradscaler_commit": _commit(),
    }


def _commit() -> str | None:
    """The git commit of the gradscaler source being measured (None outside a checkout)."""
    import gradscaler

    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=os.path.dirname(gradscaler.__file__),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run(
    device_name: str | None,
    steps: int,
    warmup: int,
    sections: list[str],
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the chosen sections (kernel, step, iteration, masters, compile, memory, accumulation, bf16) and return
    every number (matrix: ``matrix.py``)."""
    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = gpt2_shapes(1024, 24, 50257, 1024) if device.type == "cuda" else gpt2_shapes(512, 8, 16384, 512)
    results: dict[str, Any] = {"environment": environment(device), "steps": steps, "warmup": warmup}
    if "kernel" in sections:
        progress("bench: one read pass over the gradients ...")
        results["kernel"] = kernel_section(device, shapes, steps, warmup)
    if "step" in sections:
        progress("bench: optimizer step phase (4 rows x 3 variants) ...")
        results["step"] = step_section(device, shapes, steps, warmup)
    if "iteration" in sections:
        progress("bench: whole training iterations ...")
        results["iteration"] = iteration_section(device, steps, warmup)
    if "masters" in sections:
        from gradscaler.tools.bench_masters import masters_section

        progress("bench: float16 parameters + master weights, step phase (4 rows x 2 variants) ...")
        results["masters"] = masters_section(device, shapes, steps, warmup)
    if "compile" in sections:
        from gradscaler.tools.bench_compile import compile_section

        progress("bench: training steps eager, model compiled, step compiled (4 loop shapes x 2 scalers) ...")
        results["compile"] = compile_section(device, steps, warmup)
    if "memory" in sections:
        from gradscaler.tools.memory import memory_section

        progress("bench: bytes per parameter after a training step (3 setups x 2 optimizers) ...")
        results["memory"] = memory_section(device)
    if "host" in sections:
        from gradscaler.tools.bench_host import SHAPES, host_section, triton_rows

        if device.type == "cpu":  # the CUDA route's ops, dispatched here: the proxy for a GPU's host
            progress(f"bench: host cost per step on the CUDA route ({len(SHAPES)} loop shapes x 2 scalers) ...")
            results["host"] = host_section(steps, warmup, progress=progress)
            progress(
                "bench: host cost on the Triton route, its kernels in Triton's interpreter (counts only; minutes) ..."
            )
            results["host"] += triton_rows(progress)
        else:  # the real thing, each phase's thread time after the device drained: the scaler's own route, then
            # torch's ops (no Triton): which of the two is lighter on the host, shape by shape
            progress(f"bench: host cost per step on {device} ({len(SHAPES)} loop shapes x 2 scalers x 2 routes) ...")
            results["host"] = host_section(steps, warmup, route="native", device=device, progress=progress)
            results["host"] += host_section(steps, warmup, route="torch-ops", device=device, progress=progress)
    if "accumulation" in sections:
        from gradscaler.tools.bench_accumulate import accumulation_section

        progress("bench: gradients accumulated in float32: precision, training, memory, time ...")
        results["accumulation"] = accumulation_section(device, steps, warmup)
    if "bf16" in sections:
        from gradscaler.tools.bench_bf16 import bf16_section

        progress("bench: a bfloat16 model without a scaler, with and without with_master_weights ...")
        results["bf16"] = bf16_section(device, steps)
    return results


def _pct(k: dict[str, Any], name: str) -> str:
    q1, q3 = k[f"{name}_fraction_iqr"]
    return f"{100 * k[f'{name}_fraction_of_copy_bandwidth']:.0f}% [{100 * q1:.0f}-{100 * q3:.0f}%]"


TIMED = ("kernel", "step", "iteration", "matrix", "masters", "compile", "accumulation", "bf16")
"""The sections that time something (``memory`` only counts bytes): the header names the median only with one."""


def format_tables(results: dict[str, Any]) -> str:
    """Markdown tables of the results (what the terminal and the README show)."""
    env = results["environment"]
    lines = [
        f"device: {env['device']} ({env.get('cores')} cores, {env.get('threads')} torch threads) | "
        f"torch {env['torch']} | "
        f"{env['dtype']} | seed {env['seed']} | gradscaler {env.get('gradscaler_commit')}"
        + (
            f" | median of {results['steps']} after {results['warmup']} warm-up"
            if any(section in results for section in TIMED)
            else ""
        )
        + (
            " | kernel and step rows: device time (GPU busy ahead of each call)"
            if ("kernel" in results or "step" in results)
            and ("NVIDIA" in env["device"] or "cuda" in env["device"].lower())
            else ""
        )
    ]
    formatters: dict[str, Callable[[Any], list[str]]] = {
        "kernel": _kernel_lines,
        "step": _step_lines,
        "iteration": _iteration_lines,
    }
    if "masters" in results:
        from gradscaler.tools.bench_masters import masters_lines

        formatters["masters"] = masters_lines
    if "host" in results:
        from gradscaler.tools.bench_host import format_host

        formatters["host"] = format_host
    if "compile" in results:
        from gradscaler.tools.bench_compile import compile_lines

        formatters["compile"] = compile_lines
    if "memory" in results:
        from gradscaler.tools.memory import memory_lines

        formatters["memory"] = memory_lines
    if "accumulation" in results:
        from gradscaler.tools.bench_accumulate import accumulation_lines

        formatters["accumulation"] = accumulation_lines
    if "bf16" in results:
        from gradscaler.tools.bench_bf16 import bf16_lines

        formatters["bf16"] = bf16_lines
    for section, format_section in formatters.items():
        if section in results:
            lines += format_section(results[section])
    return "\n".join(lines)


def _kernel_lines(k: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"One read pass, {k['numel'] / 1e6:.0f}M float32 values in {k['tensors']} tensors:",
        "",
        "| pass | ms |",
        "|---|---|",
        f"| device copy (read+write) | {k['copy_ms']:.3f} ({k['copy_bandwidth_GBps']:.0f} GB/s) |",
        f"| ideal read (copy / 2) | {k['ideal_read_ms']:.3f} |",
        f"| gradscaler flag + L2 norms | {k['ours_ms']:.3f} ({_pct(k, 'ours')} of copy bandwidth) |",
        f"| gradscaler flag only | {k['ours_check_only_ms']:.3f} ({_pct(k, 'ours_check_only')}) |",
        f"| torch._foreach_norm | {k['foreach_norm_ms']:.3f} ({_pct(k, 'foreach_norm')}) |",
        f"| flat-buffer vector_norm | {k['flat_norm_ms']:.3f} ({_pct(k, 'flat_norm')}) |",
    ]
    if "dots_ms" in k:  # records older than this pass have none
        lines.append(f"| one torch.dot per tensor, nothing else | {k['dots_ms']:.3f} ({_pct(k, 'dots')}) |")
    return [
        *lines,
        "",
        "(% of copy bandwidth: bytes read per ms over bytes a copy_ moves per ms, median of per-pass "
        "ratios [IQR], each pass timed right after its own copy; over 100% means the read outruns copy / 2.)",
    ]


def _step_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "Optimizer step phase (hand-off: the fused optimizer given grad_scale and found_inf by hand, "
        "no check: the floor for any scaler):",
        "",
        "| optimizer | clip | alone ms | hand-off ms | + torch scaler ms | + gradscaler ms "
        "| overhead torch / ours ms | speedup | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {'1.0' if r['clip'] else 'no'} | {r['alone_ms']:.2f} | "
            f"{'-' if r['handoff_ms'] is None else format(r['handoff_ms'], '.2f')} | {r['torch_ms']:.2f} | "
            f"{r['ours_ms']:.2f} | {r['torch_overhead_ms']:.2f} / "
            f"{r['ours_overhead_ms']:.2f} | {r['speedup']:.2f}x | {r['check']} |"
        )
    return lines


def _iteration_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "Whole iteration (float16 autocast on CUDA, float32 on the CPU). With clipping the two runs differ "
        "by float32 summation order in the norm, so a step near the overflow edge can go either way; "
        "without clipping the scalers add no difference (bit-identical on the CPU; on CUDA the model's "
        "own backward is not deterministic):",
        "",
        "| optimizer | clip | params | torch scaler ms | gradscaler ms | speedup | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {'1.0' if r['clip'] else 'no'} | {r['params'] / 1e6:.0f}M | {r['torch_ms']:.2f} "
            f"| {r['ours_ms']:.2f} "
            f"| {r['speedup']:.2f}x | {r['check']} |"
        )
    return lines


def dump(results: dict[str, Any], path: str) -> None:
    """Write the results as JSON (NaN-free)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)
