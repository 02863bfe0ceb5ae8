"""The plugin <-> agent path (its format alone: `tests/unit/test_wire_format.py`): the
thin path judges a call exactly as the in-process path does; only `ipam.agentSocket`
sends a call anywhere, and only to a socket and an agent of root or of the plugin's own
user; an old plugin and a new agent (and the reverse) say so instead of misreading each
other; the error codes of a call that does not get through. Real agent processes, the
installed plugin exec'd, real sockets."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.cni import wire
from ipward.core import keys
from ipward.core.records import AddressRecord
from ipward.store import open_backend, open_store
from ipward_lab import fleet
from ipward_lab.waiting import wait_for
from support import REPO, PluginResult, exec_plugin
from test_agent import exec_as, notes_of_others, public_plugin

NOBODY = 65534
SETPRIV = "/usr/bin/setpriv"
AS_ROOT = os.getuid() == 0 and Path(SETPRIV).exists()
RANGES = {"ranges": [[{"subnet": "10.90.0.0/24"}]]}
K8S = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=victim-pod"


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short directory others may enter (sockets: AF_UNIX paths are short; pytest's
    tmp dirs are 0700 to root)."""
    path = Path(tempfile.mkdtemp(prefix="ipw-wire-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(tmp_path: Path, run_dir: Path, sqlite_url: str) -> Iterator[fleet.Agent]:
    started = fleet.Agent("wire-node", sqlite_url, run_dir / "agent" / "agent.sock", tmp_path)
    try:
        started.wait_ready()
        with open_store(sqlite_url) as store:  # its registration: the last write of its own
            wait_for(lambda: store.get(keys.node_key("wire-node")), "the node's registration")
        yield started
    finally:
        started.kill()


def agent_config(socket_path: Path | str, **top: object) -> dict:
    ipam = {"type": "ipward", "agentSocket": str(socket_path), **RANGES}
    return {"cniVersion": "1.0.0", "name": "net", "ipam": ipam, **top}


def local_config(url: str, **top: object) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": url, **RANGES},
        **top,
    }


def whole_store(url: str) -> tuple[int, dict[str, bytes]]:
    """Every key and the revision, as the backend holds them (no schema check: an old
    agent makes a store of schema version 0)."""
    with open_backend(url) as store:
        kvs, revision = store.range("")
    return revision, {kv.key: kv.value for kv in kvs}


def holder_of(url: str) -> dict[str, str]:
    """container -> address, from the allocation records."""
    with open_store(url) as store:
        kvs, _ = store.range("ips/")
    return {
        AddressRecord.decode(kv.value).attachment.container: kv.key.rsplit("/", 1)[1] for kv in kvs
    }


def error_code(result: PluginResult) -> int:
    assert result.returncode == 1, result
    assert result.json is not None and len(result.stdout.strip().splitlines()) == 1, result
    return int(result.json["code"])


# -- injection through newlines (the finding) ------------------------------------------------


def test_newline_in_cni_args_cannot_turn_check_into_del(
    forwarder, plugin, agent, sqlite_url, tmp_path
):
    """Finding: CNI_ARGS ending in "\\nCNI_COMMAND=DEL" made the agent run a DEL for a
    CHECK and free a live address. Now the value is data: the call is a CHECK whose
    CNI_ARGS has a control character (code 4), as in-process, and nothing changes."""
    cfg = agent_config(agent.socket)
    held = exec_plugin(forwarder, "ADD", cfg, container="victim", args=K8S)
    assert held.returncode == 0, held
    before = whole_store(sqlite_url)
    injected = "IgnoreUnknown=1\nCNI_COMMAND=DEL"
    check = exec_plugin(
        forwarder, "CHECK", {**cfg, "prevResult": held.json}, container="victim", args=injected
    )
    assert error_code(check) == 4 and "CNI_ARGS" in check.json["msg"]
    assert whole_store(sqlite_url) == before
    # In-process, the same call is refused the same way.
    local = local_config(f"sqlite://{tmp_path}/local.db")
    assert exec_plugin(plugin, "ADD", local, container="victim", args=K8S).returncode == 0
    local_check = exec_plugin(
        plugin, "CHECK", {**local, "prevResult": held.json}, container="victim", args=injected
    )
    assert error_code(local_check) == 4
    ok = exec_plugin(forwarder, "CHECK", {**cfg, "prevResult": held.json}, container="victim")
    assert ok.returncode == 0, ok


def test_newline_in_container_id_cannot_allocate_as_another(
    forwarder, plugin, agent, sqlite_url, tmp_path
):
    """Finding: the container ID "x\\nCNI_CONTAINERID=victim" allocated as `victim` (and
    was handed the victim's address). Now it is one container ID, not a valid one: 4."""
    cfg = agent_config(agent.socket)
    held = exec_plugin(forwarder, "ADD", cfg, container="victim", args=K8S)
    assert held.returncode == 0, held
    before = whole_store(sqlite_url)
    for command in ("ADD", "DEL"):
        forged = exec_plugin(forwarder, command, cfg, container="x\nCNI_CONTAINERID=victim")
        assert error_code(forged) == 4 and "CNI_CONTAINERID" in forged.json["msg"]
    assert whole_store(sqlite_url) == before
    local = local_config(f"sqlite://{tmp_path}/local.db")
    assert error_code(exec_plugin(plugin, "ADD", local, container="x\nCNI_CONTAINERID=v")) == 4


# -- protocol versions ---------------------------------------------------------------------


def protocol_1_tree(tmp: Path) -> Path:
    """The package as it last was with wire protocol 1, from git history: a real old
    plugin and a real old agent, as a rolling upgrade meets them. Found among the
    commits that changed `src/ipward/wire.py` and their parents (the tree just before
    protocol 2), however long the history grows: a window of the last 200 commits lost
    them, and the tests using this skipped."""
    try:
        commits = subprocess.run(
            ["git", "-C", str(REPO), "log", "--format=%H", "--", "src/ipward/wire.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the project's git history")
    for commit in (rev for changed in commits for rev in (changed, f"{changed}^")):
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:src/ipward/wire.py"],
            capture_output=True,
            text=True,
        ).stdout
        if "def encode_env" in source:
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", commit, "src"],
                capture_output=True,
                check=True,
            ).stdout
            tmp.mkdir(parents=True, exist_ok=True)
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
            # fleet starts agents with `python -m ipward`; that tree predates its __main__.
            main = tmp / "src" / "ipward" / "__main__.py"
            if not main.exists():
                main.write_text("from ipward.cli import main\n\nmain()\n")
            return tmp / "src"
    pytest.skip("no commit with wire protocol 1 in this history")


