"""The scale-update rule: its validated constants (``ScaleRule``) and pure in-place tensor ops.

The rule itself is stated once, as pseudo-code, in the ``GradScaler`` class docstring. Notes on this
implementation: the backoff and growth products are computed in float64 and rounded once to float32,
as torch's kernel does; the scale is then clamped into ``[lower, upper]``. The floor 2**-126 (the
smallest normal float32, whose reciprocal is finite) is the one place the rule differs from torch's
``_amp_update_scale_``, which lets S reach 0 after ~150 consecutive overflows, after which ``1/S`` is
inf and every unscaled gradient is inf or NaN. With ``hysteresis=1``, no ``min_scale`` or
``max_scale`` and S above the floor, the rule is bit-identical to torch's kernel. Nothing here reads
a tensor back to the host.

The module imports torch only inside the functions that need tensors: ``ScaleRule`` checks a policy
without it, so that ``gradscaler report`` reads a log without torch (whose import alone takes seconds).

Every value the scaler's policy can hold is checked here, and only here: the constructor, the
setters and ``load_state_dict`` all build a ``ScaleRule``, so whatever one of them accepts the others
accept too, and a scaler's own ``state_dict()`` always loads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import struct
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SCALE_FLOOR = 2.0**-126
"""Smallest scale the rule ever produces: the smallest normal float32, whose reciprocal is finite."""

FLOAT32_MAX: float = struct.unpack("<f", struct.pack("<I", 0x7F7F_FFFF))[0]
"""float32's largest finite value (``torch.finfo(torch.float32).max``; tests/test_rule.py holds them equal)."""
INT32_MAX = 2**31 - 1
"""Trackers and the intervals they count to live in int32 device tensors."""
INT64_MAX = 2**63 - 1
"""The step count saturates here, so that a scaler's own state dict loads after any number of steps."""

REFILL_MODES = ("clean", "growth")


