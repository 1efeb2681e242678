"""The demo's words and hints: the verdicts read the numbers right, the printed next command runs as printed."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradscaler.tools import demo, shell
from gradscaler.tools.demo_figure import scale_text, smooth_mean


@pytest.mark.parametrize(
    ("scale", "text"),
    [(2.0**30, "2**30"), (65536.0, "2**16"), (1.0, "2**0"), (2.0**-126, "2**-126"), (3.0, "3"), (0.0, "0")],
    ids=["2**30", "2**16", "one", "floor", "not-a-power", "zero"],
)
def test_scales_read_as_powers_of_two(scale: float, text: str) -> None:
    assert scale_text(scale) == text


def test_a_run_that_stopped_learning_is_said_to_stall() -> None:
    """The demo's float16 run without scaling: a quick drop, then flat at 2.8 (fp32 ends at 0.35)."""
    losses = [3.2, 3.0, 2.9] + [2.8 + 0.01 * (step % 3) for step in range(397)]
    line = demo.no_scaling_line(losses, final=2.82, fp32=0.346)
    assert line == (
        "fp16 without scaling ends +715.0% from the fp32 loss: it stalled (training loss 2.81 at step 200, "
        "2.81 at step 400), because the gradients it needed were flushed to zero."
    )


def test_a_run_still_learning_but_behind_is_said_to_lag() -> None:
    losses = [3.0 - 0.005 * step for step in range(400)]  # 2.0 at the middle, 1.0 at the end: still falling
    assert demo.no_scaling_line(losses, final=1.0, fp32=0.5).endswith(
        ": it lags, because the gradients it needed were flushed to zero."
    )
    assert demo.no_scaling_line(losses, final=0.52, fp32=0.5).endswith("+4.0% from the fp32 loss: no lag at this size.")


def test_smooth_mean_is_the_mean_of_the_last_window() -> None:
    assert smooth_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def fake_interpreter(folder: Path, with_script: bool) -> Path:
    """A ``bin`` folder holding a ``python`` (its path is what ``shell.command`` looks beside) and maybe a
    ``gradscaler`` script."""
    folder.mkdir(parents=True)
    (folder / "python").write_text("")
    if with_script:
        script = folder / "gradscaler"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
    return folder / "python"


@pytest.mark.parametrize(
    ("with_script", "on_path", "cwd", "expected"),
    [
        (True, True, "clone", "gradscaler"),
        (True, False, "clone", ".venv/bin/gradscaler"),
        (True, False, "elsewhere", "{root}/clone/.venv/bin/gradscaler"),
        (True, False, "bin", "./gradscaler"),
        (False, False, "clone", "{root}/clone/.venv/bin/python -m gradscaler"),
    ],
    ids=["activated", "make-demo-in-the-clone", "another-folder", "in-bin", "no-script"],
)
def test_the_command_the_tools_print_is_the_one_this_shell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_script: bool, on_path: bool, cwd: str, expected: str
) -> None:
    clone = tmp_path / "clone"
    python = fake_interpreter(clone / ".venv" / "bin", with_script)
    (tmp_path / "elsewhere").mkdir()
    here = {"clone": clone, "elsewhere": tmp_path / "elsewhere", "bin": clone / ".venv" / "bin"}[cwd]
    monkeypatch.setattr(sys, "executable", str(python))
    path = os.pathsep.join([str(python.parent)] if on_path else ["/usr/bin", "/bin"])
    assert shell.command(cwd=here, path=path) == expected.format(root=tmp_path)


def test_another_gradscaler_first_on_path_is_not_taken_for_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = fake_interpreter(tmp_path / "clone" / ".venv" / "bin", with_script=True)
    fake_interpreter(tmp_path / "other" / "bin", with_script=True)
    monkeypatch.setattr(sys, "executable", str(python))
    path = os.pathsep.join([str(tmp_path / "other" / "bin"), str(python.parent)])
    assert shell.command(cwd=tmp_path / "clone", path=path) == ".venv/bin/gradscaler"


