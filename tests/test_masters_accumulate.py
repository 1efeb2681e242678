"""``accumulate_grads_in_fp32=True`` against the recipe by hand with float32 accumulation (tests/recipe.py,
``Fp32Recipe``), bit for bit, in the loop shapes users write: 1, 8 and 64 micro-batches; AdamW, fused
AdamW, SGD with momentum; no clipping, ``scaler.clip_grad_norm_``, ``unscale_`` + torch's clip over
``model.parameters()``; every ``zero_grad``; an overflow in one micro-batch; parameters without a gradient
in some or all micro-batches; a frozen block; ``add_param_group``; a dtype switch; checkpoints between
steps and in the middle of an accumulation. Then the refusals, each changing nothing.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.masters import wrappers
from gradscaler.tools.compiled_step import Shape, breaks, build, drive, inputs, recompiles
from helpers import TORCH_VERSION, swap_future
from recipe import (
    OPTIMIZERS,
    SCALER_ARGS,
    Fp32Recipe,
    Fp32RecipeScalerClips,
    Ours,
    OursScalerClips,
    Recipe,
    System,
    assert_same_state,
    assert_same_trace,
    fp32_scaler,
    new_trace,
    record,
)
from recipe import (
    named as named_groups,
)


class Net(nn.Module):
    """float16 layers: two experts taking turns by micro-batch (with one micro-batch, each misses every
    other iteration), a rare block used in the first micro-batch of every third iteration only, a frozen
    block, a LayerNorm kept in float32, and a head."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16).to(dtype)
        self.experts = nn.ModuleList(nn.Linear(16, 16).to(dtype) for _ in range(2))
        self.rare = nn.Linear(16, 16).to(dtype)
        self.frozen = nn.Linear(16, 16).to(dtype).requires_grad_(False)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4).to(dtype)
        self.extra: nn.Module | None = None  # added with add_param_group

    def forward(self, x: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        dtype = self.inp.weight.dtype
        h = torch.relu(self.inp(x.to(dtype)))
        h = self.experts[(step + micro) % 2](h)
        if step % 3 == 1 and micro == 0:
            h = h + self.rare(h)
        h = self.frozen(h)
        if self.extra is not None:
            h = h + self.extra(h)
        h = self.norm(h.float()).to(dtype)
        return self.head(h)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 8, generator=g) * 3, torch.randn(8, 4, generator=g)


def micro_loss(system: System, step: int, micro: int, count: int) -> torch.Tensor:
    x, y = batch(step, micro)
    return ((system.model(x, step, micro).float() - y) ** 2).mean() / count


def run(
    system: System,
    steps: range,
    micro: int,
    trace: dict[str, list[Any]],
    *,
    zero: str = "optimizer",
    set_to_none: bool = True,
    clip: float | None = None,
    overflow: tuple[int, int] | None = None,
    skip: tuple[int, range] | None = None,
    between: Any = None,
) -> dict[str, list[Any]]:
    """A loop of ``micro`` micro-batches per step. ``overflow``: (step, micro-batch) whose loss is made
    inf; ``skip``: (step, micro-batches) left out; ``between(system, step)`` runs after each update."""
    for step in steps:
        system.zero_grad(zero, set_to_none)
        for k in range(micro):
            if skip is not None and step == skip[0] and k in skip[1]:
                continue
            loss = micro_loss(system, step, k, micro)
            if overflow == (step, k):
                loss = loss * float("inf")
            system.backward(loss)
        if clip is not None:
            system.clip(clip)
        system.step()
        system.update()
        record(system, trace)
        if between is not None:
            between(system, step)
    return trace


def pair(name: str, clip: str = "none", dtype: torch.dtype = torch.float16) -> tuple[Ours, Fp32Recipe]:
    make = OPTIMIZERS[name]
    if clip == "scaler":
        reference = Fp32RecipeScalerClips(Net(dtype=dtype), make, GradScaler("cpu", **SCALER_ARGS))
        return OursScalerClips(Net(dtype=dtype), make, fp32_scaler()), reference
    return Ours(Net(dtype=dtype), make, fp32_scaler()), Fp32Recipe(Net(dtype=dtype), make)


def assert_same(ours: Ours, reference: Recipe, steps: range, micro: int, **loop: Any) -> None:
    a = run(ours, steps, micro, new_trace(), **loop)
    b = run(reference, steps, micro, new_trace(), **loop)
    assert_same_trace(a, b)
    assert_same_state(ours.optimizer, reference.optimizer)


CLIPS = {"none": None, "scaler": 1.0, "torch": 1.0}


@pytest.mark.parametrize("micro", [1, 8])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_micro_batches_equal_the_recipe_with_float32_accumulation(name: str, clip: str, micro: int) -> None:
    ours, reference = pair(name, clip)
    assert_same(ours, reference, range(8), micro, clip=CLIPS[clip])


@pytest.mark.parametrize(
    ("name", "clip"), [("adamw_fused", "scaler"), ("sgd_momentum_forloop", "torch"), ("adamw_foreach", "none")]
)
def test_sixty_four_micro_batches_equal_the_recipe(name: str, clip: str) -> None:
    """64 micro-batches: each optimizer and each clipping once (30 s a case here; 1 and 8 run every pair)."""
    ours, reference = pair(name, clip)
    assert_same(ours, reference, range(4), 64, clip=CLIPS[clip])


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_every_zero_grad_equals_the_recipe(zero: str, set_to_none: bool) -> None:
    ours, reference = pair("adamw_foreach", "torch")
    assert_same(ours, reference, range(7), 8, zero=zero, set_to_none=set_to_none, clip=1.0)


class OursClipsValue(Ours):
    """``unscale_``, then ``torch.nn.utils.clip_grad_value_(model.parameters(), value)``."""

    def clip(self, max_norm: float) -> None:
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_value_(self.model.parameters(), max_norm)


def clipping_value(recipe: type[Recipe]) -> type[Recipe]:
    """``recipe`` clamping its copies' gradients with torch's ``clip_grad_value_`` after ``unscale_``."""

    class ClipsValue(recipe):  # type: ignore[valid-type,misc]
        def clip(self, max_norm: float) -> None:
            self.unscale_()
            torch.nn.utils.clip_grad_value_(self.trained(), max_norm)

    return ClipsValue


@pytest.mark.parametrize("accumulate", [True, False], ids=["float32-sums", "masters-only"])
def test_torchs_clip_grad_value_over_model_parameters_clamps_the_masters_gradients(accumulate: bool) -> None:
    """Routed as ``clip_grad_norm_`` is: with float32 sums the parameters hold no gradient for torch's call
    to clamp (it clamped nothing before), without them it clamped float16 copies the step refused."""
    make = OPTIMIZERS["adamw_foreach"]
    scaler = fp32_scaler() if accumulate else GradScaler("cpu", master_weights=True, **SCALER_ARGS)
    ours = OursClipsValue(Net(), make, scaler)
    reference = clipping_value(Fp32Recipe if accumulate else Recipe)(Net(), make)
    assert_same(ours, reference, range(7), 4, clip=2e-3)  # most gradients are larger: clamped


