"""The summary of a scaler log: ``LogSummary``, and the fold that adds one checked record to it.

``scalerlog`` reads and checks the records; each one it keeps reaches ``add`` (or, for a block of
lines that repeat the last record but for their steps and norms, ``add_repeats``), and ``close`` ends
the fold. The summary's size does not grow with the log: a fixed number of plot buckets, one counter
per parameter name, the longest runs and clusters, so a 10-million-line log reads in constant memory.
Its fields are what the report's figure and its diagnosis rules need (``diagnosis`` says what the
summary means). Plain Python, no tensors; the records are taken as checked.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gradscaler.record.logfile import COUNTERS

TORCH_GROWTH_INTERVAL = 2000
"""Growth interval assumed for a log that does not state its policy and shows no two growths."""
LONG_SKIP_RUN = 20
"""Consecutive skips that no overflow explains: each halves the scale, 20 take it down a million-fold."""
CLUSTER = 3
"""Backoffs with no growth between them that make a cluster (one or two are the rule probing)."""
BUCKETS = 2048
"""Plot buckets kept; a longer log is drawn as a min/max envelope per bucket."""
KEPT_CLUSTERS = 5
Writer = tuple[Any, Any]
"""A record's ``(rank, run)``; ``(None, None)`` in logs written before records named their writer."""


@dataclass
class Bucket:
    """The records of one span of steps, for the figure."""

    first: int
    last: int
    low: float
    high: float
    scale: float
    skips: int = 0
    growths: int = 0
    backoffs: int = 0
    norm_low: float = math.inf
    norm_high: float = -math.inf


@dataclass
class Stretch:
    """Steps ``first..last`` (inclusive) and what happened in them."""

    first: int
    last: int
    count: int = 0
    scale_before: float = math.nan
    scale_after: float = math.nan
    stuck: bool = False

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


@dataclass
class LogSummary:
    """Everything the report says about one run, accumulated record by record."""

    records: int = 0
    first_step: int = 0
    last_step: int = 0
    from_start: bool = True
    base: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    last: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    runs: int = 1
    run_line: int = 1
    writer: Writer = (None, None)
    others: int = 0
    truncated: bool = False
    policy: dict[str, Any] | None = None
    first_scale: float = math.nan
    previous_scale: float = math.nan
    scale_low: float = math.inf
    scale_high: float = -math.inf
    named_records: int = 0
    names: Counter[str] = field(default_factory=Counter)
    more_names: int = 0  # the most parameters one record left unnamed (``nonfinite_more``)
    norms: int = 0
    norm_low: float = math.inf
    norm_high: float = -math.inf
    norm_sum: float = 0.0
    norm_nonfinite: int = 0
    buckets: list[Bucket] = field(default_factory=list)
    span: int = 1
    bucket_end: int = 0
    # rule 1: the run of skips the log starts with
    leading: int = 0
    leading_open: bool = True
    leading_exact: bool = True
    leading_scale: float = math.nan
    # rule 2: skips that no scale explains
    stuck: Stretch | None = None
    stuck_now: Stretch | None = None
    stuck_names: Counter[str] = field(default_factory=Counter)
    max_collapse_run: int = 0
    # rule 3: backoffs, alone or clustered
    cluster: Stretch | None = None
    clusters: list[Stretch] = field(default_factory=list)
    cluster_count: int = 0
    lone_backoffs: int = 0
    lone_first: int = 0
    lone_last: int = 0
    growth_spacing: int = 0
    last_growth: int = -1
    # rule 4: the scale held without a skip or a growth
    flat: Stretch | None = None
    longest_flat: Stretch | None = None
    # rule 0: the scale moved where the rule did not (no growth or backoff counted, or against the one counted)
    unruled: int = 0
    unruled_first: tuple[int, float, float, str] | None = None  # step, scale before and after, what was counted

    @property
    def steps(self) -> int:
        """Steps the log covers (from step 1 when it starts there; gaps of ``every=N`` included)."""
        return self.last_step if self.from_start else self.last_step - self.first_step + 1

    def total(self, counter: str) -> int:
        """How much ``counter`` advanced over the steps the log covers."""
        return int(self.last.get(counter, 0)) - self.base[counter]

    @property
    def growth_interval(self) -> int:
        """The policy's growth interval, else the closest spacing of two growths, else torch's default."""
        if self.policy and isinstance(self.policy.get("growth_interval"), int):
            return int(self.policy["growth_interval"])
        return self.growth_spacing or TORCH_GROWTH_INTERVAL


def writer_name(writer: Writer) -> str:
    """A writer as messages name it: "rank 1 run 3f9c0a", "run 3f9c0a", "rank 1"."""
    rank, run = (text if text is None or len(str(text)) <= 24 else f"{str(text)[:21]}..." for text in writer)
    parts = [f"rank {rank}"] * (rank is not None) + [f"run {run}"] * (run is not None)
    return " ".join(parts) or "records without rank and run"


