"""Promises that hold under misuse: failed steps, failing callbacks, odd checkpoints, copies.

Each test here reproduces a defect found by attacking 0.1.0 (issue 13's D-numbers), and failed on it.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

from gradscaler import GradScaler, ScaleCollapseError
from gradscaler.rule import SCALE_FLOOR
from helpers import make_optimizer


def tiny(mode: str = "foreach", init_scale: float = 2.0**10) -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, make_optimizer("adamw", mode, model.parameters()), GradScaler("cpu", init_scale=init_scale)


def backward(model: nn.Module, scaler: GradScaler, seed: int = 0) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    scaler.scale(model(x).square().mean()).backward()


class FailOnce:
    """Wraps ``optimizer.step`` so that its first call raises."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.real, self.failed = optimizer, optimizer.step, False
        optimizer.step = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("optimizer failed")
        return self.real(*args, **kwargs)


def reference_weights(mode: str, clip: bool) -> torch.Tensor:
    model, opt, scaler = tiny(mode)
    opt.zero_grad()
    backward(model, scaler, seed=1)
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return model.weight.detach().clone()


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("retry", ["new_backward", "same_gradients"])
def test_a_retry_after_optimizer_step_raised_unscales_exactly_once(mode: str, clip: bool, retry: str) -> None:
    model, opt, scaler = tiny(mode)
    FailOnce(opt)
    backward(model, scaler, seed=0 if retry == "new_backward" else 1)
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    else:
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        scaler.step(opt)
    if retry == "new_backward":  # the user's loop: zero the gradients and run the iteration again
        opt.zero_grad()
        backward(model, scaler, seed=1)
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)  # same_gradients: a direct retry steps the unscaled (clipped) gradients as they are
    scaler.update()
    assert torch.equal(model.weight, reference_weights(mode, clip))


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, GradScaler], ids=["torch", "gradscaler"])
def test_a_fused_step_that_raised_leaves_no_grad_scale_behind(scaler_class: type) -> None:
    """torch's scaler sets ``grad_scale`` and ``found_inf`` on a fused optimizer and removes them only when
    ``optimizer.step`` returns: after a raise the stale ``grad_scale`` multiplies the next step's (the retry steps
    gradients divided by S**2), and a stale ``None`` (the raise came after ``unscale_``) makes every later step
    without ``unscale_`` raise TypeError. Ours removes them either way (docs/migration.md, What differs)."""

    def run(first: str, unscale: bool, scaler_class: type = scaler_class) -> torch.Tensor | None:
        """Two iterations; the first's step ``raises`` (retried without ``unscale_``), is ``clean`` or
        ``absent``; the second has no ``unscale_``. The weights after it, or None where it raised TypeError."""
        model, opt, _ = tiny("fused")
        scaler = scaler_class("cpu", init_scale=2.0**10)
        if first == "raises":
            FailOnce(opt)
        backward(model, scaler, seed=1)
        if unscale:
            scaler.unscale_(opt)
        if first != "absent":
            with contextlib.suppress(RuntimeError) if first == "raises" else contextlib.nullcontext():
                scaler.step(opt)
        if first == "raises" and not unscale:
            scaler.step(opt)  # the retry
        scaler.update()
        opt.zero_grad()
        backward(model, scaler, seed=2)
        try:
            scaler.step(opt)
        except TypeError:
            return None
        scaler.update()
        return model.weight.detach().clone()

    retried = run("raises", unscale=False)
    later = run("raises", unscale=True)
    assert retried is not None
    if scaler_class is GradScaler:
        assert torch.equal(retried, run("clean", unscale=False, scaler_class=torch.amp.GradScaler))
        assert later is not None
        assert torch.equal(later, run("absent", unscale=True, scaler_class=torch.amp.GradScaler))
    else:  # torch's defects, pinned so that a fixed torch is noticed
        assert not torch.equal(retried, run("clean", unscale=False))
        assert later is None


