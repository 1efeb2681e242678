"""The whole training step under ``torch.compile``: never worse than torch's scaler compiled the same way.

Counted, not timed, each against torch's scaler in the same test: recompiles over 200 steps in which
the scale grows and backs off and the clipping norm changes every step (Dynamo's recompile log), graph
breaks and where they lie (``torch._dynamo.explain``), and the state the run leaves, bit for bit.
Loop shapes and the recipe by hand for float16 parameters: ``gradscaler.tools.compiled_step``.
``aot_eager`` traces exactly what inductor traces (Dynamo decides breaks and guards before any backend
runs) without a C compiler's minutes; inductor itself compares bits on two shapes.
"""

from __future__ import annotations

import re

import pytest
import torch

from gradscaler import GradScaler, patch_torch, unpatch_torch
from gradscaler.tools.compiled_step import SHAPES, Shape, breaks, build, drive, inputs, recompiles

STEPS = 200


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs: {(a.double() - b.double()).abs().max()}"


def compiled_run(
    shape: Shape, ours: bool, steps: int, backend: str = "aot_eager"
) -> tuple[list[torch.Tensor], list[str]]:
    torch._dynamo.reset()
    run = build(shape, ours)
    with recompiles() as messages:
        drive(run, inputs(steps), backend)
    return run.state(), list(messages)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_no_recompile_and_same_bits_over_200_steps(shape: Shape) -> None:
    theirs, their_recompiles = compiled_run(shape, ours=False, steps=STEPS)
    ours, our_recompiles = compiled_run(shape, ours=True, steps=STEPS)
    assert their_recompiles == []
    assert our_recompiles == [], our_recompiles[0]
    assert_same(ours, theirs)


def test_two_runs_compiled_in_one_process_keep_their_own_caches() -> None:
    """As ``gradscaler bench --sections compile`` runs them: torch's step and ours compiled side by side,
    called in turn. Each step has its own code object, so Dynamo keeps one cache entry on each; sharing
    one code object, they kept both entries in one cache, and each call looked through the other's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    shape = Shape(fused=True, clip="scaler")
    runs = [build(shape, ours) for ours in (False, True)]
    steps = [torch.compile(run.step, backend="eager") for run in runs]
    for x, bad in inputs(6, overflow_every=3):
        for step in steps:
            step(x, bad)
    codes = [run.step.__code__ for run in runs]
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [1, 1]  # shared: [2, 2]
    assert codes[0] is not codes[1]
    assert [code.co_name for code in codes] == ["step_torch", "step_gradscaler"]
    assert [run.scaler.get_scale() for run in runs] == [2.0**14] * 2  # both ran: two overflows, two backoffs


def test_the_run_moves_the_scale_both_ways() -> None:
    """The 200 steps above are the ones the issue asks for: the scale grows and backs off."""
    run = build(SHAPES[0], ours=True)
    drive(run, inputs(STEPS), None)
    stats = run.scaler.stats()
    assert stats["growths"] > 10 and stats["backoffs"] > 10, stats


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_no_graph_break_inside_the_package(shape: Shape) -> None:
    """Each scaler call is one break at the call site, on purpose; no more than torch's scaler makes
    (``scaler.clip_grad_norm_`` is one call where torch's scaler needs two). Only one break lies inside
    the library, on purpose too: ``torch.nn.utils.clip_grad_norm_`` over float16 parameters finds their
    masters eagerly (then Dynamo compiles the rest, torch's clip, in that call's own frame), where the
    recipe by hand clips its copies without a break."""
    counted = {}
    for ours in (False, True):
        torch._dynamo.reset()
        counted[ours] = breaks(build(shape, ours), inputs(2))
    finding_masters = 1 if shape.masters and shape.clip == "unscale" else 0
    inside = [b for b in counted[True] if b.in_library]
    where = "masters/wrappers.py"  # stand_ins, the one eager call inside the library
    assert all(b.on_purpose and where in b.where for b in inside) and len(inside) == finding_masters, inside
    assert len(counted[True]) <= len(counted[False]) + finding_masters, (counted[True], counted[False])
    theirs = {b.reason for b in counted[False]}
    assert all(b.on_purpose for b in counted[True] if b.reason not in theirs), counted[True]


def test_each_scaler_call_breaks_for_the_documented_reason() -> None:
    """The reason Dynamo prints names this library's choice and where it is documented."""
    found = breaks(build(Shape(clip="scaler"), ours=True), inputs(2))
    named = [re.search(r"<function (\S+) at", b.explanation).group(1) for b in found if b.on_purpose]  # type: ignore[union-attr]
    assert named == ["GradScaler.scale", "GradScaler.clip_grad_norm_", "GradScaler.step", "GradScaler.update"]


@pytest.mark.parametrize(
    "shape", [Shape(), Shape(fused=True, clip="unscale"), Shape(masters=True)], ids=lambda s: s.name
)
def test_inductor_steps_bit_identically_to_torchs_scaler(shape: Shape) -> None:
    theirs, _ = compiled_run(shape, ours=False, steps=12, backend="inductor")
    ours, _ = compiled_run(shape, ours=True, steps=12, backend="inductor")
    assert_same(ours, theirs)


@pytest.mark.parametrize("shape", [Shape(), Shape(clip="unscale"), Shape(fused=True)], ids=lambda s: s.name)
def test_compiled_run_equals_eager_run_where_torchs_does(shape: Shape) -> None:
    """Ours compiled equals ours eager exactly when torch's compiled equals torch's eager (tracing can
    decompose the optimizer's or the clip's ops, and then both move by ulps)."""
    same = {}
    for ours in (False, True):
        eager = build(shape, ours)
        drive(eager, inputs(30), None)
        torch._dynamo.reset()
        compiled = build(shape, ours)
        drive(compiled, inputs(30), "aot_eager")
        same[ours] = all(torch.equal(a, b) for a, b in zip(compiled.state(), eager.state(), strict=True))
    assert same[True] == same[False]


def test_patch_torch_compiles_like_torchs_scaler() -> None:
    """Under ``patch_torch()`` torch's own spelling builds our scaler, and the step compiles the same."""
    theirs, _ = compiled_run(Shape(clip="unscale"), ours=False, steps=40)
    patch_torch()
    try:
        torch._dynamo.reset()
        run = build(Shape(clip="unscale"), ours=False)
        assert isinstance(run.scaler, GradScaler)
        with recompiles() as messages:
            drive(run, inputs(40), "aot_eager")
        assert messages == []
        assert_same(run.state(), theirs)
    finally:
        unpatch_torch()


def test_eager_scaler_methods_run_eagerly_inside_compiled_code() -> None:
    """What ``compiled.eager`` promises: the method body never runs under tracing."""
    seen: list[bool] = []
    scaler = GradScaler("cpu")
    scaler.add_logger(lambda stats: seen.append(torch.compiler.is_compiling()))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="aot_eager")
    def step(x: torch.Tensor) -> None:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(3):
        step(torch.randn(2, 4))
    assert seen == [False, False, False]
