"""The scaler log (version 2): what a record says, on the CPU path and on the device path.

``GRADSCALER_KERNEL=generic`` makes the CPU take the device path (per-tensor results carried with the
telemetry, names resolved once landed); the default CPU path reads the gradients of a skipped step
again at ``update()``. Both must write the same log.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradscaler import GradScaler, JsonLinesLogger

PATHS = ["host", "generic"]


@pytest.fixture(params=PATHS)
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "generic":
        monkeypatch.setenv("GRADSCALER_KERNEL", "generic")
    return str(request.param)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(
    scaler: GradScaler,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    bad: dict[int, list[str]],
    recipe: str = "clip",
) -> list[torch.Tensor]:
    """``steps`` iterations; at step ``s`` (1-based) a NaN goes into each parameter named in ``bad[s]``.
    Returns the clipping norms (or nothing)."""
    params = dict(model.named_parameters())
    norms = []
    torch.manual_seed(1)
    for step in range(1, steps + 1):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).pow(2).mean()).backward()
        for name in bad.get(step, []):
            params[name].grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        if recipe == "clip":
            norms.append(scaler.clip_grad_norm_(opt, 0.5))
        elif recipe == "unscale":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return norms


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sixty_steps_three_overflows_in_one_named_parameter(path_kind: str, tmp_path: Path) -> None:
    """The acceptance run: 60 records, 3 skipped naming the parameter, a clipping norm on every one."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    scaler.name_parameters(model)
    log = tmp_path / "scaler.jsonl"
    scaler.add_logger(JsonLinesLogger(log), every=1)
    norms = train(scaler, model, opt, 60, {12: ["2.weight"], 30: ["2.weight"], 47: ["2.weight"]})
    records = read_log(log)
    assert [r["step"] for r in records] == list(range(1, 61))
    assert all(r["version"] == 2 for r in records)
    skipped = [r for r in records if r["skipped"]]
    assert [r["step"] for r in skipped] == [12, 30, 47]
    assert all(r["nonfinite"] == ["2.weight"] for r in skipped)
    # the value clip_grad_norm_ returned, NaN on the skipped steps (repr: NaN == NaN)
    assert [repr(r["grad_norm"]) for r in records] == [repr(n.item()) for n in norms]
    assert all(math.isnan(r["grad_norm"]) for r in skipped)
    assert [r["skipped_steps"] for r in records][-1] == 3
    changed = [r for r in records if "nonfinite" in r]
    scales = [2.0**10] + [r["scale"] for r in records]
    assert [r["step"] for r in changed] == [i for i in range(1, 61) if scales[i] != scales[i - 1] or i in (12, 30, 47)]
    assert all(r["nonfinite"] == [] for r in changed if not r["skipped"])  # growths: nothing overflowed
    assert records[0]["policy"] == {
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 10,
        "hysteresis": 1,
        "min_scale": None,
        "max_scale": None,
    }
    assert all("policy" not in r for r in records[1:])


