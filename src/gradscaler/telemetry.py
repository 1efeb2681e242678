"""Counters and a bounded history of the scale, kept where the scale lives and read without blocking.

Every ``update()`` adds one record. Two keepers share one accounting (``events`` and ``CONSECUTIVE``):

* ``Telemetry``, for a scale on an accelerator: a handful of tiny device ops per record, nothing read
  back. The host sees the counters through a mirror: after each record they are copied into (pinned,
  on CUDA) host memory without blocking, and the host reads the copy once it has landed, normally one
  step later. Works under CUDA-graph capture (the counters then stay on the device).
* ``HostTelemetry``, for a scale in host memory (the CPU): the record is kept in Python numbers. Reading
  a CPU tensor costs what reading a float does, while each tiny tensor op costs 1-2 us of dispatch:
  this keeper costs ~3 us per record where ``Telemetry`` costs ~30.

``make_telemetry`` picks one. ``stats()`` reads the current values and may sync; the per-step path never does.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, TypeVar

import torch

COUNTERS = ("skipped_steps", "consecutive_skips", "growths", "backoffs", "collapse_run")
CONSECUTIVE = (False, True, False, False, True)
"""Which counters count a run of consecutive events: they fall back to 0 on a record without their event."""
SATURATE = 2**62
"""Counters stop here rather than wrap (int64)."""

_Event = TypeVar("_Event")


def events(skipped: _Event, grew: _Event, shrank: _Event, skipped_at_floor: _Event) -> tuple[_Event, ...]:
    """The event that advances each counter, in ``COUNTERS`` order (Python bools or device bool tensors)."""
    return skipped, skipped, grew, shrank, skipped_at_floor


class Keeper(Protocol):
    """What the scaler asks of a telemetry keeper."""

    def before(self, scale: torch.Tensor) -> Any: ...
    def record_(self, found: torch.Tensor, before: Any, after: torch.Tensor, lower: float) -> None: ...
    def landed(self) -> dict[str, Any] | None: ...
    def read(self) -> dict[str, int]: ...
    def load(self, counters: list[int]) -> None: ...
    def histories(self) -> tuple[list[float], list[bool]]: ...


def make_telemetry(device: torch.device, history: int, counters: list[int], *, on_host: bool) -> Keeper:
    """``HostTelemetry`` when ``on_host`` (the scale is in host memory), else ``Telemetry`` on ``device``."""
    return HostTelemetry(history, counters) if on_host else Telemetry(device, history, counters)


class Telemetry:
    """Device-side counters of one scaler.

    ``counters`` (int64): skipped steps, consecutive skips, growths, backoffs, and consecutive
    overflows at the minimum scale (``collapse_run``). ``ring`` holds the last ``history`` steps (scale
    after the update, overflow flag); ``cursor`` (a device tensor) counts the records written.
    """

    def __init__(self, device: torch.device, history: int, counters: list[int]) -> None:
        self.history = history
        self.counters = torch.tensor(counters, dtype=torch.int64, device=device)
        self._kept = torch.tensor([not c for c in CONSECUTIVE], dtype=torch.int64, device=device)
        self.ring = torch.full((history, 2), math.nan, dtype=torch.float32, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # records written (a device tensor: graph-safe)
        pin = device.type == "cuda"
        self._mirror = torch.zeros(len(COUNTERS), dtype=torch.int64, pin_memory=pin)
        self._scale_mirror = torch.zeros((), dtype=torch.float32, pin_memory=pin)
        self._event: Any = None

    def before(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale as it is now, to pass to ``record_`` after the update (a device copy)."""
        return scale.clone()

    def record_(self, found: torch.Tensor, before: torch.Tensor, after: torch.Tensor, lower: float) -> None:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it."""
        skipped = found != 0
        happened = torch.stack(events(skipped, after > before, after < before, skipped & (before <= lower))).long()
        # counter = (counter + event) * (event or not CONSECUTIVE): counts, and runs that reset to 0
        self.counters.add_(happened).mul_(happened.bitwise_or_(self._kept)).clamp_(max=SATURATE)
        slot = self.cursor.remainder(self.history)
        self.ring.index_copy_(0, slot, torch.stack([after, found]).view(1, 2))
        self.cursor.add_(1)
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # under CUDA-graph capture the counters stay on the device: read them with stats()
        self._mirror.copy_(self.counters, non_blocking=True)
        self._scale_mirror.copy_(after, non_blocking=True)
        if self.counters.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def landed(self) -> dict[str, Any] | None:
        """Counters and scale as of the last record whose copy has landed on the host, else None. No sync."""
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # an event cannot be queried while a graph is being captured
        if self._event is not None and not self._event.query():
            return None
        landed: dict[str, Any] = dict(zip(COUNTERS, self._mirror.tolist(), strict=True))
        landed["scale"] = self._scale_mirror.tolist()
        return landed

    def read(self) -> dict[str, int]:
        """The current counters (syncs with the device)."""
        return dict(zip(COUNTERS, self.counters.tolist(), strict=True))

    def load(self, counters: list[int]) -> None:
        """Replace the counters (no sync)."""
        self.counters.copy_(self.counters.new_tensor(counters))

    def histories(self) -> tuple[list[float], list[bool]]:
        """Scale and skip flag of the last ``min(steps, history)`` steps, oldest first (syncs)."""
        steps = int(self.cursor.tolist()[0])
        count = min(steps, self.history)
        order = [(steps - count + i) % self.history for i in range(count)]
        rows = self.ring[torch.tensor(order, dtype=torch.long, device=self.ring.device)].tolist()
        return [scale for scale, _ in rows], [found != 0 for _, found in rows]


class HostTelemetry:
    """The counters and history of ``Telemetry`` as Python numbers, for a scale in host memory.

    A record in which nothing moves (a clean step, no growth, no run to reset, the scale as last
    landed: most steps) only writes the ring, and ``landed`` returns the same dict as before.
    """

    def __init__(self, history: int, counters: list[int]) -> None:
        self.history = history
        self._scales = [math.nan] * history
        self._skipped = [False] * history
        self._records = 0
        self._counters: list[int] = []
        self._landed: dict[str, Any] = {}
        self.load(counters)

    def before(self, scale: torch.Tensor) -> float:
        """The scale as it is now, to pass to ``record_`` after the update."""
        return scale.item()

    def record_(self, found: torch.Tensor, before: float, after: torch.Tensor, lower: float) -> None:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it."""
        skipped, now = found.item() != 0, after.item()
        happened = events(skipped, now > before, now < before, skipped and before <= lower)
        if any(happened) or any(self._counters[i] for i in _RUNS) or now != self._landed["scale"]:
            self._counters = [
                0 if run and not event else min(count + event, SATURATE)
                for count, event, run in zip(self._counters, happened, CONSECUTIVE, strict=True)
            ]
            self._publish(now)
        slot = self._records % self.history
        self._scales[slot], self._skipped[slot] = now, skipped
        self._records += 1

    def landed(self) -> dict[str, Any] | None:
        """The current counters and scale (nothing to wait for on the host). Read-only: shared between calls."""
        return self._landed if self._records else None

    def read(self) -> dict[str, int]:
        """The current counters."""
        return dict(zip(COUNTERS, self._counters, strict=True))

    def load(self, counters: list[int]) -> None:
        """Replace the counters."""
        self._counters = list(counters)
        self._publish(self._scales[(self._records - 1) % self.history] if self._records else None)

    def _publish(self, scale: float | None) -> None:
        """Make the current counters and ``scale`` what ``landed`` returns."""
        self._landed = {**self.read(), "scale": scale}

    def histories(self) -> tuple[list[float], list[bool]]:
        """Scale and skip flag of the last ``min(steps, history)`` steps, oldest first."""
        count = min(self._records, self.history)
        order = [(self._records - count + i) % self.history for i in range(count)]
        return [self._scales[i] for i in order], [self._skipped[i] for i in order]


_RUNS = [i for i, run in enumerate(CONSECUTIVE) if run]
