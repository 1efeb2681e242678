"""The one recorded demo run that docs/demo.md and README quote, and the demo's figures written from it.

    PYTHONPATH=src python3 benchmarks/demo_record.py          # run the demo and the report, record, rewrite
    PYTHONPATH=src python3 benchmarks/demo_record.py --readme # rewrite the quoting blocks from the record only

Running it runs ``gradscaler demo`` (no progress bars; the float16 kernels of a CPU without AVX-512,
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, unless ``--native``) in a scratch folder, then
README's ``gradscaler report`` command on its log, and keeps what they printed and wrote in
``benchmarks/results/demo-record/``: ``record.json`` (the command, the CPU, torch, the commit, the time
and the load), ``demo-stdout.txt``, ``gradscaler-demo.json`` (every number), ``gradscaler-demo-scaler.jsonl``
(the log) and ``report-stdout.txt``; the figures go to ``docs/demo.png`` and ``docs/report.png``. Then it
rewrites, from the record alone (``render``), the block between ``<!-- demo-record -->`` markers in
docs/demo.md and the one between ``<!-- demo-report -->`` markers in README.md (``BLOCKS``), which
``tests/test_readme.py`` compares with the record.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "demo-record"
README = ROOT / "README.md"
DEMO_PAGE = ROOT / "docs" / "demo.md"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
REPORT_ARGS = ["report", "gradscaler-demo-scaler.jsonl", "--out", "gradscaler-demo-report.png"]
"""README's report command after ``make demo`` (its program aside): the log the demo wrote, a figure beside it."""
BLOCKS = {"demo-record": DEMO_PAGE, "demo-report": README}
"""Each generated block and the file that holds it (its links are relative to that file's folder)."""


