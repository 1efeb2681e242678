"""The layering of the package, read from the source: imports only go down, and only scaler.py owns state.

The package's units, lowest first, are in ``LAYERS`` (docs/architecture.md draws them): its modules and
its four packages (``kernels``, ``masters``, ``record``, ``tools``). A unit may import only from strictly
lower layers, at module top (the optional Triton import in ``kernels/`` and the tools' lazy imports
aside); the tools and the integrations may also import the package's public face. Inside ``masters`` and
``record`` the files have layers of their own (``INSIDE``, which each package's ``__init__`` docstring
lists in the same order): a file imports only files below it, and its package's ``__init__`` never.
Imports in a top-level ``if TYPE_CHECKING:`` block count as module-top imports: ``__init__`` spells its
imports there and loads the same names at run time from ``_FACE`` on first use (so that the command
line's help needs no torch); ``test_the_lazy_face_loads_what_the_layering_checks`` holds the two equal.
No file imports itself back through others: ``import_cycles`` follows every import of every file, lazy
ones included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gradscaler"

LAYERS: dict[str, int] = {
    "errors": 0,
    "rule": 1,
    "distributed": 1,
    "kernels": 1,
    "stale": 1,
    "compiled": 1,
    "grads": 2,
    "record": 3,
    "masters": 3,
    "fused": 3,
    "clipping": 3,
    "torch_surface": 3,
    "checkpoint": 4,
    "scaler": 5,
    "drop_in": 6,
    "frameworks": 6,
    "__init__": 7,
    "tools": 8,
    "__main__": 9,
}
INSIDE: dict[str, dict[str, int]] = {
    "masters": {
        "checks": 0,
        "ddp": 0,
        "checkpoint": 1,
        "graph": 1,
        "moved": 1,
        "zeroing": 1,
        "pairs": 2,
        "sums": 2,
        "wrappers": 2,
        "accumulate": 3,
        "lifecycle": 4,
        "standalone": 5,
        "__init__": 6,
    },
    "record": {
        "logfile": 0,
        "telemetry": 1,
        "logsummary": 1,
        "monitor": 2,
        "scalerlog": 2,
        "diagnosis": 2,
        "reporting": 3,
        "__init__": 4,
    },
}
LAZY_ALLOWED = ("tools", "kernels")
PRIVATE_ACCESS = re.compile(r"\bscaler\._[A-Za-z]")


def module_path(path: Path, root: Path) -> str:
    """``masters/checks.py`` -> ``masters.checks``; ``masters/__init__.py`` -> ``masters``; ``rule.py`` -> ``rule``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_and_file(module: str) -> tuple[str, str]:
    """``masters.checks`` -> (``masters``, ``checks``); ``masters`` -> (``masters``, ``__init__``)."""
    unit, _, rest = module.partition(".")
    return unit, rest.split(".")[0] if rest else "__init__"


def type_checking_block(node: ast.stmt) -> bool:
    """``if TYPE_CHECKING:``: imports for type checkers only, never run."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def module_top(tree: ast.AST) -> list[ast.stmt]:
    """The statements at module top, those of a top-level ``if TYPE_CHECKING:`` block included."""
    if not isinstance(tree, ast.Module):
        return []
    return [*tree.body, *(inner for node in tree.body if type_checking_block(node) for inner in node.body)]


def imported_modules(tree: ast.AST, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(module of the package, as ``module_path`` names it, line, at module top) for every import of
    gradscaler; ``from gradscaler.masters import checkpoint`` is an import of ``masters.checkpoint``."""
    found: list[tuple[str, int, bool]] = []
    top = {id(node) for node in module_top(tree)}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradscaler":
            base = node.module.split(".")[1:]
            for alias in node.names:
                joined = ".".join([*base, alias.name])
                names.append(joined if joined in modules else ".".join(base))
        elif isinstance(node, ast.Import):
            names = [a.name.partition(".")[2] for a in node.names if a.name.startswith("gradscaler.")]
        found.extend((name, node.lineno, id(node) in top) for name in names if name in modules)
    return found


def layering_violations(root: Path) -> list[str]:
    problems = []
    files = sorted(root.rglob("*.py"))
    modules = {module_path(path, root) for path in files}
    for path in files:
        own = module_path(path, root)
        own_unit, own_file = unit_and_file(own)
        if own_unit not in LAYERS:
            problems.append(f"{path.name}: unit {own_unit!r} has no layer in tests/test_layers.py")
            continue
        inside = INSIDE.get(own_unit, {})
        if inside and own_file not in inside:
            problems.append(f"{path.name}: {own} has no layer in INSIDE[{own_unit!r}]")
            continue
        where = f"{path.relative_to(root)}"
        for target, line, at_top in imported_modules(ast.parse(path.read_text(encoding="utf-8")), modules):
            unit, file = unit_and_file(target)
            if target == own or unit not in LAYERS:
                continue
            if unit != own_unit and LAYERS[unit] >= LAYERS[own_unit]:
                problems.append(f"{where}:{line}: {own_unit} (layer {LAYERS[own_unit]}) imports {unit}")
            if unit == own_unit and inside and inside.get(file, len(inside)) >= inside[own_file]:
                problems.append(f"{where}:{line}: {own} (layer {inside[own_file]} in {unit}) imports {target}")
            if not at_top and own_unit not in LAZY_ALLOWED:
                problems.append(f"{where}:{line}: function-level import of {target}")
        if own != "scaler":
            for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PRIVATE_ACCESS.search(text):
                    problems.append(f"{where}:{number}: touches a scaler private: {text.strip()}")
    return problems


