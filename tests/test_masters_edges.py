"""master_weights=True at the last edges (issue 29), against the recipe by hand (tests/recipe.py) or the
documented behaviour: a parameter added twice, a checkpoint taken while a trained block is frozen, a
change of dtype, state an optimizer makes at construction, a float32 parameter resumed from a float16
run's masters, and torch's distributed-checkpoint helpers.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from gradscaler import GradScaler
from gradscaler.masters.checkpoint import SAVED_KEY, ContinuedWarning
from recipe import (
    OPTIMIZERS,
    MakeOptimizer,
    Ours,
    Recipe,
    System,
    assert_same_state,
    assert_same_trace,
    named,
    new_trace,
)
from test_masters_lifecycle import STEPS, Experts, assert_same_run, data, load, run, save

SCALES: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}  # applied steps from the first on


def ours_with(make: MakeOptimizer, seed: int = 0) -> Ours:
    return Ours(Experts(seed=seed), make, GradScaler("cpu", master_weights=True, **SCALES))


def recipe_with(make: MakeOptimizer) -> Recipe:
    return Recipe(Experts(), make, torch.amp.GradScaler("cpu", **SCALES))


def both_with(make: MakeOptimizer) -> tuple[Ours, Recipe]:
    return ours_with(make), recipe_with(make)


# 1. A float16 parameter added twice ------------------------------------------------------------------------


def lm_head_group(system: System) -> dict[str, Any]:
    """A group that re-adds a parameter the optimizer holds (weight tying: a group for the head that
    re-adds the tied input weight)."""
    return {"params": [system.model.head.weight], "lr": 1e-3}


@pytest.mark.parametrize("name", ["sgd_momentum_forloop", "adamw_fused"])
def test_adding_a_held_float16_parameter_again_is_refused_as_torch_refuses_it(name: str) -> None:
    ours, reference = both_with(OPTIMIZERS[name])
    trace, expected = run(ours, range(3), new_trace()), run(reference, range(3), new_trace())
    groups = [[id(p) for p in g["params"]] for g in ours.optimizer.param_groups]
    with pytest.raises(ValueError, match=r"^some parameters appear in more than one parameter group$"):
        reference.optimizer.add_param_group({"params": [reference.copies.params()[-2]], "lr": 1e-3})
    with pytest.raises(ValueError, match=r"^some parameters appear in more than one parameter group$"):
        ours.optimizer.add_param_group(lm_head_group(ours))
    assert [[id(p) for p in g["params"]] for g in ours.optimizer.param_groups] == groups  # nothing changed
    assert_same_trace(run(ours, range(3, 8), trace), run(reference, range(3, 8), expected))


@pytest.mark.parametrize("form", ["tensor", "list", "generator", "named"])
def test_add_param_group_reads_params_as_torch_does_refusing_a_held_one_and_taking_a_new_one(form: str) -> None:
    """Each form torch reads, named pairs included (``(name, parameter)``: a held one was let through before,
    then refused at the next step, after the group was added)."""
    ours = ours_with(named(OPTIMIZERS["adamw_foreach"]) if form == "named" else OPTIMIZERS["adamw_foreach"])
    run(ours, range(2), new_trace())
    spell: dict[str, Callable[[torch.Tensor], Any]] = {
        "tensor": lambda p: p,
        "list": lambda p: [p],
        "generator": lambda p: (q for q in [p]),
        "named": lambda p: [("p", p)],
    }
    with pytest.raises(ValueError, match=r"^some parameters appear in more than one parameter group$"):
        ours.optimizer.add_param_group({"params": spell[form](ours.model.head.weight)})
    assert len(ours.optimizer.param_groups) == 1
    extra = nn.Parameter(torch.ones(3, dtype=torch.float16))
    ours.optimizer.add_param_group({"params": spell[form](extra), "lr": 0.0})
    assert ours.optimizer.param_groups[-1]["params"] == [extra]
    ours.scaler.scale((extra.float().sum() + ours.model(data(1)[0][0], 0).float().sum()) * 0).backward()
    ours.scaler.step(ours.optimizer)
    assert any(low is extra for low, _ in ours.scaler.master_weights(ours.optimizer))


def test_a_held_float16_parameter_put_back_into_the_groups_by_hand_is_refused_at_the_next_step() -> None:
    ours = ours_with(OPTIMIZERS["adamw_foreach"])
    run(ours, range(2), new_trace())
    ours.optimizer.param_groups[0]["params"].append(ours.model.head.weight)
    with pytest.raises(
        ValueError, match=r"holds one parameter twice, as its float32 master and as .*\[0\]\['params'\]"
    ):
        run(ours, range(2, 3), new_trace())


# 2. A checkpoint taken while a trained block is frozen --------------------------------------------------------

FROZEN = range(4, 9)  # expert 0 trains, is frozen at iteration 4 (a checkpoint at 6), trains again from 9
ADAGRAD: MakeOptimizer = lambda p: torch.optim.Adagrad(p, lr=0.05)  # noqa: E731
FREEZE_OPTIMIZERS: dict[str, MakeOptimizer] = {
    "adamw_foreach": OPTIMIZERS["adamw_foreach"],
    "sgd_momentum_forloop": OPTIMIZERS["sgd_momentum_forloop"],
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adagrad": ADAGRAD,
}


def run_freezing(system: System, steps: range, trace: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``run``, with expert 0 frozen (``requires_grad_(False)``) over ``FROZEN``, as a schedule does."""
    for step in steps:
        system.model.experts[0].requires_grad_(step not in FROZEN)
        run(system, range(step, step + 1), trace)
    return trace


