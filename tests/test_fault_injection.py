"""Seeded fault injection: random inf/-inf/NaN over long runs, with the invariants checked each step."""

from __future__ import annotations

import copy
import io
import math
import random
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradscaler import GradScaler
from gradscaler.rule import SCALE_FLOOR, ScaleRule, update_scale_
from helpers import assert_same_state, make_optimizer

STEPS = 600
CONFIGS = [("sgd", "foreach"), ("adam", "fused"), ("adamw", "forloop"), ("adagrad", "fused"), ("sgd", "fused")]
POLICIES = {"torch": {}, "hysteresis": {"hysteresis": 3, "min_scale": 2.0**-4, "max_scale": 2.0**20}}


def schedule(seed: int, steps: int, rate: float = 0.1, burst_rate: float = 0.08) -> list[list[tuple[int, float]]]:
    """Per step, the (parameter index, value) faults to inject: bursts, single faults, clean runs."""
    rng = random.Random(seed)
    out: list[list[tuple[int, float]]] = []
    burst = 0
    for _ in range(steps):
        if burst == 0 and rng.random() < burst_rate:
            burst = rng.randint(1, 6)
        faults = []
        if burst or rng.random() < rate:
            faults = [(rng.randrange(6), rng.choice([math.inf, -math.inf, math.nan])) for _ in range(rng.randint(1, 2))]
            burst = max(burst - 1, 0)
        out.append(faults)
    return out


