"""The architecture as a rule the source must keep: imports point down the data flow
(orders -> schedule -> sources -> engines -> loaders -> lightning -> the public surface ->
adapters), and no module imports another module's private names or a private module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_loaders"

# The shared foundation (errors, hashing, state, context, placement, collectives) is layer 0.
LAYERS = {
    "orders": 1,
    "schedule": 2,
    "sources": 3,
    "engines": 4,
    "loaders": 5,
    "lightning": 6,
    "__init__": 7,
    "testing": 7,
    "adapters": 8,
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found.append((".".join(parts), path))
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        parts = path.relative_to(ROOT / "adapters").with_suffix("").parts
        found.append((".".join((PACKAGE, "adapters", *parts)), path))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return LAYERS["__init__"]
    return LAYERS.get(parts[1], 0)


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """``(module, names imported from it, line)`` for every import of this package."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
    return [(module, names, line) for module, names, line in out
            if module.split(".")[0] == PACKAGE]


MODULES = _modules()


def test_the_package_has_its_layers() -> None:
    names = {module for module, _ in MODULES}
    for layer in ("orders", "schedule", "sources", "engines", "loaders", "lightning"):
        assert any(name.startswith(f"{PACKAGE}.{layer}.") for name in names), layer


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down_and_stay_public(module: str, path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for target, names, line in _imports(tree):
        if target != module and _layer(target) > _layer(module):
            problems.append(f"line {line}: imports {target}, a layer above")
        private = [part for part in target.split(".") if part.startswith("_")]
        if private:
            problems.append(f"line {line}: imports the private module {target}")
        hidden = [name for name in names if name.startswith("_") and name != "__version__"]
        if hidden and target != module:
            problems.append(f"line {line}: imports private names {hidden} from {target}")
    assert not problems, f"{module}:\n  " + "\n  ".join(problems)
