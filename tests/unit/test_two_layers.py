"""The two test layers stay apart (docs/architecture.md "Tests"): pytest imports test
modules by their base name (the layers are not packages), so a name found in both stops
the whole run at collection ("import file mismatch"), and a module importing one of the
other layer cannot run with its own layer alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LAYERS = ("unit", "system")


def modules(layer: str) -> dict[str, Path]:
    return {path.stem: path for path in (TESTS / layer).glob("*.py")}


def test_no_module_name_is_in_both_layers() -> None:
    unit, system = (set(modules(layer)) - {"conftest"} for layer in LAYERS)
    assert not unit & system, f"in both tests/unit and tests/system: {sorted(unit & system)}"


def test_no_module_imports_one_of_the_other_layer() -> None:
    found = []
    for layer, other in (LAYERS, LAYERS[::-1]):
        theirs = set(modules(other)) - {"conftest"}
        for name, path in modules(layer).items():
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found += [f"{layer}/{name} imports {other}/{n}" for n in names if n in theirs]
    assert not found, found
