"""README and the pages it links as a newcomer uses them: commands run as pasted, figures are the recorded run's.

The demo's numbers (docs/demo.md), README's quoted report and the two figures come from one recorded run
(``benchmarks/demo_record.py`` writes ``benchmarks/results/demo-record/`` and the marked blocks).
These tests fail when a page and the record disagree, when the code would print the record's numbers
differently, when a command a page shows would not run, and when a link does not lead anywhere.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradscaler.tools import cli, demo
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {
    name: (ROOT / name).read_text()
    for name in (
        "README.md",
        "docs/guide.md",
        "docs/install.md",
        "docs/demo.md",
        "docs/development.md",
        "docs/benchmarks.md",
    )
}
"""README and the pages its reference lives on: their commands are checked here."""
RUN_PAGES = ("README.md", "docs/guide.md")
"""The pages every Python block of which runs (tests/test_docs.py runs them as well)."""


recorder = load_benchmark("demo_record")


def shell_blocks(texts: list[str] | None = None) -> list[str]:
    """The ``sh`` blocks of ``texts`` (default: every page of ``PAGES``)."""
    texts = list(PAGES.values()) if texts is None else texts
    return [b for text in texts for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def shell_lines(texts: list[str] | None = None) -> list[str]:
    """Every command line of the pages' ``sh`` blocks, comments cut off."""
    blocks = shell_blocks(texts)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("name", recorder.BLOCKS)
def test_readme_demo_blocks_are_the_recorded_run(name: str) -> None:
    expected = recorder.render(recorder.read_record())[name]
    page = recorder.BLOCKS[name]
    assert recorder.block(page.read_text(), name) == expected, (
        f"{page.relative_to(ROOT)}'s {name} block differs from benchmarks/results/demo-record: "
        "run PYTHONPATH=src python3 benchmarks/demo_record.py --readme (or without --readme to record again)"
    )


def test_the_demo_blocks_live_where_readme_and_the_demo_page_are() -> None:
    assert recorder.BLOCKS == {"demo-record": ROOT / "docs" / "demo.md", "demo-report": ROOT / "README.md"}


