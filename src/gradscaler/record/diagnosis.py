"""What a scaler log says: the diagnosis rules, each a pure function of a ``LogSummary``, and the text.

The rules, in plain words: early skips from an ``init_scale`` set too high (harmless); a collapse, the
scale pinned at its floor or every step skipped (a NaN source, named); backoffs one at a time every
growth interval (the rule working) or clustered (the data or the learning rate); the scale held at
``max_scale``. ``describe`` is the text of ``gradscaler report``.
"""

from __future__ import annotations

import math
from collections import Counter

from gradscaler.record.logsummary import CLUSTER, LONG_SKIP_RUN, LogSummary, writer_name


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


def _count(n: int, noun: str) -> str:
    """``1 growth``, ``34 growths``."""
    return f"{n} {noun}{'s' * (n != 1)}"


def unruled(s: LogSummary) -> str | None:
    """Rule 0: the scale moved where the rule does not move it (set by hand, loaded, or the log edited)."""
    if s.unruled_first is None:
        return None
    step, before, after, counted = s.unruled_first
    ratio = after / before
    factor = f"x{ratio:g}" if ratio >= 1 else f"/{1 / ratio:g}"
    more = f" ({_count(s.unruled - 1, 'more step')} like it)" if s.unruled > 1 else ""
    return (
        f"Scale set outside the rule: at step {step} the scale went from {_scale(before)} to {_scale(after)} "
        f"({factor}) {counted}{more}. The rule never moves the scale that way: "
        "it was set by hand (scaler.update(new_scale), load_state_dict) or the log was edited. The other "
        "findings read the counters, which do not see such a change."
    )


def early_skips(s: LogSummary) -> str | None:
    """Rule 1: the log opens with skips that stop once the scale has come down: init_scale too high."""
    if not s.from_start or s.leading_open or s.leading == 0:
        return None
    count = f"{s.leading}" if s.leading_exact else f"at least {s.leading}"
    return (
        f"Early skips: {'' if s.leading_exact else 'at least '}the first {s.leading} step{'s' * (s.leading != 1)} "
        f"overflowed while the scale came down to "
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
        fell = "" if math.isnan(c.scale_before) else f"from {_scale(c.scale_before)} "  # unknown at a log's start
        return (
            f"Clustered backoffs: {c.count} backoffs between steps {c.first} and {c.last} with no growth between "
            f"them; the scale fell {fell}to {_scale(c.scale_after)}{others}. The gradients "
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


RULES = (unruled, early_skips, collapse, backoff_pattern, capped)


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
        f"{_scale(s.scale_high)}); {_count(s.total('growths'), 'growth')}, {_count(s.total('backoffs'), 'backoff')}.",
    ]
    if s.names:
        others = len(s.names) - min(len(s.names), 5)  # named in the log, not in this line
        more = f" and {others} more" if others else ""
        if s.more_names:  # a record names 20 at most, and counts the rest
            more += f"; up to {s.more_names} more in one step, not named"
        lines.append(f"Non-finite gradients most often in: {_names(s.names, 5)}{more}.")
    elif s.version < 2:
        lines.append("Parameters are not named in this log (gradscaler 0.1.0): skips are read from the counters.")
    if s.norms:
        lines.append(
            f"Clipping norm: {s.norm_low:.3g} to {s.norm_high:.3g}, mean {s.norm_sum / s.norms:.3g} "
            f"({s.norms} records" + (f", {s.norm_nonfinite} non-finite)" if s.norm_nonfinite else ")")
        )
    if s.runs > 1:
        lines.append(f"The file holds {s.runs} runs (the last begins at line {s.run_line}); this covers the last.")
    if s.others:
        lines.append(f"Only the records of {writer_name(s.writer)}: {s.others} records of other writers were left out.")
    if s.truncated:
        lines.append("The last line is cut off (a run stopped mid-write, or still writing): it was left out.")
    findings = diagnose(s)
    lines.append("Diagnosis:" if findings else "Diagnosis: nothing unusual.")
    lines += [f"- {finding}" for finding in findings]
    return "\n".join(lines)
