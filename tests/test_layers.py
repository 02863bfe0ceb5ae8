"""The layer contracts of pyproject.toml's [tool.importlinter], checked by `lint-imports`:
the product (`ipward`) never imports the labs (`ipward_lab`), and its packages import
only the layers below them (cmd, agent | controller, gc | cni, cluster | ipam, store,
core; `|`: siblings that never import each other). Shown to bite: the same check on a
copy of the tree with one forbidden import added fails, naming it. And the store's key
layout is spelled in `ipward.core.keys` only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from ipward.core import keys

LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_product_never_imports_the_labs_and_keeps_its_layers() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the product never imports the labs KEPT" in done.stdout
    assert "the product's layers KEPT" in done.stdout


def copy_with(tmp_path: Path, module: str, source: str) -> Path:
    """A copy of the product, the labs and the configuration, with `module` (a path under
    src/ipward) written with `source`."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "src" / "ipward", tmp_path / "src" / "ipward", ignore=skip)
    shutil.copytree(
        REPO / "lab" / "src" / "ipward_lab", tmp_path / "lab" / "src" / "ipward_lab", ignore=skip
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "src" / "ipward" / module).write_text(source)
    return tmp_path


@pytest.mark.parametrize(
    "leak",
    [
        "from ipward_lab import fleet\n",
        # Imported only when called, as cli.py once imported the lab's commands.
        "def command():\n    from ipward_lab.fleet import Agent\n\n    return Agent\n",
    ],
    ids=["module-level", "inside-a-function"],
)
def test_a_product_import_of_the_labs_breaks_the_contract(tmp_path: Path, leak: str) -> None:
    copy = copy_with(tmp_path, "leak.py", leak)
    # The copy comes first on the path, before the installed (editable) packages.
    done = lint_imports(copy, f"{copy / 'src'}:{copy / 'lab' / 'src'}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the product never imports the labs BROKEN" in done.stdout
    assert "ipward.leak -> ipward_lab.fleet" in done.stdout


@pytest.mark.parametrize(
    ("module", "leak", "names"),
    [
        # Upward: the core (pure, on the plugin's path) reaching for the ledger.
        ("core/leak.py", "from ipward.ipam import ledger\n", "ipward.core.leak -> ipward.ipam"),
        # Upward, lazily: the store asking the cluster, inside a function.
        (
            "store/leak.py",
            "def pods():\n    from ipward.cluster import liveness\n\n    return liveness\n",
            "ipward.store.leak -> ipward.cluster",
        ),
        # Across independent siblings: garbage collection importing the CNI verbs; what
        # the cluster is reaching for the ledger (the controller's election, which writes
        # through the store, now lives in the controller).
        ("gc/leak.py", "from ipward.cni import verbs\n", "ipward.gc.leak -> ipward.cni"),
        (
            "cluster/leak.py",
            "from ipward.ipam import ledger\n",
            "ipward.cluster.leak -> ipward.ipam",
        ),
    ],
    ids=[
        "core-imports-ipam",
        "store-imports-cluster-lazily",
        "gc-imports-cni",
        "cluster-imports-ipam",
    ],
)
def test_an_import_against_the_layers_breaks_the_contract(
    tmp_path: Path, module: str, leak: str, names: str
) -> None:
    copy = copy_with(tmp_path, module, leak)
    done = lint_imports(copy, f"{copy / 'src'}:{copy / 'lab' / 'src'}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the product's layers BROKEN" in done.stdout
    assert names in done.stdout, done.stdout


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