def add_repeats(s: LogSummary, steps: list[int], norms: list[float] | None) -> None:
    """``add`` for records that repeat the last one but for their steps (going up) and norms, in blocks:
    a record per bucket through ``_repeat``, the rest of the bucket's records counted at once."""
    done = 0
    while done < len(steps):
        _repeat(s, steps[done], None if norms is None else norms[done])  # may open a bucket
        done += 1
        cut = bisect.bisect_right(steps, s.bucket_end, done)
        if cut == done:
            continue
        s.records += cut - done
        s.last_step = s.buckets[-1].last = steps[cut - 1]
        if s.flat is not None:
            s.flat.last = s.last_step
        if norms is not None:
            finite = list(filter(math.isfinite, norms[done:cut]))
            s.norm_nonfinite += cut - done - len(finite)
            if finite:
                b, low, high = s.buckets[-1], min(finite), max(finite)
                b.norm_low, b.norm_high = min(b.norm_low, low), max(b.norm_high, high)
                s.norm_low, s.norm_high = min(s.norm_low, low), max(s.norm_high, high)
                s.norms += len(finite)
                s.norm_sum += sum(finite)  # not fsum: it raises OverflowError past 1e308
        done = cut


def _repeat(s: LogSummary, step: int, norm: float | None) -> None:
    """``add`` for a record equal to the last one but for its step and norm: no skip, growth or backoff."""
    if s.records == 1 and s.first_step > step - s.first_step:
        _anchor(s)
    if s.leading_open:
        _leading(s, dict(s.last, step=step), step - s.last_step, 0)
    s.records += 1
    s.last_step = step
    b = s.buckets[-1]
    if step <= s.bucket_end:
        b.last = step
        if norm is not None and norm == norm:  # not NaN
            if norm < b.norm_low:
                b.norm_low = norm
            if norm > b.norm_high:
                b.norm_high = norm
    else:
        _bucket(s, step, b.scale, 0, 0, 0, norm)
    if norm is not None:
        _norm(s, norm)
    f = s.flat
    if f is not None:
        f.last = step
    else:
        s.flat = Stretch(step, step, scale_after=b.scale)


def _norm(s: LogSummary, norm: float) -> None:
    if math.isfinite(norm):
        s.norms += 1
        s.norm_sum += norm
        if norm < s.norm_low:
            s.norm_low = norm
        if norm > s.norm_high:
            s.norm_high = norm
    else:
        s.norm_nonfinite += 1


def add(s: LogSummary, record: dict[str, Any]) -> None:
    """Account for one record: the steps since the previous one, ending at ``record["step"]``."""
    step, scale = record["step"], float(record["scale"])
    before = s.last or None
    if before is None:
        s.first_step, s.first_scale = step, scale
        s.leading_scale = scale
    elif s.records == 1 and s.first_step > step - s.first_step:
        _anchor(s)  # the log starts later than one interval after step 0 (a resumed run, a late logger)
    previous = before or s.base
    gap = step - (s.last_step if before else 0)
    skips = record["skipped_steps"] - previous["skipped_steps"]
    grew = record["growths"] - previous["growths"]
    shrank = record["backoffs"] - previous["backoffs"]
    flag = record.get("skipped")
    skipped = bool(flag) if isinstance(flag, bool) else skips > 0 and record["consecutive_skips"] > 0
    if "version" in record and isinstance(record["version"], int):
        s.version = max(s.version, record["version"])
    if isinstance(record.get("policy"), dict):
        s.policy = record["policy"]
    s.records += 1
    s.previous_scale = float(before["scale"]) if before else math.nan
    s.last_step, s.last = step, record
    s.scale_low, s.scale_high = min(s.scale_low, scale), max(s.scale_high, scale)
    names = record.get("nonfinite")
    if isinstance(names, list) and names:
        s.named_records += 1
        s.names.update(str(n) for n in names)
        s.more_names = max(s.more_names, record.get("nonfinite_more", 0))
    norm = None if record.get("grad_norm") is None else float(record["grad_norm"])  # checked: a float holds it
    if norm is not None:
        _norm(s, norm)
    if before is not None:
        _unruled(s, step, s.previous_scale, scale, grew, shrank)
    _bucket(s, step, scale, skips, grew, shrank, norm)
    _leading(s, record, gap, skips)
    _stuck(s, record, step, scale, skipped, names)
    _backoffs(s, step, grew, shrank, scale, record)
    _flat(s, step, scale, skips, grew)


def _unruled(s: LogSummary, step: int, before: float, after: float, grew: int, shrank: int) -> None:
    """A scale that moved with no growth or backoff counted, or up with only backoffs (down with only
    growths): the rule makes no such move. ``update(new_scale)`` and ``load_state_dict`` do, and so
    does an edit; a bound reached (min_scale, max_scale) only stops a move, so it makes none of these."""
    if after == before or (grew and shrank):
        return
    if not grew and not shrank:
        counted = "with no growth or backoff counted for it"
    elif grew and after < before:
        counted = "down, where only a growth was counted"
    elif shrank and after > before:
        counted = "up, where only a backoff was counted"
    else:
        return
    s.unruled += 1
    if s.unruled_first is None:
        s.unruled_first = (step, before, after, counted)