def test_an_error_raised_inside_update_leaves_a_scaler_that_goes_on() -> None:
    model, opt, scaler = tiny()
    calls = []

    def failing_logger(record: dict) -> None:
        calls.append(record)
        raise OSError("disk full")

    scaler.add_logger(failing_logger)
    backward(model, scaler)
    scaler.step(opt)
    with pytest.raises(OSError, match="disk full"):
        scaler.update()
    assert len(scaler._per_optimizer_states) == 0  # the iteration ended with the update
    copy.deepcopy(scaler)
    backward(model, scaler)
    scaler.step(opt)
    with pytest.raises(OSError):
        scaler.update()
    assert scaler.stats()["steps"] == 2 and len(calls) == 2


def test_a_caught_collapse_error_does_not_apply_the_rule_twice() -> None:
    model, opt, _ = tiny()
    scaler = GradScaler("cpu", init_scale=SCALE_FLOOR, collapse_patience=1)
    scales = []
    for _ in range(3):
        opt.zero_grad()
        backward(model, scaler)
        model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        with contextlib.suppress(ScaleCollapseError):
            scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [SCALE_FLOOR] * 3 and scaler.stats()["skipped_steps"] == 3


def test_deepcopy_keeps_the_process_group_loggers_and_names() -> None:
    group = object()  # stands for a ProcessGroup: deepcopy must share it, not copy it
    scaler = GradScaler("cpu", process_group=group)
    scaler.add_logger(print)
    model = nn.Linear(2, 2)
    scaler.name_parameters(model)
    clone = copy.deepcopy(scaler)
    assert clone._process_group is group
    assert clone._monitor.loggers == scaler._monitor.loggers
    assert clone._monitor.param_names == scaler._monitor.param_names


@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e-300])
def test_a_tiny_loaded_scale_never_reaches_the_run(scale: float) -> None:
    model, opt, scaler = tiny()
    scaler.load_state_dict({**scaler.state_dict(), "scale": scale})
    assert scaler.get_scale() == SCALE_FLOOR
    backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_refused_state_dict_leaves_a_used_scaler_unchanged() -> None:
    model, opt, scaler = tiny()
    backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    before = scaler.state_dict()
    for bad in ({"_growth_tracker": 2**31}, {"skipped_steps": 2**63}, {"scale": 1e300}, {"_hysteresis_tracker": 1000}):
        with pytest.raises(ValueError):
            scaler.load_state_dict({**before, **bad})
        assert scaler.state_dict() == before


