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
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.kernels import grad_stats
from gradscaler.tools.toy_model import TinyGPT

SCALE = 2.0**16
BUSY_MS = 5.0
"""GPU work queued ahead of each timed kernel/step call on CUDA (see ``_timer``)."""


def gpt2_shapes(width: int, layers: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 model (tied embeddings): 12 tensors a layer plus 3."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,)]


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs to keep the device busy for ``ms``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / start.elapsed_time(end))


def _timer(device: torch.device, busy_ms: float = 0.0) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call: CUDA events on CUDA, the host clock elsewhere.

    ``busy_ms`` > 0 puts that much GPU work (a sleep kernel) before the start event, so the host has
    queued the timed work before the GPU reaches it: device time, as inside a training loop where
    the backward pass still runs when the host calls ``step()``. Without it the host's Python time
    before the first launch is counted too.
    """
    cycles = sleep_cycles(busy_ms) if device.type == "cuda" and busy_ms > 0 else 0

    def timed(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if cycles:
                torch.cuda._sleep(cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return timed


def _median_ms(timed: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(steps))


def kernel_section(device: torch.device, shapes: list[tuple[int, ...]], steps: int, warmup: int) -> dict[str, Any]:
    """The one read pass against torch's per-tensor norms and the copy ceiling."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [(torch.randn(s, generator=gen) * SCALE * 1e-3).to(device) for s in shapes]
    numel = sum(g.numel() for g in grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = torch.empty_like(flat)
    timed = _timer(device, BUSY_MS)
    ours = grad_stats(grads, 2.0)
    assert ours.norms is not None
    expected = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]).float()
    error = float(((ours.norms - expected).abs() / expected).max())
    # Interleaved round by round: the copy ceiling is measured in the same moments as the passes, so
    # the per-round percentage is robust to other load on the machine.
    passes: dict[str, Callable[[], Any]] = {
        "copy": lambda: out.copy_(flat),
        "ours": lambda: grad_stats(grads, 2.0),
        "ours_check_only": lambda: grad_stats(grads, None),
        "foreach_norm": lambda: torch._foreach_norm(grads, 2.0),
        "flat_norm": lambda: torch.linalg.vector_norm(flat),
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    for i in range(warmup + steps):
        for name, fn in passes.items():
            ms = timed(fn)
            if i >= warmup:
                times[name].append(ms)
    copy_ms = statistics.median(times["copy"])
    result: dict[str, Any] = {
        "numel": numel,
        "tensors": len(grads),
        "copy_ms": copy_ms,
        "copy_bandwidth_GBps": 8 * numel / copy_ms / 1e6,
        "ideal_read_ms": copy_ms / 2,
        "max_rel_error_vs_float64": error,
    }
    for name in passes:
        if name == "copy":
            continue
        result[f"{name}_ms"] = statistics.median(times[name])
        # Percent of copy bandwidth: (bytes read / pass time) / (bytes moved by copy_ / copy time).
        share, q1, q3 = _spread([c / 2 / t for c, t in zip(times["copy"], times[name], strict=True)])
        result[f"{name}_fraction_of_copy_bandwidth"] = share
        result[f"{name}_fraction_iqr"] = [q1, q3]
    return result


def step_section(device: torch.device, shapes: list[tuple[int, ...]], steps: int, warmup: int) -> list[dict[str, Any]]:
    """Rows of the step-phase table."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    scaled = [(torch.randn(s, generator=gen) * SCALE * 1e-3).to(device) for s in shapes]
    unscaled = [g / SCALE for g in scaled]
    timed = _timer(device, BUSY_MS)
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
            check = _compare(variants["ours"].params, variants["torch"].params)
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
        if self.clip and self.name == "torch":
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        elif self.clip:
            self.scaler.clip_grad_norm_(self.opt, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()


def _compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> str:
    if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        return "bit-identical"
    worst = max(
        float(
            torch.linalg.vector_norm((x - y).detach().double())
            / torch.linalg.vector_norm(y.detach().double()).clamp_min(1e-30)
        )
        for x, y in zip(a, b, strict=True)
    )
    return f"rel diff {worst:.1e}"


def iteration_section(device: torch.device, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Whole fp16-autocast iterations, torch vs ours: fused and foreach AdamW with clip 1.0, and fused
    AdamW without clipping (where the two runs must be bit-identical)."""
    if device.type == "cuda":
        cfg, batch = {"vocab": 50257, "width": 768, "layers": 12, "heads": 12, "context": 1024}, 8
    else:  # float16 matmuls are emulated on CPUs (seconds per step): a small model, float32 forward
        cfg, batch = {"vocab": 4096, "width": 256, "layers": 4, "heads": 4, "context": 128}, 8
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(cfg["vocab"], (batch, cfg["context"] + 1), generator=gen).to(device) for _ in range(4)]
    timed = _timer(device)
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
                step = functools.partial(_iteration, model, opt, scaler, name, tokens, device, losses[name], clip)
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
                "params": _count(runs["ours"][0]),
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


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _iteration(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    name: str,
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
    if clip and name == "torch":
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


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
    quick: bool = False,
) -> dict[str, Any]:
    """Run the chosen sections and return every number (``quick``: the matrix at toy sizes)."""
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
    if "matrix" in sections:
        results["matrix"] = matrix_section(device, steps, warmup, quick, progress)
        results["matrix"]["quick"] = quick
    return results


