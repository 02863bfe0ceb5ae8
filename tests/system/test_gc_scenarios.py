"""Garbage-collection scenarios (docs/design.md 5.4, 7), each on a real store with real
`ipward agent` and `ipward controller` processes, driven by the simulated cluster
(`ipward_lab.simcluster`) through the real plugin. Every scenario ends with the invariants
of docs/design.md 4 (`ipward check`, no address on two ready pods, every running pod's
address recorded for its sandbox) plus its own expectation.

No timing is asserted as a speed: where a rule is about time ("never before the grace"),
the test compares the times the processes logged with the record's own `created_at`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.soak.world import GRACE, NS, World
from ipward_lab.waiting import wait_for
from support import exec_plugin


def net_config(w: World, node: str) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "simnet",
        "ipam": {"type": "ipward", "pool": "p", "agentSocket": str(w.agents[node].socket)},
    }


def one_address_pool(w: World) -> str:
    w.pool("--range", "10.60.0.0/24,start=10.60.0.10,end=10.60.0.10")
    return "10.60.0.10"


# -- the scenarios -----------------------------------------------------------------------


def test_gc_after_del_already_freed_and_reallocated(world: World) -> None:
    """The controller has judged A's record leaked and is about to free it (held at
    the `gc-free` test point); meanwhile A's late DEL frees the address and pod B takes
    it. The compare-and-delete on A's revision must fail: B keeps its address."""
    w = world
    only = one_address_pool(w)
    w.node("n1", liveness=False)  # only the controller collects here
    ctl = w.controller("c1", env={"IPWARD_TEST_PAUSES": "gc-free=6"})
    w.sim.create_pod(NS, "a")
    assert w.running("ns/a") == only
    a_sandbox = w.sim.sandboxes_of("ns/a")[-1]
    w.sim.drop_del("ns/a")
    w.sim.delete_pod("ns/a")
    w.gone("ns/a")
    wait_for(lambda: ctl.logged("freeing"), "the controller to judge A's record leaked")
    late = exec_plugin(w.plugin, "DEL", net_config(w, "n1"), container=a_sandbox)
    assert late.returncode == 0, late
    w.sim.create_pod(NS, "b")
    assert w.running("ns/b") == only
    b_record, b_revision = w.records()[only]
    assert b_record["container"] == w.sim.sandboxes_of("ns/b")[-1]
    wait_for(
        lambda: ctl.logged("not freed: the record changed since it was judged"),
        "the controller's compare-and-delete to fail",
    )
    # More passes, once B's record is past the grace: nobody touches it.
    w.wait_past_grace([only])
    w.wait_passes()
    assert w.records()[only] == (b_record, b_revision)
    assert not [e for e in w.freed_logs() if e["by"] == ctl.name]
    assert ctl.metric("ipward_gc_freed_total", reason="sandbox-gone") == 0
    w.assert_invariants()


def test_stale_duplicate_del_after_reallocation(world: World) -> None:
    w = world
    only = one_address_pool(w)
    w.node("n1")
    w.controller("c1")
    w.sim.create_pod(NS, "a")
    assert w.running("ns/a") == only
    a_sandbox = w.sim.sandboxes_of("ns/a")[-1]
    w.sim.delete_pod("ns/a")
    w.gone("ns/a")
    assert len([c for c in w.sim.calls_for(a_sandbox) if c.command == "DEL"]) == 2
    w.sim.create_pod(NS, "b")
    assert w.running("ns/b") == only
    before = w.records()[only]
    for _ in range(3):  # the runtime's DELs for A, replayed late and more than once
        res = exec_plugin(w.plugin, "DEL", net_config(w, "n1"), container=a_sandbox)
        assert res.returncode == 0, res
    assert w.records()[only] == before
    assert before[0]["container"] == w.sim.sandboxes_of("ns/b")[-1]
    w.assert_invariants()


def test_retried_add_after_failed_interface_setup(world: World) -> None:
    """The runtime's ADD got an address, the interface setup failed, the runtime
    retries ADD for the same attachment: the same address, one record. The sandbox
    never comes up and nobody sends DEL: reconciliation frees it, never before the
    grace."""
    w = world
    w.pool("--range", "10.61.0.0/24")
    w.node("n1")
    w.controller("c1")
    config = net_config(w, "n1")
    first = exec_plugin(w.plugin, "ADD", config, container="retried-sandbox")
    again = exec_plugin(w.plugin, "ADD", config, container="retried-sandbox")
    assert first.returncode == 0 and again.returncode == 0, (first, again)
    assert first.json is not None and again.json is not None
    assert first.json["ips"] == again.json["ips"]
    ip = first.json["ips"][0]["address"].split("/")[0]
    records = w.records()
    assert list(records) == [ip]
    created = records[ip][0]["created_at"]
    assert [kv.key for kv in w.store.range("attach/")[0]] == [
        "attach/n1/simnet/retried-sandbox/eth0"
    ]
    wait_for(lambda: ip not in w.records(), "the never-started sandbox's record to be freed")
    frees = w.frees_logged({ip})
    assert len(frees) == 1 and "sandbox-gone" in frees[0]["reason"], frees
    assert frees[0]["ts"] >= created + GRACE
    w.assert_invariants()


