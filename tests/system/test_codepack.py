"""The launcher's code pack (`ipward.core.startpath`): an installed plugin imports its
modules from the pack; a module changed since the install is imported from its source;
a pack that cannot be used (missing, damaged, of another interpreter) changes nothing
but the speed. Each case on a copy of the package installed as `ipward install-cni`
installs it, run by the launcher's own interpreter."""

from __future__ import annotations

import json
import marshal
import shutil
import subprocess
from pathlib import Path
from types import CodeType
from typing import NamedTuple

import pytest

from ipward.core.startpath import pack_path
from support import REPO

HOST_PYTHON = "/usr/bin/python3"
# The launcher's lines, then which loader each module on the ADD path came from, and
# the ADD itself (its answer on stdout after the report).
REPORT = """
import sys
sys.path.insert(0, {path!r})
from ipward.core.startpath import install_pack
install_pack({pack!r})
import ipward.cni.verbs, ipward.store.sqlite
loaders = {{
    n: type(m.__spec__.loader).__name__
    for n, m in sys.modules.items() if n.startswith("ipward.") and m.__spec__
}}
marks = {{n: getattr(m, "MARK", None) for n, m in sys.modules.items() if n.startswith("ipward")}}
verbs = sys.modules["ipward.cni.verbs"]
lines = {{  # where each function of verbs starts, for tracebacks
    n: f.__code__.co_firstlineno
    for n, f in vars(verbs).items() if getattr(f, "__module__", "") == verbs.__name__
    and hasattr(f, "__code__")
}}
marks = {{n: v for n, v in marks.items() if v is not None}}
print(repr((loaders, marks, verbs.__doc__, lines, "functools" in sys.modules)))
sys.stdout.flush()
from ipward.cni.plugin import main
main()
"""


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """A copy of the package, installed (its bytecode and pack written) by the host's
    interpreter; returns the directory holding `ipward`."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "src" / "ipward", tmp_path / "pkg" / "ipward", ignore=skip)
    program = (
        "import sys;from pathlib import Path;sys.path.insert(0,sys.argv[1]);"
        "from ipward.core.startpath import write_launcher;print(write_launcher(Path(sys.argv[2])))"
    )
    target = tmp_path / "bin" / "ipward"
    argv = [HOST_PYTHON, "-I", "-S", "-B", "-c", program, str(tmp_path / "pkg"), str(target)]
    done = subprocess.run(argv, capture_output=True, timeout=300)
    assert done.stdout == b"None\n", done.stderr.decode()
    assert Path(pack_path(str(tmp_path / "pkg" / "ipward"))).is_file()
    return tmp_path / "pkg"


class Added(NamedTuple):
    loaders: dict[str, str]  # loader per ipward module
    marks: dict[str, int]  # MARK per module that has one
    verbs_doc: str | None  # `ipward.cni.verbs`' docstring
    verbs_lines: dict[str, int]  # first line of each function of `ipward.cni.verbs`
    functools: bool  # whether `functools` was imported by then (the store was)
    answer: dict  # the CNI answer


def add(package: Path, store: Path, python: str = HOST_PYTHON) -> Added:
    """One in-process ADD through the launcher's lines, run by `python`."""
    program = REPORT.format(path=str(package), pack=pack_path(str(package / "ipward")))
    config = {
        "cniVersion": "1.0.0",
        "name": "net1",
        "ipam": {
            "type": "ipward",
            "store": f"sqlite://{store}",
            "ranges": [[{"subnet": "10.0.0.0/24"}]],
        },
    }
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"}
    env.update(CNI_NETNS="/var/run/netns/test", CNI_PATH="/opt/cni/bin")
    done = subprocess.run(
        [python, "-I", "-S", "-c", program],
        input=json.dumps(config).encode(),
        env=env,
        capture_output=True,
        timeout=60,
    )
    report, _, answer = done.stdout.decode().partition("\n")
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()
    return Added(*eval(report), json.loads(answer))


def function_lines(source: Path) -> dict[str, int]:
    """First line of each top-level function's code, as Python compiles the source."""
    module = compile(source.read_text(), str(source), "exec")
    return {c.co_name: c.co_firstlineno for c in module.co_consts if isinstance(c, CodeType)}


def test_the_installed_plugin_imports_its_modules_from_the_pack(
    installed: Path, tmp_path: Path
) -> None:
    added = add(installed, tmp_path / "s.db")
    assert added.answer["ips"][0]["address"] == "10.0.0.2/24"  # .1 is the gateway
    assert added.loaders["ipward.cni.verbs"] == "CodePack"
    assert added.loaders["ipward.store.sqlite"] == "CodePack"
    # the three imported before the pack is installed, the usual way
    assert {n for n, kind in added.loaders.items() if kind != "CodePack"} == {
        "ipward.core",
        "ipward.core.startpath",
    }
    # docstrings left out, line numbers the source's
    assert added.verbs_doc is None
    verbs = installed / "ipward" / "cni" / "verbs.py"
    assert added.verbs_lines and added.verbs_lines.items() <= function_lines(verbs).items()


def test_a_module_changed_since_the_install_is_imported_from_its_source(
    installed: Path, tmp_path: Path
) -> None:
    verbs = installed / "ipward" / "cni" / "verbs.py"
    verbs.write_text(verbs.read_text() + "\nMARK = 1\n")  # as an upgrade without install-cni
    added = add(installed, tmp_path / "s.db")
    assert added.marks == {"ipward.cni.verbs": 1}  # the new source runs
    assert added.loaders["ipward.cni.verbs"] == "SourceFileLoader"
    assert added.verbs_doc  # from the source, as it is
    assert added.loaders["ipward.store.sqlite"] == "CodePack"  # the others: from the pack
    assert added.answer["ips"][0]["address"] == "10.0.0.2/24"  # .1 is the gateway


@pytest.mark.parametrize("damage", ["missing", "truncated", "another interpreter", "garbage"])
def test_a_pack_that_cannot_be_used_changes_nothing_but_the_speed(
    installed: Path, tmp_path: Path, damage: str
) -> None:
    pack = Path(pack_path(str(installed / "ipward")))
    data = pack.read_bytes()
    if damage == "missing":
        pack.unlink()
    elif damage == "truncated":
        pack.write_bytes(data[: len(data) // 3])
    elif damage == "another interpreter":
        length = int.from_bytes(data[:4], "big")
        _, entries = marshal.loads(data[4 : 4 + length])
        index = marshal.dumps((b"\x00\x00\r\n", entries))
        pack.write_bytes(len(index).to_bytes(4, "big") + index + data[4 + length :])
    else:
        pack.write_bytes(b"\xff" * 4096)
    added = add(installed, tmp_path / "s.db")
    assert "CodePack" not in added.loaders.values()
    assert added.answer["ips"][0]["address"] == "10.0.0.2/24"  # .1 is the gateway
