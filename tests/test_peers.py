"""The peers' dynamic loss scalers beside ours, on the same overflow sequences (docs/migration.md,
"Coming from Megatron-LM, DeepSpeed or Apex").

Each peer's update rule is restated below as a small model, written from reading its source:

- Megatron-core ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py);
- DeepSpeed's ``DynamicLossScaler`` (deepspeed/runtime/fp16/loss_scaler.py, the scaler of the ZeRO
  optimizers; its growth before 0.17.1 and since, read from the 0.17.0 and 0.17.1 releases, the same in
  0.19.8) and the rule ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` keep for themselves
  (deepspeed/runtime/fp16/fused_optimizer.py and unfused_optimizer.py, ``_update_scale``: fp16 without ZeRO);
- Apex: amp's ``LossScaler`` (apex/amp/scaler.py) and fp16_utils' ``DynamicLossScaler``
  (apex/fp16_utils/loss_scaler.py, under its ``FP16_Optimizer``).

Our ``GradScaler`` is driven through its public loop (``scale``, ``backward``, ``step``, ``update``)
with a NaN injected on the steps a sequence marks. Each test asserts the trajectories equal where the
docs say they are, and differ exactly where and how the docs say.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler, ScaleCollapseError

T, F = True, False


class AtMinimum(Exception):
    """A model's "cannot decrease scale anymore": DeepSpeed raises it, the run stops."""


# ---------------------------------------------------------------- the peers' rules, restated


class Megatron:
    """Megatron-core ``DynamicGradScaler``: the scale and both factors are float32 tensors.

    An overflow zeroes the growth count and takes one from the hysteresis count; at or below 0 the
    scale backs off, never below ``min_scale``. A clean update counts; at ``growth_interval`` the count
    restarts, the hysteresis count is refilled, and the scale grows (unchecked: it may become inf).
    Only a growth refills the hysteresis.
    """

    def __init__(
        self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
        growth_interval: int, hysteresis: int,
    ) -> None:  # fmt: skip
        self.scale = torch.tensor([initial_scale], dtype=torch.float32)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float32)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float32)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float32)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.clean, self.tolerance = 0, hysteresis

    def update(self, overflow: bool) -> float:
        if overflow:
            self.clean = 0
            self.tolerance -= 1
            if self.tolerance <= 0:
                self.scale = torch.max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean += 1
            if self.clean == self.growth_interval:
                self.clean, self.tolerance = 0, self.hysteresis
                self.scale = self.scale * self.growth_factor
        return float(self.scale)


