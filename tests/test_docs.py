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


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_blocks_run(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(python_blocks()[index], f"README.md block {index}", "exec"), {"__name__": "readme"})


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