@pytest.mark.parametrize("recipe", ["plain", "unscale", "clip"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_every_recipe_names_the_same_parameters_on_both_paths(
    recipe: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused check, torch's unscale kernel and the clipping pass: each path attributes; unnamed by position."""
    logs = []
    for kind in PATHS:
        monkeypatch.setenv("GRADSCALER_KERNEL", "generic" if kind == "generic" else "auto")
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        scaler.name_parameters([("first.weight", model[0].weight)])
        records: list[dict[str, Any]] = []
        scaler.add_logger(records.append)
        train(scaler, model, opt, 8, {2: ["0.weight", "2.bias"], 6: ["2.bias"]}, recipe)
        logs.append(records)
    norms = [[r.pop("grad_norm", None) for r in records] for records in logs]
    assert logs[0] == logs[1]
    for host, device in zip(*norms, strict=True):  # the two read passes sum in different orders
        assert host is device is None or host == pytest.approx(device, rel=1e-6, nan_ok=True)
    assert [r["nonfinite"] for r in logs[0] if r["skipped"]] == [
        ["first.weight", "param_groups[0][3] (3,)"],
        ["param_groups[0][3] (3,)"],
    ]
    assert all((norm is not None) == (recipe == "clip") for norm in norms[0])


def test_every_n_and_a_policy_change(path_kind: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    every2: list[dict[str, Any]] = []
    every3: list[dict[str, Any]] = []
    scaler.add_logger(every2.append, every=2)
    scaler.add_logger(every3.append, every=3)
    train(scaler, model, opt, 4, {4: ["0.bias"]}, "plain")
    scaler.set_growth_interval(7)
    train(scaler, model, opt, 3, {}, "plain")
    assert [r["step"] for r in every2] == [2, 4, 6]
    assert [r["step"] for r in every3] == [3, 6]
    assert [("policy" in r) for r in every2] == [True, False, True]
    assert [("policy" in r) for r in every3] == [True, True]
    assert every2[2]["policy"]["growth_interval"] == 7
    assert every2[1]["nonfinite"] == ["param_groups[0][1] (8,)"]


def test_more_than_twenty_nonfinite_parameters_are_counted(path_kind: str) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(2)) for _ in range(23)]
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = GradScaler("cpu")
    records: list[dict[str, Any]] = []
    scaler.add_logger(records.append)
    scaler.scale(sum(p.sum() for p in params)).backward()
    for p in params:
        p.grad[0] = float("inf")  # type: ignore[index]
    scaler.step(opt)
    scaler.update()
    assert len(records[0]["nonfinite"]) == 20
    assert records[0]["nonfinite"][0] == "param_groups[0][0] (2,)"
    assert records[0]["nonfinite_more"] == 3


def test_a_0_1_0_reader_still_finds_its_seven_fields(path_kind: str, tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu")
    scaler.add_logger(JsonLinesLogger(tmp_path / "log.jsonl"))
    train(scaler, model, opt, 2, {}, "plain")
    record = read_log(tmp_path / "log.jsonl")[1]
    assert {k: record[k] for k in ("step", "scale", "skipped_steps", "backoffs")} == {
        "step": 2,
        "scale": 2.0**16,
        "skipped_steps": 0,
        "backoffs": 0,
    }
    assert isinstance(record["consecutive_skips"], int) and record["skipped"] is False


@pytest.mark.parametrize("given", ["directory", "writer"])
def test_tensorboard_logger_writes_what_the_event_file_reads_back(given: str, tmp_path: Path) -> None:
    """Written by the real tensorboard package, read back by its EventAccumulator, compared exactly."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from gradscaler import TensorBoardLogger

    writer = SummaryWriter(str(tmp_path)) if given == "writer" else None
    logger = TensorBoardLogger(writer if writer is not None else tmp_path)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    records: list[dict[str, Any]] = []
    scaler.add_logger(records.append, every=2)
    scaler.add_logger(logger, every=2)
    train(scaler, model, opt, 12, {3: ["0.bias"], 6: ["2.weight"], 7: ["2.weight"]})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = sorted(events.Tags()["scalars"])
    assert tags == sorted(f"amp/{key}" for key in ("scale", "skipped_steps", "consecutive_skips", "growths",
                                                    "backoffs", "collapse_run", "grad_norm"))  # fmt: skip
    for tag in tags:
        key = tag.removeprefix("amp/")
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        # TensorBoard stores float32: compare with each value rounded to float32 once
        want = [(r["step"], float(torch.tensor(r[key], dtype=torch.float32))) for r in records]
        assert [(s, repr(v)) for s, v in got] == [(s, repr(v)) for s, v in want], tag
    assert [e.value for e in events.Scalars("amp/skipped_steps")] == [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_tensorboard_logger_refuses_what_it_cannot_write_to() -> None:
    from gradscaler import TensorBoardLogger

    with pytest.raises(TypeError, match=r"log directory .* or a writer with add_scalar.* got int"):
        TensorBoardLogger(3)
