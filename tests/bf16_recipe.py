"""The recipe by hand for float32 masters of a bfloat16 model, written once for the tests of
``with_master_weights`` (tests/test_bf16_*.py): float32 copies of the parameters, each backward's gradient
added into its copy's ``.grad`` in float32, the copies written back after each step."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Copies:
    """Float32 copies of ``params`` (``masters``: what the recipe's optimizer steps)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]

    def add(self) -> None:
        """After a backward: ``m.grad = p.grad.float()`` (or ``m.grad + p.grad.float()``), ``p.grad = None``."""
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None

    def write_back(self) -> None:
        """After a step: each copy into its parameter."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def state(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