def test_bfloat16_parameters_equal_the_recipe() -> None:
    ours, reference = pair("adamw_foreach", "scaler", torch.bfloat16)
    assert_same(ours, reference, range(6), 8, clip=1.0)


def test_the_sum_differs_from_low_precision_accumulation() -> None:
    """The oracle can fail: today's masters (float16 accumulation by autograd) differ from it."""
    make = OPTIMIZERS["adamw_foreach"]
    low = Ours(Net(), make, GradScaler("cpu", master_weights=True, **SCALER_ARGS))
    with pytest.raises(AssertionError):
        assert_same_trace(run(low, range(6), 8, new_trace()), run(Fp32Recipe(Net(), make), range(6), 8, new_trace()))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_overflow_in_one_micro_batch_skips_the_step_and_the_next_starts_clean(name: str) -> None:
    ours, reference = pair(name)
    assert_same(ours, reference, range(8), 8, overflow=(5, 3))
    assert ours.scaler.stats()["skipped_steps"] >= 1


def test_a_parameter_without_gradient_is_not_stepped() -> None:
    """``rare`` has a gradient in one micro-batch of every third iteration only: the others leave it (and
    its AdamW state) untouched, as issue 24's rule wants."""
    ours, _ = pair("adamw_foreach")
    run(ours, range(6), 4, new_trace())
    before = ours.model.rare.weight.detach().clone()
    run(ours, range(6, 7), 4, new_trace())  # step 6: 6 % 3 == 0, no gradient for rare
    assert torch.equal(before, ours.model.rare.weight)
    low = [p for p in ours.model.parameters() if p.dtype == torch.float16]
    assert low and all(p.grad is None for p in low)  # after backward: the sums are in the masters


def add_extra(system: System, step: int, named: bool = False) -> None:
    """After step 2, a new float16 block joins the model and the optimizer (a new param group; ``named``:
    given as ``(name, parameter)`` pairs, as torch reads them too)."""
    if step != 2:
        return
    torch.manual_seed(5)
    extra = nn.Linear(16, 16).to(system.model.inp.weight.dtype)
    system.model.extra = extra
    named_params = list(extra.named_parameters())
    if isinstance(system, Recipe):
        copies = [(n, p, p.detach().float().requires_grad_()) for n, p in named_params]
        system.copies.pairs.extend((p, c) for _, p, c in copies)
        group = [(n, c) if named else c for n, _, c in copies]
    else:
        group = [(n, p) if named else p for n, p in named_params]
    system.optimizer.add_param_group({"params": group})


@pytest.mark.parametrize("named", [False, True], ids=["tensors", "named"])
@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused"])
def test_add_param_group_equals_the_recipe(name: str, named: bool) -> None:
    """(Named pairs: before the fix the new block was not hooked, its micro-batches summed in float16.)"""
    make = named_groups(OPTIMIZERS[name]) if named else OPTIMIZERS[name]
    ours, reference = Ours(Net(), make, fp32_scaler()), Fp32Recipe(Net(), make)
    between = functools.partial(add_extra, named=named)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no late-parameter warning either
        assert_same(ours, reference, range(7), 8, clip=1.0, between=between)


def switch_dtype(system: System, step: int) -> None:
    if step == 3:  # every float16 layer to bfloat16; the LayerNorm stays in float32
        model = system.model
        for module in (model.inp, model.experts, model.rare, model.frozen, model.head):
            module.to(torch.bfloat16)


def test_a_dtype_switch_between_steps_equals_the_recipe() -> None:
    ours, reference = pair("adamw_foreach", "scaler")
    assert_same(ours, reference, range(7), 8, clip=1.0, between=switch_dtype)


def round_trip(system: System, step: int) -> None:
    """After step 2 every float16 layer to float32 (the masters stay, the sums go on in float32), after
    step 4 back to float16."""
    if step in (2, 4):
        model = system.model
        for module in (model.inp, model.experts, model.rare, model.frozen, model.head):
            module.to(torch.float32 if step == 2 else torch.float16)


@pytest.mark.parametrize("swap", [False, True], ids=["assign", "swap"])
def test_a_dtype_round_trip_with_the_swap_future_on_or_off_equals_the_recipe(swap: bool) -> None:
    """torch's swap-tensors future replaces each parameter's tensor (which refuses a weakly referenced
    parameter and leaves its hooks behind): the scaler holds no weak reference to a parameter and hooks
    the swapped ones again at the next ``scale()``."""
    with swap_future(swap):
        ours, reference = pair("adamw_foreach")
        assert_same(ours, reference, range(7), 4, clip=1.0, between=round_trip)
        assert all(p.grad is None for p in ours.model.parameters() if p.dtype == torch.float16)


def save(system: System) -> bytes:
    buffer = io.BytesIO()
    states = [system.model.state_dict(), system.optimizer.state_dict(), system.scaler.state_dict()]
    torch.save(states, buffer)
    return buffer.getvalue()


def resumed(blob: bytes, name: str) -> Ours:
    model_state, optimizer_state, scaler_state = torch.load(io.BytesIO(blob), weights_only=True)
    system = Ours(Net(seed=9), OPTIMIZERS[name], fp32_scaler())
    system.model.load_state_dict(model_state)
    system.optimizer.load_state_dict(optimizer_state)
    system.scaler.load_state_dict(scaler_state)
    return system


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_between_steps_into_fresh_objects_is_the_uninterrupted_run(name: str) -> None:
    whole = run(Ours(Net(), OPTIMIZERS[name], fp32_scaler()), range(8), 8, new_trace())
    first = Ours(Net(), OPTIMIZERS[name], fp32_scaler())
    head = run(first, range(5), 8, new_trace())
    tail = run(resumed(save(first), name), range(5, 8), 8, new_trace())
    assert_same_trace({k: head[k] + tail[k] for k in head}, whole)


def test_a_save_mid_accumulation_loses_the_partial_sum_as_the_recipe_does() -> None:
    """A checkpoint holds no gradients: resumed after micro-batch 3 of 8, the step sums the last five
    only (the recipe by hand loses its copies' partial sums too); the run that saved goes on unchanged."""
    name = "adamw_foreach"
    first = Ours(Net(), OPTIMIZERS[name], fp32_scaler())
    head = run(first, range(4), 8, new_trace())
    for k in range(3):
        first.backward(micro_loss(first, 4, k, 8))
    blob = save(first)
    # the saving run goes on as if nothing happened
    rest = run(first, range(4, 6), 8, new_trace(), skip=(4, range(3)))
    whole = run(Ours(Net(), OPTIMIZERS[name], fp32_scaler()), range(6), 8, new_trace())
    assert_same_trace({k: head[k] + rest[k] for k in head}, whole)
    # the resumed one: step 4 without its first three micro-batches, as the recipe that drops them
    again = run(resumed(blob, name), range(4, 6), 8, new_trace(), skip=(4, range(3)))
    reference = run(Fp32Recipe(Net(), OPTIMIZERS[name]), range(6), 8, new_trace(), skip=(4, range(3)))
    assert_same_trace({k: head[k] + again[k] for k in head}, reference)


