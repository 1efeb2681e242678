"""The whole training step compiled with inductor (torch.compile's default backend, which builds C++ on the
CPU: the slowest compiles of the suite), bit for bit against torch's scaler compiled the same way, on
three loop shapes. (aot_eager, which traces what inductor traces, covers every shape in
``tests/test_compiled.py``.)"""

from __future__ import annotations

import pytest

from compiled_runs import assert_same, compiled_run
from gradscaler.tools.compiled_step import Shape


@pytest.mark.parametrize(
    "shape", [Shape(), Shape(fused=True, clip="unscale"), Shape(masters=True)], ids=lambda s: s.name
)
def test_inductor_steps_bit_identically_to_torchs_scaler(shape: Shape) -> None:
    theirs, _ = compiled_run(shape, ours=False, steps=12, backend="inductor")
    ours, _ = compiled_run(shape, ours=True, steps=12, backend="inductor")
    assert_same(ours, theirs)
