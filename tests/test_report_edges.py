"""The report, round three (issue 37): what answers without torch, a scale moved outside the rule, a log
damaged in the middle, a rank that wrote nothing, and the figure's marks and bars."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradscaler
from gradscaler.record import reporting
from gradscaler.record.diagnosis import describe
from gradscaler.record.scalerlog import LogError, summarise
from synthetic_log import lines, records

ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = """
import sys
from gradscaler.tools.cli import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules)
"""


def report_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, "report", *argv], capture_output=True, text=True, env=env, check=False
    )


@pytest.mark.parametrize("case", ["missing", "empty", "blank-lines", "folder", "out-folder-missing"])
def test_what_needs_no_torch_is_answered_before_torch_is_imported(case: str, tmp_path: Path) -> None:
    """Importing torch took 10-18 s on a busy machine before these one-line answers."""
    log = tmp_path / "scaler.jsonl"
    argv = [str(log)]
    expected = f"gradscaler report: {log}: "
    if case == "missing":
        expected = f"gradscaler report: cannot read the log {log}: No such file or directory"
    elif case == "empty":
        log.write_bytes(b"")
        expected += "the log is empty"
    elif case == "blank-lines":
        log.write_bytes(b"\n  \n\n")
        expected += "the log is empty"
    elif case == "folder":
        argv = [str(tmp_path)]
        expected = f"gradscaler report: {tmp_path}: is a folder, not a log file"
    else:
        log.write_text(json.dumps(next(records(1))) + "\n")
        argv += ["--out", str(tmp_path / "nowhere" / "r.png")]
        expected = f"gradscaler report: --out {tmp_path / 'nowhere' / 'r.png'}: the folder"
    done = report_without_torch(*argv)
    assert done.stdout == "1 False\n", done.stdout + done.stderr
    assert done.stderr.startswith(expected) and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_the_torch_free_answer_is_the_readers_own(content: bytes, tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_bytes(content)
    with pytest.raises(LogError) as caught:
        summarise(content.decode().splitlines(keepends=True))
    done = report_without_torch(str(tmp_path / "s.jsonl"))
    assert done.stderr == f"gradscaler report: {tmp_path / 's.jsonl'}: {caught.value}\n"


def test_a_scale_set_by_hand_is_flagged(tmp_path: Path) -> None:
    """A real scaler's log: ``update(new_scale)`` moves the scale x8 with no counter; the report names it."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = gradscaler.GradScaler("cpu", growth_interval=100)
    scaler.add_logger(gradscaler.JsonLinesLogger(tmp_path / "s.jsonl"))
    for step in range(1, 6):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update(scaler.get_scale() * 8 if step == 3 else None)
        optimizer.zero_grad()
    text = gradscaler.report(tmp_path / "s.jsonl").text
    assert "Diagnosis: nothing unusual." not in text
    assert (
        "- Scale set outside the rule: at step 3 the scale went from 65536 to 2**19 (x8) with no growth or "
        "backoff counted for it." in text
    ), text


def moved(recs: list[dict], step: int, factor: float) -> list[str]:
    """The records as lines, the scale multiplied by ``factor`` from ``step`` on (an edit the counters miss)."""
    return [json.dumps(dict(r, scale=r["scale"] * factor) if r["step"] >= step else r) + "\n" for r in recs]


@pytest.mark.parametrize(
    ("overflow", "step", "factor", "said"),
    [
        ((), 40, 8.0, "at step 40 the scale went from 65536 to 2**19 (x8) with no growth or backoff counted"),
        ((), 40, 0.25, "at step 40 the scale went from 65536 to 16384 (/4) with no growth or backoff counted"),
        ({10}, 10, 4.0, "at step 10 the scale went from 65536 to 2**17 (x2) up, where only a backoff was counted"),
    ],
    ids=["up-no-counter", "down-no-counter", "up-on-a-backoff"],
)
def test_a_scale_the_counters_do_not_explain_is_flagged(overflow: set, step: int, factor: float, said: str) -> None:
    recs = list(records(60, overflow, growth_interval=1000))
    text = describe(summarise(moved(recs, step, factor)))
    assert f"Scale set outside the rule: {said}" in text, text
    assert "Scale set outside" not in describe(summarise(lines(recs)))


