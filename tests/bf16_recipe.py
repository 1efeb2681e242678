"""The recipe by hand for float32 masters of a bfloat16 model, written once for the tests of
``with_master_weights`` (tests/test_bf16_*.py): float32 copies of the parameters, each backward's gradient
added into its copy's ``.grad`` in float32, the copies written back after each step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

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


def run(
    params: Iterable[torch.Tensor],
    batches: list[list[Any]],
    backward: Callable[[list[Any], Any], None],
    clip: float | None,
    lr: float,
    weight_decay: float = 1e-2,
) -> list[torch.Tensor]:
    """The recipe by hand over ``params`` with AdamW: each step's micro-batches (``backward(step, micro)``
    runs one backward) summed into the copies, torch's clipping over them (``clip``: the max norm, or None),
    the step, the copies written back, their gradients cleared; returns each step's norm."""
    copies = Copies(params)
    optimizer = torch.optim.AdamW(copies.masters, lr=lr, weight_decay=weight_decay)
    norms = []
    for step in batches:
        for micro in step:
            backward(step, micro)
            copies.add()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(copies.masters, clip))
        optimizer.step()
        copies.write_back()
        optimizer.zero_grad()
    return norms


def trainer_items(step: list[torch.Tensor]) -> torch.Tensor:
    """The HF Trainer's ``num_items_in_batch`` for a step of token-id micro-batches used as their own labels:
    every label counted, over the tensor/context/sequence parallel sizes (1). All the labels, not the shifted
    ones the loss sums (``SEQ - 1`` a row): GPT-2's ``loss_type`` is None (its class name holds no key of
    ``LOSS_MAPPING``, transformers/modeling_utils.py:1284), so the Trainer does not know that its loss shifts
    the labels (``_loss_shifts_labels``, transformers/trainer.py:543) and counts them unshifted
    (trainer.py:2331), while the model's ``loss_function`` falls back to ``ForCausalLMLoss``
    (modeling_utils.py:4773), which shifts. The Trainer's loss is the shifted sum over all the labels, with or
    without PEFT, TRL or gradscaler."""
    return sum(ids.ne(-100).sum() for ids in step) / 1


def state(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