def _pct(k: dict[str, Any], name: str) -> str:
    q1, q3 = k[f"{name}_fraction_iqr"]
    return f"{100 * k[f'{name}_fraction_of_copy_bandwidth']:.0f}% [{100 * q1:.0f}-{100 * q3:.0f}%]"


def format_tables(results: dict[str, Any]) -> str:
    """Markdown tables of the results (what the terminal and the README show)."""
    env = results["environment"]
    lines = [
        f"device: {env['device']} ({env.get('cores')} cores, {env.get('threads')} torch threads) | "
        f"torch {env['torch']} | "
        f"{env['dtype']} | seed {env['seed']} | gradscaler {env.get('gradscaler_commit')} | "
        f"median of {results['steps']} after {results['warmup']} warm-up"
        + (
            " | kernel and step rows: device time (GPU busy ahead of each call)"
            if "NVIDIA" in env["device"] or "cuda" in env["device"].lower()
            else ""
        )
    ]
    if "kernel" in results:
        k = results["kernel"]
        lines += [
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
            "",
            "(% of copy bandwidth: bytes read per ms over bytes a copy_ moves per ms, median of per-round "
            "ratios [IQR], the copy timed in the same round; over 100% means the read outruns copy / 2.)",
        ]
    if "step" in results:
        lines += [
            "",
            "Optimizer step phase (hand-off: the fused optimizer given grad_scale and found_inf by hand, "
            "no check: the floor for any scaler):",
            "",
            "| optimizer | clip | alone ms | hand-off ms | + torch scaler ms | + gradscaler ms "
            "| overhead torch / ours ms | speedup | check |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["step"]:
            lines.append(
                f"| {r['optimizer']} | {'1.0' if r['clip'] else 'no'} | {r['alone_ms']:.2f} | "
                f"{'-' if r['handoff_ms'] is None else format(r['handoff_ms'], '.2f')} | {r['torch_ms']:.2f} | "
                f"{r['ours_ms']:.2f} | {r['torch_overhead_ms']:.2f} / "
                f"{r['ours_overhead_ms']:.2f} | {r['speedup']:.2f}x | {r['check']} |"
            )
    if "iteration" in results:
        lines += [
            "",
            "Whole iteration (float16 autocast on CUDA, float32 on the CPU). With clipping the two runs differ "
            "by float32 summation order in the norm, so a step near the overflow edge can go either way; "
            "without clipping the scalers add no difference (bit-identical on the CPU; on CUDA the model's "
            "own backward is not deterministic):",
            "",
            "| optimizer | clip | params | torch scaler ms | gradscaler ms | speedup | check |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results["iteration"]:
            lines.append(
                f"| {r['optimizer']} | {'1.0' if r['clip'] else 'no'} | {r['params'] / 1e6:.0f}M | {r['torch_ms']:.2f} "
                f"| {r['ours_ms']:.2f} "
                f"| {r['speedup']:.2f}x | {r['check']} |"
            )
    if "matrix" in results:
        lines += format_matrix(results["matrix"])
    return "\n".join(lines)


def dump(results: dict[str, Any], path: str) -> None:
    """Write the results as JSON (NaN-free)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)


# ---------------------------------------------------------------------------------------------------
# The matrix: shapes x optimizers x clip, torch vs ours interleaved, with host time and a whole
# iteration where the step phase is a large share.

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
    if quick:
        gpt, small, huge = gpt2_shapes(64, 2, 512, 64), [(256,)] * 200, [(1 << 16,)] * 3
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


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range (q1, q3)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


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
        if self.clip and self.name == "torch":
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        elif self.clip:
            self.scaler.clip_grad_norm_(self.opt, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()


def _interleave(
    runs: dict[str, _MatrixRun], device: torch.device, steps: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-step wall ms and host (thread CPU) ms of each run, torch and ours alternating (and which
    goes first alternating too, so neither always runs on a warm cache)."""
    timed = _timer(device, BUSY_MS)
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
    ratio, q1, q3 = _spread([a / b for a, b in zip(torch_ms, ours_ms, strict=True)])
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
            params = _compare(runs["ours"].params, runs["torch"].params)
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
                if clip and name == "torch":
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                elif clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
                sync()
                end = time.perf_counter()
                scales[name].append(scaler.get_scale())
                if i >= warmup:
                    total[name].append((end - begin) * 1e3)
                    phase[name].append((end - middle) * 1e3)
        row: dict[str, Any] = {"optimizer": optimizer, "clip": clip, "params": _count(runs["ours"][0]), "batch": batch}
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


def format_matrix(matrix: dict[str, Any]) -> list[str]:
    """Markdown for the matrix section."""
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
