"""``gradscaler demo | bench | report``: the command-line entry point (also ``python -m gradscaler``)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from gradscaler.tools.shell import command, quoted

# No torch at module top, here or in ``shell``: ``--help`` and argument errors answer without it.

DEFAULT_SECTIONS = ("kernel", "step", "iteration")
BENCH_SECTIONS = {
    "kernel": "one read pass over GPT-2-medium-shaped gradients (overflow flag and norms) against "
    "torch._foreach_norm and a plain copy (the bandwidth ceiling)",
    "step": "the optimizer step phase (fused / foreach AdamW, with and without clipping): the optimizer "
    "alone, with torch's scaler, with gradscaler",
    "iteration": "whole training iterations of a GPT-2-small-shaped model under float16 autocast, torch's "
    "scaler against gradscaler",
    "matrix": "shapes x optimizers x clipping with host time, and whole iterations at batch 1",
    "masters": "float16 parameters with master_weights=True against the same recipe written by hand",
    "compile": "whole steps eager, with the model compiled and with the step compiled, torch's scaler "
    "against gradscaler",
    "memory": "bytes per parameter of float32 / float16 + masters / float16 parameters after a training "
    "step, measured from the storages (nothing timed)",
    "host": "what a step costs the host on the CUDA route: per loop shape and phase, ATen ops, kernel launches "
    "(Triton's apart), host syncs and thread CPU time, torch's scaler against gradscaler; on the CPU, CUDA's ops "
    "dispatched here (the Triton route's counts in Triton's interpreter: minutes), on a GPU both routes there",
    "accumulation": "what accumulate_grads_in_fp32=True (micro-batch gradients summed in float32) costs "
    "and gains: the sum's error against float64, a bfloat16 training run against float32, bytes per "
    "parameter, time per micro-batch, and the same under DDP (2 gloo processes) and FSDP2",
    "bf16": "what gradscaler.with_master_weights(optimizer) costs a bfloat16 model without a scaler: bytes "
    "per parameter and time per micro-batch and per step, against the same loop without the line",
}
"""What each section of ``gradscaler bench`` measures, in the order the help lists them."""
SECTIONS = tuple(BENCH_SECTIONS)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N, checked without importing torch (whether CUDA is there is not)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device the tools run on; use cpu, cuda or cuda:N")
    return text


def _sections(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or text!r}; choose from {','.join(SECTIONS)}")
    return chosen


def _wrapped(text: str) -> str:
    """A help description wrapped by hand: the raw formatter that keeps the example's lines keeps this too."""
    return textwrap.fill(text, 88)


