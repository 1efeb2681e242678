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