def test_every_method_of_torchs_class_is_overridden() -> None:
    """isinstance(ours, torch.amp.GradScaler) holds, but none of torch's code runs on our state: every
    method and property of torch's class resolves to one of ours (``GradScaler`` or the torch surface
    it inherits, ``gradscaler.torch_surface``)."""

    def owner(name: str) -> type:
        return next(cls for cls in GradScaler.__mro__ if name in vars(cls))

    inherited = [
        name
        for name, member in vars(torch.amp.GradScaler).items()
        if (callable(member) or isinstance(member, property)) and not owner(name).__module__.startswith("gradscaler.")
    ]
    assert inherited == []
    assert isinstance(GradScaler("cpu"), torch.amp.GradScaler)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_optimizer_step_is_called_on_the_same_iterations_as_with_torchs_scaler(mode: str) -> None:
    def calls(scaler_cls: type) -> list[int]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = make_optimizer("sgd", mode, model.parameters())
        scaler = scaler_cls("cpu", init_scale=2.0**10)
        count = [0]
        real = opt.step

        def counted(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        opt.step = counted  # type: ignore[method-assign]
        per_iteration = []
        for step in range(6):
            opt.zero_grad()
            backward(model, scaler, seed=step)
            if step in (0, 1, 4):
                model.weight.grad[0, 0] = float("inf")
            before = count[0]
            scaler.step(opt)
            scaler.update()
            per_iteration.append(count[0] - before)
        return per_iteration

    assert calls(GradScaler) == calls(torch.amp.GradScaler)


def huge_gradient_run(scaler_cls: type, mode: str, scale: float, stored: float, dtype: torch.dtype, clip: bool):
    """One step whose stored (scaled) gradients are ``stored``: finite, but their squares overflow float32."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(dtype)
    opt = make_optimizer("adamw", mode, model.parameters())
    scaler = scaler_cls("cpu", init_scale=scale)
    scaler.scale(model(torch.ones(1, 64, dtype=dtype)).sum()).backward()
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, stored * (-1) ** index)
    if clip and scaler_cls is GradScaler:
        norm = scaler.clip_grad_norm_(opt, 1.0)
    elif clip:
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in model.parameters()], norm if clip else None


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize(
    ("scale", "stored", "dtype"),
    [
        (2.0**10, 3e37, torch.float32),  # near float32 max: squares overflow long before
        (2.0**100, 2e37, torch.float32),  # the largest scale: unscaled values ~1.6e7
        (2.0**60, 1e20, torch.float32),  # just past the 1.8e19 where a square overflows
        (2.0**16, 1e300, torch.float64),  # finite float64, inf as float32 (D11)
    ],
    ids=["fp32-near-max", "scale-2^100", "fp32-1e20", "fp64-1e300"],
)
def test_finite_huge_gradients_step_as_with_torch(mode: str, clip: bool, scale: float, stored: float, dtype) -> None:
    if clip and mode == "fused" and scale == 2.0**100:
        pytest.skip("documented limit (docs/migration.md): S / clip_coef = 2**100 * 6e7 exceeds float32")
    ours = huge_gradient_run(GradScaler, mode, scale, stored, dtype, clip)
    theirs = huge_gradient_run(torch.amp.GradScaler, mode, scale, stored, dtype, clip)
    assert ours[0] == theirs[0] == scale, "a finite step was called an overflow (the scale backed off)"
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0.0)
    if clip:
        torch.testing.assert_close(ours[2].double(), theirs[2].double(), rtol=1e-5, atol=0.0)


# Any sequence of public calls and loads keeps the scale finite and inside its bounds, and a refused
# call leaves state_dict() unchanged.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ACTIONS = st.sampled_from(
    [
        "clean_step",
        "inf_step",
        "clip_step",
        "update_new_scale",
        "update_bad_scale",
        "load_own",
        "load_tiny",
        "load_bad",
        "set_good",
        "set_bad",
    ]
)


@settings(max_examples=40, deadline=None)
@given(
    actions=st.lists(ACTIONS, min_size=1, max_size=25), hysteresis=st.integers(1, 3), low=st.sampled_from([None, 1.0])
)
def test_any_sequence_of_calls_keeps_the_scale_in_bounds(
    actions: list[str], hysteresis: int, low: float | None
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = make_optimizer("sgd", "fused", model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, hysteresis=hysteresis, min_scale=low,
                        max_scale=2.0**8, collapse_patience=None)  # fmt: skip
    for step, action in enumerate(actions):
        before = scaler.state_dict()
        refused = False
        try:
            if action.endswith("_step"):
                opt.zero_grad()
                backward(model, scaler, seed=step)
                if action == "inf_step":
                    model.weight.grad[0, 0] = float("nan")
                if action == "clip_step":
                    scaler.clip_grad_norm_(opt, 0.5)
                scaler.step(opt)
                scaler.update()
            elif action == "update_new_scale":
                backward(model, scaler, seed=step)
                scaler.update(2.0**30)  # above max_scale: clamped
            elif action == "update_bad_scale":
                backward(model, scaler, seed=step)
                scaler.update(float("inf"))
            elif action == "load_own":
                scaler.load_state_dict(scaler.state_dict())
            elif action == "load_tiny":
                scaler.load_state_dict({**scaler.state_dict(), "scale": 1e-45})
            elif action == "load_bad":
                scaler.load_state_dict({**scaler.state_dict(), "_hysteresis_tracker": hysteresis + 1})
            elif action == "set_good":
                scaler.set_backoff_factor(0.25)
            elif action == "set_bad":
                scaler.set_growth_interval(0)
        except (ValueError, TypeError):
            refused = True
        if refused:
            assert scaler.state_dict() == before, action
        scale = scaler.get_scale()
        assert math.isfinite(scale) and scaler._rule.lower <= scale <= scaler._rule.upper, (action, scale)
    assert all(torch.isfinite(p).all() for p in model.parameters())
