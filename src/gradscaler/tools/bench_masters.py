"""``gradscaler bench --sections masters``: float16 parameters with float32 masters, against the recipe by hand.

The step phase on GPT-2-shaped float16 parameters (the ``step`` section's shapes), fused / foreach
AdamW x no clip / clip 1.0. "by hand": torch's scaler on an optimizer over float32 copies, the float16
gradients copied into preallocated float32 gradients with one ``torch._foreach_copy_``, and the
parameters refreshed with another after the step (the fastest way to write the recipe with torch's
ops). "gradscaler": ``GradScaler(master_weights=True)``, whose move is one pass (2 bytes read and 4
written per value, the flag and clipping norms in the same pass). Both start from the same values; after the run their
parameters are compared (bit-identical without clipping; with clipping gradscaler's one-pass
``clip_grad_norm_`` rounds differently from ``unscale_`` + torch's ``clip_grad_norm_``).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.tools.harness import BUSY_MS, SCALE, compare, step_phase, timer


class _Variant:
    """float16 parameters, their gradients (re-attached before every step) and one way to step them."""

    def __init__(self, by_hand: bool, init: list[torch.Tensor], fused: bool, clip: bool) -> None:
        self.by_hand, self.clip = by_hand, clip
        self.params = [nn.Parameter(p.clone()) for p in init]
        self.grads = [torch.empty_like(p) for p in init]
        flags: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        big = 10**9
        device = init[0].device
        if by_hand:
            self.masters = [nn.Parameter(p.detach().float()) for p in self.params]
            for m in self.masters:
                m.grad = torch.empty_like(m)
            self.opt = torch.optim.AdamW(self.masters, lr=1e-4, **flags)
            self.scaler: Any = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=big)
        else:
            self.opt = torch.optim.AdamW(self.params, lr=1e-4, **flags)
            self.scaler = GradScaler(device.type, init_scale=SCALE, growth_interval=big, master_weights=True)
        self.scaler.scale(torch.ones((), device=device))

    def load(self, scaled: list[torch.Tensor]) -> None:
        for p, g, s in zip(self.params, self.grads, scaled, strict=True):
            g.copy_(s)
            p.grad = g

    def step(self) -> None:
        if not self.by_hand:
            step_phase(self.scaler, self.opt, self.params, self.clip)
            return
        master_grads = [m.grad for m in self.masters]
        torch._foreach_copy_(master_grads, [p.grad for p in self.params])  # type: ignore[arg-type,misc]
        step_phase(self.scaler, self.opt, self.masters, self.clip)
        with torch.no_grad():
            torch._foreach_copy_(list(self.params), list(self.masters))  # type: ignore[arg-type]


def masters_section(
    device: torch.device, shapes: list[tuple[int, ...]], steps: int, warmup: int
) -> list[dict[str, Any]]:
    """Rows of the master-weights step-phase table."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device, torch.float16) for s in shapes]
    scaled = [(torch.randn(s, generator=gen) * 1e-2).to(device, torch.float16) * SCALE / 64 for s in shapes]
    timed = timer(device, BUSY_MS)
    rows = []
    for fused in (True, False):
        for clip in (False, True):
            variants = {"by_hand": _Variant(True, init, fused, clip), "ours": _Variant(False, init, fused, clip)}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for i in range(warmup + steps):
                for name, variant in variants.items():
                    variant.load(scaled)
                    ms = timed(variant.step)
                    if i >= warmup:
                        times[name].append(ms)
            medians = {name: statistics.median(t) for name, t in times.items()}
            rows.append(
                {
                    "optimizer": f"{'fused' if fused else 'foreach'} AdamW",
                    "clip": clip,
                    "by_hand_ms": medians["by_hand"],
                    "ours_ms": medians["ours"],
                    "speedup": medians["by_hand"] / medians["ours"],
                    "check": compare(variants["ours"].params, variants["by_hand"].params),
                }
            )
            del variants
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def masters_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "float16 parameters + float32 master weights, step phase (by hand: torch's scaler, foreach copies "
        "in and out; gradscaler: master_weights=True):",
        "",
        "| optimizer | clip | by hand ms | gradscaler ms | speedup | check |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {'1.0' if r['clip'] else 'no'} | {r['by_hand_ms']:.2f} | {r['ours_ms']:.2f} | "
            f"{r['speedup']:.2f}x | {r['check']} |"
        )
    return lines