class Run:
    """A small model, an optimizer and a scaler that can be checkpointed and resumed."""

    def __init__(
        self, optimizer: str, mode: str, policy: dict, clip: float | None = None, init_scale: float = 2.0**10
    ) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        self.opt = make_optimizer(optimizer, mode, self.model.parameters())
        self.scaler = GradScaler("cpu", init_scale=init_scale, growth_interval=5, collapse_patience=None, **policy)
        self.params = list(self.model.parameters())
        self.clip = clip
        self.overflowed = False

    def step(self, index: int, faults: list[tuple[int, float]]) -> None:
        gen = torch.Generator().manual_seed(index)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        self.opt.zero_grad()
        self.scaler.scale(nn.functional.mse_loss(self.model(x), y)).backward()
        # Clean gradients times a scale near float32's max (2**127, where a run with few faults and no max_scale
        # grows to) overflow on their own: the scaler must skip that step too.
        self.overflowed = not all(bool(p.grad.isfinite().all()) for p in self.params if p.grad is not None)
        for param_index, value in faults:
            self.params[param_index].grad.view(-1)[index % self.params[param_index].numel()] = value
        if self.clip is not None:
            self.scaler.clip_grad_norm_(self.opt, self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()

    def checkpoint(self) -> dict:
        """Through bytes and ``torch.load(weights_only=True)``, as a real checkpoint travels."""
        buffer = io.BytesIO()
        torch.save(
            {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "scaler": self.scaler.state_dict()}, buffer
        )
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.scaler.load_state_dict(ckpt["scaler"])


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(("optimizer", "mode"), CONFIGS, ids=[f"{o}-{m}" for o, m in CONFIGS])
def test_invariants_under_random_faults(optimizer: str, mode: str, policy: str) -> None:
    plan = schedule(seed=zlib.crc32(f"{optimizer}-{mode}-{policy}".encode()), steps=STEPS)
    check_run(lambda: Run(optimizer, mode, POLICIES[policy]), plan)


REGIMES = {
    # name: (init_scale, fault rate, burst rate): harsh keeps most steps overflowing; floor starts at
    # the floor, so backoffs press against 2**-126 (or min_scale) the whole run.
    "harsh": (2.0**10, 0.6, 0.3),
    "floor": (SCALE_FLOOR, 0.5, 0.2),
}


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize(("optimizer", "mode"), [("adamw", "fused"), ("sgd", "foreach")], ids=["fused", "foreach"])
def test_invariants_in_harsh_regimes(optimizer: str, mode: str, regime: str, clip: float | None) -> None:
    init_scale, rate, burst_rate = REGIMES[regime]
    plan = schedule(seed=zlib.crc32(f"{regime}-{mode}".encode()), steps=240, rate=rate, burst_rate=burst_rate)
    check_run(
        lambda: Run(optimizer, mode, POLICIES["hysteresis" if regime == "floor" else "torch"], clip, init_scale), plan
    )


def check_run(make: Callable[[], Run], plan: list[list[tuple[int, float]]]) -> int:
    """Run ``plan``: skips exactly where faults are (or where the scaled gradients overflowed on their own), a
    skip changes nothing, the scale stays in bounds, and a run resumed from a mid-run checkpoint (through
    weights_only loading) ends bit-identical. Returns how many clean steps overflowed on their own."""
    run = make()
    steps = len(plan)
    lower, upper = run.scaler._rule.lower, run.scaler._rule.upper
    ckpt, mid = None, steps // 2
    consecutive = skips = natural = 0
    for index, faults in enumerate(plan):
        if index == mid:
            ckpt = run.checkpoint()
        before_params = [p.detach().clone() for p in run.params]
        before_state = copy.deepcopy(run.opt.state_dict()["state"])
        run.step(index, faults)
        skipped = run.scaler.last_step_skipped()
        bad = bool(faults) or run.overflowed
        assert skipped == bad, f"step {index}: skipped={skipped}, faults={faults}, overflowed={run.overflowed}"
        if skipped:
            for a, b in zip(before_params, run.params, strict=True):
                assert torch.equal(a, b), f"step {index}: a skipped step changed a parameter"
            assert_same_state(copy.deepcopy(run.opt.state_dict()["state"]), before_state, f"step {index} state")
        scale = run.scaler.get_scale()
        assert math.isfinite(scale) and lower <= scale <= upper
        consecutive = consecutive + 1 if bad else 0
        skips += bad
        natural += run.overflowed and not faults
    stats = run.scaler.stats()
    assert stats["skipped_steps"] == skips
    assert stats["consecutive_skips"] == consecutive
    assert stats["steps"] == steps
    final = [p.detach().clone() for p in run.params]
    final_stats = stats

    resumed = make()
    resumed.restore(ckpt)
    for index in range(mid, steps):
        resumed.step(index, plan[index])
    for a, b in zip(final, resumed.params, strict=True):
        assert torch.equal(a, b), "a resumed run must be bit-identical to the uninterrupted one"
    assert resumed.scaler.stats() == final_stats
    return natural


def python_rule(flags: list[bool], rule: ScaleRule, init: float) -> list[float]:
    """The rule in plain Python floats, written from the docstring's pseudo-code."""
    scale, tracker, left, out = init, 0, rule.hysteresis, []
    for found in flags:
        if found:
            tracker, left = 0, left - 1
            if left <= 0:
                scale = float(torch.tensor(scale * rule.backoff_factor, dtype=torch.float32))
        else:
            tracker += 1
            if rule.hysteresis_refill == "clean":
                left = rule.hysteresis
            if tracker == rule.growth_interval:
                tracker, left = 0, rule.hysteresis
                grown = float(torch.tensor(scale * rule.growth_factor, dtype=torch.float32))
                if math.isfinite(grown):
                    scale = grown
        left = max(left, 0)
        scale = min(max(scale, rule.lower), rule.upper)
        out.append(scale)
    return out


@settings(max_examples=60, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
    hysteresis=st.integers(1, 4),
    refill=st.sampled_from(["clean", "growth"]),
    interval=st.integers(1, 5),
    exponent=st.integers(-10, 30),
    bounds=st.sampled_from([(None, None), (2.0**-3, None), (None, 2.0**12), (1.0, 2.0**8)]),
)
def test_rule_matches_its_pseudo_code(flags, hysteresis, refill, interval, exponent, bounds) -> None:
    rule = ScaleRule(
        growth_interval=interval,
        hysteresis=hysteresis,
        hysteresis_refill=refill,
        min_scale=bounds[0],
        max_scale=bounds[1],
    )
    init = min(max(2.0**exponent, rule.lower), rule.upper)
    scale, tracker = torch.tensor(init), torch.tensor(0, dtype=torch.int32)
    left = torch.tensor(hysteresis, dtype=torch.int32)
    got = []
    for found in flags:
        update_scale_(scale, tracker, left, torch.tensor(float(found)), rule)
        got.append(float(scale))
    assert got == python_rule(flags, rule, init)
    assert all(s >= SCALE_FLOOR for s in got)