def real_number(name: str, value: Any) -> float:
    """``value`` as a float when it is a real number (int, float, NumPy scalar; not bool or tensor)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__} {value!r}.")
    try:
        return float(value)
    except OverflowError:  # an int past float64's range: infinite, refused by every caller's range check
        huge: Any = value  # a Real, which typeshed does not order against 0
        return math.inf if huge > 0 else -math.inf


def integer(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an int when it is an integer in ``[low, high]`` (not bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    number = int(value)
    if not low <= number <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}.")
    return number


def positive_finite(name: str, value: Any) -> float:
    """``value`` as a float when it is a real number, finite and > 0."""
    number = real_number(name, value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return number


@dataclass(frozen=True)
class ScaleRule:
    """The constants of the update rule, each checked and normalised to a plain Python number.

    ``growth_factor``: finite, > 1. ``backoff_factor``: in (0, 1). ``growth_interval`` and
    ``hysteresis``: ints in [1, 2**31 - 1]. ``hysteresis_refill``: ``"clean"`` or ``"growth"``.
    ``min_scale`` / ``max_scale``: None or finite > 0, ``min_scale <= float32 max``,
    ``max_scale >= 2**-126``, ``min_scale <= max_scale``. Violations raise ``ValueError`` (a value out of
    range) or ``TypeError`` (not a number), naming the argument and echoing the value.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    hysteresis_refill: str = "clean"
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        growth = real_number("growth_factor", self.growth_factor)
        if not (math.isfinite(growth) and growth > 1.0):
            raise ValueError(f"growth_factor must be a finite number > 1.0, got {self.growth_factor!r}.")
        backoff = real_number("backoff_factor", self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"backoff_factor must be a number in (0, 1), got {self.backoff_factor!r}.")
        interval = integer("growth_interval", self.growth_interval, 1, INT32_MAX)
        hysteresis = integer("hysteresis", self.hysteresis, 1, INT32_MAX)
        if self.hysteresis_refill not in REFILL_MODES:
            raise ValueError(f"hysteresis_refill must be one of {REFILL_MODES}, got {self.hysteresis_refill!r}.")
        low = None if self.min_scale is None else positive_finite("min_scale", self.min_scale)
        high = None if self.max_scale is None else positive_finite("max_scale", self.max_scale)
        if low is not None and low > FLOAT32_MAX:
            raise ValueError(f"min_scale must be <= float32 max ({FLOAT32_MAX:g}), got {self.min_scale!r}.")
        if high is not None and high < SCALE_FLOOR:
            raise ValueError(f"max_scale must be >= 2**-126 (the smallest normal float32), got {self.max_scale!r}.")
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r}).")
        for name, value in zip(
            ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale"),
            (growth, backoff, interval, hysteresis, low, high),
            strict=True,
        ):
            object.__setattr__(self, name, value)
        # Computed once: the update path reads them every step.
        object.__setattr__(self, "_lower", max(_float32_toward(low or 0.0, +1), SCALE_FLOOR))
        object.__setattr__(self, "_upper", _float32_toward(min(high or FLOAT32_MAX, FLOAT32_MAX), -1))
        # Scales from which neither factor can leave [lower, upper], with a margin for float32 rounding
        # (rounding is monotonic: a product inside by a margin stays inside); see ``update_scale_``.
        margin = 1.0 + 2.0**-20
        object.__setattr__(self, "_steady", (self.lower * margin / backoff, self.upper / (growth * margin)))
        if self.lower > self.upper:
            raise ValueError(
                f"min_scale ({self.min_scale!r}) and max_scale ({self.max_scale!r}) hold no float32 value between them."
            )

    def with_changes(self, strict: bool = True, **changes: Any) -> ScaleRule:
        """A new rule with ``changes`` applied, validated like any other.

        ``strict=False`` (a disabled scaler, whose settings torch never checks and nothing uses): each
        change that would be refused is left out instead.
        """
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"ScaleRule has no field(s) {unknown}.")
        if strict:
            return replace(self, **changes)
        rule = self
        for name, value in changes.items():
            with contextlib.suppress(TypeError, ValueError):
                rule = replace(rule, **{name: value})
        return rule

    def initial_scale(self, init_scale: Any, strict: bool = True) -> float:
        """``init_scale`` checked (a finite number > 0) and moved into ``[lower, upper]``.

        ``strict=False`` (a disabled scaler, which never scales): 2**16 where it would be refused.
        """
        try:
            return self.clamp(positive_finite("init_scale", init_scale))
        except (TypeError, ValueError):
            if strict:
                raise
            return self.clamp(2.0**16)

    # lower, upper, steady and matches_torch_kernel: read at every update; as cached properties each read after
    # the first is an attribute's, not a call (the rule is frozen).
    @functools.cached_property
    def lower(self) -> float:
        """The smallest scale the rule produces (a float32 value: ``min_scale`` rounded up)."""
        return self._lower  # type: ignore[attr-defined,no-any-return]

    @functools.cached_property
    def upper(self) -> float:
        """The largest scale the rule produces (a float32 value: ``max_scale`` rounded down)."""
        return self._upper  # type: ignore[attr-defined,no-any-return]

    @functools.cached_property
    def steady(self) -> tuple[float, float]:
        """Scales from which one growth or backoff stays inside ``[lower, upper]`` (with a margin)."""
        return self._steady  # type: ignore[attr-defined,no-any-return]

    def steady_run(self, scale: float, most: int) -> int:
        """How many updates after ``scale`` leave the scale inside ``steady`` whatever they find: the largest
        ``k <= most`` whose every reachable scale is in ``steady``; -1 when ``scale`` is not in it. A caller
        that knows the scale was ``scale`` at most ``k`` updates ago skips the clamp of the next.

        Each update multiplies the scale by 1, or by a factor and rounds the product to float32 (a relative
        error under ``2**-24``): after ``k`` of them it lies between ``scale * (backoff * (1 - 2**-23))**k``
        and ``scale * (growth * (1 + 2**-23))**k``, both of which must be in ``steady``. (``steady``'s own
        margin is for one rounding: that of the update whose clamp is skipped.)"""
        low, high = self.steady
        shrink, grow = self.backoff_factor * (1.0 - 2.0**-23), self.growth_factor * (1.0 + 2.0**-23)

        def inside(k: int) -> bool:
            try:
                return low <= scale * shrink**k and scale * grow**k <= high
            except OverflowError:
                return False

        if not inside(0):
            return -1
        # the logarithms give k within one or two; the products decide, as ``inside`` is monotonic in k
        estimate = min(math.log(scale / low) / -math.log(shrink), math.log(high / scale) / math.log(grow))
        k = int(min(estimate, most))
        while k > 0 and not inside(k):
            k -= 1
        while k < most and inside(k + 1):
            k += 1
        return k

    def clamp(self, scale: float) -> float:
        """``scale`` (a finite number > 0) moved into ``[lower, upper]``."""
        return min(max(scale, self.lower), self.upper)

    @functools.cached_property
    def matches_torch_kernel(self) -> bool:
        """True when torch's ``_amp_update_scale_`` kernel computes this rule (before the clamp)."""
        return self.hysteresis == 1

    def next_on_host(self, scale: float, tracker: int, skipped: bool) -> tuple[float, int]:
        """The scale and growth tracker that ``update_scale_`` leaves after one update of a rule that
        ``matches_torch_kernel``, computed from host numbers: torch's kernel (each product in float64, rounded
        once to float32; a growth past float32's range leaves the scale as it was; the tracker compared to the
        interval with ``==``), then the clamp. ``scale`` is within ``[lower, upper]``, as every scale a scaler
        holds is. The device telemetry computes its records' scales with it from their flags instead of
        copying the scale at each update; tests/test_rule.py holds the two bit for bit."""
        if skipped:
            return self.clamp(_to_float32(scale * self.backoff_factor)), 0
        if tracker + 1 != self.growth_interval:
            return scale, tracker + 1  # a clean update that does not grow: the clamp moves no scale within bounds
        grown = _to_float32(scale * self.growth_factor)
        return self.clamp(grown if math.isfinite(grown) else scale), 0


