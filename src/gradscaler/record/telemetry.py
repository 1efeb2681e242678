"""Counters and a bounded history of the scale, kept where the scale lives and read without blocking.

Every ``update()`` adds one record. Two keepers share one accounting (``events`` and ``CONSECUTIVE``):

* ``Telemetry``, for a scale on an accelerator: no device op per record under torch's rule (the flag is
  kept as it is; the host computes the scale after each update from the flags, ``ScaleRule.next_on_host``),
  one (a copy of the scale) under a rule torch's kernel does not compute; nothing read back on the way.
  The flags (and copied scales) of ``RECORDS_PER_COPY`` records travel to (pinned, on CUDA) host memory in
  one non-blocking copy, and the host accounts them once it has landed, with ``HostTelemetry``'s code.
  Every record lands, in order. Works under CUDA-graph capture (captured records are written to a device
  ring and accounted when read).
* ``HostTelemetry``, for a scale in host memory (the CPU): the record is kept in Python numbers. Reading
  a CPU tensor costs what reading a float does, while each tiny tensor op costs 1-2 us of dispatch:
  this keeper reads the flag and the scale at once.

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
"""Most records ``landed`` holds unread (the oldest go first: only when nobody calls it); ``Telemetry``
also waits for its oldest copy rather than run this many updates ahead of the device."""
RECORDS_PER_COPY = 16
"""Records ``Telemetry`` carries to the host in one copy: two device ops per this many updates."""
MOST_UNSEEN = IN_FLIGHT + 2 * RECORDS_PER_COPY
"""More records than are ever made and not yet accounted (at most ``IN_FLIGHT // RECORDS_PER_COPY + 1`` batches in
flight before the host waits for one, and the pending batch): the longest steady run ``Telemetry`` asks for."""
KERNEL_DEVICES = ("cuda", "cpu")
"""Device types whose ``_amp_update_scale_`` computes what ``ScaleRule.next_on_host`` does (each product in float64,
``==`` with the interval, no growth to inf): ``Telemetry`` computes their records' scales. Elsewhere (MPS's kernel
multiplies in float32, compares with ``>=`` and may grow to inf) each record copies its scale."""

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

    def before(
        self, scale: torch.Tensor, tracker: torch.Tensor | None = None, rule: Any = None
    ) -> tuple[Any, bool]: ...
    def rebase(self) -> None: ...
    def copy_every(self, records: int) -> None: ...
    def record_(
        self,
        found: torch.Tensor,
        before: Any,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> bool: ...
    def landed(self, wait: bool = False) -> list[Landed]: ...
    def read(self) -> dict[str, int]: ...
    def load(self, counters: list[int]) -> None: ...
    def histories(self) -> tuple[list[float], list[bool]]: ...


def make_telemetry(
    device: torch.device, history: int, counters: list[int], on_host: bool, logged: bool = False
) -> Keeper:
    """``HostTelemetry`` when ``on_host`` (the scale is in host memory), else ``Telemetry`` on ``device``,
    copying each record on its own when ``logged`` (a logger is attached)."""
    keeper: Keeper = HostTelemetry(history, counters) if on_host else Telemetry(device, history, counters)
    if logged:
        keeper.copy_every(1)
    return keeper


class Telemetry:
    """The keeper for a scale on an accelerator: no device op per update under torch's rule (one under another),
    the accounting on the host.

    Each ``record_`` keeps the update's overflow flag as it is (a tensor of that iteration, which
    nothing writes again). The scale after it is computed on the host when ``before`` was given the growth
    tracker and a rule torch's kernel computes (``ScaleRule.next_on_host``, from the scale and tracker before
    it and the flag: no device op), else copied (the record that ends a batch is copied by the batch's
    ``stack``, made at once). The scale before a record is the previous record's after, unless ``rebase``
    said the scale (or the tracker) moved outside the rule, or an update made no record after its ``before``
    (its bookkeeping raised): the next ``before`` then copies the scale, and the tracker when the record is
    computed (two ops, once; also after a copied record). A batch of computed records that ``record_`` sends
    carries the scale as it is then (no op more: the stack's), the last record's after, which the host checks
    its computation against: a scale written outside the scaler (its private tensor) costs at most that batch's
    records, and the next update copies the scale and tracker again. Every
    ``RECORDS_PER_COPY`` records, or when read, one ``stack`` and one non-blocking copy to (pinned, on
    CUDA) host memory carry a batch over; once a batch's copy has landed, the host accounts its records
    exactly as ``HostTelemetry`` does (the same code). So a record reaches
    ``landed`` up to ``RECORDS_PER_COPY`` updates later than it is made (``copy_every``: one, with a
    logger attached), plus however far the host runs ahead of the device; ``read``, ``histories`` and
    ``landed(wait=True)`` wait for every record.

    Under CUDA-graph capture the captured update writes its flag and scale into a device ring instead
    (three ops, replayed with the graph; ``history`` records between two reads); reads account its rows
    after the records made before the capture.
    """

    def __init__(self, device: torch.device, history: int, counters: list[int]) -> None:
        self._host = HostTelemetry(history, counters)
        self._device = device
        self._pin = device.type == "cuda"
        # the records made and not yet copied: their flags (0-d float32), scales after (copied records), host notes
        self._flags: list[torch.Tensor] = []
        self._afters: list[torch.Tensor] = []
        self._notes: list[_Note] = []
        self._per_copy = RECORDS_PER_COPY
        self._first_before: torch.Tensor | None = None  # the scale before the pending batch, when copied
        self._first_tracker: torch.Tensor | None = None  # its growth tracker (host memory), when computed and copied
        self._rule_now: Any = None  # the rule ``before`` was given, when the coming record is computed (else None)
        self._chained = False  # the host will know the tracker after the last record made (computed since a copy)
        self._tracker: int | None = None  # the growth tracker after the last accounted record, when known
        self._awaiting = False  # ``before`` was called and its update's ``record_`` not yet made
        self._computes = device.type in KERNEL_DEVICES  # the device's update is computable on the host
        self._in_flight: deque[_Batch] = deque()  # copies issued, oldest first
        self._landed: deque[Landed] = deque(maxlen=IN_FLIGHT)
        self._buffers: dict[int, list[torch.Tensor]] = {}  # host buffers read already, by length
        self._last_after: float | None = None  # the scale after the last accounted record
        self._rebased = True  # the next record's before is a copy of the scale (none before it yet)
        self._made = self._accounted = self._rebased_at = 0  # records made, accounted; made at the last rebase
        self._rule: Any = None  # the rule ``before`` was last given
        self._steady_upto = -1  # while at most this many records are made, the scale is inside the rule's steady
        self._steady_run: tuple[Any, float, int] = (None, math.nan, -1)  # the last asked: rule, scale, answer
        # allocated now: a buffer made during a capture would be filled by each replay, not before
        self._ring = _Ring(device, history) if device.type == "cuda" else None
        self._captured = False  # a captured update writes into the ring

    def _capturing(self) -> bool:
        return self._ring is not None and torch.cuda.is_current_stream_capturing()

    def before(
        self, scale: torch.Tensor, tracker: torch.Tensor | None = None, rule: Any = None
    ) -> tuple[torch.Tensor | None, bool]:
        """Called before the update that the next ``record_`` records. With ``tracker`` (the growth tracker) and
        a ``rule`` that ``matches_torch_kernel``, that record's scale after is computed on the host, not copied.
        Returns the scale as it is now when the previous record's after is not it (a device copy), else None;
        and whether the scale is inside ``rule.steady`` for certain (``ScaleRule.steady_run`` from the last
        accounted record's scale, counting the updates made since), so that the update may skip its clamp:
        never under a rule other than the one the accounted records were made under, nor after a capture."""
        if self._capturing():
            return None, False
        if self._awaiting:  # the last update moved the scale and made no record (its bookkeeping raised)
            self.rebase()
        self._awaiting = True
        if rule is not self._rule:  # a new rule object (a setter, a load): its records count from now
            self._rule, self._rebased_at, self._steady_upto = rule, self._made, -1
        steady = self._made <= self._steady_upto
        # after a capture the graph's replays move the scale and tracker unseen: copied from then on
        known = tracker is not None and rule is not None and self._computes and not self._captured
        computed = rule if known and rule.matches_torch_kernel else None
        self._rule_now = computed
        copy_tracker = computed is not None and not self._chained
        if not (self._rebased or copy_tracker):
            return None, steady
        self._flush()  # a batch starts at a copied before
        if copy_tracker:
            assert tracker is not None
            host = torch.empty(1, dtype=tracker.dtype, pin_memory=self._pin)
            self._first_tracker = host.copy_(tracker.reshape(1), non_blocking=True)  # before the update moves it
            self._chained = True
        copied = scale.clone() if self._rebased else None
        self._rebased = False
        return copied, steady

    def rebase(self) -> None:
        """The scale or the growth tracker was set outside the rule (``update(new_scale)``, a load, a new
        growth interval): the next record copies the scale, and the tracker when it is computed."""
        self._rebased = True
        self._chained = False
        self._rebased_at, self._steady_upto = self._made, -1

    def copy_every(self, records: int) -> None:
        """Carry records to the host ``records`` at a time (1 with a logger: each lands a step later)."""
        self._per_copy = records
        if len(self._notes) >= records:
            self._flush()

    def record_(
        self,
        found: torch.Tensor,
        before: torch.Tensor | None,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> bool:
        """Account for one update: ``found`` 0-d float flag, ``before`` from ``before()``, the scale
        ``after`` it (computed on the host when ``before`` said so; else copied: by the batch's stack when this
        record ends a batch, else on its own).
        ``tag`` (any host object) and ``carry`` (a device tensor, copied to the host without blocking)
        come back with this record from ``landed``. Returns whether ``landed`` has records to return."""
        if self._capturing():
            assert self._ring is not None
            self._ring.write_(found, after)  # the records pending stay so, to be copied after the capture
            self._ring.lower, self._captured, self._chained = lower, True, False  # a replay moves the tracker
            self._steady_upto = -1  # a replay moves the scale unseen
            return False
        if before is not None:
            self._first_before = before
        carried = None if carry is None else carry.to("cpu", non_blocking=True)
        flush = len(self._notes) + 1 >= self._per_copy  # this record's batch is stacked now: no copy of its own
        rule, self._rule_now = self._rule_now, None
        kept = None if rule is not None else after if flush else after.clone()
        plain = found.dim() == 0 and found.dtype == torch.float32  # a reshape and a conversion are ops
        flag = found if plain else found.reshape(()).float()
        # appended once nothing can fail: the lists stay in step (a failed copy leaves no record)
        self._flags.append(flag)
        if kept is not None:
            self._afters.append(kept)
            self._chained = False
        self._notes.append((lower, tag, carried, rule))
        self._made += 1
        self._awaiting = False
        if flush:  # the scale now is this record's after: a batch of computed records takes it along to check
            checked = rule is not None and (len(self._notes) > 1 or self._made % RECORDS_PER_COPY == 0)
            self._flush(after if checked else None)
        if self._in_flight:
            self._drain(wait=False)
        return bool(self._landed)

    def landed(self, wait: bool = False) -> list[Landed]:
        """The records accounted since the last call, oldest first (at most ``IN_FLIGHT``). No sync,
        unless ``wait``: then every record made so far (the host waits for their copies)."""
        if self._capturing():
            return []  # an event cannot be queried while a graph is being captured
        if wait:
            self._flush()
        self._drain(wait)
        out = list(self._landed)
        self._landed.clear()
        return out

    def read(self) -> dict[str, int]:
        """The current counters (waits for every record)."""
        self._drain_all()
        return self._host.read()

    def load(self, counters: list[int]) -> None:
        """Replace the counters, after every record made so far is accounted (waits for them)."""
        self._drain_all()
        self._host.load(counters)

    def histories(self) -> tuple[list[float], list[bool]]:
        """Scale and skip flag of the last ``min(steps, history)`` steps, oldest first (waits)."""
        self._drain_all()
        return self._host.histories()

    def _drain_all(self) -> None:
        self._flush()
        self._drain(wait=True)

    @staticmethod
    def _clean_run(batch: _Batch, flags: list[float], tracker: int | None) -> bool:
        """Whether every record of ``batch`` is computed under one rule, carries nothing, is clean (``flags``) and
        grows no scale (the growth tracker before them, known, stays below the interval): each then leaves the
        scale as it was, and the host accounts them together."""
        notes = batch.records
        _, tag, carried, rule = first = notes[0]
        if batch.copied or tag is not None or carried is not None or rule is None or tracker is None:
            return False
        count = len(notes)
        return 0 <= tracker < tracker + count < rule.growth_interval and not any(flags) and notes.count(first) == count

    def _steady_limit(self) -> int:
        """The most records made up to which the scale stays inside the rule's steady (``before``): counted from the
        last accounted record when one made under the current rule is, not after a capture; else -1."""
        rule, last = self._rule, self._last_after
        if rule is None or last is None or self._accounted <= self._rebased_at or self._captured:
            return -1
        known_rule, known_scale, run = self._steady_run
        if known_rule is not rule or known_scale != last:  # else as last time: most batches leave the scale as it was
            run = rule.steady_run(last, MOST_UNSEEN)
            self._steady_run = (rule, last, run)
        return self._accounted + run

    def _flush(self, check: torch.Tensor | None = None) -> None:
        """Start the copy of the pending records: one stack, one non-blocking copy (a lone flag: the copy alone);
        ``check``: the scale after the last record, for the host to check its computed records against."""
        if not self._notes:
            return
        values = self._flags + self._afters  # no afters in a computed batch
        if check is not None:
            values.append(check)
        if self._first_before is not None:
            values.append(self._first_before)
        stacked = values[0].reshape(1) if len(values) == 1 else torch.stack(values)  # a flag is never written again
        free = self._buffers.setdefault(stacked.shape[0], [])
        host = free.pop() if free else torch.empty(stacked.shape, dtype=torch.float32, pin_memory=self._pin)
        host.copy_(stacked, non_blocking=True)
        event = None
        if stacked.is_cuda:
            event = torch.cuda.Event()
            event.record()
        batch = _Batch(host, self._notes, event, len(self._afters), check is not None, self._first_tracker)
        self._in_flight.append(batch)
        self._flags, self._afters, self._notes, self._first_before, self._first_tracker = [], [], [], None, None

    def _drain(self, wait: bool) -> None:
        """Account every batch whose copy has landed (all of them with ``wait``), in order."""
        while self._in_flight:
            batch = self._in_flight[0]
            if batch.event is not None:
                if wait or len(self._in_flight) > IN_FLIGHT // RECORDS_PER_COPY:
                    batch.event.synchronize()  # the host runs that far ahead only if nobody reads
                elif not batch.event.query():
                    break
            self._in_flight.popleft()
            values = batch.host.tolist()
            self._buffers[batch.host.shape[0]].append(batch.host)  # read: free for a later copy
            count = len(batch.records)
            given = count + batch.copied + batch.checked  # the flags, the copied records' afters, the check
            before = values[given] if len(values) > given else self._last_after
            assert before is not None, "the first record copies its before"
            tracker = self._tracker if batch.tracker is None else batch.tracker.tolist()[0]  # host memory
            copied = iter(values[count : count + batch.copied])
            account, landed = self._host.account, self._landed
            quiet = self._host.account_quiet(before, count) if self._clean_run(batch, values[:count], tracker) else None
            if quiet is not None:  # every record of the batch leaves the scale and the counters as they were
                assert tracker is not None
                landed.extend([quiet] * count)
                tracker += count
            else:
                for found, (lower, tag, carried, rule) in zip(values[:count], batch.records, strict=True):
                    if rule is None:
                        after, tracker = next(copied), None
                    else:  # a computed record follows a copied one only where ``before`` copied the tracker
                        assert tracker is not None, "a computed record starts where the tracker is known"
                        after, tracker = rule.next_on_host(before, tracker, found != 0)
                    landed.append(account(found != 0, before, after, lower, tag, carried))
                    before = after
            if batch.checked and values[given - 1] != before:  # a write outside the rule since the last copy
                before = values[given - 1]
                self.rebase()  # the next update copies the scale and the tracker again
            self._last_after, self._tracker = before, tracker
            self._accounted += count
            self._steady_upto = self._steady_limit()
        if wait and self._captured:
            assert self._ring is not None
            for found, after in self._ring.read():
                before = self._last_after if self._last_after is not None else after
                self._landed.append(self._host.account(found != 0, before, after, self._ring.lower))
                self._last_after = after
            self._tracker = None  # computed records stopped at the capture: none follows it


_Note = tuple[float, Any, "torch.Tensor | None", Any]
"""What the host keeps of one record made: the rule's floor, the caller's tag and carried tensor, and the rule that
computes its scale after (None: the scale was copied). A plain tuple: one is made at every update."""


class _Batch(NamedTuple):
    """A batch of records in flight: host buffer (flags, the copied scales after, maybe the before), the
    records' notes, the event its copy completes (None off CUDA), how many were copied, and the growth
    tracker before the batch when ``before`` copied it (else the host knows it, or no record is computed)."""

    host: torch.Tensor
    records: list[_Note]
    event: Any
    copied: int  # records whose scale after was copied
    checked: bool  # the scale after the last record follows them, to check the computed ones against
    tracker: torch.Tensor | None


class _Ring:
    """Flags and scales written by captured updates, on the device, read back when the host waits."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.lower = -math.inf  # the rule's floor when the graph was captured
        self.rows = torch.zeros((size, 2), dtype=torch.float32, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.read_upto = 0

    def write_(self, found: torch.Tensor, after: torch.Tensor) -> None:
        slot = self.cursor.remainder(self.rows.shape[0])
        self.rows.index_copy_(0, slot, torch.stack([found.reshape(()).float(), after]).view(1, 2))
        self.cursor.add_(1)

    def read(self) -> list[tuple[float, float]]:
        """The rows written since the last read, oldest first (the newest ``size`` of them)."""
        written = int(self.cursor.item())
        size = self.rows.shape[0]
        start = max(self.read_upto, written - size)
        rows = self.rows.tolist()
        self.read_upto = written
        return [(rows[i % size][0], rows[i % size][1]) for i in range(start, written)]


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
        self._running = False  # a counter of consecutive events is above 0
        self.load(counters)

    def before(self, scale: torch.Tensor, tracker: torch.Tensor | None = None, rule: Any = None) -> tuple[float, bool]:
        """The scale as it is now, to pass to ``record_`` after the update, and whether it is inside ``rule.steady``."""
        now = scale.item()
        if rule is None:
            return now, False
        low, high = rule.steady
        return now, low <= now <= high

    def rebase(self) -> None:
        """Nothing to do: every record reads its scale before."""

    def copy_every(self, records: int) -> None:
        """Nothing to do: every record is on the host at once."""

    def record_(
        self,
        found: torch.Tensor,
        before: float,
        after: torch.Tensor,
        lower: float,
        tag: Any = None,
        carry: torch.Tensor | None = None,
    ) -> bool:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it.
        ``tag`` and ``carry`` come back with the record from ``landed`` (which has it at once: True)."""
        self._last = self.account(found.item() != 0, before, after.item(), lower, tag, carry)
        return True

    def account(
        self, skipped: bool, before: float, now: float, lower: float, tag: Any = None, carry: torch.Tensor | None = None
    ) -> Landed:
        """The accounting of one update from host values (both keepers'): counters, the ring, its record."""
        if skipped or now != before or self._running or now != self._landed["scale"]:  # else no counter moves
            happened = events(skipped, now > before, now < before, skipped and before <= lower)
            self._counters = [
                0 if run and not event else min(count + event, SATURATE)
                for count, event, run in zip(self._counters, happened, CONSECUTIVE, strict=True)
            ]
            self._publish(now)
        slot = self._records % self.history
        self._scales[slot], self._skipped[slot] = now, skipped
        self._records += 1
        return Landed(self._landed, skipped, now != before, tag, carry)

    def account_quiet(self, scale: float, count: int) -> Landed | None:
        """``account`` of ``count`` clean records in a row, each leaving ``scale`` as it was, when none of them
        moves a counter (no run to reset, ``scale`` the one last published): the ring written, and the one record
        they all share returned; None otherwise (``account`` them one by one)."""
        if self._running or scale != self._landed["scale"]:
            return None
        history, scales, skipped = self.history, self._scales, self._skipped
        for slot in range(self._records, self._records + count):
            scales[slot % history], skipped[slot % history] = scale, False
        self._records += count
        return Landed(self._landed, False, False, None, None)

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
        self._running = any(self._counters[i] for i in _RUNS)  # a run to reset at the next clean record

    def histories(self) -> tuple[list[float], list[bool]]:
        """Scale and skip flag of the last ``min(steps, history)`` steps, oldest first."""
        count = min(self._records, self.history)
        order = [(self._records - count + i) % self.history for i in range(count)]
        return [self._scales[i] for i in order], [self._skipped[i] for i in order]


_RUNS = [i for i, run in enumerate(CONSECUTIVE) if run]
