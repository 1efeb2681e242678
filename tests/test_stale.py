"""An interrupted iteration: a retried step steps the gradients as they are; a new backward is unscaled once.

Each scenario runs twice from the same seed, once interrupted and once not, and the parameters and
optimizer state must be bit-identical. The interruptions: an exception between ``unscale_`` (or
``clip_grad_norm_``) and ``step`` after which the loop goes on with a new backward (issue 20, item 10:
torch steps gradients still multiplied by the scale), and an exception inside ``optimizer.step``
after which the step is retried directly or the iteration is run again (items 9(a), 9(b)).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from gradscaler import GradScaler
from gradscaler.stale import GradSnapshot, leaves
from helpers import assert_same_state, make_model, make_optimizer, optimizer_state

OPTIMIZERS = [(name, mode) for name in ("sgd", "adamw") for mode in ("forloop", "foreach", "fused")]
OPTIMIZER_IDS = [f"{name}-{mode}" for name, mode in OPTIMIZERS]
PREPARE = ["none", "unscale", "unscale_torch_clip", "clip"]


class Interrupt(Exception):
    """Stands for a KeyboardInterrupt or an error in the user's code between two scaler calls."""


def loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return nn.functional.mse_loss(model(x), y)


def prepare(scaler: GradScaler, opt: torch.optim.Optimizer, model: nn.Module, how: str, max_norm: float) -> None:
    """What the loop does between backward and step."""
    if how == "unscale":
        scaler.unscale_(opt)
    elif how == "unscale_torch_clip":
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    elif how == "clip":
        scaler.clip_grad_norm_(opt, max_norm)


def train(
    name: str,
    mode: str,
    how: str,
    *,
    set_to_none: bool = True,
    interrupt: str | None = None,
    init_scale: float = 2.0**10,
    max_norm: float = 0.5,
) -> tuple[list[torch.Tensor], dict]:
    """Three iterations; at the second, ``interrupt`` says what goes wrong and how the loop goes on."""
    model = make_model("mlp")
    opt = make_optimizer(name, mode, model.parameters())
    scaler = GradScaler("cpu", init_scale=init_scale)
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss(model, step)).backward()
        prepare(scaler, opt, model, how, max_norm)
        if step == 1 and interrupt == "before_step":  # an Interrupt here; the loop runs the iteration again
            opt.zero_grad(set_to_none=set_to_none)
            scaler.scale(loss(model, step)).backward()
            prepare(scaler, opt, model, how, max_norm)
        if step == 1 and interrupt == "before_step_scale_first":  # the same, with zero_grad after scale()
            scaled = scaler.scale(loss(model, step))
            opt.zero_grad(set_to_none=set_to_none)
            scaled.backward()
            prepare(scaler, opt, model, how, max_norm)
        if step == 1 and interrupt in ("in_step_retry", "in_step_new_backward"):
            real = opt.step

            def fail(*args: object, **kwargs: object) -> None:
                raise Interrupt

            opt.step = fail  # type: ignore[method-assign]
            with pytest.raises(Interrupt):
                scaler.step(opt)
            opt.step = real  # type: ignore[method-assign]
            if interrupt == "in_step_new_backward":
                opt.zero_grad(set_to_none=set_to_none)
                scaler.scale(loss(model, step)).backward()
                prepare(scaler, opt, model, how, max_norm)
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], optimizer_state(opt)


