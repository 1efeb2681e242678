"""The masters' lifecycle against the recipe by hand (tests/recipe.py), through the loops users write.

Parameters that miss steps (mixture-of-experts experts, a LayerDrop block) under either ``zero_grad``,
iterations that end at ``update()`` without ``step``, a step that raises, a batch dropped after its
backward, resume then an edit, checkpoints that cross runs without masters, copied training states,
writes that replace a parameter's storage, float32 parameters among float16 ones under clipping.
Every case is compared bit for bit: scales, every parameter after every iteration, optimizer state.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from recipe import (
    OPTIMIZERS,
    SCALER_ARGS,
    Boom,
    Ours,
    OursScalerClips,
    Recipe,
    RecipeScalerClips,
    System,
    assert_same_state,
    assert_same_trace,
    new_trace,
    record,
)

STEPS = 12


class Experts(nn.Module):
    """float16 layers: three experts of which each step's routing uses two (expert k sits out every third
    step), a LayerDrop block used on even steps only, a LayerNorm kept in float32 between them and the head."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, 16).to(dtype)
        self.experts = nn.ModuleList(nn.Linear(16, 16).to(dtype) for _ in range(3))
        self.layerdrop = nn.Linear(16, 16).to(dtype)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4).to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.inp(x.to(self.dtype)))
        used = [k for k in range(3) if (step + k) % 3 != 0]
        h = sum(self.experts[k](h) for k in used) / len(used)
        if step % 2 == 0:
            h = h + self.layerdrop(h)
        h = self.norm(h.float()).to(self.dtype)
        return self.head(h)