def test_the_argument_without_master_weights_is_refused() -> None:
    with pytest.raises(ValueError, match=r"accumulate_grads_in_fp32=True\) needs master_weights=True"):
        GradScaler("cpu", accumulate_grads_in_fp32=True)


def test_register_ddp_without_accumulation_or_with_a_plain_module_is_refused() -> None:
    net = nn.Linear(2, 2).to(torch.bfloat16)
    for scaler in (GradScaler("cpu", master_weights=True), GradScaler("cpu")):
        with pytest.raises(ValueError, match=r"register_ddp\(ddp_model\) is for .*accumulate_grads_in_fp32=False"):
            scaler.register_ddp(net)  # type: ignore[arg-type]
    scaler = fp32_scaler()
    with pytest.raises(TypeError, match=r"register_ddp\(module\): module is a Linear, not a .*DistributedDataParallel"):
        scaler.register_ddp(net)  # type: ignore[arg-type]
    assert not scaler._masters._sums.ddp  # nothing registered


FIXES = ("Build", "Call", "Enable", "Keep", "Leave", "Pass", "Register", "Save", "Take", "Turn", "Use", "Write")
"""The verbs a refusal opens with: its first sentence says what to do, the rest why."""


@pytest.mark.parametrize(
    "message",
    [
        "checks.WITHOUT_MASTERS_MESSAGE",
        "checks.SPARSE_MESSAGE",
        "checks.CREATE_GRAPH_MESSAGE",
        "checks.WRITTEN_MESSAGE",
        "checks.DDP_MESSAGE",
        "checks.FSDP2_MESSAGE",
        "checks.SWAPPED_MESSAGE",
        "checks.LATER_HOOK_MESSAGE",
        "ddp.NOT_DDP_MESSAGE",
        "ddp.NOT_ACCUMULATING_MESSAGE",
        "checkpoint.DCP_MESSAGE",
        "checks.WRITTEN_LOW_GRADS_MESSAGE",
        "checks.INNER_OPTIMIZER_MESSAGE",
        "checks.DISABLED_MESSAGE",
        "checks.HELD_MESSAGE",
        "checks.HELD_DDP_MESSAGE",
        "standalone.NOTHING_MESSAGE",
        "standalone.NOT_AN_OPTIMIZER_MESSAGE",
        "standalone.RE_EVALUATING_MESSAGE",
        "standalone.SCALERS_MASTERS_MESSAGE",
        "standalone.DISTRIBUTED_MESSAGE",
    ],
)
def test_each_refusal_leads_with_what_to_do(message: str) -> None:
    import importlib

    module, name = message.split(".")
    text = getattr(importlib.import_module(f"gradscaler.masters.{module}"), name)
    assert text.split(" ", 1)[0] in FIXES, text


def trained_once(micro: int = 2) -> Ours:
    ours = Ours(Net(), OPTIMIZERS["adamw_foreach"], fp32_scaler(init_scale=2.0**8))
    run(ours, range(2), micro, new_trace())
    return ours


def masters_and_grads(system: Ours) -> list[torch.Tensor]:
    return [t.detach().clone() for t in system.trained()] + [
        m.grad.clone() for m in system.trained() if m.grad is not None
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_gradient_written_by_hand_is_refused_at_the_step_changing_nothing() -> None:
    ours = trained_once()
    ours.zero_grad("optimizer", True)
    ours.backward(micro_loss(ours, 2, 0, 1))
    ours.model.head.weight.grad = torch.ones_like(ours.model.head.weight)
    before = masters_and_grads(ours)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[\d+\] \(shape \(4, 16\).*by hand"):
        ours.step()
    assert same(before, masters_and_grads(ours))
    ours.model.head.weight.grad = None  # the fix: the step then goes on with the sums
    ours.step()
    ours.update()


def test_a_write_after_unscale_is_refused_at_the_step() -> None:
    ours = trained_once()
    ours.zero_grad("optimizer", True)
    ours.backward(micro_loss(ours, 2, 0, 1))
    ours.unscale_()
    assert all(p.grad is None for p in ours.model.parameters() if p.dtype == torch.float16)
    ours.model.inp.bias.grad = torch.zeros_like(ours.model.inp.bias)
    with pytest.raises(ValueError, match=r"after scaler\.unscale_"):
        ours.step()


def test_sparse_gradients_are_refused_in_the_backward_adding_nothing() -> None:
    embedding = nn.Embedding(10, 4, sparse=True).half()
    scaler = fp32_scaler()
    tokens = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"sparse=False.*shape \(10, 4\).*is sparse"):
        scaler.scale(embedding(tokens).float().sum()).backward()
    assert embedding.weight.grad is None  # a refused backward leaves nothing behind; no sum started
    found = scaler._masters._sums.sum_of(embedding.weight)
    assert found is not None and found.total is None  # hooked at scale(), nothing added


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_create_graph_backward_is_refused_and_changes_nothing() -> None:
    """The refusal leaves no gradient behind, so the plain backward its message advises trains as the
    recipe does (it was refused again, by the gradient the refused backward had left, until zero_grad)."""
    ours, reference = pair("adamw_foreach")
    with pytest.raises(RuntimeError, match="create_graph=True"):
        ours.scaler.scale(micro_loss(ours, 0, 0, 1)).backward(create_graph=True)
    assert all(p.grad is None for p in ours.model.parameters())
    for system in (ours, reference):
        for step in range(3):
            system.zero_grad("optimizer", True)
            system.backward(micro_loss(system, step, 0, 1))
            system.step()
            system.update()
    assert same([p.detach() for p in ours.model.parameters()], [p.detach() for p in reference.model.parameters()])
    assert_same_state(ours.optimizer, reference.optimizer)


def test_a_retain_graph_double_backward_counts_twice_as_in_the_recipe() -> None:
    """Two backward calls through one retained graph are two gradients: each added into the float32 sum,
    as the recipe by hand adds after every backward."""

    def twice(system: System) -> None:
        for step in range(4):
            system.zero_grad("optimizer", True)
            loss = micro_loss(system, step, 0, 2)
            system.scaler.scale(loss).backward(retain_graph=True)
            if isinstance(system, Recipe):
                system.copies.accumulate()
            system.backward(loss)
            system.step()
            system.update()

    ours, reference = pair("adamw_foreach")
    twice(ours)
    twice(reference)
    assert same([p.detach() for p in ours.model.parameters()], [p.detach() for p in reference.model.parameters()])
    assert_same_state(ours.optimizer, reference.optimizer)


def test_user_hooks_before_the_scalers_see_each_micro_batch_and_after_are_refused() -> None:
    ours = Ours(Net(), OPTIMIZERS["adamw_foreach"], fp32_scaler(init_scale=2.0**8))
    seen: list[Any] = []
    weight = ours.model.head.weight
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.clone()))
    for k in range(3):
        loss = micro_loss(ours, 0, k, 3)
        expected = torch.autograd.grad(ours.scaler.scale(loss), weight, retain_graph=True)[0]
        ours.backward(loss)
        assert torch.equal(seen[-1], expected)  # this micro-batch's gradient alone, in float16
    ours.step()
    ours.update()
    late: list[Any] = []
    ours.model.inp.weight.register_post_accumulate_grad_hook(lambda p: late.append(p.grad))
    ours.backward(micro_loss(ours, 1, 0, 1))
    assert late == [None]
    before = masters_and_grads(ours)
    with pytest.raises(ValueError, match="registered after the scaler's own"):
        ours.step()
    assert same(before, masters_and_grads(ours))


