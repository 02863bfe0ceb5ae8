"""The simulated cluster (`ipward_lab.simcluster`) with the real plugin and real agents on
SQLite: what its lifecycles send to the plugin (ADD, DEL at stop, DEL at remove, none
for a completed Job, none when dropped, late when delayed), what the store then holds,
and what it publishes, read back the way agents and controllers read it
(`SimFileSource`), faults included."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ipward.cluster.liveness import LivenessUnavailable, Pod
from ipward.core import records as rec
from ipward.store import open_store
from ipward_lab.fleet import run_cli
from ipward_lab.simcluster import SimCluster, SimFileSource
from ipward_lab.soak.checker import Checker
from ipward_lab.soak.result import Options, Result
from ipward_lab.soak.world import agents
from support import ManualClock

NODES = ["node-a", "node-b", "node-c"]
NETWORK = "simnet"
POOL = "simpool"


@dataclass
class Lab:
    store: str
    plugin: Path
    sockets: dict[str, str]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cni_bin: Path) -> Iterator[Lab]:
    """One store, one pool, an agent per node, shared by the module's tests (each test
    uses its own namespaces)."""
    tmp = tmp_path_factory.mktemp("sim")
    store = f"sqlite://{tmp}/ipward.db"
    run_cli("pool", "create", POOL, "--range", "10.44.0.0/16", store=store, check=True)
    with agents(tmp, store, NODES) as running:
        yield Lab(store, cni_bin / "ipward", {n: str(a.socket) for n, a in running.items()})


@pytest.fixture
def make_sim(lab: Lab, tmp_path: Path) -> Iterator[Callable[..., SimCluster]]:
    """Started clusters over the lab's nodes; stopped at teardown, where none may have
    logged an error."""
    made: list[SimCluster] = []

    def make(**kwargs: Any) -> SimCluster:
        path = tmp_path / f"state-{len(made)}.json"
        sim = SimCluster(str(path), str(lab.plugin), NETWORK, POOL, **kwargs)
        for node in NODES:
            sim.add_node(node, lab.sockets[node])
        made.append(sim)
        return sim.start()

    yield make
    for sim in made:
        sim.stop()
        errors = [e for e in sim.events if e[1] == "error"]
        assert not errors, errors


@pytest.fixture
def sim(make_sim: Callable[..., SimCluster]) -> SimCluster:
    return make_sim()


def records(url: str) -> dict[str, dict]:
    """Allocation records by address."""
    with open_store(url) as store:
        kvs, _ = store.range(f"ips/{POOL}/")
    return {kv.key.rsplit("/", 1)[1]: rec.decode(kv.value) for kv in kvs}


def running(sim: SimCluster, namespace: str) -> list[Pod]:
    return [p for p in sim.pods(namespace) if p.phase == "Running" and p.deleted_at is None]


def uids(sim: SimCluster, namespace: str | None = None) -> set[str]:
    return {p.uid for p in sim.pods(namespace)}


def wait_running(sim: SimCluster, namespace: str, count: int) -> list[Pod]:
    sim.wait_until(
        lambda: len(running(sim, namespace)) == count == len(sim.pods(namespace)),
        what=f"{count} pods running in {namespace}",
    )
    return running(sim, namespace)


def calls(sim: SimCluster, sandbox: str) -> list[tuple[str, str, int]]:
    return [(c.command, c.why, c.returncode) for c in sim.calls_for(sandbox)]


def event_index(sim: SimCluster, pattern: str) -> int:
    """Position of the first event whose detail matches."""
    for i, (_, _, detail) in enumerate(sim.events):
        if re.search(pattern, detail):
            return i
    raise AssertionError(f"no event matches {pattern!r}")


def assert_invariants(sim: SimCluster, lab: Lab) -> None:
    """The soak's live checks on this cluster's pods: no address on two ready pods, no
    ready pod's record lost (`ipward_lab.soak.checker`)."""
    with open_store(lab.store) as store:
        found = Checker(sim, store, Result(Options()), pool=POOL).check_once()
    assert not found, found


def assert_check_clean(lab: Lab) -> None:
    proc = run_cli("check", store=lab.store)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- lifecycles ----------------------------------------------------------------------


