"""Scaler logs written without a scaler: the update rule replayed in Python on a chosen overflow pattern.

The records are what ``JsonLinesLogger`` writes (version 2, or 0.1.0's seven keys with ``version=1``),
so the report's rules can be tested on patterns a real run would take minutes to produce.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from typing import Any

FLOOR = 2.0**-126


def records(
    steps: int,
    overflow: Collection[int] | Callable[[int], bool] = (),
    *,
    init_scale: float = 65536.0,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float | None = None,
    max_scale: float | None = None,
    names: Callable[[int], list[str]] | None = None,
    norm: Callable[[int], float] | None = None,
    version: int = 2,
    every: int = 1,
    start: int = 0,
) -> Iterator[dict[str, Any]]:
    """One record per ``every`` updates for steps ``start+1 .. start+steps``; ``overflow`` holds the skipped steps."""
    skipped_at = overflow if callable(overflow) else overflow.__contains__
    lower, upper = max(min_scale or 0.0, FLOOR), max_scale or float("inf")
    scale, tracker = init_scale, 0
    counters = dict.fromkeys(("skipped_steps", "consecutive_skips", "growths", "backoffs", "collapse_run"), 0)
    for step in range(start + 1, start + steps + 1):
        before = scale
        skipped = bool(skipped_at(step))
        if skipped:
            scale, tracker = max(scale * backoff_factor, lower), 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = min(scale * growth_factor, upper), 0
        counters["skipped_steps"] += skipped
        counters["consecutive_skips"] = counters["consecutive_skips"] + 1 if skipped else 0
        counters["growths"] += scale > before
        counters["backoffs"] += scale < before
        counters["collapse_run"] = counters["collapse_run"] + 1 if skipped and before <= lower else 0
        if step % every:
            continue
        record: dict[str, Any] = {"step": step, "scale": scale, **counters}
        if version >= 2:
            record.update(version=version, skipped=skipped)
            if names is not None and skipped and names(step):
                record["nonfinite"] = names(step)
            if norm is not None:
                record["grad_norm"] = norm(step)
            if step == start + every:
                record["policy"] = {
                    "growth_factor": growth_factor,
                    "backoff_factor": backoff_factor,
                    "growth_interval": growth_interval,
                    "hysteresis": 1,
                    "min_scale": min_scale,
                    "max_scale": max_scale,
                }
        yield record


def lines(recs: Iterator[dict[str, Any]]) -> Iterator[str]:
    """The records as ``JsonLinesLogger`` writes them."""
    for record in recs:
        yield json.dumps(record) + "\n"