def test_old_plugin_and_new_agent_get_a_clear_error(agent, sqlite_url, tmp_path):
    old = protocol_1_tree(tmp_path / "old")
    launcher = tmp_path / "old-ipward"
    launcher.write_text(
        f"#!/usr/bin/python3 -IS\nimport sys\nsys.path.insert(0, {str(old)!r})\n"
        "from ipward.plugin import main\nmain()\n"
    )
    launcher.chmod(0o755)
    before = whole_store(sqlite_url)
    for command in ("ADD", "DEL"):
        result = exec_plugin(launcher, command, agent_config(agent.socket), container="c1")
        assert error_code(result) == 11, result
        assert "wire protocol 2" in result.json["msg"] and "install-cni" in result.json["msg"]
    assert whole_store(sqlite_url) == before


def test_new_plugin_and_old_agent_get_a_clear_error(forwarder, sqlite_url, tmp_path, run_dir):
    old = protocol_1_tree(tmp_path / "old")
    socket_path = run_dir / "old" / "agent.sock"
    pythonpath = {"PYTHONPATH": str(old)}
    old_agent = fleet.Agent("old-node", sqlite_url, socket_path, tmp_path, env=pythonpath)
    try:
        old_agent.wait_started()
        before = whole_store(sqlite_url)
        result = exec_plugin(forwarder, "ADD", agent_config(socket_path), container="c1")
        assert error_code(result) == 11, result
        assert "does not speak wire protocol 2" in result.json["msg"]
        assert whole_store(sqlite_url) == before
    finally:
        old_agent.kill()