class DeepSpeedLossScaler:
    """DeepSpeed's ``DynamicLossScaler`` (ZeRO stages 1-3): the scale is a Python float.

    It counts updates (``cur_iter``) and remembers the last overflow's. An overflow backs off (divides
    by ``scale_factor``, not below ``min_scale``) once the hysteresis is down to 1, else takes one from
    it; at ``min_scale`` already, ``raise_error_at_min_scale`` stops the run instead. A clean update
    grows the scale, and refills the hysteresis then (or at every clean update with
    ``consecutive_hysteresis``), when ``since``, the updates since the last overflow or the start
    (this one counted; an overflow the hysteresis absorbed counts as one), is:

    - since DeepSpeed 0.17.1, ``since - 1`` a positive multiple of ``scale_window``
      (``stable_interval``, the rule of ``FP16_Optimizer``): the ``scale_window + 1``-th clean update
      grows, then every ``scale_window``-th; ``scale_factor`` is fixed at 2 (no longer an argument);
    - before 0.17.1 (``before_0_17_1=True``), ``since`` a multiple of ``scale_window``: the
      ``scale_window``-th, then every ``scale_window``-th, as Megatron, Apex, torch and we grow.
    """

    def __init__(
        self, init_scale: float, scale_window: int, min_scale: float = 1.0, delayed_shift: int = 1,
        consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = False, scale_factor: float = 2.0,
        before_0_17_1: bool = False,
    ) -> None:  # fmt: skip
        assert scale_factor == 2.0 or before_0_17_1, "since 0.17.1 DynamicLossScaler takes no scale_factor"
        self.scale, self.window, self.min_scale, self.factor = init_scale, scale_window, min_scale, scale_factor
        self.delayed_shift = self.tolerance = delayed_shift
        self.consecutive, self.raise_at_min = consecutive_hysteresis, raise_error_at_min_scale
        self.iteration, self.last_overflow = 0, -1
        self.before_0_17_1 = before_0_17_1

    def grows(self) -> bool:
        since = self.iteration - self.last_overflow
        if self.before_0_17_1:
            return since % self.window == 0
        return since - 1 > 0 and (since - 1) % self.window == 0

    def update(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.tolerance == 1:
                if self.scale == self.min_scale and self.raise_at_min:
                    raise AtMinimum(self.iteration)
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.tolerance -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.tolerance = self.delayed_shift
            if self.grows():
                if not self.consecutive:
                    self.tolerance = self.delayed_shift
                self.scale *= self.factor
        self.iteration += 1
        return self.scale


class DeepSpeedFP16Optimizer:
    """DeepSpeed's ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` (fp16 without ZeRO), their own rule.

    Factor 2, a floor, no hysteresis (the config's ``hysteresis`` is not read). A clean update grows the
    scale when ``(cur_iter - last_overflow_iter) - 1``, the clean updates since the last overflow (this
    one counted) less one, is a positive multiple of ``scale_window``: the first growth comes after ``scale_window + 1``
    clean updates, the next ones every ``scale_window``.
    """

    def __init__(self, init_scale: float, scale_window: int, min_loss_scale: float = 1.0) -> None:
        self.scale, self.window, self.min_scale = init_scale, scale_window, min_loss_scale
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> float:
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.last_overflow = self.iteration
        else:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
        self.iteration += 1
        return self.scale


class ApexAmp:
    """Apex amp's ``LossScaler``: starts at 2**16, factor 2, ``scale_window`` 2000, a Python float.

    An overflow halves the scale (not below ``min_loss_scale`` when one is set: a falsy value sets
    none) and restarts the count; ``scale_window`` clean updates in a row double it, capped at
    ``max_loss_scale`` (the start is not capped).
    """

    def __init__(
        self, init_scale: float = 2.0**16, scale_window: int = 2000, min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:  # fmt: skip
        self.scale, self.window, self.clean = init_scale, scale_window, 0
        self.min_scale, self.max_scale = min_loss_scale, max_loss_scale

    def update(self, overflow: bool) -> float:
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2) if self.min_scale else self.scale / 2
            self.clean = 0
        else:
            self.clean += 1
        if self.clean == self.window:
            self.scale = min(self.max_scale, self.scale * 2)
            self.clean = 0
        return self.scale


class ApexFP16Utils:
    """Apex fp16_utils' ``DynamicLossScaler``: DeepSpeed's without hysteresis, its floor fixed at 1."""

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        self.scale, self.factor, self.window = init_scale, scale_factor, scale_window
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> float:
        if overflow:
            self.scale = max(self.scale / self.factor, 1)
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.scale *= self.factor
        self.iteration += 1
        return self.scale


def run_model(
    model: Megatron | DeepSpeedLossScaler | DeepSpeedFP16Optimizer | ApexAmp | ApexFP16Utils, flags: list[bool]
) -> list[float]:
    return [model.update(flag) for flag in flags]


# ---------------------------------------------------------------- ours, through the training loop


def drive(scaler: GradScaler | torch.amp.GradScaler, flags: list[bool]) -> list[float]:
    """One training step per flag (True: a NaN in a gradient); the scale after each ``update()``.

    The loss is multiplied by 2**-100 so that any float32 scale, up to its max, leaves the gradients
    finite: every overflow is one the sequence put there.
    """
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for bad in flags:
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum() * 2.0**-100).backward()
        if bad:
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = math.nan
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def stops_at(scaler: GradScaler, flags: list[bool]) -> int | None:
    """The index of the update at which ``ScaleCollapseError`` stops the run, or None."""
    for i in range(len(flags)):
        try:
            drive(scaler, flags[i : i + 1])
        except ScaleCollapseError:
            return i
    return None