def resumed(name: str, blob: bytes, order: str) -> Ours:
    """A new process's run resumed from ``blob`` at iteration 6, expert 0 frozen as the schedule says.
    ``order``: the model's or the optimizer's checkpoint loaded first, before any step; or ``bound-*``:
    after an iteration that binds the optimizer's other masters and ends without a step."""
    system = ours_with(FREEZE_OPTIMIZERS[name], seed=9)
    system.model.experts[0].requires_grad_(False)
    if order.startswith("bound"):
        run(system, range(6, 7), new_trace(), pattern="no_step")  # 6 % 4 == 2: unscale_ + update only
    return load(system, blob, optimizer_first=order.endswith("optimizer-first"))  # type: ignore[return-value]


@pytest.mark.parametrize("order", ["model-first", "optimizer-first", "bound-model-first", "bound-optimizer-first"])
@pytest.mark.parametrize("name", list(FREEZE_OPTIMIZERS))
def test_a_checkpoint_taken_while_a_trained_block_is_frozen_resumes_as_the_recipe(name: str, order: str) -> None:
    ours, reference = both_with(FREEZE_OPTIMIZERS[name])
    trace, expected = run_freezing(ours, range(6), new_trace()), run_freezing(reference, range(6), new_trace())
    again = resumed(name, save(ours), order)
    low = again.model.experts[0].weight
    assert_same_trace(run_freezing(again, range(6, STEPS), trace), run_freezing(reference, range(6, STEPS), expected))
    assert_same_state(again.optimizer, reference.optimizer)
    assert any(p is low for p, _ in again.scaler.master_weights(again.optimizer))


def test_a_block_frozen_from_the_start_gets_no_master_even_with_adagrads_constructed_state() -> None:
    """The promise for LoRA on a float16 base stands: a frozen parameter never stepped gets no master."""
    model = Experts()
    model.experts[0].requires_grad_(False)
    optimizer = ADAGRAD(list(model.parameters()))
    assert model.experts[0].weight in optimizer.state  # Adagrad made state for it at construction
    ours = Ours.__new__(Ours)
    ours.model, ours.optimizer, ours.scaler = model, optimizer, GradScaler("cpu", master_weights=True, **SCALES)
    run(ours, range(2), new_trace())
    lows = [p for p, _ in ours.scaler.master_weights(optimizer)]
    assert lows and not any(p is model.experts[0].weight for p in lows)