def _to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as C's cast rounds it: inf past float32's range."""
    try:
        rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # struct refuses what rounds to inf; the kernel's cast gives inf
        return math.copysign(math.inf, value)
    return rounded


def _float32_toward(value: float, direction: int) -> float:
    """The float32 nearest ``value`` (0 <= value <= float32 max) on the side of ``direction`` (+1 or -1)."""
    rounded = _to_float32(value)
    if (rounded - value) * direction < 0:  # stepping the bits of a non-negative float moves it by one ulp
        bits = struct.unpack("<I", struct.pack("<f", rounded))[0] + direction
        rounded = struct.unpack("<f", struct.pack("<I", bits))[0]
    return rounded


ROUNDED_DIVISION_DEVICES = ("cuda", "cpu")
"""Device types whose float32 ``reciprocal`` of a one-element tensor is a correctly rounded division: CUDA's
``1 / a`` as nvcc compiles it without fast math (not ROCm's, which reports "cuda" and is not checked), the CPU
kernel's scalar loop, which a one-element tensor always takes (some ARM SVE builds vectorize it as an estimate
and Newton steps). Rounded once to float32, ``1/S`` is the float64 reciprocal rounded to float32, torch's three
ops: rounding a quotient twice, through 53 bits then 24, gives the once-rounded result (53 >= 2 * 24 + 2), and
flush-to-zero flushes both alike. Checked for every positive finite float32 on the CPU, and on CUDA by
tests/test_cuda.py. Elsewhere (Metal computes in fast math by default) ``inverse_scale`` makes torch's three ops."""


def inverse_scale(scale: torch.Tensor, on_host: bool) -> torch.Tensor:
    """``1/S`` as torch computes it (a float64 reciprocal rounded to float32), on the scale's device, in one op:
    ``on_host`` (the scale reads for free) in Python, on a device in ``ROUNDED_DIVISION_DEVICES`` its float32
    reciprocal, elsewhere torch's three ops."""
    import torch

    if on_host:
        return torch.scalar_tensor(1.0 / scale.item(), dtype=torch.float32, device=scale.device)
    if scale.device.type in ROUNDED_DIVISION_DEVICES and torch.version.hip is None:
        return scale.reciprocal()
    return scale.double().reciprocal().float()


NEW_SCALE_REASON = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False."
)


