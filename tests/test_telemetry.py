"""Skip signal, stats, history, loggers and overflow attribution."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradscaler import GradScaler, JsonLinesLogger
from gradscaler.record.telemetry import COUNTERS, IN_FLIGHT, RECORDS_PER_COPY, SATURATE, Telemetry, make_telemetry


def steps(
    scaler: GradScaler, flags: list[bool], fused: bool = False, model: nn.Module | None = None
) -> tuple[torch.optim.Optimizer, list[bool]]:
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    scaler.name_parameters(model)
    seen = []
    for bad in flags:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        if bad:
            model[1].bias.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        seen.append(scaler.last_step_skipped())
    return opt, seen


def test_last_step_skipped_and_device_flag_with_fused_optimizer() -> None:
    scaler = GradScaler("cpu", init_scale=16.0)
    assert not scaler.last_step_skipped() and scaler.last_found_inf() is None
    _, seen = steps(scaler, [False, True, False, True, True], fused=True)
    assert seen == [False, True, False, True, True]
    flag = scaler.last_found_inf()
    assert isinstance(flag, torch.Tensor) and flag.dim() == 0 and float(flag) == 1.0


def test_scheduler_steps_only_on_real_steps() -> None:
    scaler = GradScaler("cpu", init_scale=16.0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model.bias.grad[0] = math.nan
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped():
            sched.step()
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.25


def test_stats_counts_and_history() -> None:
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=2, history=4)
    flags = [False, False, True, True, False, False, False]
    steps(scaler, flags)
    stats = scaler.stats()
    assert stats["steps"] == 7 and stats["skipped_steps"] == 2 and stats["consecutive_skips"] == 0
    assert stats["growths"] == 2 and stats["backoffs"] == 2 and stats["scale"] == 16.0
    history = scaler.history()
    assert history["skipped"] == [True, False, False, False]  # the last 4 steps, oldest first
    assert history["scale"] == [8.0, 8.0, 16.0, 16.0]


def test_counters_saturate() -> None:
    scaler = GradScaler("cpu", init_scale=16.0)
    state = {
        "scale": 16.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
        "skipped_steps": SATURATE,
        "consecutive_skips": SATURATE,
    }
    scaler.load_state_dict(state)
    steps(scaler, [True, True])
    stats = scaler.stats()
    assert stats["skipped_steps"] == SATURATE and stats["consecutive_skips"] == SATURATE


def test_json_lines_logger(tmp_path) -> None:
    path = tmp_path / "scaler.jsonl"
    scaler = GradScaler("cpu", init_scale=16.0)
    scaler.add_logger(JsonLinesLogger(path), every=2)
    steps(scaler, [False, True, False, False])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert records[0]["skipped_steps"] == 1 and records[0]["scale"] == 8.0
    assert records[1]["consecutive_skips"] == 0


def test_overflow_attribution_by_name_and_by_position() -> None:
    scaler = GradScaler("cpu", init_scale=16.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))  # a module named whole: named while it lives
    opt, _ = steps(scaler, [True], model=model)  # the scaler holds optimizers weakly: keep it alive
    assert scaler.nonfinite_parameters() == ["1.bias"]
    del opt, model
    anonymous = GradScaler("cpu", init_scale=16.0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    anonymous.scale(model(torch.ones(1, 2)).sum()).backward()
    model.weight.grad[0, 0] = math.nan
    anonymous.step(opt)
    anonymous.update()
    assert anonymous.nonfinite_parameters() == ["param_groups[0][0] (2, 2)"]


def test_last_grad_norms_come_from_the_clipping_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = GradScaler("cpu", init_scale=64.0)
    scaler.name_parameters(model)
    assert scaler.last_grad_norms() == {}
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    expected = {name: float(torch.linalg.vector_norm(p.grad.double() / 64)) for name, p in model.named_parameters()}
    scaler.clip_grad_norm_(opt, 1e9)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)  # still available: the norms live on the device
    got = scaler.last_grad_norms()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.sampled_from([0.5, 1.0, 2.0, 4.0]), st.sampled_from([0.5, 1.0, 2.0, 4.0]))),
    st.integers(1, 5),
    st.lists(st.integers(0, SATURATE), min_size=5, max_size=5),
)
def test_host_and_device_keepers_agree(
    records: list[tuple[bool, float, float]], history: int, start: list[int]
) -> None:
    """The CPU keeper (Python numbers) and the device keeper (batched copies) count and remember the same.
    A scale before a record that is not the last record's after was set outside the rule: ``rebase``."""
    device = torch.device("cpu")
    keepers = [make_telemetry(device, history, start, on_host=on_host) for on_host in (True, False)]
    lower = 1.0
    last = None
    for found, before, after in records:
        flag, scale = torch.tensor(float(found)), torch.full((), before)
        for keeper in keepers:
            if before != last:
                keeper.rebase()
            kept, _ = keeper.before(scale)
            keeper.record_(flag, kept, torch.full((), after), lower)
        last = after
        host, device_kept = (k.read() for k in keepers)
        assert host == device_kept
        assert keepers[0].landed() == keepers[1].landed()
    assert keepers[0].histories() == keepers[1].histories()
    assert len(keepers[0].histories()[0]) == min(len(records), history)
    expected = list(start)  # the rule in words: runs reset on a record without their event
    for found, before, after in records:
        expected[0] = min(expected[0] + found, SATURATE)
        expected[1] = min(expected[1] + 1, SATURATE) if found else 0
        expected[2] = min(expected[2] + (after > before), SATURATE)
        expected[3] = min(expected[3] + (after < before), SATURATE)
        expected[4] = min(expected[4] + 1, SATURATE) if found and before <= lower else 0
    assert list(keepers[0].read().values()) == expected


