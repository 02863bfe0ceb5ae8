"""The native plugin (`src/ipward/cni/native`, what `install-cni --standalone` installs)
next to the Python forwarder (`cni/plugin.py`, the installed launcher): the same calls
exec'd on both as a runtime does, with the same exit status and the same stdout byte for
byte. Through a real agent: every version's format (cniVersion 0.3.0 to 1.1.0), any JSON
in any config field, any bytes in any CNI_* variable. Against listeners that are not
agents: half-written, garbage and oversized answers, a connection closed or reset, a
full listen backlog, an agent that hangs (`slow`: the 60 s deadline). Where no agent is
reached: every reason, the notes. The one place wording differs is a JSON syntax error
(Python's json words its own): there the code and the field named are compared. Its
parsing of untrusted input is fuzzed with ASan and UBSan (libFuzzer), for a bounded
number of runs (a long run is `slow`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipward.cni import wire
from ipward.cni.plugin import configured
from ipward.core import keys
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.waiting import wait_for
from support import REPO, PluginResult, exec_plugin
from test_plugin_input import (
    COMMANDS,
    FIELDS,
    PROPERTY,
    SHORT,
    base_config,
    base_env,
    draw_variables,
    json_values,
    run_plugin,
    set_path,
)

NATIVE = REPO / "src" / "ipward" / "cni" / "native"
FUZZ_TARGET = REPO / "tests" / "system" / "fuzz" / "ipward_cni_fuzz.c"
VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
NOT_JSON = "network configuration on stdin is not JSON"
RANGES = {"ranges": [[{"subnet": "10.95.0.0/24"}]]}
EXAMPLES = SHORT // 3  # each execs both plugins
DEADLINE = wire.CALL_TIMEOUT


def same(plugin: Path, native: Path, *call: Any, **options: Any) -> PluginResult:
    """Exec the call on the Python forwarder, then on the native plugin: the same exit
    status and stdout. The native plugin's result."""
    python = exec_plugin(plugin, *call, **options)
    result = exec_plugin(native, *call, **options)
    assert (result.returncode, result.stdout) == (python.returncode, python.stdout), (
        python,
        result,
    )
    return result


def env_of(command: str, container: str = "c0") -> dict[str, bytes]:
    """A call's environment (`run_plugin` passes exactly this one), notes in the run's."""
    return {**base_env(command, container), "IPWARD_CNI_NOTES": os.environb[b"IPWARD_CNI_NOTES"]}


def note_of(container: str) -> Path:
    return Path(os.environ["IPWARD_CNI_NOTES"]) / "native" / container / "eth0"


def config(socket_path: Path | str, version: str = "1.0.0", **ipam: object) -> dict:
    return {
        "cniVersion": version,
        "name": "native",
        "ipam": {"type": "ipward", "agentSocket": str(socket_path), **RANGES, **ipam},
    }


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ipw-nat-"))  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(tmp_path: Path, run_dir: Path, sqlite_url: str) -> Iterator[fleet.Agent]:
    started = fleet.Agent("native-node", sqlite_url, run_dir / "agent.sock", tmp_path)
    try:
        started.wait_ready()
        with open_store(sqlite_url) as store:
            wait_for(lambda: store.get(keys.node_key("native-node")), "the node's registration")
        yield started
    finally:
        started.kill()


# -- through a real agent ----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_through_a_real_agent_answers_alike(
    plugin: Path, native_plugin: Path, agent: fleet.Agent, version: str
) -> None:
    """ADD (the second one of an attachment answers as the first), CHECK (refused before
    0.4.0), GC (1.1.0), STATUS and DEL, each in the config's version."""
    cfg = config(agent.socket, version)
    container = f"v{version}"
    added = same(plugin, native_plugin, "ADD", cfg, container=container)
    assert added.returncode == 0 and added.json["cniVersion"] == version, added
    same(plugin, native_plugin, "CHECK", {**cfg, "prevResult": added.json}, container=container)
    gc = {**cfg, "cni.dev/valid-attachments": [{"containerID": container, "ifname": "eth0"}]}
    same(plugin, native_plugin, "GC", gc, container=container)
    same(plugin, native_plugin, "STATUS", cfg, container=container)
    for _ in range(2):  # the second DEL finds nothing: success too
        deleted = same(plugin, native_plugin, "DEL", cfg, container=container)
        assert deleted.returncode == 0 and deleted.stdout == b"", deleted