def model_stops_at(model: DeepSpeedLossScaler, flags: list[bool]) -> int | None:
    for i, flag in enumerate(flags):
        try:
            model.update(flag)
        except AtMinimum:
            return i
    return None


def seeded_flags(n: int, p: float, seed: int) -> list[bool]:
    draw = random.Random(seed)
    return [draw.random() < p for _ in range(n)]


# Overflow sequences that walk every branch: growth, backoff, hysteresis spent and refilled by a
# clean update or only by a growth, runs at the floor.
SEQUENCES = {
    "growths": [F] * 13,
    "backoffs": [T] * 6 + [F] * 9,
    "alternating": [T, F] * 10,
    "pairs": [T, T, F, F, F, F, T, F, T, T, T, F, F, F, F, F, T, F, F, F, F, F],
    "spikes": [F] * 5 + [T] + [F] * 4 + [T, T] + [F] * 9 + [T, F, T] + [F] * 8,
    "floor": [T] * 12 + [F, T] * 3 + [F] * 9,
    "seeded_0.2": seeded_flags(200, 0.2, 0),
    "seeded_0.5": seeded_flags(200, 0.5, 1),
}


def float32(value: float) -> float:
    """``value`` rounded once to the nearest float32."""
    return float(torch.tensor(value, dtype=torch.float64).float())


# ---------------------------------------------------------------- Megatron-core


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_megatron_trajectories_equal_ours_with_growth_refill(name: str, hysteresis: int) -> None:
    flags = SEQUENCES[name]
    theirs = run_model(Megatron(2.0**10, 1.0, 2.0, 0.5, 4, hysteresis), flags)
    ours = GradScaler(
        "cpu", init_scale=2.0**10, min_scale=1.0, growth_interval=4, hysteresis=hysteresis,
        hysteresis_refill="growth", collapse_patience=None,
    )  # fmt: skip
    assert drive(ours, flags) == theirs
    assert len(set(theirs)) > 1  # the sequence moved the scale


def test_megatron_refill_differs_from_a_clean_update_refill() -> None:
    """``hysteresis_refill="clean"`` (our default) is DeepSpeed's, not Megatron's: a clean update
    between two overflows keeps Megatron's count spent, and the second overflow backs off."""
    flags = [T, F, T, F]
    assert run_model(Megatron(64.0, 1.0, 2.0, 0.5, 10, 2), flags) == [64, 64, 32, 32]
    clean = GradScaler("cpu", init_scale=64.0, growth_interval=10, hysteresis=2, collapse_patience=None)
    assert drive(clean, flags) == [64, 64, 64, 64]


def test_megatron_skips_forever_at_its_floor_where_ours_stops_after_collapse_patience() -> None:
    flags = [T] * 60
    theirs = run_model(Megatron(1.0, 1.0, 2.0, 0.5, 1000, 1), flags)
    assert theirs == [1.0] * 60
    assert drive(GradScaler("cpu", init_scale=1.0, min_scale=1.0, collapse_patience=None), flags) == theirs
    # collapse_patience=50 (the default): 50 overflowing steps at the minimum raise, at the 50th.
    assert stops_at(GradScaler("cpu", init_scale=1.0, min_scale=1.0), flags) == 49


def test_megatron_growth_past_float32_max_is_inf_where_ours_holds_the_scale() -> None:
    flags = [F, F, F]
    assert run_model(Megatron(2.0**126, 1.0, 2.0, 0.5, 1, 1), flags) == [2.0**127, math.inf, math.inf]
    assert drive(GradScaler("cpu", init_scale=2.0**126, growth_interval=1), flags) == [2.0**127] * 3


def test_megatron_min_scale_rounds_to_nearest_float32_ours_rounds_up() -> None:
    """A ``min_scale`` float32 cannot hold (0.7): Megatron's floor is the nearest float32 (below 0.7),
    ours the next float32 up, so that the scale is never below what was asked."""
    flags = [T, T, T]
    theirs = run_model(Megatron(2.0, 0.7, 2.0, 0.5, 1000, 1), flags)
    ours = drive(GradScaler("cpu", init_scale=2.0, min_scale=0.7, collapse_patience=None), flags)
    assert theirs[:1] == ours[:1] == [1.0]
    assert theirs[1:] == [float32(0.7)] * 2 and float32(0.7) < 0.7
    assert ours[1:] == [float(torch.nextafter(torch.tensor(float32(0.7)), torch.tensor(1.0)))] * 2 and ours[1] > 0.7


