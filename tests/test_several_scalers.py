"""Several scalers, or several optimizers, over one model's float16 parameters with master weights: a GAN
with a scaler per network or one for both, G stepped before D or after, each network's scaler summing in
float32 or not, and a scaler switched for another; all against the recipe by hand (tests/recipe.py's
copies, torch's scalers: tests/gan_recipe.py), bit for bit.

The rule under test: a scaler's hooks belong to the parameters its optimizers step. A hook a scaler made
from its scaled graph on another network's parameter (G's loss runs through D) never takes over the hook
D's scaler bound, and is given up when D's own scaler binds D; ``optimizer.zero_grad()`` clears a sum a
hook holds before its binding, as the recipe's ``zero_grad`` clears its copies."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

from gan_recipe import DTYPE, SCALER_ARGS, Gan, Ours, Recipe, adamw, data, networks
from gradscaler import GradScaler
from recipe import Copies, Fp32Copies


def train(
    system: Gan, steps: range, order: str, micro: int, zero: bool = True, late: bool = False
) -> list[list[torch.Tensor]]:
    """``order``: "GD" steps G first; "DG" steps D first. Each side: zero_grad (unless ``zero`` is False),
    ``micro`` backwards, step, and its scaler's update at once, or with ``late`` (and with one shared
    scaler) after both steps."""
    trace = []
    for step in steps:
        for side in order:
            if zero:
                system.zero_grad(side)
            for k in range(micro):
                system.backward(side, system.loss(side, step, k, micro))
            system.step(side)
            if not (system.shared or late):
                system.update(side)
        for side in [] if not (system.shared or late) else ["G"] if system.shared else list(order):
            system.update(side)
        trace.append(system.weights())
    return trace


def assert_same(ours: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> None:
    """Equal bit for bit at every step, and every step trained (a skipped step compares nothing)."""
    assert len(ours) == len(reference)
    initial = [p.detach() for net in networks() for p in net.parameters()]
    for before, after in zip([initial, *reference], reference, strict=False):
        assert differs([before], [after]), "a step of the recipe applied nothing"
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {step}, parameter {index}: {(x.float() - y.float()).abs().max()}"


def differs(ours: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> bool:
    return any(not torch.equal(x, y) for a, b in zip(ours, reference, strict=True) for x, y in zip(a, b, strict=True))


SETTINGS = {
    "both sum in float32": {"G": True, "D": True},
    "G sums in float32, D not": {"G": True, "D": False},
    "D sums in float32, G not": {"G": False, "D": True},
}


@pytest.mark.parametrize("late", [False, True], ids=["each updated after its step", "both updated at the end"])
@pytest.mark.parametrize("order", ["GD", "DG"])
@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_scaler_per_network_equals_the_recipe(setting: str, micro: int, order: str, late: bool) -> None:
    """Each network's scaler keeps its own parameters' hooks: G's first iteration, whose scaled graph runs
    through D, neither takes D's bound hooks over nor releases them at its update (D stepped and updated
    first: every later D step was refused, "written by hand"), and a hook G's scaler made on D's parameter
    before D's scaler bound them gives way to D's (G stepped first, D's scaler without float32 sums: D's
    first step applied nothing)."""
    accumulate = SETTINGS[setting]
    ours = train(Ours(accumulate, shared=False), range(4), order, micro, late=late)
    assert_same(ours, train(Recipe(accumulate, shared=False), range(4), order, micro, late=late))


@pytest.mark.parametrize("order", ["GD", "DG"])
@pytest.mark.parametrize("micro", [1, 3])
def test_one_scaler_for_both_networks_equals_the_recipe(micro: int, order: str) -> None:
    """One scaler with float32 sums: G stepped first leaves sums of G's backward in D's hooks before D is
    bound; D's ``zero_grad`` clears them, as the recipe's clears D's copies (they were stepped with D's
    first step, 0.02 off, and the runs never rejoined)."""
    accumulate = {"G": True, "D": True}
    ours = train(Ours(accumulate, shared=True), range(4), order, micro)
    assert_same(ours, train(Recipe(accumulate, shared=True), range(4), order, micro))


@pytest.mark.parametrize("shared", [True, False], ids=["one scaler", "a scaler each"])
def test_a_loop_that_never_clears_d_adds_g_s_gradients_in_as_the_recipe_does(shared: bool) -> None:
    """Without D's ``zero_grad`` the sums of G's backwards through D stay in D's and are stepped with D's,
    in the first iteration as in the others (the comparison's power: with the clearing the runs differ)."""
    accumulate = {"G": True, "D": True}
    ours = train(Ours(accumulate, shared), range(3), "GD", 2, zero=False)
    reference = train(Recipe(accumulate, shared), range(3), "GD", 2, zero=False)
    assert_same(ours, reference)
    assert differs(ours, train(Recipe(accumulate, shared), range(3), "GD", 2))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_before_the_binding_clears_the_hooks_sum_either_way(set_to_none: bool) -> None:
    """A backward, ``zero_grad`` (to None or to zeros), a backward, the step: the step sees the second
    backward's gradient alone, as the recipe's copies do."""
    model = nn.Linear(4, 3).to(DTYPE)
    reference = nn.Linear(4, 3).to(DTYPE)
    reference.load_state_dict(model.state_dict())
    optimizer = adamw(model.parameters())
    scaler = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, **SCALER_ARGS)
    copies = Fp32Copies(reference.parameters())
    recipe_optimizer, recipe_scaler = adamw(copies.params()), torch.amp.GradScaler("cpu", **SCALER_ARGS)
    for k in range(2):
        x = data(0, k)[0]
        scaler.scale(model(x).float().square().mean()).backward()
        recipe_scaler.scale(reference(x).float().square().mean()).backward()
        copies.accumulate()
        if k == 0:
            optimizer.zero_grad(set_to_none)
            recipe_optimizer.zero_grad(set_to_none)
    scaler.step(optimizer)
    scaler.update()
    copies.move_grads()
    recipe_scaler.step(recipe_optimizer)
    recipe_scaler.update()
    copies.copy_back()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dropped", [False, True], ids=["the first kept", "the first dropped"])
