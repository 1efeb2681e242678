"""Reading a scaler log (``JsonLinesLogger``'s JSON lines) in one streaming pass, and checking its records.

``summarise(lines)`` reads the lines, checks each record, tells the writers and runs of a file apart,
and folds every record it keeps into a ``LogSummary`` (``logsummary``: what the summary holds and how
a record adds to it). ``diagnosis`` says what the summary means. Plain Python, no tensors. The
records are ``JsonLinesLogger``'s (version 2; 0.1.0's seven keys still read: a skip is then seen in
the ``skipped_steps`` counter, and parameters are not named); keys it does not know are ignored.

Nothing is summarised that no logger could have written: every value a record holds is checked (a
scale that is finite and > 0, no more skipped steps than steps, a policy ``GradScaler`` accepts, ...)
and a record that fails is refused with its line number and field (``LogError``, one line). Records
name their writer (``rank`` and ``run``, written by ``JsonLinesLogger``): a file where two writers'
records interleave, or where one record is written twice, is refused with what to do, unless
``rank`` / ``run`` select one writer.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import operator
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from gradscaler import rule
from gradscaler.record import logsummary
from gradscaler.record.logfile import COUNTERS, EMPTY, FOLDER
from gradscaler.record.logsummary import BUCKETS, LogSummary, Writer, writer_name

__all__ = ["BUCKETS", "LogError", "LogSummary", "summarise", "summarise_file", "writer_name"]

REQUIRED = ("step", "scale", *COUNTERS)
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
SHOWN_WRITERS = 4
"""The other writers a ``--rank`` / ``--run`` that matches nothing names (with their record counts)."""

Progress = Callable[[int, int], None]
"""``progress(lines_read, records)``."""


class LogError(ValueError):
    """The input is not a readable scaler log; the message says why in one line."""


NOT_A_LOG = "not a JsonLinesLogger log"
NOT_A_RECORD = "not a JsonLinesLogger record"


class _Malformed(LogError):
    """A line that is not a record at all (not JSON, not an object, no step or scale): ``what`` says what
    the line is, and the message adds the verdict on the file, which the reader makes damaged when
    records came before the line."""

    def __init__(self, what: str, verdict: str) -> None:
        super().__init__(f"{what}: {verdict}")
        self.what = what


class _Unreadable(_Malformed):
    """A line that is not JSON: at the end of a log and without its newline, a record cut off mid-write."""


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
        raise _Malformed(f"line {number} is {type(record).__name__} JSON, not a record", NOT_A_LOG)
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise _Malformed(
            f"line {number} has no {', '.join(repr(k) for k in missing)}",
            "not a gradscaler scaler log (JsonLinesLogger writes step, scale and the counters on every line)",
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
        raise _Unreadable(f"line {number} is JSON nested too deeply for a record", NOT_A_LOG) from None
    except _KeyTwice as error:
        raise _Malformed(f"line {number} holds the key {error.args[0]!r} twice", NOT_A_RECORD) from None
    except ValueError:
        shown = line.strip()
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise _Unreadable(f"line {number} is not JSON ({shown!r})", NOT_A_LOG) from None
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
            raise reader.no_record_of(rank, run)
        raise LogError(EMPTY)
    summary.others = reader.others
    logsummary.close(summary)
    return summary


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
        self.other_writers: Counter[Writer] = Counter()  # the first SHOWN_WRITERS of them, for the message
        self.any_record = False  # whether a line before this one was a record, of any writer
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
        logsummary.add_repeats(self.summary, steps, norms)

    def line(self, line: str) -> None:
        """One line through the JSON parser."""
        self.number += 1
        if not line.strip():
            return
        if self.pending is not None:
            raise self.pending
        try:
            record = _parse(line, self.number)
        except _Malformed as error:
            if isinstance(error, _Unreadable) and not line.endswith("\n"):
                self.pending = error  # an error unless it is the last line: then the line was cut off
                return
            raise self.damaged(error) from None
        writer = (record.get("rank"), record.get("run"))
        self.any_record = True
        if (self.rank is not None and writer[0] != self.rank) or (self.run is not None and writer[1] != self.run):
            self.others += 1
            if len(self.other_writers) < SHOWN_WRITERS or writer in self.other_writers:
                self.other_writers[writer] += 1
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
        logsummary.add(s, record)
        self.key = _key(line, record)

    def damaged(self, error: _Malformed) -> LogError:
        """A line that is no record: the file is not a scaler log, or, when records came before it, a
        damaged one (a record cut mid-write with more written after it, two files joined, an edit)."""
        if not self.any_record:
            return error
        return LogError(
            f"{error.what}: a damaged gradscaler log (the lines before it are a JsonLinesLogger's records): "
            "a record was cut off mid-write and more written after it, or the file was "
            f"joined or edited there; delete line {self.number} to read the rest, or read the lines before it "
            f"(head -n {self.number - 1})"
        )

    def no_record_of(self, rank: int | None, run: str | None) -> LogError:
        """``--rank`` / ``--run`` chose a writer that wrote nothing here: which writers did."""
        wanted = writer_name((rank, run))
        shown = ", ".join(f"{writer_name(w)} ({n} records)" for w, n in self.other_writers.most_common())
        more = len(self.other_writers) >= SHOWN_WRITERS and sum(self.other_writers.values()) < self.others
        return LogError(
            f"{wanted} wrote none of this log's {self.others} records; they were written by {shown}"
            f"{' and others' if more else ''}: choose one of those with --rank/--run (report(path, rank=..., "
            "run=...)), or open the file that writer logged to (under torch.distributed each rank writes its own file)"
        )

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
        raise LogError(FOLDER)
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
