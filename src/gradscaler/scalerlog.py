"""Reading a scaler log (``JsonLinesLogger``'s JSON lines) in one streaming pass.

``summarise(lines)`` folds the records into a ``LogSummary`` whose size does not grow with the log
(a fixed number of plot buckets, one counter per parameter name, the longest runs and clusters), so
a 10-million-line log reads in constant memory. ``diagnosis`` says what the summary means. Plain
Python, no tensors. The records are ``JsonLinesLogger``'s (version 2; 0.1.0's seven keys still read:
a skip is then seen in the ``skipped_steps`` counter, and parameters are not named); keys it does not
know are ignored.

Nothing is summarised that no logger could have written: every value a record holds is checked (a
scale that is finite and > 0, no more skipped steps than steps, a policy ``GradScaler`` accepts, ...)
and a record that fails is refused with its line number and field (``LogError``, one line). Records
name their writer (``rank`` and ``run``, written by ``JsonLinesLogger``): a file where two writers'
records interleave, or where one record is written twice, is refused with what to do, unless
``rank`` / ``run`` select one writer.
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import math
import operator
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradscaler import rule
from gradscaler.telemetry import COUNTERS

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
PROGRESS_EVERY = 1 << 16
"""Lines between calls of the progress callback."""
CHUNK = 4096
"""Lines scanned as one string."""
_STEP = re.compile(r'\{"step": (0|[1-9]\d*), ')
_LINE_START = '\n{"step": '
"""With ``_STEP`` matching once a line, at each line's start: then no match is nested inside a line."""
# A norm as json writes one (strictly: float() also takes "inf", "1_0", " 1"), the first in a line.
_NUMBER = r"-?(?:(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|Infinity)|NaN"
_NORM = re.compile(rf'"grad_norm": ({_NUMBER})(?=[,}}])[^\n]*')
_NORM_VALUE = re.compile(rf'"grad_norm": (?:{_NUMBER})(?=[,}}])')
KEPT_WRITERS = 1024
"""Writers remembered after their run ended, to tell a file's next run from interleaved writers."""
Writer = tuple[Any, Any]
"""A record's ``(rank, run)``; ``(None, None)`` in logs written before records named their writer."""

Progress = Callable[[int, int], None]
"""``progress(lines_read, records)``."""


class LogError(ValueError):
    """The input is not a readable scaler log; the message says why in one line."""


class _Unreadable(LogError):
    """A line that is not JSON: at the end of a log and without its newline, a record cut off mid-write."""


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


def _shown(value: Any) -> str:
    """A value as a message quotes it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number a float holds (not a bool, not an int past 1e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _check(record: Any, number: int) -> dict[str, Any]:
    """``record`` when every value it holds is one a scaler logger could have written, else ``LogError``."""
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
            raise LogError(f"line {number}: {key!r} must be an int >= 0, got {_shown(value)}")
    for part, whole in (("skipped_steps", "step"), ("consecutive_skips", "skipped_steps")):
        if record[part] > record[whole]:
            raise LogError(
                f"line {number}: {part!r} ({record[part]}) is more than {whole!r} ({record[whole]}), which no "
                "scaler logs: the file was edited or mixes logs"
            )
    scale = _number(record["scale"])
    if scale is None or not math.isfinite(scale) or scale <= 0:
        raise LogError(
            f"line {number}: 'scale' must be a finite number > 0, got {_shown(record['scale'])}: no scaler logs another"
        )
    _check_optional(record, number)
    return record


def _check_optional(record: dict[str, Any], number: int) -> None:
    """The keys a record may hold (docs/log-format.md), each of the type and range its writer gives it."""
    if "grad_norm" in record:
        norm = _number(record["grad_norm"])
        if norm is None or norm < 0:
            raise LogError(
                f"line {number}: 'grad_norm' must be a number >= 0 (NaN or Infinity on an overflowing step), "
                f"got {_shown(record['grad_norm'])}"
            )
    names = record.get("nonfinite", [])
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise LogError(f"line {number}: 'nonfinite' must be a list of parameter names, got {_shown(names)}")
    for key, low in (("nonfinite_more", 0), ("version", 1), ("rank", 0)):
        value = record.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise LogError(f"line {number}: {key!r} must be an int >= {low}, got {_shown(value)}")
    if not isinstance(record.get("skipped", False), bool):
        raise LogError(f"line {number}: 'skipped' must be true or false, got {_shown(record['skipped'])}")
    if not isinstance(record.get("run", ""), str):
        raise LogError(f"line {number}: 'run' must be a string (the writer's id), got {_shown(record['run'])}")
    if "policy" in record:
        _check_policy(record["policy"], number)


POLICY_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale")


def _check_policy(policy: Any, number: int) -> None:
    """A logged policy must be one ``GradScaler`` accepts: ``rule.ScaleRule`` checks it, as it checks the scaler's."""
    if not isinstance(policy, dict):
        raise LogError(f"line {number}: 'policy' must be an object of the scaler's settings, got {_shown(policy)}")
    try:
        rule.ScaleRule(**{key: policy[key] for key in POLICY_KEYS if key in policy})
    except (TypeError, ValueError) as error:
        raise LogError(f"line {number}: 'policy' holds a setting no GradScaler accepts: {error}") from None