@pytest.mark.parametrize(
    ("on_path", "cwd", "expected"),
    [
        ("python3", "clone", "python3"),
        ("python", "clone", "python"),
        (None, "clone", ".venv/bin/python"),
        (None, "elsewhere", "{root}/clone/.venv/bin/python"),
    ],
    ids=["activated", "activated-python-only", "make-demo-in-the-clone", "another-folder"],
)
def test_the_interpreter_the_tools_print_is_the_one_this_shell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_path: str | None, cwd: str, expected: str
) -> None:
    """A fresh shell has ``python3`` (often no ``python``) and not the venv's: a hint names what runs."""
    clone = tmp_path / "clone"
    python = fake_interpreter(clone / ".venv" / "bin", with_script=True)
    system = tmp_path / "usr" / "bin"
    system.mkdir(parents=True)
    for folder, name in [(system, "python3"), (python.parent, on_path)]:  # the system's comes last on PATH
        if name is not None:
            (folder / name).write_text("#!/bin/sh\n")
            (folder / name).chmod(0o755)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(sys, "executable", str(python))
    path = os.pathsep.join(([str(python.parent)] if on_path else []) + [str(system)])
    here = {"clone": clone, "elsewhere": tmp_path / "elsewhere"}[cwd]
    assert shell.python(cwd=here, path=path) == expected.format(root=tmp_path)


@pytest.mark.integration
def test_the_demo_closing_hint_runs_when_pasted(tmp_path: Path) -> None:
    """A short demo in a shell whose PATH lacks this interpreter's folder (``make demo`` in a fresh clone);
    the command it prints last, pasted into that shell, runs and writes the figure it names."""
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(demo.__file__).parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "gradscaler", "demo", "--steps", "3", "--no-progress", "--out", "run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    tail = run.stdout.rstrip().splitlines()
    assert tail[-2] == "What happened to its loss scale, in words and in a figure:"
    pasted = subprocess.run(
        ["/bin/sh", "-c", tail[-1].strip()], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert pasted.returncode == 0, (tail[-1], pasted.stderr)
    assert " of 3 steps skipped" in pasted.stdout.splitlines()[0]
    assert pasted.stdout.rstrip().endswith("figure: run/gradscaler-demo-report.png")
    assert (tmp_path / "run" / "gradscaler-demo-report.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def axes():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_the_legend_marks_a_nan_run_as_the_plot_does(axes) -> None:
    """The run whose loss became NaN is drawn as a dotted vertical line at that step; its legend entry is
    that line (it was the curve's dashed line, which stops at step 3 and is all but invisible)."""
    from gradscaler.tools import demo_figure

    runs = [
        {"run": "fp32", "losses": [3.0 - 0.01 * i for i in range(50)], "final_loss": 2.5},
        {"run": demo.NO_MASTERS, "losses": [3.0, 2.9, 2.8] + [math.nan] * 47, "final_loss": math.nan},
    ]
    demo_figure._losses(axes, runs)
    handles, labels = axes.get_legend_handles_labels()
    nan_entries = [h for h, label in zip(handles, labels, strict=True) if "NaN" in label]
    assert [label for label in labels if "NaN" in label] == [f"{demo.NO_MASTERS}: loss NaN from step 3"]
    (entry,) = nan_entries
    assert entry.get_linestyle() == ":" and list(entry.get_xdata()) == [3, 3]  # the vertical line itself
    assert len(labels) == 2


def test_the_two_flushed_shares_say_why_they_differ(axes) -> None:
    from gradscaler.tools import demo_figure

    edges = [-60.0 + 0.25 * i for i in range(321)]
    hist = {
        "edges": edges,
        "before": [1.0] * 320,
        "after": [1.0] * 320,
        "scale": 2.0**30,
        "flushed_before": 0.765,
        "flushed_after": 0.0,
        "flushed_without_scaling": 0.982,
    }
    demo_figure._histogram(axes, hist)
    (text,) = [t.get_text() for t in axes.texts if "flushed" in t.get_text()]
    assert "at scale 1: 76.5%" in text and "its own model: 98.2%" in text
    assert "the same batch" in text and "stalled" in text