def torch_rule(init: float, growth: float, backoff: float, interval: int, flags: list[bool]) -> list[float]:
    """torch's ``_amp_update_scale_`` without hysteresis or bounds: each product taken in float64
    (the factor as the float64 it was given) and rounded once to float32."""
    scale, clean, out = float32(init), 0, []
    for flag in flags:
        if flag:
            scale, clean = float32(scale * backoff), 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = float32(scale * growth), 0
        out.append(scale)
    return out


def test_factors_float32_cannot_hold_round_like_torch_not_like_megatron() -> None:
    """Growth 1.1, backoff 0.9: ours equals torch's scaler bit for bit; Megatron multiplies by the
    factors already rounded to float32. The trajectories part at the first product the two roundings
    put on different float32 values (here the 7th growth) and then drift, meeting now and then: 140
    of these 200 updates end apart."""
    flags = SEQUENCES["seeded_0.2"]
    settings: dict[str, Any] = {
        "init_scale": 2.0**16,
        "growth_factor": 1.1,
        "backoff_factor": 0.9,
        "growth_interval": 2,
    }
    ours = drive(GradScaler("cpu", **settings, collapse_patience=None), flags)
    assert ours == drive(torch.amp.GradScaler("cpu", **settings), flags)
    assert ours == torch_rule(2.0**16, 1.1, 0.9, 2, flags)
    theirs = run_model(Megatron(2.0**16, 2.0**-100, 1.1, 0.9, 2, 1), flags)
    apart = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert len(apart) == 140 and apart[:4] == [13, 14, 17, 18]
    first = apart[0]
    assert ours[:first] == theirs[:first]
    before = ours[first - 1] if first else 2.0**16
    factor = 0.9 if flags[first] else 1.1
    assert ours[first] == float32(before * factor) != float32(before * float32(factor)) == theirs[first]


# ---------------------------------------------------------------- DeepSpeed

ZERO_HYSTERESIS = pytest.mark.parametrize(
    ("hysteresis", "consecutive"), [(1, False), (2, False), (2, True), (3, True)],
    ids=["hysteresis1", "hysteresis2", "hysteresis2-consecutive", "hysteresis3-consecutive"],
)  # fmt: skip


def ours_as_zero(hysteresis: int, consecutive: bool, growth_interval: int = 4) -> GradScaler:
    """The arguments docs/migration.md gives for ZeRO's ``fp16`` section (here ``loss_scale_window`` 4)."""
    return GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=growth_interval, min_scale=1.0, hysteresis=hysteresis,
        hysteresis_refill="clean" if consecutive else "growth", collapse_patience=None,
    )  # fmt: skip


@ZERO_HYSTERESIS
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_deepspeed_zero_before_0_17_1_trajectories_equal_ours(name: str, hysteresis: int, consecutive: bool) -> None:
    """ZeRO's ``DynamicLossScaler`` before 0.17.1: ``loss_scale_window`` is ``growth_interval`` to the
    update, ``hysteresis`` is ours, ``consecutive_hysteresis`` picks the refill."""
    flags = SEQUENCES[name]
    theirs = run_model(DeepSpeedLossScaler(2.0**10, 4, 1.0, hysteresis, consecutive, before_0_17_1=True), flags)
    assert drive(ours_as_zero(hysteresis, consecutive), flags) == theirs


def longest_clean_run(flags: list[bool]) -> int:
    return max(len(run) for run in "".join("T" if flag else "F" for flag in flags).split("T"))


