"""``gradscaler report`` on what real runs and adversaries hand it (issue 25, item 2).

It never crashes and never summarises what no logger wrote: every bad input is one line on stderr
and exit 1 (``gradscaler.report`` raises ``ValueError``), a log still being written reads up to its
last complete record, several writers in one file are told apart or refused with what to do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradscaler
from gradscaler.record import reporting, scalerlog
from gradscaler.record.diagnosis import describe
from gradscaler.record.scalerlog import LogError, summarise, summarise_file
from synthetic_log import lines, records

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = '"skipped_steps": 0, "consecutive_skips": 0, "growths": 0, "backoffs": 0, "collapse_run": 0'


def line(step: int = 1, scale: str = "65536.0", counters: str = COUNTERS, extra: str = "") -> str:
    """One record's line, as JsonLinesLogger writes it, with ``extra`` keys after the counters."""
    return f'{{"step": {step}, "scale": {scale}, {counters}{extra}}}\n'


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "gradscaler", "report", *argv], capture_output=True, text=True, env=env, check=False
    )


def assert_refused_everywhere(path: Path, message: str, **select: Any) -> None:
    """The CLI: exit 1, nothing on stdout, one line on stderr; the API: ValueError with the same words."""
    flags = [part for key, value in select.items() for part in (f"--{key}", str(value))]
    result = run_cli(str(path), *flags)
    assert result.returncode == 1, result
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"gradscaler report: {path}: "), result.stderr
    assert message in result.stderr, result.stderr
    with pytest.raises(ValueError) as caught:
        gradscaler.report(path, **select)
    assert isinstance(caught.value, LogError) and message in str(caught.value) and "\n" not in str(caught.value)


NESTED = "[" * 100_000 + "]" * 100_000
BAD = {
    "int-scale-past-float": (line(scale="1" + "0" * 400), "line 1: 'scale' must be a finite number > 0"),
    "nested-json": (NESTED + "\n", "line 1 is JSON nested too deeply for a record"),
    "nested-field": (line(extra=f', "x": {NESTED}'), "line 1 is JSON nested too deeply"),
    "growth-interval-0": (
        line(extra=', "policy": {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 0}'),
        "line 1: 'policy' holds a setting no GradScaler accepts: growth_interval must be an int in [1, ",
    ),
    "policy-not-an-object": (line(extra=', "policy": 7'), "line 1: 'policy' must be an object"),
    "nan-scale": (line(scale="NaN"), "line 1: 'scale' must be a finite number > 0"),
    "inf-scale": (line(scale="Infinity"), "line 1: 'scale' must be a finite number > 0"),
    "zero-scale": (line(scale="0.0"), "line 1: 'scale' must be a finite number > 0, got 0.0"),
    "negative-scale": (line(scale="-2.0"), "line 1: 'scale' must be a finite number > 0, got -2.0"),
    "more-skips-than-steps": (
        line(2, counters=COUNTERS.replace('"skipped_steps": 0', '"skipped_steps": 50')),
        "line 1: 'skipped_steps' (50) is more than 'step' (2)",
    ),
    "more-in-a-row-than-skipped": (
        line(9, counters=COUNTERS.replace('"consecutive_skips": 0', '"consecutive_skips": 3')),
        "line 1: 'consecutive_skips' (3) is more than 'skipped_steps' (0)",
    ),
    "negative-grad-norm": (line(extra=', "grad_norm": -1.5'), "line 1: 'grad_norm' must be a number >= 0"),
    "string-grad-norm": (line(extra=', "grad_norm": "1.5"'), "line 1: 'grad_norm' must be a number >= 0"),
    "negative-nonfinite-more": (
        line(extra=', "nonfinite": ["w"], "nonfinite_more": -5'),
        "line 1: 'nonfinite_more' must be an int >= 0, got -5",
    ),
    "names-not-strings": (line(extra=', "nonfinite": [1, 2]'), "line 1: 'nonfinite' must be a list of parameter"),
    "key-twice": (line(extra=', "step": 7'), "line 1 holds the key 'step' twice"),
    "bad-rank": (line(extra=', "rank": -1, "run": "a"'), "line 1: 'rank' must be an int >= 0, got -1"),
    "not-json-with-newline-at-end": (line() + '{"step": 2, "scale": 655\n', "line 2 is not JSON"),
}