def test_what_to_read_instead_of_p_grad() -> None:
    """After backward ``p.grad`` is None; the scaled float32 sum is the master's gradient
    (``scaler.master_weights(optimizer)``), and torch's clip over ``model.parameters()`` reaches it."""
    ours = trained_once()
    ours.zero_grad("optimizer", True)
    for k in range(4):
        ours.backward(micro_loss(ours, 2, k, 4))
    pairs = ours.scaler.master_weights(ours.optimizer)
    assert pairs and all(p.grad is None for p, _ in pairs)
    sums = {id(p): m.grad.clone() for p, m in pairs if m.grad is not None}
    assert sums
    ours.scaler.unscale_(ours.optimizer)
    scale = ours.scaler.get_scale()
    for p, m in pairs:
        if id(p) in sums:
            assert torch.equal(m.grad, sums[id(p)] * (1 / scale))
    by_hand = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(t.grad) for t in ours.trained() if t.grad is not None])
    )
    norm = torch.nn.utils.clip_grad_norm_(ours.model.parameters(), 1e-3)
    assert torch.allclose(norm, by_hand) and norm > 1e-2  # the masters' sums, clipped
    after = [torch.linalg.vector_norm(t.grad) for t in ours.trained() if t.grad is not None]
    assert torch.allclose(torch.linalg.vector_norm(torch.stack(after)), torch.tensor(1e-3), rtol=1e-3)


def test_default_off_leaves_the_parameters_gradients_to_autograd() -> None:
    ours = Ours(Net(), OPTIMIZERS["adamw_foreach"], GradScaler("cpu", master_weights=True, **SCALER_ARGS))
    ours.backward(micro_loss(ours, 0, 0, 1))
    assert ours.model.head.weight.grad is not None
    assert not ours.model.head.weight._post_accumulate_grad_hooks


def test_a_parameter_no_optimizer_steps_gets_its_gradient_back_after_the_first_iteration() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    scaler = fp32_scaler(init_scale=1.0)
    for k in range(2):
        scaler.scale(micro_loss(Ours(model, lambda p: optimizer, scaler), 0, k, 2)).backward()
    assert model.inp.weight.grad is None  # hooked from the graph: summed in float32 until the update
    scaler.step(optimizer)
    scaler.update()
    assert model.inp.weight.grad is not None and model.inp.weight.grad.dtype == torch.float16
    assert not model.inp.weight._post_accumulate_grad_hooks  # handed back to autograd
    assert model.head.weight._post_accumulate_grad_hooks


def test_patch_torch_builds_accumulating_scalers_that_equal_the_recipe() -> None:
    import gradscaler

    make = OPTIMIZERS["adamw_foreach"]
    with gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True):
        scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        ours = Ours(Net(), make, scaler)
        trace = run(ours, range(4), 8, new_trace(), clip=1.0)
    assert isinstance(scaler, GradScaler) and scaler._masters._sums is not None
    assert_same_trace(trace, run(Fp32Recipe(Net(), make), range(4), 8, new_trace(), clip=1.0))


def test_patch_torch_refuses_accumulation_without_masters_and_other_settings() -> None:
    import gradscaler

    with pytest.raises(ValueError, match=r"patch_torch\(accumulate_grads_in_fp32=True\) needs master_weights"):
        gradscaler.patch_torch(accumulate_grads_in_fp32=True)
    assert not gradscaler.is_torch_patched()
    with gradscaler.patch_torch(master_weights=True), pytest.raises(ValueError, match=r"unpatch_torch\(\) first"):
        gradscaler.patch_torch(master_weights=True, accumulate_grads_in_fp32=True)