@ZERO_HYSTERESIS
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_deepspeed_zero_since_0_17_1_no_growth_interval_reproduces_it(
    name: str, hysteresis: int, consecutive: bool
) -> None:
    """Since 0.17.1 ZeRO's scaler grows at the ``loss_scale_window + 1``-th clean update after an
    overflow (or the start), then every ``loss_scale_window``-th. With ``growth_interval`` =
    ``loss_scale_window`` (4) ours grows one update sooner at each of its growths; ``window + 1`` (5)
    matches only where no run of clean updates reaches the second growth (``2 * window + 1``); no other
    interval matches where theirs grows at all."""
    flags = SEQUENCES[name]
    theirs = run_model(DeepSpeedLossScaler(2.0**10, 4, 1.0, hysteresis, consecutive), flags)
    ours = drive(ours_as_zero(hysteresis, consecutive), flags)
    if not growth_steps(theirs, 2.0**10):  # no clean run reaches 5: the same if none reaches 4 either
        assert (ours == theirs) == (longest_clean_run(flags) < 4)
        return
    matches = [n for n in range(1, 10) if drive(ours_as_zero(hysteresis, consecutive, n), flags) == theirs]
    assert matches == ([5] if longest_clean_run(flags) < 9 else [])
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    assert first in growth_steps(ours, 2.0**10)  # they part where ours grows and theirs does not yet,
    assert first + 1 == len(flags) or flags[first + 1] or first + 1 in growth_steps(theirs, 2.0**10)  # at the next


def test_deepspeed_zero_since_0_17_1_an_overflow_on_the_update_between_parts_them_for_good() -> None:
    """Ours grows at the 4th clean update, theirs would at the 5th, which overflows: ours backs off from
    the doubled scale, theirs from the scale it had, and from there ours is twice theirs, four times
    on each update between our growth and theirs."""
    flags = [F] * 4 + [T] + [F] * 10
    theirs = run_model(DeepSpeedLossScaler(2.0**10, 4), flags)
    ours = drive(GradScaler("cpu", init_scale=2.0**10, growth_interval=4, min_scale=1.0), flags)
    assert theirs == [2.0**10] * 4 + [2.0**9] * 5 + [2.0**10] * 4 + [2.0**11] * 2
    assert ours == [2.0**10] * 3 + [2.0**11] + [2.0**10] * 4 + [2.0**11] * 4 + [2.0**12] * 3
    assert [a / b for a, b in zip(ours, theirs, strict=True)][4:] == [2, 2, 2, 2, 4, 2, 2, 2, 4, 2, 2]


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_deepspeed_zero_since_0_17_1_grows_as_its_fp16_optimizers(name: str) -> None:
    """Since 0.17.1 DeepSpeed has one timing: ZeRO's scaler without hysteresis (the non-ZeRO optimizers
    read none) gives the ``FP16_Optimizer`` rule's trajectory; before, ours."""
    flags = SEQUENCES[name]
    theirs = run_model(DeepSpeedFP16Optimizer(2.0**10, 4), flags)
    assert run_model(DeepSpeedLossScaler(2.0**10, 4), flags) == theirs
    before = run_model(DeepSpeedLossScaler(2.0**10, 4, before_0_17_1=True), flags)
    assert before == drive(GradScaler("cpu", init_scale=2.0**10, growth_interval=4, min_scale=1.0), flags)
    assert (before == theirs) == (growth_steps(theirs, 2.0**10) == growth_steps(before, 2.0**10) == [])


def first_overflow_at(floor: float, init: float, scales: list[float], flags: list[bool]) -> int:
    """The index of the first overflowing update that starts at ``floor``."""
    before = [init, *scales[:-1]]
    return next(i for i, (scale, bad) in enumerate(zip(before, flags, strict=True)) if bad and scale == floor)