def test_newlines_and_odd_bytes_in_cni_variables_reach_the_agent_as_data(
    plugin: Path, native_plugin: Path, agent: fleet.Agent
) -> None:
    cfg = config(agent.socket)
    for env in (
        {"CNI_ARGS": "IgnoreUnknown=1\nCNI_COMMAND=DEL"},
        {"CNI_CONTAINERID": "x\nCNI_CONTAINERID=victim"},
        {"CNI_IFNAME": "eth0\n"},
        {"CNI_ARGS": "IgnoreUnknown=1;X=" + os.fsdecode(b"\xff\xfe")},
        {"CNI_NETNS": None, "CNI_ARGS": None},
    ):
        result = same(plugin, native_plugin, "ADD", cfg, container="odd", env=env)
        assert result.returncode == 1 and result.json["code"] == 4, (env, result)


def test_only_the_last_of_duplicate_keys_counts(
    plugin: Path, native_plugin: Path, agent: fleet.Agent, run_dir: Path
) -> None:
    """As Python's json reads them: the last `ipam`, the last `agentSocket`; and
    `agentSocket` over `agent_socket` whatever their order."""
    nowhere = run_dir / "nowhere.sock"
    good = json.dumps(config(agent.socket))
    ipam = '{"type": "ipward", "ranges": [[{"subnet": "10.95.0.0/24"}]], %s}'
    for text, reaches in (
        (good.replace('"ipam":', f'"ipam": {{"agentSocket": "{nowhere}"}}, "ipam":'), True),
        (good[:-1] + f', "ipam": {{"agentSocket": "{nowhere}"}}}}', False),
        (
            good[:-1]
            + ', "ipam": '
            + ipam % f'"agentSocket": "{nowhere}", "agentSocket": "{agent.socket}"'
            + "}",
            True,
        ),
        (
            good[:-1]
            + ', "ipam": '
            + ipam % f'"agentSocket": "{agent.socket}", "agent_socket": "{nowhere}"'
            + "}",
            True,
        ),
        (good[:-1] + ', "ipam": ' + ipam % f'"agent_socket": "{agent.socket}"' + "}", True),
    ):
        result = same(plugin, native_plugin, "ADD", text.encode(), container="dup")
        assert (result.returncode == 0) == reaches, (text, result)


@given(data=st.data())
@settings(PROPERTY, max_examples=EXAMPLES)
def test_any_json_in_any_config_field_answers_alike(plugin, native_plugin, agent, data):
    """What is forwarded gets the agent's answer, printed as it came; what is not (the
    field broke `ipam.agentSocket`) is compared where both refuse it without an agent."""
    # A field that breaks the socket sends the Python launcher in-process: to a store of
    # the test's, never the machine's default one.
    in_process = f"sqlite://{agent.socket.parent}/in-process.db"
    cfg = base_config({"agentSocket": str(agent.socket), "store": in_process})
    path = data.draw(st.sampled_from(FIELDS), label="field")
    set_path(cfg, path, data.draw(json_values, label="value"))
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    stdin = json.dumps(cfg).encode()
    env = env_of(command, container="any-json")
    python = run_plugin(plugin, env, stdin, agent.socket.parent)
    native = run_plugin(native_plugin, env, stdin, agent.socket.parent)
    forwarded, _ = configured(stdin, command.encode())
    if forwarded is not None or command == "VERSION":
        assert (native.returncode, native.stdout) == (python.returncode, python.stdout)
    elif command == "DEL":  # no ADD of it reached an agent (design 5.14)
        assert native.returncode == 0 and native.stdout == b"", native
    else:  # the Python launcher runs it in-process; the native plugin refuses it (7)
        assert native.returncode == 1 and native.json["code"] == 7, native
    if command == "ADD":  # the next example starts from no attachment
        run_plugin(plugin, env_of("DEL", container="any-json"), stdin, agent.socket.parent)


@given(data=st.data())
@settings(PROPERTY, max_examples=EXAMPLES)
def test_any_bytes_in_any_cni_variable_answer_alike(plugin, native_plugin, agent, data):
    env = draw_variables(data, env_of(data.draw(st.sampled_from(COMMANDS), label="command")))
    stdin = json.dumps(base_config({"agentSocket": str(agent.socket)})).encode()
    python = run_plugin(plugin, env, stdin, agent.socket.parent)
    native = run_plugin(native_plugin, env, stdin, agent.socket.parent)
    assert (native.returncode, native.stdout) == (python.returncode, python.stdout)
    if python.returncode == 0 and env.get("CNI_COMMAND") == b"ADD":
        run_plugin(plugin, {**env, "CNI_COMMAND": b"DEL"}, stdin, agent.socket.parent)


