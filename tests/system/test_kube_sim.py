"""The simulated cluster behind a Kubernetes API server: its publisher keeps the server's
objects as the model says (on the loopback test server and, when KUBE_APISERVER names
it, on the real kube-apiserver: the `kube` fixture), and `ipward sim --api` runs the
soak with agents and controllers reading the cluster through `k8s://`. Nothing is
timed: every wait is for a condition."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipward.cluster.k8s.reflector import Reflector
from ipward.cluster.k8s.source import NODES
from ipward.cluster.liveness import LivenessUnavailable, Pod
from ipward.kubeapi.client import ApiClient
from ipward.kubeapi.config import from_kubeconfig
from ipward_lab.fleet import run_cli
from ipward_lab.servers.kube_admin import KubeAdmin, KubeApi
from ipward_lab.simcluster import SimCluster, SimFileSource
from ipward_lab.soak.world import agents
from ipward_lab.waiting import wait_for
from support import ManualClock
from test_sim import CI_RUN, fault_counts, possible, soak

POOL = "kpool"
GRACE = 5.0  # pods' termination grace; containers run it out (exit_after=None)


class Lab:
    """A simulated cluster published to `kube` on a clock that moves when told, its
    nodes' agents on one store. What the test did to nodes, StatefulSets and the
    namespace's annotations is kept here to compare with the server."""

    def __init__(self, kube: KubeApi, sim: SimCluster, clock: ManualClock, nodes: list[str]):
        self.kube = kube
        self.sim = sim
        self.clock = clock
        self.nodes = set(nodes)
        self.ns = kube.name("shop")
        self.sets: dict[str, int] = {}
        self.ns_annotations: dict[str, str] = {}

    # -- what the test does

    def set_namespace(self, annotations: dict[str, str]) -> None:
        self.sim.set_namespace(self.ns, annotations)
        self.ns_annotations = dict(annotations)

    def statefulset(self, name: str, replicas: int) -> None:
        if name in self.sets:
            self.sim.scale(self.ns, name, replicas)
        else:
            self.sim.create_statefulset(self.ns, name, replicas, ordered=False)
        self.sets[name] = replicas

    def pod(self, name: str) -> Pod:
        return self.sim.pod(f"{self.ns}/{name}")

    def pods(self, prefix: str) -> list[Pod]:
        return [p for p in self.sim.pods(self.ns) if p.name.startswith(prefix)]

    def settle(self, what: str) -> None:
        """Until every pod not being deleted runs or has finished (the kubelet idle)."""
        self.sim.wait_until(
            lambda: all(
                p.phase in ("Running", "Succeeded") or p.deleted_at is not None
                for p in self.sim.pods(self.ns)
            ),
            timeout=60,
            what=what,
        )

    # -- the server against the model

    def api_state(self) -> dict[str, Any]:
        get = self.kube.client.request
        pods = get("GET", f"/api/v1/namespaces/{self.ns}/pods")["items"]
        sets = get("GET", f"/apis/apps/v1/namespaces/{self.ns}/statefulsets")["items"]
        namespace = get("GET", f"/api/v1/namespaces/{self.ns}")["metadata"]
        return {
            "pods": {o["metadata"]["name"]: api_pod(o) for o in pods},
            "nodes": {o["metadata"]["name"] for o in get("GET", "/api/v1/nodes")["items"]}
            & self.all_nodes,
            "statefulsets": {o["metadata"]["name"]: o["spec"]["replicas"] for o in sets},
            "annotations": namespace.get("annotations") or {},
        }

    def model_state(self) -> dict[str, Any]:
        return {
            "pods": {p.name: model_pod(p) for p in self.sim.pods(self.ns) if p.node},
            "nodes": self.nodes,
            "statefulsets": self.sets,
            "annotations": self.ns_annotations,
        }

    all_nodes: set[str] = set()

    def in_step(self, what: str) -> dict[str, Any]:
        """Wait until the server holds what the model holds; the server's state. Every
        plugin call of the model's pods carried the UID the server gave the pod."""
        try:
            state: dict[str, Any] = wait_for(
                lambda: (s := self.api_state()) == self.model_state() and s, what
            )
        except AssertionError:
            assert self.api_state() == self.model_state(), what  # shows the difference
            raise
        for pod in self.sim.pods(self.ns):
            for sandbox in self.sim.sandboxes_of(pod):
                assert {c.uid for c in self.sim.calls_for(sandbox)} == {pod.uid}, (what, pod)
        return state