def test_pods_get_distinct_addresses_and_the_runtime_lists_their_sandboxes(
    sim: SimCluster, lab: Lab
) -> None:
    started = time.monotonic()
    for i in range(9):
        sim.create_pod("plain", f"p{i}")
    pods = wait_running(sim, "plain", 9)
    elapsed = time.monotonic() - started
    addresses = [sim.address_of(p) for p in pods]
    assert len(set(addresses)) == 9 and None not in addresses
    assert_invariants(sim, lab)
    assert Counter(p.node for p in pods) == {n: 3 for n in NODES}  # least-loaded
    held = records(lab.store)
    source = SimFileSource(sim.state_path)
    cluster = source.cluster_view()
    assert cluster.nodes == frozenset(NODES)
    for pod in pods:
        [sandbox] = sim.sandboxes_of(pod)
        assert re.fullmatch("[0-9a-f]{64}", sandbox)
        listed = source.node_view(pod.node).sandboxes[sandbox]
        assert listed.ready and listed.uid == pod.uid and listed.name == pod.name
        record = held[str(sim.address_of(pod))]
        assert record["container"] == sandbox and record["node"] == pod.node
        assert record["pod"] == {
            "namespace": "plain",
            "name": pod.name,
            "uid": pod.uid,
            "infra_container": sandbox,
        }
        assert cluster.pods[pod.uid].phase == "Running"
    adds = [c for c in sim.calls if c.command == "ADD"]
    assert len(adds) == 9 and all(c.returncode == 0 for c in adds)
    print(
        f"ADD through an agent: median {statistics.median(c.elapsed_ms for c in adds):.1f} ms,"
        f" max {max(c.elapsed_ms for c in adds):.1f} ms; 9 pods running in {elapsed:.2f} s"
    )


def test_deletion_waits_the_grace_then_stops_and_removes_with_two_dels(
    make_sim: Callable[..., SimCluster], lab: Lab
) -> None:
    dels_may_run = threading.Event()
    dels_may_run.set()
    sim: SimCluster  # the wrapper below calls the cluster's own exec

    def held_dels(
        node: str, command: str, env: dict[str, str], stdin: bytes
    ) -> tuple[int, bytes, bytes]:
        if command == "DEL":
            assert dels_may_run.wait(10)
        return sim.exec_plugin(node, command, env, stdin)

    sim = make_sim(cni_exec=held_dels, exit_after=None)  # containers run out the grace
    pod = sim.create_pod("del", "web")
    [pod] = wait_running(sim, "del", 1)
    ip = str(sim.address_of(pod))
    [sandbox] = sim.sandboxes_of(pod)
    source = SimFileSource(sim.state_path)
    dels_may_run.clear()
    sim.delete_pod(pod, grace=1.0)
    # Within the grace: deleted in the API, the sandbox still ready, no DEL yet.
    published = source.cluster_view().pods[pod.uid]
    assert published.deleted_at is not None and published.grace == 1.0
    assert source.node_view(pod.node).sandboxes[sandbox].ready
    assert calls(sim, sandbox) == [("ADD", "add", 0)]
    # Past the grace: StopPodSandbox lists it not ready and sends its DEL (held here).
    sim.wait_until(
        lambda: not source.node_view(pod.node).sandboxes[sandbox].ready, what="sandbox stopped"
    )
    assert ip in records(lab.store)
    assert pod.uid in uids(sim)
    dels_may_run.set()
    sim.wait_until(lambda: pod.uid not in uids(sim), what="pod gone")
    assert calls(sim, sandbox) == [("ADD", "add", 0), ("DEL", "stop", 0), ("DEL", "remove", 0)]
    assert sandbox not in source.node_view(pod.node).sandboxes
    assert pod.uid not in source.cluster_view().pods
    assert ip not in records(lab.store)
    assert_check_clean(lab)


