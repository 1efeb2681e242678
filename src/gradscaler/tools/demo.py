"""``gradscaler demo``: why float16 training needs loss scaling, reproduced at small scale.

The task: a character-level transformer language model learns a small generated corpus (sentences
from a fixed grammar, made in-process from the seed; nothing is downloaded). Five runs from the same
initial weights and batches, with the same AdamW: float32; float16 autocast without loss scaling;
float16 autocast with gradscaler (float32 parameters); the model cast to float16 (``model.half()``,
the float32 initial weights rounded) trained through float32 master weights
(``GradScaler(..., master_weights=True)``); and the same float16 model stepped in float16 without
masters (fused AdamW, see ``gradscaler.tools.demo_fp16``). It reproduces the findings of
Micikevicius et al., "Mixed Precision Training" (ICLR 2018): many activation-gradient values lie
below float16's smallest subnormal (2**-24) and become 0 without scaling (their Figure 3), float16
with loss scaling follows the float32 loss curve, and float16 weights need a float32 master copy
(their section 3.1: updates below float16's resolution are lost; here AdamW's second moment, kept in
float16, also underflows).

Why the gradients are small here, honestly. Language models are trained on large global batches
split over data-parallel ranks, and Megatron-LM's per-token loss (``calculate_per_token_loss``) has
each rank divide its summed token loss by the *global* token count, then sums gradients across ranks.
This demo is one rank of such a job with a 1,048,576-token global batch (Llama 2 trained on 4M-token
batches): on the CPU 512 tokens a step over 2,048 ranks, on CUDA 1,024 tokens over 1,024 ranks, so
the loss it back-propagates is its mean token loss / ranks. The gradient reaching each logit is then
(softmax - onehot) / 2**20 either way, of order 1e-7 to 1e-11; the output projection and the blocks
(weights at std 0.02, GPT-2's initialisation) shrink it further, and it shrinks again as the model
learns. After the backward pass every run multiplies its gradients by the rank count, in float32,
standing in for the all-reduce sum over ranks whose data are alike (``sum_over_ranks_``).

Sizes (``CPU`` and ``CUDA``, ``Setup``): float16 matrix products on a CPU without AVX-512 run about
ten times slower than float32 ones, so the CPU model is narrower (width 32) and sees 512 tokens a
step, which makes the whole demo under a minute on two such cores when nothing else runs (1-5 minutes
when other work shares them); on CUDA the model is width 64.
The verdicts hold over seeds 0-3 at both sizes (benchmarks/results/demo-seeds-cpu.txt).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler, JsonLinesLogger
from gradscaler.record.logfile import PLOT_HINT
from gradscaler.tools import shell
from gradscaler.tools.demo_figure import plot, scale_text
from gradscaler.tools.demo_fp16 import (
    FP16_PARAMETERS,
    MASTERS,
    NO_MASTERS,
    UpdateWatch,
    float32_copy,
    masters_line,
    no_masters_line,
    optimizer_params,
)
from gradscaler.tools.demo_progress import Progress, bar
from gradscaler.tools.toy_model import TinyGPT

FP16_TINY = 2.0**-24  # smallest positive subnormal float16
SCALED = "fp16 + gradscaler"
RUNS = ("fp32", "fp16, no scaling", SCALED, MASTERS, NO_MASTERS)
GLOBAL_TOKENS = 2**20
"""Tokens in the global batch of the data-parallel job this demo is one rank of (the module docstring)."""


@dataclass(frozen=True)
class Setup:
    """The model, the batches and the run length of one device kind."""

    width: int
    layers: int
    heads: int
    batch: int
    context: int
    steps: int
    lr: float = 3e-3
    final_lr: float | None = None
    """With a value, the learning rate falls from ``lr`` to it along a half cosine over the run."""

    def lr_factor(self, step: int) -> float:
        """The learning rate at ``step`` as a multiple of ``lr`` (1 throughout without ``final_lr``)."""
        if self.final_lr is None:
            return 1.0
        low = self.final_lr / self.lr
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * min(step / self.steps, 1.0)))

    @property
    def ranks(self) -> int:
        """Data-parallel ranks the per-token loss is normalised over: the global batch over this rank's tokens."""
        return GLOBAL_TOKENS // (self.batch * self.context)


