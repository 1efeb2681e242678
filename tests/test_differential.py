"""Bit-identical to torch.amp.GradScaler: the same seeded runs, compared after every step."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import gradscaler
from helpers import MODES, OPTIMIZERS, assert_same_trace, run

INF, NAN = float("inf"), float("nan")
# Injected faults: single, consecutive (steps 8-9), each kind, in different parameters.
FAULTS = {3: [(0, INF)], 8: [(2, NAN)], 9: [(1, -INF)], 21: [(3, INF), (0, NAN)]}
SETTINGS = {"init_scale": 2.0**12, "growth_interval": 4}  # both growth and backoff happen


def both(**kwargs: object) -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = run(gradscaler.GradScaler("cpu", **SETTINGS), **kwargs)
        theirs = run(torch.amp.GradScaler("cpu", **SETTINGS), **kwargs)
    return ours, theirs


@pytest.mark.parametrize(
    ("model", "optimizer", "mode", "recipe"),
    list(itertools.product(("mlp", "transformer"), OPTIMIZERS, MODES, ("plain", "unscale", "unscale_clip"))),
)
def test_fp16_autocast_run_is_bit_identical(model: str, optimizer: str, mode: str, recipe: str) -> None:
    ours, theirs = both(model=model, optimizer=optimizer, mode=mode, recipe=recipe, inject=FAULTS, steps=50)
    assert_same_trace(ours, theirs)
    assert sum(ours.skipped) >= len(FAULTS)
    scales = ours.scales
    assert any(b > a for a, b in itertools.pairwise(scales)), "no growth happened"
    assert any(b < a for a, b in itertools.pairwise(scales)), "no backoff happened"


@pytest.mark.parametrize(("optimizer", "mode"), list(itertools.product(OPTIMIZERS, MODES)))
def test_fp32_run_is_bit_identical(optimizer: str, mode: str) -> None:
    ours, theirs = both(optimizer=optimizer, mode=mode, autocast=False, inject=FAULTS, steps=50)
    assert_same_trace(ours, theirs)


def test_non_power_of_two_factors_are_bit_identical() -> None:
    settings = {"init_scale": 3000.0, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3}
    kwargs = {"optimizer": "adamw", "mode": "foreach", "inject": FAULTS, "steps": 40}
    ours = run(gradscaler.GradScaler("cpu", **settings), **kwargs)
    theirs = run(torch.amp.GradScaler("cpu", **settings), **kwargs)
    assert_same_trace(ours, theirs)