@pytest.mark.parametrize("before_0_17_1", [True, False], ids=["before-0.17.1", "since-0.17.1"])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("name", ["floor", "seeded_0.5", "backoffs"])
def test_deepspeed_raise_error_at_min_scale_is_collapse_patience_1(
    name: str, hysteresis: int, before_0_17_1: bool
) -> None:
    """Without ``consecutive_hysteresis`` (the default), from a start above the minimum: only a growth
    refills the allowance, and a growth leaves the minimum, so every overflow at the minimum would
    back off, and both stop at the first one they meet there, each on its own trajectory (before
    0.17.1 the same one; since, the growths' timing can bring them to the minimum at other updates)."""
    flags = SEQUENCES[name] + [T] * 30

    def theirs(raise_at_min: bool) -> DeepSpeedLossScaler:
        return DeepSpeedLossScaler(
            2.0**4, 4, 1.0, hysteresis, raise_error_at_min_scale=raise_at_min, before_0_17_1=before_0_17_1
        )

    def ours(patience: int | None) -> GradScaler:
        return GradScaler(
            "cpu", init_scale=2.0**4, growth_interval=4, min_scale=1.0, hysteresis=hysteresis,
            hysteresis_refill="growth", collapse_patience=patience,
        )  # fmt: skip

    their_stop, our_stop = model_stops_at(theirs(True), flags), stops_at(ours(1), flags)
    assert their_stop == first_overflow_at(1.0, 2.0**4, run_model(theirs(False), flags), flags)
    assert our_stop == first_overflow_at(1.0, 2.0**4, drive(ours(None), flags), flags)
    assert before_0_17_1 <= (their_stop == our_stop)


@pytest.mark.parametrize("before_0_17_1", [True, False], ids=["before-0.17.1", "since-0.17.1"])
def test_deepspeed_raise_error_at_min_scale_with_hysteresis_waits_for_a_backoff_ours_does_not(
    before_0_17_1: bool,
) -> None:
    """With hysteresis DeepSpeed raises at an overflow at the minimum that would back off; ours counts
    every overflowing step at the minimum, so ``collapse_patience=1`` stops at the first."""
    flags = [T, T, F, T, T]  # 2 -> 1 at the second overflow; a clean update refills; then two more
    theirs = DeepSpeedLossScaler(
        2.0, 4, 1.0, delayed_shift=2, consecutive_hysteresis=True, raise_error_at_min_scale=True,
        before_0_17_1=before_0_17_1,
    )  # fmt: skip
    ours = GradScaler("cpu", init_scale=2.0, growth_interval=4, min_scale=1.0, hysteresis=2, collapse_patience=1)
    assert (model_stops_at(theirs, flags), stops_at(ours, flags)) == (4, 3)


def growth_steps(scales: list[float], init: float) -> list[int]:
    """The indices of the updates that grew the scale."""
    return [i for i, (before, after) in enumerate(zip([init, *scales[:-1]], scales, strict=True)) if after > before]


def test_deepspeed_fp16_optimizer_grows_one_update_later_than_growth_interval() -> None:
    """fp16 without ZeRO: after an overflow the first growth comes at the ``scale_window + 1``-th clean
    update, the next ones every ``scale_window``; from the start too. Ours grows at the ``growth_interval``-th."""
    flags = [F] * 8 + [T] + [F] * 10
    theirs = run_model(DeepSpeedFP16Optimizer(2.0**10, 3), flags)
    ours = drive(GradScaler("cpu", init_scale=2.0**10, growth_interval=3), flags)
    assert growth_steps(theirs, 2.0**10) == [3, 6, 12, 15, 18]  # the 4th, 7th (and 10th) clean updates of a run
    assert growth_steps(ours, 2.0**10) == [2, 5, 11, 14, 17]  # the 3rd, 6th (and 9th)
    # the ZeRO scaler grows at ours before DeepSpeed 0.17.1, at the FP16 optimizers' since
    zero = {before: run_model(DeepSpeedLossScaler(2.0**10, 3, before_0_17_1=before), flags) for before in (True, False)}
    assert growth_steps(zero[True], 2.0**10) == [2, 5, 11, 14, 17]
    assert growth_steps(zero[False], 2.0**10) == [3, 6, 12, 15, 18]


def test_no_growth_interval_reproduces_the_fp16_optimizers_timing() -> None:
    """``growth_interval = scale_window + 1`` has the first growth after an overflow right, and the
    next ones one update late; no interval has both."""
    flags = [F] * 8 + [T] + [F] * 10
    theirs = run_model(DeepSpeedFP16Optimizer(2.0**10, 3), flags)
    matches = [
        n for n in range(1, 12) if drive(GradScaler("cpu", init_scale=2.0**10, growth_interval=n), flags) == theirs
    ]
    assert matches == []
    late = drive(GradScaler("cpu", init_scale=2.0**10, growth_interval=4), flags)
    assert growth_steps(late, 2.0**10) == [3, 7, 12, 16]  # 3 and 12 as theirs; 7 and 16 one late, no 18
    assert growth_steps(theirs, 2.0**10) == [3, 6, 12, 15, 18]