# -- answered without an agent ----------------------------------------------------------------


@given(version=json_values)
@settings(PROPERTY, max_examples=EXAMPLES)
def test_version_echoes_any_cni_version_alike(plugin, native_plugin, version):
    """VERSION answers with the config's cniVersion as it was given, whatever JSON it
    is: floats in their shortest form, big integers, lone surrogates, duplicate keys."""
    stdin = json.dumps({"cniVersion": version, "name": "v"}).encode()
    env = env_of("VERSION")
    python = run_plugin(plugin, env, stdin, native_plugin.parent)
    native = run_plugin(native_plugin, env, stdin, native_plugin.parent)
    assert (native.returncode, native.stdout) == (python.returncode, python.stdout)


MUTATIONS = [b"", b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\\", b'"', b",", b"}", b"]",
             b"{", b"[", b"1e999", b"NaN", b"-", b" \x0b", b"\\ud800", b"\\u12"]  # fmt: skip


@given(data=st.data())
@settings(PROPERTY, max_examples=EXAMPLES)
def test_any_bytes_on_stdin_get_the_same_code(plugin, native_plugin, run_dir, data):
    """A config with bytes put into its text anywhere, forwarded to no agent: the same
    stdout when it still names the socket; when it is not JSON, code 6 from both (the
    words of the syntax error are Python's json's own)."""
    in_process = f"sqlite://{run_dir}/in-process.db"  # where a broken socket leaves Python
    text = json.dumps(config(run_dir / "no-agent.sock", "0.4.0", store=in_process)).encode()
    at = data.draw(st.integers(0, len(text)), label="at")
    cut = data.draw(st.integers(0, 3), label="cut")
    inserted = data.draw(st.sampled_from(MUTATIONS) | st.binary(max_size=6), label="bytes")
    stdin = text[:at] + inserted + text[at + cut :]
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    env = env_of(command, container="bytes")
    python = run_plugin(plugin, env, stdin, run_dir)
    native = run_plugin(native_plugin, env, stdin, run_dir)
    try:
        # Not JSON as the plugins judge it: UTF-8 strictly (json.loads of bytes would
        # take an encoded lone surrogate, b"\xed\xa0\x80", which neither plugin does).
        json.loads(stdin.decode())
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError)
        if command == "DEL":
            assert (native.returncode, native.stdout) == (python.returncode, python.stdout)
        else:
            assert native.json["code"] == python.json["code"] == 6, (python, native)
            assert native.json["msg"].startswith(NOT_JSON), native
        return
    forwarded, _ = configured(stdin, command.encode())
    if forwarded is not None or command in ("VERSION", "DEL"):
        assert (native.returncode, native.stdout) == (python.returncode, python.stdout)


@pytest.mark.parametrize(
    "stdin",
    [
        b"{not json",
        b'{"cniVersion": "1.0.0",}',
        b"\xff{}",
        b'{"a": 1' + b"0" * 4400 + b"}",  # past Python's 4300 digits of an int
        b"[" * 996 + b"]" * 996,
        b'{"x": "\\uZZZZ"}',
    ],
    ids=["brace", "trailing-comma", "not-utf8", "long-int", "too-deep", "bad-escape"],
)
def test_json_syntax_errors_get_code_6_naming_stdin(
    plugin: Path, native_plugin: Path, stdin: bytes
) -> None:
    for command in ("ADD", "VERSION"):
        python = exec_plugin(plugin, command, stdin)
        native = exec_plugin(native_plugin, command, stdin)
        assert native.returncode == python.returncode == 1
        assert native.json["code"] == python.json["code"] == 6, (python, native)
        assert native.json["msg"].startswith(NOT_JSON) and python.json["msg"].startswith(NOT_JSON)


def test_nesting_as_deep_as_python_parses_is_forwarded(
    plugin: Path, native_plugin: Path, run_dir: Path
) -> None:
    """A config nested deep is forwarded by both; one deeper than the Python forwarder
    parses (995 containers) is not JSON to either. (Between 993 and 995, Python's json
    parses it to forward it, but no longer deep in the error path, which then answers in
    1.1.0: the native plugin answers in the config's version.)"""
    deep = "[" * 991 + "]" * 991
    text = json.dumps(config(run_dir / "gone.sock"))[:-1] + f', "deep": {deep}}}'
    assert same(plugin, native_plugin, "ADD", text.encode()).json["code"] == 11
    deeper = text.replace(deep, "[" * 995 + "]" * 995)
    python = exec_plugin(plugin, "ADD", deeper.encode())
    native = exec_plugin(native_plugin, "ADD", deeper.encode())
    assert native.json["code"] == python.json["code"] == 6, (python, native)


