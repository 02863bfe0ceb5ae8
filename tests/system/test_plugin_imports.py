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

from ipward.core.pool import PoolSpec
from ipward.core.startpath import LAUNCHER, pack_path, write_executable, write_launcher
from ipward.ipam.pools import create_pool
from ipward.store import open_store
from support import REPO

HOST_PYTHON = "/usr/bin/python3"
SRC = REPO / "src"
V4 = {"ranges": [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}]]}

# Beyond the interpreter's own start (written out: adding one is a decision, made here).
# The in-process path: the verbs, the ledger on SQLite, and the C or small modules they
# use; `random` is imported only on a transaction conflict, `json` only to word an error
# about malformed input, so neither is here; nor is `ipward.ipam.combining`: the plugin's
# one call is never concurrent with another.
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
    "ipward.core.keys",
    "ipward.core.log",
    "ipward.core.names",
    "ipward.core.policy",
    "ipward.core.pool",
    "ipward.core.records",
    "ipward.core.startpath",
    "ipward.core.testpoints",
    "ipward.ipam",
    "ipward.ipam.allocating",
    "ipward.ipam.allocation",
    "ipward.ipam.cache",
    "ipward.ipam.free_queue",
    "ipward.ipam.ledger",
    "ipward.store",
    "ipward.store.base",
    "ipward.store.schema",
    "ipward.store.sqlite",
    "__future__",
    "_json",
    "_socket",
    # the C module under sqlite3 (not the package: it adds datetime, collections.abc),
    # and the C module under functools (its lru_cache is the statement cache)
    "_sqlite3",
    "_functools",
}
# Only the ADD that stores (or changes) an inline pool: its overlap guard.
STORING_A_POOL = {"ipward.ipam.pools"}
# Only an ADD that finds the block its node fills used up (the first ADD of each block):
# room elsewhere, the claim walk.
CLAIMING = {"ipward.ipam.claims"}
# Only DEL (and CNI GC): freeing is not ADD's. A sticky ADD adds its reservations (which
# free through `freeing` when they retire).
FREEING = {"ipward.ipam.freeing"}
STICKY = {"ipward.ipam.sticky", *FREEING}
# The thin path: the config is parsed for ipam.agentSocket and the call forwarded.
FORWARDING = {
    "ipward",
    "ipward.cni",
    "ipward.cni.cniio",
    "ipward.cni.notes",
    "ipward.cni.plugin",
    "ipward.cni.wire",
    "ipward.core",
    "ipward.core.errors",
    "ipward.core.startpath",
    "__future__",
    "_json",
    "_socket",
}


def imported(
    launcher: Path, command: str, config: dict, container: str = "c1", args: str = ""
) -> set[str]:
    """The modules one exec of an installed `launcher` imports beyond a bare interpreter's
    start: run as its shebang line says, with `-X importtime` added."""
    interpreter, *options = launcher.read_text().splitlines()[0].removeprefix("#!").split()

    def modules(argv: list[str], stdin: bytes) -> tuple[set[str], subprocess.CompletedProcess]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container, "CNI_IFNAME": "eth0"}
        if args:
            env["CNI_ARGS"] = args
        env.update(CNI_NETNS="/var/run/netns/test", CNI_PATH="/opt/cni/bin")
        proc = subprocess.run(argv, input=stdin, env=env, capture_output=True, timeout=60)
        lines = proc.stderr.decode().splitlines()
        names = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}
        return names - {"module"}, proc  # "module": the header line

    bare, _ = modules([HOST_PYTHON, "-X", "importtime", "-I", "-S", "-c", "pass"], b"")
    argv = [interpreter, "-X", "importtime", *options, str(launcher)]
    found, proc = modules(argv, json.dumps(config).encode())
    assert "ipward.cni.plugin" in found, proc.stderr.decode()[-2000:]
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()[-2000:]
    return found - bare


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    """The plugin as `ipward install-cni` installs it."""
    write_launcher(tmp_path / "bin" / "ipward")
    return tmp_path / "bin" / "ipward"


def in_process_config(url: str) -> dict:
    return {"cniVersion": "1.0.0", "name": "net1", "ipam": {"type": "ipward", "store": url, **V4}}


def test_in_process_add_imports_only_the_allow_list(launcher: Path, sqlite_url: str) -> None:
    config = in_process_config(sqlite_url)
    first = imported(launcher, "ADD", config, container="c1")
    assert first - IN_PROCESS - STORING_A_POOL - CLAIMING == set()
    assert first >= STORING_A_POOL | CLAIMING  # the pool stored, a block claimed: seen
    assert imported(launcher, "ADD", config, container="c2") - IN_PROCESS == set()
    deleting = imported(launcher, "DEL", config, container="c2")
    assert deleting - IN_PROCESS - FREEING == set()
    assert deleting >= FREEING  # the measurement saw the DEL free
    assert imported(launcher, "VERSION", config) - IN_PROCESS == set()


