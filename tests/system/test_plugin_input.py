"""Property tests of everything the plugin reads: any JSON value in any field of the
network config, any bytes in any CNI_* variable (in-process and through a real agent,
which must judge alike), any frame sent to a real agent's socket. Whatever comes in:
one JSON object on stdout (or nothing, for a success without a result), a documented
code (never 999, never a traceback), the store unchanged by a failure, and the agent
still answering a good call.

The default run draws a bounded number of examples (each exec'd plugin costs ~15-30 ms);
the `slow` variants draw many more."""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipward.cni import wire
from ipward.cni.plugin import forward
from ipward.core import keys
from ipward.core.errors import CODES
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.waiting import wait_for
from support import PluginResult

DOCUMENTED = set(CODES)  # README's table; 999 (a bug) is not among them
COMMANDS = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")
PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SHORT, LONG = 150, 1500  # examples of the default run, of the `slow` run

# -- what the plugin printed -----------------------------------------------------------------


def judge(result: PluginResult, where: str) -> int | None:
    """The error code of a failed call (None for a success), after checking that stdout
    holds exactly one JSON object (or nothing, for a success without a result)."""
    out = result.stdout
    assert b"Traceback" not in out, (where, result)
    if result.returncode == 0:
        if out:
            assert out.endswith(b"\n") and out.count(b"\n") == 1, (where, result)
            assert isinstance(json.loads(out), dict), (where, result)
        return None
    assert result.returncode == 1, (where, result)
    assert out.endswith(b"\n") and out.count(b"\n") == 1, (where, result)
    error = json.loads(out)
    assert isinstance(error, dict) and set(error) <= {"cniVersion", "code", "msg", "details"}
    assert error["code"] in DOCUMENTED, (where, error)
    assert isinstance(error["msg"], str) and error["msg"], (where, error)
    return int(error["code"])


def whole_store(url: str) -> tuple[int, dict[str, bytes]]:
    with open_store(url) as store:
        kvs, revision = store.range("")
    return revision, {kv.key: kv.value for kv in kvs if not kv.key.startswith("nodes/")}


def run_plugin(plugin: Path, env: dict[str, bytes], stdin: bytes, cwd: Path) -> PluginResult:
    """Exec the plugin with exactly this environment (bytes: anything but NUL) in `cwd`
    (a relative logFile a config may name lands there), and the run's notes directory
    (tests/conftest.py) unless the environment names one."""
    env = {"IPWARD_CNI_NOTES": os.environb[b"IPWARD_CNI_NOTES"], **env}
    proc = subprocess.run(
        [str(plugin)], input=stdin, env=env, cwd=cwd, capture_output=True, timeout=60
    )
    return PluginResult(proc)


def base_env(command: str, container: str = "c0") -> dict[str, bytes]:
    return {
        "CNI_COMMAND": command.encode(),
        "CNI_CONTAINERID": container.encode(),
        "CNI_IFNAME": b"eth0",
        "CNI_NETNS": b"/var/run/netns/prop",
        "CNI_ARGS": b"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-0",
    }