def assert_same_run(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.isfinite(x).all()
        assert torch.equal(x, y)
    assert_same_state(a[1], b[1], "optimizer state")


@pytest.mark.parametrize(("name", "mode"), OPTIMIZERS, ids=OPTIMIZER_IDS)
@pytest.mark.parametrize("how", [h for h in PREPARE if h != "none"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
@pytest.mark.parametrize("interrupt", ["before_step", "before_step_scale_first"], ids=["zero_first", "scale_first"])
def test_a_new_backward_after_an_interrupted_unscale_is_unscaled_once(
    name: str, mode: str, how: str, set_to_none: bool, interrupt: str
) -> None:
    """Item 10: unscale_, an interrupt before step, zero_grad and a new backward: stepped once unscaled; also
    with ``zero_grad`` between ``scale()`` and the backward (it was refused as a sum onto unscaled gradients)."""
    interrupted = train(name, mode, how, set_to_none=set_to_none, interrupt=interrupt)
    assert_same_run(interrupted, train(name, mode, how, set_to_none=set_to_none))


@pytest.mark.parametrize(("name", "mode"), OPTIMIZERS, ids=OPTIMIZER_IDS)
@pytest.mark.parametrize("how", PREPARE)
@pytest.mark.parametrize("retry", ["in_step_retry", "in_step_new_backward"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
def test_an_exception_inside_optimizer_step_changes_nothing(
    name: str, mode: str, how: str, retry: str, set_to_none: bool
) -> None:
    """A direct retry steps the gradients as they were (unscaled, clipped); a new backward is unscaled once."""
    interrupted = train(name, mode, how, set_to_none=set_to_none, interrupt=retry)
    assert_same_run(interrupted, train(name, mode, how, set_to_none=set_to_none))


@pytest.mark.parametrize(("name", "mode"), OPTIMIZERS, ids=OPTIMIZER_IDS)
@pytest.mark.parametrize(
    ("init_scale", "max_norm"), [(2.0**10, 0.0), (3.0, 0.5), (3.0, 0.0)], ids=["clip_to_zero", "inexact", "both"]
)
def test_a_retried_step_after_clipping_is_exact(name: str, mode: str, init_scale: float, max_norm: float) -> None:
    """Items 9(a), 9(b): max_norm=0 (a factor of 0) and clip_coef / S not a power of two survive a retry."""
    kwargs = {"init_scale": init_scale, "max_norm": max_norm}
    interrupted = train(name, mode, "clip", interrupt="in_step_retry", **kwargs)
    assert_same_run(interrupted, train(name, mode, "clip", **kwargs))


def test_the_issue_example_no_longer_steps_scaled_gradients() -> None:
    """Item 10 as reported: SGD lr 0.1 moved a parameter from 1 to -6552.6."""
    param = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(param * 1.0).backward()
    scaler.unscale_(opt)  # ... and an interrupt here
    opt.zero_grad()
    scaler.scale(param * 1.0).backward()
    scaler.step(opt)
    scaler.update()
    assert param.item() == pytest.approx(0.9, rel=1e-6)


def two_model_step(interleaved: bool, clip: bool, cls: type = GradScaler) -> list[torch.Tensor]:
    """Two models, two losses; ``unscale_(opts[0])`` before (interleaved) or after the second backward."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2), nn.Linear(4, 2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    scaler = cls("cpu", init_scale=2.0**8)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    scaler.scale(models[0](x).square().sum()).backward()
    if interleaved:
        scaler.unscale_(opts[0])
    scaler.scale(models[1](x).square().sum()).backward()  # writes only the second model's gradients
    if not interleaved:
        scaler.unscale_(opts[0])
    if clip:
        scaler.clip_grad_norm_(opts[0], 0.5)  # writes the first model's gradients in place
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale_then_clip"])
def test_a_backward_that_leaves_an_unscaled_optimizer_alone_is_not_stale(clip: bool) -> None:
    """unscale_(opt0); scale(loss1).backward() through the other model only; step(opt0): no second unscale."""
    expected = two_model_step(interleaved=False, clip=clip)
    for a, b in zip(two_model_step(interleaved=True, clip=clip), expected, strict=True):
        assert torch.equal(a, b)
    if not clip:  # and as torch's scaler steps it
        for a, b in zip(two_model_step(True, False, torch.amp.GradScaler), expected, strict=True):
            assert torch.equal(a, b)


def test_the_standard_recipe_with_torchs_clip_is_not_stale() -> None:
    """unscale_, torch.nn.utils.clip_grad_norm_ (which moves the version counters), step: as torch does."""
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        model = make_model("mlp")
        opt = make_optimizer("sgd", "foreach", model.parameters())
        scaler = cls("cpu", init_scale=2.0**10)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(loss(model, step)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_clip_called_again_on_the_same_gradients_is_refused() -> None:
    """After an exception inside optimizer.step the clip stands: a second clip would clip twice."""
    model = make_model("mlp")
    opt = make_optimizer("sgd", "foreach", model.parameters())
    scaler = GradScaler("cpu")
    scaler.scale(loss(model, 0)).backward()
    scaler.clip_grad_norm_(opt, 0.5)
    with pytest.raises(TypeError):
        scaler.step(opt, fail=True)  # SGD.step takes no ``fail``: an error raised by optimizer.step
    with pytest.raises(RuntimeError, match="clip_grad_norm_\\(\\) has already been called"):
        scaler.clip_grad_norm_(opt, 0.5)


class TestGradSnapshot:
    def params(self) -> list[nn.Parameter]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(1))]
        for p in params[:2]:
            p.grad = torch.ones_like(p)
        return params

    def test_unchanged_gradients(self) -> None:
        params = self.params()
        assert not GradSnapshot(params).changed(params)

    def test_a_new_gradient_object(self) -> None:
        params = self.params()
        snapshot = GradSnapshot(params)
        params[1].grad = torch.ones(2)
        assert snapshot.changed(params)

    def test_an_in_place_write(self) -> None:
        params = self.params()
        snapshot = GradSnapshot(params)
        params[0].grad.zero_()
        assert snapshot.changed(params)

    def test_a_gradient_gained(self) -> None:
        params = self.params()
        snapshot = GradSnapshot(params)
        params[2].grad = torch.ones(1)
        assert snapshot.changed(params)

    def test_gradients_only_dropped_are_no_change(self) -> None:
        """A ``zero_grad`` with no backward after it: no backward drops a gradient, the record stands (torch's
        scaler steps what is left; the masters machine drew the difference, with float32 sums, where only the
        float32 layer's gradient was dropped by ``model.zero_grad()``)."""
        params = self.params()
        snapshot = GradSnapshot(params)
        params[0].grad = None
        assert not snapshot.changed(params)
        params[1].grad = None
        assert not snapshot.changed(params)
        params[1].grad = torch.ones(2)  # and then a backward
        assert snapshot.changed(params)

    def test_another_parameter_list(self) -> None:
        params = self.params()
        assert GradSnapshot(params).changed(params[:2])

    def test_a_parameter_added_since_counts_only_with_a_gradient(self) -> None:
        """``add_param_group`` between an interrupted step's ``scale()`` and its retry is no backward (the masters
        machine drew it: the retry was refused as a sum of unscaled and scaled gradients)."""
        params = self.params()
        snapshot = GradSnapshot(params[:2])
        params[2].grad = None
        assert not snapshot.changed(params)
        params[2].grad = torch.ones(1)
        assert snapshot.changed(params)

    def test_keeps_no_gradient_alive(self) -> None:
        params = self.params()
        ref = weakref.ref(params[0].grad)
        snapshot = GradSnapshot(params)
        params[0].grad = None
        gc.collect()
        assert ref() is None
        params[0].grad = torch.ones(3)  # a new one, even at the old one's address
        assert snapshot.changed(params)


@pytest.mark.parametrize("outputs", ["tensor", "list"])
def test_the_hook_sits_on_the_scaled_outputs_only_after_an_interrupted_iteration(outputs: str) -> None:
    """A normal loop's scaled loss carries no hook; after an interrupted ``unscale_`` each scaled output does, and
    the backward through any of them tells the snapshot once."""
    model = make_model("mlp")
    opt = make_optimizer("sgd", "foreach", model.parameters())
    scaler = GradScaler("cpu")

    def scaled() -> list[torch.Tensor]:
        out = loss(model, 0)
        return [scaler.scale(out)] if outputs == "tensor" else scaler.scale([out, out * 2])

    assert all(not t._backward_hooks for t in scaled())
    scaler.scale(loss(model, 0)).backward()
    scaler.unscale_(opt)  # ... and an interrupt
    again = scaled()
    assert all(len(t._backward_hooks) == 1 for t in again)
    opt.zero_grad()
    sum(again).backward()  # type: ignore[union-attr]
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def gan_order(zero_second_first: bool, interrupt: bool = True) -> list[torch.Tensor]:
    """Two optimizers, a backward each, each ``zero_grad`` just before its own backward (DCGAN's order), both
    unscaled on a logging iteration that an exception interrupts; the next iteration steps both."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 1), nn.Linear(4, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 4)
    for logged in (True, False) if interrupt else (False,):
        if zero_second_first:
            opts[1].zero_grad()
        for opt, model in zip(opts, models, strict=True):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
        if logged:
            for opt in opts:
                scaler.unscale_(opt)
            continue  # an exception here
        for opt in opts:
            scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for m in models for p in m.parameters()]


def test_each_optimizers_snapshot_is_taken_when_its_own_backward_begins() -> None:
    """DCGAN's order after an interrupted iteration: the second optimizer's ``zero_grad`` comes after the first
    backward, and its snapshot is taken when the backward that reaches its parameters begins (it was taken at the
    first backward, before that ``zero_grad``, and the step was refused as a mixed sum)."""
    expected = gan_order(zero_second_first=False, interrupt=False)
    for zero_second_first in (False, True):
        for a, b in zip(gan_order(zero_second_first), expected, strict=True):
            assert torch.equal(a, b)


def test_leaves_are_the_tensors_a_backward_accumulates_into() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    frozen = nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3, requires_grad=True)
    out = model(frozen(x)).sum()
    assert leaves(out) == {id(p) for p in model.parameters()} | {id(x)}
    assert leaves(x) == {id(x)}


def test_an_in_place_zero_grad_with_no_backward_is_refused_and_steps_nothing() -> None:
    """docs/migration.md's remaining limit of the check after an interrupted iteration: a refusal (the MIXED
    error), never a step of what it cannot tell apart. If it is lifted, this test says so."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 4)
    scaler.scale(model(x).square().mean()).backward()
    scaler.unscale_(opt)  # ... and an interrupt
    scaler.scale(model(x).square().mean())  # a loss scaled, its backward never run
    opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="a later backward added scaled gradients"):
        scaler.step(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
