"""A GAN in float16 with master weights, ours and the recipe by hand, for the tests of several scalers and
optimizers over one model (tests/test_several_scalers.py, tests/scalers_machine.py).

G's loss runs through D, D's through D only. ``Ours`` keeps an AdamW per network and
``GradScaler(master_weights=True)`` per network or one for both, each with or without float32 sums;
``Recipe`` keeps float32 copies per network (``recipe.Fp32Copies``, summed after every backward, where that
network's scaler sums in float32; else ``recipe.Copies``, moved at its step), an AdamW of the copies and
torch's scalers, shared as ours are.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from gradscaler import GradScaler
from recipe import Copies, Fp32Copies

DTYPE = torch.float16
SIDES = ("G", "D")
REACHES = {"G": ("G", "D"), "D": ("D",)}  # whose parameters a side's loss reaches
SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**12, "growth_interval": 2}  # steps applied from the first


def networks(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A generator and a discriminator in float16."""
    torch.manual_seed(seed)
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).to(DTYPE)
    d = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    return g, d


def data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 4, generator=gen).to(DTYPE), torch.randn(8, 6, generator=gen).to(DTYPE)


def loss_of(g: nn.Module, d: nn.Module, side: str, step: int, micro: int, count: int) -> torch.Tensor:
    """G's loss runs through D; D's loss through D only (G's output detached)."""
    z, real = data(step, micro)
    if side == "G":
        return ((d(g(z)).float() - 1) ** 2).mean() / count
    fake = g(z).detach()
    return (((d(real).float() - 1) ** 2).mean() + (d(fake).float() ** 2).mean()) / count


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


class Gan:
    """G and D, an optimizer each, and the scalers (``accumulate``: per side, whether its scaler sums in
    float32; ``shared``: one scaler for both, then both sides take G's setting)."""

    scalers: dict[str, Any]
    optimizers: dict[str, torch.optim.Optimizer]

    def __init__(self, accumulate: dict[str, bool], shared: bool) -> None:
        self.g, self.d = networks()
        self.nets = {"G": self.g, "D": self.d}
        self.accumulate, self.shared = dict(accumulate), shared

    def loss(self, side: str, step: int, micro: int, count: int) -> torch.Tensor:
        return loss_of(self.g, self.d, side, step, micro, count)

    def backward(self, side: str, loss: torch.Tensor) -> None:
        self.scalers[side].scale(loss).backward()

    def update(self, side: str) -> None:
        self.scalers[side].update()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for net in self.nets.values() for p in net.parameters()]


class Ours(Gan):
    def __init__(self, accumulate: dict[str, bool], shared: bool) -> None:
        super().__init__(accumulate, shared)
        self.optimizers = {side: adamw(net.parameters()) for side, net in self.nets.items()}
        first = self.scaler_for("G")
        self.scalers = {"G": first, "D": first if shared else self.scaler_for("D")}

    def scaler_for(self, side: str) -> GradScaler:
        return GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=self.accumulate[side], **SCALER_ARGS)

    def zero_grad(self, side: str, set_to_none: bool = True) -> None:
        self.optimizers[side].zero_grad(set_to_none)

    def step(self, side: str) -> None:
        self.scalers[side].step(self.optimizers[side])

    def switch(self, side: str, accumulate: bool) -> GradScaler:
        """A new scaler for ``side`` (for both when shared), the old one's state loaded; returns the old one."""
        old = self.scalers[side]
        for each in SIDES if self.shared else (side,):
            self.accumulate[each] = accumulate
        new = self.scaler_for(side)
        new.load_state_dict(old.state_dict())
        for each in SIDES if self.shared else (side,):
            self.scalers[each] = new
        return old


class Recipe(Gan):
    """The recipe by hand: float32 copies per network (summed in float32 after every backward where that
    network's scaler sums in float32, else moved at its step), an optimizer of the copies, torch's scalers.
    ``active``: the sides whose copies sum now (``accumulate`` unless the tests say otherwise); ``round_once``:
    sides whose next move rounds their float32 sum to float16 once (docs/migration.md: a scaler without float32
    sums taking over from one with them)."""

    def __init__(self, accumulate: dict[str, bool], shared: bool) -> None:
        super().__init__(accumulate, shared)
        self.copies: dict[str, Copies] = {
            side: (Fp32Copies if accumulate[side] else Copies)(net.parameters()) for side, net in self.nets.items()
        }
        self.optimizers = {side: adamw(copies.params()) for side, copies in self.copies.items()}
        first = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        self.scalers = {"G": first, "D": first if shared else torch.amp.GradScaler("cpu", **SCALER_ARGS)}
        self.round_once: set[str] = set()

    def zero_grad(self, side: str, set_to_none: bool = True) -> None:
        self.optimizers[side].zero_grad(set_to_none)
        self.nets[side].zero_grad(set_to_none)

    def backward(self, side: str, loss: torch.Tensor) -> None:
        super().backward(side, loss)
        for copies in self.copies.values():
            if isinstance(copies, Fp32Copies):
                copies.accumulate()

    def step(self, side: str) -> None:
        copies = self.copies[side]
        copies.move_grads()
        if side in self.round_once:
            self.round_once.discard(side)
            for _, c in copies.pairs:
                if c.grad is not None:
                    c.grad = c.grad.to(DTYPE).float()
            self.copies[side] = plain(copies, Copies)
        scaler, optimizer = self.scalers[side], self.optimizers[side]
        scaler.step(optimizer)
        if not sum(flag.item() for flag in scaler._found_inf_per_device(optimizer).values()):
            self.copies[side].copy_back()

    def switch(self, side: str, accumulate: bool, rounded: Collection[str] = ()) -> None:
        """``Ours.switch`` in the recipe: the same torch scaler goes on; the copies of each side switched sum in
        float32 from now on, or not: at once, or, for the sides in ``rounded`` (those the old scaler with float32
        sums bound, kept alive: its hooks go on summing until the new scaler binds them), after the next move,
        which rounds that iteration's sum once."""
        for each in SIDES if self.shared else (side,):
            was = self.accumulate[each]
            self.accumulate[each] = accumulate
            if was and not accumulate and each in rounded:
                self.round_once.add(each)
            elif was != accumulate:
                self.round_once.discard(each)
                self.copies[each] = plain(self.copies[each], Fp32Copies if accumulate else Copies)


def plain(copies: Copies, kind: type[Copies]) -> Copies:
    """The same copies (the optimizer steps them) under ``kind``'s rule."""
    made = kind([])
    made.all, made.pairs = copies.all, copies.pairs
    return made
