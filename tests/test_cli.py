"""The command line: help, clear errors for bad options, a short demo and bench end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gradscaler.tools import cli


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["report", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(argv)
    assert excinfo.value.code == 0
    assert "usage: gradscaler" in capsys.readouterr().out


def imported_by(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``gradscaler ARGV`` run in a process of its own, and the modules it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradscaler", *argv], capture_output=True, text=True, check=False
    )
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    return result, imported


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["bench", "--help"],
        ["report", "--help"],
        ["demo", "--steps", "0"],
        ["demo", "--device", "tpu9"],
        ["frobnicate"],
    ],
    ids=["help", "demo-help", "bench-help", "report-help", "bad-steps", "bad-device", "bad-command"],
)
def test_help_and_argument_errors_do_not_import_torch(argv: list[str]) -> None:
    """Importing torch takes 1.5 s on a quiet machine and ten on a busy one: help must not wait for it."""
    result, imported = imported_by(argv)
    assert result.returncode in (0, 2), result.stderr
    assert "gradscaler.tools.cli" in imported  # the report is read: the command line was imported
    assert "torch" not in imported


GARBAGE = {
    "not-json": (b"epoch,loss\n1,0.5\n", "line 1 is not JSON"),
    "binary": (b"\x89PNG\r\n\x1a\n", "is not UTF-8 text"),
}
"""Files that are no log, and what the report says of each."""


@pytest.mark.parametrize("kind", ["log", "log-with-figure", *GARBAGE])
def test_report_reads_a_log_without_importing_torch(kind: str, tmp_path: Path) -> None:
    """A log read, or a file that is none refused, without torch: a garbled file is told at once."""
    from synthetic_log import lines, records

    log = tmp_path / "scaler.jsonl"
    argv = ["report", str(log)]
    if kind in GARBAGE:
        log.write_bytes(GARBAGE[kind][0])
    else:
        log.write_text("".join(lines(records(300, overflow={5, 6, 200}))))
    if kind == "log-with-figure":
        pytest.importorskip("matplotlib")
        argv += ["--out", str(tmp_path / "report.png")]
    result, imported = imported_by(argv)
    out = result.stdout + result.stderr
    assert "gradscaler.record.scalerlog" in imported  # the log was read
    assert "torch" not in imported
    if kind in GARBAGE:
        assert result.returncode == 1
        assert GARBAGE[kind][1] in result.stderr
    else:
        assert result.returncode == 0, out
        assert "skipped" in result.stdout
        assert (tmp_path / "report.png").is_file() == (kind == "log-with-figure")


@pytest.mark.parametrize("command", ["demo", "bench", "report"])
def test_each_subcommand_help_shows_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    example = capsys.readouterr().out.split("example:\n", 1)[1].strip()
    assert f" {command} " in f"{example} "
    argv = example.split(f" {command}", 1)[1].split()
    cli.build_parser().parse_args([command, *argv])  # the example is a valid command line


def test_demo_help_names_the_files_it_writes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("gradscaler-demo.png", "gradscaler-demo.json", "gradscaler-demo-scaler.jsonl"):
        assert name in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "expected a positive integer, got 0"),
        (["demo", "--steps", "many"], "expected a positive integer, got 'many'"),
        (["bench", "--sections", "kernel,warp"], "unknown section(s) ['warp']"),
        (["demo", "--device", "tpu9"], "'tpu9' is not a device the tools run on; use cpu, cuda or cuda:N"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.integration
def test_short_demo_writes_table_figure_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the demo's one thread (the tests run on one: conftest.py)
    try:
        assert cli.main(["demo", "--steps", "12", "--out", str(tmp_path), "--no-progress"]) == 0
        assert torch.get_num_threads() == 2  # the demo's one thread on the CPU is given back
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| fp16 + gradscaler |" in out and "tolerance 10%" in out
    assert "| fp16 parameters + master weights |" in out and "| fp16 parameters, no masters |" in out
    numbers = json.loads((tmp_path / "gradscaler-demo.json").read_text())
    runs = {r["run"]: r for r in numbers["runs"]}
    assert list(runs) == [
        "fp32",
        "fp16, no scaling",
        "fp16 + gradscaler",
        "fp16 parameters + master weights",
        "fp16 parameters, no masters",
    ]
    assert all(len(r["losses"]) == 12 for r in numbers["runs"])
    assert runs["fp16, no scaling"]["underflow_share"] > 0.5  # the point of the demo: most values lost
    masters = runs["fp16 parameters + master weights"]
    assert all(math.isfinite(loss) for loss in masters["losses"]) and math.isfinite(masters["final_loss"])
    assert 0 <= masters["lost_update_share"] < 1  # the applied updates below float16's resolution, measured
    plain = runs["fp16 parameters, no masters"]  # float16 AdamW moments: measured, whatever they come to
    assert 0 <= plain["lost_update_share"] <= 1 and 0 <= plain["second_moment_zero_share"] <= 1
    verdicts = [line for line in out.splitlines() if line.startswith("fp16 parameters")]
    assert len(verdicts) == 2 and ("PASS" in verdicts[0] or "FAIL" in verdicts[0])
    assert "rounded to nothing in float16" in verdicts[1]
    assert (tmp_path / "gradscaler-demo.png").stat().st_size > 10_000
    log = tmp_path / "gradscaler-demo-scaler.jsonl"  # the gradscaler run's log, every step
    assert len(log.read_text().splitlines()) == 12
    assert cli.main(["report", str(log)]) == 0 and "of 12 steps skipped" in capsys.readouterr().out


def test_short_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    assert cli.main(["bench", "--sections", "kernel", "--steps", "1", "--warmup", "1", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gradscaler flag + L2 norms" in out and "gradscaler flag only" in out and "of copy bandwidth" in out
    numbers = json.loads(path.read_text())
    assert numbers["kernel"]["ours_check_only_fraction_of_copy_bandwidth"] > 0
    # float32 sums over up to 25M values (CPU: BLAS dot) against float64: a few 1e-5 at most.
    assert numbers["kernel"]["max_rel_error_vs_float64"] < 1e-4


def test_bench_help_describes_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    described = capsys.readouterr().out.split("options:", 1)[0]
    assert all(f"\n  {section}: " in described for section in cli.SECTIONS)
    assert "accumulation: what accumulate_grads_in_fp32=True" in described


def test_the_bench_header_names_a_median_only_when_something_was_timed() -> None:
    """The memory section counts bytes: alone, its header says nothing of medians or warm-up."""
    from gradscaler.tools import bench

    environment = {"device": "cpu", "cores": 2, "threads": 1, "torch": "2.x", "dtype": "float32", "seed": 0}
    row = {"setup": "float32", "optimizer": "AdamW", "params": 1e6, "param_bytes": 4.0, "grad_bytes_in_step": 4.0}
    row |= {"grad_bytes_after_step": 4.0, "master_bytes": 0.0, "state_bytes": 8.0}
    row |= {"total_in_step": 16.0, "total_after_step": 16.0}
    results = {"environment": environment, "steps": 30, "warmup": 5, "memory": [row]}
    memory_only = bench.format_tables(results).splitlines()[0]
    assert "median" not in memory_only and "warm-up" not in memory_only and "seed 0" in memory_only
    timed = bench.format_tables({**results, "matrix": {}}).splitlines()[0]  # matrix: tables of its own
    assert timed.endswith("median of 30 after 5 warm-up")


def test_quick_matrix_reports_every_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.json"
    argv = ["bench", "--device", "cpu", "--sections", "matrix", "--quick", "--steps", "1", "--warmup", "1"]
    assert cli.main([*argv, "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| many small (50 x 256) | fused AdamW | no |" in out and "step phase share" in out
    matrix = json.loads(path.read_text())["matrix"]
    assert len(matrix["cells"]) == 4 * 6 * 2  # shapes x optimizers x clip, every cell reported
    timed = [c for c in matrix["cells"] if "skipped" not in c]
    assert all(c["ok"] for c in timed), [c["check"] for c in timed]  # same scales; bit-identical without clip
    assert all(c["step"]["ratio"] > 0 and c["host"]["ratio"] > 0 for c in timed)
    assert len(matrix["iteration"]) == 3 and all(0 < r["ours_step_share"] < 1 for r in matrix["iteration"])


def test_demo_progress_shows_the_time_left(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's time left counts the float16 runs at a float16 run's speed (ten times fp32's on AVX2)."""
    from gradscaler.tools import demo, demo_progress

    now = [0.0]
    monkeypatch.setattr(demo_progress.time, "perf_counter", lambda: now[0])
    clock = demo_progress.Progress(demo.RUNS, steps=10)
    clock.start("fp32")
    for _ in range(10):  # fp32: 0.01 s a step; the float16 runs' cost is not known yet
        now[0] += 0.01
        clock.step()
    assert clock.left() is None
    now[0] += 1.0  # the fp32 run's evaluation: not a step
    begin = now[0]
    clock.start("fp16, no scaling")
    for _ in range(4):  # the first float16 run: 0.1 s a step, 4 of 10 done
        now[0] += 0.1
        clock.step()
    assert clock.left() == pytest.approx(6 * 0.1 + 3 * 10 * 0.1)  # its 6 steps left, then three runs like it
    demo_progress.bar("fp16, no scaling", 4, 10, 2.5, begin, clock)
    assert "4/10 loss 2.500  10.0 it/s  1s left of this run, 4s of the demo" in capsys.readouterr().err
