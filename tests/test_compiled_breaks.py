"""Graph breaks of the whole training step under ``torch.compile`` (``torch._dynamo`` explains each): where
they lie and why, against torch's scaler compiled the same way; and the scaler's methods that run eagerly
on purpose never run under tracing. (Recompiles and bits: ``tests/test_compiled.py``.)"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from gradscaler import GradScaler, compiled
from gradscaler.masters import zeroing
from gradscaler.tools.compiled_step import SHAPES, Shape, breaks, build, inputs


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


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


@pytest.mark.parametrize("wrapped", [False, True], ids=["torch-zero_grad", "wrapped-zero_grad"])
def test_each_scaler_call_breaks_for_the_documented_reason(wrapped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason Dynamo prints names this library's choice and where it is documented. Once a hook held a
    float32 sum before its binding (any earlier test in this process), ``Optimizer.zero_grad`` is
    ``zeroing``'s wrapper: its one eager break stands in for the one of torch's method (``_disable_dynamo``),
    which it calls, so the count does not move."""
    compiled.prepare()  # as the first scaler does, before any hook can install the wrapper
    zero_grad = zeroing._zero_grad_optimizer if wrapped else zeroing._optimizer_zero_grad
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", zero_grad)
    found = breaks(build(Shape(clip="scaler"), ours=True), inputs(2))
    named = [re.search(r"<function (\S+) at", b.explanation).group(1) for b in found if b.on_purpose]  # type: ignore[union-attr]
    calls = ["GradScaler.scale", "GradScaler.clip_grad_norm_", "GradScaler.step", "GradScaler.update"]
    assert named == calls + (["_zero_grad_optimizer"] if wrapped else [])
    torch._dynamo.reset()
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", zeroing._optimizer_zero_grad)
    assert len(breaks(build(Shape(clip="scaler"), ours=True), inputs(2))) == len(found)


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


@pytest.mark.parametrize(("version", "direct"), [("2.5.1", False), ("2.7.1", False), ("2.8.0", True), ("2.13.0", True)])
def test_the_direct_call_needs_a_torch_whose_callback_reader_is_sound(
    version: str, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.6 and 2.7's ``get_eval_frame_callback`` returns a borrowed reference (each call takes one from the
    callback: a crash); 2.4 and 2.5 have none. Before 2.8 the marked methods keep torch's wrapper."""

    def method() -> str:
        return "called"

    disabled = torch.compiler.disable(method)
    monkeypatch.setattr(torch, "__version__", version)
    wrapper = compiled._direct_when_eager(method, disabled)
    assert (wrapper is not disabled) is direct
    assert wrapper() == "called" and wrapper._torchdynamo_disable  # type: ignore[attr-defined]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="None is immortal from Python 3.12: its count does not move")
def test_an_eager_call_takes_no_reference_from_the_callback() -> None:
    """The reader's result is a reference of our own: a thousand calls leave None's count where it was (torch
    2.6's borrowed one took a thousand)."""
    compiled.prepare()
    scaler = GradScaler("cpu")
    scaler.get_scale()
    before = sys.getrefcount(None)
    for _ in range(1000):
        scaler.get_scale()
    assert abs(sys.getrefcount(None) - before) < 100