def finite_or_nan(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the demo held it before writing JSON (which has no NaN: ``json_safe`` wrote None)."""
    out = dict(run)
    out["losses"] = [math.nan if v is None else v for v in run["losses"]]
    out["final_loss"] = math.nan if run["final_loss"] is None else run["final_loss"]
    return out


def test_the_code_prints_the_recorded_numbers_as_recorded() -> None:
    """The table and verdicts README quotes, made again by today's code from the recorded numbers."""
    record = recorder.read_record()
    runs = [finite_or_nan(r) for r in record["numbers"]["runs"]]
    printed = demo.summary_table(runs) + "\n\n" + "\n".join(demo.verdict(runs))
    assert printed == recorder.demo_results(record["demo"])


def test_the_record_names_its_command_cpu_and_commit() -> None:
    meta = recorder.read_record()["meta"]
    assert meta["command"].endswith("gradscaler demo --no-progress")
    assert re.fullmatch(r"[0-9a-f]{7,}( with uncommitted changes under src/)?", meta["commit"])
    assert meta["cpu"] and meta["cpu_capability"] and meta["torch"].startswith("2.")
    quoted = recorder.block(PAGES["docs/demo.md"], "demo-record")
    assert meta["cpu"] in quoted and meta["torch"] in quoted and meta["command"] in quoted
    assert "(../benchmarks/results/demo-record/record.json)" in quoted  # where the commit and the date are


def test_readme_report_command_prints_what_readme_says(tmp_path: Path) -> None:
    """README's line after ``make demo``, run on the recorded demo's log in a folder like a fresh clone."""
    (line,) = [line for line in shell_lines([README]) if line.startswith(".venv/bin/gradscaler report ")]
    shutil.copyfile(recorder.RECORD / "gradscaler-demo-scaler.jsonl", tmp_path / "gradscaler-demo-scaler.jsonl")
    argv = shlex.split(line)[1:]
    assert argv == recorder.REPORT_ARGS  # the command the record ran
    result = subprocess.run(
        [sys.executable, "-m", "gradscaler", *argv], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    quoted = recorder.block(README, "demo-report").removeprefix("```text\n").removesuffix("\n```")
    assert result.stdout == quoted + "\nfigure: gradscaler-demo-report.png\n"
    assert (tmp_path / "gradscaler-demo-report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_files_the_demo_and_report_write_in_a_clone_are_ignored_by_git() -> None:
    patterns = (ROOT / ".gitignore").read_text().splitlines()
    for name in (
        "gradscaler-demo.png",
        "gradscaler-demo.json",
        "gradscaler-demo-scaler.jsonl",
        "gradscaler-demo-report.png",
    ):
        assert any(p.startswith("/") and Path(name).match(p[1:]) for p in patterns), name


@pytest.mark.parametrize("line", [line for line in shell_lines() if shlex.split(line)[0].endswith("gradscaler")])
def test_readme_gradscaler_command_lines_parse(line: str) -> None:
    program, *argv = shlex.split(line)
    assert program == ".venv/bin/gradscaler", f"{line}: after make demo the tools are in .venv/bin, not on PATH"
    cli.build_parser().parse_args(argv)  # argparse exits (status 2) on a bad line


def test_readme_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = {line.split()[1] for line in shell_lines() if line.startswith("make ")}
    assert targets >= {"demo", "test"}
    for target in targets:
        assert re.search(rf"(?m)^{target}:", makefile), target


def test_readme_pip_lines_install_what_exists() -> None:
    """gradscaler is not on PyPI: a pip line installs a path or a git URL, with extras pyproject defines."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    table = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"(?m)^([\w-]+) = ", table))
    assert {"plot", "triton", "test", "dev"} <= extras
    lines = [line for line in shell_lines() if line.startswith("pip install")]
    assert lines
    for line in lines:
        (requirement,) = [w for w in shlex.split(line)[2:] if not w.startswith("-")]
        assert requirement.startswith(".") or "@ git+" in requirement, line  # never a name looked up on an index
        named = re.search(r"\[(.*?)\]", requirement)
        assert named is not None and set(named.group(1).split(",")) <= extras, line


def test_readme_files_it_runs_exist() -> None:
    for line in shell_lines():
        for word in shlex.split(line):
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), line


def anchors(text: str) -> set[str]:
    """A page's heading anchors as GitHub makes them: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a comment line in a code block is no heading
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"(?m)^#{1,4} (.*)$", text)
    }


LINKED = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("name", LINKED)
def test_links_resolve(name: str) -> None:
    """Every relative link of README and docs/ leads to a file that exists, and every #anchor to a heading
    of its page (the page's own, or the linked one's)."""
    page = ROOT / name
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        found = linked.exists() and (not anchor or (linked.suffix == ".md" and anchor in anchors(linked.read_text())))
        if not found:
            broken.append(target)
    assert not broken, broken


def test_readme_links_to_its_own_sections() -> None:
    """The contents list is there, and each of its entries a heading of README."""
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert len(links) >= 8 and links <= anchors(README), links - anchors(README)


def git_url_block() -> str:
    """The block (docs/install.md) that installs from the git URL ``git remote get-url origin`` prints."""
    (block,) = [b for b in shell_blocks() if "git remote get-url origin" in b]
    return block


@pytest.mark.parametrize(
    ("origin", "requirement"),
    [
        ("https://github.com/o/gradscaler.git", "gradscaler[plot] @ git+https://github.com/o/gradscaler.git"),
        ("git@github.com:o/gradscaler.git", "gradscaler[plot] @ git+ssh://git@github.com/o/gradscaler.git"),
        ("/srv/git/gradscaler", "gradscaler[plot] @ git+file:///srv/git/gradscaler"),
    ],
    ids=["https", "scp-like", "path"],
)
def test_readme_git_url_block_turns_each_origin_form_into_a_url_pip_takes(
    origin: str, requirement: str, tmp_path: Path
) -> None:
    """The block as pasted into sh, with ``git`` answering one of the forms and ``pip`` echoing its words."""
    fake = tmp_path / "git"
    fake.write_text(f"#!/bin/sh\necho '{origin}'\n")
    fake.chmod(0o755)
    script = "pip() { printf '%s\\n' \"$@\"; }\n" + git_url_block()
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.splitlines() == ["install", requirement], done.stdout


def test_readme_git_url_block_installs_from_a_clone_path(tmp_path: Path) -> None:
    """The path form for real, in a clone whose origin is this repository's path (as a clone of a folder
    has): pip resolves ``git+file://`` to gradscaler (its metadata built; nothing installed), where the
    bare path after ``git+`` fails."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "clone")], check=True)
    script = git_url_block().replace("pip install", f"{shlex.quote(sys.executable)} -m pip install --dry-run --no-deps")
    done = subprocess.run(["sh", "-c", script], cwd=tmp_path / "clone", capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Would install gradscaler-" in done.stdout, done.stdout + done.stderr


def test_make_demo_pins_the_kernels_the_record_was_made_with() -> None:
    """The recorded numbers are what ``make demo`` prints on an x86 CPU: the Makefile sets, on x86, the
    variables the record's command names, and docs/demo.md says so (with what it costs on an AVX-512 CPU)."""
    meta = recorder.read_record()["meta"]
    pins = [word for word in meta["command"].split() if "=" in word]
    assert pins == ["ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"], meta["command"]
    makefile = (ROOT / "Makefile").read_text()
    (isa,) = re.findall(r"(?m)^DEMO_ISA := \$\(if \$\(filter x86_64 amd64,\$\(shell uname -m\)\),(.*)\)$", makefile)
    assert isa.split() == pins
    assert re.search(r"(?m)^demo: .*\n\t\$\(DEMO_ISA\) \$\(BIN\)/gradscaler demo$", makefile)
    page = PAGES["docs/demo.md"]
    assert "what `make demo` runs" in recorder.block(page, "demo-record")
    assert f"(`{' '.join(pins)}`)" in page


DEMO_VENV_LACKS = (
    "tensorboard",
    "timm",
    "torchvision",
    "transformers",
    "accelerate",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "triton",
)
"""What ``make test`` adds to ``make demo``'s ``.venv`` (and torchvision, in neither) that a block could import
(its test tools aside: no block imports them)."""
RUNNER = r"""
import importlib.abc, json, os, sys, tempfile

blocks, lacks = json.load(sys.stdin)


class Absent(importlib.abc.MetaPathFinder):
    blocked = set()

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


finder = Absent()
sys.meta_path.insert(0, finder)
for index, code, needs in blocks:
    for name in [m for m in sys.modules if m.split(".")[0] in lacks or m.startswith("torch.utils.tensorboard")]:
        del sys.modules[name]
    finder.blocked = set(lacks) - set(needs)
    os.chdir(tempfile.mkdtemp())
    try:
        exec(compile(code, f"block {index}", "exec"), {"__name__": "readme"})
    except ImportError as error:
        print(f"block {index}: {error}", flush=True)
        continue
    print(f"block {index}: ran", flush=True)
"""


def python_blocks() -> list[str]:
    """The Python blocks of ``RUN_PAGES``, in order."""
    return [b for name in RUN_PAGES for b in re.findall(r"```python\n(.*?)```", PAGES[name], flags=re.S)]


def needs(block: str) -> list[str]:
    """What a block's first line says it needs beyond make demo's .venv: ``# ... pip install NAME ...``."""
    first = block.splitlines()[0]
    found = re.match(r"# .*?\bpip install ([\w\-. ]+?)\s*(?:[;(]|$)", first)
    return found.group(1).split() if found else []


def test_readme_python_blocks_run_in_the_venv_make_demo_sets_up() -> None:
    """Each block of README and docs/guide.md in a process where what make demo's .venv lacks cannot be
    imported, but for what the block's first line names; the TensorBoard block once more without its line,
    which must fail. The torch.compile block (minutes of inductor on a cold CPU) runs in tests/test_docs.py;
    here its imports are checked to be make demo's."""
    blocks = python_blocks()
    (compiled,) = [i for i, b in enumerate(blocks) if "@torch.compile" in b]
    assert set(re.findall(r"(?m)^(?:from|import) (\w+)", blocks[compiled])) <= {"torch", "gradscaler"}
    (board,) = [i for i, b in enumerate(blocks) if "TensorBoardLogger(" in b]
    assert needs(blocks[board]) == ["tensorboard"], blocks[board].splitlines()[0]
    runs = [(i, b, needs(b)) for i, b in enumerate(blocks) if i != compiled] + [(-1, blocks[board], [])]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([runs, DEMO_VENV_LACKS]),
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("block ")]  # the blocks print too
    assert said[:-1] == [f"block {i}: ran" for i, _, _ in runs[:-1]], done.stdout
    assert said[-1].startswith("block -1: ") and "needs the tensorboard package" in said[-1], said[-1]