def test_failed_add_is_retried_with_a_new_sandbox_and_a_restart_replaces_it(
    make_sim: Callable[..., SimCluster], lab: Lab
) -> None:
    clock = ManualClock(1000.0)
    failures = ["injected: agent busy"]
    sim: SimCluster

    def flaky(
        node: str, command: str, env: dict[str, str], stdin: bytes
    ) -> tuple[int, bytes, bytes]:
        if command == "ADD" and failures:
            return 11, f'{{"code": 11, "msg": "{failures.pop()}"}}'.encode(), b""
        return sim.exec_plugin(node, command, env, stdin)

    sim = make_sim(cni_exec=flaky, clock=clock, retry_delay=1.0)
    pod = sim.create_pod("retry", "web")
    sim.wait_until(lambda: any(c.why == "add-failed" for c in sim.calls), what="failed ADD")
    [failed] = sim.sandboxes_of(pod)
    assert calls(sim, failed) == [("ADD", "add", 11), ("DEL", "add-failed", 0)]
    source = SimFileSource(sim.state_path)
    assert source.cluster_view().pods[pod.uid].phase == "Pending"
    assert not any(source.node_view(n).sandboxes for n in NODES)  # never listed
    clock.advance(1.0)  # the kubelet's retry is due
    [pod] = wait_running(sim, "retry", 1)
    first, second = sim.sandboxes_of(pod)
    assert first == failed and second != failed
    assert records(lab.store)[str(sim.address_of(pod))]["container"] == second

    sim.restart_pod(pod)
    sim.wait_until(
        lambda: len(sim.sandboxes_of(pod)) == 3 and sim.address_of(pod) is not None,
        what="a third sandbox running",
    )
    third = sim.sandboxes_of(pod)[2]
    sim.wait_until(lambda: len(calls(sim, second)) == 3, what="old sandbox removed")
    assert calls(sim, second) == [("ADD", "add", 0), ("DEL", "stop", 0), ("DEL", "remove", 0)]
    log = sim.calls
    stop_at = next(i for i, c in enumerate(log) if c.sandbox == second and c.why == "stop")
    add_at = next(i for i, c in enumerate(log) if c.sandbox == third and c.command == "ADD")
    assert stop_at < add_at  # the old sandbox is stopped before the new one's ADD
    assert sim.pod(pod).uid == pod.uid and sim.pod(pod).phase == "Running"
    mine = [r for r in records(lab.store).values() if r["pod"]["uid"] == pod.uid]
    assert [r["container"] for r in mine] == [third]
    assert source.node_view(pod.node).sandboxes.keys() == {third}

    # Force: out of the API at once; the kubelet tears the orphan sandbox down.
    sim.delete_pod(pod, force=True)
    assert pod.uid not in source.cluster_view().pods
    sim.wait_until(lambda: len(calls(sim, third)) == 3, what="orphan torn down")
    assert calls(sim, third) == [("ADD", "add", 0), ("DEL", "stop", 0), ("DEL", "remove", 0)]
    assert not [r for r in records(lab.store).values() if r["pod"]["uid"] == pod.uid]


def test_deployment_scales_and_rolls_new_pods_before_old(sim: SimCluster, lab: Lab) -> None:
    sim.create_deployment("dep", "web", 3)
    pods = wait_running(sim, "dep", 3)
    assert all(re.fullmatch("web-[a-z]{5}", p.name) for p in pods)
    assert {(p.owner_kind, p.owner_name) for p in pods} == {("Deployment", "web")}
    sim.scale("dep", "web", 5)
    wait_running(sim, "dep", 5)
    sim.scale("dep", "web", 2)
    pods = wait_running(sim, "dep", 2)
    held = {ip for ip, r in records(lab.store).items() if r["pod"]["namespace"] == "dep"}
    assert held == {sim.address_of(p) for p in pods}  # the three removed were freed

    old = {p.uid for p in pods}
    ready_seen: list[int] = []

    def rolled() -> bool:
        ready_seen.append(len(running(sim, "dep")))
        current = uids(sim, "dep")
        return len(running(sim, "dep")) == 2 and len(current) == 2 and not current & old

    sim.rolling_restart("dep", "web")
    sim.wait_until(rolled, what="rolled")
    assert min(ready_seen) >= 2  # never fewer ready than replicas
    new = running(sim, "dep")
    first_new_running = min(event_index(sim, f"running dep/{p.name} ") for p in new)
    first_old_deleted = min(event_index(sim, f"deleted dep/.* {uid}") for uid in old)
    assert first_new_running < first_old_deleted
    held = {ip for ip, r in records(lab.store).items() if r["pod"]["namespace"] == "dep"}
    assert held == {sim.address_of(p) for p in new}
    assert_invariants(sim, lab)
    assert_check_clean(lab)


