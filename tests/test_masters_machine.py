"""The master weights' state machine (tests/masters_machine.py) with a fixed seed and CI's budget.

``derandomize=True``: the same 300 sequences of up to 50 rules every run, each rule on both sides and followed by
the invariant: 38.9 s in pytest, 42 s wall and 42 s of CPU for this file on this 2-core machine at a load of 1.0;
with issue 35x's exclusions lifted, 32 to 54 s in pytest at loads of 1.6 to 3.7.
With issue 35's six fixes each reverted in turn, this budget finds five (docs/architecture.md: all but fix 5);
60 sequences found three. On one torch thread (set for this test, restored after): the machine's tensors are
tiny, and on a loaded machine two threads spend their time waiting for each other at every operation (the same 60
sequences at a load of 3.5: 5.3 s of CPU with one thread, 82 to 120 s with two). A run that finds a defect takes
longer, shrinking it. ``python tests/masters_soak.py --examples N --seed S`` runs more.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings

from masters_machine import MastersMachine

EXAMPLES = 300
STEPS = 50


class TestMastersMachine(MastersMachine.TestCase):  # type: ignore[misc,name-defined]
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
