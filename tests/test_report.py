"""``gradscaler report``: the streaming reader, each diagnosis rule on a synthetic log, bad input, the figure."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gradscaler
from gradscaler.record import diagnosis, reporting, scalerlog
from gradscaler.record.diagnosis import describe
from gradscaler.record.scalerlog import LogError, summarise
from gradscaler.tools import cli
from synthetic_log import lines, records

ROOT = Path(__file__).resolve().parents[1]


def text_of(recs: Iterator[dict]) -> str:
    return describe(summarise(lines(recs)))


def write(path: Path, recs: Iterator[dict]) -> Path:
    path.write_text("".join(lines(recs)))
    return path


# The summary line, on version-2 logs, 0.1.0 logs and every=N gaps


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("every", [1, 10])
def test_summary_opens_with_skipped_of_steps(version: int, every: int) -> None:
    recs = records(60, {7, 15, 33}, growth_interval=10, version=version, every=every, names=lambda s: ["fc.weight"])
    summary = summarise(lines(recs))
    assert describe(summary).startswith("3 of 60 steps skipped (5.0%);")
    assert (summary.steps, summary.total("skipped_steps"), summary.records) == (60, 3, 60 // every)
    assert summary.total("backoffs") == 3
    if version == 2 and every == 1:  # a record names the parameters of its own step only
        assert "most often in: fc.weight (3 steps)" in describe(summary)
    elif version == 1:
        assert "not named in this log (gradscaler 0.1.0)" in describe(summary)


@pytest.mark.parametrize("chunk", [7, 4096])
def test_fast_path_reads_what_the_json_parser_reads(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines that repeat the one before skip the parser; the same records in another key order cannot."""
    monkeypatch.setattr(scalerlog, "CHUNK", chunk)
    norm = lambda s: float("nan") if s == 777 else s / 7  # noqa: E731
    recs = list(records(3000, lambda k: k % 97 == 0, growth_interval=30, names=lambda s: ["w"], norm=norm))
    for r in recs[1000:1200]:
        del r["grad_norm"]  # clipping on some steps only
    recs += list(records(900, {5, 6}, growth_interval=40))  # a second run in the same file
    fast = [json.dumps(r) + "\n" for r in recs]
    slow_lines = [json.dumps(r, sort_keys=True) + "\n" for r in recs]
    fast[50:50] = slow_lines[50:50] = ["\n", "  \n"]
    slow = summarise(slow_lines)
    parsed: list[int] = []
    parse = scalerlog._parse
    monkeypatch.setattr(scalerlog, "_parse", lambda line, number: parsed.append(number) or parse(line, number))
    fast_summary = summarise(fast)
    assert len(parsed) < len(fast) / 4  # most lines took the fast path
    assert describe(fast_summary) == describe(slow)
    assert fast_summary.buckets == slow.buckets and fast_summary.records == slow.records == 900
    first = summarise(fast[:3002])
    assert (first.norms, first.norm_nonfinite) == (2799, 1)
    assert first.norm_low == pytest.approx(1 / 7) and first.norm_high == pytest.approx(3000 / 7)


def test_a_log_that_starts_late_counts_from_its_first_record() -> None:
    summary = summarise(lines(records(50, {1010, 1020}, start=1000, growth_interval=5)))
    assert describe(summary).startswith("2 of 50 steps skipped")
    assert early_rule(summary) is None  # the start of the run is not in the log


def early_rule(summary: scalerlog.LogSummary) -> str | None:
    return diagnosis.early_skips(summary)


def test_a_file_with_two_runs_reports_the_last() -> None:
    first = list(lines(records(30, {3}, growth_interval=10)))
    second = list(lines(records(20, {4, 5}, growth_interval=10)))
    text = describe(summarise(first + second))
    assert text.startswith("2 of 20 steps skipped")
    assert "holds 2 runs (the last begins at line 31)" in text


def test_the_plot_keeps_a_bounded_number_of_buckets() -> None:
    summary = summarise(lines(records(30_000, lambda k: k % 1000 == 0, growth_interval=100, version=1)))
    assert len(summary.buckets) <= scalerlog.BUCKETS
    assert sum(b.skips for b in summary.buckets) == 30
    assert summary.buckets[0].first == 1 and summary.buckets[-1].last == 30_000


