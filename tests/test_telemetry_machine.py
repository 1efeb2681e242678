"""The device keeper (records batched to the host) against the host keeper, in any order of calls.

Two scalers train the same parameter with the same gradients: one keeps its telemetry with the device
route's ``Telemetry`` (under torch's rule each scale after an update computed on the host from the flags,
under a rule with hysteresis copied; ``RECORDS_PER_COPY`` records per copy to the host), the other with
``HostTelemetry`` (every value read at once). Hypothesis picks the order of updates (clean or overflowing),
scales set by ``update(new_scale)``, loads (of a growth tracker and a hysteresis too), policy changes, growth
intervals, a logger attached mid-run and reads; whatever the order, the two report the same ``stats()``,
``history()``, ``state_dict()`` and logged records, and the same scale.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gradscaler import GradScaler
from gradscaler.record.telemetry import HostTelemetry, Telemetry


def _scaler(route: str, monkeypatch: pytest.MonkeyPatch) -> GradScaler:
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, history=8, collapse_patience=None)
    with monkeypatch.context() as patch:
        patch.setenv("GRADSCALER_KERNEL", route)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    return scaler


class KeeperMachine(RuleBasedStateMachine):
    """``device`` and ``host`` scalers driven alike; their reports must agree whenever read."""

    monkeypatch: pytest.MonkeyPatch

    @initialize()
    def build(self) -> None:
        self.scalers = {"device": _scaler("generic", self.monkeypatch), "host": _scaler("auto", self.monkeypatch)}
        assert isinstance(self.scalers["device"]._telemetry, Telemetry)
        assert isinstance(self.scalers["host"]._telemetry, HostTelemetry)
        self.params = {name: torch.nn.Parameter(torch.ones(3)) for name in self.scalers}
        self.opts = {name: torch.optim.SGD([p], lr=0.01) for name, p in self.params.items()}
        self.logs: dict[str, list[dict[str, Any]]] = {name: [] for name in self.scalers}

    def _each(self) -> Any:
        return ((self.scalers[n], self.opts[n], self.params[n], n) for n in self.scalers)

    @rule(overflow=st.booleans(), repeat=st.integers(1, 20))
    def iterations(self, overflow: bool, repeat: int) -> None:
        for _ in range(repeat):
            for scaler, opt, param, _ in self._each():
                opt.zero_grad()
                scaler.scale(param.sum() * (float("inf") if overflow else 1.0)).backward()
                scaler.step(opt)
                scaler.update()

    @rule(value=st.sampled_from([0.1, 1.0, 3.0, 2.0**-125, 2.0**20]))
    def set_scale(self, value: float) -> None:
        for scaler, *_ in self._each():
            scaler.update(value)

    @rule(tensor=st.booleans())
    def set_scale_as_tensor(self, tensor: bool) -> None:
        for scaler, *_ in self._each():
            scaler.update(torch.tensor(6.0) if tensor else 6)

    @rule(factor=st.sampled_from([1.5, 2.0, 4.0]), backoff=st.sampled_from([0.25, 0.5, 0.75]))
    def policy(self, factor: float, backoff: float) -> None:
        for scaler, *_ in self._each():
            scaler.set_growth_factor(factor)
            scaler.set_backoff_factor(backoff)

    @rule(interval=st.sampled_from([1, 2, 3]))
    def set_interval(self, interval: int) -> None:
        for scaler, *_ in self._each():
            scaler.set_growth_interval(interval)  # clamps a tracker past it: the device keeper copies it again

    @rule(hysteresis=st.sampled_from([1, 2]), tracker=st.integers(0, 2))
    def load_hysteresis(self, hysteresis: int, tracker: int) -> None:
        """A rule torch's kernel does not compute (hysteresis 2: the device keeper copies each scale) and back,
        with a growth tracker set by the load."""
        state = self.scalers["host"].state_dict()
        if "hysteresis" not in state:
            return  # not yet stepped: the state dict is torch's
        tracker = min(tracker, state["growth_interval"] - 1)
        state.update(hysteresis=hysteresis, _hysteresis_tracker=hysteresis, _growth_tracker=tracker)
        for scaler, *_ in self._each():
            scaler.load_state_dict(dict(state))

    @rule(skipped=st.integers(0, 5), scale=st.sampled_from([1.0, 64.0]))
    def load(self, skipped: int, scale: float) -> None:
        state = self.scalers["host"].state_dict()
        state.update(scale=scale)
        if "skipped_steps" in state:
            state["skipped_steps"] = skipped
        for scaler, *_ in self._each():
            scaler.load_state_dict(dict(state))

    @rule()
    def attach_logger(self) -> None:
        for scaler, *_, name in self._each():
            scaler.add_logger(self.logs[name].append)

    @rule()
    def read(self) -> None:
        device, host = self.scalers["device"], self.scalers["host"]
        assert device.stats() == host.stats()
        assert device.history() == host.history()
        assert device.state_dict() == host.state_dict()
        assert self.logs["device"] == self.logs["host"]

    def teardown(self) -> None:
        if hasattr(self, "scalers"):
            self.read()  # every run ends with the full comparison, whether or not it drew a read

    @invariant()
    def same_scale(self) -> None:
        device, host = self.scalers["device"], self.scalers["host"]
        assert device._scale is not None and host._scale is not None
        assert torch.equal(device._scale, host._scale)  # the clamp skipped only where it changes nothing


def test_the_device_keeper_reports_what_the_host_keeper_does(monkeypatch: pytest.MonkeyPatch) -> None:
    KeeperMachine.monkeypatch = monkeypatch
    run = settings(max_examples=60, stateful_step_count=30, deadline=None)(KeeperMachine).TestCase
    run().runTest()