def test_statefulset_comes_back_with_the_same_names_and_new_uids(sim: SimCluster, lab: Lab) -> None:
    source = SimFileSource(sim.state_path)
    sim.create_statefulset("sts", "db", 3)  # OrderedReady
    pods = wait_running(sim, "sts", 3)
    assert [p.name for p in pods] == ["db-0", "db-1", "db-2"]
    published = source.cluster_view().pods
    for pod in pods:
        assert (pod.owner_kind, pod.owner_name) == ("StatefulSet", "db")
        assert (published[pod.uid].owner_kind, published[pod.uid].owner_name) == (
            "StatefulSet",
            "db",
        )
    # One at a time, each after the previous one ran.
    assert event_index(sim, "running sts/db-0 ") < event_index(sim, "created sts/db-1 ")
    assert event_index(sim, "running sts/db-1 ") < event_index(sim, "created sts/db-2 ")
    assert source.cluster_view().statefulsets == {"sts/db": 3}
    before = {p.name: p.uid for p in pods}

    sim.scale("sts", "db", 0)
    sim.wait_until(lambda: not sim.pods("sts"), what="scaled to 0")
    assert source.cluster_view().statefulsets == {"sts/db": 0}
    # Down from the highest ordinal, each gone before the next is deleted.
    assert (
        event_index(sim, "deleted sts/db-2 ")
        < event_index(sim, "gone sts/db-2 ")
        < event_index(sim, "deleted sts/db-1 ")
        < event_index(sim, "gone sts/db-1 ")
        < event_index(sim, "deleted sts/db-0 ")
    )
    assert not [r for r in records(lab.store).values() if r["pod"]["namespace"] == "sts"]

    sim.scale("sts", "db", 3)
    pods = wait_running(sim, "sts", 3)
    after = {p.name: p.uid for p in pods}
    assert after.keys() == before.keys()
    assert not set(after.values()) & set(before.values())

    assert source.cluster_view().statefulsets == {"sts/db": 3}

    sim.create_statefulset("sts", "par", 3, ordered=False)
    sim.wait_until(lambda: len([p for p in running(sim, "sts") if p.owner_name == "par"]) == 3)
    assert source.cluster_view().statefulsets == {"sts/db": 3, "sts/par": 3}
    listed = source.cluster_view().pods.values()
    assert {(p.name, p.owner_kind, p.owner_name) for p in listed if p.namespace == "sts"} == {
        *((f"db-{i}", "StatefulSet", "db") for i in range(3)),
        *((f"par-{i}", "StatefulSet", "par") for i in range(3)),
    }
    sim.scale("sts", "par", 1)
    assert source.cluster_view().statefulsets == {"sts/db": 3, "sts/par": 1}
    sim.wait_until(lambda: [p.name for p in sim.pods("sts") if p.owner_name == "par"] == ["par-0"])
    # Parallel: both deleted before either is gone.
    last_deleted = max(event_index(sim, f"deleted sts/par-{i} ") for i in (1, 2))
    assert last_deleted < min(event_index(sim, f"gone sts/par-{i} ") for i in (1, 2))

    sim.delete_statefulset("sts", "db")
    assert source.cluster_view().statefulsets == {"sts/par": 1}
    sim.delete_statefulset("sts", "par")
    sim.wait_until(lambda: not sim.pods("sts"), what="sets deleted")
    assert source.cluster_view().statefulsets == {}
    assert not [r for r in records(lab.store).values() if r["pod"]["namespace"] == "sts"]
    assert_check_clean(lab)


def test_completed_job_keeps_its_sandbox_and_address_until_its_ttl(
    make_sim: Callable[..., SimCluster], lab: Lab
) -> None:
    clock = ManualClock(1000.0)
    sim = make_sim(clock=clock)
    source = SimFileSource(sim.state_path)
    sim.create_job("job", "kept", completions=2, parallelism=2, duration=5)
    sim.create_job("job", "ttl", completions=1, duration=5, ttl_after_finished=60)
    wait_running(sim, "job", 3)

    def succeeded(owner: str) -> list[Pod]:
        return [p for p in sim.pods("job") if p.owner_name == owner and p.phase == "Succeeded"]

    clock.advance(5)
    sim.wait_until(lambda: len(succeeded("kept")) == 2 and len(succeeded("ttl")) == 1)
    [ttl_pod] = succeeded("ttl")
    held = records(lab.store)
    for pod in [*succeeded("kept"), ttl_pod]:
        assert pod.finished_at == clock.now and pod.owner_kind == "Job"
        [sandbox] = sim.sandboxes_of(pod)
        listed = source.node_view(pod.node).sandboxes[sandbox]
        assert not listed.ready  # stopped, not removed
        assert calls(sim, sandbox) == [("ADD", "add", 0)]  # nobody freed the address
        assert held[str(sim.address_of(pod))]["container"] == sandbox
    assert sim.ready_addresses() == {}  # completed pods are not ready

    clock.advance(60)
    sim.wait_until(lambda: ttl_pod.uid not in uids(sim), what="TTL")
    [sandbox] = sim.sandboxes_of(ttl_pod)
    assert calls(sim, sandbox) == [("ADD", "add", 0), ("DEL", "stop", 0), ("DEL", "remove", 0)]
    assert not [r for r in records(lab.store).values() if r["container"] == sandbox]
    # The Job without a TTL keeps its pods, sandboxes and addresses.
    kept = succeeded("kept")
    assert len(kept) == 2
    assert all(sim.address_of(p) in records(lab.store) for p in kept)