# 3. A change of dtype is no write ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float", "bfloat16"])
def test_changing_the_models_dtype_keeps_the_masters_as_the_recipe_does(dtype: torch.dtype) -> None:
    ours, reference = both_with(OPTIMIZERS["adamw_foreach"])
    trace, expected = run(ours, range(6), new_trace()), run(reference, range(6), new_trace())
    for system in (ours, reference):  # the float16 layers, as model.to(dtype) converts them; the norm stays
        for module in (system.model.inp, system.model.experts, system.model.layerdrop, system.model.head):
            module.to(dtype)
        system.model.dtype = dtype
    assert_same_trace(run(ours, range(6, STEPS), trace), run(reference, range(6, STEPS), expected))
    assert_same_state(ours.optimizer, reference.optimizer)


# 4. State made at construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["forloop", "fused"])
def test_adagrads_initial_accumulator_is_built_in_float32_as_the_recipe_builds_it(fused: bool) -> None:
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = lambda p: torch.optim.Adagrad(  # noqa: E731
        p, lr=0.05, initial_accumulator_value=0.1, fused=fused
    )
    assert_same_run(*both_with(make))


# 6. A float32 parameter resumed from a float16 run's masters (peft loads adapters in float32) -------------


def test_a_float32_parameter_continues_from_a_saved_master_that_rounds_to_it() -> None:
    ours = ours_with(OPTIMIZERS["adamw_foreach"])
    run(ours, range(6), new_trace())
    masters = {id(low): master.detach().clone() for low, master in ours.scaler.master_weights(ours.optimizer)}
    expected = masters[id(ours.model.head.weight)]
    blob = save(ours)
    again = ours_with(OPTIMIZERS["adamw_foreach"], seed=9)
    again.model.head.float()  # as peft's load casts an adapter
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    again.model.load_state_dict(saved["model"])
    again.optimizer.load_state_dict(saved["optimizer"])
    assert not torch.equal(again.model.head.weight, expected)  # the float16 values: the test can fail
    with (
        torch.autocast("cpu", dtype=torch.float16),  # the float32 head computes in float16, as under the Trainer
        pytest.warns(
            ContinuedWarning,
            match=r"\['params'\]\[12\] \(shape \(4, 16\), torch.float32\) was float16 .*"
            r", and 1 more parameters: it continues .*param.data = param.data.half\(\)",
        ),
    ):
        run(again, range(6, 7), new_trace(), pattern="no_step")  # binds, steps nothing
    assert again.model.head.weight.dtype == torch.float32
    assert torch.equal(again.model.head.weight.detach(), expected)
    assert all(SAVED_KEY not in group for group in again.optimizer.param_groups)


def test_a_float32_parameter_keeps_its_values_where_the_saved_master_does_not_round_to_them() -> None:
    ours = ours_with(OPTIMIZERS["adamw_foreach"])
    run(ours, range(6), new_trace())
    saved = torch.load(io.BytesIO(save(ours)), weights_only=True)
    again = ours_with(OPTIMIZERS["adamw_foreach"], seed=9)
    again.model.head.float()
    again.model.load_state_dict(saved["model"])
    with torch.no_grad():
        again.model.head.weight.add_(1e-3)  # an edit since: the saved master belongs to another state
    edited = again.model.head.weight.detach().clone()
    again.optimizer.load_state_dict(saved["optimizer"])
    with torch.autocast("cpu", dtype=torch.float16), warnings.catch_warnings():
        warnings.simplefilter("error", ContinuedWarning)  # the bias continues (no edit), the weight must not
        with pytest.raises(ContinuedWarning, match=r"\['params'\]\[13\] \(shape \(4,\), torch.float32\) was "):
            run(again, range(6, 7), new_trace(), pattern="no_step")
    assert torch.equal(again.model.head.weight.detach(), edited)