def test_every_package_has_its_map_in_its_docstring() -> None:
    """Each package's ``__init__`` docstring names its files in ``INSIDE``'s order, lowest first."""
    for package, inside in INSIDE.items():
        doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text(encoding="utf-8"))) or ""
        files = sorted((name for name in inside if name != "__init__"), key=inside.__getitem__)
        on_disk = {path.stem for path in (SRC / package).glob("*.py")} - {"__init__"}
        assert set(files) == on_disk, package
        positions = [doc.find(f"``{name}``") for name in files]
        assert -1 not in positions, (package, files, positions)
        assert [inside[name] for name in sorted(files, key=lambda n: doc.find(f"``{n}``"))] == sorted(
            inside[name] for name in files
        ), package


def test_the_architecture_map_names_every_file_of_each_package() -> None:
    """docs/architecture.md's map lists each package's files, as its ``__init__`` docstring does."""
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for package in INSIDE:
        line = next(line for line in doc.splitlines() if line.strip().startswith(f"{package}/ "))
        listed = [name.strip() for name in line.split(":", 1)[1].split(",")]
        on_disk = {path.stem for path in (SRC / package).glob("*.py")} - {"__init__"}
        assert set(listed) == on_disk, (package, listed)


def test_every_other_room_stays_under_five_hundred_twenty_lines() -> None:
    """Issue 29's rule: a module past 520 lines holds two mechanisms; split it where they part (scaler.py, the
    owner of state, has its own limit below)."""
    long = {
        str(path.relative_to(SRC)): lines
        for path in SRC.rglob("*.py")
        if path.name != "scaler.py" and (lines := len(path.read_text(encoding="utf-8").splitlines())) >= 520
    }
    assert not long, f"modules of 520 lines or more: {long}"


def test_the_owner_stays_under_seven_hundred_lines() -> None:
    """scaler.py holds the state machine, not every mechanism it calls (issue 34): under 700 lines."""
    lines = len((SRC / "scaler.py").read_text(encoding="utf-8").splitlines())
    assert lines < 700, f"scaler.py has {lines} lines: move a mechanism out to the module that owns it"


def test_imports_only_go_down_and_only_scaler_touches_its_privates() -> None:
    assert layering_violations(SRC) == []


def face_imports(init: Path) -> dict[str, str]:
    """Public name -> module, from ``__init__.py``'s ``if TYPE_CHECKING:`` imports (what the layering reads)."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return {
        alias.name: node.module or ""
        for block in tree.body
        if type_checking_block(block)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_the_lazy_face_loads_what_the_layering_checks() -> None:
    """``__init__`` imports its names at run time from ``_FACE`` (so that ``gradscaler --help`` needs no
    torch); the layering check reads the ``TYPE_CHECKING`` block. The two must name the same modules."""
    import gradscaler

    assert face_imports(SRC / "__init__.py") == gradscaler._FACE
    assert sorted(gradscaler._FACE) == gradscaler.__all__


def dotted_name(path: Path, root: Path) -> str:
    """``tools/bench.py`` -> ``gradscaler.tools.bench``; ``tools/__init__.py`` -> ``gradscaler.tools``."""
    parts = ["gradscaler", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each file's module -> the package's modules it imports, anywhere in the file.

    ``from gradscaler.tools import bench`` counts as an import of ``gradscaler.tools.bench`` when that
    is a file, else of ``gradscaler.tools``. A file's import of a package that encloses it is not an
    edge: Python runs a package before any of its submodules, so a submodule importing names from
    its own package (``kernels/torch_stats.py`` from ``gradscaler.kernels``) finds them defined.
    """
    modules = {dotted_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(f"{t}.")}
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Every import circle in the package, each as the modules in import order, the first one repeated."""
    graph = import_graph(root)
    found: list[list[str]] = []
    for start in sorted(graph):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for target in sorted(graph[node]):
                if target == start:
                    found.append([*trail, start])
                elif target > start and target not in trail:  # each circle once, from its smallest name
                    stack.append((target, [*trail, target]))
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    """The layers order modules of different layers; this also covers files of one layer (``tools/``)."""
    assert import_cycles(SRC) == []


def package_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package under ``tmp_path`` with ``line`` appended to ``module``."""
    copy = tmp_path / "gradscaler"
    for path in SRC.rglob("*.py"):
        target = copy / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (copy / module).write_text((copy / module).read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    return copy


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("clipping.py", "from gradscaler.scaler import GradScaler", "clipping (layer 3) imports scaler"),
        ("record/monitor.py", "def f(scaler):\n    return scaler._scale", "touches a scaler private"),
        ("grads.py", "def f():\n    from gradscaler import rule", "function-level import of rule"),
        ("record/telemetry.py", "from gradscaler.scaler import GradScaler", "record (layer 3) imports scaler"),
        ("masters/wrappers.py", "from gradscaler import record", "masters (layer 3) imports record"),
        ("errors.py", "from gradscaler import kernels", "errors (layer 0) imports kernels"),
        (
            "masters/checks.py",
            "from gradscaler.masters.lifecycle import MasterWeights",
            "masters.checks (layer 0 in masters) imports masters.lifecycle",
        ),
        (
            "masters/pairs.py",
            "from gradscaler.masters import Moved",
            "masters.pairs (layer 2 in masters) imports masters",
        ),
        (
            "record/telemetry.py",
            "from gradscaler.record import monitor",
            "record.telemetry (layer 1 in record) imports record.monitor",
        ),
        ("record/logsummary.py", "def f():\n    import gradscaler.record.telemetry", "function-level import"),
    ],
)
def test_the_check_fails_when_a_violation_is_reintroduced(
    tmp_path: Path, module: str, line: str, expected: str
) -> None:
    problems = layering_violations(package_with(tmp_path, module, line))
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        (
            "tools/bench_masters.py",
            "def f():\n    from gradscaler.tools.bench import run",
            ["gradscaler.tools.bench", "gradscaler.tools.bench_masters", "gradscaler.tools.bench"],
        ),
        (
            "tools/toy_model.py",
            "from gradscaler.tools import demo",
            ["gradscaler.tools.demo", "gradscaler.tools.toy_model", "gradscaler.tools.demo"],
        ),
        (
            "masters/checkpoint.py",
            "def f():\n    from gradscaler.masters import pairs",
            ["gradscaler.masters.checkpoint", "gradscaler.masters.pairs", "gradscaler.masters.checkpoint"],
        ),
        ("rule.py", "import gradscaler.errors", []),
    ],
    ids=["lazy-import-in-tools", "from-package-import-module", "lazy-import-in-masters", "no-circle"],
)
def test_the_circle_check_fails_when_a_circle_is_reintroduced(
    tmp_path: Path, module: str, line: str, expected: list[str]
) -> None:
    assert import_cycles(package_with(tmp_path, module, line)) == ([expected] if expected else [])