def send_raw(path: Path, payload: bytes) -> tuple[int, bytes] | None:
    """Send raw bytes and end our side; the agent's answer, or None if it closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # it answered and closed before taking all of it
        try:
            return wire.read_answer(s.recv)
        except (wire.WireError, ConnectionResetError):
            return None


def garbage_cases() -> list[tuple[str, bytes, int | None]]:
    good_env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "g", "CNI_IFNAME": "eth0"}
    good = wire.encode_request(good_env, b"{}")
    body = good[wire.REQUEST_HEADER :]
    header = wire.REQUEST_MAGIC

    def request(body: bytes) -> bytes:
        return header + len(body).to_bytes(4, "big") + body

    def field(data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data

    return [
        ("random", b"x" + os.urandom(4095), 6),
        ("http", b"GET / HTTP/1.1\r\n\r\n", 6),
        ("length over the limit", header + (wire.MAX_REQUEST + 1).to_bytes(4, "big"), 107),
        ("4 GiB", header + b"\xff\xff\xff\xff", 107),
        ("version 3", header[:-1] + b"\x03" + good[len(header) :], 11),
        ("stdin over the limit", request(b"\x00" + (wire.MAX_CONFIG + 1).to_bytes(4, "big")), 107),
        (
            "a variable not forwarded",
            request(b"\x01" + field(b"HOME") + field(b"/root") + field(b"{}")),
            6,
        ),
        (
            "a variable twice",
            request(b"\x02" + 2 * (field(b"CNI_COMMAND") + field(b"ADD")) + field(b"{}")),
            6,
        ),
        ("count past the fields", request(b"\x05" + body[1:]), 6),
        ("bytes after stdin", request(body + b"extra"), 6),
        ("empty body", request(b""), 6),
        ("cut short, then gone", good[:-3], None),
        ("header only, then gone", good[: wire.REQUEST_HEADER], None),
        ("connect and leave", b"", None),
    ]


def test_protocol_garbage_is_answered_and_does_not_stop_the_agent(plugin, agent, sqlite_url):
    """Whatever arrives, the agent answers with a documented code (or, when the peer
    left mid-request, closes), does nothing, and serves the next call."""
    before = whole_store(sqlite_url)
    for name, payload, code in garbage_cases():
        answer = send_raw(agent.socket, payload)
        if code is None:
            assert answer is None, (name, answer)
            continue
        assert answer is not None, name
        status, out = answer
        error = json.loads(out)
        assert status == 1 and error["code"] == code, (name, error)
    legacy = (100).to_bytes(4, "big") + b"CNI_COMMAND=ADD\n" + b"x" * 84
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a version 1 plugin
        s.settimeout(30)
        s.connect(str(agent.socket))
        s.sendall(legacy)
        size = int.from_bytes(s.recv(4), "big")
        reply = b""
        while len(reply) < size:
            reply += s.recv(size - len(reply))
    assert reply[0] == 1 and json.loads(reply[1:])["code"] == 11
    assert whole_store(sqlite_url) == before
    assert agent.running
    ok = exec_plugin(plugin, "ADD", agent_config(agent.socket), container="after")
    assert ok.returncode == 0, ok
    errors = [e for e in agent.logs() if e["msg"] == "protocol error"]
    assert len(errors) >= len(garbage_cases())


# -- which socket, whose socket --------------------------------------------------------------


class Listener:
    """A Unix socket something listens on (as another user with `user`), recording what
    each connection sent."""

    MARK = b"mark"

    def __init__(self, path: Path, user: list[str] | None = None) -> None:
        self.path = path
        self.record = path.with_suffix(".got")
        script = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n"
            "open(sys.argv[2],'w').close()\n"
            "while True:\n"
            "  c,_=s.accept(); c.settimeout(10); data=b''\n"
            "  try:\n"
            "    while (chunk := c.recv(65536)): data += chunk\n"
            "  except OSError: pass\n"
            "  c.close(); open(sys.argv[2],'a').write(f'{len(data)}\\n')\n"
        )
        prefix = [SETPRIV, *user] if user else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", script, str(path), str(self.record)]
        )
        wait_for(self.record.exists, "the listener")

    def received(self) -> list[int]:
        """Bytes sent by each connection so far. Connections are taken in order, so once
        a marker connection of ours is recorded, every one before it is."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self.path))
            s.sendall(self.MARK)
        counts = wait_for(
            lambda: (c := self.record.read_text().split()) and c[-1] == str(len(self.MARK)) and c,
            "the marker connection",
        )
        return [int(c) for c in counts[:-1]]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def listeners() -> Iterator[Callable[..., Listener]]:
    made: list[Listener] = []

    def make(path: Path, user: list[str] | None = None) -> Listener:
        made.append(Listener(path, user))
        return made[-1]

    yield make
    for listener in made:
        listener.stop()


