"""The documentation runs: README's Python blocks execute, docs/api.md is current."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def promised_output(block: str) -> list[str]:
    """What a block says it prints: the comment after each ``print(...)`` line."""
    return [line.split("#", 1)[1].strip() for line in block.splitlines() if "print(" in line and "#" in line]


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_blocks_run(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each block runs as pasted into a fresh interpreter, and prints what its comments say it prints."""
    monkeypatch.chdir(tmp_path)
    block = python_blocks()[index]
    exec(compile(block, f"README.md block {index}", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    for expected in promised_output(block):
        assert any(line == expected or line.endswith(f" {expected}") for line in lines), (expected, printed)


def test_readme_says_what_its_blocks_print() -> None:
    """The check above has something to hold: README's blocks that print promise what."""
    assert sum(len(promised_output(block)) for block in python_blocks()) >= 2


def test_readme_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[3].startswith("make demo") and lines[4].startswith("make test")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_api_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"], check=False)
    assert result.returncode == 0, "docs/api.md is stale: run python docs/make_api.py"


def test_make_api_renders_every_public_name() -> None:
    module = runpy.run_path(str(ROOT / "docs" / "make_api.py"))
    text = module["render"]()
    for name in ("GradScaler", "OptState", "ScaleCollapseError", "JsonLinesLogger", "clip_grad_norm_", "stats"):
        assert name in text
