"""ipward under a real containerd (1.6, CRI plugin, runc, Debian's bridge), driven through
CRI with `ipward.cluster.cri.CriClient`; and `CriSource`, the CRI liveness source, against that
containerd and against a stand-in CRI server (hung, failing, slow).

The containerd tests (marked `net`) share one containerd per module (`ipward_lab.containerd.lab`);
each test removes its own sandboxes. They need root and Debian's containerd, runc, gcc,
libc6-dev and containernetworking-plugins: without them they fail, they do not skip.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from ipward.cluster import cri
from ipward.cluster.cri import CriClient, CriError, CriSource
from ipward.cluster.liveness import LivenessUnavailable, NotCovered, Sandbox, open_source
from ipward.core.errors import InvalidConfig
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.containerd.lab import CALL_TIMEOUT, REQUIRED, ContainerdLab, LabError, machine_state
from ipward_lab.fleet import run_cli
from ipward_lab.waiting import wait_for
from support import exec_plugin

NETWORK = "ipward-cri"
SUBNET = "10.77.0.0/24"
GATEWAY = "10.77.0.1"
NODE = "node-1"

net = pytest.mark.net


def start_lab(workdir: Path, plugin: Path, ipam: dict[str, Any]) -> ContainerdLab:
    lab = ContainerdLab(workdir, plugin, ipam, NETWORK)
    try:
        lab.start()
    except LabError as e:
        lab.stop()
        pytest.fail(f"containerd lab: {e}", pytrace=False)
    return lab


@pytest.fixture(scope="module")
def module_lab(
    tmp_path_factory: pytest.TempPathFactory, cni_bin: Path
) -> Iterator[tuple[ContainerdLab, str]]:
    """One containerd for the module, its network on in-process SQLite; and the store URL."""
    work = tmp_path_factory.mktemp("ctrd")
    store_url = f"sqlite://{work}/ipward.db"
    ipam = {
        "type": "ipward",
        "store": store_url,
        "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]],
    }
    lab = start_lab(work / "lab", cni_bin / "ipward", ipam)
    yield lab, store_url
    lab.stop()
    assert lab.leftovers == [], f"containerd lab teardown left: {lab.leftovers}"


@pytest.fixture
def lab(module_lab: tuple[ContainerdLab, str]) -> Iterator[ContainerdLab]:
    """The module's containerd; after the test, every sandbox removed (with the network
    config the test left, as a runtime does) and the module's network config restored."""
    the_lab = module_lab[0]
    ipam, bridge = dict(the_lab.ipam), the_lab.bridge
    yield the_lab
    for sandbox in the_lab.cri().list_pod_sandboxes():
        the_lab.remove_pod(sandbox.id)
    if (the_lab.ipam, the_lab.bridge) != (ipam, bridge):
        the_lab.write_network(ipam, bridge)


@pytest.fixture
def store_url(module_lab: tuple[ContainerdLab, str]) -> str:
    return module_lab[1]


def allocations(url: str, pool: str = NETWORK) -> dict[str, dict[str, Any]]:
    """`ips/<pool>/<ip>` records by address."""
    store = open_store(url)
    try:
        kvs, _ = store.range(f"ips/{pool}/")
    finally:
        store.close()
    return {kv.key.rsplit("/", 1)[1]: json.loads(kv.value) for kv in kvs}


def store_snapshot(url: str) -> tuple[dict[str, bytes], int]:
    store = open_store(url)
    try:
        kvs, revision = store.range("")
    finally:
        store.close()
    return {kv.key: kv.value for kv in kvs}, revision


def eth0_addresses(lab: ContainerdLab, sandbox_id: str) -> list[str]:
    out = lab.in_sandbox(sandbox_id, "ip", "-o", "-4", "addr", "show", "dev", "eth0")
    assert out.returncode == 0, out.stderr
    return [line.split()[3] for line in out.stdout.splitlines()]


