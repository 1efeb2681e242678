"""What tests/test_compiled*.py share: a compiled run of a loop shape and a bit-for-bit comparison."""

from __future__ import annotations

import torch

from gradscaler.tools.compiled_step import Shape, build, drive, inputs, recompiles


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs: {(a.double() - b.double()).abs().max()}"


def compiled_run(
    shape: Shape, ours: bool, steps: int, backend: str = "aot_eager"
) -> tuple[list[torch.Tensor], list[str]]:
    """The state ``shape`` leaves after ``steps`` compiled steps (from a reset Dynamo), and the recompile
    messages logged meanwhile."""
    torch._dynamo.reset()
    run = build(shape, ours)
    with recompiles() as messages:
        drive(run, inputs(steps), backend)
    return run.state(), list(messages)