def api_pod(obj: dict) -> dict[str, Any]:
    """A pod of the server, in the terms `model_pod` gives the model's."""
    meta, spec, status = obj["metadata"], obj["spec"], obj.get("status") or {}
    owners = [r for r in meta.get("ownerReferences") or [] if r.get("controller") is True]
    owner = (owners[0]["kind"], owners[0]["name"]) if owners else None
    if owner is not None and owner[0] == "ReplicaSet":  # <deployment>-<template hash>
        owner = ("Deployment", owner[1].rsplit("-", 1)[0])
    states = [c.get("state") or {} for c in status.get("containerStatuses") or []]
    return {
        "uid": meta["uid"],
        "node": spec["nodeName"],
        "phase": status.get("phase"),
        "owner": owner,
        "annotations": meta.get("annotations") or {},
        "deleting": bool(meta.get("deletionTimestamp")),
        "grace": meta.get("deletionGracePeriodSeconds", spec["terminationGracePeriodSeconds"]),
        "finished": any(s.get("terminated", {}).get("finishedAt") for s in states),
    }


def model_pod(pod: Pod) -> dict[str, Any]:
    return {
        "uid": pod.uid,
        "node": pod.node,
        "phase": pod.phase,
        "owner": (pod.owner_kind, pod.owner_name) if pod.owner_kind else None,
        "annotations": pod.annotations,
        "deleting": pod.deleted_at is not None,
        "grace": int(pod.grace),
        "finished": pod.finished_at is not None,
    }


@pytest.fixture
def lab(kube: KubeApi, tmp_path: Path, cni_bin: Path) -> Iterator[Lab]:
    nodes = [kube.name("a"), kube.name("b")]
    store = f"sqlite://{tmp_path}/ipward.db"
    run_cli("pool", "create", POOL, "--range", "10.46.0.0/16", store=store, check=True)
    clock = ManualClock(time.time())
    client = ApiClient(from_kubeconfig(str(kube.kubeconfig)))
    with agents(tmp_path, store, nodes) as running:
        sim = SimCluster(
            str(tmp_path / "state.json"),
            str(cni_bin / "ipward"),
            "knet",
            POOL,
            clock=clock,
            grace=GRACE,
            exit_after=None,
            api=KubeAdmin(client),
        )
        for node, agent in running.items():
            sim.add_node(node, str(agent.socket))
        made = Lab(kube, sim, clock, nodes)
        made.all_nodes = set(nodes)
        sim.start()
        try:
            yield made
        finally:
            sim.stop()
            client.close()
            errors = [e for e in sim.events if e[1] == "error"]
            assert not errors, errors


