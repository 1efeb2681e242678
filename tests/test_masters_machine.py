"""The master weights' state machine (tests/masters_machine.py) with a fixed seed and CI's budget.

``derandomize=True``: the same 60 sequences of up to 50 rules every run (about 1,500 rules, each on both
sides, each followed by the invariant). Measured on this 2-core machine, shared with four other jobs:
58 s of CPU time for 100 sequences (103 s wall under that load), so about 35 s for these 60; a run that
finds a defect takes longer, shrinking it. ``python tests/masters_soak.py --examples N --seed S`` runs more.
"""

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
