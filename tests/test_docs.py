"""The documentation runs: the Python blocks of README and docs/guide.md execute, docs/api.md is current."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


RUN_PAGES = ("README.md", "docs/guide.md")
"""The pages every Python block of which runs (tests/test_readme.py runs them too, in make demo's venv)."""
FRAGMENT_PAGES = ("docs/integrations.md", "docs/migration.md", "docs/bfloat16.md")
"""Pages whose Python blocks are fragments of a framework's script or a policy's arguments, not run here."""


def python_blocks(page: str = "README.md") -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


BLOCKS = [(page, index) for page in RUN_PAGES for index in range(len(python_blocks(page)))]


def promised_output(block: str) -> list[str]:
    """What a block says it prints: the comment after each ``print(...)`` line."""
    return [line.split("#", 1)[1].strip() for line in block.splitlines() if "print(" in line and "#" in line]


@pytest.mark.parametrize(("page", "index"), BLOCKS, ids=[f"{page}-{index}" for page, index in BLOCKS])
def test_readme_python_blocks_run(
    page: str, index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each block runs as pasted into a fresh interpreter, and prints what its comments say it prints."""
    monkeypatch.chdir(tmp_path)
    block = python_blocks(page)[index]
    exec(compile(block, f"{page} block {index}", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    for expected in promised_output(block):
        assert any(line == expected or line.endswith(f" {expected}") for line in lines), (expected, printed)


def test_readme_says_what_its_blocks_print() -> None:
    """The check above has something to hold: README's blocks that print promise what."""
    assert sum(len(promised_output(block)) for block in python_blocks()) >= 2


def test_every_page_with_python_blocks_is_run_or_known_for_fragments() -> None:
    """A block moved to a new page under docs/ is run: a page with Python blocks is in RUN_PAGES, or is one
    of the fragment pages."""
    pages = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    with_blocks = {page for page in pages if python_blocks(page)}
    assert with_blocks - set(FRAGMENT_PAGES) == set(RUN_PAGES)


def test_readme_stays_short() -> None:
    """README is the first screen and the way in; the reference lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


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