def test_device_keeper_lands_every_record_in_order_with_what_it_carries() -> None:
    """Records not yet read stay queued, each with its own copy; ``wait`` drains them all."""
    keeper = make_telemetry(torch.device("cpu"), 4, [0] * len(COUNTERS), on_host=False)
    scale = torch.full((), 8.0)
    for step, found in enumerate([0.0, 1.0, 0.0]):
        before, _ = keeper.before(scale)
        after = scale * (0.5 if found else 1.0)
        keeper.record_(torch.tensor(found), before, after, 1.0, tag=step, carry=torch.tensor([float(step)]))
        scale = after
    landed = keeper.landed(wait=True)
    assert [(r.tag, r.skipped, r.changed, r.carried.tolist()) for r in landed] == [  # type: ignore[union-attr]
        (0, False, False, [0.0]),
        (1, True, True, [1.0]),
        (2, False, False, [2.0]),
    ]
    assert [r.counters["skipped_steps"] for r in landed] == [0, 1, 1]
    assert [r.counters["scale"] for r in landed] == [8.0, 4.0, 4.0]
    assert keeper.landed() == []


def test_unread_records_are_bounded() -> None:
    keeper = make_telemetry(torch.device("cpu"), 4, [0] * len(COUNTERS), on_host=False)
    scale = torch.full((), 8.0)
    for step in range(IN_FLIGHT + 3):
        keeper.record_(torch.tensor(0.0), keeper.before(scale)[0], scale, 1.0, tag=step)
    assert [r.tag for r in keeper.landed(wait=True)] == list(range(3, IN_FLIGHT + 3))
    assert keeper.read()["skipped_steps"] == 0 and keeper.histories()[0] == [8.0] * 4  # every record counted


