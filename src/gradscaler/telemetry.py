"""Counters and a bounded history of the scale, kept on the scale's device and read without blocking.

Every ``update()`` adds one record with a handful of tiny device ops. The host sees the counters
through a mirror: after each record they are copied into (pinned, on CUDA) host memory without
blocking, and the host reads the copy once it has landed, normally one step later. ``stats()`` reads
the device directly and may sync; the per-step path never does.
"""

from __future__ import annotations

from typing import Any

import torch

COUNTERS = ("skipped_steps", "consecutive_skips", "growths", "backoffs", "collapse_run")
SATURATE = 2**62
"""Counters stop here rather than wrap (int64)."""


class Telemetry:
    """Device-side counters of one scaler.

    ``counters`` (int64): skipped steps, consecutive skips, growths, backoffs, and consecutive
    overflows at the minimum scale (``collapse_run``). ``scale_history`` / ``skip_history`` hold the
    last ``history`` steps in a ring; ``cursor`` (a device tensor) counts the records written.
    """

    def __init__(self, device: torch.device, history: int, counters: list[int] | None = None) -> None:
        self.history = history
        self.counters = torch.tensor(counters or [0] * len(COUNTERS), dtype=torch.int64, device=device)
        self.scale_history = torch.full((history,), float("nan"), dtype=torch.float32, device=device)
        self.skip_history = torch.zeros(history, dtype=torch.bool, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # next ring slot (a device tensor: graph-safe)
        pin = device.type == "cuda"
        self._mirror = torch.zeros(len(COUNTERS), dtype=torch.int64, pin_memory=pin)
        self._scale_mirror = torch.zeros((), dtype=torch.float32, pin_memory=pin)
        self._event: Any = None

    def record_(self, found: torch.Tensor, before: torch.Tensor, after: torch.Tensor, lower: float) -> None:
        """Account for one update: ``found`` 0-d float flag, the scale ``before`` and ``after`` it."""
        skipped = found != 0
        at_floor = skipped & (before <= lower)
        inc = torch.stack([skipped, skipped, after > before, after < before, at_floor]).long()
        keep = torch.stack(
            [torch.ones_like(skipped), skipped, torch.ones_like(skipped), torch.ones_like(skipped), at_floor]
        ).long()
        self.counters.add_(inc).mul_(keep).clamp_(max=SATURATE)
        slot = self.cursor.remainder(self.history)
        self.scale_history.index_copy_(0, slot, after.view(1))
        self.skip_history.index_copy_(0, slot, skipped.view(1))
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

    def histories(self) -> tuple[list[float], list[bool]]:
        """Scale and skip flag of the last ``min(steps, history)`` steps, oldest first (syncs)."""
        steps = int(self.cursor.tolist()[0])
        count = min(steps, self.history)
        order = [(steps - count + i) % self.history for i in range(count)]
        index = torch.tensor(order, dtype=torch.long, device=self.scale_history.device)
        return self.scale_history[index].tolist(), self.skip_history[index].tolist()
