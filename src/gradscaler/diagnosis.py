"""Reading a scaler log (``JsonLinesLogger``'s JSON lines) in one streaming pass, and what it says.

``summarise(lines)`` folds the records into a ``LogSummary`` whose size does not grow with the log
(a fixed number of plot buckets, one counter per parameter name, a few runs and clusters), so a
10-million-line log reads in constant memory. The diagnosis rules are pure functions of that summary;
``describe`` turns it into the text ``gradscaler report`` prints. Nothing here imports torch or
matplotlib. The record format is docs/log-format.md (version 2; 0.1.0's seven keys still read: a
skip is then seen in the ``skipped_steps`` counter, parameters are not named).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COUNTERS = ("skipped_steps", "consecutive_skips", "growths", "backoffs", "collapse_run")
REQUIRED = ("step", "scale", *COUNTERS)
TORCH_GROWTH_INTERVAL = 2000
"""Growth interval assumed for a log that does not state its policy and shows no two growths."""
LONG_SKIP_RUN = 20
"""Consecutive skips that no overflow explains: each halves the scale, 20 take it down a million-fold."""
CLUSTER = 3
"""Backoffs with no growth between them that make a cluster (one or two are the rule probing)."""
BUCKETS = 2048
"""Plot buckets kept; a longer log is drawn as a min/max envelope per bucket."""
KEPT_CLUSTERS = 5
PROGRESS_EVERY = 1 << 18
"""Lines between calls of the progress callback."""

Progress = Callable[[int, int], None]
"""``progress(lines_read, records)``."""


class LogError(ValueError):
    """The input is not a readable scaler log; the message says why in one line."""


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
    truncated: bool = False
    policy: dict[str, Any] | None = None
    first_scale: float = math.nan
    previous_scale: float = math.nan
    scale_low: float = math.inf
    scale_high: float = -math.inf
    named_records: int = 0
    names: Counter[str] = field(default_factory=Counter)
    more_names: int = 0
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


def _check(record: Any, number: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise LogError(f"line {number} is {type(record).__name__} JSON, not a record: not a JsonLinesLogger log")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise LogError(
            f"line {number} has no {', '.join(repr(k) for k in missing)}: not a gradscaler scaler log "
            "(JsonLinesLogger writes step, scale and the counters on every line)"
        )
    for key in ("step", *COUNTERS):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LogError(f"line {number}: {key!r} must be an int >= 0, got {value!r}")
    if isinstance(record["scale"], bool) or not isinstance(record["scale"], (int, float)):
        raise LogError(f"line {number}: 'scale' must be a number, got {record['scale']!r}")
    return record


def _parse(line: str, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:
        shown = line.strip()
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise LogError(f"line {number} is not JSON ({shown!r}): not a JsonLinesLogger log") from None
    return _check(record, number)


def summarise(lines: Iterable[str], progress: Progress | None = None) -> LogSummary:
    """Fold a log's lines (a file opened as text, or any iterable of str) into a ``LogSummary``.

    Blank lines are ignored. A last line that is not JSON is taken as cut off mid-write (a run that
    was stopped, or a log still being written): it is dropped and ``truncated`` set. When steps
    restart (a second run appended to the same file) the summary covers the last run and ``runs``
    counts them. Raises ``LogError`` for anything else that is not a scaler log, or no record.
    """
    summary = LogSummary()
    pending: LogError | None = None
    head = tail = ""  # the last parsed line around its step and grad_norm values
    norm_key = False
    number = 0
    for number, line in enumerate(lines, 1):
        if progress is not None and not number % PROGRESS_EVERY:
            progress(number, summary.records)
        # Most lines of a long log repeat the one before but for "step" (and "grad_norm"): nothing
        # happened. Compared as text around those two values, they skip the JSON parser.
        cut = line.find(", ")
        if line.startswith('{"step": ') and line.endswith("}\n") and pending is None:
            if norm_key:
                at = line.find('"grad_norm": ', cut) + 13
                end = line.find(", ", at)
                end = len(line) - 2 if end < 0 else end
                same = line[cut:at] == head and line[end:] == tail
            else:
                same = line[cut:] == head
            if same:
                try:
                    step = int(line[9:cut])
                    norm = float(line[at:end]) if norm_key else None
                except ValueError:
                    step = -1
                if step > summary.last_step:
                    _repeat(summary, step, norm)
                    continue
        if not line.strip():
            continue
        if pending is not None:
            raise pending
        try:
            record = _parse(line, number)
        except LogError as error:
            pending = error  # an error unless it is the last line: then the line was cut off
            continue
        if summary.records and (
            record["step"] <= summary.last_step or record["skipped_steps"] < summary.last["skipped_steps"]
        ):
            summary = LogSummary(runs=summary.runs + 1, run_line=number)
        _add(summary, record)
        at = line.find('"grad_norm": ', cut) + 13
        norm_key = at >= 13
        if norm_key:
            end = line.find(", ", at)
            head, tail = line[cut:at], line[len(line) - 2 if end < 0 else end :]
        else:
            head = line[cut:]
    if pending is not None:
        summary.truncated = True
    if not summary.records:
        if pending is not None:
            raise pending
        raise LogError("the log is empty: no records (loggers are called after each scaler.update())")
    _close(summary)
    return summary


def _repeat(s: LogSummary, step: int, norm: float | None) -> None:
    """``_add`` for a record equal to the last one but for its step and norm: no skip, growth or backoff."""
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


def _add(s: LogSummary, record: dict[str, Any]) -> None:
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
        more = record.get("nonfinite_more")
        s.more_names += more if isinstance(more, int) else 0
    norm = record.get("grad_norm")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)):
        norm = None
    if norm is not None:
        _norm(s, float(norm))
    _bucket(s, step, scale, skips, grew, shrank, norm)
    _leading(s, record, gap, skips)
    _stuck(s, record, step, scale, skipped, names)
    _backoffs(s, step, grew, shrank, scale, record)
    _flat(s, step, scale, skips, grew)


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


def _close(s: LogSummary) -> None:
    _close_cluster(s)
    _close_flat(s)


def _scale(value: float) -> str:
    """A scale as people write it: 65536, 0.5, 2**-126."""
    if value > 0 and math.log2(value).is_integer() and not 2**-16 <= value <= 2**16:
        return f"2**{int(math.log2(value))}"
    return f"{value:g}"


def _names(counts: Counter[str], top: int = 3) -> str:
    return ", ".join(f"{name} ({n} step{'s' * (n != 1)})" for name, n in counts.most_common(top))


def top_offenders(s: LogSummary, top: int = 10) -> list[tuple[str, int]]:
    """The parameters most often named as non-finite, with the number of records that named them."""
    return s.names.most_common(top)


def early_skips(s: LogSummary) -> str | None:
    """Rule 1: the log opens with skips that stop once the scale has come down: init_scale too high."""
    if not s.from_start or s.leading_open or s.leading == 0:
        return None
    count = f"{s.leading}" if s.leading_exact else f"at least {s.leading}"
    return (
        f"Early skips: the first {count} step{'s' * (s.leading != 1)} overflowed while the scale came down to "
        f"{_scale(s.leading_scale)}; init_scale was set higher than these gradients allow. Harmless: it cost "
        f"{count} of {s.steps} steps ({100 * s.leading / s.steps:.1f}%); GradScaler(init_scale="
        f"{_scale(s.leading_scale)}) would start where the run settled."
    )


def collapse(s: LogSummary) -> str | None:
    """Rule 2: the scale pinned at its floor, or skips no scale explains: a NaN source, not an overflow."""
    c = s.stuck
    all_skipped = s.from_start and s.leading_open and s.leading >= LONG_SKIP_RUN
    if not all_skipped and (c is None or (c.count < LONG_SKIP_RUN and s.max_collapse_run < CLUSTER)):
        return None
    if all_skipped:
        where = f"every one of the {s.steps} steps in the log was skipped"
    else:
        assert c is not None
        ended = "to the end of the log" if c.last == s.last_step and s.last["consecutive_skips"] else f"to {c.last}"
        where = f"every step from {c.first} {ended} was skipped ({c.count} in a row)"
    floor = f"; the scale sat at its floor {_scale(s.scale_low)}" if s.max_collapse_run else ""
    if s.stuck_names:
        blame = f"Non-finite in those steps: {_names(s.stuck_names)}: look there first."
    elif s.names:
        blame = f"Non-finite most often: {_names(s.names)}."
    else:
        blame = (
            "This log does not name parameters (a 0.1.0 log, or no names given): call "
            "scaler.name_parameters(model) and log with a newer gradscaler, or print "
            "scaler.nonfinite_parameters() after a skipped step."
        )
    return (
        f"Collapse: {where}{floor}. No scale fixes this: an overflow goes away once the scale is small "
        "enough, so these gradients are inf or NaN before any scaling. Something produces a NaN (a log or "
        f"division of 0, an fp16 activation past 65504, bad data). {blame}"
    )


def backoff_pattern(s: LogSummary) -> str | None:
    """Rule 3: lone backoffs about every growth_interval (the rule working) or backoffs in clusters."""
    interval = s.growth_interval
    if s.clusters:
        c = s.clusters[0]
        others = f" ({s.cluster_count - 1} more cluster{'s' * (s.cluster_count != 2)})" if s.cluster_count > 1 else ""
        return (
            f"Clustered backoffs: {c.count} backoffs between steps {c.first} and {c.last} with no growth between "
            f"them; the scale fell from {_scale(c.scale_before)} to {_scale(c.scale_after)}{others}. The gradients "
            "grew suddenly there: that points to the data (a bad batch) or the learning rate (a spike), not to "
            f"the scaler. Look at the loss and the batches around step {c.first}."
        )
    if s.lone_backoffs >= 2:
        every = (s.lone_last - s.lone_first) / (s.lone_backoffs - 1)
        return (
            f"Oscillation: the scale backed off {s.lone_backoffs} times, one at a time, about every {every:.0f} "
            f"steps, and grew back after each (growth_interval={interval}). That is the rule working: it tries "
            "a larger scale every growth_interval clean steps and steps back when that overflows. Nothing to fix."
        )
    return None


def capped(s: LogSummary) -> str | None:
    """Rule 4: no growth for a long time while the scale sits at max_scale."""
    f, interval = s.longest_flat, s.growth_interval
    if f is None or f.last - f.first < 2 * interval:
        return None
    top = (s.policy or {}).get("max_scale")
    length = f.last - f.first
    held = f"from step {f.first} to {f.last} ({length} steps, {length / interval:.1f} growth intervals)"
    if isinstance(top, (int, float)) and f.scale_after >= top * (1 - 2**-23):
        return (
            f"Capped: the scale sat at max_scale={_scale(top)} {held} without an overflow: the cap holds it "
            "there, not float16. Harmless while the loss is fine; raise max_scale if small gradients underflow."
        )
    if s.policy is not None:
        return None  # a policy without a cap always grows after growth_interval clean steps
    return (
        f"Capped: the scale stayed at {_scale(f.scale_after)} {held} without an overflow or a growth: "
        "something caps it (max_scale?). Harmless while the loss is fine."
    )


RULES = (early_skips, collapse, backoff_pattern, capped)


def diagnose(s: LogSummary) -> list[str]:
    """Every rule's finding, in plain words; empty when none applies."""
    return [finding for rule in RULES if (finding := rule(s)) is not None]