def test_the_server_holds_what_the_model_holds(lab: Lab) -> None:
    """Namespaces with annotations, nodes, pods (node, owner, annotations, phase,
    deletion with its grace, finish) and StatefulSets, across scale down and up,
    restarts, deletions and a node leaving."""
    sim, clock, ns = lab.sim, lab.clock, lab.ns
    lab.set_namespace({"ipward.io/pool": "blue", "team": "x"})
    sim.create_deployment(ns, "web", 2)
    lab.statefulset("db", 2)
    sim.create_job(ns, "job", completions=1, duration=10.0)
    sim.create_pod(ns, "solo", annotations={"ipward.io/sticky": "true"})
    lab.settle("every pod running")
    state = lab.in_step("created")
    assert {p["owner"][0] for p in state["pods"].values() if p["owner"]} == {
        "Deployment",  # a ReplicaSet named after it
        "StatefulSet",
        "Job",
    }
    assert all(p["phase"] == "Running" for p in state["pods"].values())

    clock.advance(11)  # the Job's pod has run its 10 s
    sim.wait_until(lambda: lab.pods("job")[0].phase == "Succeeded", what="the Job done")
    state = lab.in_step("the Job's pod succeeded")
    (job,) = [p for name, p in state["pods"].items() if name.startswith("job")]
    assert job["finished"]

    old = {p.name: p.uid for p in lab.pods("db")}
    lab.statefulset("db", 0)
    sim.wait_until(lambda: all(p.deleted_at for p in lab.pods("db")), what="db terminating")
    state = lab.in_step("db scaled down: terminating, grace shown")
    assert [state["pods"][name]["grace"] for name in sorted(old)] == [5, 5]
    clock.advance(GRACE + 1)
    sim.wait_until(lambda: not lab.pods("db"), what="db pods gone")
    lab.in_step("db pods gone")
    lab.statefulset("db", 3)
    lab.settle("db back")
    state = lab.in_step("db back with new pods under the old names")
    assert all(state["pods"][name]["uid"] != uid for name, uid in old.items())

    web = lab.pods("web")[0]
    sim.restart_pod(web, failed_for=4)
    sim.wait_until(lambda: lab.pod(web.name).phase == "Failed", what="restart: Failed")
    state = lab.in_step("restarting: Failed, not finished")
    assert not state["pods"][web.name]["finished"]
    clock.advance(5)
    lab.settle("restarted")
    lab.in_step("running again")

    sim.annotate_pod(f"{ns}/solo", {"ipward.io/sticky": "true", "ipward.io/pool": "red"})
    lab.set_namespace({"ipward.io/pool": "green"})  # "team" goes
    lab.in_step("annotations replaced")
    sim.delete_pod(f"{ns}/solo")
    lab.in_step("solo terminating")
    clock.advance(GRACE + 1)
    sim.wait_until(lambda: not lab.pods("solo"), what="solo gone")
    lab.in_step("solo gone")

    gone = sorted(lab.nodes)[1]
    sim.delete_node(gone)
    lab.nodes.discard(gone)
    lab.settle("pods of the deleted node recreated elsewhere")
    state = lab.in_step("node gone, its pods elsewhere")
    assert {p["node"] for p in state["pods"].values()} == lab.nodes

    sim.delete_statefulset(ns, "db")
    del lab.sets["db"]
    lab.in_step("StatefulSet gone, its pods terminating")
    clock.advance(GRACE + 1)
    sim.wait_until(lambda: not lab.pods("db"), what="db pods gone")
    lab.in_step("db gone")


def test_the_server_catches_up_after_being_down(lab: Lab) -> None:
    """While the server is down the model goes on (a kubelet runs no pod the server
    has not shown it); back, the server gets what it missed, deletions included. The
    state file has no cluster to give: readers of it are not told pods are gone."""
    if lab.kube.server is None:
        pytest.skip("the test server goes down on demand")
    sim, ns = lab.sim, lab.ns
    sim.create_deployment(ns, "web", 2)
    sim.create_pod(ns, "doomed")
    lab.settle("web and doomed running")
    lab.in_step("web and doomed")
    lab.kube.server.go_down()
    sim.scale(ns, "web", 4)
    sim.delete_pod(f"{ns}/doomed")
    sim.create_pod(ns, "late")
    sim.wait_until(
        lambda: len(lab.pods("web")) == 4 and all(p.node for p in sim.pods(ns)),
        what="new pods scheduled",
    )
    unpublished = {p.uid for p in sim.pods(ns) if p.phase == "Pending"}
    assert len(unpublished) == 3
    lab.clock.advance(GRACE + 1)
    sim.wait_until(lambda: not lab.pods("doomed"), what="doomed gone from the model")
    assert not [c for c in sim.calls if c.uid in unpublished]  # nothing ran them
    with pytest.raises(LivenessUnavailable, match="Kubernetes API"):
        SimFileSource(sim.state_path).cluster_view()

    lab.kube.server.come_back()
    lab.settle("every pod running")
    state = lab.in_step("caught up")
    assert "doomed" not in state["pods"]
    assert not {p["uid"] for p in state["pods"].values()} & unpublished  # the server's UIDs
    assert not [c for c in sim.calls if c.uid in unpublished]


