"""The whole training step under ``torch.compile``: never worse than torch's scaler compiled the same way.

Counted, not timed, each against torch's scaler in the same test: recompiles over the steps of a run in
which the scale grows and backs off and the clipping norm changes every step (Dynamo's recompile log),
and the state the run leaves, bit for bit. Loop shapes and the recipe by hand for float16 parameters:
``gradscaler.tools.compiled_step``. ``aot_eager`` traces exactly what inductor traces (Dynamo decides
breaks and guards before any backend runs) without a C compiler's minutes; graph breaks are counted in
``tests/test_compiled_breaks.py`` and inductor's bits in ``tests/test_compiled_inductor.py``.

Each compiled run (a loop shape, our scaler or torch's) is made once for this file
(``compiled_runs``) and read by every test that needs it: compiling costs more than the steps.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from compiled_runs import assert_same, compiled_run
from gradscaler import GradScaler, patch_torch, unpatch_torch
from gradscaler.tools.compiled_step import SHAPES, Shape, build, drive, inputs, recompiles

STEPS = 40
"""With ``growth_interval=4`` and an overflow every 9 steps, 40 steps grow the scale 8 times and back it
off 4 times, and every value the step reads (scale, growth tracker, norm) changes several times; a
recompile comes at the first change of a guarded value. ``benchmarks/compile_counts.py`` counts 200."""
Runs = Callable[[Shape, bool], tuple[list[torch.Tensor], list[str]]]


@pytest.fixture(scope="module")
def compiled_runs() -> Runs:
    """``compiled_runs(shape, ours)``: ``compiled_run`` of ``STEPS`` aot_eager steps, made once per file."""
    made: dict[tuple[Shape, bool], tuple[list[torch.Tensor], list[str]]] = {}

    def get(shape: Shape, ours: bool) -> tuple[list[torch.Tensor], list[str]]:
        if (shape, ours) not in made:
            made[shape, ours] = compiled_run(shape, ours, STEPS)
        return made[shape, ours]

    return get


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_no_recompile_and_same_bits(shape: Shape, compiled_runs: Runs) -> None:
    theirs, their_recompiles = compiled_runs(shape, False)
    ours, our_recompiles = compiled_runs(shape, True)
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
    """The steps above are the ones the issue asks for: the scale grows and backs off, several times."""
    run = build(SHAPES[0], ours=True)
    drive(run, inputs(STEPS), None)
    stats = run.scaler.stats()
    assert stats["growths"] >= 8 and stats["backoffs"] >= 4, stats


@pytest.mark.parametrize("shape", [Shape(), Shape(clip="unscale"), Shape(fused=True)], ids=lambda s: s.name)
def test_compiled_run_equals_eager_run_where_torchs_does(shape: Shape, compiled_runs: Runs) -> None:
    """Ours compiled equals ours eager exactly when torch's compiled equals torch's eager (tracing can
    decompose the optimizer's or the clip's ops, and then both move by ulps)."""
    same = {}
    for ours in (False, True):
        eager = build(shape, ours)
        drive(eager, inputs(STEPS), None)
        compiled, _ = compiled_runs(shape, ours)
        same[ours] = all(torch.equal(a, b) for a, b in zip(compiled, eager.state(), strict=True))
    assert same[True] == same[False]


def test_patch_torch_compiles_like_torchs_scaler(compiled_runs: Runs) -> None:
    """Under ``patch_torch()`` torch's own spelling builds our scaler, and the step compiles the same."""
    theirs, _ = compiled_runs(Shape(clip="unscale"), False)
    patch_torch()
    try:
        torch._dynamo.reset()
        run = build(Shape(clip="unscale"), ours=False)
        assert isinstance(run.scaler, GradScaler)
        with recompiles() as messages:
            drive(run, inputs(STEPS), "aot_eager")
        assert messages == []
        assert_same(run.state(), theirs)
    finally:
        unpatch_torch()