def data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def loss_of(system: System, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    x, y = batch
    return ((system.model(x, step).float() - y) ** 2).mean()


def run(
    system: System,
    steps: range,
    trace: dict[str, list[Any]],
    *,
    zero: str = "optimizer",
    set_to_none: bool = True,
    pattern: str = "plain",
    clip: float | None = None,
) -> dict[str, list[Any]]:
    """A training loop over ``steps``. ``pattern``: ``"dropped"`` (every fourth iteration runs a backward
    whose batch it drops, then ``zero_grad`` and the real one), ``"no_step"`` (every fourth iteration
    ends at ``unscale_`` + ``update()``), ``"raises"`` (every fourth iteration's ``optimizer.step``, when
    the scaler calls it, raises and the loop calls ``update()`` without a retry)."""
    batches = data(max(steps) + 1)
    extra = data(max(steps) + 1, seed=7)
    for step in steps:
        system.zero_grad(zero, set_to_none)
        if pattern == "dropped" and step % 4 == 1:
            system.backward(loss_of(system, extra[step], step))
            system.zero_grad(zero, set_to_none)
        system.backward(loss_of(system, batches[step], step))
        if pattern == "no_step" and step % 4 == 2:
            system.unscale_()
        elif pattern == "raises" and step % 4 == 3:
            system.armed = True
            with contextlib.suppress(Boom):  # when the scaler calls ``optimizer.step`` (not on a skip)
                system.step()
            system.armed = False
        else:
            if clip is not None:
                system.clip(clip)
            system.step()
        system.update()
        record(system, trace)
    return trace


def both(name: str, model: Callable[[], nn.Module] = Experts) -> tuple[Ours, Recipe]:
    return Ours(model(), OPTIMIZERS[name]), Recipe(model(), OPTIMIZERS[name])


def assert_same_run(
    ours: Ours, reference: Recipe, steps: range = range(STEPS), **loop: Any
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    a, b = run(ours, steps, new_trace(), **loop), run(reference, steps, new_trace(), **loop)
    assert_same_trace(a, b)
    assert_same_state(ours.optimizer, reference.optimizer)
    return a, b


# (a) parameters that miss steps, either zero_grad -------------------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("zero", ["model", "optimizer"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_experts_and_layerdrop_that_miss_steps_equal_the_recipe(name: str, zero: str, set_to_none: bool) -> None:
    ours, reference = both(name)
    trace, _ = assert_same_run(ours, reference, zero=zero, set_to_none=set_to_none)
    sat_out = [i for i in range(1, STEPS) if i % 2 == 1]  # the LayerDrop block has no gradient on odd steps
    index = [n for n, _ in ours.model.named_parameters()].index("layerdrop.weight")
    for step in sat_out:
        assert torch.equal(trace["params"][step][index], trace["params"][step - 1][index]), step


def test_the_same_with_bfloat16_parameters() -> None:
    ours, reference = both("adamw_foreach", lambda: Experts(dtype=torch.bfloat16))
    assert_same_run(ours, reference, zero="model")


# (f) iterations without a step, a batch dropped after its backward ----------------------------------------


@pytest.mark.parametrize("zero", ["model", "optimizer"])
@pytest.mark.parametrize("pattern", ["dropped", "no_step", "raises"])
@pytest.mark.parametrize("name", ["sgd_momentum_forloop", "adamw_fused"])
def test_loops_that_leave_an_iteration_equal_the_recipe(name: str, pattern: str, zero: str) -> None:
    ours, reference = both(name)
    ours.arm_step_failure()
    reference.arm_step_failure()
    assert_same_run(ours, reference, zero=zero, pattern=pattern)
    assert ours.raised == reference.raised and (ours.raised > 0) == (pattern == "raises")


def test_torchs_clipping_recipe_with_missing_gradients_equals_the_recipe() -> None:
    ours, reference = both("adamw_foreach")
    assert_same_run(ours, reference, zero="model", clip=0.5)


# (g) float32 parameters among float16 ones: the clipping norm in the optimizer's order ---------------------


@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused"])
def test_scaler_clipping_sums_norms_in_the_optimizers_order(name: str) -> None:
    """200 steps of ``scaler.clip_grad_norm_``: the norm of float32 and master gradients summed in the
    optimizer's order, as clipping the copies by hand sums them (the recipe with our scaler, which
    equals torch's, for its ``clip_grad_norm_``)."""

    ours = OursScalerClips(Experts(), OPTIMIZERS[name])
    reference = RecipeScalerClips(Experts(), OPTIMIZERS[name], GradScaler("cpu", **SCALER_ARGS))
    assert_same_run(ours, reference, range(200), clip=0.05)


# (c) resume, then an edit before the first step --------------------------------------------------------


def save(system: System) -> bytes:
    buffer = io.BytesIO()
    state = {"model": system.model.state_dict(), "optimizer": system.optimizer.state_dict()}
    torch.save({**state, "scaler": system.scaler.state_dict()}, buffer)
    return buffer.getvalue()


def load(system: System, blob: bytes, optimizer_first: bool = False) -> System:
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    if optimizer_first:
        system.optimizer.load_state_dict(saved["optimizer"])
    system.model.load_state_dict(saved["model"])
    if not optimizer_first:
        system.optimizer.load_state_dict(saved["optimizer"])
    system.scaler.load_state_dict(saved["scaler"])
    return system


def new_head(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(model.head.weight.shape, generator=g) * 0.3).to(model.head.weight.dtype)


@pytest.mark.parametrize("how", ["data", "no_grad"])
@pytest.mark.parametrize("name", ["sgd_momentum_forloop", "adamw_foreach"])
def test_resume_then_edit_keeps_the_edit_as_the_uninterrupted_run(name: str, how: str) -> None:
    ours, reference = both(name)
    first, second = range(6), range(6, STEPS)
    trace = run(ours, first, new_trace(), zero="model")
    expected = run(reference, first, new_trace(), zero="model")
    resumed = load(Ours(Experts(seed=9), OPTIMIZERS[name]), save(ours))
    value = new_head(resumed.model)
    if how == "data":
        resumed.model.head.weight.data.copy_(value)  # through .data, before the first contact
    else:
        with torch.no_grad():
            resumed.model.head.weight.copy_(value)
    reference.edit(reference.model.head.weight, value)
    assert_same_trace(run(resumed, second, trace, zero="model"), run(reference, second, expected, zero="model"))
    assert_same_state(resumed.optimizer, reference.optimizer)


def test_an_edit_between_steps_of_a_bound_run_is_kept() -> None:
    ours, reference = both("adamw_foreach")
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    with torch.no_grad():
        ours.model.head.weight.copy_(new_head(ours.model))
    reference.edit(reference.model.head.weight, new_head(reference.model))
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))


@pytest.mark.parametrize("how", ["assign_data", "vector_to_parameters"])
def test_a_write_that_replaces_the_storage_is_seen(how: str) -> None:
    """``p.data = t`` and ``torch.nn.utils.vector_to_parameters`` bump no version counter; the master sees
    the parameter's new storage and takes its values."""
    ours, reference = both("sgd_momentum_forloop")
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    value = new_head(ours.model)
    if how == "assign_data":
        ours.model.head.weight.data = value.clone()
    else:
        torch.nn.utils.vector_to_parameters(value.flatten().clone(), [ours.model.head.weight])
    reference.edit(reference.model.head.weight, value)
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))


def test_loading_into_a_bound_optimizer_before_the_model_resumes_exactly() -> None:
    ours, reference = both("adamw_foreach")
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    blob = save(ours)
    run(ours, range(6, 9), new_trace())  # trained on, then rolled back to the checkpoint
    load(ours, blob, optimizer_first=True)
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))
    assert_same_state(ours.optimizer, reference.optimizer)


# (d) checkpoints that cross runs without masters -------------------------------------------------------