@pytest.mark.parametrize("version", ["0.3.1", "1.1.0", "9.9.9", None])
def test_every_reason_no_agent_answered_is_worded_alike(
    plugin: Path, native_plugin: Path, run_dir: Path, version: str | None
) -> None:
    """No socket file, nobody listening, a regular file, a directory, a path through a
    file: the same code (11; 5 when it is not a socket; 50 for STATUS) and words, in the
    config's version when it is one we support (else 1.1.0)."""
    stale = run_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # nobody listens: what a killed agent leaves
    regular = run_dir / "file"
    regular.write_text("")
    (run_dir / "dir").mkdir()
    paths = [run_dir / "missing.sock", stale, regular, run_dir / "dir", regular / "below"]
    for path in paths:
        cfg = config(path)
        if version is None:
            del cfg["cniVersion"]
        else:
            cfg["cniVersion"] = version
        for command in ("ADD", "CHECK", "STATUS", "GC"):
            result = same(plugin, native_plugin, command, cfg, container="gone")
            assert result.returncode == 1 and result.json["code"] in (5, 11, 50), result
        deleted = same(plugin, native_plugin, "DEL", cfg, container="gone")
        assert deleted.returncode == 0 and deleted.stdout == b"", deleted


def test_a_del_with_a_note_and_no_agent_is_worded_alike(
    plugin: Path, native_plugin: Path, run_dir: Path
) -> None:
    note = note_of("noted")
    note.parent.mkdir(parents=True)
    note.write_text("as an ADD that reached an agent leaves it\n")
    try:
        for cfg in (config(run_dir / "missing.sock"), config("relative.sock")):
            python = exec_plugin(plugin, "DEL", cfg, container="noted")
            native = exec_plugin(native_plugin, "DEL", cfg, container="noted")
            assert python.returncode == native.returncode == 1
            if cfg["ipam"]["agentSocket"].startswith("/"):
                assert native.stdout == python.stdout and native.json["code"] == 11, native
            else:  # in-process, the config is refused by its checks; natively, the field
                assert native.json["code"] == python.json["code"] == 7, (python, native)
                assert "agentSocket" in native.json["msg"] and "agentSocket" in python.json["msg"]
    finally:
        shutil.rmtree(note.parent)


def test_an_add_whose_note_cannot_be_written_is_worded_alike(
    plugin: Path, native_plugin: Path, agent: fleet.Agent, tmp_path: Path
) -> None:
    """The note's path in the message, its bytes that are not UTF-8 replaced; a long
    one cut at 2000 characters."""
    blocked = tmp_path / "notes-is-a-file"
    blocked.write_text("")
    long_dir = str(blocked) + "/" + "d" * 2100
    for notes, container in (
        (str(blocked), "c1"),
        (str(blocked), os.fsdecode(b"c\xff\xc3(\xe2\x82")),
        (long_dir, "c1"),
    ):
        env = {"IPWARD_CNI_NOTES": notes}
        result = same(plugin, native_plugin, "ADD", config(agent.socket), container, env=env)
        assert result.json["code"] == 11 and "note" in result.json["msg"], result
    assert result.json["msg"].endswith(" [...]")


# -- listeners that are not agents ---------------------------------------------------------------


class FakeAgent:
    """A Unix socket of ours answering every connection with `reply(request)`: bytes to
    send once the request is read, then the connection closed; None: closed with the
    request unread (the plugin's recv then meets ECONNRESET)."""

    def __init__(self, path: Path, reply: Callable[[bytes], bytes | None], backlog: int = 8):
        self.path = path
        self.reply = reply
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(backlog)
        self.serving = threading.Thread(target=self.serve, daemon=True)

    def start(self) -> FakeAgent:
        self.serving.start()
        return self

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                request = self.request(conn)
                if request is None:
                    continue  # a client that left before it was accepted
                answer = self.reply(request)
                if answer is not None:
                    conn.recv(len(request), socket.MSG_WAITALL)
                    with contextlib.suppress(OSError):  # the plugin gave up first
                        conn.sendall(answer)

    @staticmethod
    def request(conn: socket.socket) -> bytes | None:
        """The whole request, still unread (MSG_PEEK); None if the client left."""
        head = b"-"
        while 0 < len(head) < wire.REQUEST_HEADER:
            head = conn.recv(wire.REQUEST_HEADER, socket.MSG_PEEK | socket.MSG_WAITALL)
        if not head:
            return None
        size = wire.REQUEST_HEADER + int.from_bytes(head[len(wire.REQUEST_MAGIC) :], "big")
        return conn.recv(size, socket.MSG_PEEK | socket.MSG_WAITALL)

    def stop(self) -> None:
        self.listener.close()


