"""examples/distributed.py as README runs it (torchrun, 2 gloo processes): one line per rank a step, in
rank order, and every rank skips the step whose gradients overflowed on one of them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 7


@pytest.mark.distributed
def test_the_example_prints_one_line_per_rank_a_step_in_rank_order() -> None:
    """FSDP2 (the DDP mode prints through the same lines; each run costs about 30 s on a busy machine)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / "distributed.py"), "--mode", "fsdp2", "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    expected = [(rank, step) for step in range(STEPS) for rank in (0, 1)]
    found = [re.match(r"rank (\d) step (\d+): loss [\d.]+ norm (?:[\d.]+|inf) scale \d+( SKIPPED)?$", t) for t in lines]
    assert all(found), lines
    assert [(int(m[1]), int(m[2])) for m in found if m] == expected
    skipped = {(int(m[1]), int(m[2])) for m in found if m and m[3]}
    assert skipped == {(0, 5), (1, 5)}  # the inf injected on rank 1 at step 5
