"""``gradscaler bench --sections memory``: the measured bytes per parameter are what the storages hold."""

from __future__ import annotations

import pytest
import torch

from gradscaler.tools import memory
from gradscaler.tools.toy_model import TinyGPT

# (setup, optimizer) -> bytes per parameter of: parameters, gradients during the step, gradients after
# it, masters, and the optimizer's moments (AdamW two, SGD one momentum buffer, in the stepped dtype).
STRUCTURE = {
    ("float32 params + autocast", "AdamW"): (4, 4, 4, 0, 8),
    ("float32 params + autocast", "SGD momentum"): (4, 4, 4, 0, 4),
    ("float16 params + master weights", "AdamW"): (2, 2 + 4, 4, 4, 8),  # unscale_ keeps the float16 ones
    ("float16 params + master weights", "SGD momentum"): (2, 2 + 4, 4, 4, 4),
    ("float16 params, no masters (fused)", "AdamW"): (2, 2, 2, 0, 4),
    ("float16 params, no masters (fused)", "SGD momentum"): (2, 2, 2, 0, 2),
}


def test_structure_covers_every_row() -> None:
    assert set(STRUCTURE) == {(s, o) for s in memory.SETUPS for o in memory.OPTIMIZERS}


def test_a_storage_is_counted_once() -> None:
    base = torch.zeros(10, dtype=torch.float32)
    other = torch.zeros(3, dtype=torch.float16)
    seen: set[tuple[str, int]] = set()
    assert memory.storage_bytes([base, base[2:5], base.view(2, 5), None, other], seen) == 40 + 6
    assert memory.storage_bytes([base[1:], torch.zeros(2)], seen) == 8  # seen before: only the new one


@pytest.mark.parametrize(("setup", "optimizer"), list(STRUCTURE), ids=lambda v: v.replace(" ", "-"))
def test_measured_bytes_follow_the_structure(setup: str, optimizer: str) -> None:
    footprint = memory.measure(setup, optimizer, torch.device("cpu"), width=32, layers=1)
    params, in_step, after, masters, moments = STRUCTURE[(setup, optimizer)]
    assert footprint.params > 10_000
    assert footprint.param_bytes == params
    assert footprint.grad_bytes_in_step == in_step
    assert footprint.grad_bytes_after_step == after
    assert footprint.master_bytes == masters
    # Beyond the moments, AdamW keeps one 0-d step counter per parameter tensor: a few bytes each.
    tensors = len(list(TinyGPT(256, width=32, layers=1, heads=4, context=64).parameters()))
    extra = footprint.state_bytes - moments
    assert 0 <= extra <= (8 * tensors / footprint.params if optimizer == "AdamW" else 0)
    assert footprint.total_in_step == params + in_step + masters + footprint.state_bytes


def test_unknown_setup_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown setup 'int8'; choose from float32 params"):
        memory.measure("int8", "AdamW", torch.device("cpu"))