def answer(status: int, stdout: bytes) -> bytes:
    return wire.encode_answer(status, stdout)


ANSWERS: dict[str, bytes | None] = {
    "verbatim": answer(0, b'{"anything": "\\u00e9"}\nand more\x00\xff'),
    "status 200": answer(200, b"odd"),
    "empty stdout": answer(7, b""),
    "trailing bytes": answer(0, b"{}\n") + b"junk after",
    "closed at once": b"",
    "reset": None,
    "half written": answer(0, b"x" * 100)[:60],
    "header cut": b"IPWARDA\x02\x00\x00",
    "protocol 3": b"IPWARDA\x03" + answer(0, b"{}")[8:],
    "http": b"HTTP/1.1 400 Bad Request\r\n\r\n",
    "too large": b"IPWARDA\x02\x00" + (wire.MAX_ANSWER + 1).to_bytes(4, "big"),
}
PRINTED = ("verbatim", "status 200", "empty stdout", "trailing bytes")


@pytest.mark.parametrize("name", list(ANSWERS))
def test_what_a_listener_answers_is_printed_or_refused_alike(
    plugin: Path, native_plugin: Path, run_dir: Path, name: str
) -> None:
    """An answer of protocol 2 is printed as it came, with its status; anything else,
    or none, is an error (11; 50 for STATUS), never a success."""
    reply = ANSWERS[name]
    container = f"listener-{list(ANSWERS).index(name)}"
    fake = FakeAgent(run_dir / "fake.sock", lambda request: reply).start()
    try:
        for command in ("DEL", "ADD", "STATUS", "DEL"):
            result = same(plugin, native_plugin, command, config(fake.path), container)
            if name in PRINTED:
                assert reply is not None
                status, out = wire.read_answer(io.BytesIO(reply).read)
                assert (result.returncode, result.stdout) == (status, out), result
            elif command == "STATUS":
                assert result.json["code"] == 50, result
            elif command == "DEL" and not note_of(container).exists():
                assert result.returncode == 0 and result.stdout == b"", result  # design 5.14
            else:  # an ADD, or a DEL after an ADD that reached it (its note)
                assert result.json["code"] == 11, result
    finally:
        fake.stop()
        shutil.rmtree(note_of(container).parent, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/syscall"), reason="needs /proc/PID/syscall")
@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_full_listen_backlog_is_waited_out(
    plugin: Path, native_plugin: Path, run_dir: Path, kind: str
) -> None:
    """The listener's backlog is full when the plugin connects: it waits (the native
    plugin in connect, the Python one retrying) and is answered once there is room."""
    executable = plugin if kind == "python" else native_plugin
    reply = answer(0, b'{"waited": true}\n')
    fake = FakeAgent(run_dir / "busy.sock", lambda request: reply, backlog=0)
    queued = []
    while True:  # fill the backlog: a connect past it says EAGAIN at once
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(fake.path))
        except BlockingIOError:
            s.close()
            break
        queued.append(s)
    stdin = run_dir / "stdin"
    stdin.write_text(json.dumps(config(fake.path)))
    with stdin.open("rb") as given:
        proc = subprocess.Popen(
            [str(executable)], stdin=given, stdout=subprocess.PIPE, env=env_of("ADD", "busy")
        )
    try:
        connect, sleep = "42", "230"  # x86-64: connect, clock_nanosleep (the retry's)

        def connecting() -> bool:
            assert proc.poll() is None, proc.communicate()
            fds = Path(f"/proc/{proc.pid}/fd")
            has_socket = any(os.readlink(fd).startswith("socket:") for fd in fds.iterdir())
            call = Path(f"/proc/{proc.pid}/syscall").read_text().split()[0]
            return has_socket and call in (connect, sleep)

        wait_for(connecting, "the plugin waiting to connect")
        for s in queued:  # room: the queued are served (and go), then the plugin
            s.close()
        fake.start()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out == b'{"waited": true}\n', (proc.returncode, out)
    finally:
        proc.kill()
        proc.wait()
        fake.stop()