def test_a_parameter_cast_back_to_float16_after_the_loads_resumes_bit_for_bit() -> None:
    """The line docs/integrations.md gives for peft's float32 cast: the adapter cast back to float16 after
    the loads and before the first step takes its master and float32 state exactly, without a warning."""
    ours = ours_with(OPTIMIZERS["adamw_foreach"])
    trace = run(ours, range(6), new_trace())
    blob = save(ours)
    expected = run(ours, range(6, STEPS), new_trace())
    again = ours_with(OPTIMIZERS["adamw_foreach"], seed=9)
    again.model.head.float()  # as peft's load casts an adapter
    load(again, blob)
    for param in again.model.head.parameters():
        param.data = param.data.half()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContinuedWarning)
        assert_same_trace(run(again, range(6, STEPS), new_trace()), expected)
    assert_same_state(again.optimizer, ours.optimizer)
    assert trace["params"]  # the first phase trained (applied steps from the first on)


# 6b. The same with float32 sums over micro-batches, from a checkpoint saved before any applied step ---------

PRE_STEP: dict[str, Any] = {"init_scale": 2.0**40, "backoff_factor": 2.0**-10, "growth_interval": 3}
# every step skipped until the scale reaches 2**10 (the fourth iteration): the masters still equal their parameters
MICRO = 3  # micro-batches per step: the scaler warns of hidden parameters only after two or more scaled graphs


def adapter_run(seed: int = 0, accumulate: bool = True) -> tuple[Experts, torch.optim.Optimizer, Any]:
    """The float16 ``Experts`` with only the head trained (an adapter over a frozen base); ``accumulate``:
    ``accumulate_grads_in_fp32``."""
    model = Experts(seed=seed)
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=accumulate, **PRE_STEP)
    return model, optimizer, scaler


def adapter_steps(system: tuple[Experts, torch.optim.Optimizer, Any], steps: range) -> None:
    """``MICRO`` micro-batches a step under float16 autocast (the float32 head computes in float16, as under the
    Trainer), then step, update and zero_grad."""
    model, optimizer, scaler = system
    batches = data(MICRO * (max(steps) + 1))
    for step in steps:
        for micro in range(MICRO):
            x, y = batches[MICRO * step + micro]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x, step).float() - y) ** 2).mean()
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def adapter_save(system: tuple[Experts, torch.optim.Optimizer, Any]) -> dict[str, Any]:
    model, optimizer, scaler = system
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, buffer
    )
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def adapter_resume(saved: dict[str, Any], float32: bool, accumulate: bool = True) -> tuple[Any, ...]:
    """A fresh run (another seed) loaded from ``saved``; ``float32``: its head cast to float32 before the loads,
    as peft's load casts an adapter."""
    system = adapter_run(seed=9, accumulate=accumulate)
    model, optimizer, scaler = system
    if float32:
        model.head.float()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    return system