def test_node_down_hides_its_runtime_and_delete_node_moves_its_pods(
    sim: SimCluster, lab: Lab
) -> None:
    source = SimFileSource(sim.state_path)
    sim.create_deployment("nodes", "web", 3)
    sim.create_statefulset("nodes", "db", 3, ordered=False)
    pods = wait_running(sim, "nodes", 6)
    assert Counter(p.node for p in pods) == {n: 2 for n in NODES}

    sim.node_down("node-b")
    with pytest.raises(LivenessUnavailable, match="unreachable"):
        source.node_view("node-b")
    cluster = source.cluster_view()
    on_b = [p for p in pods if p.node == "node-b"]
    assert all(cluster.pods[p.uid].phase == "Running" for p in on_b)
    assert "node-b" in cluster.nodes
    web_b = next(p for p in on_b if p.owner_kind == "Deployment")
    [web_b_sandbox] = sim.sandboxes_of(web_b)
    sim.delete_pod(web_b)
    sim.wait_until(lambda: len(running(sim, "nodes")) == 6, what="replacement running")
    # The kubelet of node-b is away: the pod stays deleted in the API, no DEL is sent.
    assert sim.pod(web_b).deleted_at is not None
    assert calls(sim, web_b_sandbox) == [("ADD", "add", 0)]
    [replacement] = [p for p in running(sim, "nodes") if p.uid not in {q.uid for q in pods}]
    assert replacement.node != "node-b"
    sim.node_up("node-b")
    sim.wait_until(lambda: web_b.uid not in uids(sim), what="node-b catches up")
    assert [c[1] for c in calls(sim, web_b_sandbox)] == ["add", "stop", "remove"]

    on_c = [p for p in sim.pods("nodes") if p.node == "node-c"]
    sim.delete_node("node-c")
    assert not {p.uid for p in on_c} & uids(sim)  # force-deleted at once
    sim.wait_until(lambda: len(running(sim, "nodes")) == 6, what="recreated elsewhere")
    assert {p.node for p in running(sim, "nodes")} <= {"node-a", "node-b"}
    db_c = next(p for p in on_c if p.owner_kind == "StatefulSet")
    again = sim.pod(f"nodes/{db_c.name}")
    assert again.uid != db_c.uid and again.node != "node-c"
    cluster = source.cluster_view()
    assert cluster.nodes == {"node-a", "node-b"}
    with pytest.raises(LivenessUnavailable):
        source.node_view("node-c")
    # Nobody sent their DELs: their records are left for garbage collection.
    held = records(lab.store)
    for pod in on_c:
        [sandbox] = sim.sandboxes_of(pod)
        assert calls(sim, sandbox) == [("ADD", "add", 0)]
        assert any(r["container"] == sandbox for r in held.values())
    assert_invariants(sim, lab)


# -- faults, as SimFileSource reads them ---------------------------------------------