class Mlp(nn.Module):
    """float16 layers around a float32 LayerNorm, one forward for every micro-batch (nothing to recompile)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16).half()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.inp(x.half())).float()).half())


def compiled_loop(system: System, steps: int, micro: int) -> dict[str, list[Any]]:
    trace = new_trace()
    compiled = torch.compile(system.model, backend="aot_eager")
    for step in range(steps):
        system.zero_grad("optimizer", True)
        for k in range(micro):
            x, y = batch(step, k)
            system.backward(((compiled(x).float() - y) ** 2).mean() / micro)
        system.clip(1.0)
        system.step()
        system.update()
        record(system, trace)
    return trace


def test_a_compiled_model_with_the_eager_step_equals_the_recipe() -> None:
    """``torch.compile(model)`` (aot_eager: the graphs inductor would get, run without a C compiler): the
    compiled backward's gradients reach the parameters through autograd's ``AccumulateGrad``, so the
    hooks and the walk at ``scale()`` see them as in eager mode."""
    make = OPTIMIZERS["adamw_fused"]
    torch._dynamo.reset()
    ours = compiled_loop(Ours(Mlp(), make, fp32_scaler()), 4, 4)
    torch._dynamo.reset()
    reference = compiled_loop(Fp32Recipe(Mlp(), make), 4, 4)
    assert_same_trace(ours, reference)


ACCUMULATING = [
    Shape(False, "none", True, True),
    Shape(False, "unscale", True, True),
    Shape(True, "scaler", True, True),
]


@pytest.mark.parametrize("shape", ACCUMULATING, ids=lambda s: s.name)
def test_the_whole_step_compiled_keeps_no_recompile_and_no_more_breaks(shape: Shape) -> None:
    """tests/test_compiled.py's counting (``gradscaler.tools.compiled_step``) with the argument on: over 60
    steps whose scale grows and backs off, no recompile and the recipe's bits (one backward a step: the
    recipe by hand with float32 accumulation is the plain one); the graph breaks are those of the same
    shape without the argument."""
    torch._dynamo.reset()
    theirs = build(shape, ours=False)
    drive(theirs, inputs(60), "aot_eager")
    torch._dynamo.reset()
    ours = build(shape, ours=True)
    with recompiles() as messages:
        drive(ours, inputs(60), "aot_eager")
    assert list(messages) == []
    assert all(torch.equal(a, b) for a, b in zip(ours.state(), theirs.state(), strict=True))
    counted = {}
    for accumulate in (False, True):
        torch._dynamo.reset()
        plain = Shape(shape.fused, shape.clip, True, accumulate)
        counted[accumulate] = [(b.reason, b.in_library) for b in breaks(build(plain, ours=True), inputs(2))]
    assert counted[True] == counted[False]


def test_parameters_no_optimizer_binds_get_their_gradients_back_at_the_first_update_even_with_none_bound() -> None:
    """A float16 base outside the only optimizer, which holds a float32 head: no master is ever bound, and
    the base's gradient stayed in the hook's sum for good (and every ``scale()`` walked the graph)."""
    torch.manual_seed(0)
    base, head = nn.Linear(8, 16).half(), nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    scaler = fp32_scaler(init_scale=8.0)
    for step in range(3):
        optimizer.zero_grad()
        base.zero_grad()
        expected = torch.zeros_like(base.weight, dtype=torch.float32)
        for micro in range(2):
            x, y = batch(step, micro)
            loss = ((head(base(x.half()).float()) - y) ** 2).mean()
            if step > 0:  # from the second iteration on autograd's own accumulation, as torch's scaler
                scaler.scale(loss).backward()
                continue
            scaled = scaler.scale(loss)
            (part,) = torch.autograd.grad(scaled, base.weight, retain_graph=True)
            expected += part.float()
            scaled.backward()
        scaler.step(optimizer)
        scaler.update()
        assert base.weight.grad is not None and base.weight.grad.dtype == torch.float16
        if step == 0:  # the first iteration's float32 sum, given back in float16
            assert expected.abs().max() > 0 and torch.equal(base.weight.grad, expected.half())
    assert not scaler._masters._sums.watching


def test_a_tensor_subclass_parameter_swapped_with_the_future_off_is_hooked_again() -> None:
    """``nn.Module._apply`` swaps a wrapper-subclass parameter whatever the future says (even for a
    ``.to()`` that changes nothing), leaving the hook behind on the old tensor."""
    from torch.testing._internal.two_tensor import TwoTensor

    assert not torch.__future__.get_swap_module_params_on_conversion()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).half()
    weight = model[0].weight.detach()
    model[0].weight = nn.Parameter(TwoTensor(weight.clone(), weight.clone()))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = fp32_scaler(init_scale=8.0)
    for step in range(4):
        if step == 2:
            impl = model[0].weight._cdata
            model.to(torch.float16)
            assert model[0].weight._cdata != impl  # swapped
        optimizer.zero_grad()
        for micro in range(2):
            x, y = batch(step, micro)
            scaler.scale(((model(x.half()).float() - y) ** 2).mean()).backward()
            assert model[0].weight.grad is None  # in the float32 sum, not accumulated by autograd
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.skipif(
    TORCH_VERSION < (2, 11),
    reason="torch 2.4's swap_tensors keeps the parameter's _cdata: the step refuses the float16 gradient the dead "
    "hook left with the message for a gradient written by hand, not the one that names the swap",
)
def test_a_swap_with_the_future_on_around_the_conversion_only_is_refused_at_the_step_naming_the_fix() -> None:
    """The scaler hooks swapped parameters again at ``scale()`` while the future is on; turned on around
    ``model.to()`` only, the swapped parameters' hooks are dead at the next backward."""
    ours, _ = pair("adamw_foreach")
    run(ours, range(2), 2, new_trace())
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ours.model.head.to(torch.float32).to(torch.float16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    ours.zero_grad("optimizer", True)
    for micro in range(2):
        ours.backward(micro_loss(ours, 2, micro, 2))
    before = [p.detach().clone() for p in ours.model.parameters()]
    with pytest.raises(ValueError, match=r"set_swap_module_params_on_conversion\(True\) before training.*was swapped"):
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.model.parameters(), strict=True))
    run(ours, range(3, 5), 2, new_trace())  # hooked again: the next iterations sum in float32
    assert ours.model.head.weight.grad is None


def test_a_resume_with_a_trained_block_frozen_binds_it_and_sums_it_once_unfrozen() -> None:
    """A frozen parameter the resumed optimizer holds state for gets a master at the binding; torch refuses
    a hook on it (it raised "cannot register a hook on a tensor that doesn't require gradient" at the first
    step). It is hooked at the first ``scale()`` after it is unfrozen, and sums in float32 from then on."""
    ours, reference = pair("adamw_foreach")
    trace, expected = run(ours, range(2), 2, new_trace()), run(reference, range(2), 2, new_trace())
    again = resumed(save(ours), "adamw_foreach")
    for system in (again, reference):
        system.model.head.requires_grad_(False)
    assert_same_trace(run(again, range(2, 4), 2, trace), run(reference, range(2, 4), 2, expected))
    for system in (again, reference):
        system.model.head.requires_grad_(True)
    assert_same_trace(run(again, range(4, 7), 2, trace), run(reference, range(4, 7), 2, expected))
    assert again.model.head.weight.grad is None  # summed in float32, not by autograd
    assert_same_state(again.optimizer, reference.optimizer)


def test_a_bound_optimizers_zero_grad_clears_the_sum_of_a_group_added_since_its_last_move() -> None:
    """The sum of a group added to a bound optimizer is held by its hook until the next move; the
    optimizer's ``zero_grad`` (ours, installed at the binding) clears it as the recipe's clears its copy's."""
    for set_to_none in (True, False):
        ours, reference = pair("adamw_foreach")
        trace, expected = run(ours, range(2), 2, new_trace()), run(reference, range(2), 2, new_trace())
        for system in (ours, reference):
            add_extra(system, 2)
            system.backward(micro_loss(system, 2, 0, 2))  # a batch the loop then drops
            system.zero_grad("optimizer", set_to_none)
        held = ours.scaler._masters._sums.sum_of(ours.model.extra.weight)
        assert held is not None and (held.total is None if set_to_none else not held.total.any())
        assert_same_trace(run(ours, range(3, 6), 2, trace), run(reference, range(3, 6), 2, expected))
        assert_same_state(ours.optimizer, reference.optimizer)


def test_an_update_torch_refuses_before_any_step_changes_nothing() -> None:
    """``update()`` before any ``unscale_``/``step`` raises torch's "No inf checks were recorded"; the
    first iteration's sums stay where they are (they were handed back in float16 first)."""
    ours, _ = pair("adamw_foreach")
    ours.backward(micro_loss(ours, 0, 0, 1))
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        ours.scaler.update()
    assert all(p.grad is None for p in ours.model.parameters() if p.requires_grad and p.dtype == torch.float16)
    assert ours.scaler._masters._sums.watching


