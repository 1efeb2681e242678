"""Write OUT_DIR/summary.md for a ``make gpu-check`` run (``benchmarks/gpu_run.sh``) and exit non-zero
when any step failed or a CUDA-marked test did not run.

Usage: python benchmarks/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests, failures, errors and skipped of a pytest JUnit XML file (None when it is missing)."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def section(path: Path, start: str, stop: str) -> list[str]:
    """The lines of ``path`` from the first one starting with ``start`` up to (not including) the first
    later one starting with ``stop``."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if first is None:
        return []
    end = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(stop)), len(lines))
    return lines[first:end]


def main(out: Path) -> int:
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
    problems = [
        f"step `{name}` was not run: GPU_CHECK_BUDGET_S was spent"
        if rc == "not-run"
        else f"step `{name}` exited with {rc}" + (" (timed out)" if rc == "124" else "")
        for name, rc, _ in steps
        if rc != "0"
    ]
    md = ["# gradscaler gpu-check", "", *[f"    {line}" for line in (out / "env.txt").read_text().splitlines()], ""]
    md += ["| step | exit | seconds | tests (passed / failed / errors / skipped) |", "|---|---|---|---|"]
    for name, rc, seconds in steps:
        counts = junit_counts(out / f"{name}.xml")
        if counts is None:
            tests = "-"
        else:
            passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            tests = f"{passed} / {counts['failures']} / {counts['errors']} / {counts['skipped']}"
            if name == "cuda-tests" and (counts["skipped"] or not counts["tests"]):
                problems.append(f"{counts['skipped']} of {counts['tests']} CUDA-marked tests did not run")
        md.append(f"| {name} | {rc} | {seconds} | {tests} |")
    total = sum(int(seconds) for _, _, seconds in steps)
    numbers = "`bench.json`, `host.json`, `compile.json`, `accumulation.json`, `demo/`"
    md += ["", f"Total {total} s. Logs: `<step>.log` in this folder; numbers: {numbers}.", ""]
    md += ["## Verdict", ""] + ([f"- FAILED: {p}" for p in problems] or ["- every step passed"]) + [""]
    read_pass = section(out / "bench.log", "One read pass", "Optimizer step phase")
    if read_pass:
        md += ["## Read pass (bench)", "", *read_pass, ""]
    host = section(out / "host.log", "Host cost per step", "numbers written")
    if host:
        md += ["## Host cost per step (bench --sections host)", "", *host, ""]
    compiled = section(out / "compile.log", "Training steps under torch.compile", "numbers written")
    if compiled:
        md += ["## Compiled steps (bench --sections compile)", "", *compiled[2:], ""]
    accumulation = section(out / "accumulation.log", "Gradient accumulation", "numbers written")
    if accumulation:
        md += ["## Float32 accumulation (bench --sections accumulation)", "", *accumulation[1:], ""]
    demo = section(out / "demo.log", "| run", "figure:")
    if demo:
        md += ["## Demo", "", *demo, ""]
    (out / "summary.md").write_text("\n".join(md))
    print("\n".join(md))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
