"""The layering of the package, read from the source: imports only go down, and only scaler.py owns state.

Layers, lowest first, are in ``LAYERS`` (docs/architecture.md draws them). A module may import only
from strictly lower layers, at module top (the optional Triton import in ``kernels/`` and the tools'
lazy imports aside); the tools and the integrations may also import the package's public face.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gradscaler"

LAYERS: dict[str, int] = {
    "errors": 0,
    "rule": 0,
    "telemetry": 0,
    "distributed": 0,
    "kernels": 0,
    "stale": 0,
    "grads": 1,
    "scalerlog": 1,
    "fused": 2,
    "clipping": 2,
    "monitor": 2,
    "checkpoint": 2,
    "diagnosis": 2,
    "masters": 2,
    "torch_surface": 2,
    "scaler": 3,
    "drop_in": 4,
    "frameworks": 4,
    "reporting": 4,
    "__init__": 5,
    "tools": 6,
    "__main__": 7,
}
PRIVATE_ACCESS = re.compile(r"\bscaler\._[A-Za-z]")


def module_name(path: Path, root: Path) -> str:
    """``kernels/torch_stats.py`` -> ``kernels``; ``rule.py`` -> ``rule``."""
    relative = path.relative_to(root)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_modules(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(top-level gradscaler module, line, at module top) for every import of gradscaler."""
    found: list[tuple[str, int, bool]] = []
    top = {id(node) for node in tree.body} if isinstance(tree, ast.Module) else set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradscaler":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("gradscaler.")]
        found.extend((name, node.lineno, id(node) in top) for name in names)
    return found


def layering_violations(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        own = module_name(path, root)
        if own not in LAYERS:
            problems.append(f"{path.name}: module {own!r} has no layer in tests/test_layers.py")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target, line, at_top in imported_modules(tree):
            if target == own or target not in LAYERS:
                continue
            if LAYERS[target] >= LAYERS[own]:
                problems.append(f"{path.relative_to(root)}:{line}: {own} (layer {LAYERS[own]}) imports {target}")
            if not at_top and own not in ("tools", "kernels"):
                problems.append(f"{path.relative_to(root)}:{line}: function-level import of {target}")
        if own != "scaler":
            for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PRIVATE_ACCESS.search(text):
                    problems.append(f"{path.relative_to(root)}:{number}: touches a scaler private: {text.strip()}")
    return problems


def test_imports_only_go_down_and_only_scaler_touches_its_privates() -> None:
    assert layering_violations(SRC) == []


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("clipping.py", "from gradscaler.scaler import GradScaler", "clipping (layer 2) imports scaler"),
        ("monitor.py", "def f(scaler):\n    return scaler._scale", "touches a scaler private"),
        ("grads.py", "def f():\n    from gradscaler import rule", "function-level import of rule"),
    ],
)
def test_the_check_fails_when_a_violation_is_reintroduced(
    tmp_path: Path, module: str, line: str, expected: str
) -> None:
    copy = tmp_path / "gradscaler"
    for path in SRC.rglob("*.py"):
        target = copy / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (copy / module).write_text((copy / module).read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    problems = layering_violations(copy)
    assert any(expected in problem for problem in problems), problems
