"""examples/distributed.py as README runs it (torchrun, 2 gloo processes): one line per rank a step, in
rank order, and every rank skips the step whose gradients overflowed on one of them."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
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
    lines = done.stdout.splitlines()
    if done.returncode != 0:
        # torch's gloo sometimes aborts a process at interpreter exit, after destroy_process_group, every line
        # printed ("terminate called without an active exception": 2 of 12 and 1 of 14 runs here; a barrier
        # before the teardown did not help): reported as dist_launch reports a rank's crash in teardown
        teardown = "terminate called without an active exception" in done.stderr and len(lines) == 2 * STEPS
        assert teardown, done.stderr[-3000:]
        warnings.warn(f"torchrun exited {done.returncode} after the run, in gloo's teardown", stacklevel=1)
    expected = [(rank, step) for step in range(STEPS) for rank in (0, 1)]
    found = [re.match(r"rank (\d) step (\d+): loss [\d.]+ norm (?:[\d.]+|inf) scale \d+( SKIPPED)?$", t) for t in lines]
    assert all(found), lines
    assert [(int(m[1]), int(m[2])) for m in found if m] == expected
    skipped = {(int(m[1]), int(m[2])) for m in found if m and m[3]}
    assert skipped == {(0, 5), (1, 5)}  # the inf injected on rank 1 at step 5
