"""A small model whose layers may each hold any dtype, for the master-weights defects and state machine.

``Net``: three float16 linear layers (``inp``, ``block``, ``head``) around a LayerNorm kept in float32, and an
``extra`` layer that joins the forward once a test adds it to the optimizer (``use_extra``). Each layer casts
its input to its own weight's dtype, so any layer can be switched to float32, bfloat16 or float16 on its own,
as ``model.float()`` or ``block.half()`` would switch it in a user's loop. ``loss_of`` can inject an inf or a
NaN into one layer's gradient and leave ``block`` out of the forward (a parameter without a gradient).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

LOW_LAYERS = ("inp", "block", "head", "extra")
"""The layers that start in float16 (the LayerNorm between them stays float32)."""


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return functional.linear(x.to(layer.weight.dtype), layer.weight, layer.bias)


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16).half()
        self.block = nn.Linear(16, 16).half()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4).half()
        self.extra = nn.Linear(16, 4).half()
        self.use_extra = False

    def forward(self, x: torch.Tensor, use_block: bool = True) -> torch.Tensor:
        h = torch.relu(_linear(self.inp, x))
        if use_block:
            h = h + _linear(self.block, h)
        h = self.norm(h.float())
        out = _linear(self.head, h).float()
        if self.use_extra:
            out = out + _linear(self.extra, h).float()
        return out

    def base_params(self) -> list[nn.Parameter]:
        """The parameters an optimizer is built over (``extra`` joins by ``add_param_group``)."""
        return [p for name, p in self.named_parameters() if not name.startswith("extra.")]


def batch(number: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + number)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model: Net, number: int, use_block: bool = True, inject: str = "", layer: str = "block") -> torch.Tensor:
    """The loss of batch ``number``; ``inject`` ("inf" or "nan") makes every gradient of ``layer``'s weight
    that value (whatever the scale)."""
    x, y = batch(number)
    loss = ((model(x, use_block) - y) ** 2).mean()
    if inject:
        bad = float(inject)
        loss = loss + bad * getattr(model, layer).weight.float().sum()
    return loss
