"""``accumulate_grads_in_fp32=True`` with activation checkpointing, against the recipe by hand with float32
accumulation (``recipe.Fp32Recipe``), bit for bit.

The scaler hooks the parameters of its first iteration where it finds them: in the graph of each
``scale(loss)``. A reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``, torch's default
when the argument is left out; ``checkpoint_sequential``; DeepSpeed's and Megatron-LM's) runs its function
under ``no_grad``, so its graph node hides the parameters inside: before the fix the first iteration's
micro-batches of those parameters were summed by autograd in bfloat16/float16, silently (found 2026-11-28:
up to 1.5e-3 off the recipe in bfloat16 after three iterations). Now the scaler looks into the checkpointed
function and its other arguments (a module, its method, a ``functools.partial`` as the HF layers pass, a
closure, a default argument, a list, a block passed as an argument); where it cannot (a callable object), the
step warns.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from recipe import Fp32Recipe, Ours, System, assert_same_state, fp32_scaler

MICRO = 4


class Runner:
    """A callable object holding the block: the scaler does not look into it."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)


def run_block(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A module-level function given the block as an argument."""
    return block(h)


# how the checkpointed function is written: the block itself, its method, a partial of the method with a keyword
# (as the HF layers pass it), a closure, checkpoint_sequential's closure over a list
FORMS: dict[str, Callable[[nn.Module, torch.Tensor, bool], torch.Tensor]] = {
    "module": lambda block, h, reentrant: checkpoint(block, h, use_reentrant=reentrant),
    "method": lambda block, h, reentrant: checkpoint(block.forward, h, use_reentrant=reentrant),
    "partial": lambda block, h, reentrant: checkpoint(
        functools.partial(type(block).forward, block), h, use_reentrant=reentrant
    ),
    "closure": lambda block, h, reentrant: checkpoint(lambda x: block(x), h, use_reentrant=reentrant),
    "default": lambda block, h, reentrant: checkpoint(lambda x, b=block: b(x), h, use_reentrant=reentrant),
    "sequential": lambda block, h, reentrant: checkpoint_sequential(block, 2, h, use_reentrant=reentrant),
    "argument": lambda block, h, reentrant: checkpoint(run_block, block, h, use_reentrant=reentrant),
    "callable-object": lambda block, h, reentrant: checkpoint(Runner(block), h, use_reentrant=reentrant),
}


class Net(nn.Module):
    def __init__(self, form: str, reentrant: bool, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.reentrant = FORMS[form], reentrant
        self.inp = nn.Linear(8, 32).to(dtype)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).to(dtype) for _ in range(2)
        )
        self.head = nn.Linear(32, 4).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        for block in self.blocks:
            h = h + self.form(block, h, self.reentrant)
        return self.head(h).float()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def assert_same(ours: System, reference: System) -> None:
    """Parameters and optimizer state (by position) equal, bit for bit."""
    for mine, theirs in zip(ours.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert_same_state(ours.optimizer, reference.optimizer)


def regression() -> Callable[[int, int], Any]:
    """A seeded regression's batches, (x, y) for each (iteration, micro-batch), drawn in the order asked."""
    draws = torch.Generator().manual_seed(1)
    return lambda iteration, micro: (torch.randn(16, 8, generator=draws), torch.randn(16, 4, generator=draws))


def squared_error(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def train(
    ours: System,
    reference: System,
    iterations: int = 3,
    micro: int = MICRO,
    batch: Callable[[int, int], Any] | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] = squared_error,
) -> list[str]:
    """Both sides through the same iterations of ``micro`` batches (``batch(iteration, micro)``, by default
    ``regression()``'s); parameters and optimizer state equal after each step. The warnings issued, as text."""
    batch = batch or regression()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for iteration in range(iterations):
            for system in (ours, reference):
                system.zero_grad("optimizer", True)
            for number in range(micro):
                drawn = batch(iteration, number)
                for system in (ours, reference):
                    system.backward(loss(system.model, drawn))
            for system in (ours, reference):
                system.step()
                system.update()
            assert_same(ours, reference)
    return [str(w.message) for w in record]


def pair(model: nn.Module, **scaler: Any) -> tuple[System, System]:
    """Ours with float32 sums, and the recipe by hand with float32 accumulation, over copies of ``model``."""
    return Ours(model, adamw, fp32_scaler(**scaler)), Fp32Recipe(copy.deepcopy(model), adamw)


@pytest.mark.parametrize("form", ["module", "method", "partial", "closure", "default", "sequential", "argument"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_blocks_sum_in_float32_from_the_first_iteration(form: str, reentrant: bool) -> None:
    """bfloat16 (the first step applies: no overflow at 2**24), every form the scaler looks into."""
    ours, reference = pair(Net(form, reentrant, torch.bfloat16))
    assert train(ours, reference) == []
    assert all(p.grad is None for p in ours.model.parameters())


def test_float16_checkpointed_blocks_with_an_applied_first_step() -> None:
    ours, reference = pair(Net("module", True, torch.float16), init_scale=2.0**10)
    reference.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    assert train(ours, reference) == []
    assert ours.scaler.stats()["skipped_steps"] == 0


def test_a_function_the_scaler_cannot_look_into_is_warned_at_the_first_step() -> None:
    """A callable object: its block's parameters get gradients the scaled graphs never showed; the first
    step says so (those micro-batches were summed by autograd); from the second iteration on they are
    hooked, each backward's gradient moved into float32 at once."""
    model = Net("callable-object", True, torch.bfloat16)
    ours = Ours(model, adamw, fp32_scaler())
    batches = regression()

    def iteration(micro: int) -> tuple[list[str], list[torch.Tensor | None]]:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ours.zero_grad("optimizer", True)
            for number in range(micro):
                ours.backward(squared_error(model, batches(0, number)))
            blocks = [p.grad for p in model.blocks.parameters()]
            ours.step()
            ours.update()
        return [str(w.message) for w in record], blocks

    messages, blocks = iteration(MICRO)
    assert all(grad is not None for grad in blocks)  # autograd held them: the scaler had not hooked them
    assert len(messages) == 1, messages
    assert "8 low-precision parameter(s) of optimizer AdamW got gradients in the first iteration" in messages[0]
    assert "use_reentrant=False" in messages[0]
    messages, blocks = iteration(MICRO)
    assert messages == [] and all(grad is None for grad in blocks)  # hooked since the binding


def test_one_backward_hidden_is_not_warned() -> None:
    """With one micro-batch nothing was summed: the gradient autograd left is the recipe's, no warning."""
    ours, reference = pair(Net("callable-object", True, torch.bfloat16))
    assert train(ours, reference, micro=1) == []


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hf_gradient_checkpointing_of_a_bfloat16_gpt2(reentrant: bool) -> None:
    """transformers' own checkpointing (``activation_checkpointing_enable``, which passes each layer's forward as
    a ``functools.partial``), both variants, on a tiny GPT-2 in bfloat16."""
    pytest.importorskip("transformers")
    from integration_helpers import tiny_gpt2

    model = tiny_gpt2().to(torch.bfloat16)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ours, reference = pair(model)
    ids = torch.randint(0, 64, (3 * MICRO, 2, 16), generator=torch.Generator().manual_seed(1))
    messages = train(
        ours,
        reference,
        batch=lambda iteration, micro: ids[iteration * MICRO + micro],
        loss=lambda model, batch: model(input_ids=batch, labels=batch).loss,
    )
    assert not [message for message in messages if "accumulate_grads_in_fp32" in message]