def test_missed_del_comes_back_within_interval_plus_grace(world: World) -> None:
    w = world
    w.pool("--range", "10.62.0.0/24")
    w.node("n1")
    w.controller("c1")
    for name in ("keep", "lost"):
        w.sim.create_pod(NS, name)
    kept, lost = w.running("ns/keep"), w.running("ns/lost")
    created = w.records()[lost][0]["created_at"]
    w.sim.drop_del("ns/lost")
    w.sim.delete_pod("ns/lost")
    w.gone("ns/lost")
    vanished = time.time()
    wait_for(lambda: lost not in w.records(), "the missed DEL's address to come back")
    back = time.time()
    frees = w.frees_logged({lost})
    assert len(frees) == 1 and "sandbox-gone" in frees[0]["reason"], frees
    assert frees[0]["ts"] >= created + GRACE  # never before the grace
    print(f"missed DEL: address back {back - vanished:.2f}s after the sandbox vanished")
    assert kept in w.records()
    w.assert_invariants()


def test_add_in_flight_while_gc_runs_is_not_freed(world: World) -> None:
    """The runtime lists a sandbox only once RunPodSandbox returns, well after the ADD
    committed: GC passes in between see a record without its sandbox, and keep it."""
    w = world
    w.pool("--range", "10.63.0.0/24")
    w.node("n1")
    ctl = w.controller("c1", gc_interval=0.1)
    w.sim.list_delay = GRACE * 0.8
    for i in range(4):
        w.sim.create_pod(NS, f"slow-{i}")
    addresses = [w.running(f"ns/slow-{i}") for i in range(4)]
    wait_for(lambda: len(w.sim.ready_addresses()) == 4, "the sandboxes to be listed")
    w.wait_passes()  # a free judged before the listing would have landed
    assert set(addresses) <= set(w.records())
    assert w.freed_logs() == []
    assert ctl.metric("ipward_gc_freed_total", reason="sandbox-gone") == 0
    w.assert_invariants()


def test_agent_restart_during_churn_with_runtime_unreachable(world: World) -> None:
    """While the runtime (and the cluster) cannot be read, the agent is SIGKILLed and
    restarted and pods churn with missed DELs: nothing is freed. Once the sources answer,
    the leaked records come back and nothing else."""
    w = world
    if not w.faults_on_demand:
        pytest.skip("the real kube-apiserver cannot refuse one client on demand")
    w.pool("--range", "10.64.0.0/24")
    agent = w.node("n1")
    w.controller("c1")
    w.sim.create_deployment(NS, "web", 6)
    wait_for(lambda: len(w.sim.ready_addresses()) == 6, "6 pods running")
    w.sim.fail_runtime("n1", "connection refused")
    w.fail_cluster("apiserver unavailable")
    w.sim.drop_del_rate = 1.0  # every DEL of the scale down missed: 4 records leak
    agent.kill()
    w.sim.scale(NS, "web", 2)
    restarted = w.agent("n1")
    wait_for(lambda: len(w.sim.pods(NS)) == 2, "the scale down")
    w.sim.drop_del_rate = 0.0
    w.sim.scale(NS, "web", 4)
    wait_for(lambda: len(w.sim.ready_addresses()) == 4, "4 pods running")
    leaked = set(w.records()) - set(w.sim.ready_addresses())
    wait_for(
        lambda: (restarted.metric("ipward_agent_reconcile_skipped_total") or 0) >= 2,
        "reconciliation to try and skip",
    )
    w.wait_past_grace(leaked)
    w.wait_passes()
    assert set(w.records()) >= leaked
    assert not [e for e in w.freed_logs() if e["reason"] != "CNI DEL"]
    w.clear_faults()
    wait_for(
        lambda: set(w.records()) == set(w.sim.ready_addresses()),
        "convergence: exactly the running pods' addresses recorded",
    )
    w.assert_invariants()