def cpu_model() -> str:
    """The CPU's model name as lscpu gives it, with the vector extensions its float16 kernels could use."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    name = " ".join(fields.get("Model name", platform.machine()).split())
    flags = set(fields.get("Flags", "").split())
    extensions = [f for f in ("avx2", "avx512f", "avx512_fp16", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs ({', '.join(extensions) or 'no AVX2'})"


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "-"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip() + (" with uncommitted changes under src/" if dirty.stdout.strip() else "")


def record(native: bool) -> None:
    """Run the demo and the report; keep their output in ``RECORD`` and their figures in ``docs/``."""
    env = {**os.environ, **({} if native else AVX2)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    probe = "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())"
    torch_version, capability = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    with tempfile.TemporaryDirectory() as scratch:
        before = load()
        begin = time.perf_counter()
        demo = subprocess.run(
            [sys.executable, "-m", "gradscaler", "demo", "--no-progress"],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        seconds = time.perf_counter() - begin
        after = load()
        report = subprocess.run(
            [sys.executable, "-m", "gradscaler", *REPORT_ARGS],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        RECORD.mkdir(parents=True, exist_ok=True)
        for name in ("gradscaler-demo.json", "gradscaler-demo-scaler.jsonl"):
            shutil.copyfile(Path(scratch, name), RECORD / name)
        shutil.copyfile(Path(scratch, "gradscaler-demo.png"), ROOT / "docs" / "demo.png")
        shutil.copyfile(Path(scratch, "gradscaler-demo-report.png"), ROOT / "docs" / "report.png")
    (RECORD / "demo-stdout.txt").write_text(demo.stdout)
    (RECORD / "report-stdout.txt").write_text(report.stdout)
    kernels = "native" if native else " ".join(f"{k}={v}" for k, v in AVX2.items())
    meta = {
        "command": ("" if native else f"{kernels} ") + "gradscaler demo --no-progress",
        "then": "gradscaler " + " ".join(REPORT_ARGS),
        "kernels": kernels,
        "cpu": cpu_model(),
        "cpu_capability": capability,
        "torch": torch_version,
        "python": platform.python_version(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "demo_seconds": round(seconds, 1),
        "load_before": before,
        "load_after": after,
    }
    (RECORD / "record.json").write_text(json.dumps(meta, indent=1) + "\n")


def read_record(folder: Path = RECORD) -> dict[str, Any]:
    """The record: ``meta`` (record.json), ``numbers`` (the demo's JSON), ``demo`` and ``report`` (stdout)."""
    return {
        "meta": json.loads((folder / "record.json").read_text()),
        "numbers": json.loads((folder / "gradscaler-demo.json").read_text()),
        "demo": (folder / "demo-stdout.txt").read_text(),
        "report": (folder / "report-stdout.txt").read_text(),
    }


def demo_results(stdout: str) -> str:
    """The demo's table and verdicts, as it printed them (between its introduction and the files it wrote)."""
    start = stdout.index("| run |")
    return stdout[start : stdout.index("\nfigure: ", start)].strip()


def report_text(stdout: str) -> str:
    """What ``gradscaler report`` printed, less the line naming the figure."""
    return "\n".join(line for line in stdout.rstrip("\n").splitlines() if not line.startswith("figure: "))


def render(rec: dict[str, Any]) -> dict[str, str]:
    """The generated blocks (``BLOCKS``), from the record alone."""
    meta, numbers = rec["meta"], rec["numbers"]
    runs = {r["run"]: r for r in numbers["runs"]}
    fp32 = runs["fp32"]["final_loss"]
    plain, scaled = runs["fp16, no scaling"], runs["fp16 + gradscaler"]
    masters, bare = runs["fp16 parameters + master weights"], runs["fp16 parameters, no masters"]
    broken = next(i for i, loss in enumerate(bare["losses"]) if loss is None or not math.isfinite(loss))

    def gap(run: dict[str, Any]) -> str:
        return f"{100 * (run['final_loss'] - fp32) / fp32:+.1f}%"

    prose = (
        f"In the recorded run, without loss scaling {100 * plain['underflow_share']:.1f}% of the "
        f"activation-gradient values were flushed to zero and the loss stalled at {plain['final_loss']:.2f} "
        f"(fp32: {fp32:.2f}). With gradscaler the float16 run ended at {scaled['final_loss']:.3f} "
        f"({gap(scaled)} from fp32), {scaled['skipped_steps']} of {numbers['steps']} steps skipped while "
        "the scale probed for overflow. The model cast to float16 and trained through float32 master "
        f"weights ended {gap(masters)} from fp32; {100 * masters['lost_update_share']:.2f}% of the masters' "
        "updates were below float16's resolution and would have been lost without them. Stepped in float16 "
        f"without masters, AdamW's second moment underflowed to 0 for "
        f"{100 * bare['second_moment_zero_share']:.0f}% of its entries at the first step and the loss was "
        f"NaN from step {broken} on."
    )
    kernels = (
        "this CPU's own float16 kernels"
        if meta["kernels"] == "native"
        else "the two variables give it the float16 kernels of a CPU without AVX-512"
    )
    provenance = (
        f"Recorded with `{meta['command']}` (what `make demo` runs, less the progress bars; {kernels}, "
        f"torch reports capability {meta['cpu_capability']}) on {meta['cpu']}, torch "
        f"{meta['torch']}: {meta['demo_seconds']:.0f} s for the "
        f"whole demo, load average {meta['load_before']} before and {meta['load_after']} after (other "
        "work shared the machine). Another CPU's float16 kernels round differently, so its last digits "
        "differ; the verdicts hold over seeds 0-3 with both kinds of kernels "
        "([benchmarks/results/demo-seeds-cpu.txt](../benchmarks/results/demo-seeds-cpu.txt)). "
        "`PYTHONPATH=src python3 benchmarks/demo_record.py` reruns it and rewrites this block, "
        "the report README quotes and both figures, from "
        "[benchmarks/results/demo-record](../benchmarks/results/demo-record/record.json) "
        "(which also names the commit and the date)."
    )
    record_block = "\n\n".join(
        [
            prose,
            "![gradscaler demo: gradient histogram, loss curves, loss scale, verdicts](demo.png)",
            "What it printed:",
            "```text\n" + demo_results(rec["demo"]) + "\n```",
            provenance,
        ]
    )
    return {"demo-record": record_block, "demo-report": "```text\n" + report_text(rec["report"]) + "\n```"}


def block(text: str, name: str) -> str:
    """The text between ``<!-- name -->`` and ``<!-- /name -->`` in ``text``, without the blank lines at its ends."""
    found = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", text, flags=re.S)
    if found is None:
        raise ValueError(f"no <!-- {name} --> ... <!-- /{name} --> block")
    return found.group(1).strip("\n")


def rewrite(readme: str, blocks: dict[str, str]) -> str:
    """``readme`` (any page's text) with each named block's body replaced."""
    for name, body in blocks.items():
        block(readme, name)  # it must be there
        readme = re.sub(
            rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)",
            lambda m, body=body: m.group(1) + "\n" + body + "\n\n" + m.group(2),
            readme,
            flags=re.S,
        )
    return readme


def main(argv: list[str]) -> int:
    if "--readme" not in argv:
        record(native="--native" in argv)
    rendered = render(read_record())
    for name, page in BLOCKS.items():
        page.write_text(rewrite(page.read_text(), {name: rendered[name]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
