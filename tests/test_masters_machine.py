"""The master weights' state machine (tests/masters_machine.py) with a fixed seed and CI's budget."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from masters_machine import MastersMachine

EXAMPLES = 60
STEPS = 50

TestMastersMachine = MastersMachine.TestCase
TestMastersMachine.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