def base_config(ipam: dict) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": "prop",
        "ipam": {
            "type": "ipward",
            "ranges": [[{"subnet": "10.44.0.0/16", "gateway": "10.44.0.1"}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.44.0.53"], "domain": "example.org"},
            **ipam,
        },
        "runtimeConfig": {"ips": []},
        "args": {"cni": {}},
        "prevResult": {"cniVersion": "1.1.0", "ips": [{"address": "10.44.0.2/16"}]},
        "cni.dev/valid-attachments": [],
    }


# -- any JSON value in any config field ---------------------------------------------------------

SAMPLES = [
    "", "10.44.0.5", "10.44.0.0/24", "fd00::1", "fd00::/64", "0.0.0.0/0", "eth0", "a/b",
    "..", "1.0.0", "0.4.0", "ipward", "prop", "\n", "\udcff", "x" * 300,
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: JSON text of Python's json, which we accept
    | st.text(max_size=40)
    | st.sampled_from(SAMPLES)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS: list[tuple[str | int, ...]] = [
    ("cniVersion",), ("name",), ("ipam",), ("args",), ("args", "cni"), ("args", "cni", "ips"),
    ("runtimeConfig",), ("runtimeConfig", "ips"), ("runtimeConfig", "ips", 0),
    ("prevResult",), ("prevResult", "ips"), ("prevResult", "ips", 0),
    ("prevResult", "ips", 0, "address"), ("cni.dev/valid-attachments",),
    ("cni.dev/valid-attachments", 0), ("cni.dev/valid-attachments", 0, "containerID"),
    ("cni.dev/valid-attachments", 0, "ifname"),
    ("ipam", "type"), ("ipam", "pool"), ("ipam", "ranges"), ("ipam", "ranges", 0),
    ("ipam", "ranges", 0, 0), ("ipam", "ranges", 0, 0, "subnet"),
    ("ipam", "ranges", 0, 0, "gateway"), ("ipam", "ranges", 0, 0, "rangeStart"),
    ("ipam", "ranges", 0, 0, "rangeEnd"), ("ipam", "subnet"), ("ipam", "rangeStart"),
    ("ipam", "gateway"), ("ipam", "range"), ("ipam", "range_start"), ("ipam", "range_end"),
    ("ipam", "exclude"), ("ipam", "ipRanges"), ("ipam", "routes"), ("ipam", "routes", 0),
    ("ipam", "routes", 0, "dst"), ("ipam", "routes", 0, "gw"), ("ipam", "dns"),
    ("ipam", "dns", "nameservers"), ("ipam", "dns", "domain"), ("ipam", "dns", "search"),
    ("ipam", "cooldown"), ("ipam", "node"), ("ipam", "logLevel"), ("ipam", "sticky"),
    ("ipam", "stickyTTL"), ("ipam", "gcGrace"), ("ipam", "agentSocket"),
    ("ipam", "agent_socket"), ("ipam", "store"), ("ipam", "logFile"),
]  # fmt: skip
CONTAINED = {("ipam", "store"), ("ipam", "logFile")}  # strings kept inside the test's dir


def set_path(config: dict, path: tuple[str | int, ...], value: object) -> None:
    """Put `value` at `path`, making the containers on the way what the path needs."""
    node: Any = config
    for step, following in itertools.pairwise(path):
        child = _get(node, step)
        wanted: type = list if isinstance(following, int) else dict
        if not isinstance(child, wanted):
            child = wanted()
            _put(node, step, child)
        node = child
    _put(node, path[-1], value)


def _get(node: Any, step: str | int) -> object:
    if isinstance(node, list):
        return node[int(step)] if int(step) < len(node) else None
    return node.get(step)


def _put(node: Any, step: str | int, value: object) -> None:
    if isinstance(node, list):
        node.extend([None] * (int(step) + 1 - len(node)))
    node[step] = value


@pytest.fixture
def local(tmp_path: Path, plugin: Path) -> Iterator[tuple[Path, str]]:
    """A directory and an in-process store holding one allocation (so "unchanged" means
    something)."""
    url = f"sqlite://{tmp_path}/local.db"
    seed = json.dumps(base_config({"store": url})).encode()
    assert run_plugin(plugin, base_env("ADD", "seed"), seed, tmp_path).returncode == 0
    yield tmp_path, url


def config_field_example(plugin: Path, local: tuple[Path, str], data: st.DataObject) -> None:
    cwd, url = local
    config = base_config({"store": url})
    path = data.draw(st.sampled_from(FIELDS), label="field")
    value = data.draw(json_values, label="value")
    if path in CONTAINED and isinstance(value, str):
        inside = f"{cwd}/{value.replace('/', '_')}"
        value = f"sqlite://{inside}" if path[-1] == "store" else inside
    set_path(config, path, value)
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    stdin = json.dumps(config).encode()  # NaN, Infinity, lone surrogates as escapes
    before = whole_store(url)
    code = judge(run_plugin(plugin, base_env(command), stdin, cwd), "in-process")
    if code is not None:
        assert whole_store(url) == before, (path, value, command, code)


@given(data=st.data())
@settings(PROPERTY, max_examples=SHORT)
def test_any_json_in_any_config_field(plugin, local, data):
    config_field_example(plugin, local, data)


@pytest.mark.slow
@given(data=st.data())
@settings(PROPERTY, max_examples=LONG)
def test_any_json_in_any_config_field_long(plugin, local, data):
    config_field_example(plugin, local, data)


# -- any bytes in any CNI_* variable: both paths, one judgement -------------------------------

SHAPES = b"\n=;/:. \t\x01\x7f\x80\xc3\xa9\xff-_aZ09,"
env_bytes = st.one_of(
    st.binary(max_size=40),
    st.lists(st.sampled_from([bytes((c,)) for c in SHAPES]), max_size=40).map(b"".join),
    st.sampled_from(
        [b"", b".", b"..", b"ADD", b"DEL", b"CHECK", b"VERSION", b"c" * 257, b"e" * 16,
         b"IP=10.44.0.9", b"IP=banana", b"K8S_POD_NAME=Web", b"IgnoreUnknown=1;A=\n",
         b"x\nCNI_COMMAND=DEL", b"x\nCNI_CONTAINERID=seed", b"x" * 10_000]
    ),
).map(lambda b: b.replace(b"\0", b""))  # an environment cannot hold NULs  # fmt: skip


@pytest.fixture
def both(tmp_path: Path, plugin: Path, local: tuple[Path, str]) -> Iterator[dict[str, Any]]:
    """The in-process store and a real agent on a store of its own, each holding the
    same allocation."""
    agent_url = f"sqlite://{tmp_path}/agent.db"
    agent = fleet.Agent("prop-node", agent_url, tmp_path / "run" / "agent.sock", tmp_path)
    try:
        agent.wait_ready()
        with open_store(agent_url) as store:
            wait_for(lambda: store.get(keys.node_key("prop-node")), "the node's registration")
        configs = {
            "in-process": json.dumps(base_config({"store": local[1]})).encode(),
            "agent": json.dumps(
                base_config({"agentSocket": str(agent.socket), "store": local[1]})
            ).encode(),
        }
        seeded = run_plugin(plugin, base_env("ADD", "seed"), configs["agent"], tmp_path)
        assert seeded.returncode == 0, seeded
        yield {"cwd": tmp_path, "urls": {"in-process": local[1], "agent": agent_url}, **configs}
    finally:
        agent.kill()


def draw_variables(data: st.DataObject, env: dict[str, bytes]) -> dict[str, bytes]:
    """`env` with some of the variables the plugin forwards drawn anew: any bytes, or
    unset."""
    for name in data.draw(st.sets(st.sampled_from(wire.FORWARDED), min_size=1), label="names"):
        value = data.draw(st.none() | env_bytes, label=name)
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def cni_variable_example(plugin: Path, both: dict[str, Any], data: st.DataObject) -> None:
    env = draw_variables(data, base_env(data.draw(st.sampled_from(COMMANDS), label="command")))
    codes = {}
    for where in ("in-process", "agent"):
        before = whole_store(both["urls"][where])
        codes[where] = judge(run_plugin(plugin, env, both[where], both["cwd"]), where)
        if codes[where] is not None:
            assert whole_store(both["urls"][where]) == before, (where, env)
    assert codes["in-process"] == codes["agent"], env  # the thin path judges alike


@given(data=st.data())
@settings(PROPERTY, max_examples=SHORT)
def test_any_bytes_in_any_cni_variable(plugin, both, data):
    cni_variable_example(plugin, both, data)


@pytest.mark.slow
@given(data=st.data())
@settings(PROPERTY, max_examples=LONG)
def test_any_bytes_in_any_cni_variable_long(plugin, both, data):
    cni_variable_example(plugin, both, data)


# -- any frame to a real agent ---------------------------------------------------------------


def field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """Raw garbage, or requests built field by field with any count, names, values,
    lengths and stdin, or a good request with bytes changed or cut."""
    kind = draw(st.sampled_from(["raw", "built", "mutated"]))
    if kind == "raw":
        return bytes(draw(st.binary(max_size=200)))
    names = st.sampled_from([n.encode() for n in wire.FORWARDED]) | st.binary(max_size=12)
    pairs = draw(st.lists(st.tuples(names, env_bytes), max_size=7))
    stdin = draw(st.sampled_from([b"", b"{}", b"[", b'{"cniVersion": "1.0.0"}']) | st.binary())
    count = draw(st.integers(0, 255) | st.just(len(pairs)))
    body = bytes((count,)) + b"".join(field(n) + field(v) for n, v in pairs) + field(stdin)
    magic = draw(st.just(wire.REQUEST_MAGIC) | st.binary(min_size=8, max_size=8))
    length = draw(st.just(len(body)) | st.integers(0, 2**32 - 1))
    frame = magic + length.to_bytes(4, "big") + body
    if kind == "mutated" and frame:
        at = draw(st.integers(0, len(frame) - 1))
        frame = frame[:at] + draw(st.binary(max_size=3)) + frame[at + 1 :]
        frame = frame[: draw(st.integers(0, len(frame)))]
    return frame


@pytest.fixture
def lone_agent(tmp_path: Path) -> Iterator[tuple[fleet.Agent, str]]:
    url = f"sqlite://{tmp_path}/agent.db"
    agent = fleet.Agent("frame-node", url, tmp_path / "run" / "agent.sock", tmp_path)
    try:
        agent.wait_ready()
        with open_store(url) as store:
            wait_for(lambda: store.get(keys.node_key("frame-node")), "the node's registration")
        yield agent, url
    finally:
        agent.kill()


def frame_example(lone_agent: tuple[fleet.Agent, str], frame: bytes) -> None:
    agent, url = lone_agent
    before = whole_store(url)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(agent.socket))
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)  # then nothing more: a short frame ends here
        except OSError:
            pass  # answered and closed before taking all of it
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    if not reply:  # closed without an answer: only for a request cut short
        assert len(frame) < wire.REQUEST_HEADER or frame.startswith(wire.REQUEST_MAGIC), frame
    else:
        if frame.startswith(b"\0"):  # a version 1 request: answered in version 1's format
            assert int.from_bytes(reply[:4], "big") == len(reply) - 4
            status, out = reply[4], reply[5:]
        else:
            status, out = wire.read_answer(io.BytesIO(reply).read)
        code = judge(PluginResult(subprocess.CompletedProcess([], status, out, b"")), "agent")
        if code is not None:
            assert whole_store(url) == before, frame
    assert agent.running
    status, _ = forward(str(agent.socket), {"CNI_COMMAND": "VERSION"}, b"{}")
    assert status == 0  # and it still serves


@given(frame=frames())
@settings(PROPERTY, max_examples=SHORT * 4)
def test_any_frame_to_a_real_agent(lone_agent, frame):
    frame_example(lone_agent, frame)


@pytest.mark.slow
@given(frame=frames())
@settings(PROPERTY, max_examples=LONG * 4)
def test_any_frame_to_a_real_agent_long(lone_agent, frame):
    frame_example(lone_agent, frame)


def test_the_examples_reach_every_path(plugin, local):
    """The config property is worth something only if its base config is served: ADD,
    CHECK and DEL of it succeed in-process."""
    cwd, url = local
    stdin = json.dumps(base_config({"store": url})).encode()
    for command in ("ADD", "CHECK", "DEL", "STATUS", "GC", "VERSION"):
        result = run_plugin(plugin, base_env(command, "seed"), stdin, cwd)
        assert judge(result, command) is None, (command, result)
    assert os.path.exists(url.removeprefix("sqlite://"))