CPU = Setup(width=32, layers=2, heads=4, batch=16, context=32, steps=400, lr=1e-2, final_lr=1e-3)
"""Sized for under a minute on two quiet cores without AVX-512 (float16 products about ten times float32's cost)."""
CUDA = Setup(width=64, layers=2, heads=4, batch=16, context=64, steps=600)
CPU_THREADS = 1
"""Threads on the CPU (``--threads`` changes it). The matrices are small: on 2 quiet cores without
AVX-512 a second thread took the demo from 46 s to 40 s, but with other work on the machine torch's
OpenMP barriers wait for a descheduled thread at every operation, and the same demo took 212 s."""
LOSS_TOLERANCE = 0.10
"""The demo's stated tolerance: final loss of fp16 + gradscaler, and of fp16 parameters + master
weights, within 10% of the fp32 run's (float16 rounding makes the trajectories differ step by step;
all are evaluated in float32 on the same held-out batches)."""
EVAL_BATCHES = 4
GROWTH_INTERVAL = 10
"""The scaled runs' ``growth_interval`` (torch's default: 2000), so that a few hundred steps show the scale
growing up to overflow and backing off."""


def corpus(seed: int, sentences: int = 4000) -> str:
    """Sentences from a small English-like grammar (subject, verb, object, place), lower case."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the teacher"]
    verbs = ["sees", "finds", "likes", "follows", "paints", "carries", "wants"]
    objects = ["the ball", "a red box", "the river", "an apple", "the green door", "a small boat"]
    places = ["in the park", "at home", "near the hill", "by the sea", "after school", "at night"]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(places)}."
        for _ in range(sentences)
    )


class Batches:
    """Seeded random windows of the encoded corpus: (inputs, targets) of shape (batch, context)."""

    def __init__(self, text: str, batch: int, context: int, seed: int, device: torch.device) -> None:
        self.vocab = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.batch, self.context, self.seed, self.device = batch, context, seed, device

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        starts = torch.randint(len(self.data) - self.context - 1, (self.batch,), generator=gen)
        window = torch.stack([self.data[s : s + self.context + 1] for s in starts.tolist()])
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)


def sum_over_ranks_(params: list[torch.Tensor], ranks: int) -> None:
    """Stand-in for the all-reduce SUM of a data-parallel job: ``ranks`` ranks whose data are alike.

    Applied after the backward pass, in float32, to every run alike (the float16 run without masters
    aside: its float16 gradients, still scaled, as DDP sums them): it restores the gradient's magnitude
    for the optimizer; it cannot bring back values the float16 backward already lost.
    """
    with torch.no_grad():
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], float(ranks))


def loss_of(
    model: TinyGPT, x: torch.Tensor, y: torch.Tensor, fp16: bool, keep: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Mean next-character cross-entropy; the forward pass under float16 autocast when ``fp16``."""
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=fp16):
        logits = model(x, keep)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def activation_gradients(model: TinyGPT, batch: tuple[torch.Tensor, torch.Tensor], ranks: int) -> torch.Tensor:
    """|gradient| of every activation value for this rank's loss, computed in float32 (the true values)."""
    model.zero_grad(set_to_none=True)
    kept: list[torch.Tensor] = []
    (loss_of(model, *batch, fp16=False, keep=kept) / ranks).backward()
    values = torch.cat([a.grad.detach().abs().reshape(-1).float() for a in kept if a.grad is not None])
    model.zero_grad(set_to_none=True)
    return values


def underflow_share(values: torch.Tensor, scale: float) -> float:
    """Share of nonzero gradient values that float16 flushes to 0 at this loss scale."""
    nonzero = values[values > 0]
    return float((nonzero * scale < FP16_TINY / 2).float().mean()) if nonzero.numel() else 0.0


