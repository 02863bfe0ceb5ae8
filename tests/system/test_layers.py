"""The import contracts of pyproject.toml's [tool.importlinter], checked by `lint-imports`:
the product (`ipward`) never imports the labs (`ipward_lab`), its packages import only
the layers below them (cmd, agent | controller, gc | cni, cluster | ipam, store, core;
`|`: siblings that never import each other), and no modules or packages of the lab
import each other in a circle. Shown to bite: the same check on a copy of the tree with
one forbidden import added fails, naming it. (The key layout's rule:
`tests/unit/test_key_layout.py`.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

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
    assert "no import circle in the lab KEPT" in done.stdout


def copy_with(tmp_path: Path, module: str, source: str, root: str = "src/ipward") -> Path:
    """A copy of the product, the labs and the configuration, with `module` (a path under
    `root`) written with `source`."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "src" / "ipward", tmp_path / "src" / "ipward", ignore=skip)
    shutil.copytree(
        REPO / "lab" / "src" / "ipward_lab", tmp_path / "lab" / "src" / "ipward_lab", ignore=skip
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / root / module).write_text(source)
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


LAB = "lab/src/ipward_lab"


@pytest.mark.parametrize(
    ("module", "added", "names"),
    [
        # Within a package: the cluster lab's addresses importing its facade, which is
        # made of modules that import them (as podroutes and kubecluster once did).
        (
            "kubecluster/layout.py",
            "from ipward_lab.kubecluster import cluster\n",
            ("No cycles are allowed in ipward_lab.kubecluster.", ".layout -> .cluster"),
        ),
        # Across packages, lazily: a loopback server reaching into the cluster lab, which
        # uses the servers' certificates.
        (
            "servers/pki.py",
            "def lab():\n    from ipward_lab.kubecluster import cluster\n\n    return cluster\n",
            ("No cycles are allowed in ipward_lab.\n", ".servers -> .kubecluster"),
        ),
    ],
    ids=["within-a-package", "across-packages-lazily"],
)
def test_an_import_circle_in_the_lab_breaks_the_contract(
    tmp_path: Path, module: str, added: str, names: tuple[str, str]
) -> None:
    source = (REPO / LAB / module).read_text() + added
    copy = copy_with(tmp_path, module, source, root=LAB)
    done = lint_imports(copy, f"{copy / 'src'}:{copy / 'lab' / 'src'}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no import circle in the lab BROKEN" in done.stdout
    assert all(name in done.stdout for name in names), done.stdout
