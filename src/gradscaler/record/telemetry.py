"""Counters and a bounded history of the scale, kept where the scale lives and read without blocking.

Every ``update()`` adds one record. Two keepers share one accounting (``events`` and ``CONSECUTIVE``):

* ``Telemetry``, for a scale on an accelerator: a handful of tiny device ops per record, nothing read
  back. The host sees each record through a mirror: the counters, the scale before and after and the
  overflow flag (and whatever the caller asks to carry along) are copied into (pinned, on CUDA) host
  memory without blocking, and the host reads the copy once it has landed, normally one step later.
  Every record lands, in order: a copy still in flight keeps its own buffers. Works under CUDA-graph
  capture (the counters then stay on the device).
* ``HostTelemetry``, for a scale in host memory (the CPU): the record is kept in Python numbers. Reading
  a CPU tensor costs what reading a float does, while each tiny tensor op costs 1-2 us of dispatch:
  this keeper costs ~3 us per record where ``Telemetry`` costs ~30.

``make_telemetry`` picks one. ``stats()`` reads the current values and may sync; the per-step path never does.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from gradscaler.record.logfile import COUNTERS

CONSECUTIVE = (False, True, False, False, True)
"""Which counters count a run of consecutive events: they fall back to 0 on a record without their event."""
SATURATE = 2**62
"""Counters stop here rather than wrap (int64)."""
IN_FLIGHT = 1024
"""Most records ``Telemetry`` keeps unread; beyond, the oldest one's buffers take the newest (that
record is lost: only when nobody calls ``landed``, or the host runs this many updates ahead of the device)."""

_Event = TypeVar("_Event")


def events(skipped: _Event, grew: _Event, shrank: _Event, skipped_at_floor: _Event) -> tuple[_Event, ...]:
    """The event that advances each counter, in ``COUNTERS`` order (Python bools or device bool tensors)."""
    return skipped, skipped, grew, shrank, skipped_at_floor


class Landed(NamedTuple):
    """One record as the host sees it.

    ``counters``: the ``COUNTERS`` and ``"scale"`` (after the update) as Python numbers; read-only, it
    may be shared between records. ``skipped``: the update saw an overflow. ``changed``: the scale
    moved. ``tag`` and ``carried``: what the caller passed to ``record_`` (``carried`` now in host memory).
    """

    counters: dict[str, Any]
    skipped: bool
    changed: bool
    tag: Any
    carried: torch.Tensor | None


class Keeper(Protocol):
    """What the scaler asks of a telemetry keeper."""

    def before(self, scale: torch.Tensor) -> Any: ...
    def record_(
        self,
        found: torch.Tensor,
        before: Any,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> None: ...
    def landed(self, wait: bool = False) -> list[Landed]: ...
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
    after the update, overflow flag, scale before); ``cursor`` (a device tensor) counts the records written.
    """

    def __init__(self, device: torch.device, history: int, counters: list[int]) -> None:
        self.history = history
        self.counters = torch.tensor(counters, dtype=torch.int64, device=device)
        self._kept = torch.tensor([not c for c in CONSECUTIVE], dtype=torch.int64, device=device)
        self.ring = torch.full((history, 3), math.nan, dtype=torch.float32, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # records written (a device tensor: graph-safe)
        self._pin = device.type == "cuda"
        self._in_flight: deque[_Mirror] = deque()  # copies issued, oldest first
        self._free: list[_Mirror] = []  # mirrors whose copy has been read

    def before(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale as it is now, to pass to ``record_`` after the update (a device copy)."""
        return scale.clone()

    def record_(
        self,
        found: torch.Tensor,
        before: torch.Tensor,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> None:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it.

        ``tag`` (any host object) and ``carry`` (a device tensor, copied to the host without blocking
        along with the counters) come back with this record from ``landed``.
        """
        skipped = found != 0
        happened = torch.stack(events(skipped, after > before, after < before, skipped & (before <= lower))).long()
        # counter = (counter + event) * (event or not CONSECUTIVE): counts, and runs that reset to 0
        self.counters.add_(happened).mul_(happened.bitwise_or_(self._kept)).clamp_(max=SATURATE)
        slot = self.cursor.remainder(self.history)
        row = torch.stack([after, found, before])
        self.ring.index_copy_(0, slot, row.view(1, 3))
        self.cursor.add_(1)
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # under CUDA-graph capture the counters stay on the device: read them with stats()
        if len(self._in_flight) >= IN_FLIGHT:
            # Nobody reads them (no logger): reuse the oldest; copies into one buffer land in stream order.
            mirror = self._in_flight.popleft()
        else:
            mirror = self._free.pop() if self._free else _Mirror(self._pin)
        mirror.counters.copy_(self.counters, non_blocking=True)
        mirror.row.copy_(row, non_blocking=True)
        mirror.carried = None if carry is None else carry.to("cpu", non_blocking=True)
        mirror.tag = tag
        if self.counters.is_cuda:
            mirror.event = torch.cuda.Event()
            mirror.event.record()
        self._in_flight.append(mirror)

    def landed(self, wait: bool = False) -> list[Landed]:
        """The records whose copy has landed on the host since the last call, oldest first. No sync,
        unless ``wait``: then every record issued so far (the host waits for their copies)."""
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            return []  # an event cannot be queried while a graph is being captured
        out = []
        while self._in_flight:
            mirror = self._in_flight[0]
            if mirror.event is not None:
                if wait:
                    mirror.event.synchronize()
                elif not mirror.event.query():
                    break
            self._in_flight.popleft()
            after, found, before = mirror.row.tolist()
            counters: dict[str, Any] = dict(zip(COUNTERS, mirror.counters.tolist(), strict=True))
            counters["scale"] = after
            out.append(Landed(counters, found != 0, after != before, mirror.tag, mirror.carried))
            mirror.tag = mirror.carried = mirror.event = None
            self._free.append(mirror)
        return out

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
        return [row[0] for row in rows], [row[1] != 0 for row in rows]


class _Mirror:
    """Host buffers for one record's copy: counters, (scale after, flag, scale before), what was carried."""

    def __init__(self, pin: bool) -> None:
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device="cpu", pin_memory=pin)
        self.row = torch.zeros(3, dtype=torch.float32, device="cpu", pin_memory=pin)
        self.carried: torch.Tensor | None = None
        self.tag: Any = None
        self.event: Any = None


class HostTelemetry:
    """The counters and history of ``Telemetry`` as Python numbers, for a scale in host memory.

    A record in which nothing moves (a clean step, no growth, no run to reset, the scale as last
    landed: most steps) only writes the ring, and its record shares the counters dict of the one before.
    """

    def __init__(self, history: int, counters: list[int]) -> None:
        self.history = history
        self._scales = [math.nan] * history
        self._skipped = [False] * history
        self._records = 0
        self._counters: list[int] = []
        self._landed: dict[str, Any] = {}
        self._last: Landed | None = None
        self.load(counters)

    def before(self, scale: torch.Tensor) -> float:
        """The scale as it is now, to pass to ``record_`` after the update."""
        return scale.item()

    def record_(
        self,
        found: torch.Tensor,
        before: float,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> None:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it.
        ``tag`` and ``carry`` come back with the record from ``landed``."""
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
        self._last = Landed(self._landed, skipped, now != before, tag, carry)

    def landed(self, wait: bool = False) -> list[Landed]:
        """The last record, once (nothing to wait for on the host); its counters dict is shared between calls."""
        last, self._last = self._last, None
        return [] if last is None else [last]

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