class _CopyFails(torch.Tensor):
    """A scale whose copy runs out of memory, as a device allocation can."""

    def clone(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("no memory for the record's copy")


def test_a_record_whose_copy_fails_leaves_nothing_behind() -> None:
    """The device keeper's flag, scale and notes of one record are kept together or not at all: a copy that
    fails leaves the pending batch as it was, and every later record lands as if the failed one was never made."""
    keepers = [make_telemetry(torch.device("cpu"), 8, [0] * len(COUNTERS), on_host=False) for _ in range(2)]
    scale = torch.full((), 8.0)
    failing = keepers[0]
    failing.record_(torch.tensor(1.0), failing.before(scale)[0], scale, 1.0)
    with pytest.raises(torch.OutOfMemoryError):
        failing.record_(torch.tensor(1.0), failing.before(scale)[0], scale.as_subclass(_CopyFails), 1.0)
    keepers[1].record_(torch.tensor(1.0), keepers[1].before(scale)[0], scale, 1.0)
    for step in range(RECORDS_PER_COPY + 3):
        for keeper in keepers:
            keeper.record_(torch.tensor(float(step % 3 == 0)), keeper.before(scale)[0], scale, 1.0, tag=step)
    assert [r.tag for r in failing.landed(wait=True)] == [r.tag for r in keepers[1].landed(wait=True)]
    assert failing.read() == keepers[1].read() and failing.histories() == keepers[1].histories()


@pytest.mark.parametrize("failing", ["monitor", "record"])
def test_an_update_whose_record_fails_leaves_the_later_records_right(
    failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scale moved, then the record's bookkeeping raised (an allocation on the device can): that update has
    no record, and every later one is the scale the device holds. The device keeper computes its records from
    the scale and growth tracker it last knew: after such a failure it copies them again, as the host keeper
    reads them, so the two agree (without that copy the computed history drifts a growth off for good)."""
    from gradscaler.record import monitor

    runs = {}
    for route in ("generic", "auto"):
        monkeypatch.setenv("GRADSCALER_KERNEL", route)
        scaler, backward_and_step = _scaler_and_step(history=32)
        for step in range(12):
            backward_and_step(overflow=step == 7)
            if step == 4:
                with monkeypatch.context() as patch:
                    target = monitor.Monitor if failing == "monitor" else type(scaler._telemetry)
                    patch.setattr(target, "record_update" if failing == "monitor" else "record_", _raises)
                    with pytest.raises(torch.OutOfMemoryError):
                        scaler.update()
                scaler._per_optimizer_states.clear()  # the iteration is over, record or not
            else:
                scaler.update()
        runs[route] = (scaler.history(), scaler.stats(), scaler.get_scale())
    assert runs["generic"] == runs["auto"]
    assert runs["auto"][0]["scale"][-1] == runs["auto"][2]


def _raises(*args: object, **kwargs: object) -> None:
    raise torch.OutOfMemoryError("no memory for the record")


def _scaler_and_step(history: int, **options: Any) -> tuple[GradScaler, Callable[[bool], None]]:
    """A scaler growing every 3 clean steps over one parameter (or as ``options`` say), and its iteration up to
    ``update()``: zero_grad, the scaled backward (an inf loss when ``overflow``), the step."""
    options = {"init_scale": 4.0, "growth_interval": 3, "collapse_patience": None, **options}
    scaler = GradScaler("cpu", history=history, **options)
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.01)

    def backward_and_step(overflow: bool) -> None:
        opt.zero_grad()
        scaler.scale(param.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)

    return scaler, backward_and_step


def test_a_scale_written_outside_the_scaler_costs_at_most_one_batch_of_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A script that writes the scale's tensor itself (torch's private ``_scale``, which some do): the device keeper
    checks its computed records against the scale each batch carries, copies scale and tracker again on a
    difference, and from the next batch on reports what the host keeper reads (it drifted for good without it)."""
    runs = {}
    for route in ("generic", "auto"):
        monkeypatch.setenv("GRADSCALER_KERNEL", route)
        scaler, backward_and_step = _scaler_and_step(history=64)
        for step in range(3 * RECORDS_PER_COPY):
            if step == 5:
                scaler._get_scale_async().fill_(1024.0)  # type: ignore[union-attr]
            backward_and_step(overflow=step % 7 == 6)
            scaler.update()
        runs[route] = scaler.history()["scale"], scaler.get_scale()
    (device, scale), (host, _) = runs["generic"], runs["auto"]
    assert device[-1] == scale
    assert device[RECORDS_PER_COPY:] == host[RECORDS_PER_COPY:]  # all but the batch of the write


def test_a_device_whose_kernel_rounds_otherwise_copies_every_record() -> None:
    """MPS's ``_amp_update_scale_`` multiplies in float32: no record of a scale there is computed on the host."""
    from gradscaler.record.telemetry import Telemetry
    from gradscaler.rule import ScaleRule

    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    kept = []
    for device in ("cpu", "mps"):
        keeper = Telemetry(torch.device(device), 4, [0] * len(COUNTERS))
        keeper.record_(torch.tensor(0.0), keeper.before(scale, tracker, ScaleRule())[0], scale, 1.0)
        kept.append(len(keeper._afters))  # the pending records' copied scales (one batch: not yet sent)
    assert kept == [0, 1]


@settings(max_examples=40, deadline=None)
@given(
    overflows=st.sets(st.integers(0, 3 * RECORDS_PER_COPY + 5), max_size=5),
    interval=st.sampled_from([1, 2, 5, RECORDS_PER_COPY - 1, RECORDS_PER_COPY, RECORDS_PER_COPY + 1, 40, 2000]),
    history=st.sampled_from([3, RECORDS_PER_COPY, 64]),
    every=st.sampled_from([None, 1, 5]),
    rebased_at=st.one_of(st.none(), st.integers(0, 3 * RECORDS_PER_COPY + 5)),
)
def test_the_device_keepers_computed_records_are_the_host_keepers(
    overflows: set[int], interval: int, history: int, every: int | None, rebased_at: int | None
) -> None:
    """Runs of clean updates that grow no scale (a batch of them is accounted at once), growths, overflows, a
    scale set between two updates, a logger: the device route's history, counters, scale and log are the ones the
    host route reads each update."""
    runs = []
    for route in ("generic", "auto"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GRADSCALER_KERNEL", route)
            scaler, backward_and_step = _scaler_and_step(history, init_scale=2.0**10, growth_interval=interval)
            logged: list[dict] = []
            if every is not None:
                scaler.add_logger(logged.append, every=every)
            for step in range(3 * RECORDS_PER_COPY + 6):
                backward_and_step(step in overflows)
                scaler.update(2.0**12 if step == rebased_at else None)
            runs.append((scaler.history(), scaler.stats(), scaler.get_scale(), logged))
    assert runs[0] == runs[1]


class _LateEvent:
    """A batch's copy event that says it landed only after ``lag`` queries: a GPU running behind the host."""

    def __init__(self, lag: int) -> None:
        self.lag = lag

    def query(self) -> bool:
        self.lag -= 1
        return self.lag < 0

    def synchronize(self) -> None:
        self.lag = 0


@pytest.mark.parametrize(
    ("factors", "init", "bounds", "overflow"),
    [
        ((2.0, 0.5), 2.0**10, (2.0**8, 2.0**12), lambda step: step % 5 in (1, 2)),  # bounds a few updates away
        ((2.0, 1.0 - 1.4 * 2.0**-24), 1.0 + 2.0**-16, (1.0, None), lambda step: True),  # backoffs drift to min_scale
        ((1.0 + 1.4 * 2.0**-23, 0.5), 2.0**20 - 24.0, (None, 2.0**20), lambda step: False),  # growths to max_scale
    ],
)
@pytest.mark.parametrize("lag", [3, 70])
def test_records_landing_late_skip_no_clamp_a_bound_needs(
    factors: tuple, init: float, bounds: tuple, overflow: Callable[[int], bool], lag: int
) -> None:
    """On CUDA the host runs ahead of the records that have landed (up to a thousand updates): the device keeper
    skips an update's clamp only while the scale, unseen since the last landed record, cannot have reached a bound,
    each unseen update counted with its float32 rounding. Copies landing ``lag`` updates late (a CPU run cannot
    make them), the scales and records are the host keeper's, which reads the scale at every update."""
    growth, backoff = factors
    real = Telemetry._flush

    def late(keeper: Telemetry, check: torch.Tensor | None = None) -> None:
        before = len(keeper._in_flight)
        real(keeper, check)
        if len(keeper._in_flight) > before:  # a batch was sent
            keeper._in_flight[-1] = keeper._in_flight[-1]._replace(event=_LateEvent(lag))

    runs = []
    for route in ("generic", "auto"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GRADSCALER_KERNEL", route)
            patch.setattr(Telemetry, "_flush", late)  # the host keeper (auto) sends no batch
            scaler, backward_and_step = _scaler_and_step(
                256, init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=1,
                min_scale=bounds[0], max_scale=bounds[1],
            )  # fmt: skip
            held = []  # the scale the device holds after each update (a read of the tensor: no telemetry)
            for step in range(200):
                backward_and_step(overflow(step))
                scaler.update()
                held.append(scaler.get_scale())
            runs.append((held, scaler.history(), scaler.stats()))
    assert runs[0] == runs[1]
    assert all((bounds[0] or 0.0) <= scale <= (bounds[1] or math.inf) for scale in runs[0][0])