def test_controller_restart_between_the_two_gc_passes(world: World) -> None:
    """The first controller finds a leak once and is SIGKILLed; its successor starts
    counting again: its first pass frees nothing, its second frees the leak."""
    w = world
    w.pool("--range", "10.65.0.0/24")
    w.node("n1", liveness=False)
    first = w.controller("c1", gc_interval=4.0)
    w.sim.create_pod(NS, "lost")
    lost = w.running("ns/lost")
    w.sim.drop_del("ns/lost")
    w.sim.delete_pod("ns/lost")
    w.gone("ns/lost")

    def found_once(ctl: fleet.Controller) -> list[dict]:
        return [e for e in ctl.logged("garbage collection pass") if e["candidates"]]

    wait_for(lambda: found_once(first), "the first controller to find the leak")
    first.kill()
    assert lost in w.records()
    second = w.controller("c2", gc_interval=1.0)
    wait_for(lambda: len(found_once(second)) >= 2, "two passes of the successor", 60)
    passes = found_once(second)
    assert passes[0]["freed"] == 0
    assert passes[1]["freed"] == 1
    assert lost not in w.records()
    w.assert_invariants()


def test_force_deleted_pod_slow_to_stop_is_freed_by_its_teardown_not_on_pod_gone(
    world: World,
) -> None:
    """`kubectl delete --force` of a pod whose containers ignore SIGTERM: the API forgets
    it at once, its sandbox runs on, ready, until its kubelet kills it after the grace
    period. Its node's agent reads the runtime, so the controller, whose `k8s://` source
    has no runtime view, does not free the address on `pod-gone` (found on a real
    cluster: a StatefulSet's next pod took the address on another node while the old
    sandbox still held it); the teardown's DEL frees it."""
    w = world
    w.pool("--range", "10.69.0.0/24")
    w.node("n1")
    ctl = w.controller("c1")
    w.sim.create_pod(NS, "slow")
    ip = w.running("ns/slow")
    w.wait_past_grace([ip])
    w.sim.delete_pod("ns/slow", grace=8.0, force=True)
    w.gone("ns/slow")
    wait_for(lambda: ip not in w.records(), "the address freed once the sandbox is torn down")
    [free] = w.frees_logged({ip})
    assert free["by"] == "agent-n1" and "pod-gone" not in free["reason"], free
    assert ctl.metric("ipward_gc_freed_total", reason="pod-gone") == 0
    w.assert_invariants()


def test_completed_job_freed_after_grace_never_before(world: World) -> None:
    w = world
    w.pool("--range", "10.66.0.0/24")
    w.node("n1")
    ctl = w.controller("c1")
    job_grace = 3.0
    w.sim.create_job(NS, "batch", completions=2, parallelism=2, duration=0.5, grace=job_grace)

    def completed() -> list:
        done = [p for p in w.sim.pods(NS) if p.phase == "Succeeded"]
        return done if len(done) == 2 else []

    pods = wait_for(completed, "the job's pods to complete")
    held = {w.sim.address_of(p): p for p in pods}
    assert None not in held and set(held) <= set(w.records())
    wait_for(lambda: not set(held) & set(w.records()), "the completed pods' addresses freed")
    for ip, pod in held.items():
        frees = w.frees_logged({ip})
        assert len(frees) == 1 and "pod-terminal" in frees[0]["reason"], frees
        assert pod.finished_at is not None
        assert frees[0]["ts"] >= pod.finished_at + job_grace  # never before
    assert ctl.metric("ipward_gc_freed_total", reason="pod-terminal") == 2
    w.assert_invariants()


def test_node_down_freed_only_after_lease_expired_and_node_gone(world: World) -> None:
    w = world
    w.pool("--range", "10.67.0.0/24", "--warm", "4")
    w.node("n1")
    n2 = w.node("n2")
    ctl = w.controller("c1")
    for i in range(3):
        w.sim.create_pod(NS, f"on-n2-{i}", node="n2")
    held = {w.running(f"ns/on-n2-{i}") for i in range(3)}
    w.sim.node_down("n2")
    n2.kill()
    wait_for(lambda: w.store.get(keys.node_key("n2")) is None, "n2's lease to expire")
    w.wait_past_grace(held)
    w.wait_passes()  # the cluster still lists n2
    assert held <= set(w.records())
    w.sim.delete_node("n2")
    wait_for(lambda: not held & set(w.records()), "n2's records freed")
    frees = w.frees_logged(held)
    assert frees and all("node-gone" in e["reason"] for e in frees), frees

    def n2_blocks() -> list[str]:
        return [
            kv.key for kv in w.store.range("blocks/")[0] if rec.decode(kv.value)["node"] == "n2"
        ]

    wait_for(lambda: not n2_blocks(), "n2's blocks to be released")
    assert ctl.logged("answered for a gone node")
    w.assert_invariants()


def rolling_restart(w: World, replicas: int) -> None:
    """Restart Deployment web and wait until its `replicas` pods are all new and ready.
    Found flaky: the simulated cluster restarts in the background, so waiting for
    `replicas` ready pods alone could end at once, on the old ones, on a loaded machine."""
    old = {p.uid for p in w.sim.pods(NS)}
    w.sim.rolling_restart(NS, "web")
    wait_for(
        lambda: (
            {p.uid for p in w.sim.pods(NS)}.isdisjoint(old)
            and len(w.sim.pods(NS)) == replicas
            and len(w.sim.ready_addresses()) == replicas
        ),
        "the rolling restart",
    )