def test_lag_publishes_an_old_state_with_its_old_as_of(
    make_sim: Callable[..., SimCluster],
) -> None:
    clock = ManualClock(1000.0)
    sim = make_sim(clock=clock)
    source = SimFileSource(sim.state_path)
    a = sim.create_pod("lag", "a", node="node-a")
    wait_running(sim, "lag", 1)
    [sandbox_a] = sim.sandboxes_of(a)
    clock.advance(10)
    b = sim.create_pod("lag", "b", node="node-a")
    wait_running(sim, "lag", 2)
    clock.advance(10)
    sim.publish()
    assert source.cluster_view().as_of == 1020.0

    sim.lag_cluster(15)  # the newest state at least 15 s old: the one of t=1000
    cluster = source.cluster_view()
    assert cluster.as_of == 1000.0 and set(cluster.pods) == {a.uid}
    runtime = source.node_view("node-a")
    assert runtime.as_of == 1000.0  # one as_of for the file: the oldest part's
    assert len(runtime.sandboxes) == 2  # the runtime itself is current

    sim.clear_faults()
    sim.lag_runtime("node-a", 15)
    runtime = source.node_view("node-a")
    assert runtime.as_of == 1000.0 and set(runtime.sandboxes) == {sandbox_a}
    cluster = source.cluster_view()
    assert cluster.as_of == 1000.0 and set(cluster.pods) == {a.uid, b.uid}
    assert source.node_view("node-b").as_of == 1000.0

    sim.clear_faults()
    assert source.cluster_view().as_of == 1020.0
    assert len(source.node_view("node-a").sandboxes) == 2


def test_fail_and_stall_make_the_source_unavailable(make_sim: Callable[..., SimCluster]) -> None:
    clock = ManualClock(1000.0)
    sim = make_sim(clock=clock)
    source = SimFileSource(sim.state_path, timeout=0.2)
    sim.fail_cluster("apiserver: connection refused")
    with pytest.raises(LivenessUnavailable, match="apiserver: connection refused"):
        source.cluster_view()
    assert source.node_view("node-a").sandboxes == {}  # the runtimes still answer
    sim.fail_runtime("node-b", "containerd: deadline exceeded")
    with pytest.raises(LivenessUnavailable, match="containerd: deadline exceeded"):
        source.node_view("node-b")
    source.node_view("node-a")
    sim.clear_faults()
    source.cluster_view()
    source.node_view("node-b")

    sim.stall_runtime("node-a", 5)
    with pytest.raises(LivenessUnavailable, match="no answer"):
        source.node_view("node-a")
    source.node_view("node-b")
    clock.advance(5)
    sim.publish()  # the stall is over
    assert source.node_view("node-a").as_of == 1005.0


def test_dropped_dels_leave_the_record_and_delayed_dels_free_it_later(
    make_sim: Callable[..., SimCluster], lab: Lab
) -> None:
    clock = ManualClock(1000.0)
    sim = make_sim(clock=clock)
    source = SimFileSource(sim.state_path)
    for name in ("dropped", "by-rate", "delayed"):
        sim.create_pod("faults", name)
    pods = {p.name: p for p in wait_running(sim, "faults", 3)}
    sandboxes = {name: sim.sandboxes_of(p)[0] for name, p in pods.items()}
    addresses = {name: str(sim.address_of(p)) for name, p in pods.items()}

    def gone_without_dels(name: str) -> None:
        pod = pods[name]
        sim.wait_until(lambda: pod.uid not in uids(sim), what=f"{name} gone")
        assert sandboxes[name] not in source.node_view(pod.node).sandboxes
        assert calls(sim, sandboxes[name]) == [("ADD", "add", 0)]
        assert records(lab.store)[addresses[name]]["container"] == sandboxes[name]

    sim.drop_del(pods["dropped"])
    sim.delete_pod(pods["dropped"])
    gone_without_dels("dropped")

    sim.drop_del_rate = 1.0
    sim.delete_pod(pods["by-rate"])
    gone_without_dels("by-rate")
    sim.drop_del_rate = 0.0

    sim.delay_del(pods["delayed"], 30)
    sim.delete_pod(pods["delayed"])
    gone_without_dels("delayed")
    clock.advance(30)
    sim.wait_until(lambda: len(calls(sim, sandboxes["delayed"])) == 3, what="delayed DELs")
    assert calls(sim, sandboxes["delayed"]) == [
        ("ADD", "add", 0),
        ("DEL", "delayed", 0),
        ("DEL", "delayed", 0),
    ]
    assert addresses["delayed"] not in records(lab.store)


# -- annotations and restart phases ----------------------------------------------------