def _anchor(s: LogSummary) -> None:
    """Count from the first record instead of from step 0: it is the only known starting point."""
    first = s.last
    s.from_start = False
    s.base = {key: int(first[key]) for key in COUNTERS}
    s.base["skipped_steps"] -= 1 if first["consecutive_skips"] > 0 else 0
    s.leading, s.leading_open = 0, False


def _bucket(s: LogSummary, step: int, scale: float, skips: int, grew: int, shrank: int, norm: float | None) -> None:
    if s.buckets and step <= s.bucket_end:
        b = s.buckets[-1]
        b.last, b.scale = step, scale
        b.low, b.high = min(b.low, scale), max(b.high, scale)
    else:
        b = Bucket(step, step, scale, scale, scale)
        s.buckets.append(b)
        s.bucket_end = ((step - 1) // s.span + 1) * s.span
    b.skips += skips
    b.growths += grew
    b.backoffs += shrank
    if norm is not None and math.isfinite(norm):
        b.norm_low, b.norm_high = min(b.norm_low, norm), max(b.norm_high, norm)
    if len(s.buckets) > BUCKETS:
        s.span *= 2
        merged: list[Bucket] = []
        for b in s.buckets:
            if merged and (merged[-1].first - 1) // s.span == (b.first - 1) // s.span:
                m = merged[-1]
                m.last, m.scale = b.last, b.scale
                m.low, m.high = min(m.low, b.low), max(m.high, b.high)
                m.skips, m.growths, m.backoffs = m.skips + b.skips, m.growths + b.growths, m.backoffs + b.backoffs
                m.norm_low, m.norm_high = min(m.norm_low, b.norm_low), max(m.norm_high, b.norm_high)
            else:
                merged.append(b)
        s.buckets = merged
        s.bucket_end = ((merged[-1].first - 1) // s.span + 1) * s.span


def _leading(s: LogSummary, record: dict[str, Any], gap: int, skips: int) -> None:
    if not s.leading_open:
        return
    if record["skipped_steps"] - s.base["skipped_steps"] >= record["step"]:
        s.leading, s.leading_scale = record["step"], float(record["scale"])
        return
    s.leading_open = False
    # every=N: the run ended somewhere between the two records; at least ``leading`` steps were in it.
    s.leading_exact = gap == 1 or skips == 0


def _stuck(s: LogSummary, record: dict[str, Any], step: int, scale: float, skipped: bool, names: Any) -> None:
    run, collapse = record["consecutive_skips"], record["collapse_run"]
    s.max_collapse_run = max(s.max_collapse_run, collapse)
    if not skipped or (run < LONG_SKIP_RUN and collapse == 0):
        return
    first = step - run + 1
    c = s.stuck_now
    if c is None or c.first != first:
        c = s.stuck_now = Stretch(first, step)
    c.last, c.count, c.scale_after = step, run, scale
    if s.stuck is None or c.count >= s.stuck.count:
        s.stuck = c
    if isinstance(names, list):
        s.stuck_names.update(str(n) for n in names)


def _backoffs(s: LogSummary, step: int, grew: int, shrank: int, scale: float, record: dict[str, Any]) -> None:
    if grew:
        if s.last_growth >= 0:  # growths come growth_interval clean steps apart, or further
            spacing = step - s.last_growth
            s.growth_spacing = min(s.growth_spacing or spacing, spacing)
        s.last_growth = step
        _close_cluster(s)
    if not shrank or (s.leading_open and s.from_start):
        return
    c = s.cluster
    if c is not None and step - c.last > s.growth_interval:
        _close_cluster(s)
        c = None
    if c is None:
        c = s.cluster = Stretch(step, step, scale_before=s.previous_scale)
    c.last, c.count, c.scale_after = step, c.count + shrank, scale
    c.stuck = c.stuck or record["collapse_run"] > 0 or record["consecutive_skips"] >= LONG_SKIP_RUN


def _close_cluster(s: LogSummary) -> None:
    c, s.cluster = s.cluster, None
    if c is None:
        return
    if c.count < CLUSTER:
        s.lone_first = s.lone_first or c.first
        s.lone_last = c.last
        s.lone_backoffs += c.count
    elif not c.stuck:
        s.cluster_count += 1
        s.clusters.append(c)
        s.clusters.sort(key=lambda k: -k.count)
        del s.clusters[KEPT_CLUSTERS:]


def _flat(s: LogSummary, step: int, scale: float, skips: int, grew: int) -> None:
    f = s.flat
    if f is not None and not skips and not grew and scale == f.scale_after:
        f.last = step
        return
    _close_flat(s)
    s.flat = None if skips else Stretch(step, step, scale_after=scale)


def _close_flat(s: LogSummary) -> None:
    f, s.flat = s.flat, None
    if f is not None and (s.longest_flat is None or f.steps > s.longest_flat.steps):
        s.longest_flat = f


def close(s: LogSummary) -> None:
    _close_cluster(s)
    _close_flat(s)