# The diagnosis rules, each on the pattern it names and silent on the others


def test_rule_early_skips_from_a_high_init_scale() -> None:
    summary = summarise(lines(records(60, {1, 2, 3, 4}, init_scale=2.0**20, growth_interval=100)))
    finding = diagnosis.early_skips(summary)
    assert finding is not None
    assert "the first 4 steps overflowed while the scale came down to 65536" in finding
    assert "Harmless: it cost 4 of 60 steps (6.7%)" in finding and "init_scale=65536" in finding
    assert diagnosis.collapse(summary) is None and diagnosis.backoff_pattern(summary) is None


def test_rule_early_skips_with_gaps_says_at_least() -> None:
    summary = summarise(lines(records(100, set(range(1, 16)), every=10, version=1, growth_interval=1000)))
    finding = diagnosis.early_skips(summary)
    assert finding is not None and "at least the first 10 steps overflowed" in finding
    assert "it cost at least 10 of 100 steps" in finding


@pytest.mark.parametrize("version", [2, 1])
def test_rule_collapse_names_the_nan_source(version: int) -> None:
    def names(step: int) -> list[str]:
        return ["blocks.2.attn.qkv.weight"] if step >= 200 else ["head.bias"]

    recs = records(600, lambda k: k >= 200, growth_interval=50, names=names, version=version)
    summary = summarise(lines(recs))
    finding = diagnosis.collapse(summary)
    assert finding is not None
    assert "every step from 200 to the end of the log was skipped (401 in a row)" in finding
    assert "the scale sat at its floor 2**-126" in finding and "a NaN" in finding
    if version == 2:
        assert "Non-finite in those steps: blocks.2.attn.qkv.weight" in finding
        assert "head.bias" not in finding
    else:
        assert "does not name parameters" in finding
    assert diagnosis.backoff_pattern(summary) is None  # the collapse is not a cluster of overflows


def test_rule_collapse_at_min_scale() -> None:
    summary = summarise(lines(records(100, set(range(40, 47)), init_scale=2.0, min_scale=1.0, names=lambda s: ["w"])))
    finding = diagnosis.collapse(summary)
    assert finding is not None and "every step from 40 to 46 was skipped (7 in a row)" in finding
    assert "floor 1" in finding


def test_rule_collapse_when_every_step_is_skipped() -> None:
    finding = diagnosis.collapse(summarise(lines(records(30, lambda k: True, version=1))))
    assert finding is not None and "every one of the 30 steps in the log was skipped" in finding


def test_rule_oscillation_every_growth_interval_is_fine() -> None:
    summary = summarise(lines(records(3000, lambda k: k % 101 == 0, growth_interval=50)))
    finding = diagnosis.backoff_pattern(summary)
    assert finding is not None and finding.startswith("Oscillation: the scale backed off 29 times, one at a time")
    assert "about every 101 steps" in finding and "growth_interval=50" in finding and "Nothing to fix" in finding
    assert diagnosis.collapse(summary) is None and diagnosis.early_skips(summary) is None


def test_rule_clustered_backoffs_point_at_data_or_lr() -> None:
    overflow = {500, 501, 505, 507, 510} | {k for k in range(1, 3001) if k % 301 == 0 and not 450 < k < 560}
    summary = summarise(lines(records(3000, overflow, growth_interval=25)))
    finding = diagnosis.backoff_pattern(summary)
    assert finding is not None
    assert finding.startswith("Clustered backoffs: 5 backoffs between steps 500 and 510 with no growth between them")
    assert "fell from 2**" in finding and "data (a bad batch) or the learning rate" in finding


def test_rule_clusters_are_found_in_a_0_1_0_log_with_gaps() -> None:
    overflow = set(range(1000, 1040, 4))
    summary = summarise(lines(records(4000, overflow, growth_interval=200, every=5, version=1)))
    finding = diagnosis.backoff_pattern(summary)
    assert finding is not None and "Clustered backoffs: 10 backoffs between steps 1000 and 1040" in finding


