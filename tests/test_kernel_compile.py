"""Every Triton kernel of gradscaler compiles for the CUDA targets the library claims, on a CPU machine.

``tests/kernel_compile.py`` (in processes of their own, without the interpreter this test session
runs) drives the launchers over every input class of their tables with the kernels replaced by
recorders, gives each launch to Triton's binder and compiles it ahead of time with the bundled ptxas.
Here: a cubin for each (kernel, specialization, target); the launches turn floating-point contraction
off; the PTX holds no arithmetic LLVM or ptxas may contract and no FMA outside libdevice's log2/exp2
(p-norms); the machine code of the sums of squares holds no FMA; and the same checks fail when the
launchers' ``COMPILE_OPTIONS`` are removed.

630 compiles (90 specializations x 7 targets). Cold (an empty Triton cache, as on a fresh CI machine)
about 180 CPU-seconds in two processes, ~1.5 minutes on 2 quiet cores (3m50 measured while two other
test suites shared the cores); with Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``)
warm, about 30 s, most of it the machine-code check.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from gradscaler.kernels import triton_stats

TARGETS = (70, 75, 80, 86, 89, 90, 100)
"""The compute capabilities the library claims (docs/development.md, "GPUs"): 7.0 to 10.0."""
SASS_TARGET = 90
SCRIPT = Path(__file__).with_name("kernel_compile.py")


def _run(out: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_") or k == "TRITON_CACHE_DIR"}
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Three processes: the targets split in two, and the control (MODE_SQUARES on one target, launched
    without the compile options)."""
    tmp = tmp_path_factory.mktemp("kernel_compile")
    half = len(TARGETS) // 2 + 1
    jobs = {
        "first": _run(tmp / "first.json", "--targets", ",".join(map(str, TARGETS[:half]))),
        "second": _run(
            tmp / "second.json", "--targets", ",".join(map(str, TARGETS[half:])), "--sass", str(SASS_TARGET)
        ),
        "control": _run(
            tmp / "control.json",
            "--targets",
            str(SASS_TARGET),
            "--modes",
            str(triton_stats.MODE_SQUARES),
            "--without-compile-options",
        ),
    }
    for name, job in jobs.items():
        output, _ = job.communicate()
        assert job.returncode == 0, f"kernel_compile.py ({name}) failed:\n{output.decode()[-4000:]}"
    records = {name: json.loads((tmp / f"{name}.json").read_text()) for name in jobs}
    return {"records": records["first"] + records["second"], "control": records["control"]}


def _spec(record: dict) -> tuple:
    return (record["kernel"], tuple(sorted(record["constexprs"].items())), tuple(sorted(record["signature"].items())))


def test_every_specialization_compiles_for_every_target(compiled: dict[str, list[dict]]) -> None:
    records = compiled["records"]
    by_target = collections.defaultdict(set)
    for record in records:
        assert record["cubin_bytes"] > 0, record
        by_target[record["capability"]].add(_spec(record))
    assert sorted(by_target) == sorted(TARGETS)
    specs = by_target[TARGETS[0]]
    assert all(found == specs for found in by_target.values())  # the same specializations everywhere
    assert len(records) == len(specs) * len(TARGETS)  # each compiled once per target
    per_kernel = collections.Counter(kernel for kernel, _, _ in specs)
    # 4 dtypes x (check + 3 norm modes x with/without 1/S) x aligned or not; 2 dtypes x with/without a
    # factor x (check + 3 modes x with/without the norm's 1/S); 3 modes x float32/float64 norms
    assert per_kernel == {"_chunk_kernel": 56, "_move_kernel": 28, "_tensor_kernel": 6}


def test_every_launch_turns_contraction_off(compiled: dict[str, list[dict]]) -> None:
    for record in compiled["records"]:
        assert record["launch_fp_fusion"] is False and record["enable_fp_fusion"] is False, record


def test_ptx_leaves_nothing_to_contract(compiled: dict[str, list[dict]]) -> None:
    """Every float32/float64 multiply, add and subtract carries a rounding modifier (``mul.rn.f64``), which
    neither LLVM nor ptxas contracts into an FMA; no FMA at all outside the p-norms, whose only ones are
    libdevice's explicit ones in log2/exp2 (the same code in the read pass and the move)."""
    for record in compiled["records"]:
        assert record["ptx_contractible"] == 0, record
        if record["constexprs"]["MODE"] != str(triton_stats.MODE_POWER):
            assert record["ptx_fma"] == 0, record


def test_sums_of_squares_keep_separate_multiply_and_add_in_machine_code(compiled: dict[str, list[dict]]) -> None:
    checked = [r for r in compiled["records"] if r["sass_fma"] is not None]
    assert {r["kernel"] for r in checked} == {"_chunk_kernel", "_move_kernel"}
    assert len(checked) == 16 + 8  # 4 dtypes x with/without 1/S x aligned or not; 2 dtypes x factor x 1/S
    assert all(r["sass_fma"] == 0 for r in checked), [r for r in checked if r["sass_fma"]]


def test_the_checks_fail_without_the_compile_options(compiled: dict[str, list[dict]]) -> None:
    """The control: launched as if ``COMPILE_OPTIONS`` were removed, Triton 3.9's default (contraction on)
    turns ``acc += y * y`` into FMAs, which the checks above would refuse."""
    control = compiled["control"]
    squares = [r for r in control if r["kernel"] != "_tensor_kernel"]
    assert squares
    assert all(r["launch_fp_fusion"] is None for r in control)
    if not any(r["enable_fp_fusion"] for r in control):  # Triton 3.10 on: contraction off by default
        pytest.skip("this Triton does not contract by default; the launch option is checked above")
    assert all(r["ptx_contractible"] > 0 and r["ptx_fma"] > 0 for r in squares), squares
