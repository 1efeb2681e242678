"""The several-scalers state machine (tests/scalers_machine.py) with a fixed seed and CI's budget: 300 sequences of
up to 40 rules (171 to 230 s in pytest on this 2-core machine at loads of 3 to 5), a line on the terminal every 100
sequences, on one torch thread."""

from __future__ import annotations

import pytest

from masters_machine import OneThread, ci_settings, terminal_progress
from scalers_machine import ScalersMachine

EXAMPLES = 300
STEPS = 40


@pytest.fixture(autouse=True)
def progress_on_the_terminal(request: pytest.FixtureRequest):
    with terminal_progress(request, EXAMPLES, machine=ScalersMachine, name="scalers machine"):
        yield


class TestScalersMachine(OneThread, ScalersMachine.TestCase):  # type: ignore[misc,name-defined]
    settings = ci_settings(EXAMPLES, STEPS)


@pytest.mark.parametrize("zeroed", [False, True], ids=["clean", "d_zeroed_in_place"])
def test_a_scaler_in_its_first_iteration_gives_back_what_it_summed_of_a_dropped_scalers_side(zeroed: bool) -> None:
    """``masters_soak.py --machine scalers --examples 300 --seed 15``, shrunk: D's scaler (float32 sums) dropped for
    one without, G's switched to one with sums; G's backward runs through D, whose parameters the new G scaler hooks
    in its first iteration (no live scaler holds them) and gives back at its update. Its hook took over the dropped
    D scaler's, master included, so it summed D's gradient into that master's ``.grad``, and gave nothing back: D's
    next step lost G's contribution (0.009 off the recipe)."""
    machine = ScalersMachine()
    machine.start(shared=False, d=True, g=False)
    rules: list[tuple[str, dict[str, object]]] = [("backward", {"count": 1, "side": "D"}), ("step", {"side": "D"})]
    rules += [("update", {"side": "D"})]
    if zeroed:  # D's float32 hook left mid-iteration (zeros), not fresh, when its scaler is dropped
        rules += [(name, {"side": "G"} | extra) for name, extra in (("backward", {"count": 1}), ("step", {}))]
        rules += [("update", {"side": "G"}), ("zero_grad", {"set_to_none": False, "side": "D"})]
    rules += [("switch", {"accumulate": True, "kept": False, "side": "G"})]
    rules += [("switch", {"accumulate": False, "kept": False, "side": "D"})]
    rules += [("backward", {"count": 1, "side": "G"}), ("step", {"side": "G"}), ("update", {"side": "G"})]
    rules += [("backward", {"count": 1, "side": "D"}), ("step", {"side": "D"})]
    for name, kwargs in rules:
        getattr(machine, name)(**kwargs)
        machine.same_as_the_recipe()
    machine.teardown()