@pytest.mark.parametrize(("content", "message"), list(BAD.values()), ids=list(BAD))
def test_each_bad_log_is_one_line_and_exit_1(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "scaler.jsonl"
    path.write_text(content)
    assert_refused_everywhere(path, message)


def test_a_bad_value_in_the_middle_names_its_line() -> None:
    good = list(lines(records(40, {9}, growth_interval=10, version=1)))
    good[25] = good[25].replace('"scale": ', '"scale": -')
    with pytest.raises(LogError, match=r"^line 26: 'scale' must be a finite number > 0, got -"):
        summarise(good)


def test_a_negative_norm_among_repeated_lines_is_refused_on_the_fast_path() -> None:
    good = list(lines(records(300, (), growth_interval=1000, norm=lambda s: 1.0)))
    good[200] = good[200].replace('"grad_norm": 1.0', '"grad_norm": -1.0')
    with pytest.raises(LogError, match=r"^line 201: 'grad_norm' must be a number >= 0"):
        summarise(good)


def test_a_number_json_does_not_write_is_not_read_on_the_fast_path() -> None:
    good = list(lines(records(300, (), growth_interval=1000, norm=lambda s: 1.0)))
    for bad in ("inf", "1_0", "01.0"):
        changed = [*good[:200], good[200].replace('"grad_norm": 1.0', f'"grad_norm": {bad}'), *good[201:]]
        with pytest.raises(LogError, match=r"^line 201 is not JSON"):
            summarise(changed)


# A log still being written


def test_a_record_finished_while_the_reader_passes_it_is_left_out(tmp_path: Path, monkeypatch) -> None:
    """The writer finishes the last record (and writes more) right after the reader has read its first half.

    The reader reads 41 lines a chunk here, so its first chunk ends with the half record; the writer
    goes on before the next. Before, that read the rest of the record as a line of its own: "line 42
    is not JSON".
    """
    monkeypatch.setattr(scalerlog, "CHUNK", 41)
    monkeypatch.setattr(scalerlog, "PROGRESS_EVERY", 1)
    text = list(lines(records(60, {9}, growth_interval=10)))
    path = tmp_path / "live.jsonl"
    half = len(text[40]) // 2
    path.write_text("".join(text[:40]) + text[40][:half])

    def writer_moves_on(done: int, size: int) -> None:
        if len(path.read_text().splitlines()) == 41:
            with path.open("a") as handle:
                handle.write(text[40][half:] + "".join(text[41:]))

    summary = summarise_file(path, writer_moves_on)
    assert len(path.read_text().splitlines()) == 60  # the writer did go on
    assert summary.records == 40 and summary.truncated
    assert describe(summary).startswith("1 of 40 steps skipped")
    assert summarise_file(path).records == 60  # read again, the whole log


def test_a_log_read_while_a_scaler_writes_it_always_reads(tmp_path: Path) -> None:
    """A writer thread appends records in two writes each; every read meanwhile is a prefix of the run."""
    path = tmp_path / "live.jsonl"
    text = list(lines(records(400, lambda k: k % 37 == 0, growth_interval=10, norm=lambda s: 0.5)))
    done = threading.Event()

    def write() -> None:
        with path.open("a") as handle:
            for record in text:
                handle.write(record[:30])
                handle.flush()
                time.sleep(0.0002)
                handle.write(record[30:])
                handle.flush()
        done.set()

    path.write_text("")
    thread = threading.Thread(target=write)
    thread.start()
    reads = []
    while not done.is_set():
        try:
            summary = summarise_file(path)
        except LogError as error:
            assert str(error).startswith("the log is empty") or str(error).startswith("line 1 is not JSON"), error
            continue
        reads.append(summary.records)
        expected = summarise(text[: summary.records])
        assert describe(summary).split("\n")[0] == describe(expected).split("\n")[0]
    thread.join()
    assert reads == sorted(reads) and summarise_file(path).records == 400


# Several writers in one file


def train(loggers: list[Any], steps: int = 30, overflow: tuple[int, ...] = (7, 19)) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gradscaler.GradScaler("cpu", growth_interval=5)
    scaler.name_parameters(model)
    for logger in loggers:
        scaler.add_logger(logger)
    for step in range(1, steps + 1):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        if step in overflow:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()


def test_records_name_their_writer(tmp_path: Path) -> None:
    logger = gradscaler.JsonLinesLogger(tmp_path / "s.jsonl")
    train([logger])
    written = [json.loads(text) for text in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert {(r["rank"], r["run"]) for r in written} == {(0, logger.run)} and re.fullmatch("[0-9a-f]{12}", logger.run)
    assert logger.file == tmp_path / "s.jsonl"
    assert gradscaler.JsonLinesLogger(tmp_path / "t.jsonl").run != logger.run


def test_a_logger_added_twice_is_refused_with_what_to_do(tmp_path: Path) -> None:
    logger = gradscaler.JsonLinesLogger(tmp_path / "s.jsonl")
    train([logger, logger])
    assert_refused_everywhere(
        tmp_path / "s.jsonl", f"line 2 repeats step 1 of rank 0 run {logger.run}: one JsonLinesLogger was added"
    )


def test_two_loggers_on_one_path_are_told_apart(tmp_path: Path) -> None:
    first, second = gradscaler.JsonLinesLogger(tmp_path / "s.jsonl"), gradscaler.JsonLinesLogger(tmp_path / "s.jsonl")
    train([first, second])
    message = f"line 3: rank 0 run {first.run} (from line 1) writes again after rank 0 run {second.run} began at line 2"
    assert_refused_everywhere(tmp_path / "s.jsonl", message)
    alone = gradscaler.JsonLinesLogger(tmp_path / "alone.jsonl")
    train([alone])
    text = gradscaler.report(tmp_path / "s.jsonl", run=second.run).text
    assert text.startswith("2 of 30 steps skipped")
    left_out = f"Only the records of rank 0 run {second.run}: 30 records of other writers were left out.\n"
    assert left_out in text and text.replace(left_out, "") == gradscaler.report(tmp_path / "alone.jsonl").text
    result = run_cli(str(tmp_path / "s.jsonl"), "--run", first.run)
    assert result.returncode == 0 and result.stdout.startswith("2 of 30 steps skipped"), result.stderr
    writers = f"they were written by rank 0 run {first.run} (30 records), rank 0 run {second.run} (30 records)"
    said = f"run nope wrote none of this log's 60 records; {writers}: choose one of those with --rank/--run"
    assert_refused_everywhere(tmp_path / "s.jsonl", said, run="nope")


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)


def test_each_rank_writes_its_own_file_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_rank(monkeypatch, 3)
    logger = gradscaler.JsonLinesLogger(tmp_path / "scaler.jsonl")
    train([logger])
    assert logger.file == tmp_path / "scaler.rank3.jsonl" and not (tmp_path / "scaler.jsonl").exists()
    assert json.loads((tmp_path / "scaler.rank3.jsonl").read_text().splitlines()[0])["rank"] == 3
    as_rank(monkeypatch, 0)
    zero = gradscaler.JsonLinesLogger(tmp_path / "scaler.jsonl")
    train([zero])
    assert zero.file == tmp_path / "scaler.jsonl"


def test_ranks_sharing_one_file_read_one_rank_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of a DDP job logging to one path (``per_rank=False``): the issue's "101 runs"."""
    path = tmp_path / "scaler.jsonl"
    ranks = [gradscaler.JsonLinesLogger(path, per_rank=False) for _ in range(2)]
    for rank, logger in enumerate(ranks):  # settle each logger's rank as its process would
        as_rank(monkeypatch, rank)
        logger({"step": 0})
    path.write_text("")
    train(ranks)
    assert_refused_everywhere(path, "writes again after rank 1 run")
    for rank in (0, 1):
        assert gradscaler.report(path, rank=rank).text.startswith("2 of 30 steps skipped")


def test_old_logs_written_twice_are_refused() -> None:
    """Records without rank and run (0.1.0 and earlier version-2 logs) cannot be told apart: refused."""
    doubled = [text for text in lines(records(20, {4}, growth_interval=5)) for _ in range(2)]
    with pytest.raises(LogError, match=r"^line 2 repeats step 1: two writers share this file .* one file per rank"):
        summarise(doubled)


# What the report says


def test_more_parameters_are_never_counted_than_the_model_has(tmp_path: Path) -> None:
    """28 parameters, every gradient inf on 4 steps: records name 20 and count 8 more; it said "and 32 more"."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(14)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = gradscaler.GradScaler("cpu", growth_interval=100)
    scaler.name_parameters(model)
    scaler.add_logger(gradscaler.JsonLinesLogger(tmp_path / "s.jsonl"))
    for step in range(1, 11):
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 3)).sum()).backward()
        if step in (2, 4, 6, 8):
            for p in model.parameters():
                p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
    text = gradscaler.report(tmp_path / "s.jsonl").text
    names_line = next(t for t in text.splitlines() if t.startswith("Non-finite gradients most often in:"))
    assert names_line.count("(4 steps)") == 5
    assert names_line.endswith(" and 15 more; up to 8 more in one step, not named.")


def test_the_legend_counts_the_backoffs_it_draws(tmp_path: Path) -> None:
    """11 backoffs, the first at step 1: the legend said 11 and drew 10 (the first record had no marker)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overflow = {1, *range(20, 200, 18)}
    summary = summarise(lines(records(200, overflow, init_scale=2.0**20, growth_interval=7)))
    assert summary.total("backoffs") == 11
    fig, ax = plt.subplots()
    reporting._scale_panel(ax, summary)
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    backoffs = next(c for c, label in zip(ax.collections, labels[1:], strict=False) if label.startswith("backoff"))
    assert "backoff (11)" in labels and len(backoffs.get_offsets()) == 11
    plt.close(fig)
    drawn, label = reporting.events(summarise(lines(records(100, {30, 60}, every=50, version=1))))["backoffs"]
    assert (len(drawn), label) == (2, "backoff (2)")
    drawn, label = reporting.events(summarise(lines(records(100, {30, 31}, every=50, version=1))))["backoffs"]
    assert (len(drawn), label) == (1, "backoffs (2, in 1 records)")


# The fuzz test: real logs, mutated; a correct summary or one clear line, nothing else


def real_log() -> list[str]:
    """A real run's log: named parameters, clipping norms, a policy, skips, growths and backoffs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = gradscaler.GradScaler("cpu", init_scale=2.0**18, growth_interval=6)
    scaler.name_parameters(model)
    written: list[str] = []
    scaler.add_logger(lambda record: written.append(json.dumps({**record, "rank": 0, "run": "fuzzrun"}) + "\n"))
    for step in range(1, 121):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
        if step % 17 == 0 or step in (40, 41, 42):
            model[2].weight.grad[1, 1] = float("nan")
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    return written


NUMBERS = ["-1", "0", "-0.0", "1e400", "-1e400", "1" + "0" * 30, "9" * 400, "NaN", "Infinity", "-Infinity", "2.5",
           "1e-320", "true", "null", '"7"', "[]", "{}", str(2**63)]  # fmt: skip


def mutate(rng: Any, good: list[str], other: list[str]) -> tuple[bytes, str]:
    """One random mutation of a log, and its kind."""
    kind = rng.choice(["truncate", "bytes", "number", "nesting", "duplicate", "interleave"])
    text = list(good)
    if kind == "truncate":
        blob = "".join(text).encode()
        return blob[: rng.randrange(len(blob) + 1)], kind
    if kind == "bytes":
        blob = bytearray("".join(text).encode())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(blob))
            action = rng.choice(["set", "insert", "delete"])
            if action == "set":
                blob[at] = rng.randrange(256)
            elif action == "insert":
                blob.insert(at, rng.randrange(256))
            else:
                del blob[at]
        return bytes(blob), kind
    if kind == "number":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            spots = list(re.finditer(r"-?\d+(?:\.\d+)?(?:e-?\d+)?|NaN|Infinity", text[i]))
            if spots:
                m = rng.choice(spots)
                text[i] = text[i][: m.start()] + rng.choice(NUMBERS) + text[i][m.end() :]
        return "".join(text).encode(), kind
    if kind == "nesting":
        i = rng.randrange(len(text))
        depth = rng.choice([3, 50, 5000, 200_000])
        inner = rng.choice(["1", text[rng.randrange(len(text))].strip()])
        value = "[" * depth + inner + "]" * depth
        text[i] = text[i][:-2] + f', "{rng.choice(["x", "policy", "grad_norm", "nonfinite"])}": {value}}}\n'
        return "".join(text).encode(), kind
    if kind == "duplicate":
        i = rng.randrange(len(text))
        at = rng.choice([i, i + 1, rng.randrange(len(text) + 1)])
        text.insert(at, text[i])
        return "".join(text).encode(), "duplicate-adjacent" if at in (i, i + 1) else kind
    merged, a, b = [], list(text), list(other)
    while a or b:
        source = a if (a and (not b or rng.random() < 0.5)) else b
        merged.append(source.pop(0))
    return "".join(merged).encode(), kind


def outcome(path: Path) -> tuple[str, str]:
    """("ok", report text) or ("refused", the message): anything else fails the test."""
    try:
        return "ok", gradscaler.report(path).text
    except LogError as error:
        return "refused", str(error)


def check_summary(summary: scalerlog.LogSummary) -> None:
    """What holds of every summary of a run: nothing impossible reaches the text."""
    skipped, steps = summary.total("skipped_steps"), summary.steps
    assert 0 <= skipped <= steps and summary.records >= 1
    assert 0 < summary.scale_low <= summary.scale_high < float("inf")
    assert summary.more_names >= 0 and (summary.norms == 0 or summary.norm_low >= 0)
    assert all(0 < b.low <= b.high < float("inf") for b in summary.buckets)
    text = describe(summary)
    assert text.startswith(f"{skipped} of {steps} steps skipped") and " nan " not in text


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_the_reader_gives_a_correct_summary_or_one_clear_line(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    rng = random.Random(seed)
    good = real_log()
    other = [text.replace('"run": "fuzzrun"', '"run": "other"') for text in good]
    clean = summarise(good)
    check_summary(clean)
    for case in range(80):
        content, kind = mutate(rng, good, other)
        path = tmp_path / f"case{case}.jsonl"
        path.write_bytes(content)
        fast = outcome(path)
        with monkeypatch.context() as parser_only:  # no line skips the parser: the fast path must agree
            parser_only.setattr(scalerlog, "_STEP", re.compile(r"(?!)"))
            assert outcome(path) == fast, (kind, content[:300])
        verdict, said = fast
        if verdict == "refused":
            assert "\n" not in said and len(said) < 600 and said, (kind, said)
            assert re.match(r"line \d+[ :]|the log is empty|is not UTF-8 text", said), (kind, said)
        else:
            check_summary(gradscaler.report(path).summary)
        # where the right outcome is known, it is that one
        if kind == "truncate":
            whole = content.decode().split("\n")
            kept, partial = [t + "\n" for t in whole[:-1]], whole[-1]
            if kept:
                expected = summarise([*kept, partial]) if partial else summarise(kept)
                assert fast == ("ok", describe(expected)), (content[-80:], said)
        if kind == "interleave" and content.decode().find('"other"') < content.decode().rfind('"fuzzrun"'):
            assert verdict == "refused" and "writes again after" in said
        if kind == "duplicate-adjacent":  # one writer's record twice (a copy elsewhere may read as a new run)
            assert verdict == "refused" and "repeats step" in said and "added to the scaler twice" in said


def test_fuzz_cases_through_the_command_line(tmp_path: Path) -> None:
    """A few mutated logs through ``gradscaler report``: exit 0 with the text, or 1 with one line."""
    import random

    rng = random.Random(99)
    good = real_log()
    other = [text.replace('"run": "fuzzrun"', '"run": "other"') for text in good]
    for case in range(6):
        content, kind = mutate(rng, good, other)
        path = tmp_path / f"case{case}.jsonl"
        path.write_bytes(content)
        verdict, said = outcome(path)
        result = run_cli(str(path))
        assert "Traceback" not in result.stderr, (kind, result.stderr)
        if verdict == "ok":
            assert result.returncode == 0 and result.stdout.startswith(said.split("\n")[0]), (kind, result)
        else:
            assert result.returncode == 1 and result.stderr == f"gradscaler report: {path}: {said}\n", (kind, result)
