"""`ipward install-cni --standalone`: one executable for a host without ipward. Built
with the real CLI into a temp dir, exec'd as a runtime execs it (its own shebang, the
machine's /usr/bin/python3, real CNI environment and stdin) against a real agent on
SQLite; what it imports; what it refuses without an agent; the host python check; and
a reinstall under concurrent execs."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.cni.wire import MAX_CONFIG
from ipward.core import startpath
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.waiting import wait_for
from support import PluginResult, exec_plugin

RANGES = {"ranges": [[{"subnet": "10.91.0.0/24"}]]}
# Beyond the interpreter's own start, the standalone plugin may import these and nothing
# else, on any path: the forwarding path's modules (written out: adding one is a decision,
# made here and in startpath.STANDALONE_MODULES) and the C modules they use.
ALLOWED_IMPORTS = {
    "ipward",
    "ipward.cni",
    "ipward.cni.cniio",
    "ipward.cni.notes",
    "ipward.cni.plugin",
    "ipward.cni.standalone",
    "ipward.cni.wire",
    "ipward.core",
    "ipward.core.errors",
    "ipward.core.startpath",
    "__future__",
    "_json",
    "_socket",
}


def build(bin_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return run_cli("install-cni", "--standalone", "--bin-dir", str(bin_dir), *options)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bin_dir = tmp_path_factory.mktemp("host-cni-bin")
    done = build(bin_dir)
    assert done.returncode == 0, done.stderr
    return bin_dir / "ipward"


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


def shebang_argv(plugin: Path) -> list[str]:
    """What the kernel execs for `plugin`: its interpreter, the rest of the line as one
    argument, then the file."""
    line = plugin.read_bytes().split(b"\n", 1)[0][2:].decode()
    interpreter, argument = line.split(" ", 1)
    return [interpreter, argument, str(plugin)]


def imports_of(
    plugin: Path, command: str, config: dict | bytes, python: str | None = None
) -> set[str]:
    """The modules one exec imports beyond a bare interpreter's start (`-X importtime`,
    added to the argv the kernel builds from the shebang; its interpreter replaced by
    `python` if given)."""

    def imported(argv: list[str], stdin: bytes) -> set[str]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": "c9", "CNI_IFNAME": "eth0"}
        env["CNI_NETNS"] = "/var/run/netns/x"
        proc = subprocess.run(argv, input=stdin, env=env, capture_output=True, timeout=60)
        lines = proc.stderr.decode().splitlines()
        return {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}

    interpreter, argument, path = shebang_argv(plugin)
    interpreter = python or interpreter
    stdin = config if isinstance(config, bytes) else json.dumps(config).encode()
    bare = imported([interpreter, "-X", "importtime", "-I", "-S", "-c", "pass"], b"")
    found = imported([interpreter, "-X", "importtime", argument, path], stdin)
    assert "ipward.cni.standalone" in found, found  # the plugin ran
    return found - bare - {"module"}  # "module": the header line


def records(url: str) -> list[str]:
    with open_store(url) as store:
        kvs, _ = store.range("ips/")
    return [kv.key for kv in kvs]


def error_code(result: PluginResult) -> int:
    assert result.returncode == 1, result
    assert result.json is not None and len(result.stdout.strip().splitlines()) == 1, result
    return int(result.json["code"])


# -- through a real agent ---------------------------------------------------------------


def test_standalone_plugin_serves_every_verb_through_a_real_agent(
    standalone: Path, plugin: Path, agent: fleet.Agent, sqlite_url: str
) -> None:
    """ADD, CHECK, DEL and VERSION exec'd as a runtime does; ADD answers what the
    installed plugin answers for the same attachment (one agent, one record)."""
    config = agent_config(agent.socket)
    added = exec_plugin(standalone, "ADD", config, container="sa1")
    assert added.returncode == 0, added
    assert added.json["ips"][0]["address"].startswith("10.91.0.")
    assert exec_plugin(plugin, "ADD", config, container="sa1").stdout == added.stdout
    assert len(records(sqlite_url)) == 1

    checked = exec_plugin(standalone, "CHECK", {**config, "prevResult": added.json}, "sa1")
    assert checked.returncode == 0 and checked.stdout == b"", checked
    missing = exec_plugin(standalone, "CHECK", {**config, "prevResult": added.json}, "other")
    assert error_code(missing) == 3

    deleted = exec_plugin(standalone, "DEL", config, container="sa1")
    assert deleted.returncode == 0 and deleted.stdout == b"", deleted
    assert records(sqlite_url) == []

    version = exec_plugin(standalone, "VERSION", {"cniVersion": "0.4.0"})
    assert version.json == {
        "cniVersion": "0.4.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


def test_standalone_plugin_answers_11_when_the_agent_is_down(
    standalone: Path, tmp_path: Path
) -> None:
    """No agent behind the socket: 11 for ADD (the runtime retries), 50 for STATUS; a DEL
    succeeds, since no ADD of it reached an agent (docs/design.md 5.14; the DEL of one
    that did: `test_del_never_wedges.py`)."""
    config = agent_config("/run/ipward-test-none/agent.sock")
    assert error_code(exec_plugin(standalone, "ADD", config)) == 11
    deleted = exec_plugin(standalone, "DEL", config)
    assert deleted.returncode == 0 and deleted.stdout == b"", deleted
    assert error_code(exec_plugin(standalone, "STATUS", config)) == 50


# -- what it holds and imports ----------------------------------------------------------


def test_standalone_plugin_holds_and_imports_only_the_forwarding_path(
    standalone: Path, agent: fleet.Agent
) -> None:
    """The archive holds the allow-listed modules only, and no verb, on its answered or
    its refused path, imports anything beyond them and the C modules they use."""
    with zipfile.ZipFile(standalone) as archive:
        names = set(archive.namelist())
    modules = [f"ipward/{m}" for m in startpath.STANDALONE_MODULES] + ["__main__"]
    assert names == {f"{m}{ext}" for m in modules for ext in (".py", ".pyc")}

    config = agent_config(agent.socket)
    paths = [
        ("ADD", config),
        ("DEL", config),
        ("VERSION", config),
        ("ADD", agent_config("/run/ipward-test-none/agent.sock")),  # unreachable
        ("ADD", {"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "ipward"}}),  # refused
    ]
    for command, cfg in paths:
        extra = imports_of(standalone, command, cfg) - ALLOWED_IMPORTS
        assert not extra, f"{command} imported {sorted(extra)}"
    # Malformed JSON: `json_loads` lets the `json` package word the error (standard library).
    extra = imports_of(standalone, "ADD", b"{not json") - ALLOWED_IMPORTS
    assert "json" in extra
    assert {m for m in extra if m.split(".")[0] not in sys.stdlib_module_names} == set()


def test_shebang_fits_the_kernels_line_and_modules_parse_at_the_oldest_python(
    standalone: Path,
) -> None:
    """The kernel reads at most 127 bytes of the `#!` line before Linux 5.1 (a longer
    one would be cut and run something else); each module's syntax is that of the
    oldest Python the host check accepts."""
    assert len(standalone.read_bytes().split(b"\n", 1)[0]) <= 127
    with zipfile.ZipFile(standalone) as archive:
        for name in archive.namelist():
            if name.endswith(".py"):
                ast.parse(archive.read(name), name, feature_version=startpath.MIN_HOST_PYTHON)


def test_a_host_python_of_another_version_runs_the_sources(
    standalone: Path, tmp_path: Path
) -> None:
    """The bytecode is this interpreter's; another version finds a foreign magic number
    and compiles the sources instead (simulated by changing every .pyc's magic)."""
    foreign = tmp_path / "ipward"
    head, _, _ = standalone.read_bytes().partition(b"PK")
    with zipfile.ZipFile(standalone) as src, open(foreign, "wb") as out:
        out.write(head)
        with zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename.endswith(".pyc"):
                    data = b"\x00\x00" + data[2:]
                dst.writestr(info, data)
    foreign.chmod(0o755)
    answer = exec_plugin(foreign, "VERSION", {"cniVersion": "1.0.0"})
    assert answer.returncode == 0 and answer.json["cniVersion"] == "1.0.0", answer

    assert loaded_from(standalone) == {".pyc"}
    assert loaded_from(foreign) == {".py"}


def loaded_from(plugin: Path, python: str = "/usr/bin/python3") -> set[str]:
    """The suffixes of the files the plugin's modules were imported from by `python`."""
    modules = [
        "ipward." + m.replace("/", ".")
        for m in startpath.STANDALONE_MODULES
        if not m.endswith("__init__")
    ]
    code = (
        f"import sys; sys.path.insert(0, {str(plugin)!r}); import {', '.join(modules)};"
        " print(' '.join(m.__file__ for n, m in sys.modules.items() if n.startswith('ipward')))"
    )
    out = subprocess.run(
        [python, "-I", "-S", "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return {"." + path.rsplit(".", 1)[1] for path in out.split()}


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
    ],
)
def test_a_config_without_an_agent_socket_is_refused_with_code_7(
    standalone: Path, tmp_path: Path, command: str, ipam: dict, named: str
) -> None:
    """No in-process mode: code 7 naming the field, and no store is opened or made (a
    DEL of such a config succeeds unless noted: `test_del_never_wedges.py`)."""
    store = tmp_path / "never.db"
    fields = {k: f"sqlite://{store}" if v == "STORE" else v for k, v in ipam.items()}
    config = {"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "ipward", **fields, **RANGES}}
    refused = exec_plugin(standalone, command, config)
    assert error_code(refused) == 7
    assert refused.json["msg"].startswith(named), refused.json
    assert "no in-process mode" in refused.json["msg"]
    assert not store.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("stdin", "code"),
    [(b"{not json", 6), (b"", 6), (b"[1]", 7), (b" " * (MAX_CONFIG + 1), 107)],
)
def test_input_the_plugin_cannot_read_gets_the_in_process_plugins_code(
    standalone: Path, plugin: Path, stdin: bytes, code: int
) -> None:
    """Not JSON, empty, not an object, too large: the same code as the installed plugin."""
    assert error_code(exec_plugin(standalone, "ADD", stdin)) == code
    assert error_code(exec_plugin(plugin, "ADD", stdin)) == code


# -- the host's python ------------------------------------------------------------------


def host(root: Path, python: str | None, libraries: tuple[str, ...] = ()) -> Path:
    """A host root: /usr/bin/python3 a symlink to `python` (a file made there when it
    names one under usr/bin), and standard libraries under usr/lib."""
    (root / "usr" / "bin").mkdir(parents=True)
    if python is not None:
        link = root / "usr" / "bin" / "python3"
        if python == "python3":
            link.write_bytes(b"\x7fELF")
        else:
            link.symlink_to(python)
            target = root / "usr" / "bin" / Path(python).name
            if python.startswith(("/usr/bin/", "python3.")):
                target.write_bytes(b"\x7fELF")
    for library in libraries:
        (root / "usr" / "lib" / library).mkdir(parents=True)
        (root / "usr" / "lib" / library / "os.py").write_text("")
    return root


@pytest.mark.parametrize(
    ("python", "libraries", "message"),
    [
        (None, (), "usr/bin/python3 does not exist"),
        ("/etc/alternatives/python3", ("python3.11",), "usr/bin/python3 does not exist"),
        ("python3.9", ("python3.9",), "is Python 3.9; the standalone plugin needs 3.10 or later"),
        ("python3.12", (), "is Python 3.12, but its standard library"),
        ("python3", ("python3.11", "python3.12"), "cannot tell which Python"),
        ("python3", (), "cannot tell which Python"),
    ],
)
def test_a_host_python_that_cannot_run_it_is_refused_and_nothing_is_written(
    tmp_path: Path, python: str | None, libraries: tuple[str, ...], message: str
) -> None:
    root = host(tmp_path / "host", python, libraries)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ipward").write_text("the plugin installed before")
    done = build(bin_dir, "--host-root", str(root))
    assert done.returncode == 2, done
    assert "--host-root" in done.stderr and message in done.stderr, done.stderr
    assert [p.name for p in bin_dir.iterdir()] == ["ipward"]
    assert (bin_dir / "ipward").read_text() == "the plugin installed before"


@pytest.mark.parametrize(
    ("python", "libraries"),
    [
        ("python3.11", ("python3.11",)),
        ("/usr/bin/python3.10", ("python3.10", "python3.12")),  # absolute: the host's
        ("python3", ("python3.11",)),  # not a symlink: its one library tells
    ],
)
def test_a_host_python_that_can_run_it_is_accepted(
    tmp_path: Path, python: str, libraries: tuple[str, ...]
) -> None:
    root = host(tmp_path / "host", python, libraries)
    done = build(tmp_path / "bin", "--host-root", str(root))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bin" / "ipward").read_bytes() == startpath.standalone_plugin()


def test_this_machines_python_passes_the_check_it_runs_the_plugin_with() -> None:
    """The default host root is /: the interpreter the tests exec the plugin with."""
    assert startpath.host_python_problem(Path("/")) is None


# -- reinstall while the runtime execs --------------------------------------------------


def test_an_exec_during_a_reinstall_never_sees_a_partial_file(tmp_path: Path) -> None:
    """A runtime execs the plugin while an upgrade rewrites it again and again: every
    exec runs a whole plugin (the old or the new one), and no rewrite fails."""
    target = tmp_path / "bin" / "ipward"
    plugin_bytes = startpath.standalone_plugin()
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