class Plain(System):
    """A float16 model stepped in float16 by fused AdamW: no masters (the path torch allows)."""

    def __init__(self, model: nn.Module, scaler: Any) -> None:
        self.model = model
        self.optimizer = OPTIMIZERS["adamw_fused"](list(model.parameters()))
        self.scaler = scaler

    def zero_grad(self, side: str, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        self.scaler.step(self.optimizer)


def recipe_from(blob: bytes) -> Recipe:
    """The recipe resumed from ``blob``: the model loaded first, its copies built from it, then the rest."""
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    model = Experts(seed=9)
    model.load_state_dict(saved["model"])
    system = Recipe(model, OPTIMIZERS["adamw_fused"])
    system.optimizer.load_state_dict(saved["optimizer"])
    system.scaler.load_state_dict(saved["scaler"])
    return system


@pytest.mark.parametrize("chain", ["masters-plain-masters", "plain-masters"])
def test_checkpoints_crossing_a_run_without_masters_equal_the_recipe(chain: str) -> None:
    phases = chain.split("-")
    spans = [range(5 * i, 5 * (i + 1)) for i in range(len(phases))]
    ours_trace, reference_trace = new_trace(), new_trace()
    ours_blob = reference_blob = None
    for phase, span in zip(phases, spans, strict=True):
        if phase == "masters":
            ours: System = Ours(Experts(seed=0 if ours_blob is None else 9), OPTIMIZERS["adamw_fused"])
            ours = ours if ours_blob is None else load(ours, ours_blob)
            reference: System = Recipe(Experts(), OPTIMIZERS["adamw_fused"])
            reference = reference if reference_blob is None else recipe_from(reference_blob)
        else:
            ours = Plain(Experts(seed=9), GradScaler("cpu", **SCALER_ARGS))
            ours = ours if ours_blob is None else load(ours, ours_blob)
            reference = Plain(Experts(seed=9), torch.amp.GradScaler("cpu", **SCALER_ARGS))
            if reference_blob is None:
                reference.model.load_state_dict(Experts().state_dict())
                ours.model.load_state_dict(Experts().state_dict())
            else:
                reference = load(reference, reference_blob)
        run(ours, span, ours_trace)
        run(reference, span, reference_trace)
        assert_same_trace(ours_trace, reference_trace)
        assert_same_state(ours.optimizer, reference.optimizer)
        ours_blob, reference_blob = save(ours), save(reference)


# (e) copied training states ------------------------------------------------------------------------------


def torch_save(objects: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda objects: pickle.loads(pickle.dumps(objects)),
    "torch_save": torch_save,
}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", ["sgd_momentum_forloop", "adamw_fused"])
def test_a_copied_training_state_trains_on_as_the_original(name: str, how: str) -> None:
    ours, reference = both(name)
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    original = copy.deepcopy(trace)
    copied = Ours.__new__(Ours)
    copied.model, copied.optimizer, copied.scaler = COPIES[how]((ours.model, ours.optimizer, ours.scaler))
    assert_same_trace(run(copied, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))
    assert_same_state(copied.optimizer, reference.optimizer)
    run(ours, range(6, STEPS), original)  # the original is untouched by its copy and trains on the same
    assert_same_trace(original, expected)


def test_a_copied_scaler_steers_the_original_optimizer() -> None:
    ours, reference = both("adamw_foreach")
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    ours.scaler = copy.deepcopy(ours.scaler)
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))


def test_saved_masters_that_no_longer_round_to_the_whole_parameter_are_not_used() -> None:
    """A run without masters that changed only a few values of a tensor (a small learning rate) still
    makes the saved masters of that tensor another state's: the resumed masters are the parameters'
    values, as the recipe's copies would be, never the older masters."""
    ours = Ours(Experts(), OPTIMIZERS["adamw_fused"])
    run(ours, range(5), new_trace())
    middle = Plain(Experts(seed=9), GradScaler("cpu", **SCALER_ARGS))
    load(middle, save(ours))
    for group in middle.optimizer.param_groups:
        group["lr"] = 1e-5
    before = {name: p.detach().clone() for name, p in middle.model.named_parameters()}
    run(middle, range(5, 8), new_trace())  # the first of these steps is skipped (an overflow)
    resumed = load(Ours(Experts(seed=9), OPTIMIZERS["adamw_fused"]), save(middle))
    run(resumed, range(8, 9), new_trace(), pattern="no_step")  # binds; its only iteration ends without a step
    names = {id(p): name for name, p in resumed.model.named_parameters()}
    partly = 0
    for low, master in resumed.scaler.master_weights(resumed.optimizer):
        changed = int((low != before[names[id(low)]]).sum())
        if 0 < changed < low.numel():
            partly += 1
            assert torch.equal(master, low.float())
    assert partly > 0


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_a_second_scaler_on_a_bound_optimizer_resumes_exactly(optimizer_first: bool) -> None:
    ours, reference = both("adamw_foreach")
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    blob = save(ours)
    run(ours, range(6, 9), new_trace())
    ours.scaler = GradScaler("cpu", master_weights=True, **SCALER_ARGS)  # takes over the same optimizer
    run(ours, range(9, 10), new_trace())
    load(ours, blob, optimizer_first=optimizer_first)
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))
