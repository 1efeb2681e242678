"""The update rule on its own: literal overflow sequences, exact scales (powers of two)."""

from __future__ import annotations

import random

import pytest
import torch

from gradscaler.rule import SCALE_FLOOR, ScaleRule, inverse_scale, set_scale_, update_scale_, update_scale_reference_


def trajectory(rule: ScaleRule, flags: list[bool], init: float = 8.0, reference: bool = False) -> list[float]:
    scale = torch.tensor(init)
    tracker = torch.tensor(0, dtype=torch.int32)
    hyst = torch.tensor(rule.hysteresis, dtype=torch.int32)
    step = update_scale_reference_ if reference else update_scale_
    out = []
    for flag in flags:
        step(scale, tracker, hyst, torch.tensor(float(flag)), rule)
        out.append(float(scale))
    return out


T, F = True, False


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "where"])
def test_torch_rule_growth_and_backoff(reference: bool) -> None:
    rule = ScaleRule(growth_interval=3)
    got = trajectory(rule, [F, F, F, F, T, F, F, F, T, T], reference=reference)
    assert got == [8, 8, 16, 16, 8, 8, 8, 16, 8, 4]


def test_growth_refused_when_not_finite() -> None:
    rule = ScaleRule(growth_interval=1)
    big = float(torch.finfo(torch.float32).max) / 1.5
    got = trajectory(rule, [F, F], init=big)
    assert got == [pytest.approx(big), pytest.approx(big)]
    assert all(torch.isfinite(torch.tensor(got)))


def test_scale_never_reaches_zero() -> None:
    got = trajectory(ScaleRule(), [T] * 400, init=1.0)
    assert min(got) == SCALE_FLOOR
    assert torch.isfinite(1 / torch.tensor(got[-1]))


def test_min_and_max_scale_bound_the_scale() -> None:
    rule = ScaleRule(growth_interval=1, min_scale=2.0, max_scale=32.0)
    assert trajectory(rule, [F, F, F, F]) == [16, 32, 32, 32]
    assert trajectory(rule, [T, T, T, T]) == [4, 2, 2, 2]


def test_hysteresis_refilled_by_clean_steps() -> None:
    rule = ScaleRule(growth_interval=100, hysteresis=3)
    # two overflows tolerated, the third consecutive one backs off; a clean step refills.
    assert trajectory(rule, [T, T, F, T, T, T, T]) == [8, 8, 8, 8, 8, 4, 2]


def test_hysteresis_refilled_only_by_growth_megatron() -> None:
    rule = ScaleRule(growth_interval=2, hysteresis=2, hysteresis_refill="growth")
    # T: left 1; F; T: left 0 -> backoff (a clean step did not refill); F, F: growth refills to 2.
    assert trajectory(rule, [T, F, T, F, F, T, T]) == [8, 8, 4, 4, 8, 8, 4]


@pytest.mark.parametrize("seed", range(5))
def test_kernel_and_reference_agree_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    flags = [rng.random() < 0.3 for _ in range(300)]
    rule = ScaleRule(growth_factor=1.7, backoff_factor=0.3, growth_interval=3)
    assert trajectory(rule, flags, init=3000.0) == trajectory(rule, flags, init=3000.0, reference=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hysteresis": 0}, "hysteresis must be an int in \\[1, 2147483647\\]"),
        ({"hysteresis_refill": "never"}, "hysteresis_refill must be one of"),
        ({"min_scale": 0.0}, "min_scale must be a finite number > 0, got 0.0"),
        ({"max_scale": float("inf")}, "max_scale must be a finite number > 0, got inf"),
        ({"min_scale": 8.0, "max_scale": 4.0}, r"min_scale \(8.0\) must not exceed max_scale \(4.0\)"),
    ],
)
def test_rule_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScaleRule(**kwargs)


@pytest.mark.parametrize("value", [1e300, float("inf"), float("nan"), -1.0, 0.0])
def test_a_device_scale_keeps_its_value_when_the_new_one_does_not_fit_float32(value: float) -> None:
    """The no-sync branch (a scale on a GPU, here a CPU tensor read as if it were one): a float64 value
    that float32 cannot hold leaves the scale, where it became inf and then the ceiling."""
    scale = torch.tensor(512.0)
    set_scale_(scale, torch.tensor(value, dtype=torch.float64), ScaleRule(), on_host=False)
    assert scale.item() == 512.0
    set_scale_(scale, torch.tensor(2.0**20, dtype=torch.float64), ScaleRule(), on_host=False)
    assert scale.item() == 2.0**20


def test_a_tiny_positive_new_scale_goes_to_the_floor_on_the_host_and_on_a_device() -> None:
    for on_host in (True, False):
        scale = torch.tensor(512.0)
        set_scale_(scale, torch.tensor(1e-300, dtype=torch.float64), ScaleRule(), on_host=on_host)
        assert scale.item() == SCALE_FLOOR