def test_a_pod_the_server_has_under_that_name_is_replaced(lab: Lab) -> None:
    """A pod of the same name already in the server (a create whose answer was lost) is
    removed and the model's created: the model's pod carries the new one's UID."""
    node = sorted(lab.nodes)[0]
    lab.kube.admin.namespace(lab.ns)
    squatter = lab.kube.admin.pod(lab.ns, "solo", node)
    lab.sim.create_pod(lab.ns, "solo", node=node)
    lab.settle("solo running")
    state = lab.in_step("replaced")
    assert state["pods"]["solo"]["uid"] not in ("", squatter)


# -- the soak through k8s:// ----------------------------------------------------------


def test_soak_through_k8s_on_the_test_server_every_fault(tmp_path: Path) -> None:
    """60 s of churn with agents (--cluster) and controllers (--liveness) on k8s://,
    every fault a SQLite run can make, the API server's four included: no violation,
    convergence, an empty pool after teardown."""
    run = soak(tmp_path, "--api", "test", *CI_RUN)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    counts = fault_counts(run.stdout)
    assert set(counts) == possible("sqlite", "test") and min(counts.values()) >= 1, counts
    assert {"api-expire", "api-cut", "api-down", "api-stall"} <= set(counts)
    assert "loopback test server (k8s://)" in " ".join(run.stdout.split())


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--faults", "api-stall"), ["api-stall", "--api"]),
        (("--api", "real", "--faults", "api-cut"), ["api-cut", "api-down"]),
        (("--faults", "kill-etcd"), ["kill-etcd", "etcd-cluster"]),
        (("--api", "real", "--faults", "none"), ["KUBE_APISERVER"]),
    ],
    ids=["api-fault-without-api", "test-only-fault-on-real", "etcd-fault-on-sqlite", "no-binary"],
)
def test_a_run_that_cannot_be_made_is_refused_by_name(
    tmp_path: Path, args: tuple[str, ...], named: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBE_APISERVER"}
    run = soak(tmp_path, "--duration", "5", *args, env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert all(word in run.stderr for word in named), run.stderr
    assert "Traceback" not in run.stderr


def test_a_quiet_resource_stays_current_on_the_real_server(real_kube_apiserver: Any) -> None:
    """A node list with nothing changing: the real server sends no bookmark, but answers
    every watch until its timeout and ends it cleanly, so the cache is current; its as_of
    must move on and it must stay available (else GC judges nothing newer than the list,
    and a source needing nodes and namespaces answers unavailable for good)."""
    client = ApiClient(from_kubeconfig(str(real_kube_apiserver.kubeconfig)))
    KubeAdmin(client).node(f"quiet-{int(time.time() * 1000)}")
    reflector = Reflector(client, NODES, watch_timeout=2, stale_after=5, margin=0)
    reflector.start()
    try:
        wait_for(lambda: reflector.available, "the list")
        listed = reflector.snapshot()[1]

        def moved_on() -> bool:
            try:
                return reflector.snapshot()[1] > listed + 2  # past a clean end
            except LivenessUnavailable as e:
                raise AssertionError(f"a quiet resource went unavailable: {e}") from e

        wait_for(moved_on, "as_of to move past the first clean end", timeout=20)
    finally:
        reflector.stop()
        client.close()