@pytest.mark.parametrize("fault", ["lag", "error", "stall"])
def test_liveness_source_lagging_or_failing_frees_nothing(world: World, fault: str) -> None:
    w = world
    if not w.faults_on_demand:
        pytest.skip("the real kube-apiserver cannot refuse one client on demand")
    w.pool("--range", "10.68.0.0/24")
    w.node("n1")
    ctl = w.controller("c1")
    w.sim.create_deployment(NS, "web", 3)
    wait_for(lambda: len(w.sim.ready_addresses()) == 3, "3 pods running")
    if fault == "lag":
        # Views older than the whole test, however slow the machine: a lag shorter than
        # the rolling restart would show the old pods gone, and their frees be right.
        w.sim.history_seconds = 3600
        w.lag_cluster(3600)
        w.sim.lag_runtime("n1", 3600)
    elif fault == "error":
        w.fail_cluster("apiserver: 500")
        w.sim.fail_runtime("n1", "runtime: connection refused")
    else:
        w.fail_cluster("apiserver: 500")
        w.sim.stall_runtime("n1", 600)
    w.sim.drop_del_rate = 1.0
    rolling_restart(w, 3)
    leaked = set(w.records()) - set(w.sim.ready_addresses())
    assert len(leaked) == 3
    w.wait_past_grace(leaked)
    w.wait_passes()
    assert set(w.records()) == leaked | set(w.sim.ready_addresses())
    assert w.freed_logs() == []
    if w.kube is not None:  # its only source (the cluster) refused: passes skipped
        wait_for(
            lambda: (ctl.metric("ipward_gc_skipped_passes_total") or 0) >= 1,
            "the controller to skip a pass: its k8s:// source refused",
        )
    elif fault == "lag":  # sources answer, with old views: judged, nothing a candidate
        assert ctl.metric("ipward_gc_candidates", reason="sandbox-gone") == 0
    else:  # nothing answers: whole passes skipped, source errors counted
        assert (ctl.metric("ipward_gc_skipped_passes_total") or 0) >= 1
        assert (ctl.metric("ipward_gc_source_errors_total", source="runtime") or 0) >= 1
    assert w.freed_logs() == []
    w.clear_faults()
    wait_for(lambda: not leaked & set(w.records()), "the leaks freed once the sources answer")
    assert set(w.records()) == set(w.sim.ready_addresses())
    w.assert_invariants()


def test_cooldown_across_agent_restart(world: World) -> None:
    w = world
    run_cli(
        "pool",
        "create",
        "p",
        "--range",
        "10.69.0.0/24,start=10.69.0.10,end=10.69.0.12",
        "--cooldown",
        "6",
        store=w.url,
        check=True,
    )
    agent = w.node("n1")
    w.controller("c1")
    w.sim.create_pod(NS, "first")
    freed = w.running("ns/first")
    w.sim.delete_pod("ns/first")
    w.gone("ns/first")
    released_at = time.time()
    agent.kill()
    w.agent("n1")
    w.sim.create_pod(NS, "second")
    w.sim.create_pod(NS, "third")
    got = {w.running("ns/second"), w.running("ns/third")}
    records = w.records()
    for ip in got:  # allocated while `freed` was cooling down, or the test proves nothing
        assert records[ip][0]["created_at"] < released_at + 6
    assert freed not in got, "an address in cooldown was handed out after the restart"
    w.assert_invariants()


@pytest.fixture
def etcd_world(tmp_path: Path, plugin: Path, world_kube: KubeApi | None) -> Iterator[World]:
    with (
        etcd_server(tmp_path / "etcd") as server,
        World(tmp_path, plugin, server.url, kube=world_kube) as w,
    ):
        yield w


def test_missed_dels_on_etcd_with_two_controllers(etcd_world: World) -> None:
    """The same rules on etcd, with a standby controller: a Deployment churns with
    every DEL dropped; everything leaked comes back, nothing running is touched."""
    w = etcd_world
    w.pool("--range", "10.70.0.0/24")
    w.node("n1")
    w.node("n2")
    w.controller("c1")
    w.controller("c2")
    w.sim.create_deployment(NS, "web", 6)
    wait_for(lambda: len(w.sim.ready_addresses()) == 6, "6 pods running")
    w.sim.drop_del_rate = 1.0
    rolling_restart(w, 6)
    wait_for(
        lambda: set(w.records()) == set(w.sim.ready_addresses()),
        "the leaked addresses back",
    )
    w.assert_invariants()