@pytest.mark.parametrize("micro", [1, 3])
def test_float32_sums_switched_off_by_a_new_scaler_train_from_its_first_step(dropped: bool, micro: int) -> None:
    """A scaler with float32 sums, then a new one without them over the same optimizer, the first's state
    loaded: the new one's first binding removes the first's hooks (they kept taking every gradient: nothing
    trained while the first lived). Its first iteration steps the float32 sum rounded once to float16, where
    the recipe's autograd rounded at each add: equal with one micro-batch, within rounding with several,
    and the recipe's from the next iteration on."""
    model, _ = networks()
    reference, _ = networks()
    optimizer = adamw(model.parameters())
    first = GradScaler("cpu", master_weights=True, accumulate_grads_in_fp32=True, **SCALER_ARGS)
    fp32 = Fp32Copies(reference.parameters())
    recipe_optimizer, recipe_scaler = adamw(fp32.params()), torch.amp.GradScaler("cpu", **SCALER_ARGS)

    def iteration(step: int, scaler: Any, copies: Copies) -> None:
        optimizer.zero_grad()
        recipe_optimizer.zero_grad()
        for k in range(micro):
            z = data(step, k)[0]
            scaler.scale(model(z).float().square().mean() / micro).backward()
            recipe_scaler.scale(reference(z).float().square().mean() / micro).backward()
            if isinstance(copies, Fp32Copies):
                copies.accumulate()
        scaler.step(optimizer)
        scaler.update()
        copies.move_grads()
        recipe_scaler.step(recipe_optimizer)
        if not sum(flag.item() for flag in recipe_scaler._found_inf_per_device(recipe_optimizer).values()):
            copies.copy_back()
        recipe_scaler.update()

    for step in range(3):
        iteration(step, first, fp32)
    second = GradScaler("cpu", master_weights=True, **SCALER_ARGS)
    second.load_state_dict(first.state_dict())
    if dropped:
        del first
        gc.collect()
    plain = Copies([])
    plain.pairs = fp32.pairs  # the same copies, moved at the step from now on
    before = [p.detach().clone() for p in model.parameters()]
    iteration(3, second, plain)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing trained"
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        if micro == 1:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2)
    assert all(p.grad is None for p in model.parameters())


def critic_loop(system: Gan, steps: range, critic: int, g_first: bool) -> list[list[torch.Tensor]]:
    """WGAN's shape: D stepped ``critic`` times per G step, a scaler each (updated after each step), D alone
    in the first iteration (a warm-up); with ``g_first`` G's backward runs before D's steps and G steps after
    them."""
    trace = []
    for step in steps:
        generator = step > 0
        system.zero_grad("G")
        if g_first and generator:
            system.backward("G", system.loss("G", step, 0, 1))
        for k in range(critic):
            system.zero_grad("D")
            system.backward("D", system.loss("D", step, k + 1, 1))
            system.step("D")
            system.update("D")
        if generator:
            if not g_first:
                system.backward("G", system.loss("G", step, 0, 1))
            system.step("G")
            system.update("G")
        trace.append(system.weights())
    return trace


@pytest.mark.parametrize("g_first", [False, True], ids=["G after the critic", "G's backward before the critic"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_critic_stepped_several_times_per_generator_step_equals_the_recipe(setting: str, g_first: bool) -> None:
    """G's scaler hooks D's parameters from its first graph while D's scaler, which bound them, goes on
    stepping: D's ``zero_grad`` clears what G's backward left in those hooks, and D's moves without float32
    sums take the gradients back from them (found by tests/scalers_machine.py: D's second step applied only
    G's gradient, or none)."""
    accumulate = SETTINGS[setting]
    ours = critic_loop(Ours(accumulate, shared=False), range(4), 3, g_first)
    assert_same(ours, critic_loop(Recipe(accumulate, shared=False), range(4), 3, g_first))


def test_a_scaler_dropped_in_its_first_iteration_gives_back_what_its_hooks_hold() -> None:
    """A scaler with float32 sums whose graph met parameters another scaler's optimizer steps, dropped before
    its first ``update()``: the gradients its hooks held go back into ``p.grad`` (they were lost: its hooks
    stopped working with it), so the other scaler steps them as autograd left them."""
    accumulate = {"G": False, "D": False}
    ours, reference = Ours(accumulate, shared=False), Recipe(accumulate, shared=False)
    for system in (ours, reference):
        system.backward("D", system.loss("D", 0, 0, 1))
        system.step("D")
        system.update("D")
    ours.switch("G", True)  # G's scaler now sums in float32; the plain one is dropped
    reference.switch("G", True)
    for system in (ours, reference):
        system.zero_grad("D")
        system.backward("G", system.loss("G", 1, 0, 1))  # G's new scaler hooks D's parameters too
    ours.switch("G", False)  # dropped in its first iteration, D's gradients in its hooks
    reference.switch("G", False)
    gc.collect()
    for system in (ours, reference):
        system.backward("D", system.loss("D", 1, 1, 1))
        system.step("D")
        system.update("D")
    assert_same([ours.weights()], [reference.weights()])
