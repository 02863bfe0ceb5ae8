"""The node agent (`ipward agent`), always as a real process, with the real installed
plugin exec'd against it (`agentSocket` in the ipam config), on SQLite and on a real
etcd: the CNI flow, the store and node the agent serves (never the config's), socket
and peer permissions, agent down, graceful stop under a burst, SIGKILL mid-allocation,
metrics and health, protocol garbage."""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from ipward.agent.server import MAX_READING_PER_PROCESS
from ipward.cluster.liveness import Sandbox
from ipward.cni.wire import REQUEST_MAGIC, encode_request, read_answer
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord
from ipward.ipam import blocks
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import etcd_server, free_port
from ipward_lab.simcluster import write_sim_state
from ipward_lab.waiting import wait_for
from support import Gate, PluginResult, exec_plugin

NODE = "agent-node"
SETPRIV = "/usr/bin/setpriv"
NOBODY = 65534
OTHER_GID = 4242
READY_TIMEOUT = 30.0


class AgentProcess(fleet.Agent):
    """One `ipward agent` process (`ipward_lab.fleet`), metrics off unless asked for."""

    def __init__(
        self,
        tmp: Path,
        store: str,
        socket_path: Path,
        node: str = NODE,
        metrics: bool = False,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(node, store, socket_path, tmp, extra, env, metrics=metrics)
        self.store = store


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start agents (ready to serve); every one still running is killed at teardown."""
    started: list[AgentProcess] = []

    def start(
        store: str,
        socket_path: Path | None = None,
        wait: bool = True,
        **kwargs: object,
    ) -> AgentProcess:
        path = socket_path or tmp_path / "run" / "ipward" / "agent.sock"
        agent = AgentProcess(tmp_path, store, path, **kwargs)  # type: ignore[arg-type]
        started.append(agent)
        return agent.wait_ready() if wait else agent

    yield start
    for agent in started:
        agent.kill()


@pytest.fixture
def etcd(tmp_path: Path):
    with etcd_server(tmp_path / "etcd") as server:
        yield server


def config(socket_path: Path, **ipam: object) -> dict:
    section: dict = {"type": "ipward", "agentSocket": str(socket_path)}
    section.update(ipam or {"ranges": [[{"subnet": "10.20.0.0/24", "gateway": "10.20.0.1"}]]})
    return {"cniVersion": "1.0.0", "name": "net", "ipam": section}


def address(result: PluginResult) -> str:
    assert result.returncode == 0, result
    assert result.json is not None
    return str(result.json["ips"][0]["address"]).split("/")[0]


def snapshot(url: str) -> dict[str, tuple[bytes, int]]:
    """Every key of the ledger with its value and revision, and the store revision."""
    with open_store(url) as store:
        out = {
            kv.key: (kv.value, kv.mod_revision)
            for prefix in ("pools/", "ips/", "attach/", "blocks/", "free", "fill/", "block")
            for kv in store.range(prefix)[0]
        }
        out["<revision>"] = (b"", store.revision())
    return out


def records(url: str) -> dict[str, dict]:
    """Allocation records by address: ip -> record."""
    with open_store(url) as store:
        kvs, _ = store.range("ips/")
    return {kv.key.rsplit("/", 1)[1]: rec.decode(kv.value) for kv in kvs}


def holders(url: str) -> dict[str, list[str]]:
    """container -> the addresses its records hold."""
    out: dict[str, list[str]] = {}
    for ip, record in records(url).items():
        out.setdefault(AddressRecord.from_dict(record).attachment.container, []).append(ip)
    return out


def assert_check_clean(url: str) -> None:
    proc = run_cli("--json", "check", store=url)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def cni_flow(plugin: Path, url: str, cfg: dict) -> None:
    """ADD, repeated ADD, CHECK, DEL, DEL of an unknown attachment, through the agent."""
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0"
    first = exec_plugin(plugin, "ADD", cfg, container="c1", args=args)
    ip = address(first)
    again = exec_plugin(plugin, "ADD", cfg, container="c1", args=args)
    assert address(again) == ip and again.json == first.json
    [record] = records(url).values()
    assert record["node"] == NODE  # the agent's --node, not the config's
    assert AddressRecord.from_dict(record).attachment == rec.Attachment("net", "c1", "eth0")
    check = exec_plugin(plugin, "CHECK", {**cfg, "prevResult": first.json}, container="c1")
    assert check.returncode == 0 and check.stdout == b"", check
    status = exec_plugin(plugin, "STATUS", cfg)
    assert status.returncode == 0, status
    assert exec_plugin(plugin, "DEL", cfg, container="c1").returncode == 0
    assert records(url) == {}
    check = exec_plugin(plugin, "CHECK", {**cfg, "prevResult": first.json}, container="c1")
    assert check.returncode == 1 and check.json["code"] == 3, check
    before = snapshot(url)
    assert exec_plugin(plugin, "DEL", cfg, container="never-added").returncode == 0
    assert exec_plugin(plugin, "DEL", cfg, container="c1").returncode == 0  # repeated
    assert snapshot(url) == before
    # The address is usable again (the pool's cooldown permits it when nothing else is
    # free, so just ask for it by name).
    reuse = exec_plugin(plugin, "ADD", cfg, container="c2", args=f"IP={ip}")
    assert address(reuse) == ip
    assert exec_plugin(plugin, "DEL", cfg, container="c2").returncode == 0
    assert_check_clean(url)


def test_an_empty_socket_directory_made_for_the_agent_is_made_0750(
    sqlite_url, start_agent, tmp_path
):
    """Finding (a real cluster): the DaemonSet's hostPath `DirectoryOrCreate` makes
    /run/ipward 0755, and every agent start warned it was more open than 0750. An empty
    directory of the agent's own user is the agent's to set; one in use is left as is."""
    socket_dir = tmp_path / "run" / "ipward"
    socket_dir.mkdir(parents=True, mode=0o755)
    socket_dir.chmod(0o755)
    agent = start_agent(sqlite_url, socket_dir / "agent.sock")
    assert socket_dir.stat().st_mode & 0o777 == 0o750
    assert not [e for e in agent.logs() if e["msg"].startswith("socket directory is more open")]
    assert agent.logged("made an empty socket directory 0750")


def test_sqlite_flow_serves_its_own_store_and_node(forwarder, sqlite_url, start_agent, tmp_path):
    agent = start_agent(sqlite_url)
    socket_dir = agent.socket.parent
    assert socket_dir.stat().st_mode & 0o777 == 0o750  # created by the agent
    assert agent.socket.stat().st_mode & 0o777 == 0o660
    elsewhere = tmp_path / "elsewhere.db"
    cni_log = tmp_path / "cni.log"
    cfg = config(
        agent.socket,
        ranges=[[{"subnet": "10.20.0.0/24", "gateway": "10.20.0.1"}]],
        node="config-node",
        store=f"sqlite://{elsewhere}",
        logFile=str(cni_log),
    )
    cni_flow(forwarder, sqlite_url, cfg)
    assert not elsewhere.exists()  # the config's store is never opened
    assert not cni_log.exists()  # nor its log file: the agent keeps its own
    requests = [e for e in agent.logs() if e["msg"] == "request"]
    assert {e["command"] for e in requests} >= {"ADD", "DEL", "CHECK", "STATUS"}
    assert agent.stop() == 0
    assert not agent.socket.exists()


def test_etcd_flow_never_uses_the_configs_store(forwarder, etcd, start_agent, tmp_path):
    run_cli("pool", "create", "web", "--range", "10.30.0.0/24", store=etcd.url, check=True)
    agent = start_agent(etcd.url)
    # The config names stores the agent must not touch: the agent serves its own.
    cfg = config(agent.socket, pool="web", store="etcd://127.0.0.1:1", node="config-node")
    cni_flow(forwarder, etcd.url, cfg)
    cfg = config(agent.socket, pool="web", store="sqlite:///proc/nope/x.db")
    ip = address(exec_plugin(forwarder, "ADD", cfg, container="c9"))
    assert records(etcd.url)[ip]["node"] == NODE
    assert agent.stop() == 0
    assert_check_clean(etcd.url)


def test_a_second_agent_stands_by_and_takes_the_socket_over_when_the_first_stops(
    plugin, sqlite_url, start_agent, tmp_path
):
    """The next version's agent, rolled out with a surge (`maxSurge: 1`), starts while
    the first still serves its node: it stands by on the socket's lock (it used to exit
    2, so a surge rollout never went on) and serves from the moment the first stops
    taking connections, the first draining meanwhile; the metrics address they share
    is taken once the first lets it go. A dead agent's socket is replaced; what is not
    a socket is never touched."""
    port = free_port()
    metrics = ("--metrics-address", f"127.0.0.1:{port}")
    first = start_agent(sqlite_url, extra=metrics)
    second = start_agent(sqlite_url, wait=False, extra=metrics)
    wait_for(lambda: second.logged(STANDING_BY), "the second agent standing by")
    cfg = config(first.socket)
    address(exec_plugin(plugin, "ADD", cfg, container="to-first"))
    assert not second.logged("request") and first.logged("request")
    assert first.stop() == 0
    wait_for(lambda: second.logged("agent started"), "the second agent serving")
    address(exec_plugin(plugin, "ADD", cfg, container="to-second"))
    assert [e["container"] for e in second.logged("request")] == ["to-second"]
    assert http_get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
    second.kill()  # SIGKILL leaves its socket file behind
    assert second.socket.exists()
    third = start_agent(sqlite_url)
    assert any(e["msg"].startswith("removed a stale socket") for e in third.logs())
    assert third.stop() == 0
    # Something that is not a socket is never removed.
    third.socket.write_text("not a socket")
    fourth = start_agent(sqlite_url, wait=False)
    assert fourth.proc.wait(30) == 2
    assert "not a socket" in fourth.output()
    assert third.socket.read_text() == "not a socket"


STANDING_BY = "another agent serves this socket; standing by to take over when it stops"


class CallsAllThrough:
    """Connections to an agent's socket path in a loop, and ADDs through the plugin one
    after the other, in threads until `stop`; what failed of each."""

    def __init__(self, plugin: Path, socket_path: Path) -> None:
        self.plugin = plugin
        self.socket_path = socket_path
        self.refused: list[str] = []
        self.connects = 0
        self.results: list[PluginResult] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._probe), threading.Thread(target=self._add)]
        for t in self._threads:
            t.start()

    def _probe(self) -> None:
        while not self._stop.is_set():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(self.socket_path))
                    self.connects += 1
                except OSError as e:
                    self.refused.append(str(e))
            self._stop.wait(0.001)

    def _add(self) -> None:
        while not self._stop.is_set():
            container = f"handover-{len(self.results)}"
            cfg = config(self.socket_path)
            self.results.append(exec_plugin(self.plugin, "ADD", cfg, container=container))

    def wait_more(self, adds: int, what: str) -> None:
        """Until `adds` more ADDs have been answered."""
        done = len(self.results) + adds
        wait_for(lambda: len(self.results) >= done, what)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def assert_none_failed(self) -> None:
        assert not self.refused, (
            f"{len(self.refused)} connections failed, the first: {self.refused[0]}"
        )
        failed = [r for r in self.results if r.returncode != 0]
        assert not failed, (
            f"{len(failed)} of {len(self.results)} ADDs failed, the first: {failed[0]}"
        )


def test_the_socket_path_answers_all_through_a_handover(plugin, sqlite_url, start_agent):
    """The first agent used to remove its socket as it stopped, and the one standing by
    bound its own a lock poll later, so a call in between found no socket (the plugin
    answered 11, and a kubelet's sandbox failed in a surge roll, which test_kube_stories'
    roll forbids). The next agent now renames its listening socket over the path, and
    the first accepts until it sees that: connecting to the path never fails while one
    agent hands over to the next, and every ADD made all through is served."""
    first = start_agent(sqlite_url)
    second = start_agent(sqlite_url, wait=False)
    wait_for(lambda: second.logged(STANDING_BY), "the second agent standing by")
    calls = CallsAllThrough(plugin, first.socket)
    try:
        calls.wait_more(2, "calls to the first agent")
        assert first.stop() == 0
        wait_for(lambda: second.logged("agent started"), "the second agent serving")
        calls.wait_more(2, "calls to the second agent")
    finally:
        calls.stop()
    calls.assert_none_failed()
    assert calls.connects and first.logged("request") and second.logged("request")


def test_a_stopping_agent_serves_on_until_a_late_successor_comes(plugin, sqlite_url, start_agent):
    """Found on the real cluster's roll (test_kube_stories): in a surge roll the old
    agent may be told to stop before its successor has even started (the new pod counts
    as Ready by /healthz on the port the two share on the host, which the old agent
    answers). The old agent serves on, up to `--handover-seconds`, until the successor
    has put its socket over the path: no call fails meanwhile. (It waited 2 s, and on a
    loaded node the path was gone before the successor came: an ADD failed, 11.)"""
    first = start_agent(sqlite_url, extra=("--handover-seconds", "300"))
    calls = CallsAllThrough(plugin, first.socket)
    try:
        calls.wait_more(2, "calls to the first agent")
        first.proc.terminate()
        wait_for(lambda: first.logged("agent stopping: handing the socket over"), "the stop")
        calls.wait_more(3, "calls served by the first agent, stopping, with no successor")
        second = start_agent(sqlite_url)
        assert first.proc.wait(60) == 0
        assert first.logged("socket taken over by the next agent")
        calls.wait_more(2, "calls to the second agent")
    finally:
        calls.stop()
    calls.assert_none_failed()
    assert second.logged("request")


# -- permissions ---------------------------------------------------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory others may enter (pytest's tmp dirs are 0700 to root)."""
    path = Path(tempfile.mkdtemp(prefix="ipward-agent-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def public_plugin(directory: Path) -> Path:
    """A copy of the plugin another user can run: its package readable by all, wherever
    this checkout lives (a clone in a 0700 directory would make the import fail)."""
    import ipward
    from ipward.core.startpath import LAUNCHER, PACK_NAME, pack_path

    lib = directory / "lib"
    # Not the code pack: its entries name this checkout's files (the copy imports its own).
    skip = shutil.ignore_patterns(PACK_NAME)
    shutil.copytree(Path(ipward.__file__).parent, lib / "ipward", ignore=skip)
    for path in [lib, *lib.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    launcher = directory / "ipward"
    launcher.write_text(LAUNCHER.format(path=str(lib), pack=pack_path(str(lib / "ipward"))))
    launcher.chmod(0o755)
    return launcher


def exec_as(user: list[str], plugin: Path, command: str, cfg: dict, container: str) -> PluginResult:
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_IFNAME": "eth0",
        "CNI_NETNS": "/var/run/netns/test",
        "CNI_PATH": str(plugin.parent),
        "IPWARD_CNI_NOTES": notes_of_others(),
    }
    proc = subprocess.run(
        [SETPRIV, *user, str(plugin)],
        input=json.dumps(cfg).encode(),
        env=env,
        capture_output=True,
        timeout=60,
    )
    return PluginResult(proc)


@functools.cache
def notes_of_others() -> str:
    """A notes directory (docs/design.md 5.14) every user's plugin may write in (the
    run's own, tests/conftest.py, is under a directory only root enters)."""
    path = tempfile.mkdtemp(prefix="ipw-notes-")
    os.chmod(path, 0o1777)
    atexit.register(shutil.rmtree, path, True)
    return path


@pytest.mark.skipif(os.getuid() != 0 or not Path(SETPRIV).exists(), reason="needs root, setpriv")
def test_other_users_are_refused_by_the_peer_check(
    forwarder, plugin, sqlite_url, start_agent, open_dir
):
    # A plugin copy and a socket others can reach: so the agent's peer check, not file
    # permissions, is what decides.
    if forwarder == plugin:
        launcher = public_plugin(open_dir)
    else:
        launcher = Path(shutil.copy2(forwarder, open_dir / "ipward-native"))
    agent = start_agent(sqlite_url, open_dir / "agent.sock", extra=("--allow-gid", str(OTHER_GID)))
    assert any(e["msg"].startswith("socket directory is more open") for e in agent.logs())
    assert agent.socket.stat().st_mode & 0o777 == 0o660
    assert agent.socket.stat().st_gid == OTHER_GID  # the allowed group can connect
    agent.socket.chmod(0o666)
    cfg = config(agent.socket)
    as_root = exec_plugin(launcher, "ADD", cfg, container="mine")
    held = address(as_root)
    before = snapshot(sqlite_url)

    nobody = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    for command in ("ADD", "DEL"):
        for container in ("theirs", "mine"):
            refused = exec_as(nobody, launcher, command, cfg, container)
            assert refused.returncode == 1, refused
            assert refused.json["code"] == 5, refused
            assert refused.json["cniVersion"] == "1.0.0"
            assert "permission denied" in refused.json["msg"]
    assert snapshot(sqlite_url) == before  # nothing was done for them
    refusals = [e for e in agent.logs() if e["msg"] == "refused a peer"]
    assert len(refusals) == 4 and {e["peer_uid"] for e in refusals} == {NOBODY}

    # The --allow-gid group is served, as primary or as a supplementary group.
    primary = [f"--reuid={NOBODY}", f"--regid={OTHER_GID}", "--clear-groups"]
    supplementary = [f"--reuid={NOBODY}", f"--regid={NOBODY}", f"--groups={OTHER_GID}"]
    assert address(exec_as(primary, launcher, "ADD", cfg, "theirs")) != held
    assert exec_as(supplementary, launcher, "DEL", cfg, "theirs").returncode == 0
    assert list(records(sqlite_url)) == [held]
    assert agent.stop() == 0


# -- agent down ----------------------------------------------------------------------------


def test_agent_not_running_is_try_again_later(forwarder, sqlite_url, tmp_path):
    run_cli("pool", "create", "web", "--range", "10.40.0.0/24", store=sqlite_url, check=True)
    before = snapshot(sqlite_url)
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nobody listens on: what a killed agent leaves
    for path in (tmp_path / "missing" / "agent.sock", stale):
        cfg = config(path, pool="web")
        add = exec_plugin(forwarder, "ADD", cfg, container="c1")
        assert add.returncode == 1 and add.json["code"] == 11, add
        assert "try again later" in add.json["msg"]
        # No ADD of c1 reached an agent: its DEL succeeds (docs/design.md 5.14). One
        # whose ADD did (its note) waits for the agent: `test_del_never_wedges.py`.
        delete = exec_plugin(forwarder, "DEL", cfg, container="c1")
        assert delete.returncode == 0 and delete.stdout == b"", delete
    assert snapshot(sqlite_url) == before


# -- stopping ------------------------------------------------------------------------------


def test_graceful_stop_drains_and_refuses(plugin, sqlite_url, start_agent):
    # No next agent is coming: its socket goes at once (no --handover-seconds of serving on).
    agent = start_agent(sqlite_url, extra=("--handover-seconds", "0"))
    cfg = config(agent.socket)
    # A call in flight when the stop comes: half its request is sent, the rest comes late.
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.settimeout(30)
    slow.connect(str(agent.socket))
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "slow",
        "CNI_IFNAME": "eth0",
        "CNI_NETNS": "/x",
    }
    request = encode_request(env, json.dumps(cfg).encode())
    slow.sendall(request[: len(request) // 2])

    # A burst of plugin execs, with the SIGTERM in the middle of it.
    results: dict[str, PluginResult] = {}
    containers = [f"b{i}" for i in range(40)]

    def one(container: str) -> None:
        results[container] = exec_plugin(plugin, "ADD", cfg, container=container)

    # Launch until a few have answered, SIGTERM, then launch some more: the stop falls
    # in the middle of the burst whatever the machine's speed.
    threads: list[threading.Thread] = []
    after_stop = 0
    while after_stop < 8:
        if len(threads) < len(containers):
            threads.append(threading.Thread(target=one, args=(containers[len(threads)],)))
            threads[-1].start()
        if agent.proc.returncode is None and after_stop == 0 and len(results) >= 4:
            agent.proc.send_signal(signal.SIGTERM)
            after_stop = 1
        elif after_stop:
            after_stop += 1
        time.sleep(0.004)
    wait_for(lambda: not agent.socket.exists(), "the agent's socket removed", 10, 0.005)
    late = exec_plugin(plugin, "ADD", cfg, container="late")  # after the stop began
    assert late.returncode == 1 and late.json["code"] == 11, late
    for t in threads:
        t.join(60)

    slow.sendall(request[len(request) // 2 :])  # finished after the stop: still served
    status, out = read_answer(slow.recv)
    slow.close()
    assert status == 0, out
    slow_ip = json.loads(out)["ips"][0]["address"].split("/")[0]
    assert agent.proc.wait(30) == 0

    held = holders(sqlite_url)
    assert held.pop("slow") == [slow_ip]
    assert "late" not in held
    succeeded = {c: address(r) for c, r in results.items() if r.returncode == 0}
    for container, result in results.items():
        if container in succeeded:
            assert held.get(container) == [succeeded[container]]  # recorded exactly once
        else:
            assert result.json["code"] == 11, result
            assert container not in held  # a refused call left nothing
    assert set(held) == set(succeeded)
    assert succeeded and len(succeeded) < len(containers), "the stop fell outside the burst"
    stopped = [e["msg"] for e in agent.logs()]
    assert "drained" in stopped and stopped[-1] == "agent stopped"
    assert_check_clean(sqlite_url)


def test_sigkill_mid_allocation_leaves_the_retry_its_address(plugin, sqlite_url, start_agent):
    rng = random.Random(20261122)
    socket_path = None
    cfg: dict = {}
    outcome: dict[str, str | None] = {}  # container -> address returned (None: failed)
    for round_ in range(6):
        agent = start_agent(sqlite_url, socket_path)
        socket_path = agent.socket
        cfg = config(socket_path)
        # Retries of last round's failed ADDs: what the store holds for them is theirs.
        before = holders(sqlite_url)
        for container, ip in list(outcome.items()):
            if ip is None:
                retry = address(exec_plugin(plugin, "ADD", cfg, container=container))
                if container in before:
                    assert before[container] == [retry]
                outcome[container] = retry
        results: dict[str, PluginResult] = {}
        batch = [f"r{round_}c{i}" for i in range(12)]

        def one(container: str, results: dict = results, cfg: dict = cfg) -> None:
            results[container] = exec_plugin(plugin, "ADD", cfg, container=container)

        threads = [threading.Thread(target=one, args=(c,)) for c in batch]
        for t in threads:
            t.start()
        # Kill while calls stream through: a few ms after the first answer.
        wait_for(lambda results=results: results, "a first answer", 10, 0.001)
        time.sleep(rng.uniform(0.0, 0.015))
        agent.kill()
        for t in threads:
            t.join(60)
        held = holders(sqlite_url)
        for container, result in results.items():
            if result.returncode == 0:
                outcome[container] = address(result)
                assert held[container] == [outcome[container]]
            else:
                assert result.json["code"] == 11, result
                outcome[container] = None
                assert len(held.get(container, [])) <= 1
    agent = start_agent(sqlite_url, socket_path)
    before = holders(sqlite_url)
    for container, ip in outcome.items():
        if ip is None:
            retry = address(exec_plugin(plugin, "ADD", cfg, container=container))
            if container in before:
                assert before[container] == [retry]
            outcome[container] = retry
    assert agent.stop() == 0
    held = holders(sqlite_url)
    assert held == {c: [ip] for c, ip in outcome.items()}
    assert len({ip for ips in held.values() for ip in ips}) == len(held)
    assert_check_clean(sqlite_url)


# -- metrics and health --------------------------------------------------------------------


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_and_health(plugin, etcd, start_agent):
    run_cli("pool", "create", "web", "--range", "10.50.0.0/24", store=etcd.url, check=True)
    agent = start_agent(etcd.url, metrics=True)
    base = agent.metrics_url()
    assert base is not None
    assert base.startswith("http://127.0.0.1:")  # loopback
    cfg = config(agent.socket, pool="web")
    address(exec_plugin(plugin, "ADD", cfg, container="m1"))
    address(exec_plugin(plugin, "ADD", cfg, container="m2"))
    assert exec_plugin(plugin, "DEL", cfg, container="m1").returncode == 0
    unknown = exec_plugin(plugin, "ADD", config(agent.socket, pool="nope"), container="m3")
    assert unknown.json["code"] == 103, unknown

    code, text = http_get(f"{base}/metrics")
    assert code == 200
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['ipward_agent_requests_total{code="0",command="ADD"}'] == 2
    assert samples['ipward_agent_requests_total{code="0",command="DEL"}'] == 1
    assert samples['ipward_agent_requests_total{code="103",command="ADD"}'] == 1
    assert samples['ipward_agent_request_seconds_count{command="ADD"}'] == 3
    assert samples["ipward_agent_in_flight"] == 0
    assert samples[f'ipward_agent_info{{node="{NODE}"}}'] == 1
    assert not any(k.startswith("python_gc") for k in samples)  # its own registry
    assert http_get(f"{base}/healthz") == (200, "ok\n")

    etcd.stop()

    def unhealthy() -> tuple[int, str] | None:
        health = http_get(f"{base}/healthz")
        return health if health[0] != 200 else None

    health = wait_for(unhealthy, "/healthz to stop answering 200", 15, 0.1)
    assert health[0] == 503 and "store" in health[1], health
    down = exec_plugin(plugin, "ADD", cfg, container="m4")
    assert down.returncode == 1 and down.json["code"] == 11, down
    code, text = http_get(f"{base}/metrics")
    assert 'ipward_agent_requests_total{code="11",command="ADD"} 1.0' in text
    assert agent.stop() == 0


def test_cli_exposes_the_agent():
    out = subprocess.run(
        [sys.executable, "-m", "ipward", "agent", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in ("--node", "--store", "--socket", "--metrics-address", "--drain-seconds"):
        assert option in out


def test_status_names_the_live_agents_and_the_leading_controller(sqlite_url, start_agent, tmp_path):
    """`ipward status` shows who serves: the nodes whose agent holds its registration,
    and the controller that leads; none once they stop."""

    def status() -> dict:
        return json.loads(run_cli("--json", "status", store=sqlite_url, check=True).stdout)

    run_cli("pool", "create", "web", "--range", "10.5.0.0/24", store=sqlite_url, check=True)
    agent = start_agent(sqlite_url, extra=("--duty-interval", "0.1", "--node-ttl", "2"))
    ctl = fleet.Controller("c7", sqlite_url, tmp_path, ("--lease-ttl", "2", "--interval", "0.2"))
    try:
        ctl.wait_started()
        shown = wait_for(
            lambda: (s := status())["leader"] and s["nodes"] and s, "the agent and the leader"
        )
        assert shown["nodes"] == [NODE] and shown["leader"]["id"] == "c7"
        text = run_cli("status", store=sqlite_url, check=True).stdout
        assert "leader    c7 (since" in text and "nodes     1 with a live agent" in text
    finally:
        ctl.stop()
    agent.stop()
    wait_for(lambda: not (s := status())["leader"] and not s["nodes"], "both gone")
    text = run_cli("status", store=sqlite_url, check=True).stdout
    assert "(no controller leads)" in text and "nodes     0 with a live agent" in text


def test_agent_registers_its_node_and_answers_the_handshake(
    plugin, sqlite_url, start_agent, tmp_path
):
    """The agent keeps nodes/<node> under a lease, answers `ready` for an empty marked
    block of its own and `refused` for one holding an allocation, and deregisters when
    it stops."""
    run_cli(
        "pool",
        "create",
        "web",
        "--range",
        "10.5.0.0/24",
        "--block-v4",
        "28",
        store=sqlite_url,
        check=True,
    )
    agent = start_agent(sqlite_url, extra=("--duty-interval", "0.1", "--node-ttl", "2"))
    cfg = config(agent.socket, pool="web")
    held = exec_plugin(plugin, "ADD", cfg, container="held")
    assert held.returncode == 0, held
    with open_store(sqlite_url) as store:
        assert wait_for(lambda: store.get(keys.node_key(NODE)), "registration").lease
        spec = PoolSpec.from_dict(rec.decode(store.get("pools/web").value))
        spare = blocks.assign(store, spec, 4, NODE)
        busy = "10.5.0.0/28"
        for cidr in (spare, busy):
            kv = store.get(keys.block_key("web", cidr))
            assert blocks.mark(store, "web", kv, time.time())

        def state(cidr: str) -> str:
            return rec.decode(store.get(keys.block_key("web", cidr)).value)["state"]

        wait_for(lambda: state(spare) == rec.READY, "ready for the empty block")
        wait_for(lambda: state(busy) == rec.REFUSED, "refused for the block in use")
        assert agent.stop() == 0
        assert wait_for(lambda: store.get(keys.node_key(NODE)) is None, "deregistration")


# -- batches and the store's transaction limits --------------------------------------------

PAUSED = {"IPWARD_TEST_PAUSES": "allocate=0.5"}  # commits wait: callers pile up in batches


def concurrent(plugin: Path, command: str, cfg: dict, containers: list[str]) -> dict:
    """Exec the plugin for every container at once; container -> PluginResult, or the
    exception when no answer came (a hung call times out)."""
    results: dict[str, PluginResult | Exception] = {}

    def one(container: str) -> None:
        try:
            results[container] = exec_plugin(plugin, command, cfg, container=container)
        except Exception as e:  # a hang: subprocess.TimeoutExpired
            results[container] = e

    threads = [threading.Thread(target=one, args=(c,)) for c in containers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def assert_all_answered(results: dict) -> None:
    for container, result in results.items():
        assert not isinstance(result, Exception), (container[:8], result)
        assert result.returncode == 0, result


def dual_stack_pool_with_a_free_queue(plugin: Path, url: str, agent_cfg: dict, size: int) -> None:
    """A dual-stack pool whose addresses come back from the free queue at once (cooldown
    0): the costliest batch member, three compares and three writes per family."""
    run_cli(
        "pool", "create", "dual", "--range", "10.60.0.0/24", "--range", "fd60::/120",
        "--cooldown", "0", store=url, check=True,
    )  # fmt: skip
    warm = [f"warm{i}" for i in range(size)]
    assert_all_answered(concurrent(plugin, "ADD", agent_cfg, warm))
    assert_all_answered(concurrent(plugin, "DEL", agent_cfg, warm))


def race(plugin: Path, calls: list[tuple[str, str]], cfg: dict) -> list[PluginResult]:
    """Exec the plugin for every (command, container) at once, in that order of start;
    their answers in the same order (every one must come)."""
    results: list[PluginResult | None] = [None] * len(calls)

    def one(i: int, command: str, container: str) -> None:
        results[i] = exec_plugin(plugin, command, cfg, container=container)

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results), results
    return [r for r in results if r is not None]


@pytest.mark.parametrize("store_kind", ["sqlite", "etcd"])
def test_racing_calls_of_one_attachment_act_one_after_the_other(
    plugin, sqlite_url, etcd, start_agent, store_kind
):
    """Finding (hostile pass 2): ADDs of one attachment arriving together, with a DEL of
    it racing them (a runtime's retry, a timeout), were combined by the agent into one
    transaction that wrote a record for each: the attachment held two addresses of one
    pool, and after its final DEL one record stayed. Calls of one attachment now act as
    if one after the other, whatever the batching: at every point the attachment holds
    at most one address, the one its index lists, and after the final DEL nothing."""
    url = sqlite_url if store_kind == "sqlite" else etcd.url
    run_cli("pool", "create", "pods", "--range", "10.61.0.0/24", store=url, check=True)
    # Commits wait, so the calls pile up behind the others' batch and meet in the next.
    paused = {"IPWARD_TEST_PAUSES": "allocate=0.2"}
    agent = start_agent(url, env=paused, extra=("--max-workers", "32"))
    cfg = config(agent.socket, pool="pods")
    for rnd in range(2):
        dup = f"dup{rnd}"
        others = [("ADD", f"other{rnd}-{i}") for i in range(3)]
        calls = [*others, *[("ADD", dup)] * 5, ("DEL", dup), *[("ADD", dup)] * 2]
        results = race(plugin, calls, cfg)
        assert all(r.returncode == 0 for r in results), [r for r in results if r.returncode]
        held = holders(url)
        assert len(held.get(dup, [])) <= 1, held
        proc = run_cli("--json", "check", store=url)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert exec_plugin(plugin, "DEL", cfg, container=dup).returncode == 0
        assert dup not in holders(url)
    assert agent.stop() == 0
    assert_check_clean(url)


def test_a_del_racing_an_add_of_its_attachment_frees_what_the_add_commits(
    plugin, sqlite_url, start_agent, tmp_path
):
    """Finding (hostile pass 2): a DEL arriving while an ADD of its attachment was still
    to commit (a runtime's DEL after the ADD timed out) found nothing, answered success,
    and the ADD's address stayed held by a torn-down sandbox until GC. Now the DEL waits
    for its turn, after the ADD, and frees what it committed."""
    run_cli("pool", "create", "pods", "--range", "10.61.0.0/24", store=sqlite_url, check=True)
    gate = Gate(tmp_path, "allocate")
    agent = start_agent(sqlite_url, env={"IPWARD_TEST_GATES": gate.env["IPWARD_TEST_GATES"]})
    cfg = config(agent.socket, pool="pods")
    added = race_in_background(plugin, "ADD", cfg, "slow")
    gate.wait_reached()  # the ADD has picked its address and waits to commit
    deleted = race_in_background(plugin, "DEL", cfg, "slow")
    waiting = "a call waits for another call of its attachment"
    wait_for(lambda: deleted.done() or agent.logged(waiting), "the DEL answered, or waiting")
    gate.open()
    assert address(added.result(timeout=60))
    assert deleted.result(timeout=60).returncode == 0
    assert "slow" not in holders(sqlite_url)
    assert_check_clean(sqlite_url)


def race_in_background(plugin: Path, command: str, cfg: dict, container: str) -> Future:
    return _BACKGROUND.submit(exec_plugin, plugin, command, cfg, container=container)


_BACKGROUND = ThreadPoolExecutor(4)


def test_a_sticky_takeover_waits_while_the_runtime_lists_the_old_sandbox(
    plugin, sqlite_url, start_agent, tmp_path
):
    """Finding (a real cluster, a StatefulSet pod force-deleted): its successor took the
    sticky address while the old sandbox's teardown was still going on. The agent asks its
    runtime (`--liveness`): while it lists the old sandbox, the new one's ADD is 11 and
    nothing is written; once it lists it no more, the address moves."""
    state = tmp_path / "state.json"
    cluster = {"pods": [], "nodes": [NODE], "statefulsets": {}}

    def runtime_lists(*ids: str) -> None:
        sandboxes = [Sandbox(i, ready=True, namespace="db", name="db-0") for i in ids]
        write_sim_state(str(state), time.time(), cluster, {NODE: {"sandboxes": sandboxes}})

    runtime_lists()
    agent = start_agent(sqlite_url, extra=("--liveness", f"sim://{state}"))
    ranges = [[{"subnet": "10.20.0.0/24"}]]
    cfg = config(agent.socket, ranges=ranges, sticky=True)
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=db;K8S_POD_NAME=db-0"
    first = address(exec_plugin(plugin, "ADD", cfg, container="old", args=args))
    runtime_lists("old")  # force-deleted: the old sandbox's teardown has not ended
    before = snapshot(sqlite_url)
    waits = exec_plugin(plugin, "ADD", cfg, container="new", args=args)
    assert waits.returncode == 1 and waits.json["code"] == 11, waits
    assert "still lists" in waits.json["msg"]
    assert snapshot(sqlite_url) == before
    runtime_lists("new")  # torn down (its DEL never came); the new sandbox is created
    assert address(exec_plugin(plugin, "ADD", cfg, container="new", args=args)) == first
    assert_check_clean(sqlite_url)


def test_concurrent_dual_stack_adds_all_answered_and_agent_still_serves(plugin, etcd, start_agent):
    """Finding: 24 concurrent ADDs of a dual-stack pool made one batch of 168 writes,
    which etcd refused ("too many operations in txn request"); the batch's callers were
    never woken nor the lead handed on, and the agent hung. Now a batch stops before the
    store's limit and every caller is answered."""
    agent = start_agent(etcd.url, env=PAUSED, extra=("--max-workers", "32"))
    cfg = config(agent.socket, pool="dual")
    dual_stack_pool_with_a_free_queue(plugin, etcd.url, cfg, 40)
    containers = [f"d{i}" for i in range(40)]
    results = concurrent(plugin, "ADD", cfg, containers)
    assert_all_answered(results)
    assert all(len(r.json["ips"]) == 2 for r in results.values())
    held = holders(etcd.url)
    assert {c: sorted(held[c]) for c in containers} == {
        c: sorted(a["address"].split("/")[0] for a in r.json["ips"]) for c, r in results.items()
    }
    combined = [e["batch"] for e in agent.logs() if e["msg"] == "allocated" and "batch" in e]
    assert combined and max(combined) > 1  # batches were combined, within the limits
    assert address(exec_plugin(plugin, "ADD", cfg, container="after"))
    assert agent.stop() == 0
    assert_check_clean(etcd.url)


def test_concurrent_adds_with_long_container_ids_all_answered(plugin, start_agent, tmp_path):
    """Finding: 16 ADDs with 40 KB container IDs made one batch larger than etcd takes
    ("request is too large"), and every caller in it waited forever. Container IDs are
    bounded now (255 characters), and whatever the store refuses, each caller is
    answered: here etcd takes less than a batch of long IDs (8 KiB a request), so
    batches are refused and served one by one."""
    with etcd_server(tmp_path / "etcd", extra_args=["--max-request-bytes=8192"]) as etcd:
        run_cli("pool", "create", "web", "--range", "10.61.0.0/24", store=etcd.url, check=True)
        agent = start_agent(etcd.url, env=PAUSED, extra=("--max-workers", "32"))
        cfg = config(agent.socket, pool="web")
        containers = [f"{i:02d}" + "c" * 253 for i in range(32)]  # 255 characters, valid
        assert_all_answered(concurrent(plugin, "ADD", cfg, containers))
        assert sorted(holders(etcd.url)) == sorted(containers)
        too_long = exec_plugin(plugin, "ADD", cfg, container="c" * 256)
        assert too_long.returncode == 1 and too_long.json["code"] == 4, too_long
        assert "255" in too_long.json["msg"]
        assert address(exec_plugin(plugin, "ADD", cfg, container="after"))
        assert agent.stop() == 0
        assert_check_clean(etcd.url)


def test_store_refusing_a_batch_still_answers_every_caller(plugin, start_agent, tmp_path):
    """The store raises something the ledger did not foresee inside a batch (etcd run
    with fewer operations per transaction than its default): every caller of the batch
    is answered, served one by one."""
    with etcd_server(tmp_path / "etcd", extra_args=["--max-txn-ops=16"]) as etcd:
        agent = start_agent(etcd.url, env=PAUSED, extra=("--max-workers", "32"))
        cfg = config(agent.socket, pool="dual")
        dual_stack_pool_with_a_free_queue(plugin, etcd.url, cfg, 24)
        containers = [f"s{i}" for i in range(24)]
        assert_all_answered(concurrent(plugin, "ADD", cfg, containers))
        assert any(e["msg"].startswith("combined allocation failed") for e in agent.logs())
        assert address(exec_plugin(plugin, "ADD", cfg, container="after"))
        assert agent.stop() == 0
        assert_check_clean(etcd.url)


def test_an_add_the_store_refuses_as_too_large_is_107_and_writes_nothing(
    plugin, start_agent, tmp_path
):
    """etcd run with fewer operations per transaction than ipward assumes: the first ADD
    of a new dual-stack pool (it claims a block of each family in its allocating
    transaction) cannot fit; it gets code 107 and the store is unchanged."""
    with etcd_server(tmp_path / "etcd", extra_args=["--max-txn-ops=8"]) as etcd:
        agent = start_agent(etcd.url)
        run_cli(
            "pool", "create", "fresh", "--range", "10.70.0.0/24", "--range", "fd70::/120",
            store=etcd.url, check=True,
        )  # fmt: skip
        with open_store(etcd.url) as store:
            before = store.revision()
        wide = exec_plugin(plugin, "ADD", config(agent.socket, pool="fresh"), "wide")
        assert wide.returncode == 1 and wide.json["code"] == 107, wide
        assert "too many operations" in wide.json["msg"]
        with open_store(etcd.url) as store:
            assert store.revision() == before
        assert agent.stop() == 0
        assert_check_clean(etcd.url)


def test_healthz_reports_a_request_stuck_in_flight(plugin, sqlite_url, start_agent):
    """Finding: with every worker stuck, /healthz still said ok. A request that waits
    for a worker or its answer longer than --stuck-seconds makes it 503, naming why."""
    slow = {"IPWARD_TEST_PAUSES": "allocate=8"}
    agent = start_agent(sqlite_url, metrics=True, env=slow, extra=("--stuck-seconds", "1"))
    base = agent.metrics_url()
    assert base is not None
    assert http_get(f"{base}/healthz") == (200, "ok\n")
    cfg = config(agent.socket)
    done: list[PluginResult] = []
    caller = threading.Thread(target=lambda: done.append(exec_plugin(plugin, "ADD", cfg, "s1")))
    caller.start()
    stuck = wait_for(
        lambda: (h := http_get(f"{base}/healthz"))[0] == 503 and h, "healthz to see it stuck"
    )
    assert "in flight" in stuck[1] and "ADD" in stuck[1], stuck
    caller.join(60)
    assert address(done[0])
    wait_for(lambda: http_get(f"{base}/healthz") == (200, "ok\n"), "healthz ok again")
    assert agent.stop() == 0


# -- slow, idle and hostile clients ------------------------------------------------------------

IDLE_CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
print("connected", flush=True)
trickle = float(sys.argv[3])
s.setblocking(False)
answer = b""
while True:
    try:
        chunk = s.recv(65536)
    except BlockingIOError:
        if trickle:
            s.send(b"x")  # a byte at a time, never a whole request
        time.sleep(trickle or 0.05)
        continue
    if not chunk:
        break
    answer += chunk
print(answer.hex(), flush=True)
"""


class Client:
    """A process of its own (a peer of its own) that connects, sends `first`, then sits
    idle or trickles a byte every `trickle` seconds; it ends once the agent answers."""

    def __init__(self, path: Path, first: bytes, trickle: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IDLE_CLIENT, str(path), first.hex(), str(trickle)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "connected"

    @property
    def waiting(self) -> bool:
        """Still connected, not answered yet."""
        return self.proc.poll() is None

    def answer(self) -> dict:
        """The error object the agent answered with (waits for it)."""
        out, _ = self.proc.communicate(timeout=60)
        status, stdout = read_answer(io.BytesIO(bytes.fromhex(out.strip())).read)
        assert status == 1
        return dict(json.loads(stdout))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(path: Path, first: bytes, trickle: float = 0.0) -> Client:
        made.append(Client(path, first, trickle))
        return made[-1]

    yield make
    for client in made:
        client.kill()


def test_idle_clients_cost_nothing_to_others(plugin, sqlite_url, start_agent, clients):
    """Finding: 16 idle connections delayed every ADD by 10 s (the acceptor took a
    worker for each and the worker waited on it). Now 24 idle peers, each its own
    process, more than there are workers: an ADD is answered while they are connected."""
    agent = start_agent(sqlite_url)
    idle = [clients(agent.socket, b"") for _ in range(24)]
    added = exec_plugin(plugin, "ADD", config(agent.socket), container="busy-day")
    assert address(added)
    assert all(client.waiting for client in idle)  # they were connected all along
    for client in idle:  # and each is told, at its deadline, that nothing was done
        assert client.answer()["code"] == 11
    assert agent.running


def test_a_byte_trickler_is_cut_off_by_the_deadline_of_its_request(
    plugin, sqlite_url, start_agent, clients
):
    """Finding: 16 clients sending a byte every 5 s blocked ADDs indefinitely (the
    timeout was per read). The deadline is for the whole request: each trickler is
    answered 11 though it never stops sending, and ADDs go through meanwhile."""
    agent = start_agent(sqlite_url)
    header = REQUEST_MAGIC + (4096).to_bytes(4, "big")  # then its body, a byte at a time
    tricklers = [clients(agent.socket, header, trickle=0.5) for _ in range(16)]
    assert address(exec_plugin(plugin, "ADD", config(agent.socket), container="during"))
    assert all(client.waiting for client in tricklers)
    for client in tricklers:
        error = client.answer()
        assert error["code"] == 11 and "incomplete" in error["msg"], error
    assert address(exec_plugin(plugin, "ADD", config(agent.socket), container="after"))


def test_a_flood_of_connections_is_turned_away_at_once(plugin, sqlite_url, start_agent):
    """Finding: 200 connections filled the listen backlog (11, then 60 s timeouts for
    everyone). Now all 200 are accepted; those past one process's cap are answered 11
    at once without being read, and an ADD from another process goes through."""
    agent = start_agent(sqlite_url, metrics=True)
    flood = []
    for _ in range(200):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(str(agent.socket))  # never refused nor left in a full backlog
        flood.append(s)
    try:
        added = exec_plugin(plugin, "ADD", config(agent.socket), container="in-the-flood")
        assert address(added)
        codes = []
        for s in flood[MAX_READING_PER_PROCESS:]:
            status, out = read_answer(s.recv)
            codes.append((status, json.loads(out)["code"]))
        assert codes == [(1, 11)] * (200 - MAX_READING_PER_PROCESS)
        assert agent.metric("ipward_agent_turned_away_total", reason="process") == len(codes)
    finally:
        for s in flood:
            s.close()
    assert agent.running


def test_past_max_connections_calls_are_answered_11(plugin, sqlite_url, start_agent, clients):
    agent = start_agent(sqlite_url, extra=("--max-connections", "4"))
    idle = [clients(agent.socket, b"") for _ in range(4)]
    busy = exec_plugin(plugin, "ADD", config(agent.socket), container="c1")
    assert busy.returncode == 1 and busy.json["code"] == 11, busy
    assert "4 connections open" in busy.json["msg"]
    for client in idle:
        client.kill()
    wait_for(
        lambda: exec_plugin(plugin, "ADD", config(agent.socket), container="c1").returncode == 0,
        "room again",
    )


@pytest.mark.skipif(os.getuid() != 0 or not Path(SETPRIV).exists(), reason="needs root, setpriv")
def test_refusals_and_garbage_need_no_worker(plugin, sqlite_url, start_agent, open_dir):
    """With the only worker held by a slow ADD, a refused peer and a malformed request
    are still answered (by the I/O thread) before that ADD ends."""
    slow = {"IPWARD_TEST_PAUSES": "allocate=8"}
    launcher = public_plugin(open_dir)  # first: the agent makes an empty directory 0750
    agent = start_agent(
        sqlite_url,
        open_dir / "agent.sock",
        metrics=True,
        env=slow,
        extra=("--max-workers", "1"),
    )
    agent.socket.chmod(0o666)
    cfg = config(agent.socket)
    held: list[PluginResult] = []
    holder = threading.Thread(target=lambda: held.append(exec_plugin(plugin, "ADD", cfg, "h")))
    holder.start()
    wait_for(lambda: agent.metric("ipward_agent_in_flight") == 1, "the ADD in the worker")
    nobody = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    refused = exec_as(nobody, launcher, "ADD", cfg, "theirs")
    assert refused.json["code"] == 5, refused
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(agent.socket))
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        status, out = read_answer(s.recv)
    assert status == 1 and json.loads(out)["code"] == 6
    assert holder.is_alive()  # the ADD still holds the only worker
    holder.join(60)
    assert address(held[0])


def test_txn_bytes_bounds_what_etcd_counts(tmp_path):
    """`txn_bytes` is an upper bound of a transaction's size as etcd counts it against
    --max-request-bytes: transactions of several shapes, grown while estimated under an
    etcd's limit (and within its 128 operations), are all taken; the estimate is never
    below the protobuf encoding."""
    from ipward.store import etcd as etcd_store
    from ipward.store.base import VALUE, Compare, Put, absent, at_revision, txn_bytes

    limit = 32 << 10
    container = "c" * 200
    shapes = {
        "puts": lambda i: ([], [Put(f"ips/p/10.0.0.{i}", b"r" * 300)]),
        "large values": lambda i: ([], [Put(f"big/{i}", b"v" * 9_000)]),
        "compares and puts": lambda i: (
            [absent(f"attach/n1/net/{container}{i}/eth0"), at_revision(f"blocks/p/{i}", 2**40)],
            [Put(f"attach/n1/net/{container}{i}/eth0", b'{"ips":["p/10.0.0.1"]}')],
        ),
        "value compares": lambda i: ([Compare(f"k{i}", VALUE, "==", b"x" * 3000)], []),
    }
    with etcd_server(tmp_path / "etcd", extra_args=[f"--max-request-bytes={limit}"]) as etcd:
        store = open_store(etcd.url)
        try:
            for name, member in shapes.items():
                compares: list = []
                ops: list = []
                for i in range(128):
                    more_compares, more_ops = member(i)
                    grown = (compares + more_compares, ops + more_ops)
                    if txn_bytes(*grown, ()) > limit or max(map(len, grown)) > 128:
                        break
                    compares, ops = grown
                assert txn_bytes(compares, ops, ()) > limit * 0.8, name  # near the limit
                request = etcd_store.rpc.TxnRequest(
                    compare=[etcd_store._compare(c) for c in compares],
                    success=[etcd_store._op(o) for o in ops],
                )
                assert request.ByteSize() < txn_bytes(compares, ops, ()), name
                assert store.txn(compares, ops)  # TxnTooLarge if etcd counts more
        finally:
            store.close()