def test_every_module_imports_first() -> None:
    """Each module of the package imports in a process where nothing of gradscaler is loaded yet (a
    private module a test or a tool imports first, ``from gradscaler import grads`` inside it included):
    the lazy face must not load the public names while one of their modules is half-initialised."""
    modules = sorted(dotted_name(path, SRC) for path in SRC.rglob("*.py") if path.name != "__main__.py")
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {modules!r}:\n" + FORGET_PACKAGE + "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as error:\n"
        "        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
    )
    assert_prints_no_failure(script)


FORGET_PACKAGE = (
    "    for loaded in [m for m in sys.modules if m == 'gradscaler' or m.startswith('gradscaler.')]:\n"
    "        del sys.modules[loaded]\n"
)
"""A loop body's first lines in the scripts below: the package imported afresh (torch stays loaded)."""


def assert_prints_no_failure(script: str) -> None:
    """Run ``script`` (which fills a list ``failed``) in a new interpreter; it must print none."""
    import subprocess
    import sys

    script += "print('\\n'.join(failed))\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", result.stdout


SPELLING = re.compile(r"(?<![\w/.-])gradscaler(?:\.[A-Za-z_]\w*)+")
"""A dotted name under the package as the docs write it (``.../gradscaler.git`` in a URL is not one)."""


def documented_spellings() -> list[str]:
    """Every ``gradscaler.X`` and ``gradscaler.sub.Y`` that README.md and docs/*.md show a reader."""
    root = SRC.parent.parent
    texts = [(root / "README.md").read_text()] + [path.read_text() for path in sorted((root / "docs").glob("*.md"))]
    return sorted({match for text in texts for match in SPELLING.findall(text)})


def test_every_documented_spelling_works_whichever_is_used_first() -> None:
    """The lazy face loads on the first public name touched; each spelling the docs show must work
    before and after that, in any order (``gradscaler.frameworks.log_scale`` once failed after
    ``gradscaler.patch_torch``). Each order runs in a package imported afresh (torch stays loaded)."""
    spellings = documented_spellings()
    assert {"gradscaler.patch_torch", "gradscaler.frameworks.log_scale", "gradscaler.tools.demo"} <= set(spellings)
    orders = [[first] + [s for s in spellings if s != first] for first in spellings]
    orders += [list(reversed(order)) for order in orders]
    script = (
        "import functools, importlib, sys\n"
        "failed = []\n"
        f"for order in {orders!r}:\n" + FORGET_PACKAGE + "    package = importlib.import_module('gradscaler')\n"
        "    for spelling in order:\n"
        "        try:\n"
        "            functools.reduce(getattr, spelling.split('.')[1:], package)\n"
        "        except AttributeError as error:\n"
        "            failed.append(f'{spelling} after {order[: order.index(spelling)]}: {error}')\n"
        "            break\n"
    )
    assert_prints_no_failure(script)