def test_pod_and_namespace_annotations_are_published_and_lag_with_the_cluster(
    make_sim: Callable[..., SimCluster],
) -> None:
    clock = ManualClock(1000.0)
    sim = make_sim(clock=clock)
    source = SimFileSource(sim.state_path)
    sim.set_namespace("ann", {"ipward.io/pool": "simpool"})
    sim.set_namespace("bare", {})
    own = {"ipward.io/address": "10.44.9.9"}
    solo = sim.create_pod("ann", "solo", annotations=own)
    own["changed"] = "after"  # the pod kept a copy
    plain = sim.create_pod("ann", "plain")
    template = {"team": "web"}
    sim.create_deployment("ann", "web", 2, annotations=template)
    template["changed"] = "after"
    sim.create_statefulset("ann", "db", 2, ordered=False, annotations={"team": "db"})
    sim.create_job("ann", "batch", duration=100, annotations={"team": "batch"})
    pods = wait_running(sim, "ann", 7)
    expected = {
        "Deployment": {"team": "web"},
        "StatefulSet": {"team": "db"},
        "Job": {"team": "batch"},
    }
    cluster = source.cluster_view()
    assert cluster.namespaces == {"ann": {"ipward.io/pool": "simpool"}, "bare": {}}
    for pod in pods:
        want = expected.get(pod.owner_kind, {})
        if pod.uid == solo.uid:
            want = {"ipward.io/address": "10.44.9.9"}
        assert pod.annotations == want, pod
        assert cluster.pods[pod.uid].annotations == want, pod
    assert cluster.pods[plain.uid].annotations == {}
    with open(sim.state_path) as f:
        raw = json.load(f)["cluster"]
    assert raw["namespaces"]["ann"] == {"ipward.io/pool": "simpool"}
    assert {p["name"]: p["annotations"] for p in raw["pods"]}["solo"] == solo.annotations
    # A Pod handed out is a copy: changing it changes nothing in the model.
    sim.pod(solo).annotations["x"] = "y"
    assert sim.pod(solo).annotations == {"ipward.io/address": "10.44.9.9"}
    with pytest.raises(TypeError):
        sim.create_pod("ann", "bad", annotations={"n": 1})  # type: ignore[dict-item]

    # Pods an owner creates later get its template too.
    [web] = [p for p in pods if p.owner_kind == "Deployment"][:1]
    sim.delete_pod(web, force=True)
    sim.wait_until(lambda: len(running(sim, "ann")) == 7, what="replacement running")
    [replacement] = [p for p in running(sim, "ann") if p.uid not in {q.uid for q in pods}]
    assert replacement.owner_kind == "Deployment"
    assert source.cluster_view().pods[replacement.uid].annotations == {"team": "web"}

    clock.advance(10)
    sim.set_namespace("ann", {"ipward.io/pool": "other"})  # replaced, not merged
    sim.annotate_pod("ann/solo", {"b": "2"})  # replaced, not merged
    cluster = source.cluster_view()
    assert cluster.as_of == 1010.0
    assert cluster.namespaces["ann"] == {"ipward.io/pool": "other"}
    assert cluster.pods[solo.uid].annotations == {"b": "2"}
    assert sim.pod(solo).annotations == {"b": "2"}

    sim.lag_cluster(5)  # the state of t=1000: namespaces and pods as they were
    cluster = source.cluster_view()
    assert cluster.as_of == 1000.0
    assert cluster.namespaces == {"ann": {"ipward.io/pool": "simpool"}, "bare": {}}
    assert cluster.pods[solo.uid].annotations == {"ipward.io/address": "10.44.9.9"}
    sim.clear_faults()
    cluster = source.cluster_view()
    assert cluster.namespaces == {"ann": {"ipward.io/pool": "other"}, "bare": {}}
    assert cluster.pods[solo.uid].annotations == {"b": "2"}