# Validation in one place: whatever the constructor or a setter accepts, its own state_dict loads.
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradscaler import GradScaler  # noqa: E402
from gradscaler.rule import FLOAT32_MAX, INT32_MAX  # noqa: E402


def test_float32_max_is_torchs() -> None:
    """``FLOAT32_MAX`` is spelled from its bits (rule.py imports no torch at module top)."""
    assert float(torch.finfo(torch.float32).max) == FLOAT32_MAX


finite_above_one = st.floats(min_value=1.0, max_value=1e30, exclude_min=True, allow_nan=False)
in_unit = st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True)
scale_like = st.floats(min_value=1e-44, max_value=1e300, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    init=scale_like,
    growth=finite_above_one,
    backoff=in_unit,
    interval=st.integers(1, INT32_MAX),
    hysteresis=st.integers(1, INT32_MAX),
    refill=st.sampled_from(["clean", "growth"]),
    low=st.none() | st.floats(min_value=1e-40, max_value=FLOAT32_MAX),
    high=st.none() | st.floats(min_value=SCALE_FLOOR, max_value=1e300),
    used=st.booleans(),
)
def test_every_accepted_policy_round_trips_through_its_state_dict(
    init, growth, backoff, interval, hysteresis, refill, low, high, used
) -> None:
    if low is not None and high is not None and low > high:
        low, high = high, low
    try:
        ScaleRule(min_scale=low, max_scale=high)
    except ValueError as error:
        assume("no float32 value between them" not in str(error))
    scaler = GradScaler(
        "cpu", init, growth, backoff, interval, hysteresis=hysteresis, hysteresis_refill=refill,
        min_scale=low, max_scale=high,
    )  # fmt: skip
    if used:
        scaler.scale(torch.ones(()))
    saved = scaler.state_dict()
    fresh = GradScaler("cpu")
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert scaler._rule.lower <= fresh.get_scale() <= scaler._rule.upper


@settings(max_examples=40, deadline=None)
@given(growth=finite_above_one, backoff=in_unit, interval=st.integers(1, INT32_MAX))
def test_every_accepted_setter_value_round_trips(growth: float, backoff: float, interval: int) -> None:
    scaler = GradScaler("cpu")
    scaler.set_growth_factor(growth)
    scaler.set_backoff_factor(backoff)
    scaler.set_growth_interval(interval)
    fresh = GradScaler("cpu")
    fresh.load_state_dict(scaler.state_dict())
    assert (fresh.get_growth_factor(), fresh.get_backoff_factor(), fresh.get_growth_interval()) == (
        growth,
        backoff,
        interval,
    )