@pytest.mark.slow
def test_an_agent_that_hangs_is_given_up_after_the_deadline(
    plugin: Path, native_plugin: Path, run_dir: Path
) -> None:
    """It reads the call and never answers: after the call's 60 s deadline, 11 (the
    runtime retries), the same words from both; both waited at once."""
    release = threading.Event()

    def hang(request: bytes) -> bytes:
        release.wait()
        return b""

    fake = FakeAgent(run_dir / "hang.sock", hang).start()
    results: dict[str, PluginResult] = {}

    def run(kind: str, executable: Path) -> None:
        results[kind] = exec_plugin(
            executable, "ADD", config(fake.path), container="hang", timeout=2 * DEADLINE
        )

    threads = [threading.Thread(target=run, args=kind) for kind in
               (("python", plugin), ("native", native_plugin))]  # fmt: skip
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        release.set()
        fake.stop()
    python, native = results["python"], results["native"]
    assert (native.returncode, native.stdout) == (python.returncode, python.stdout)
    assert native.json["code"] == 11 and "recv: timed out" in native.json["msg"], native


# -- fuzzing: ASan and UBSan on what it parses ------------------------------------------------

CLANG = shutil.which("clang")
SEEDS = {
    "add": b"\x00c1\x00eth0\x00" + json.dumps(config("/run/x.sock")).encode(),
    "del": b"\x01c1\x00eth0\x00" + json.dumps(config("/run/x.sock", "0.3.1")).encode(),
    "version": b'\x05c\x00e\x00{"cniVersion": [1.5e300, -0, "\\ud800\\u00e9", {"a": 1, "a": 2}]}',
    "no-socket": b'\x02c\x00e\x00{"ipam": {"agent_socket": 5, "store": "x"}, "name": "n"}',
    "answer": b"\x80" + answer(0, b'{"cniVersion": "1.0.0"}\n'),
}


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fuzz target built with libFuzzer, ASan and UBSan (any report aborts)."""
    if CLANG is None:
        pytest.fail("clang is missing (scripts/setup.sh installs it with its runtimes)")
    out = tmp_path_factory.mktemp("fuzz") / "ipward-cni-fuzz"
    done = subprocess.run(
        [CLANG, "-g", "-O0", "-fsanitize=fuzzer,address,undefined",
         "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror", "-DIPWARD_FUZZ",
         f"-I{NATIVE}", "-o", str(out), str(FUZZ_TARGET), "-lm"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


def fuzz(fuzzer: Path, tmp_path: Path, runs: int) -> str:
    """`runs` inputs from the seeds on (a fixed seed: the same runs each time); the
    output, after checking that no sanitizer or crash report stopped it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in SEEDS.items():
        (corpus / name).write_bytes(data)
    done = subprocess.run(
        [str(fuzzer), f"-runs={runs}", "-seed=1", "-max_len=8192", "-print_final_stats=1",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"stat::number_of_executed_units: {runs}" in done.stderr, done.stderr[-2000:]
    return done.stderr


def test_fuzzing_the_parsers_finds_nothing(fuzzer: Path, tmp_path: Path) -> None:
    fuzz(fuzzer, tmp_path, 30_000)


def test_the_fuzz_target_fails_on_a_sanitizer_report(fuzzer: Path, tmp_path: Path) -> None:
    """The run can fail: a target with an out-of-bounds read on one input stops."""
    broken = tmp_path / "broken.c"
    source = FUZZ_TARGET.read_text().replace(
        "if (data[0] & 0x80)", "if (data[0] == 5) return data[size + 8];\n    if (data[0] & 0x80)"
    )
    broken.write_text(source)
    out = tmp_path / "broken"
    assert CLANG is not None
    subprocess.run(
        [CLANG, "-g", "-O0", "-fsanitize=fuzzer,address,undefined", "-DIPWARD_FUZZ",
         f"-I{NATIVE}", "-o", str(out), str(broken), "-lm"],
        check=True, capture_output=True,
    )  # fmt: skip
    with pytest.raises(AssertionError, match="AddressSanitizer"):
        fuzz(out, tmp_path, 30_000)


@pytest.mark.slow
def test_fuzzing_the_parsers_long(fuzzer: Path, tmp_path: Path) -> None:
    fuzz(fuzzer, tmp_path, 3_000_000)
