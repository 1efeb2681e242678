"""A wheel and an sdist that install from a file: ``python -m build`` makes both, with the metadata
pyproject.toml declares, and the wheel installs and imports with nothing else on the path.

Built offline (``--no-isolation``: the hatchling of this environment, which ``.[dev]`` installs).
"""

from __future__ import annotations

import email
import importlib.util
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("build") is None or importlib.util.find_spec("hatchling") is None,
    reason="needs build and hatchling (pip install -e '.[dev]')",
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_wheel_carries_pyprojects_metadata_and_the_whole_package(dist: Path) -> None:
    (wheel,) = dist.glob(f"gradscaler-{PROJECT['version']}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"gradscaler-{PROJECT['version']}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert metadata["Name"] == "gradscaler" and metadata["Version"] == PROJECT["version"]
    assert metadata["Requires-Python"] == PROJECT["requires-python"]
    assert PROJECT["dependencies"] == ["torch>=2.4"]
    assert "torch>=2.4" in metadata.get_all("Requires-Dist")
    assert set(metadata.get_all("Provides-Extra")) == set(PROJECT["optional-dependencies"])
    assert "gradscaler = gradscaler.tools.cli:main" in entry_points
    source = {
        f"gradscaler/{p.relative_to(ROOT / 'src' / 'gradscaler')}" for p in (ROOT / "src" / "gradscaler").rglob("*.py")
    }
    assert source | {"gradscaler/py.typed"} <= names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)


def test_the_wheel_installs_from_its_file_and_imports(dist: Path, tmp_path: Path) -> None:
    """Installed into a folder of its own (no dependencies: torch is this environment's), run from there."""
    (wheel,) = dist.glob("*.whl")
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    probe = "import gradscaler, sys; print(gradscaler.__file__, gradscaler.__version__)"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, env=env, cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr
    where, version = ran.stdout.split()
    assert Path(where).is_relative_to(target) and version == PROJECT["version"]


def test_the_sdist_holds_what_a_build_and_the_tests_need(dist: Path) -> None:
    (sdist,) = dist.glob(f"gradscaler-{PROJECT['version']}.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "src/gradscaler/__init__.py", "src/gradscaler/py.typed"} <= names
    assert "tests/test_packaging.py" in names
    assert not any(name.startswith((".venv/", ".hypothesis/", ".git/")) for name in names)