class FreshNode:
    """An autograd node as torch 2.11 and older show it: a new Python object at each access of a parent's
    ``next_functions``, freed after use (so CPython hands its id to the next one)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        if isinstance(spec, torch.Tensor):
            self.variable = spec

    @property
    def next_functions(self) -> tuple[tuple[Any, int], ...]:
        return () if isinstance(self.spec, torch.Tensor) else tuple((FreshNode(child), 0) for child in self.spec)


def test_graph_leaves_finds_every_parameter_when_node_objects_are_made_fresh() -> None:
    """On torch 2.11 (the CUDA image of the lent GPU machines) the first iteration's gradients were summed
    by autograd in bfloat16: graph_leaves marked nodes seen by id(), a freed node's id came back on
    another node, and that node (with the parameters below it) was skipped."""
    from gradscaler.masters.graph import graph_leaves

    params = [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(6)]
    chain: Any = [params[0]]
    for param in params[1:]:
        chain = [[[chain]], param]  # ToCopy -> Addmm -> (T -> AccumulateGrad, AccumulateGrad)
    output = type("Output", (), {"grad_fn": FreshNode(chain)})()
    assert {id(p) for p in graph_leaves(output)} == {id(p) for p in params}


@pytest.mark.parametrize("accumulate", [False, True], ids=["autograd_sums", "fp32_sums"])
@pytest.mark.parametrize("via", [torch.float32, torch.bfloat16], ids=str)
def test_a_skipped_fused_step_after_a_cast_leaves_the_parameters_as_the_recipe_does(
    accumulate: bool, via: torch.dtype
) -> None:
    """A bound layer cast (to float32, or from float16 to bfloat16) holds its old values widened or rounded
    twice, not its master rounded. A fused AdamW step that skips inside its kernel then must leave them, as
    the recipe's skipped step does (ours does not read the flag on the host: the copy back is chosen on the
    device). Found by the state machine (tests/masters_machine.py, rule ``convert``)."""

    def cast(system: System, step: int) -> None:
        if step == 2:
            model = system.model
            for module in (model.inp, model.experts, model.rare, model.frozen, model.head):
                module.to(via)

    make, args = OPTIMIZERS["adamw_fused"], {**SCALER_ARGS, "init_scale": 2.0**12}  # steps 0-2 applied
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=accumulate, **args)
    ours = Ours(Net(), make, scaler)
    reference = (Fp32Recipe if accumulate else Recipe)(Net(), make, torch.amp.GradScaler("cpu", **args))
    # the cast after step 2, an overflow in step 3's first micro-batch, applied steps after it
    assert_same(ours, reference, range(6), 2, overflow=(3, 0), between=cast)
    assert ours.scaler.stats()["skipped_steps"] == 1


@pytest.mark.parametrize("accumulate", [False, True], ids=["autograd_sums", "fp32_sums"])
def test_a_resume_after_a_bfloat16_round_trip_keeps_the_parameters_through_a_skipped_fused_step(
    accumulate: bool,
) -> None:
    """After a bfloat16 evaluation and back, the parameters are their masters rounded through bfloat16; a
    checkpoint then resumed binds each parameter to its saved master, which rounds to it only through that
    round trip, so a fused step that skips must leave the parameter, as the run that did not stop does
    (shrunk by hand from a sequence the state machine found: 7 rules)."""
    make, args = OPTIMIZERS["adamw_fused"], {**SCALER_ARGS, "init_scale": 2.0**12}

    def build() -> Ours:
        return Ours(Net(), make, GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=accumulate, **args))

    def round_trip(system: System, step: int) -> None:
        if step == 2:
            model = system.model
            for module in (model.inp, model.experts, model.rare, model.frozen, model.head):
                module.to(torch.bfloat16).to(torch.float16)

    whole = run(build(), range(6), 2, new_trace(), overflow=(3, 0), between=round_trip)
    first = build()
    head = run(first, range(3), 2, new_trace(), between=round_trip)
    model_state, optimizer_state, scaler_state = torch.load(io.BytesIO(save(first)), weights_only=True)
    again = build()
    again.model.load_state_dict(model_state)
    again.optimizer.load_state_dict(optimizer_state)
    again.scaler.load_state_dict(scaler_state)
    tail = run(again, range(3, 6), 2, new_trace(), overflow=(3, 0))
    assert_same_trace({k: head[k] + tail[k] for k in head}, whole)
    assert again.scaler.stats()["skipped_steps"] == 1


def test_a_frozen_parameter_swapped_under_the_future_is_hooked_again_once_unfrozen() -> None:
    """With the swap-tensors future on for the run, a bound parameter frozen when a conversion swaps it
    cannot be hooked again at the next ``scale()`` (torch refuses a hook on a tensor that does not require
    grad: it raised that from the backward, found by the state machine); it is hooked at the first
    ``scale()`` after it is unfrozen, and sums in float32 from then on, as the recipe's copy does."""
    with swap_future(True):
        ours, reference = pair("adamw_foreach")
        trace, expected = run(ours, range(2), 2, new_trace()), run(reference, range(2), 2, new_trace())
        for system in (ours, reference):
            system.model.head.requires_grad_(False)
            round_trip(system, 2)  # every float16 layer to float32, each parameter swapped
            round_trip(system, 4)  # and back to float16
        assert_same_trace(run(ours, range(2, 4), 2, trace), run(reference, range(2, 4), 2, expected))
        for system in (ours, reference):
            system.model.head.requires_grad_(True)
        assert_same_trace(run(ours, range(4, 7), 2, trace), run(reference, range(4, 7), 2, expected))
        assert ours.model.head.weight.grad is None  # summed in float32, not by autograd
        assert_same_state(ours.optimizer, reference.optimizer)


def test_a_swap_round_trip_whose_new_tensor_gets_the_old_address_is_hooked_again() -> None:
    """A round trip under the swap-tensors future swaps each parameter twice; the first swap frees the tensor
    the scaler hooked, and the second may be given its address back (the allocator's choice: found by the
    state machine, order-dependent), so the address alone does not tell that the hook is dead. Here the
    address is handed back by hand: the sums must still be hooked again, as the recipe's copies sum."""
    with swap_future(True):
        ours, reference = pair("adamw_foreach")
        trace, expected = run(ours, range(2), 2, new_trace()), run(reference, range(2), 2, new_trace())
        for system in (ours, reference):
            round_trip(system, 2)
            round_trip(system, 4)
        sums = ours.scaler._masters._sums
        hooked = [p for p in ours.model.parameters() if sums.sum_of(p) is not None]
        assert len(hooked) >= 4
        for param in hooked:
            sums.sum_of(param).impl = param._cdata  # type: ignore[union-attr]
        assert_same_trace(run(ours, range(2, 5), 2, trace), run(reference, range(2, 5), 2, expected))
        assert all(p.grad is None for p in hooked)  # summed in float32, not by autograd
        assert_same_state(ours.optimizer, reference.optimizer)