Trajectory = Callable[[list[bool]], list[float]]
"""A rule set up: the scales it gives a sequence of overflow flags."""


def deepspeed_unit_tests(make: Callable[[float, int, float], Trajectory]) -> dict[str, bool]:
    """DeepSpeed's tests/unit/runtime/half_precision/test_dynamic_loss_scale.py, their sequences and
    expectations replayed on a rule (``make(init_scale, scale_window, min_loss_scale)``). The six tests
    are three for ``FP16_Optimizer`` (Adam) and three for ``FP16_UnfusedOptimizer`` (Lamb), the same
    but for the Lamb ``test_all_overflow``'s ``min_loss_scale`` 0.25."""
    results = {}
    for optimizer, floor in (("fused", 1.0), ("unfused", 0.25)):
        # test_no_overflow: ten clean steps; the expected scale doubles after every second one
        scales, expected, ok = make(2.0**8, 2, 1.0)(10 * [F]), 2.0**8, True
        for i, scale in enumerate(scales):
            ok &= scale == expected
            expected *= 2 if (i + 1) % 2 == 0 else 1
        results[f"{optimizer}-no_overflow"] = ok
        # test_all_overflow: eight overflows halve the scale down to the floor
        scales, expected, ok = make(2.0**4, 2, floor)(8 * [T]), 2.0**4, True
        for scale in scales:
            expected = max(expected / 2, floor)
            ok &= scale == expected
        results[f"{optimizer}-all_overflow"] = ok
        # test_some_overflow: two overflows, "scale_window + 1 times to increase scale once", one overflow
        scales = make(2.0**8, 2, 1.0)([T, T, F, F, F, T])
        results[f"{optimizer}-some_overflow"] = (scales[1], scales[4], scales[5]) == (2.0**6, 2.0**7, 2.0**6)
    return results


def test_deepspeed_unit_tests_pin_the_later_growth_which_zero_before_0_17_1_and_ours_fail() -> None:
    """The six pass on the ``FP16_Optimizer`` rule and on ZeRO's ``DynamicLossScaler`` since 0.17.1
    (without hysteresis, as the tests' optimizers have none); on ZeRO's before 0.17.1 and on ours the
    two ``test_no_overflow`` fail: there the scale grows at the second clean step, the tests expect the
    third."""

    def fp16_optimizer(init: float, window: int, floor: float) -> Trajectory:
        return lambda flags: run_model(DeepSpeedFP16Optimizer(init, window, floor), flags)

    def zero_scaler(before_0_17_1: bool) -> Callable[[float, int, float], Trajectory]:
        def make(init: float, window: int, floor: float) -> Trajectory:
            return lambda flags: run_model(DeepSpeedLossScaler(init, window, floor, before_0_17_1=before_0_17_1), flags)

        return make

    def ours(init: float, window: int, floor: float) -> Trajectory:
        return lambda flags: drive(GradScaler("cpu", init_scale=init, growth_interval=window, min_scale=floor), flags)

    for rule in (fp16_optimizer, zero_scaler(False)):
        results = deepspeed_unit_tests(rule)
        assert len(results) == 6 and all(results.values())
    fails = ["fused-no_overflow", "unfused-no_overflow"]
    for rule in (zero_scaler(True), ours):
        results = deepspeed_unit_tests(rule)
        assert len(results) == 6 and [name for name, ok in results.items() if not ok] == fails