def describe(s: LogSummary) -> str:
    """The text of ``gradscaler report``: a summary that opens with "N of M steps skipped", then the diagnosis."""
    skipped, steps = s.total("skipped_steps"), s.steps
    share = f" ({100 * skipped / steps:.1f}%)" if steps else ""
    lines = [
        f"{skipped} of {steps} steps skipped{share}; scale {_scale(s.first_scale)} at step {s.first_step}, "
        f"{_scale(float(s.last['scale']))} at step {s.last_step} (min {_scale(s.scale_low)}, max "
        f"{_scale(s.scale_high)}); {s.total('growths')} growths, {s.total('backoffs')} backoffs.",
    ]
    if s.names:
        more = f" and {s.more_names} more" if s.more_names else ""
        lines.append(f"Non-finite gradients most often in: {_names(s.names, 5)}{more}.")
    elif s.version < 2:
        lines.append("Parameters are not named in this log (gradscaler 0.1.0): skips are read from the counters.")
    if s.norms:
        lines.append(
            f"Clipping norm: {s.norm_low:.3g} to {s.norm_high:.3g}, mean {s.norm_sum / s.norms:.3g} "
            f"({s.norms} records" + (f", {s.norm_nonfinite} non-finite)" if s.norm_nonfinite else ")")
        )
    if s.runs > 1:
        lines.append(f"The file holds {s.runs} runs (steps restart at line {s.run_line}); this covers the last.")
    if s.truncated:
        lines.append("The last line is cut off (a run stopped mid-write, or still writing): it was left out.")
    findings = diagnose(s)
    lines.append("Diagnosis:" if findings else "Diagnosis: nothing unusual.")
    lines += [f"- {finding}" for finding in findings]
    return "\n".join(lines)


def summarise_file(path: str | Path, progress: Callable[[int, int], None] | None = None) -> LogSummary:
    """``summarise`` a file, streamed; ``progress(bytes_read, file_size)`` is called now and then.

    OS errors (a missing file) propagate as they are; a file that is not UTF-8 text raises ``LogError``.
    """
    path = Path(path)
    if path.is_dir():
        raise LogError("is a folder, not a log file")
    with path.open(encoding="utf-8") as handle:
        size = os.fstat(handle.fileno()).st_size
        tick = None if progress is None else (lambda lines, records: progress(handle.buffer.tell(), size))
        try:
            return summarise(handle, tick)
        except UnicodeDecodeError:
            raise LogError("is not UTF-8 text: not a JsonLinesLogger log") from None