def train(
    name: str,
    setup: Setup,
    batches: Batches,
    seed: int,
    progress: bool,
    log: Path | None = None,
    clock: Progress | None = None,
) -> dict[str, Any]:
    """One run of ``setup.steps`` steps; returns losses, scales, skipped steps, timing and the final
    underflow share.

    With ``log``, the gradscaler run writes its scaler log there (every step; ``gradscaler report`` reads it).
    ``clock``: the demo's progress over all its runs, for the time left.
    """
    steps = setup.steps
    if name not in RUNS:
        raise ValueError(f"unknown demo run {name!r}; the runs are {', '.join(RUNS)}")
    torch.manual_seed(seed)
    model = TinyGPT(len(batches.vocab), setup.width, setup.layers, setup.heads, setup.context).to(batches.device)
    if name in FP16_PARAMETERS:
        model.half()  # the float32 initial weights, rounded to float16
    # Fused AdamW: how torch lets a scaler step float16 parameters without masters (demo_fp16).
    fused: dict[str, Any] = {"fused": True} if name == NO_MASTERS else {}
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0, **fused)
    schedule = None if setup.final_lr is None else torch.optim.lr_scheduler.LambdaLR(opt, setup.lr_factor)
    fp16 = name != "fp32"
    # collapse_patience=None lets the float16 run without masters go on to the end once it has diverged.
    scaler = (
        GradScaler(
            batches.device.type,
            growth_interval=GROWTH_INTERVAL,
            collapse_patience=None,
            master_weights=name == MASTERS,
        )
        if name in (SCALED, *FP16_PARAMETERS)
        else None
    )
    if scaler is not None and log is not None and name == SCALED:
        log.unlink(missing_ok=True)  # the logger appends
        scaler.name_parameters(model)
        scaler.add_logger(JsonLinesLogger(log), every=1)
    watch = UpdateWatch(model, opt, scaler) if scaler is not None and name in FP16_PARAMETERS else None
    losses: list[float] = []
    begin = time.perf_counter()
    if clock is not None:
        clock.start(name)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, *batches.get(step), fp16=fp16)
        rank_loss = loss / setup.ranks  # this rank's share of the global per-token loss
        if scaler is None:
            rank_loss.backward()
            sum_over_ranks_(optimizer_params(opt), setup.ranks)
            opt.step()
        else:
            scaler.scale(rank_loss).backward()
            if name != NO_MASTERS:  # with masters: moves the gradients into the float32 masters, unscaled
                scaler.unscale_(opt)
            sum_over_ranks_(optimizer_params(opt), setup.ranks)  # without masters: float16 gradients, still scaled
            if watch is not None:
                watch.before()
            scaler.step(opt)
            scaler.update()
            if watch is not None:
                watch.after()
        if schedule is not None:
            schedule.step()
        losses.append(loss.detach().item())
        if clock is not None:
            clock.step()
        if progress:
            bar(name, step + 1, steps, losses[-1], begin, clock)
    seconds = time.perf_counter() - begin
    held_out = [batches.get(10**6 + i) for i in range(EVAL_BATCHES)]
    evaluated = float32_copy(model) if name in FP16_PARAMETERS else model
    with torch.no_grad():
        final = sum(float(loss_of(evaluated, *b, fp16=False)) for b in held_out) / len(held_out)
    scale = scaler.get_scale() if scaler is not None else 1.0
    history = scaler.history() if scaler is not None else {"scale": [], "skipped": []}
    grads = activation_gradients(evaluated, held_out[0], setup.ranks)
    return {
        "run": name,
        "losses": losses,
        "final_loss": final,
        "seconds": seconds,
        "skipped_steps": sum(history["skipped"]),
        "final_scale": scale,
        "scales": history["scale"],
        "skipped": history["skipped"],
        "underflow_share": None if name == "fp32" else underflow_share(grads, scale),
        "activation_gradients": grads,
        **(watch.numbers() if watch is not None else {}),
    }


