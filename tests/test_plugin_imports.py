"""The plugin's start path imports an allow-list of modules and nothing else: every pod
start pays for what it imports (docs/architecture.md "Plugin start path"). Measured on
the machine's `/usr/bin/python3 -I -S` (as the launcher runs it) with `-X importtime`,
which names every module imported, on the real paths: the in-process ADD on a real
SQLite file (the first, which stores the inline pool, and the next, the common case),
DEL, VERSION, and the thin path forwarding to an agent (here one that is not there).
Shown to bite: the same exec of a copy of the package with one costly import added to
a module on the path fails, naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_install_standalone import ALLOWED_IMPORTS as STANDALONE_IMPORTS

HOST_PYTHON = "/usr/bin/python3"
SRC = REPO / "src"
V4 = {"ranges": [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}]]}

# Beyond the interpreter's own start (written out: adding one is a decision, made here).
# The in-process path: the verbs, the ledger on SQLite, and the C or small modules they
# use; `random` is imported only on a transaction conflict, `json` only to word an error
# about malformed input, so neither is here.
IN_PROCESS = {
    "ipward",
    "ipward.cni",
    "ipward.cni.cniio",
    "ipward.cni.config",
    "ipward.cni.plugin",
    "ipward.cni.selection",
    "ipward.cni.verbs",
    "ipward.cni.wire",
    "ipward.core",
    "ipward.core.addr",
    "ipward.core.errors",
    "ipward.core.jsonc",
    "ipward.core.keys",
    "ipward.core.log",
    "ipward.core.names",
    "ipward.core.policy",
    "ipward.core.pool",
    "ipward.core.records",
    "ipward.core.testpoints",
    "ipward.ipam",
    "ipward.ipam.blocks",
    "ipward.ipam.ledger",
    "ipward.store",
    "ipward.store.base",
    "ipward.store.schema",
    "ipward.store.sqlite",
    "__future__",
    "_json",
    "_socket",
    # os (the environment, the store's directory) and its path module
    "os",
    "stat",
    "_stat",
    "posixpath",
    "genericpath",
    "_collections_abc",
    # sqlite3 and what it imports
    "sqlite3",
    "sqlite3.dbapi2",
    "_sqlite3",
    "datetime",
    "_datetime",
    "math",
    "collections",
    "collections.abc",
    "_collections",
    "functools",
    "_functools",
    "itertools",
    "keyword",
    "operator",
    "_operator",
    "reprlib",
    "types",
}
# Only the ADD that stores (or changes) an inline pool: its overlap guard.
STORING_A_POOL = {"ipward.ipam.pools"}
# The thin path: the config is parsed for ipam.agentSocket and the call forwarded; the
# standalone plugin is that path with an entry of its own.
FORWARDING = STANDALONE_IMPORTS - {"ipward.cni.standalone"}


def imported(src: Path, command: str, config: dict, container: str = "c1") -> set[str]:
    """The modules one plugin exec imports beyond a bare interpreter's start: the
    launcher's own program (`ipward install-cni`'s, with `src` on the path), run with
    `-X importtime`."""
    program = (
        f"import sys;sys.path.insert(0,{str(src)!r});from ipward.cni.plugin import main;main()"
    )

    def modules(argv: list[str], stdin: bytes) -> tuple[set[str], subprocess.CompletedProcess]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container, "CNI_IFNAME": "eth0"}
        env.update(CNI_NETNS="/var/run/netns/test", CNI_PATH="/opt/cni/bin")
        proc = subprocess.run(argv, input=stdin, env=env, capture_output=True, timeout=60)
        lines = proc.stderr.decode().splitlines()
        names = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}
        return names - {"module"}, proc  # "module": the header line

    bare, _ = modules([HOST_PYTHON, "-X", "importtime", "-I", "-S", "-c", "pass"], b"")
    argv = [HOST_PYTHON, "-X", "importtime", "-I", "-S", "-c", program]
    found, proc = modules(argv, json.dumps(config).encode())
    assert "ipward.cni.plugin" in found, proc.stderr.decode()[-2000:]
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()[-2000:]
    return found - bare


def in_process_config(url: str) -> dict:
    return {"cniVersion": "1.0.0", "name": "net1", "ipam": {"type": "ipward", "store": url, **V4}}


def test_in_process_add_imports_only_the_allow_list(sqlite_url: str) -> None:
    config = in_process_config(sqlite_url)
    first = imported(SRC, "ADD", config, container="c1")
    assert first - IN_PROCESS - STORING_A_POOL == set()
    assert first >= STORING_A_POOL  # the pool was stored: the measurement saw the ADD
    assert imported(SRC, "ADD", config, container="c2") - IN_PROCESS == set()
    assert imported(SRC, "DEL", config, container="c2") - IN_PROCESS == set()
    assert imported(SRC, "VERSION", config) - IN_PROCESS == set()


def test_forwarding_path_imports_only_the_allow_list() -> None:
    config = {
        "cniVersion": "1.0.0",
        "name": "net1",
        "ipam": {"type": "ipward", "agentSocket": "/run/ipward-test-none/agent.sock"},
    }
    assert imported(SRC, "ADD", config) - FORWARDING == set()


@pytest.mark.parametrize(
    ("module", "added"),
    [
        ("core/pool.py", "typing"),
        ("cni/selection.py", "ipaddress"),
        ("store/sqlite.py", "logging"),
        ("cni/wire.py", "dataclasses"),
    ],
)
def test_a_costly_import_on_the_start_path_is_found(
    tmp_path: Path, sqlite_url: str, module: str, added: str
) -> None:
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(SRC / "ipward", tmp_path / "ipward", ignore=skip)
    path = tmp_path / "ipward" / module
    source = path.read_text()
    head, marker, rest = source.partition("from __future__ import annotations\n")
    path.write_text(f"{head}{marker}import {added}\n{rest}")
    found = imported(tmp_path, "ADD", in_process_config(sqlite_url))
    assert added in found - IN_PROCESS - STORING_A_POOL
