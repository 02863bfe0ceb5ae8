"""`ipward install-cni --standalone`: the native plugin, one static executable for a host
without ipward. Installed with the real CLI, exec'd as a runtime execs it (real CNI
environment and stdin) against a real agent on SQLite, also in an otherwise empty root
(no interpreter, no shell, no C library); what it refuses without an agent; an install
where it was never built writes nothing; a reinstall under concurrent execs. Its
answers next to the Python forwarder's: `test_native_plugin.py`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import ipward
from ipward.cni.wire import MAX_CONFIG
from ipward.core import startpath
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.waiting import wait_for
from support import PluginResult, exec_plugin, static_x86_64_executable

RANGES = {"ranges": [[{"subnet": "10.91.0.0/24"}]]}
AS_ROOT = os.getuid() == 0 and shutil.which("chroot") is not None


@pytest.fixture
def agent(tmp_path: Path, sqlite_url: str) -> Iterator[fleet.Agent]:
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-sa-"))  # AF_UNIX paths are short
    started = fleet.Agent("sa-node", sqlite_url, run_dir / "agent.sock", tmp_path)
    try:
        started.wait_ready()
        yield started
    finally:
        started.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def agent_config(socket_path: Path | str, version: str = "1.1.0") -> dict:
    ipam = {"type": "ipward", "agentSocket": str(socket_path), **RANGES}
    return {"cniVersion": version, "name": "sanet", "ipam": ipam}


def records(url: str) -> list[str]:
    with open_store(url) as store:
        kvs, _ = store.range("ips/")
    return [kv.key for kv in kvs]


def error_code(result: PluginResult) -> int:
    assert result.returncode == 1, result
    assert result.json is not None and len(result.stdout.strip().splitlines()) == 1, result
    return int(result.json["code"])


# -- what is installed ----------------------------------------------------------------------


def test_the_installed_file_is_one_static_x86_64_executable(native_plugin: Path) -> None:
    """The built file, as is: an ELF executable for x86-64 that names no dynamic loader
    (so no C library of the host's is used, glibc, musl or none)."""
    data = native_plugin.read_bytes()
    assert data == startpath.native_plugin()
    assert static_x86_64_executable(data)
    assert os.access(native_plugin, os.X_OK)


def test_where_it_was_not_built_nothing_is_installed(tmp_path: Path) -> None:
    """A package without the built file (a copy of this one without it): the install
    says so, exits non-zero and writes nothing, neither the plugin nor a stand-in."""
    package = tmp_path / "lib" / "ipward"
    shutil.copytree(
        Path(ipward.__file__).parent,
        package,
        ignore=shutil.ignore_patterns("__pycache__", Path(startpath.NATIVE_PLUGIN).name),
    )
    assert not (package / startpath.NATIVE_PLUGIN).exists()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ipward").write_text("the plugin installed before")
    main = "import sys; from ipward.cmd.cli import main; sys.argv[0] = 'ipward'; main()"
    done = subprocess.run(
        [sys.executable, "-c", main, "install-cni", "--standalone", "--bin-dir", str(bin_dir)],
        env={**os.environ, "PYTHONPATH": str(package.parent)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done
    assert "nothing installed" in done.stderr and "was not built" in done.stderr, done.stderr
    assert [p.name for p in bin_dir.iterdir()] == ["ipward"]
    assert (bin_dir / "ipward").read_text() == "the plugin installed before"


# -- through a real agent ---------------------------------------------------------------


def test_it_serves_every_verb_through_a_real_agent(
    native_plugin: Path, plugin: Path, agent: fleet.Agent, sqlite_url: str
) -> None:
    """ADD, CHECK, DEL and VERSION exec'd as a runtime does; ADD answers what the
    installed plugin answers for the same attachment (one agent, one record)."""
    config = agent_config(agent.socket)
    added = exec_plugin(native_plugin, "ADD", config, container="sa1")
    assert added.returncode == 0, added
    assert added.json["ips"][0]["address"].startswith("10.91.0.")
    assert exec_plugin(plugin, "ADD", config, container="sa1").stdout == added.stdout
    assert len(records(sqlite_url)) == 1

    checked = exec_plugin(native_plugin, "CHECK", {**config, "prevResult": added.json}, "sa1")
    assert checked.returncode == 0 and checked.stdout == b"", checked
    missing = exec_plugin(native_plugin, "CHECK", {**config, "prevResult": added.json}, "other")
    assert error_code(missing) == 3

    deleted = exec_plugin(native_plugin, "DEL", config, container="sa1")
    assert deleted.returncode == 0 and deleted.stdout == b"", deleted
    assert records(sqlite_url) == []

    version = exec_plugin(native_plugin, "VERSION", {"cniVersion": "0.4.0"})
    assert version.json == {
        "cniVersion": "0.4.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


@pytest.mark.skipif(not AS_ROOT, reason="needs root (chroot)")
def test_it_runs_in_an_empty_root(native_plugin: Path, tmp_path: Path, sqlite_url: str) -> None:
    """A root holding the plugin and the agent's socket directory, nothing else: no
    interpreter, no shell, no C library, no /proc. ADD and DEL through a real agent
    (listening inside that root) work there, keeping the note inside it too."""
    root = Path(tempfile.mkdtemp(prefix="ipw-root-"))  # AF_UNIX paths are short
    try:
        shutil.copy2(native_plugin, root / "ipward")
        agent = fleet.Agent("root-node", sqlite_url, root / "run" / "agent.sock", tmp_path)
        try:
            agent.wait_ready()
            inside = {str(p.relative_to(root)) for p in root.rglob("*")}
            assert inside == {"ipward", "run", "run/agent.sock", "run/agent.sock.lock"}, inside
            config = agent_config("/run/agent.sock")
            env = {"IPWARD_CNI_NOTES": "/notes"}  # the root's own
            note = root / "notes" / "sanet" / "c1" / "eth0"

            def exec_inside(command: str) -> PluginResult:
                return exec_plugin(
                    Path("/ipward"), command, config, container="c1", env=env, root=root
                )

            added = exec_inside("ADD")
            assert added.returncode == 0 and added.json["ips"][0]["address"], added
            assert note.read_text() == "/run/agent.sock\n"
            assert len(records(sqlite_url)) == 1
            deleted = exec_inside("DEL")
            assert deleted.returncode == 0 and deleted.stdout == b"", deleted
            assert records(sqlite_url) == [] and not note.exists()
        finally:
            agent.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_it_answers_11_when_the_agent_is_down(native_plugin: Path) -> None:
    """No agent behind the socket: 11 for ADD (the runtime retries), 50 for STATUS; a DEL
    succeeds, since no ADD of it reached an agent (docs/design.md 5.14; the DEL of one
    that did: `test_del_never_wedges.py`)."""
    config = agent_config("/run/ipward-test-none/agent.sock")
    assert error_code(exec_plugin(native_plugin, "ADD", config)) == 11
    deleted = exec_plugin(native_plugin, "DEL", config)
    assert deleted.returncode == 0 and deleted.stdout == b"", deleted
    assert error_code(exec_plugin(native_plugin, "STATUS", config)) == 50


# -- no agent: refused ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ADD", "CHECK", "GC", "STATUS"])
@pytest.mark.parametrize(
    ("ipam", "named"),
    [
        ({}, "ipam.agentSocket is missing"),
        ({"store": "STORE"}, "ipam.agentSocket is missing (ipam.store is ignored)"),
        ({"agentSocket": "run/agent.sock"}, "ipam.agentSocket must be an absolute path"),
        ({"agentSocket": ""}, "ipam.agentSocket must be an absolute path"),
        ({"agent_socket": 5}, "ipam.agent_socket must be a string"),
        ({"agentSocket": None, "agent_socket": "/a.sock"}, "ipam.agentSocket must be a string"),
        ({"agentSocket": "/a\0b"}, "ipam.agentSocket must not contain a NUL byte"),
        ({"agentSocket": "/" + "s" * 107}, "ipam.agentSocket is longer than a Unix socket"),
        ({"agentSocket": "/\ud800"}, "ipam.agentSocket must be Unicode text"),
    ],
)
def test_a_config_without_an_agent_socket_is_refused_with_code_7(
    native_plugin: Path, tmp_path: Path, command: str, ipam: dict, named: str
) -> None:
    """No in-process mode: code 7 naming the field, and no store is opened or made (a
    DEL of such a config succeeds unless noted: `test_del_never_wedges.py`)."""
    store = tmp_path / "never.db"
    fields = {k: f"sqlite://{store}" if v == "STORE" else v for k, v in ipam.items()}
    config = {"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "ipward", **fields, **RANGES}}
    refused = exec_plugin(native_plugin, command, config)
    assert error_code(refused) == 7
    assert refused.json["msg"].startswith(named), refused.json
    assert "no in-process mode" in refused.json["msg"]
    assert not store.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("stdin", "code"),
    [(b"{not json", 6), (b"", 6), (b" \x0b\n", 6), (b"[1]", 7), (b" " * (MAX_CONFIG + 1), 107)],
)
def test_input_the_plugin_cannot_read_gets_the_in_process_plugins_code(
    native_plugin: Path, plugin: Path, stdin: bytes, code: int
) -> None:
    """Not JSON, empty, blank, not an object, too large: the same code as the installed
    plugin."""
    assert error_code(exec_plugin(native_plugin, "ADD", stdin)) == code
    assert error_code(exec_plugin(plugin, "ADD", stdin)) == code


# -- reinstall while the runtime execs --------------------------------------------------


def test_an_exec_during_a_reinstall_never_sees_a_partial_file(tmp_path: Path) -> None:
    """A runtime execs the plugin while an upgrade rewrites it again and again: every
    exec runs a whole plugin (the old or the new one), and no rewrite fails."""
    target = tmp_path / "bin" / "ipward"
    plugin_bytes = startpath.native_plugin()
    startpath.write_executable(target, plugin_bytes)
    execs: list[PluginResult] = []
    rewrites: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def reinstall() -> None:
        try:
            while not stop.is_set():
                startpath.write_executable(target, plugin_bytes)
                rewrites.append(1)
        except BaseException as e:
            failures.append(e)

    writer = threading.Thread(target=reinstall)
    writer.start()
    try:
        wait_for(lambda: rewrites, "the first rewrite")
        while len(execs) < 60 or len(rewrites) < 60:
            execs.append(exec_plugin(target, "VERSION", {"cniVersion": "1.0.0"}))
            if failures:
                break
    finally:
        stop.set()
        writer.join()
    assert not failures, failures
    bad = [r for r in execs if r.returncode != 0 or r.json is None]
    assert not bad, bad[:3]
    assert [p.name for p in target.parent.iterdir()] == ["ipward"]  # no temp file left