def test_only_ipam_agent_socket_counts(
    forwarder, plugin, agent, sqlite_url, run_dir, listeners, tmp_path
):
    """Finding: "agentSocket" anywhere in the raw config (a key of `args.cni`, which
    Multus fills from pod annotations) sent the call to that socket and printed its
    answer. Now only `ipam.agentSocket` counts (the native plugin, which has no
    in-process mode, refuses the first: 7)."""
    decoy = listeners(run_dir / "decoy.sock")
    # Without ipam.agentSocket the call runs in-process; with it, it goes to the agent.
    local = local_config(f"sqlite://{tmp_path}/local.db")
    for config, where, runs in (
        ({**local, "args": {"cni": {"agentSocket": str(decoy.path)}}}, "in-process", plugin),
        (
            {"args": {"cni": {"agentSocket": str(decoy.path)}}, **agent_config(agent.socket)},
            "agent",
            forwarder,
        ),
    ):
        data = json.dumps(config).encode()
        assert data.index(b'"agentSocket"') < len(data)  # the decoy's comes first or alone
        result = exec_plugin(runs, "ADD", data, container=f"c-{where}")
        assert result.returncode == 0, (where, result)
        if where == "in-process" and forwarder != plugin:
            assert error_code(exec_plugin(forwarder, "ADD", data, container="c-native")) == 7
    assert decoy.received() == []  # nobody connected to it
    assert "c-agent" in holder_of(sqlite_url)
    assert "c-in-process" in holder_of(f"sqlite://{tmp_path}/local.db")


@pytest.mark.skipif(not AS_ROOT, reason="needs root and setpriv")
def test_socket_of_another_user_is_refused_and_nothing_sent(forwarder, run_dir, listeners):
    listener = listeners(run_dir / "theirs.sock")
    os.chown(listener.path, NOBODY, NOBODY)
    result = exec_plugin(forwarder, "ADD", agent_config(listener.path), container="c1")
    assert error_code(result) == 5
    assert f"owned by uid {NOBODY}" in result.json["msg"]
    assert listener.received() == []  # not even a connection


@pytest.mark.skipif(not AS_ROOT, reason="needs root and setpriv")
def test_agent_of_another_user_is_refused_and_nothing_sent(forwarder, run_dir, listeners):
    """The socket file says root (chowned after the bind), but the process listening on
    it runs as nobody: SO_PEERCRED tells, and nothing is sent."""
    theirs = run_dir / "nobody"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    nobody = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    listener = listeners(theirs / "agent.sock", nobody)
    os.chown(listener.path, 0, 0)
    for command in ("ADD", "DEL"):
        result = exec_plugin(forwarder, command, agent_config(listener.path), container="c1")
        assert error_code(result) == 5, result
        assert f"runs as uid {NOBODY}" in result.json["msg"]
    assert listener.received() == [0, 0]  # it connected (to ask), and sent nothing


# -- codes of a call that does not get through -----------------------------------------------


def test_version_needs_no_agent(forwarder, run_dir):
    cfg = agent_config(run_dir / "missing" / "agent.sock")
    result = exec_plugin(forwarder, "VERSION", cfg, env={"CNI_CONTAINERID": None})
    assert result.returncode == 0, result
    assert result.json["cniVersion"] == "1.0.0" and "1.1.0" in result.json["supportedVersions"]