def caught(action: Callable[[], None]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        action()
    return list(found)


@pytest.mark.parametrize("accumulate", [True, False], ids=["float32 sums", "float16 sums"])
@pytest.mark.parametrize("saved_at", ["before any applied step", "after applied steps"])
def test_float32_adapters_resumed_over_micro_batches_continue_with_one_continued_warning(
    saved_at: str, accumulate: bool
) -> None:
    """docs/integrations.md, 'PEFT adapters in float16': a float32 adapter resumed from a float16 run's checkpoint
    continues from its saved master with one ``ContinuedWarning``, not the warning of parameters hidden from the
    scaled graphs (issue 46 item 6: saved before any applied step, the master equals the float32 adapter, which
    was bound to it and counted as hidden; autograd had summed its micro-batches in float32, nothing lost)."""
    first = range(1) if saved_at == "before any applied step" else range(6)
    ours = adapter_run(accumulate=accumulate)
    adapter_steps(ours, first)
    masters = [master.detach().clone() for _, master in ours[2].master_weights(ours[1])]
    applied = not torch.equal(masters[0].half(), Experts(seed=0).head.weight)
    assert applied == (saved_at == "after applied steps")  # the test is where it says it is
    again = adapter_resume(adapter_save(ours), float32=True, accumulate=accumulate)
    found = caught(lambda: adapter_steps(again, range(len(first), len(first) + 1)))
    assert [w.category for w in found] == [ContinuedWarning], [str(w.message) for w in found]
    named = r"\['params'\]\[0\] \(shape \(4, 16\), torch.float32\) was float16 or bfloat16 .*, and 1 more parameters"
    assert re.search(named, str(found[0].message))
    head = again[0].head
    assert head.weight.dtype == torch.float32
    if saved_at == "before any applied step":  # that step skipped too: the head holds its saved master
        assert torch.equal(head.weight.detach(), masters[0]) and torch.equal(head.bias.detach(), masters[1])
    assert not caught(lambda: adapter_steps(again, range(len(first) + 1, len(first) + 3)))  # once


def test_a_checkpoint_without_saved_dtypes_continues_a_float32_adapter_equal_to_its_float16_master_warning() -> None:
    """A checkpoint of an earlier version names no dtype beside its masters (``dtypes``): a float32 adapter equal to
    its saved master, a float16 value, is taken as peft's cast of a float16 run's adapter (``checkpoint.narrowed``)."""
    ours = adapter_run()
    adapter_steps(ours, range(1))
    saved = adapter_save(ours)
    for group in saved["optimizer"]["param_groups"]:
        del group[SAVED_KEY]["dtypes"]
    again = adapter_resume(saved, float32=True)
    found = caught(lambda: adapter_steps(again, range(1, 2)))
    assert [w.category for w in found] == [ContinuedWarning], [str(w.message) for w in found]


def test_a_head_saved_in_float32_before_any_applied_step_resumes_in_float32_without_a_warning() -> None:
    """The head cast to float32 on a bound model (every step skipped, so its masters equal it), saved, resumed
    in float32 with float32 sums over micro-batches: it was float32 when saved, nothing is lost, nothing said."""
    ours = adapter_run()
    adapter_steps(ours, range(1))
    ours[0].head.float()
    adapter_steps(ours, range(1, 2))
    assert ours[2].get_scale() > 2.0**15  # every step skipped
    again = adapter_resume(adapter_save(ours), float32=True)
    assert not caught(lambda: adapter_steps(again, range(2, 3)))


def test_float32_adapters_cast_back_to_float16_resume_bit_for_bit_from_a_checkpoint_saved_before_any_step() -> None:
    """The recipe of docs/integrations.md with float32 sums over micro-batches, from a checkpoint saved before any
    applied step: the adapter cast back to float16 after the loads equals the uninterrupted run, in silence."""
    ours = adapter_run()
    adapter_steps(ours, range(1))
    saved = adapter_save(ours)
    again = adapter_resume(saved, float32=True)
    for param in again[0].head.parameters():
        param.data = param.data.half()
    adapter_steps(ours, range(1, 7))
    assert not torch.equal(ours[0].head.weight, saved["model"]["head.weight"])  # steps were applied
    assert not caught(lambda: adapter_steps(again, range(1, 7)))
    assert ours[2].get_scale() == again[2].get_scale()
    assert all(torch.equal(a, b) for a, b in zip(ours[0].head.parameters(), again[0].head.parameters(), strict=True))
    assert_same_state(again[1], ours[1])
    trained = [master for _, master in ours[2].master_weights(ours[1])]
    assert all(
        torch.equal(a, b) for a, b in zip(trained, [m for _, m in again[2].master_weights(again[1])], strict=True)
    )


# 7. torch.distributed.checkpoint's state-dict helpers -----------------------------------------------------


def test_get_optimizer_state_dict_is_refused_with_what_to_use_instead() -> None:
    ours = ours_with(OPTIMIZERS["adamw_foreach"])
    run(ours, range(2), new_trace())
    with pytest.raises(
        ValueError, match=r"^Save and load optimizer.state_dict\(\).*MixedPrecisionPolicy.*master_weights=True"
    ):
        get_optimizer_state_dict(ours.model, ours.optimizer)
    assert SAVED_KEY in ours.optimizer.state_dict()["param_groups"][0]  # the plain state dict still works


def test_get_optimizer_state_dict_of_an_optimizer_without_masters_still_works() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = GradScaler("cpu", master_weights=True)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert set(get_optimizer_state_dict(model, optimizer)["state"]) == {"weight", "bias"}
