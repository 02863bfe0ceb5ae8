"""The store's key layout is spelled in `ipward.core.keys` only: every other module of the
product and the labs builds and parses keys through it, so the layout changes in one
place (with a schema version). Shown to bite on made-up sources."""

from __future__ import annotations

import ast

import pytest

from ipward.core import keys
from support import REPO


def spelled_key_prefixes(source: str) -> list[str]:
    """The string literals (f-string parts included, docstrings aside) of a module that
    start with one of the store's key prefixes."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and node.value.startswith(keys.PREFIXES)
    ]


def test_only_the_key_layout_spells_a_key_prefix() -> None:
    """Every other module builds and parses keys through `ipward.core.keys`, so the layout
    changes in one place (with a schema version)."""
    spelled = {}
    for root in (REPO / "src" / "ipward", REPO / "lab" / "src" / "ipward_lab"):
        for path in sorted(root.rglob("*.py")):
            if path == REPO / "src" / "ipward" / "core" / "keys.py":
                continue
            found = spelled_key_prefixes(path.read_text())
            if found:
                spelled[str(path.relative_to(REPO))] = found
    assert spelled == {}


@pytest.mark.parametrize(
    "source",
    ['store.range("ips/")\n', 'key = f"blocks/{pool}/{cidr}"\n', "PREFIX = 'freeq/'\n"],
    ids=["literal", "f-string", "constant"],
)
def test_a_spelled_key_prefix_is_found(source: str) -> None:
    assert spelled_key_prefixes('"""ips/ in a docstring is prose."""\n' + source) != []
    assert spelled_key_prefixes('"""ips/ in a docstring is prose."""\n') == []