def ping(lab: ContainerdLab, sandbox_id: str, ip: str) -> None:
    out = lab.in_sandbox(sandbox_id, "ping", "-c1", "-W2", ip)
    assert out.returncode == 0, f"ping {ip} from {sandbox_id[:12]}: {out.stdout}{out.stderr}"


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def ipward_check(url: str) -> None:
    out = run_cli("check", store=url)
    assert out.returncode == 0, f"ipward check: {out.stdout}{out.stderr}"


# -- through CRI: addresses, traffic, release ----------------------------------------------


@net
def test_two_pods_get_addresses_from_ipward_and_ping_each_other(
    lab: ContainerdLab, store_url: str
) -> None:
    before = machine_state()
    a = lab.run_pod("web-a", "team1")
    b = lab.run_pod("web-b", "team1")
    sa, sb = lab.cri().pod_sandbox_status(a), lab.cri().pod_sandbox_status(b)
    assert sa.ready and sb.ready
    ips = [sa.ip, sb.ip]
    assert len(set(ips)) == 2, ips
    for ip in ips:
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(SUBNET)
        assert ip != GATEWAY
    # the address containerd reports is the one on eth0 and the one ipward recorded
    assert eth0_addresses(lab, a) == [f"{sa.ip}/24"]
    assert eth0_addresses(lab, b) == [f"{sb.ip}/24"]
    records = allocations(store_url)
    assert records[sa.ip]["container"] == a
    assert records[sb.ip]["container"] == b
    ping(lab, a, sb.ip)
    ping(lab, b, sa.ip)
    # the bridge and forwarding are containerd's namespace's, not the machine's
    host_forward = lab.in_host("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip()
    assert host_forward == "1"  # bridge with isGateway turned it on there
    after = machine_state()
    assert (after["ip_forward"], after["links"]) == (before["ip_forward"], before["links"])

    lab.remove_pod(a)
    lab.remove_pod(b)
    assert sa.ip not in allocations(store_url)
    assert sb.ip not in allocations(store_url)
    ipward_check(store_url)


@net
def test_stop_then_remove_frees_the_address_once(lab: ContainerdLab, store_url: str) -> None:
    a = lab.run_pod("job-1", "batch")
    ip = lab.cri().pod_sandbox_status(a).ip
    assert ip in allocations(store_url)
    attach_key = f"attach/{os.uname().nodename}/{NETWORK}/{a}/eth0"
    assert attach_key in store_snapshot(store_url)[0]

    lab.cri().stop_pod_sandbox(a)
    assert not lab.cri().pod_sandbox_status(a).ready
    assert ip not in allocations(store_url)  # the first DEL freed it
    assert attach_key not in store_snapshot(store_url)[0]
    assert [c["command"] for c in lab.cni_calls(a)] == ["ADD", "DEL"]
    snapshot = store_snapshot(store_url)

    lab.cri().remove_pod_sandbox(a)
    assert [c["command"] for c in lab.cni_calls(a)] == ["ADD", "DEL", "DEL"], (
        "containerd 1.6 sends DEL again on RemovePodSandbox"
    )
    assert store_snapshot(store_url) == snapshot  # the second DEL changed nothing at all
    assert a not in {s.id for s in lab.cri().list_pod_sandboxes()}
    with pytest.raises(CriError) as e:
        lab.cri().pod_sandbox_status(a)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    ipward_check(store_url)


@net
def test_the_allocation_names_the_pod(lab: ContainerdLab, store_url: str) -> None:
    uid = str(uuid.uuid4())
    a = lab.run_pod("db-0", "prod", uid=uid)
    ip = lab.cri().pod_sandbox_status(a).ip
    record = allocations(store_url)[ip]
    assert record["pod"] == {"namespace": "prod", "name": "db-0", "uid": uid, "infra_container": a}
    assert (record["network"], record["container"], record["ifname"]) == (NETWORK, a, "eth0")
    assert record["node"] == os.uname().nodename
    (add,) = [c for c in lab.cni_calls(a) if c["command"] == "ADD"]
    args = dict(kv.split("=", 1) for kv in add["args"].split(";"))
    assert args == {
        "IgnoreUnknown": "1",
        "K8S_POD_NAMESPACE": "prod",
        "K8S_POD_NAME": "db-0",
        "K8S_POD_INFRA_CONTAINER_ID": a,
        "K8S_POD_UID": uid,
    }
    listed = run_cli("--json", "alloc", "list", "--pod", "prod/db-0", store=store_url)
    assert listed.returncode == 0, listed.stderr
    assert [(r["ip"], r["pod"]["uid"]) for r in json.loads(listed.stdout)] == [(ip, uid)]
    lab.remove_pod(a)


# -- CriSource against containerd ------------------------------------------------------------


@net
def test_cri_source_lists_sandboxes_ready_then_not_ready_then_gone(lab: ContainerdLab) -> None:
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    t0 = time.time()
    a = lab.run_pod("api-0", "shop", uid=uid_a)
    b = lab.run_pod("api-1", "shop", uid=uid_b)
    t1 = time.time()
    source = open_source(f"cri://{lab.address}", node=NODE, timeout=5.0)
    assert isinstance(source, CriSource)
    try:
        before = time.time()
        view = source.node_view(NODE)
        after = time.time()
        assert view.node == NODE
        assert before <= view.as_of <= after
        assert set(view.sandboxes) == {a, b}
        sa = view.sandboxes[a]
        assert sa == Sandbox(a, True, "shop", "api-0", uid_a, sa.created_at)
        assert view.sandboxes[b] == Sandbox(
            b, True, "shop", "api-1", uid_b, view.sandboxes[b].created_at
        )
        for s in view.sandboxes.values():
            assert t0 - 1 <= s.created_at <= t1 + 1  # seconds, not nanoseconds
        assert view.duplicate_pods() == {}

        with pytest.raises(NotCovered):
            source.node_view("node-2")
        with pytest.raises(NotCovered):
            source.cluster_view()

        lab.cri().stop_pod_sandbox(a)
        view = source.node_view(NODE)
        assert view.sandboxes[a].ready is False
        assert view.sandboxes[a].uid == uid_a
        assert view.sandboxes[b].ready is True

        lab.cri().remove_pod_sandbox(a)
        view = source.node_view(NODE)
        assert set(view.sandboxes) == {b}
    finally:
        source.close()
    lab.remove_pod(b)


def test_a_cri_source_without_its_node_is_refused(tmp_path: Path) -> None:
    """One runtime's list is no evidence about another node's sandboxes: a CRI source
    answers for the node it is given, and cannot be opened without one (the controller
    and `ipward gc` without --node would have judged every node's records by it)."""
    with pytest.raises(ValueError, match="one node"):
        CriSource(str(tmp_path / "cri.sock"), node="")
    with pytest.raises(InvalidConfig, match="answers for one node only"):
        open_source(f"cri://{tmp_path}/cri.sock")
    url = f"sqlite://{tmp_path}/ipward.db"
    run_cli("pool", "create", "p", "--range", "10.77.0.0/24", store=url, check=True)
    with open_store(url) as store:
        before = store.range("")
    for command in (("gc",), ("controller", "--id", "c1")):
        refused = run_cli(*command, "--liveness", f"cri://{tmp_path}/cri.sock", store=url)
        assert refused.returncode == 2, refused
        assert "answers for one node only" in refused.stderr, refused
    with open_store(url) as store:
        assert store.range("") == before


@net
def test_cri_source_of_a_stopped_containerd_is_unavailable(
    tmp_path_factory: pytest.TempPathFactory, cni_bin: Path
) -> None:
    work = tmp_path_factory.mktemp("ctrd-down")
    ipam = {
        "type": "ipward",
        "store": f"sqlite://{work}/ipward.db",
        "subnet": "10.76.0.0/24",
        "gateway": "10.76.0.1",
    }
    lab = start_lab(work / "lab", cni_bin / "ipward", ipam)
    source = CriSource(str(lab.address), node=NODE, timeout=2.0)
    try:
        assert source.node_view(NODE).sandboxes == {}  # reachable and empty
        lab.stop()
        with pytest.raises(LivenessUnavailable) as e:
            source.node_view(NODE)
        assert not isinstance(e.value, NotCovered)
        assert str(lab.address) in str(e.value)
    finally:
        source.close()
        lab.stop()
    assert lab.leftovers == []


# -- an agent behind the plugin ------------------------------------------------------------


@net
def test_pods_through_the_node_agent_which_reconciles_with_containerd(
    lab: ContainerdLab, tmp_path: Path, cni_bin: Path
) -> None:
    """Pods through a real agent whose reconciliation lists containerd's sandboxes over
    CRI: the pods' records are kept (their sandboxes are ready), a record whose sandbox
    containerd never had (an ADD whose runtime crashed before the sandbox existed) is
    freed once the ADD grace has passed, and nothing else."""
    agent_store = f"sqlite://{tmp_path}/agent.db"
    created = run_cli(
        "pool", "create", "pods", "--range", "10.78.0.0/24,gateway=10.78.0.1", store=agent_store
    )
    assert created.returncode == 0, created.stderr
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
    grace = 1.0
    agent = fleet.Agent(
        "agent-node",
        agent_store,
        run_dir / "agent.sock",
        tmp_path,
        (
            "--liveness",
            f"cri://{lab.address}",
            "--add-grace",
            str(grace),
            "--reconcile-interval",
            "0.3",
        ),
    )
    try:
        agent.wait_ready()
        network = {"type": "ipward", "agentSocket": str(agent.socket), "pool": "pods"}
        lab.write_network(network, bridge=f"ipwa{lab.tag}")
        a = lab.run_pod("cache-0", "infra")
        b = lab.run_pod("cache-1", "infra")
        ip_a = lab.cri().pod_sandbox_status(a).ip
        ip_b = lab.cri().pod_sandbox_status(b).ip
        assert ipaddress.ip_address(ip_a) in ipaddress.ip_network("10.78.0.0/24")
        records = allocations(agent_store, "pods")
        assert records[ip_a]["node"] == "agent-node"  # the agent's node, not the config's
        assert records[ip_a]["pod"]["name"] == "cache-0"
        assert records[ip_b]["container"] == b
        ping(lab, a, ip_b)
        config = {"cniVersion": "1.0.0", "name": NETWORK, "ipam": network}
        leaked = exec_plugin(cni_bin / "ipward", "ADD", config, container="never-a-sandbox")
        assert leaked.returncode == 0, leaked
        assert leaked.json is not None
        ip_leaked = leaked.json["ips"][0]["address"].split("/")[0]
        created_at = allocations(agent_store, "pods")[ip_leaked]["created_at"]

        def freed() -> list[dict]:
            return [e for e in agent.logged("freed") if f"pods/{ip_leaked}" in e["ips"]]

        (free,) = wait_for(freed, "the leaked address freed", 60, 0.1)
        assert "sandbox-gone" in free["reason"] and free["ts"] >= created_at + grace
        assert set(allocations(agent_store, "pods")) == {ip_a, ip_b}
        passes = [e for e in agent.logged("reconciled") if e["sandboxes"] >= 2]
        assert passes, "reconciliation never saw containerd's sandboxes"
        lab.remove_pod(a)
        lab.remove_pod(b)
        assert allocations(agent_store, "pods") == {}
        ipward_check(agent_store)
    finally:
        for sandbox in lab.cri().list_pod_sandboxes():  # while the agent still answers DEL
            lab.remove_pod(sandbox.id)
        agent.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


@net
def test_a_del_refused_while_the_agent_was_down_is_finished_by_the_agent_once_back(
    lab: ContainerdLab, tmp_path: Path
) -> None:
    """Finding (a real cluster): a pod deleted while its node's agent was down had its
    CNI DEL refused; containerd stopped the sandbox but kept its network namespace, the
    address still on its veth, and no kubelet retries the teardown of a deleted pod.
    The agent, once back, has the runtime finish the teardown of a sandbox it lists
    stopped on two passes: the DEL comes, the namespace goes, the address is freed."""
    agent_store = f"sqlite://{tmp_path}/agent.db"
    created = run_cli(
        "pool", "create", "pods", "--range", "10.79.0.0/24,gateway=10.79.0.1", store=agent_store
    )
    assert created.returncode == 0, created.stderr
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
    options = ("--liveness", f"cri://{lab.address}", "--reconcile-interval", "0.3")

    def start_agent() -> fleet.Agent:
        return fleet.Agent("agent-node", agent_store, run_dir / "agent.sock", tmp_path, options)

    agent = start_agent().wait_ready()
    try:
        network = {"type": "ipward", "agentSocket": str(agent.socket), "pool": "pods"}
        lab.write_network(network, bridge=f"ipwd{lab.tag}")
        sandbox = lab.run_pod("orphan-0", "infra")
        ip = lab.cri().pod_sandbox_status(sandbox).ip
        assert set(allocations(agent_store, "pods")) == {ip}
        agent.kill()
        with pytest.raises(CriError, match="unreachable"):  # the DEL refused: agent down
            lab.cri().stop_pod_sandbox(sandbox, timeout=CALL_TIMEOUT)
        assert Path(lab.sandbox_netns(sandbox)).exists()  # its address still on its veth
        assert set(allocations(agent_store, "pods")) == {ip}
        agent = start_agent().wait_ready()
        wait_for(lambda: not allocations(agent_store, "pods"), "the address freed by the DEL")
        # Counted once the runtime answers, which is after the DEL it sent came back.
        finished = "ipward_agent_teardowns_finished_total"
        wait_for(lambda: agent.metric(finished) == 1, "the teardown counted")
        (freed,) = agent.logged("freed")
        assert freed["ips"] == [f"pods/{ip}"] and freed["reason"] == "CNI DEL", freed
        assert not Path(lab.sandbox_netns(sandbox)).exists()
        ipward_check(agent_store)
    finally:
        for listed in lab.cri().list_pod_sandboxes():  # while the agent still answers DEL
            lab.remove_pod(listed.id)
        agent.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


# -- host-local compatibility seen through a real runtime --------------------------------------


@net
def test_without_a_gateway_no_pod_gets_the_bridge_address(
    lab: ContainerdLab, tmp_path: Path
) -> None:
    url = f"sqlite://{tmp_path}/nogw.db"
    lab.write_network(
        {"type": "ipward", "store": url, "ranges": [[{"subnet": "10.79.0.0/24"}]]},
        bridge=f"ipwg{lab.tag}",
    )
    a = lab.run_pod("first", "default")
    ip = lab.cri().pod_sandbox_status(a).ip
    out = lab.in_host("ip", "-o", "-4", "addr", "show", "dev", lab.bridge)
    bridge_ips = [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]
    assert bridge_ips == ["10.79.0.1"], f"bridge {lab.bridge} addresses: {bridge_ips}"
    assert ip not in bridge_ips, f"the pod has the bridge's own address {ip}"


# -- the lab's teardown ----------------------------------------------------------------------


@net
def test_teardown_after_containerd_is_killed_leaves_the_machine_as_it_was(
    tmp_path_factory: pytest.TempPathFactory, cni_bin: Path
) -> None:
    before = machine_state()
    work = tmp_path_factory.mktemp("ctrd-crash")
    ipam = {
        "type": "ipward",
        "store": f"sqlite://{work}/ipward.db",
        "subnet": "10.75.0.0/24",
        "gateway": "10.75.0.1",
    }
    lab = start_lab(work / "lab", cni_bin / "ipward", ipam)
    try:
        ids = [lab.run_pod(f"p{i}", "crash") for i in range(2)]
        pids = [int(lab.sandbox_info(i)["pid"]) for i in ids]
        assert machine_state()["ip_forward"] == before["ip_forward"]
        assert lab.in_host("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"
        assert lab.proc is not None
        lab.proc.send_signal(signal.SIGKILL)  # sandboxes, shims, mounts all left behind
        lab.proc.wait()
        assert all(running(pid) for pid in pids)
    finally:
        lab.stop()
    assert lab.leftovers == []
    assert not [pid for pid in pids if running(pid)]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(work) not in mounts
    assert machine_state() == before


def test_a_missing_binary_fails_the_lab_naming_the_package(
    tmp_path: Path, cni_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(REQUIRED, "ipward-no-such-binary", "some-package")
    lab = ContainerdLab(tmp_path / "lab", cni_bin / "ipward", {"type": "ipward"})
    with pytest.raises(LabError, match=r"ipward-no-such-binary \(Debian package some-package\)"):
        lab.start()
    lab.stop()
    assert not (tmp_path / "lab").exists()  # nothing was made
    assert lab.leftovers == []


# -- CriClient and CriSource against a stand-in CRI server (no root needed) ------------------


class StandIn:
    """A CRI server on a Unix socket answering ListPodSandbox with what a test sets:
    sandboxes, a delay, or an error code."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sandboxes: list[Any] = []
        self.delay = 0.0
        self.error: grpc.StatusCode | None = None
        self.requests: list[Any] = []
        self.answered_at = 0.0
        self.release = threading.Event()
        handlers = {
            "ListPodSandbox": grpc.unary_unary_rpc_method_handler(
                self._list,
                request_deserializer=cri.message_class("ListPodSandboxRequest").FromString,
                response_serializer=cri.message_class("ListPodSandboxResponse").SerializeToString,
            ),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(cri.SERVICE, handlers),)
        )
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def _list(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(request)
        if self.delay:
            self.release.wait(self.delay)
        if self.error is not None:
            context.abort(self.error, "stand-in failure")
        self.answered_at = time.time()
        return cri.message("ListPodSandboxResponse", items=self.sandboxes)

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[StandIn]:
    server = StandIn(tmp_path / "cri.sock")
    yield server
    server.stop()


def pod_sandbox(id: str, state: int, created_ns: int, ns: str = "ns", name: str = "p") -> Any:
    return cri.message(
        "PodSandbox",
        id=id,
        metadata=cri.message("PodSandboxMetadata", name=name, namespace=ns, uid=f"uid-{id}"),
        state=state,
        created_at=created_ns,
        labels={"io.kubernetes.pod.name": name},
    )


def test_as_of_is_taken_before_the_call_is_sent(stand_in: StandIn) -> None:
    created = time.time_ns() - 5_000_000_000
    stand_in.sandboxes = [
        pod_sandbox("s1", cri.SANDBOX_READY, created),
        pod_sandbox("s2", cri.SANDBOX_NOTREADY, created, name="q"),
    ]
    stand_in.delay = 0.5
    source = CriSource(str(stand_in.path), node=NODE, timeout=5.0)
    try:
        started = time.time()
        view = source.node_view(NODE)
    finally:
        source.close()
    assert started <= view.as_of < stand_in.answered_at - 0.4
    assert view.sandboxes == {
        "s1": Sandbox("s1", True, "ns", "p", "uid-s1", created / 1e9),
        "s2": Sandbox("s2", False, "ns", "q", "uid-s2", created / 1e9),
    }
    (request,) = stand_in.requests
    assert not request.HasField("filter")  # every sandbox, ready or not


def test_list_filter_reaches_the_runtime(stand_in: StandIn) -> None:
    with CriClient(str(stand_in.path)) as client:
        client.list_pod_sandboxes(state=cri.SANDBOX_READY, label_selector={"a": "b"})
        client.list_pod_sandboxes(id="abc")
    ready, by_id = stand_in.requests
    assert ready.filter.HasField("state") and ready.filter.state.state == cri.SANDBOX_READY
    assert dict(ready.filter.label_selector) == {"a": "b"}
    assert by_id.filter.id == "abc" and not by_id.filter.HasField("state")


def test_a_hung_runtime_is_unavailable_after_the_timeout(stand_in: StandIn) -> None:
    stand_in.delay = 10.0
    source = CriSource(str(stand_in.path), node=NODE, timeout=0.3)
    try:
        with pytest.raises(LivenessUnavailable, match=r"no answer within 0\.3s") as e:
            source.node_view(NODE)
    finally:
        source.close()
    assert isinstance(e.value, CriError) and e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_runtime_error_is_unavailable_not_empty(stand_in: StandIn) -> None:
    stand_in.error = grpc.StatusCode.INTERNAL
    source = CriSource(str(stand_in.path), node=NODE)
    try:
        with pytest.raises(LivenessUnavailable, match="stand-in failure") as e:
            source.node_view(NODE)
    finally:
        source.close()
    assert isinstance(e.value, CriError) and e.value.code == grpc.StatusCode.INTERNAL


def test_an_unreachable_socket_is_unavailable(tmp_path: Path) -> None:
    missing = CriSource(str(tmp_path / "none.sock"), node=NODE)
    # a socket file nobody listens on
    dead_path = tmp_path / "dead.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(dead_path))
    refused = CriSource(str(dead_path), node=NODE)
    try:
        for source in (missing, refused):
            with pytest.raises(LivenessUnavailable, match="unreachable") as e:
                source.node_view(NODE)
            assert not isinstance(e.value, NotCovered)
            assert isinstance(e.value, CriError) and e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        missing.close()
        refused.close()
        dead.close()


def test_a_restarted_runtime_is_seen_again_within_a_second(tmp_path: Path) -> None:
    """grpc fails calls at once while it backs off between reconnects, by default 1 s,
    1.6 s, 2.56 s... up to 120 s; the client caps that at 1 s (+20% jitter)."""
    path = tmp_path / "cri.sock"
    source = CriSource(str(path), node=NODE)
    try:
        down_since = time.monotonic()

        def unavailable_past_the_backoff() -> bool:
            with pytest.raises(LivenessUnavailable):
                source.node_view(NODE)
            return time.monotonic() > down_since + 2.8  # the default backoff passes 2 s

        wait_for(unavailable_past_the_backoff, "2.8 s of polls with the runtime down", 10, 0.1)
        server = StandIn(path)
        try:
            server.sandboxes = [pod_sandbox("s1", cri.SANDBOX_READY, time.time_ns())]
            # The one wait here that bounds a speed: the point of the test.
            view = wait_for(
                lambda: source.node_view(NODE),
                "the restarted runtime seen within 1.4 s",
                1.4,
                0.05,
                passing=(LivenessUnavailable,),
            )
            assert set(view.sandboxes) == {"s1"}
        finally:
            server.stop()
    finally:
        source.close()


def test_a_closed_source_is_unavailable(stand_in: StandIn) -> None:
    source = CriSource(str(stand_in.path), node=NODE)
    source.close()
    with pytest.raises(LivenessUnavailable):
        source.node_view(NODE)


def test_schema_field_numbers_match_the_published_api() -> None:
    """A few numbers spot-checked against k8s.io/cri-api runtime/v1 api.proto on the wire."""
    wire = cri.message(
        "PodSandboxStatusResponse",
        status=cri.message(
            "PodSandboxStatus",
            network=cri.message("PodSandboxNetworkStatus", ip="10.0.0.2"),
            created_at=7,
        ),
    ).SerializeToString()
    # status = 1 (LEN), created_at = 4 (varint), network = 5 (LEN) { ip = 1 }
    assert wire == b"\x0a\x0e" + b"\x20\x07" + b"\x2a\x0a\x0a\x0810.0.0.2"
    config = cri.message(
        "PodSandboxConfig",
        metadata=cri.message("PodSandboxMetadata", name="n", uid="u", namespace="s", attempt=1),
        log_directory="/l",
    ).SerializeToString()
    # metadata = 1 { name = 1, uid = 2, namespace = 3, attempt = 4 }, log_directory = 3
    assert config == b"\x0a\x0b\x0a\x01n\x12\x01u\x1a\x01s\x20\x01" + b"\x1a\x02/l"