def summary_table(runs: list[dict[str, Any]]) -> str:
    """The demo's summary, as a Markdown table."""
    lines = [
        "| run | final loss | skipped steps | final scale | activation grads underflowed "
        "| updates lost to fp16 rounding | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        scaled = r["run"] in (SCALED, *FP16_PARAMETERS)
        share = "-" if r["underflow_share"] is None else f"{100 * r['underflow_share']:.1f}%"
        skipped = str(r["skipped_steps"]) if scaled else "-"
        scale = scale_text(r["final_scale"]) if scaled else "-"
        lost = "-" if r.get("lost_update_share") is None else f"{100 * r['lost_update_share']:.2f}%"
        if r["run"] == MASTERS and lost != "-":
            lost += " (kept by the masters)"
        lines.append(
            f"| {r['run']} | {r['final_loss']:.3f} | {skipped} | {scale} | {share} | {lost} | {r['seconds']:.1f} s |"
        )
    return "\n".join(lines)


def verdict(runs: list[dict[str, Any]]) -> list[str]:
    """Plain-language reading of the numbers, checked against the stated tolerance."""
    by_name = {r["run"]: r for r in runs}
    fp32 = by_name["fp32"]["final_loss"]
    out = [within_tolerance(SCALED, by_name[SCALED]["final_loss"], fp32)]
    out.append(no_scaling_line(by_name["fp16, no scaling"]["losses"], by_name["fp16, no scaling"]["final_loss"], fp32))
    if MASTERS in by_name:
        out.append(within_tolerance(MASTERS, by_name[MASTERS]["final_loss"], fp32) + masters_line(by_name[MASTERS]))
    if NO_MASTERS in by_name:
        out.append(no_masters_line(by_name[NO_MASTERS], fp32, LOSS_TOLERANCE))
    return out


def no_scaling_line(losses: list[float], final: float, fp32: float) -> str:
    """The verdict of the float16 run without scaling: stalled (it stopped learning), lags, or no lag.

    Stalled: over the second half of the run its training loss (the mean of a twentieth of the run, at
    the middle and at the end) fell by less than the tolerance.
    """
    lag = (final - fp32) / fp32
    head = f"fp16 without scaling ends {100 * lag:+.1f}% from the fp32 loss"
    if lag <= LOSS_TOLERANCE:
        return f"{head}: no lag at this size."
    window = max(len(losses) // 20, 1)
    half = max(len(losses) // 2, window)
    middle = sum(losses[half - window : half]) / window
    end = sum(losses[-window:]) / window
    if end > middle * (1 - LOSS_TOLERANCE):
        return (
            f"{head}: it stalled (training loss {middle:.2f} at step {half}, {end:.2f} at step {len(losses)}), "
            "because the gradients it needed were flushed to zero."
        )
    return f"{head}: it lags, because the gradients it needed were flushed to zero."


def within_tolerance(name: str, loss: float, fp32: float) -> str:
    """The PASS/FAIL line of a run held to the stated tolerance of the fp32 loss."""
    gap = abs(loss - fp32) / fp32
    passed = math.isfinite(gap) and gap <= LOSS_TOLERANCE
    return (
        f"{name} ends within {100 * gap:.1f}% of the fp32 loss (tolerance "
        f"{100 * LOSS_TOLERANCE:.0f}%): {'PASS' if passed else 'FAIL'}."
    )


def histogram_data(grads: torch.Tensor, scale: float) -> dict[str, Any]:
    """log2 |g| histograms (1/4-octave bins) before and after scaling by ``scale``."""
    values = grads[grads > 0].double().log2()
    edges = torch.arange(-60.0, 20.25, 0.25, dtype=torch.float64)
    before = torch.histc(values, bins=len(edges) - 1, min=float(edges[0]), max=float(edges[-1]))
    after = torch.histc(values + math.log2(scale), bins=len(edges) - 1, min=float(edges[0]), max=float(edges[-1]))
    return {
        "edges": edges.tolist(),
        "before": before.tolist(),
        "after": after.tolist(),
        "scale": scale,
        "zeros": int((grads == 0).sum()),
        "total": grads.numel(),
        "flushed_before": underflow_share(grads, 1.0),
        "flushed_after": underflow_share(grads, scale),
    }


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as None (JSON has no NaN or inf): a diverged run's losses."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def main(args: Any) -> int:
    """Entry point of ``gradscaler demo`` (arguments from ``gradscaler.tools.cli``); torch's thread count
    is set for the demo (``--threads``, ``CPU_THREADS``) and given back after it."""
    before = torch.get_num_threads()
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(before)


def _demo(args: Any) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    setup = CUDA if device.type == "cuda" else CPU
    if args.steps:
        setup = replace(setup, steps=args.steps)
    threads = getattr(args, "threads", None) or (CPU_THREADS if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"gradscaler demo: a character-level transformer on generated sentences, {setup.steps} steps per run, "
        f"on {device.type}.\nEach step back-propagates one rank's share of a per-token loss over a "
        f"{setup.ranks}-rank job (loss / {setup.ranks}), which is what makes its gradients small; see "
        f"`{shell.python()} -c 'import gradscaler.tools.demo as d; help(d)'`.\n"
    )
    batches = Batches(corpus(args.seed), batch=setup.batch, context=setup.context, seed=args.seed, device=device)
    log = out / "gradscaler-demo-scaler.jsonl"
    clock = Progress(RUNS, setup.steps)
    runs = [train(name, setup, batches, args.seed, not args.no_progress, log, clock) for name in RUNS]
    scaled = next(r for r in runs if r["run"] == SCALED)
    hist = histogram_data(scaled["activation_gradients"], scaled["final_scale"])
    hist["flushed_without_scaling"] = next(r for r in runs if r["run"] == "fp16, no scaling")["underflow_share"]
    print()
    print(summary_table(runs))
    print()
    verdicts = verdict(runs)
    for line in verdicts:
        print(line)
    numbers = {
        "steps": setup.steps,
        "device": device.type,
        "seed": args.seed,
        "setup": asdict(setup),
        "ranks": setup.ranks,
        "loss_tolerance": LOSS_TOLERANCE,
        "histogram": hist,
        "runs": [{k: v for k, v in r.items() if k != "activation_gradients"} for r in runs],
    }
    json_path = out / "gradscaler-demo.json"
    json_path.write_text(json.dumps(json_safe(numbers), indent=1, allow_nan=False))
    png = out / "gradscaler-demo.png"
    if plot(runs, hist, verdicts, GROWTH_INTERVAL, png):
        print(f"\nfigure: {png}")
    else:
        print(f"\nmatplotlib is not installed, so no figure was drawn: {PLOT_HINT}")
    print(f"numbers: {json_path}")
    print(f"scaler log of the {SCALED} run: {log}")
    print("\nWhat happened to its loss scale, in words and in a figure:")
    print(f"  {report_hint(log)}")
    return 0


def report_hint(log: Path) -> str:
    """The ``gradscaler report`` command for the demo's log, as it runs when pasted in this shell."""
    figure = log.with_name("gradscaler-demo-report.png")
    return f"{shell.command()} report {shell.quoted(log)} --out {shell.quoted(figure)}"