@pytest.mark.parametrize("accumulate", [False, True], ids=["autograd_sums", "fp32_sums"])
def test_a_skipped_fused_step_after_a_resume_from_a_round_trip_leaves_the_parameters_as_the_recipe_does(
    accumulate: bool,
) -> None:
    """A bfloat16 evaluation and back (``round_trip`` through bfloat16) leaves the parameters rounded twice,
    no rounding of their masters; a checkpoint saved then and resumed into fresh objects binds each to its
    saved master, which it is still no rounding of. A fused AdamW step that skips inside its kernel then must
    leave the parameters as they are, as the recipe's skipped step does (the fresh binding took them for
    their masters rounded, and wrote the masters into them). Found by the state machine (a round trip, a
    save and a fresh resume, a skipped step)."""
    make, args = OPTIMIZERS["adamw_fused"], {**SCALER_ARGS, "init_scale": 2.0**12}  # steps 0-1 applied

    def scaler() -> GradScaler:
        return GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=accumulate, **args)

    ours = Ours(Net(), make, scaler())
    reference = (Fp32Recipe if accumulate else Recipe)(Net(), make, torch.amp.GradScaler("cpu", **args))
    trace, expected = run(ours, range(2), 2, new_trace()), run(reference, range(2), 2, new_trace())
    for system in (ours, reference):
        for module in (system.model.inp, system.model.experts, system.model.rare, system.model.head):
            module.to(torch.bfloat16).to(torch.float16)
    model_state, optimizer_state, scaler_state = torch.load(io.BytesIO(save(ours)), weights_only=True)
    again = Ours(Net(seed=9), make, scaler())
    again.model.load_state_dict(model_state)
    again.optimizer.load_state_dict(optimizer_state)
    again.scaler.load_state_dict(scaler_state)
    # an overflow in step 2's first micro-batch (skipped), applied steps after it
    run(again, range(2, 5), 2, trace, overflow=(2, 0))
    run(reference, range(2, 5), 2, expected, overflow=(2, 0))
    assert_same_trace(trace, expected)
    assert again.scaler.stats()["skipped_steps"] == 1


def test_a_layer_frozen_at_the_binding_and_unfrozen_later_sums_in_float32_from_its_first_backward() -> None:
    """A layer frozen and without optimizer state at the binding gets no master and no hook (a warm-up with a
    frozen layer). Unfrozen later, its first iteration was summed by autograd in float16 into ``p.grad`` (with
    the late-parameter warning), where the recipe's copy sums in float32 (found by the state machine through a
    fresh resume that binds before its loads). Now the iteration's first ``scale()`` hooks it."""
    ours, reference = pair("adamw_foreach")
    for system in (ours, reference):
        system.model.head.requires_grad_(False)
    trace, expected = run(ours, range(2), 4, new_trace()), run(reference, range(2), 4, new_trace())
    for system in (ours, reference):
        system.model.head.requires_grad_(True)
    assert_unfrozen_sum_in_float32(ours, reference, trace, expected, list(ours.model.head.parameters()))


def assert_unfrozen_sum_in_float32(
    ours: Ours, reference: Fp32Recipe, trace: dict[str, list[Any]], expected: dict[str, list[Any]], unfrozen: list[Any]
) -> None:
    """Iteration 2 of 4 micro-batches after ``unfrozen`` (ours') were unfrozen on both sides: no late-parameter
    warning, their first gradient in the float32 sum (not in ``p.grad`` for autograd to add to), and ours equal
    to the recipe through iteration 5."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no late-parameter warning
        ours.zero_grad("optimizer", True)
        ours.backward(micro_loss(ours, 2, 0, 4))
        assert all(p.grad is None for p in unfrozen)  # in the float32 sums, not accumulated by autograd
        for micro in range(1, 4):
            ours.backward(micro_loss(ours, 2, micro, 4))
        ours.step()
    ours.update()
    record(ours, trace)
    run(reference, range(2, 3), 4, expected)
    assert_same_trace(run(ours, range(3, 6), 4, trace), run(reference, range(3, 6), 4, expected))
    assert_same_state(ours.optimizer, reference.optimizer)


def test_a_layer_frozen_at_the_binding_and_unfrozen_between_micro_batches_sums_in_float32_from_then_on() -> None:
    """As above, unfrozen between two micro-batches of a later iteration (a loop that unfreezes at a set
    micro-batch count): its next backward's gradient goes into the float32 sum, not into ``p.grad`` for autograd
    to add the rest in float16 (found by the state machine: the check ran at the iteration's first ``scale()``
    only)."""
    ours, reference = pair("adamw_foreach")
    for system in (ours, reference):
        system.model.head.requires_grad_(False)
    trace, expected = run(ours, range(2), 4, new_trace()), run(reference, range(2), 4, new_trace())
    for system, out in ((ours, trace), (reference, expected)):
        system.zero_grad("optimizer", True)
        for micro in range(4):
            if micro == 2:
                system.model.head.requires_grad_(True)
            system.backward(micro_loss(system, 2, micro, 4))
            if micro == 2 and system is ours:
                assert ours.model.head.weight.grad is None  # in the float32 sum, not accumulated by autograd
        system.step()
        system.update()
        record(system, out)
    assert_same_trace(run(ours, range(3, 6), 4, trace), run(reference, range(3, 6), 4, expected))
    assert_same_state(ours.optimizer, reference.optimizer)


@pytest.mark.parametrize("how", ["unfrozen", "all-unfrozen", "added"])
def test_a_parameter_hooked_before_its_binding_keeps_its_sum_through_a_swap(how: str) -> None:
    """With the swap-tensors future on for the run: a layer hooked before its first move (unfrozen since a
    binding that gave it no master, or added by ``add_param_group``) and then swapped by a cast (a round trip
    through float32, exact) between two micro-batches: the scaler hooks it again at the next ``scale()``, its
    sum carried over, as it does for a master's parameter. (Before the fix only the masters' parameters were
    hooked again: the rest of the iteration was summed by autograd in float16 into ``p.grad``; found by the
    state machine, seed 35 of 400 sequences, through a fresh resume. ``all-unfrozen``: every float16 layer
    frozen at the first contact, so nothing was bound: found by review.)"""
    ours, reference = pair("adamw_foreach")
    frozen = {"unfrozen": ["head"], "all-unfrozen": ["inp", "experts", "rare", "head"], "added": []}[how]
    for system in (ours, reference):
        for name in frozen:
            getattr(system.model, name).requires_grad_(False)
    with swap_future(True):
        trace, expected = run(ours, range(2), 4, new_trace()), run(reference, range(2), 4, new_trace())
        for system, out in ((ours, trace), (reference, expected)):
            if frozen:
                for name in frozen:
                    getattr(system.model, name).requires_grad_(True)
                layer = system.model.head
            else:
                add_extra(system, 2)
                layer = system.model.extra
            system.zero_grad("optimizer", True)
            for micro in range(4):
                if micro == 2:
                    layer.float()
                    layer.half()
                system.backward(micro_loss(system, 2, micro, 4))
                if system is ours:
                    assert all(p.grad is None for p in layer.parameters())  # in the float32 sums
            system.step()
            system.update()
            record(system, out)
        assert_same_trace(run(ours, range(3, 6), 4, trace), run(reference, range(3, 6), 4, expected))
    assert_same_state(ours.optimizer, reference.optimizer)


def test_every_low_precision_layer_frozen_at_the_first_contact_and_unfrozen_later_sums_in_float32() -> None:
    """A warm-up that trains only the float32 layers: at the scaler's first contact nothing needs a master, so
    nothing is bound. Unfrozen later, the layers' first iteration was summed by autograd in float16 into
    ``p.grad`` (with the late-parameter warning) where the recipe's copies sum in float32 (found by the state
    machine, seed 14, through a fresh resume with every float16 layer frozen). Now such an optimizer is watched
    as one bound with frozen layers is: the first ``scale()`` after they are unfrozen hooks them."""
    ours, reference = pair("adamw_foreach")
    low = [
        [p for p in system.model.parameters() if p.dtype == torch.float16 and p.requires_grad]
        for system in (ours, reference)
    ]
    for params in low:
        for p in params:
            p.requires_grad_(False)
    trace, expected = run(ours, range(2), 4, new_trace()), run(reference, range(2), 4, new_trace())
    assert not ours.scaler.master_weights(ours.optimizer)  # nothing to master yet
    for params in low:
        for p in params:
            p.requires_grad_(True)
    assert_unfrozen_sum_in_float32(ours, reference, trace, expected, low[0])


USER_LOOP = """\
import torch
from torch.nn.utils import clip_grad_norm_ as clip