@pytest.mark.parametrize(
    ("setter", "value", "error", "message"),
    [
        ("set_growth_factor", 1.0, ValueError, "growth_factor must be a finite number > 1.0, got 1.0"),
        ("set_growth_factor", float("nan"), ValueError, "growth_factor must be a finite number > 1.0, got nan"),
        ("set_backoff_factor", 3.0, ValueError, "backoff_factor must be a number in (0, 1), got 3.0"),
        ("set_backoff_factor", 0.0, ValueError, "backoff_factor must be a number in (0, 1), got 0.0"),
        ("set_growth_interval", 0, ValueError, "growth_interval must be an int in [1, 2147483647], got 0"),
        ("set_growth_interval", torch.tensor(5), TypeError, "growth_interval must be an int, got Tensor"),
    ],
)
def test_refused_values_are_refused_with_one_wording_and_change_nothing(
    setter: str, value: object, error: type, message: str
) -> None:
    scaler = GradScaler("cpu", growth_interval=7)
    before = scaler.state_dict()
    with pytest.raises(error) as excinfo:
        getattr(scaler, setter)(value)
    assert message in str(excinfo.value)
    assert scaler.state_dict() == before
    kwarg = {"set_growth_factor": "growth_factor", "set_backoff_factor": "backoff_factor"}.get(setter)
    if kwarg is not None and kwarg == "growth_factor" and value == 1.0:
        return  # the constructor keeps torch's AssertionError for this one (tests/test_scaler.py)
    name = setter.removeprefix("set_")
    with pytest.raises((error, AssertionError)):
        GradScaler("cpu", **{name: value})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_scale": 1e-40}, "max_scale must be >= 2**-126"),
        ({"min_scale": 1e300}, "min_scale must be <= float32 max"),
        ({"growth_factor": float("inf")}, "growth_factor must be a finite number > 1.0, got inf"),
        ({"backoff_factor": -0.5}, "backoff_factor must be a number in (0, 1), got -0.5"),
        ({"backoff_factor": float("nan")}, "backoff_factor must be a number in (0, 1), got nan"),
        ({"growth_interval": -3}, "growth_interval must be an int in [1, 2147483647], got -3"),
    ],
)
def test_constructor_refuses_policies_that_cannot_work(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        GradScaler("cpu", **kwargs)
    assert message in str(excinfo.value)


@pytest.mark.parametrize("found", [0.0, 1.0])
@pytest.mark.parametrize(
    "scale", [2.0**-126, 2.0**-125, 1.5 * 2.0**-126, 1.0, 2.0**126, 2.0**127, 3.0e38, 4.0, 8.0, 7.999999]
)
@pytest.mark.parametrize("bounds", [(None, None), (1.0, 8.0), (4.0, 4.0)])
def test_update_with_the_scale_held_on_the_host_matches_the_clamped_update(found, scale, bounds) -> None:
    """Skipping the clamp when the caller holds the scale as a number never changes a result."""
    low, high = bounds
    policy = ScaleRule(growth_factor=2.0, backoff_factor=0.5, growth_interval=1, min_scale=low, max_scale=high)
    results = []
    for held in (False, True):
        s, tracker = torch.tensor(scale), torch.zeros((), dtype=torch.int32)
        hysteresis = torch.ones((), dtype=torch.int32)
        s.clamp_(policy.lower, policy.upper)
        steady = held and policy.steady[0] <= s.item() <= policy.steady[1]
        update_scale_(s, tracker, hysteresis, torch.tensor(found), policy, steady=steady)
        results.append(s.item())
    assert results[0] == results[1]


@settings(max_examples=300, deadline=None)
@given(
    scale=st.floats(min_value=SCALE_FLOOR, max_value=FLOAT32_MAX, width=32),
    growth=st.one_of(st.sampled_from([2.0, 1.5, 1.0 + 2.0**-30]), st.floats(1.0, 1e3, exclude_min=True)),
    backoff=st.one_of(st.sampled_from([0.5, 0.9]), st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
    bounds=st.sampled_from([(None, None), (1.0, 2.0**20), (2.0**-100, 3.0e38), (0.75, 0.75), (2.0**10, 2.0**12)]),
    found=st.lists(st.sampled_from([0.0, 1.0]), max_size=12),
    most=st.integers(0, 12),
)
def test_updates_within_the_steady_run_skip_the_clamp_and_change_nothing(
    scale: float, growth: float, backoff: float, bounds: tuple, found: list[float], most: int
) -> None:
    """``steady_run``: the telemetry skips the clamp of the ``j``-th update after a scale it knows while
    ``j <= steady_run(scale, most)``; those updates leave the same scales as updates that always clamp, and
    the run is the longest (``most`` at the longest) whose growths and backoffs all stay in ``steady``."""
    low, high = bounds
    policy = ScaleRule(growth_factor=growth, backoff_factor=backoff, growth_interval=1, min_scale=low, max_scale=high)
    known = policy.clamp(scale)
    run = policy.steady_run(known, most)
    lo, hi = policy.steady

    def inside(k: int) -> bool:  # the least and greatest scale k float32-rounded updates can reach
        return lo <= known * (backoff * (1 - 2.0**-23)) ** k and known * (growth * (1 + 2.0**-23)) ** k <= hi

    assert -1 <= run <= most and all(inside(k) for k in range(run + 1))
    assert run == most or not inside(run + 1)
    assert _updated(known, found, policy, run) == _updated(known, found, policy, None)


def _updated(scale: float, found: list[float], policy: ScaleRule, run: int | None) -> list[float]:
    """The scale after each update of ``found``'s flags from ``scale``, the ``j``-th skipping its clamp while
    ``j <= run`` (None: every update clamps)."""
    s, t, out = torch.tensor(scale), torch.zeros((), dtype=torch.int32), []
    for j, flag in enumerate(found):
        steady = run is not None and j <= run
        update_scale_(s, t, torch.ones((), dtype=torch.int32), torch.tensor(flag), policy, steady=steady)
        out.append(s.item())
    return out


@pytest.mark.parametrize(
    ("factors", "bounds", "flag"),
    [((2.0, 1.0 - 1.4 * 2.0**-24), (1.0, None), 1.0), ((1.0 + 1.4 * 2.0**-23, 0.5), (None, 2.0**20), 0.0)],
)
def test_a_long_steady_run_counts_the_rounding_of_every_update(factors: tuple, bounds: tuple, flag: float) -> None:
    """Factors this close to 1 move the scale less than float32's rounding can: over a hundred updates the
    roundings add up past ``steady``'s margin (which covers one), and the run must count them (found in
    review: a run that did not left the scale 0.99999869 with ``min_scale=1``, and 1048576.125 above a
    ``max_scale`` of 2**20). From scales up to 150 updates from the bound, every update overflowing (or
    growing: ``growth_interval=1``), the updates within the run leave what updates that always clamp do."""
    growth, backoff = factors
    policy = ScaleRule(
        growth_factor=growth, backoff_factor=backoff, growth_interval=1, min_scale=bounds[0], max_scale=bounds[1]
    )
    edge, toward = (policy.steady[0], backoff) if flag else (policy.steady[1], growth)
    for updates in (60, 100, 150):
        known = policy.clamp(edge / toward**updates)
        run = policy.steady_run(known, 2 * updates)
        found = [flag] * (run + 2)
        assert _updated(known, found, policy, run) == _updated(known, found, policy, None), updates


_FLOAT32 = st.floats(min_value=SCALE_FLOOR, max_value=FLOAT32_MAX, width=32)


@settings(max_examples=400, deadline=None)
@given(
    scale=_FLOAT32,
    growth=st.one_of(st.sampled_from([2.0, 1.5, 1.1, 1.0 + 2.0**-30]), st.floats(1.0, 1e3, exclude_min=True)),
    backoff=st.one_of(st.sampled_from([0.5, 0.25, 0.9]), st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
    interval=st.integers(1, 4),
    tracker=st.integers(0, 5),
    found=st.sampled_from([0.0, 1.0, float("nan"), float("inf")]),
    bounds=st.sampled_from([(None, None), (1.0, 2.0**20), (2.0**-100, 3.0e38), (0.75, 0.75)]),
)
def test_the_host_form_of_torchs_kernel_gives_the_device_update_bit_for_bit(
    scale: float, growth: float, backoff: float, interval: int, tracker: int, found: float, bounds: tuple
) -> None:
    """``ScaleRule.next_on_host`` (the device telemetry's records) is ``update_scale_`` on the device: the same
    float32 scale and tracker for any scale up to float32's max (growth to inf refused), odd factors whose
    float64 products round, trackers at, below and past the interval, and NaN or inf flags (an overflow)."""
    low, high = bounds
    policy = ScaleRule(
        growth_factor=growth, backoff_factor=backoff, growth_interval=interval, min_scale=low, max_scale=high
    )
    s = torch.tensor(scale).clamp_(policy.lower, policy.upper)
    held = s.item()
    t = torch.tensor(tracker, dtype=torch.int32)
    update_scale_(s, t, torch.ones((), dtype=torch.int32), torch.tensor(found), policy)
    assert policy.next_on_host(held, tracker, found != 0) == (s.item(), int(t.item()))


def _torchs_inverse(scale: torch.Tensor) -> torch.Tensor:
    return scale.double().reciprocal().float()  # torch.amp.GradScaler's unscale_, verbatim


def test_the_one_op_inverse_is_torchs_three_over_a_sweep_of_every_exponent() -> None:
    """``inverse_scale`` on a device (one float32 ``reciprocal``) against torch's float64 reciprocal rounded to
    float32: one positive finite float32 in 251 (every exponent, subnormals included; every one of the 2**31 was
    checked once when the one op replaced the three), through the kernel's scalar loop, the one a one-element scale
    takes (a strided view is not vectorized)."""
    bits = torch.arange(1, 0x7F7F_FFFF + 1, 251, dtype=torch.int64).to(torch.int32)
    values = torch.stack([bits, bits], dim=1)[:, 0].view(torch.float32)  # every other element: stride 2
    assert values.stride() == (2,)
    assert torch.equal(values.reciprocal().view(torch.int32), _torchs_inverse(values).view(torch.int32))


@settings(max_examples=300, deadline=None)
@given(scale=st.floats(min_value=SCALE_FLOOR, max_value=FLOAT32_MAX, width=32))
def test_the_one_op_inverse_of_a_0d_scale_is_torchs(scale: float) -> None:
    """The scale itself, through ``inverse_scale``: one element, so the kernel's scalar loop, as in the sweep above."""
    held = torch.tensor(scale)
    assert torch.equal(inverse_scale(held, on_host=False).view(torch.int32), _torchs_inverse(held).view(torch.int32))


@pytest.mark.parametrize("device_type", ["cpu", "elsewhere", "rocm"])
def test_the_inverse_is_one_op_where_division_rounds(device_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch on CUDA and the CPU's device route; torch's three on a device type not known to round its
    float32 division correctly, and on a ROCm build (its "cuda" is not checked)."""
    from gradscaler import rule
    from gradscaler.tools.bench_host import Counts

    if device_type == "elsewhere":
        monkeypatch.setattr(rule, "ROUNDED_DIVISION_DEVICES", ("cuda",))
    if device_type == "rocm":
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
    held = torch.tensor(3.0)
    with Counts() as counts:
        inverse = inverse_scale(held, on_host=False)
    assert sum(counts.ops.values()) == (1 if device_type == "cpu" else 3), counts.ops
    assert torch.equal(inverse, _torchs_inverse(held))
