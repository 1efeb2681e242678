"""The several-scalers state machine (tests/scalers_machine.py) with a fixed seed and CI's budget: a line on the
terminal every 100 sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from masters_machine import progress
from scalers_machine import ScalersMachine

EXAMPLES = 300
STEPS = 40


@pytest.fixture(autouse=True)
def progress_on_the_terminal(request: pytest.FixtureRequest):
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        yield
        return

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"  {line}")

    with progress(say, EXAMPLES, machine=ScalersMachine, name="scalers machine"):
        yield


class TestScalersMachine(ScalersMachine.TestCase):  # type: ignore[misc,name-defined]
    settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )

    def setUp(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def tearDown(self) -> None:
        torch.set_num_threads(self.threads)