def test_restart_phases_failed_then_pending_then_running_with_a_new_sandbox(
    make_sim: Callable[..., SimCluster], lab: Lab
) -> None:
    clock = ManualClock(1000.0)
    may_add = threading.Event()
    may_add.set()
    adding = threading.Event()  # an ADD has started while held
    sim: SimCluster

    def held_adds(
        node: str, command: str, env: dict[str, str], stdin: bytes
    ) -> tuple[int, bytes, bytes]:
        if command == "ADD" and not may_add.is_set():
            adding.set()
            assert may_add.wait(10)
        return sim.exec_plugin(node, command, env, stdin)

    def adds_of(pod: Pod) -> list[float]:
        return [c.at for c in sim.calls if c.uid == pod.uid and c.command == "ADD"]

    sim = make_sim(cni_exec=held_adds, clock=clock)
    source = SimFileSource(sim.state_path)
    plain = sim.create_pod("phases", "plain", node="node-a")
    slow = sim.create_pod("phases", "slow", node="node-b")
    wait_running(sim, "phases", 2)
    with pytest.raises(ValueError):
        sim.restart_pod(slow, failed_for=-1)

    # Both 0, as before: Running throughout, no address while the new ADD is in flight.
    may_add.clear()
    sim.restart_pod(plain)
    assert adding.wait(10)
    assert sim.pod(plain).phase == "Running" and sim.address_of(plain) is None
    assert source.cluster_view().pods[plain.uid].phase == "Running"
    assert not [s for s in source.node_view("node-a").sandboxes.values() if s.ready]
    may_add.set()
    sim.wait_until(lambda: sim.address_of(plain) is not None, what="plain running again")
    assert len(sim.sandboxes_of(plain)) == 2

    # Failed 5 s, then Pending 3 s, then the new sandbox.
    [old] = sim.sandboxes_of(slow)
    old_ip = sim.address_of(slow)
    may_add.clear()
    adding.clear()
    sim.restart_pod(slow, failed_for=5, pending_for=3)
    published = source.cluster_view().pods[slow.uid]
    assert published.phase == "Failed" and published.finished_at is None
    assert (published.name, published.deleted_at) == ("slow", None)
    assert sim.address_of(slow) is None
    sim.wait_until(lambda: len(calls(sim, old)) == 3, what="old sandbox stopped and removed")
    assert calls(sim, old) == [("ADD", "add", 0), ("DEL", "stop", 0), ("DEL", "remove", 0)]
    assert [c.at for c in sim.calls_for(old) if c.command == "DEL"] == [1000.0, 1000.0]
    assert old_ip not in records(lab.store)
    assert source.node_view("node-b").sandboxes == {}
    assert source.cluster_view().pods[slow.uid].phase == "Failed"
    assert sim.pod(slow).phase == "Failed"

    clock.advance(5)
    sim.wait_until(lambda: sim.pod(slow).phase == "Pending", what="Pending after Failed")
    assert source.cluster_view().pods[slow.uid].phase == "Pending"
    clock.advance(2)
    sim.wait_ticks(3)  # still no sandbox started
    assert not adding.is_set() and adds_of(slow) == [1000.0]
    assert source.cluster_view().pods[slow.uid].phase == "Pending"

    clock.advance(1)
    assert adding.wait(10)  # the ADD is in flight: still Pending, no address, not listed
    assert sim.pod(slow).phase == "Pending" and sim.address_of(slow) is None
    assert source.cluster_view().pods[slow.uid].phase == "Pending"
    assert source.node_view("node-b").sandboxes == {}
    may_add.set()
    sim.wait_until(
        lambda: sim.pod(slow).phase == "Running" and sim.address_of(slow) is not None,
        what="slow running again",
    )
    assert adds_of(slow) == [1000.0, 1008.0]
    _, new = sim.sandboxes_of(slow)
    again = source.cluster_view().pods[slow.uid]
    assert (again.uid, again.name, again.phase) == (slow.uid, "slow", "Running")
    assert source.node_view("node-b").sandboxes[new].ready
    assert records(lab.store)[str(sim.address_of(slow))]["container"] == new

    # Pending only: Pending at once, the new sandbox 2 s later.
    sim.restart_pod(plain, pending_for=2)
    assert source.cluster_view().pods[plain.uid].phase == "Pending"
    sim.wait_ticks(3)
    assert adds_of(plain) == [1000.0, 1000.0] and sim.address_of(plain) is None
    clock.advance(2)
    sim.wait_until(lambda: sim.pod(plain).phase == "Running", what="plain running again")
    assert adds_of(plain) == [1000.0, 1000.0, 1010.0] and sim.address_of(plain) is not None

    # A Job's pod in a restart's Failed phase is neither finished nor replaced.
    sim.create_job("phases-job", "batch", duration=100, node="node-c")
    [job_pod] = wait_running(sim, "phases-job", 1)
    sim.restart_pod(job_pod, failed_for=5)
    sim.wait_ticks(3)
    [still] = sim.pods("phases-job")
    assert (still.uid, still.phase, still.finished_at) == (job_pod.uid, "Failed", None)
    clock.advance(5)
    [job_pod] = wait_running(sim, "phases-job", 1)
    assert job_pod.uid == still.uid and len(sim.sandboxes_of(job_pod)) == 2
    assert_invariants(sim, lab)