def set_scale_(
    scale: torch.Tensor, new_scale: Any, rule: ScaleRule, on_host: bool, device_type: str | None = None
) -> None:
    """Set ``scale`` in place to ``new_scale`` (a number, or a 1-element tensor), moved into the bounds.

    A tensor must be one element on ``device_type`` (default: the scale's) without ``requires_grad``
    (torch's ``AssertionError``, verbatim). NaN, inf, values <= 0 and values past float32's largest (a
    float64 1e300: finite, but no float32 holds it) raise ``ValueError`` and change nothing; except a
    tensor when reading it would cost a host sync (``on_host`` False: the scale on a GPU), which leaves
    the scale as it was.
    """
    import torch

    if isinstance(new_scale, torch.Tensor):
        wrong_device = new_scale.device.type != (device_type or scale.device.type)
        if wrong_device or new_scale.numel() != 1 or new_scale.requires_grad:
            raise AssertionError(NEW_SCALE_REASON)
        value = new_scale.detach().reshape(())
        if on_host:  # reading it is free: refused as a float would be
            scale.fill_(_storable_scale(new_scale, value.item()))
        else:
            stored = value.to(scale.dtype)  # past float32's range this is inf, and refused below
            scale.copy_(torch.where(torch.isfinite(stored) & (value > 0), stored, scale))
    else:
        scale.fill_(_storable_scale(new_scale, new_scale))
    clamp_scale_(scale, rule)


def _storable_scale(new_scale: Any, number: Any) -> float:
    """``number`` (``new_scale`` read on the host) as a float when a float32 scale can hold it."""
    value = positive_finite("new_scale", number)
    if value > FLOAT32_MAX:
        raise ValueError(
            f"new_scale must be a finite number > 0 and <= float32 max ({FLOAT32_MAX:g}), the scale's "
            f"dtype, got {new_scale!r}. Pass a smaller value; above max_scale it is clamped to max_scale."
        )
    return value


def clamp_scale_(scale: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """Clamp ``scale`` in place into ``[rule.lower, rule.upper]`` (a NaN stays NaN; the rule makes none)."""
    return scale.clamp_(rule.lower, rule.upper)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    rule: ScaleRule,
    *,
    steady: bool = False,
) -> None:
    """Apply one step of the rule in place. ``found_inf`` is a 0-d float tensor, nonzero on overflow.

    All four tensors live on one device. Nothing is read back to the host. ``steady``: the caller knows
    the scale is inside ``rule.steady`` now (its telemetry: ``ScaleRule.steady_run``), from where neither
    factor can leave the bounds: the clamp is skipped.
    """
    import torch

    if rule.matches_torch_kernel:
        # One launch for the common case; the floor/ceiling clamp is the only addition.
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, rule.growth_factor, rule.backoff_factor, rule.growth_interval
        )
        if not steady:
            clamp_scale_(scale, rule)
        return
    update_scale_reference_(scale, growth_tracker, hysteresis_tracker, found_inf, rule)


def update_scale_reference_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    rule: ScaleRule,
) -> None:
    """The rule written out with ``torch.where``: any hysteresis, same results as the kernel at 1."""
    import torch

    found = found_inf != 0
    hysteresis_after = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    backoff = found & (hysteresis_after <= 0)
    clean_count = growth_tracker + 1
    grow = (~found) & (clean_count == rule.growth_interval)
    scale64 = scale.double()
    grown = (scale64 * rule.growth_factor).float()
    shrunk = (scale64 * rule.backoff_factor).float()
    new_scale = torch.where(backoff, shrunk, torch.where(grow & torch.isfinite(grown), grown, scale))
    new_tracker = torch.where(found | grow, torch.zeros_like(growth_tracker), clean_count)
    refill = grow if rule.hysteresis_refill == "growth" else ~found
    new_hysteresis = torch.where(refill, torch.full_like(hysteresis_tracker, rule.hysteresis), hysteresis_after)
    scale.copy_(new_scale)
    clamp_scale_(scale, rule)
    growth_tracker.copy_(new_tracker)
    hysteresis_tracker.copy_(new_hysteresis.clamp_(min=0))
