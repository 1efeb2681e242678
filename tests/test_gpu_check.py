"""``make gpu-check`` on a machine without CUDA, and the summary it ends with (``benchmarks/gpu_summary.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_summary  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_skips_with_one_line_and_exit_0_without_cuda(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: skipped, no CUDA device"), done.stdout
    assert not (tmp_path / "out").exists()


def junit(path: Path, tests: int, skipped: int, failures: int = 0) -> None:
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
        f'errors="0" skipped="{skipped}"></testsuite></testsuites>'
    )


def folder(tmp_path: Path, steps: list[tuple[str, int]], cuda_skipped: int = 0) -> Path:
    (tmp_path / "env.txt").write_text("NVIDIA H100 80GB HBM3, 570.00, 81559 MiB, 9.0\ntorch 2.11 | triton 3.9\n")
    (tmp_path / "steps.tsv").write_text("".join(f"{name}\t{rc}\t12\n" for name, rc in steps))
    junit(tmp_path / "cuda-tests.xml", tests=40, skipped=cuda_skipped)
    junit(tmp_path / "gpu-tests.xml", tests=150, skipped=3)
    (tmp_path / "compile.log").write_text(
        "bench: ...\ndevice: cuda\n\nTraining steps under torch.compile (inductor; ...):\n\n"
        "| loop shape | mode |\n|---|---|\n| adamw | eager |\n\nnumbers written to compile.json\n"
    )
    (tmp_path / "accumulation.log").write_text(
        "bench: ...\n\nGradient accumulation (accumulate_grads_in_fp32): relative error ...:\n\n"
        "| parameters | micro-batches |\n|---|---|\n| bfloat16 | 8 |\n\nnumbers written to accumulation.json\n"
    )
    (tmp_path / "host.log").write_text(
        "bench: ...\n\nHost cost per step on the CUDA route (...)\n\n| shape | route |\n|---|---|\n"
        "| mlp adamw | native, cuda |\n\nnumbers written to host.json\n"
    )
    (tmp_path / "demo.log").write_text(
        "intro\n| run | final loss |\n|---|---|\n| fp32 | 1.2 |\n\nverdict\nfigure: x.png\n"
    )
    return tmp_path


STEPS = [
    ("cuda-tests", 0),
    ("gpu-tests", 0),
    ("bench", 0),
    ("compile", 0),
    ("accumulation", 0),
    ("demo", 0),
    ("host", 0),
]


def test_summary_of_a_clean_run(tmp_path: Path) -> None:
    out = folder(tmp_path, STEPS)
    assert gpu_summary.main(out) == 0
    text = (out / "summary.md").read_text()
    assert "| cuda-tests | 0 | 12 | 40 / 0 / 0 / 0 |" in text
    assert "| gpu-tests | 0 | 12 | 147 / 0 / 0 / 3 |" in text
    assert "- every step passed" in text and "| fp32 | 1.2 |" in text and "figure:" not in text
    assert "| bfloat16 | 8 |" in text and "numbers written" not in text
    assert "| adamw | eager |" in text and "numbers written" not in text
    assert "## Host cost per step" in text and "| mlp adamw | native, cuda |" in text


@pytest.mark.parametrize("problem", ["a_step_failed", "a_step_timed_out", "a_step_not_run", "a_cuda_test_skipped"])
def test_summary_fails_the_run(tmp_path: Path, problem: str) -> None:
    steps = list(STEPS)
    if problem == "a_step_failed":
        steps[2] = ("bench", 1)
    if problem == "a_step_timed_out":
        steps[5] = ("demo", 124)
    if problem == "a_step_not_run":
        steps[4] = ("accumulation", "not-run")  # type: ignore[assignment]
    out = folder(tmp_path, steps, cuda_skipped=2 if problem == "a_cuda_test_skipped" else 0)
    assert gpu_summary.main(out) == 1
    text = (out / "summary.md").read_text()
    expected = {
        "a_step_failed": "FAILED: step `bench` exited with 1",
        "a_step_timed_out": "FAILED: step `demo` exited with 124 (timed out)",
        "a_step_not_run": "FAILED: step `accumulation` was not run: GPU_CHECK_BUDGET_S was spent",
        "a_cuda_test_skipped": "FAILED: 2 of 40 CUDA-marked tests did not run",
    }[problem]
    assert expected in text