def test_status_with_the_agent_down_is_50(forwarder, run_dir):
    for path in (run_dir / "missing" / "agent.sock", run_dir / "stale.sock"):
        if path.name == "stale.sock":
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(path))  # nobody listens: what a killed agent leaves
        cfg = {**agent_config(path), "cniVersion": "1.1.0"}
        result = exec_plugin(forwarder, "STATUS", cfg, env={"CNI_CONTAINERID": None})
        assert error_code(result) == 50, result
        add = exec_plugin(forwarder, "ADD", cfg, container="c1")
        assert error_code(add) == 11, add


@pytest.mark.skipif(not AS_ROOT, reason="needs root and setpriv")
def test_caller_refused_by_the_socket_directory_gets_5(
    forwarder, plugin, agent, sqlite_url, run_dir
):
    """Finding: a caller the socket directory's mode (0750, root) keeps out got 11, and
    retried forever. Retrying cannot help: 5. A DEL of an attachment no ADD of which
    reached an agent succeeds all the same (docs/design.md 5.14); with its note, 5."""
    runs = public_plugin(run_dir) if forwarder == plugin else forwarder  # nobody may run it
    assert agent.socket.parent.stat().st_mode & 0o777 == 0o750
    before = whole_store(sqlite_url)
    nobody = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    container = f"refused-{forwarder.parent.name}"
    added = exec_as(nobody, runs, "ADD", agent_config(agent.socket), container)
    assert error_code(added) == 5, added
    assert "Permission denied" in added.json["msg"]
    deleted = exec_as(nobody, runs, "DEL", agent_config(agent.socket), container)
    assert deleted.returncode == 0 and deleted.stdout == b"", deleted
    note = Path(notes_of_others()) / "net" / container / "eth0"  # as an ADD that got through
    note.parent.mkdir(parents=True)
    note.write_text(f"{agent.socket}\n")
    try:
        deleted = exec_as(nobody, runs, "DEL", agent_config(agent.socket), container)
        assert error_code(deleted) == 5 and "Permission denied" in deleted.json["msg"], deleted
    finally:
        shutil.rmtree(note.parent)
    assert whole_store(sqlite_url) == before


def test_config_over_the_limit_is_107_on_both_paths(forwarder, plugin, agent, sqlite_url, tmp_path):
    """Finding: a 10 MB config succeeded in-process and got 11 through the agent (its
    frame was too big). One limit for both: wire.MAX_CONFIG, code 107."""
    local_url = f"sqlite://{tmp_path}/local.db"
    for cfg, url, runs in (
        (agent_config(agent.socket), sqlite_url, forwarder),
        (local_config(local_url), local_url, plugin),
    ):
        cfg["padding"] = "x" * (10 << 20)
        before = whole_store(url) if Path(url.removeprefix("sqlite://")).exists() else None
        result = exec_plugin(runs, "ADD", cfg, container="big")
        assert error_code(result) == 107, result
        assert str(wire.MAX_CONFIG) in result.json["msg"]
        if before is not None:
            assert whole_store(url) == before
        just_under = {**cfg, "padding": ""}
        just_under["padding"] = "x" * (wire.MAX_CONFIG - len(json.dumps(just_under)))
        assert len(json.dumps(just_under)) == wire.MAX_CONFIG
        ok = exec_plugin(runs, "ADD", just_under, container="under")
        assert ok.returncode == 0, ok


def test_plugin_forwards_the_environment_as_bytes(forwarder, agent):
    """Non-UTF-8 bytes reach the agent as they are and are judged as in-process: not
    valid UTF-8 in CNI_ARGS, code 4 on both paths (a process environment cannot hold
    NULs, so any other byte is possible)."""
    cfg = agent_config(agent.socket)
    env = {"CNI_ARGS": "IgnoreUnknown=1;X=" + os.fsdecode(b"\xff\xfe")}
    result = exec_plugin(forwarder, "ADD", cfg, container="c1", env=env)
    assert error_code(result) == 4 and "UTF-8" in result.json["msg"]