class _KeyTwice(ValueError):
    """A key twice in one JSON object: ``json`` keeps the last value, the fast path would read the first."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        keys = [key for key, _ in pairs]
        raise _KeyTwice(next(key for i, key in enumerate(keys) if key in keys[:i]))
    return record


def _parse(line: str, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _Unreadable(f"line {number} is JSON nested too deeply for a record: not a JsonLinesLogger log") from None
    except _KeyTwice as error:
        raise LogError(f"line {number} holds the key {error.args[0]!r} twice: not a JsonLinesLogger record") from None
    except ValueError:
        shown = line.strip()
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise _Unreadable(f"line {number} is not JSON ({shown!r}): not a JsonLinesLogger log") from None
    return _check(record, number)


def summarise(
    lines: Iterable[str], progress: Progress | None = None, *, rank: int | None = None, run: str | None = None
) -> LogSummary:
    """Fold a log's lines (a file opened as text, or any iterable of str) into a ``LogSummary``.

    Blank lines are ignored. A last line that is not JSON and has no newline is taken as cut off
    mid-write (a run that was stopped, or a log still being written): it is dropped and
    ``truncated`` set. When steps restart or a new writer begins (a second run appended to the same
    file) the summary covers the last run and ``runs`` counts them. ``rank`` / ``run``: read only the
    records of that writer. Raises ``LogError`` for anything else that is not a scaler log: a value
    no logger writes, records of several writers interleaved or one record written twice, no record.
    """
    reader = _Reader(rank, run)
    source = iter(lines)
    shown = 0
    while chunk := list(itertools.islice(source, CHUNK)):
        reader.fold(chunk)
        if progress is not None and reader.number // PROGRESS_EVERY > shown:
            shown = reader.number // PROGRESS_EVERY
            progress(reader.number, reader.summary.records)
    summary = reader.summary
    if reader.pending is not None:
        summary.truncated = True
    if not summary.records:
        if reader.pending is not None:
            raise reader.pending
        if reader.others:
            raise LogError(
                f"no record of {writer_name((rank, run))} among the log's {reader.others} records (other writers' only)"
            )
        raise LogError("the log is empty: no records (loggers are called after each scaler.update())")
    summary.others = reader.others
    _close(summary)
    return summary


def writer_name(writer: Writer) -> str:
    """A writer as messages name it: "rank 1 run 3f9c0a", "run 3f9c0a", "rank 1"."""
    rank, run = (text if text is None or len(str(text)) <= 24 else f"{str(text)[:21]}..." for text in writer)
    parts = [f"rank {rank}"] * (rank is not None) + [f"run {run}"] * (run is not None)
    return " ".join(parts) or "records without rank and run"


class _Reader:
    """The fold's state between chunks of lines.

    Most lines of a long log repeat the last parsed record but for "step" and "grad_norm": nothing
    happened. A chunk is scanned as one string (regular expressions, C speed) for those lines and only
    the others reach the JSON parser, so a line costs well under a microsecond.
    """

    def __init__(self, rank: int | None = None, run: str | None = None) -> None:
        self.summary = LogSummary()
        self.pending: LogError | None = None
        self.number = 0
        self.key: str | None = None  # the last record's line without its step and norm values
        self.rank, self.run = rank, run
        self.others = 0  # records of writers that ``rank`` / ``run`` leave out
        self.ended: dict[Writer, int] = {}  # writers whose run ended, and the line it began at

    def fold(self, chunk: list[str]) -> None:
        text = "".join(chunk)
        n = len(chunk)
        steps = _STEP.findall(text)
        norms = _NORM.findall(text)
        alike = (
            text.count("\n") == n
            and text.endswith("\n")
            and len(steps) == n
            and text.startswith('{"step": ')
            and text.count(_LINE_START) == n - 1
        )
        if not alike or len(norms) not in (0, n):
            if n >= 16 and 2 * len(steps) >= n:  # halves, until each holds lines alike (a blank line, norms on some)
                self.fold(chunk[: n // 2])
                self.fold(chunk[n // 2 :])
                return
            for line in chunk:
                self.line(line)
            return
        plain = _NORM_VALUE.sub('"grad_norm": ', text) if norms else text
        keys = [line[line.find(", ") :] for line in plain.split("\n")]
        numbers = list(map(int, steps))
        values = list(map(float, norms)) if norms else None
        # a negative norm is refused, with its line, by the parser; an int past float64 (which float() reads
        # as inf) too; NaN and Infinity on a line that repeats the last record are rare: parsed alike
        if values is not None and (any(map((0.0).__gt__, values)) or not all(map(math.isfinite, values))):
            for line in chunk:
                self.line(line)
            return
        # where a line's key differs from the one before it: those lines are parsed
        changes = [0, *itertools.compress(range(1, n), map(operator.ne, keys[1:n], keys[: n - 1])), n]
        for start, stop in itertools.pairwise(changes):
            first = start
            if self.pending is not None:  # a bad line is an error unless nothing but blanks follows it
                for i in range(start, stop):
                    self.line(chunk[i])
                continue
            if keys[start] != self.key:
                self.line(chunk[start])
                first += 1
                if keys[start] != self.key:  # a blank or bad line, not a record: the rest go one by one
                    for i in range(first, stop):
                        self.line(chunk[i])
                    continue
            if first < stop:
                self.repeat(numbers[first:stop], None if values is None else values[first:stop], chunk[first:stop])

    def repeat(self, steps: list[int], norms: list[float] | None, lines: list[str]) -> None:
        """Lines that repeat the last record: counted as a block when their steps go up."""
        s = self.summary
        if steps[0] <= s.last_step or not all(map(operator.lt, steps, steps[1:])):
            for line in lines:
                self.line(line)
            return
        self.number += len(steps)
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

    def line(self, line: str) -> None:
        """One line through the JSON parser."""
        self.number += 1
        if not line.strip():
            return
        if self.pending is not None:
            raise self.pending
        try:
            record = _parse(line, self.number)
        except _Unreadable as error:
            if line.endswith("\n"):
                raise
            self.pending = error  # an error unless it is the last line: then the line was cut off
            return
        writer = (record.get("rank"), record.get("run"))
        if (self.rank is not None and writer[0] != self.rank) or (self.run is not None and writer[1] != self.run):
            self.others += 1
            return
        s = self.summary
        if not s.records:
            s.writer, s.run_line = writer, self.number
        elif writer != s.writer:
            s = self.summary = self.next_writer(writer)
        elif record["step"] == s.last_step:
            raise LogError(self.twice(record["step"], writer))
        elif record["step"] < s.last_step or record["skipped_steps"] < s.last["skipped_steps"]:
            s = self.summary = LogSummary(runs=s.runs + 1, run_line=self.number, writer=writer)
        _add(s, record)
        self.key = _key(line, record)

    def next_writer(self, writer: Writer) -> LogSummary:
        """The summary of a run by a new writer; a writer whose run has ended cannot come back."""
        s = self.summary
        if writer in self.ended:
            raise LogError(
                f"line {self.number}: {writer_name(writer)} (from line {self.ended[writer]}) writes again after "
                f"{writer_name(s.writer)} began at line {s.run_line}: several writers share this file (every rank "
                "logging to one path, or two loggers on one scaler); read one with --rank/--run "
                "(report(path, rank=..., run=...)) and give each writer its own file"
            )
        if len(self.ended) < KEPT_WRITERS:
            self.ended[s.writer] = s.run_line
        return LogSummary(runs=s.runs + 1, run_line=self.number, writer=writer)

    def twice(self, step: int, writer: Writer) -> str:
        """The message for a step written twice by what looks like one writer."""
        where = f"line {self.number} repeats step {step}"
        if writer[1] is not None:
            return (
                f"{where} of {writer_name(writer)}: one JsonLinesLogger was added to the scaler twice, and "
                "every record is written twice; add it once"
            )
        return (
            f"{where}: two writers share this file (a logger added twice, or every rank of a DDP job logging "
            "to one path) and its records do not say which wrote them; add each logger once, one file per rank "
            "(JsonLinesLogger writes rank and run, and a file per rank under torch.distributed)"
        )


def _key(line: str, record: dict[str, Any]) -> str | None:
    """The line without its step and norm values, when lines alike may skip the parser (``_Reader.fold``).

    Only for a line whose text says where its values are: its first key ``step``, no escapes (a key
    spelt ``"grad\\u005fnorm"`` is ``grad_norm`` to the parser), and ``"grad_norm"`` once, at the top
    level, written as ``json`` writes numbers; or not at all.
    """
    if not (line.endswith("\n") and line.startswith('{"step": ')) or "\\" in line:
        return None
    norms = len(_NORM_VALUE.findall(line))
    if norms != line.count('"grad_norm"') or norms != ("grad_norm" in record):
        return None
    plain = _NORM_VALUE.sub('"grad_norm": ', line[:-1])
    return plain[plain.find(", ") :]


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
        s.more_names = max(s.more_names, record.get("nonfinite_more", 0))
    norm = None if record.get("grad_norm") is None else float(record["grad_norm"])  # checked: a float holds it
    if norm is not None:
        _norm(s, norm)
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


def summarise_file(
    path: str | Path,
    progress: Callable[[int, int], None] | None = None,
    *,
    rank: int | None = None,
    run: str | None = None,
) -> LogSummary:
    """``summarise`` a file, streamed; ``progress(bytes_read, file_size)`` is called now and then.

    A log still being written reads as it stood when the reader reached its end: the reader stops at
    the first line without its newline (a record the writer has not finished), which is left out.
    OS errors (a missing file) propagate as they are; a file that is not UTF-8 text raises ``LogError``.
    """
    path = Path(path)
    if path.is_dir():
        raise LogError("is a folder, not a log file")
    with path.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as handle:
        size = os.fstat(raw.fileno()).st_size
        tick = None if progress is None else (lambda lines, records: progress(raw.tell(), size))
        try:
            return summarise(_to_the_live_edge(handle), tick, rank=rank, run=run)
        except UnicodeDecodeError:
            raise LogError("is not UTF-8 text: not a JsonLinesLogger log") from None


def _to_the_live_edge(handle: Iterable[str]) -> Iterator[str]:
    """The lines of a file up to and including the first without a newline: what was there at its end.

    A writer appends one record with its newline per write; iterating on past a line without one would
    read the rest of that record, written since, as a line of its own.
    """
    for line in handle:
        yield line
        if not line.endswith("\n"):
            return