def _example(*lines: str) -> str:
    """A subcommand's help epilog: commands as this shell runs them (``shell.command``)."""
    return "example:\n" + "\n".join(f"  {command()} {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradscaler",
        description=_wrapped("Dynamic loss scaling for float16 training."),
        epilog=_example("demo", "report gradscaler-demo-scaler.jsonl --out gradscaler-demo-report.png"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="show why loss scaling matters: fp32 vs fp16 with and without scaling, fp16 weights with masters",
        description=_wrapped(
            "Train a small transformer language model on generated text in float32, "
            "in float16 without loss scaling and in float16 with gradscaler; then the model cast to float16, "
            "with float32 master weights (master_weights=True) and without; print a summary table "
            "and write, in the --out folder: gradscaler-demo.png (the figure), gradscaler-demo.json (the "
            "numbers) and gradscaler-demo-scaler.jsonl (the log of the fp16 + gradscaler run, every step; "
            "`report` reads it). 1-5 minutes on a 2-core CPU machine (under a minute when nothing else runs, "
            "longer when other work shares it); progress bars show the time left."
        ),
        epilog=_example("demo --out demo-run --seed 1"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="training steps per run (default: 400 on the CPU, 600 on CUDA)",
    )
    demo.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument(
        "--out",
        default=".",
        help="folder for gradscaler-demo.png, gradscaler-demo.json and gradscaler-demo-scaler.jsonl "
        "(default: the current folder; created if missing)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads torch uses (default on the CPU: 1; the demo's matrices are small, and a second "
        "thread gains little on a quiet machine but stalls at every barrier when other work competes)",
    )
    bench = sub.add_parser(
        "bench",
        help="time torch.amp.GradScaler and gradscaler side by side",
        description=_wrapped("Side-by-side benchmark in one process; checks results while timing. The sections:")
        + "\n"
        + "\n".join(
            textwrap.fill(f"{name}: {what}", 88, initial_indent="  ", subsequent_indent="    ")
            for name, what in BENCH_SECTIONS.items()
        ),
        epilog=_example("bench --sections kernel,step --out bench.json"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--steps", type=_positive_int, default=30, help="timed steps per variant (median; default 30)")
    bench.add_argument("--warmup", type=_positive_int, default=5, help="untimed warm-up steps (default 5)")
    bench.add_argument(
        "--sections",
        type=_sections,
        default=list(DEFAULT_SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)}; "
        "each is described above)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="run the matrix at toy sizes (seconds; for tests and smoke runs)"
    )
    bench.add_argument("--out", default="bench.json", help="JSON file for every number (default bench.json)")
    report = sub.add_parser(
        "report",
        help="read a scaler log (JsonLinesLogger) and say what happened to the scale",
        description=_wrapped(
            'Summarise a JSON-lines scaler log ("N of M steps skipped", the parameters that '
            "overflowed most), diagnose it in plain words, and draw it with --out. Streams the file."
        ),
        epilog=_example("report gradscaler-demo-scaler.jsonl --out gradscaler-demo-report.png"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("log", help="the file JsonLinesLogger wrote")
    report.add_argument(
        "--out",
        default=None,
        help="write the figure to this file, in a folder that exists (PNG; .png is added to a name "
        "without a suffix; needs matplotlib)",
    )
    report.add_argument(
        "--rank", type=int, default=None, help="read only this rank's records (a file several ranks wrote to)"
    )
    report.add_argument("--run", default=None, help="read only the records of this run id (a logger's `run`)")
    return parser


def _check_device(parser: argparse.ArgumentParser, device: str | None) -> None:
    """Whether CUDA is there: the one check of an argument that needs torch, made before the command runs."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        parser.error(f"--device {device} was given but torch.cuda.is_available() is False; use --device cpu")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_command(args.log, args.out, args.rank, args.run)
    _check_device(parser, args.device)
    if args.command == "bench":
        import torch

        from gradscaler.tools import bench, matrix

        results = bench.run(args.device, args.steps, args.warmup, args.sections)
        if "matrix" in args.sections:
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            results["matrix"] = matrix.matrix_section(device, args.steps, args.warmup, args.quick, print)
            results["matrix"]["quick"] = args.quick
        bench.dump(results, args.out)
        print("\n".join([bench.format_tables(results), *matrix.format_matrix(results.get("matrix"))]))
        print(f"\nnumbers written to {args.out}")
        return 0
    from gradscaler.tools import demo

    return demo.main(args)


def report_command(log: str, out: str | None, rank: int | None = None, run: str | None = None) -> int:
    """``gradscaler report``: the text on stdout; a problem is one line on stderr naming the file at fault
    (the log, or the figure's file or folder) and exit status 1."""
    # Reading a log needs no torch (whose import alone takes seconds): record/ and rule.ScaleRule do without it.
    from gradscaler.record.logfile import PLOT_HINT, figure_path, first_problem

    figure = None if out is None else figure_path(out)
    if out is not None and figure is not None:
        problem = _unwritable(Path(out), figure)
        if problem is not None:
            print(f"gradscaler report: --out {out}: {problem}", file=sys.stderr)
            return 1
    try:
        problem = first_problem(Path(log))
    except OSError as error:
        print(f"gradscaler report: cannot read the log {log}: {error.strerror or error}", file=sys.stderr)
        return 1
    if problem is not None:
        print(f"gradscaler report: {log}: {problem}", file=sys.stderr)
        return 1
    from gradscaler.record.reporting import draw, report
    from gradscaler.record.scalerlog import LogError

    try:
        result = report(log, None, progress=True, rank=rank, run=run)
    except LogError as error:
        print(f"gradscaler report: {log}: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"gradscaler report: cannot read the log {log}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(result.text)
    if figure is None:
        return 0
    if importlib.util.find_spec("matplotlib") is None:
        print(f"gradscaler report: no figure written: matplotlib is not installed ({PLOT_HINT})", file=sys.stderr)
        return 1
    try:
        draw(result.summary, figure, title=Path(log).name)
    except OSError as error:
        print(f"gradscaler report: cannot write the figure {figure}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"figure: {figure}")
    return 0


def _unwritable(out: Path, figure: Path) -> str | None:
    """Why the figure (``out``, written to ``figure``) cannot be written, said before the log is read (a long
    log takes seconds)."""
    folder = figure.parent
    if out.is_dir() or figure.is_dir():
        return f"{out} is a folder; name a file in it, e.g. --out {quoted(out / 'report.png')}"
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        return f"the folder {folder} {what}; create it (mkdir -p {quoted(folder)}) or choose another --out"
    return None


if __name__ == "__main__":
    sys.exit(main())