def test_sticky_add_imports_only_the_allow_list(launcher: Path, sqlite_url: str) -> None:
    config = in_process_config(sqlite_url)
    config["ipam"]["sticky"] = True
    identity = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_UID=u1"
    first = imported(launcher, "ADD", config, container="c1", args=identity)
    assert first - IN_PROCESS - STORING_A_POOL - CLAIMING - STICKY == set()
    assert "ipward.ipam.sticky" in first  # the measurement saw the sticky ADD


def test_named_pool_add_imports_only_the_allow_list(launcher: Path, sqlite_url: str) -> None:
    store = open_store(sqlite_url)
    try:
        create_pool(store, PoolSpec("named", [[{"subnet": "10.9.0.0/24"}]]))
    finally:
        store.close()
    ipam = {"type": "ipward", "store": sqlite_url, "pool": "named"}
    config = {"cniVersion": "1.0.0", "name": "net1", "ipam": ipam}
    assert imported(launcher, "ADD", config, container="c1") - IN_PROCESS - CLAIMING == set()
    assert imported(launcher, "ADD", config, container="c2") - IN_PROCESS == set()
    assert imported(launcher, "DEL", config, container="c1") - IN_PROCESS - FREEING == set()


def test_forwarding_path_imports_only_the_allow_list(launcher: Path) -> None:
    config = {
        "cniVersion": "1.0.0",
        "name": "net1",
        "ipam": {"type": "ipward", "agentSocket": "/run/ipward-test-none/agent.sock"},
    }
    assert imported(launcher, "ADD", config) - FORWARDING == set()


@pytest.mark.parametrize(
    ("module", "added"),
    [
        ("core/pool.py", "typing"),
        ("cni/selection.py", "ipaddress"),
        ("store/sqlite.py", "logging"),
        ("cni/wire.py", "dataclasses"),
        ("cni/config.py", "os"),
        ("store/sqlite.py", "sqlite3"),
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
    copy_launcher = tmp_path / "bin" / "ipward"
    text = LAUNCHER.format(path=str(tmp_path), pack=pack_path(str(tmp_path / "ipward")))
    write_executable(copy_launcher, text.encode())  # no pack there: imported module by module
    found = imported(copy_launcher, "ADD", in_process_config(sqlite_url))
    assert added in found - IN_PROCESS - STORING_A_POOL - CLAIMING


def test_a_launcher_without_isolation_flags_is_found(tmp_path: Path, sqlite_url: str) -> None:
    """Its shebang is what the measurement runs: without -S, `site` (and with it `os`)
    is imported on every exec."""
    slow = tmp_path / "bin" / "ipward"
    text = LAUNCHER.format(path=str(SRC), pack=pack_path(str(SRC / "ipward")))
    text = text.replace("#!/usr/bin/python3 -IS", "#!/usr/bin/python3 -I")
    write_executable(slow, text.encode())
    found = imported(slow, "ADD", in_process_config(sqlite_url))
    assert {"site", "os"} <= found - IN_PROCESS


def test_install_writes_the_bytecode_the_launcher_loads(tmp_path: Path, sqlite_url: str) -> None:
    """`install-cni` compiles the package for the launcher's interpreter, so no exec
    compiles (a module without fresh bytecode costs its compile on every exec where
    the package directory is not writable). A copy of the package without bytecode is
    installed, then every ipward module an ADD imports has a `.pyc` of that interpreter
    from before the exec, and the exec writes none."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(SRC / "ipward", tmp_path / "pkg" / "ipward", ignore=skip)
    target = tmp_path / "bin" / "ipward"
    program = (
        "import sys;from pathlib import Path;sys.path.insert(0,sys.argv[1]);"
        "from ipward.core.startpath import write_launcher;print(write_launcher(Path(sys.argv[2])))"
    )
    argv = [HOST_PYTHON, "-I", "-S", "-B", "-c", program, str(tmp_path / "pkg"), str(target)]
    done = subprocess.run(argv, capture_output=True, timeout=300)
    assert done.stdout == b"None\n", done.stderr.decode()
    tag = (
        subprocess.run(
            [HOST_PYTHON, "-I", "-S", "-c", "import sys;print(sys.implementation.cache_tag)"],
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    before = set((tmp_path / "pkg").rglob("*.pyc"))
    ipward_modules = {
        m for m in imported(target, "ADD", in_process_config(sqlite_url)) if m.startswith("ipward")
    }
    assert set((tmp_path / "pkg").rglob("*.pyc")) == before  # the exec wrote none
    for module in ipward_modules:
        source = tmp_path / "pkg" / Path(*module.split("."))
        source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
        assert source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc" in before, module