@pytest.mark.parametrize("factor", [3.0, 1.1])
def test_deepspeed_and_apex_factor_other_than_2_divides_a_float64_ours_multiplies_a_float32(factor: float) -> None:
    """``scale_factor`` (a ``DynamicLossScaler`` argument before DeepSpeed 0.17.1, not in its config,
    fixed at 2 since; Apex fp16_utils' ``dynamic_loss_args``): the peers divide a Python float by it;
    ours multiplies the float32 scale by ``backoff_factor = 1 / scale_factor`` and rounds, as torch
    does. Apart after each backoff (here a growth brings both back to 2**16)."""
    flags = [T, F, F, T, F, F]
    theirs = run_model(DeepSpeedLossScaler(2.0**16, 2, 1.0, scale_factor=factor, before_0_17_1=True), flags)
    assert theirs == run_model(ApexFP16Utils(2.0**16, factor, 2), flags)
    ours = drive(
        GradScaler("cpu", init_scale=2.0**16, growth_factor=factor, backoff_factor=1 / factor, growth_interval=2), flags
    )
    assert ours == torch_rule(2.0**16, factor, 1 / factor, 2, flags)
    assert theirs[0] == 2.0**16 / factor != ours[0] == float32(2.0**16 * (1 / factor))
    assert [i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b] == [0, 1, 3, 4]


# ---------------------------------------------------------------- Apex


@pytest.mark.parametrize(("init", "floor"), [(2.0**16, None), (2.0**4, 1.0)], ids=["no-min", "min-1"])
@pytest.mark.parametrize("name", [*SEQUENCES, "to_the_cap"])
def test_apex_amp_trajectories_equal_ours_with_max_scale_2_24(name: str, init: float, floor: float | None) -> None:
    """``amp.initialize(loss_scale="dynamic", min_loss_scale=..., max_loss_scale=2**24)``: torch's
    rule and defaults (2**16, 2000) with ``max_scale=2**24``; here with ``scale_window`` 4."""
    flags = [F] * 88 if name == "to_the_cap" else SEQUENCES[name]
    theirs = run_model(ApexAmp(init, 4, floor), flags)
    ours = GradScaler(
        "cpu", init_scale=init, growth_interval=4, min_scale=floor, max_scale=2.0**24, collapse_patience=None
    )
    assert drive(ours, flags) == theirs
    assert name != "to_the_cap" or theirs[-8:] == [2.0**24] * 8


def test_apex_amp_without_min_loss_scale_halves_past_2_pow_minus_126_ours_stops_there() -> None:
    flags = [T] * 10
    theirs = run_model(ApexAmp(2.0**-120, min_loss_scale=0), flags)  # 0, like None, sets no floor
    assert theirs == [2.0**-k for k in range(121, 131)]
    assert drive(GradScaler("cpu", init_scale=2.0**-120, collapse_patience=None), flags) == [
        *[2.0**-k for k in range(121, 127)],
        *[2.0**-126] * 4,
    ]


def test_apex_amp_keeps_a_start_above_max_loss_scale_until_its_first_growth_ours_starts_at_the_cap() -> None:
    flags = [F] * 6
    assert run_model(ApexAmp(2.0**16, 4, max_loss_scale=2.0**10), flags) == [2.0**16] * 3 + [2.0**10] * 3
    assert drive(GradScaler("cpu", init_scale=2.0**16, growth_interval=4, max_scale=2.0**10), flags) == [2.0**10] * 6


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_apex_fp16_utils_trajectories_equal_ours_with_min_scale_1(name: str) -> None:
    flags = SEQUENCES[name]
    theirs = run_model(ApexFP16Utils(2.0**10, 2.0, 4), flags)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=4, min_scale=1.0, collapse_patience=None)
    assert drive(ours, flags) == theirs


# ---------------------------------------------------------------- a constant scale


def test_a_constant_scale_is_min_scale_equal_to_max_scale() -> None:
    """Megatron's ``ConstantGradScaler`` (``--loss-scale``) and DeepSpeed's ``loss_scale > 0``: the scale
    never moves, and steps with an overflow are still skipped (Apex's static ``loss_scale`` steps them)."""
    flags = SEQUENCES["pairs"]
    scaler = GradScaler(
        "cpu", init_scale=2.0**12, min_scale=2.0**12, max_scale=2.0**12, growth_interval=2, collapse_patience=None
    )
    assert drive(scaler, flags) == [2.0**12] * len(flags)
    assert scaler.stats()["skipped_steps"] == sum(flags) > 0