def loop(model, optimizer, scaler, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 16, dtype=torch.float16)).float().pow(2).mean()).backward()
        scaler.unscale_(optimizer)
        clip(model.parameters(), 1e-3)
        scaler.step(optimizer)
        scaler.update()
"""


@pytest.mark.parametrize("bound", [True, False], ids=["from-import", "through-the-module"])
def test_torchs_clipping_bound_by_name_before_the_first_step_is_warned(
    bound: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop that imported ``clip_grad_norm_`` by name holds torch's function, not the routed one: over the
    model's parameters it finds no gradient (they are the masters' float32 sums) and clips nothing. The first
    move warns, once, naming the module and the name, at the loop's line; through the module it is routed.
    (The import is made as in a fresh process, before any scaler routed torch's name.)"""
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", wrappers.torch_clip_grad_norm_)
    source = USER_LOOP if bound else USER_LOOP.replace("from torch.nn.utils import clip_grad_norm_ as clip", "")
    source = source.replace("        clip(", "        torch.nn.utils.clip_grad_norm_(") if not bound else source
    module: dict[str, Any] = {"__name__": "user_loop"}
    exec(compile(source, "user_loop.py", "exec"), module)  # a user's module, written here
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = fp32_scaler(init_scale=2.0**10)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        module["loop"](model, optimizer, scaler, 3)
    ours = [w for w in record if "holds torch's own clip_grad_norm_" in str(w.message)]
    masters = dict(scaler.master_weights(optimizer))
    if bound:
        assert len(ours) == 1 and (ours[0].filename, ours[0].lineno) == ("user_loop.py", 9)  # the unscale_
        assert "module user_loop holds torch's own clip_grad_norm_ as clip" in str(ours[0].message)
        assert all(m.grad is not None and m.grad.norm() > 1e-3 for m in masters.values())  # not clipped
    else:
        total = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters.values()]))
        assert ours == [] and total <= 1e-3 * 1.001


@pytest.mark.parametrize("how", ["new, the first kept", "new, the first dropped", "deepcopy"])
def test_a_second_scaler_taking_over_the_bound_optimizer_equals_the_recipe(how: str) -> None:
    """A second scaler over the optimizer the first one bound (a new one given the first's state, or a deep
    copy): its hooks replace the first's, so it steers alone and the run goes on as the recipe's. (Both hooks
    ran before, the first's first: it moved each gradient and the second found none, so nothing was trained
    while the first lived, and one iteration was lost when it was dropped; found by a hostile round.)"""
    ours, reference = pair("adamw_foreach")
    trace, expected = run(ours, range(3), 4, new_trace()), run(reference, range(3), 4, new_trace())
    first = ours.scaler
    if how == "deepcopy":
        ours.scaler = copy.deepcopy(first)
    else:
        ours.scaler = fp32_scaler()
        ours.scaler.load_state_dict(first.state_dict())
    if how == "new, the first dropped":
        del first
        gc.collect()
    assert_same_trace(run(ours, range(3, 7), 4, trace), run(reference, range(3, 7), 4, expected))
    assert_same_state(ours.optimizer, reference.optimizer)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("halved", [False, True], ids=["scaled", "scaled-then-halved"])
@pytest.mark.parametrize("refused_at", [0, 1])
def test_a_refused_create_graph_backward_leaves_float32_layers_and_sums_as_they_were(
    refused_at: int, halved: bool
) -> None:
    """A float16 body under a float32 head: autograd reaches the head first. The refusal comes before the
    backward writes anything (it came at the first float16 parameter, after the head's gradient and any sum
    of a parameter whose gradient needs no graph were written: the plain backward the message advises then
    added to them). The run with the refused call equals, bit for bit, the same run without it. ``halved``:
    the scaled loss a temporary under another op (the refusal takes the running node, not the output)."""

    def run(refuse: bool) -> tuple[list[torch.Tensor], list[Any]]:
        torch.manual_seed(0)
        body, head = nn.Linear(6, 6).half(), nn.Linear(6, 1)
        optimizer = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2)
        scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, init_scale=2.0**8)
        seen: list[Any] = []
        for _ in range(3):
            for micro in range(2):
                x = torch.randn(4, 6, dtype=torch.float16)

                def loss(x: torch.Tensor = x) -> torch.Tensor:
                    return head(torch.tanh(body(x)).float()).pow(2).mean()

                if refuse and micro == refused_at:
                    before = [None if p.grad is None else p.grad.clone() for p in head.parameters()]
                    with pytest.raises(RuntimeError, match="create_graph=True"):
                        (scaler.scale(loss()) / 2 if halved else scaler.scale(loss())).backward(create_graph=True)
                    after = [None if p.grad is None else p.grad.clone() for p in head.parameters()]
                    for a, b in zip(after, before, strict=True):
                        assert a is b is None or (a is not None and b is not None and same([a], [b]))
                    (penalty,) = torch.autograd.grad(scaler.scale(loss()), [head.weight], create_graph=True)
                    seen.append(penalty.detach().clone())  # torch.autograd.grad goes on, writing nothing
                scaler.scale(loss()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return [p.detach().clone() for p in [*body.parameters(), *head.parameters()]], seen

    plain, _ = run(refuse=False)
    refused, penalties = run(refuse=True)
    assert same(refused, plain)
    assert len(penalties) == 3 and all(bool(torch.isfinite(p).all()) for p in penalties)


def test_a_scaler_dropped_and_replaced_within_a_window_carries_its_sum_on() -> None:
    """A scaler with float32 sums dropped between two micro-batches and replaced by a new one (its state loaded):
    the new scaler's hooks take over the dropped one's and carry the window's sum on, which lives in the masters'
    gradients once bound (a first form of a fix for the scalers machine's seed 15 dropped it: the second step
    then took the last micro-batch only)."""

    def run(replace: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).half()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kwargs: dict[str, Any] = {"init_scale": 2.0**10, "master_weights": True, "accumulate_grads_in_fp32": True}
        scaler = GradScaler("cpu", **kwargs)
        x = torch.randn(2, 8, 4).half()
        for step in range(2):
            for micro in range(2):
                if replace and step == 1 and micro == 1:
                    new = GradScaler("cpu", **kwargs)
                    new.load_state_dict(scaler.state_dict())
                    del scaler
                    gc.collect()
                    scaler = new
                scaler.scale(model(x[micro]).float().square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(replace=True), run(replace=False), strict=True):
        assert torch.equal(a, b)