def test_the_rule_at_its_bounds_is_not_flagged() -> None:
    """Growth stopped by max_scale and backoff stopped by min_scale move the scale less or not at all."""
    capped = records(300, {150}, growth_interval=5, max_scale=2.0**18, min_scale=2.0**15, init_scale=2.0**16)
    assert "Scale set outside" not in describe(summarise(lines(capped)))
    floored = records(60, set(range(1, 40)), min_scale=4.0)
    assert "Scale set outside" not in describe(summarise(lines(floored)))


def test_one_growth_and_one_backoff_are_singular() -> None:
    text = describe(summarise(lines(records(30, {25}, growth_interval=20))))
    assert text.splitlines()[0].endswith("; 1 growth, 1 backoff."), text


def test_a_log_cut_in_the_middle_is_a_damaged_gradscaler_log() -> None:
    whole = list(lines(records(80, {20}, growth_interval=10)))
    joined = "".join(whole)
    cut = joined[: joined.index('{"step": 41') + 30] + joined[joined.index('{"step": 60') :]
    with pytest.raises(LogError) as caught:
        summarise(cut.splitlines(keepends=True))
    said = str(caught.value)
    assert said.startswith("line 41 ") and "a damaged gradscaler log" in said, said
    assert "delete line 41" in said and "head -n 40" in said and "not a JsonLinesLogger" not in said
    with pytest.raises(LogError, match=r"^line 1 is not JSON .*: not a JsonLinesLogger log$"):
        summarise(["step,scale\n", *whole])  # no record before it: not a gradscaler log at all


def test_a_rank_that_wrote_nothing_names_the_writers_that_did() -> None:
    recs = [dict(r, rank=0, run="abc") for r in records(30)]
    with pytest.raises(LogError) as caught:
        summarise([json.dumps(r) + "\n" for r in recs], rank=3)
    assert str(caught.value).startswith(
        "rank 3 wrote none of this log's 30 records; they were written by rank 0 run abc (30 records): "
        "choose one of those with --rank/--run"
    ), caught.value


@pytest.fixture
def axes():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_a_skip_and_its_backoff_are_drawn_at_one_point(axes) -> None:
    """Both at the scale the skipped step ran with (the cross used to sit one backoff below the triangle)."""
    summary = summarise(lines(records(120, {30, 31, 70}, growth_interval=10, init_scale=2.0**10)))
    reporting._scale_panel(axes, summary)
    labels = [t.get_text() for t in axes.get_legend().get_texts()][1:]
    marks = dict(zip(labels, axes.collections, strict=True))
    skips = {tuple(p) for p in next(c for k, c in marks.items() if k.startswith("skipped")).get_offsets()}
    backoffs = {tuple(p) for p in next(c for k, c in marks.items() if k.startswith("backoff")).get_offsets()}
    assert len(skips) == 3 and skips == backoffs, (skips, backoffs)
    ran = {
        step: scale
        for step, scale in (
            (r["step"], r["scale"]) for r in records(120, {30, 31, 70}, growth_interval=10, init_scale=2.0**10)
        )
    }
    assert skips == {(30.0, ran[29]), (31.0, ran[30]), (70.0, ran[69])}


@pytest.mark.parametrize("named", [1, 5, 8])
def test_the_offender_bars_fill_the_panel(named: int, axes) -> None:
    names = [f"layer{i}.weight" for i in range(named)]
    summary = summarise(lines(records(50, set(range(10, 40)), names=lambda step: names[: 1 + step % named])))
    reporting._offender_panel(axes, summary)
    bottom, top = axes.get_ylim()
    rows = max(named, 3)
    assert top - bottom == pytest.approx(rows + 0.2)
    assert len(axes.patches) == named