@pytest.mark.parametrize("version", [2, 1])
def test_rule_capped_at_max_scale(version: int) -> None:
    summary = summarise(lines(records(5000, (), growth_interval=100, max_scale=2.0**20, version=version)))
    finding = diagnosis.capped(summary)
    assert finding is not None
    assert "from step 400 to 5000 (4600 steps, 46.0 growth intervals)" in finding
    if version == 2:
        assert finding.startswith("Capped: the scale sat at max_scale=2**20")
    else:
        assert "something caps it (max_scale?)" in finding


def test_no_rule_fires_on_a_quiet_run() -> None:
    summary = summarise(lines(records(1000, {500}, growth_interval=100, max_scale=2.0**30)))
    assert diagnosis.diagnose(summary) == []
    assert describe(summary).endswith("Diagnosis: nothing unusual.")


# Size: constant memory, whatever the length


def template_lines(count: int) -> Iterator[str]:
    """A fast synthetic 0.1.0 log: in every 1000 steps a growth at 500 and a skip with a backoff at 1000."""
    for block in range(count // 1000):
        base, done = 1000 * block, block  # events before this block: ``done`` skips, ``done`` growths
        tail = ', "scale": {}, "skipped_steps": {}, "consecutive_skips": {}, "growths": {}, "backoffs": {}, '
        tail += '"collapse_run": 0}}\n'
        low, grown = tail.format(32768.0, done, 0, done, done), tail.format(65536.0, done, 0, done + 1, done)
        yield from (f'{{"step": {base + k}' + low for k in range(1, 500))
        yield from (f'{{"step": {base + k}' + grown for k in range(500, 1000))
        yield f'{{"step": {base + 1000}' + tail.format(32768.0, done + 1, 1, done + 1, done + 1)


def retained(summary: scalerlog.LogSummary) -> int:
    """The size of everything the summary holds (pickled)."""
    return len(pickle.dumps(summary))


@pytest.mark.parametrize("count", [1_000_000, pytest.param(10_000_000, marks=pytest.mark.slow)], ids=["1M", "10M"])
def test_a_long_log_streams_in_bounded_memory(count: int) -> None:
    """10x the small log's length in ``make test`` (a state that grew with the log would be 10x, not < 1.5x),
    100x in ``make test-slow`` (25 s at load 4 on 2 cores)."""
    small, big = summarise(template_lines(100_000)), summarise(template_lines(count))
    events = count // 1000
    assert describe(big).startswith(f"{events} of {count} steps skipped")
    assert (small.total("growths"), big.total("growths"), big.total("backoffs")) == (100, events, events)
    assert f"Oscillation: the scale backed off {events} times, one at a time, about every 1000 steps" in describe(big)
    # The reader keeps the plot's buckets, counters and a few stretches: no more at 10x or 100x the length.
    assert len(big.buckets) <= scalerlog.BUCKETS and retained(big) < 1.5 * retained(small) < 2**20


# Bad input: one line on stderr, exit 1, never a traceback


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "gradscaler", "report", *argv], capture_output=True, text=True, env=env, check=False
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the log is empty: no records"),
        (b"\n\n", "the log is empty: no records"),
        (b"step,scale\n1,65536\n", "line 1 is not JSON ('step,scale'): not a JsonLinesLogger log"),
        (b"[1, 2]\n", "line 1 is list JSON, not a record"),
        (b'{"loss": 1.5}\n', "line 1 has no 'step', 'scale', 'skipped_steps'"),
        (b"\xff\xfe\x00binary", "is not UTF-8 text"),
        (
            b'{"step": 1, "scale": 2.0, "skipped_steps": 0, "consecutive_skips": 0, "growths": 0, "backoffs": 0, '
            b'"collapse_run": 0}\n{"step": 2, oops\n{"step": 3}\n',
            "line 2 is not JSON",
        ),
        (
            b'{"step": -1, "scale": 2.0, "skipped_steps": 0, "consecutive_skips": 0, "growths": 0, "backoffs": 0, '
            b'"collapse_run": 0}\n',
            "line 1: 'step' must be an int >= 0, got -1",
        ),
    ],
    ids=["empty", "blank", "csv", "json-array", "other-json", "binary", "bad-middle-line", "negative-step"],
)
def test_bad_logs_are_one_line_and_exit_1(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "scaler.jsonl"
    path.write_bytes(content)
    result = run_cli(str(path))
    assert result.returncode == 1, result
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stderr.startswith(f"gradscaler report: {path}: ")


@pytest.mark.parametrize("chunk", [4, 4096])
def test_a_bad_line_between_repeated_records_is_an_error(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    good = list(lines(records(40, (), version=1)))
    monkeypatch.setattr(scalerlog, "CHUNK", chunk)
    with pytest.raises(LogError, match=r"line 21 is not JSON \('\{\"step\": 21, \"sca'\)"):
        summarise([*good[:20], '{"step": 21, "sca\n', *good[21:]])


def test_missing_file_and_folder(tmp_path: Path) -> None:
    missing = run_cli(str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr == (
        f"gradscaler report: cannot read the log {tmp_path / 'nope.jsonl'}: No such file or directory\n"
    )
    folder = run_cli(str(tmp_path))
    assert folder.returncode == 1 and folder.stderr == f"gradscaler report: {tmp_path}: is a folder, not a log file\n"


def test_an_out_folder_that_does_not_exist_is_named_not_the_log(tmp_path: Path) -> None:
    log = write(tmp_path / "s.jsonl", records(30, {5}, growth_interval=10))
    result = run_cli(str(log), "--out", str(tmp_path / "nosuchdir" / "r.png"))
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr == (
        f"gradscaler report: --out {tmp_path / 'nosuchdir' / 'r.png'}: the folder {tmp_path / 'nosuchdir'} does "
        f"not exist; create it (mkdir -p {tmp_path / 'nosuchdir'}) or choose another --out\n"
    )
    assert not (tmp_path / "nosuchdir").exists()


def test_an_out_that_is_a_folder_or_under_a_file_is_named(tmp_path: Path) -> None:
    log = write(tmp_path / "s.jsonl", records(30, {5}, growth_interval=10))
    folder = run_cli(str(log), "--out", str(tmp_path))
    assert folder.returncode == 1
    assert folder.stderr == (
        f"gradscaler report: --out {tmp_path}: {tmp_path} is a folder; name a file in it, "
        f"e.g. --out {tmp_path / 'report.png'}\n"
    )
    under_file = run_cli(str(log), "--out", str(log / "r.png"))
    assert under_file.returncode == 1 and f"the folder {log} is not a folder" in under_file.stderr


def test_an_out_without_a_suffix_prints_the_file_it_wrote(tmp_path: Path) -> None:
    log = write(tmp_path / "s.jsonl", records(30, {5}, growth_interval=10))
    result = run_cli(str(log), "--out", str(tmp_path / "name"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"figure: {tmp_path / 'name.png'}"
    assert (tmp_path / "name.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "name").exists()
    assert gradscaler.report(log, out=tmp_path / "other").figure == tmp_path / "other.png"
    assert (tmp_path / "other.png").exists()


def test_a_figure_that_cannot_be_written_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Reading succeeded; writing failed (a full disk, a read-only folder): the figure's file is named."""
    log = write(tmp_path / "s.jsonl", records(30, {5}, growth_interval=10))

    def refuse(summary: object, out: Path, title: str = "") -> None:
        raise PermissionError(13, "Permission denied", str(out))

    monkeypatch.setattr(reporting, "draw", refuse)
    assert cli.main(["report", str(log), "--out", str(tmp_path / "r.png")]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("1 of 30 steps skipped")
    assert err == f"gradscaler report: cannot write the figure {tmp_path / 'r.png'}: Permission denied\n"


def test_a_cut_off_last_line_is_left_out_and_said(tmp_path: Path) -> None:
    text = "".join(lines(records(40, {9}, growth_interval=10, version=1)))
    path = tmp_path / "scaler.jsonl"
    path.write_text(text + '{"step": 41, "scale": 655')
    result = run_cli(str(path))
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert result.stdout.startswith("1 of 40 steps skipped")
    assert "The last line is cut off (a run stopped mid-write, or still writing): it was left out." in result.stdout


def test_a_0_1_0_log_reads(tmp_path: Path) -> None:
    path = write(tmp_path / "old.jsonl", records(100, {20, 60}, growth_interval=10, version=1, every=5))
    result = run_cli(str(path))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("2 of 100 steps skipped (2.0%)")
    assert "not named in this log (gradscaler 0.1.0)" in result.stdout


# The figure


def test_report_writes_the_figure_and_returns_the_numbers(tmp_path: Path) -> None:
    path = write(tmp_path / "s.jsonl", records(60, {5, 20, 40}, growth_interval=10, names=lambda s: ["fc2.weight"]))
    result = gradscaler.report(path, out=tmp_path / "r.png")
    assert (result.steps, result.skipped, result.offenders) == (60, 3, [("fc2.weight", 3)])
    assert str(result).startswith("3 of 60 steps skipped") and result.figure == tmp_path / "r.png"
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_long_log_draws_an_envelope(tmp_path: Path) -> None:
    recs = records(20_000, lambda k: k % 997 == 0, growth_interval=300, max_scale=2.0**17, norm=lambda s: 1 + s % 13)
    result = gradscaler.report(write(tmp_path / "s.jsonl", recs), out=tmp_path / "r.png")
    assert result.summary.span > 1 and (tmp_path / "r.png").stat().st_size > 10_000


def test_progress_line_on_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(scalerlog, "PROGRESS_EVERY", 100)
    gradscaler.report(write(tmp_path / "s.jsonl", records(1000, {5})), progress=True)
    err = capsys.readouterr().err
    assert "reading s.jsonl: " in err and "% of 0 MiB" in err and "read s.jsonl: 1,000 records in " in err


def test_without_matplotlib_the_text_still_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "s.jsonl", records(60, {5}, growth_interval=10))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs matplotlib: pip install 'matplotlib>=3.7' into the"):
        gradscaler.report(path, out=tmp_path / "r.png")
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r.png")]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("1 of 60 steps skipped") and not (tmp_path / "r.png").exists()
    assert err == (
        "gradscaler report: no figure written: matplotlib is not installed "
        "(pip install 'matplotlib>=3.7' into the environment that runs gradscaler)\n"
    )


def test_summarise_refuses_no_records() -> None:
    with pytest.raises(LogError, match="the log is empty"):
        summarise([])


# Acceptance (issue 19): a real run, three overflows injected in one named parameter, clipping on


def test_acceptance_real_run_three_overflows_in_one_parameter(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = gradscaler.GradScaler("cpu", growth_interval=10)
    scaler.name_parameters(model)
    log = tmp_path / "scaler.jsonl"
    scaler.add_logger(gradscaler.JsonLinesLogger(log), every=1)
    data = torch.randn(60, 4, 8)
    for step in range(1, 61):
        opt.zero_grad()
        scaler.scale(model(data[step - 1]).square().mean()).backward()
        if step in (12, 30, 47):
            model[2].weight.grad[0, 3] = float("inf")
        scaler.unscale_(opt)
        scaler.clip_grad_norm_(opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
    assert len(log.read_text().splitlines()) == 60
    result = run_cli(str(log), "--out", str(tmp_path / "r.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stdout.startswith("3 of 60 steps skipped")
    assert "2.weight" in result.stdout  # needs the version-2 log (the `report` branch names parameters)


def test_the_documented_version_2_record_reads() -> None:
    """The example record of the log format (its key order, NaN norm on the overflowing step)."""
    line = (
        '{"step": 1, "skipped_steps": 1, "consecutive_skips": 1, "growths": 0, "backoffs": 1, "collapse_run": 0, '
        '"scale": 32768.0, "version": 2, "skipped": true, "nonfinite": ["2.weight"], "grad_norm": NaN, '
        '"policy": {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "hysteresis": 1, '
        '"min_scale": null, "max_scale": null}}\n'
    )
    summary = summarise([line])
    assert describe(summary).startswith("1 of 1 steps skipped (100.0%)")
    assert summary.names == {"2.weight": 1} and summary.norm_nonfinite == 1 and summary.growth_interval == 2000
