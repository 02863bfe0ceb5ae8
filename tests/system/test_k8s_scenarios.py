"""Watch faults of the `k8s://` source under real agents and a real controller: the
simulated cluster published to the loopback test server (the faults exist only there:
the real kube-apiserver cannot expire its history, cut its streams or stall its watches
on demand), the controller the only collector (agents without liveness), so every free
of a leaked address is the controller's judgment from the API. Every DEL is dropped:
the deleted pods' addresses leak and come back only through garbage collection.

Each scenario checks: no live address freed, exactly the gone pods' addresses freed
once the source is back, `ipward check` clean."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward_lab import fleet
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.soak.world import NS, World
from ipward_lab.waiting import wait_for

PODS = 4
GONE = ("web-0", "web-1")  # the standalone pods deleted during the fault


@pytest.fixture
def k8s_world(
    tmp_path: Path, plugin: Path, sqlite_url: str, kube_server: KubeApi
) -> Iterator[World]:
    with World(tmp_path, plugin, sqlite_url, kube=kube_server) as w:
        yield w


def pod_lists(kube: KubeApi) -> int:
    """Lists of every pod the server answered (the controller's; watches excluded)."""
    assert kube.server is not None
    return sum(
        1
        for method, path, _ in list(kube.server.requests)
        if method == "GET" and path.startswith("/api/v1/pods") and "watch=" not in path
    )


def freed(w: World) -> set[str]:
    return {ip.split("/", 1)[1] for e in w.freed_logs() for ip in e.get("ips", [])}


def skipped(ctl: fleet.Controller) -> float:
    return ctl.metric("ipward_gc_skipped_passes_total") or 0


def source_errors(ctl: fleet.Controller, source: str) -> float:
    return ctl.metric("ipward_gc_source_errors_total", source=source) or 0


def gc_passes(ctl: fleet.Controller) -> float:
    return ctl.metric("ipward_gc_pass_seconds_count") or 0


class Scene:
    """Pods running, the controller judging from the API, every DEL dropped."""

    def __init__(self, w: World) -> None:
        self.w = w
        w.pool("--range", "10.71.0.0/24")
        w.node("n1", liveness=False)  # only the controller collects here
        self.ctl = w.controller("c1")
        for i in range(PODS):
            w.sim.create_pod(NS, f"web-{i}")
        self.addresses = {f"web-{i}": w.running(f"ns/web-{i}") for i in range(PODS)}
        wait_for(
            lambda: self.ctl.logged("garbage collection pass"),
            "the controller to judge from the API",
        )
        w.sim.drop_del_rate = 1.0
        self.leaked = {self.addresses[name] for name in GONE}
        self.live = set(self.addresses.values()) - self.leaked

    def delete(self) -> None:
        for name in GONE:
            self.w.sim.delete_pod(f"{NS}/{name}")
        for name in GONE:
            self.w.gone(f"{NS}/{name}")

    def nothing_freed(self) -> None:
        records = set(self.w.records())
        assert self.leaked | self.live <= records, records
        assert not freed(self.w), self.w.freed_logs()

    def back(self) -> None:
        """Exactly the gone pods' addresses freed, by the controller, the live kept."""
        w = self.w
        wait_for(lambda: not self.leaked & set(w.records()), "the gone pods' addresses freed")
        w.frees_logged(self.leaked)
        assert self.live <= set(w.records())
        assert freed(w) == self.leaked, w.freed_logs()
        assert {e["by"] for e in w.freed_logs()} == {self.ctl.name}
        w.assert_invariants()


@pytest.mark.parametrize(
    "fault",
    ["expire_history", "cut_streams", "cut_inside_a_chunk"],
    ids=["410-mid-run", "stream-cut", "stream-cut-inside-a-chunk"],
)
def test_a_broken_watch_relists_then_frees_exactly_the_gone(
    k8s_world: World, kube_server: KubeApi, fault: str
) -> None:
    """A 410 (the history expired) or a cut stream mid-run: the controller's source
    lists again, and the pods deleted around the break are judged gone from that list."""
    w, server = k8s_world, kube_server.server
    assert server is not None
    scene = Scene(w)
    lists = pod_lists(kube_server)
    breaks: dict[str, Callable[[], None]] = {
        "expire_history": server.expire_history,
        "cut_streams": server.cut_streams,
        "cut_inside_a_chunk": lambda: server.cut_streams(inside_a_chunk=True),
    }
    scene.delete()
    breaks[fault]()
    wait_for(lambda: pod_lists(kube_server) > lists, "the controller's source to list again")
    scene.back()


def test_a_controller_on_the_api_alone_counts_no_runtime_errors(
    k8s_world: World, kube_server: KubeApi
) -> None:
    """Finding (a real cluster, deployed as deploy/base says: `--liveness=k8s://`):
    `ipward_gc_source_errors{source="runtime"}`, the first metric to alert on, counted up
    on every pass, for runtimes the source never covers. Only configured sources count."""
    scene = Scene(k8s_world)
    before, cluster_errors = gc_passes(scene.ctl), source_errors(scene.ctl, "cluster")
    wait_for(lambda: gc_passes(scene.ctl) >= before + 2, "two more garbage-collection passes")
    assert source_errors(scene.ctl, "runtime") == 0
    assert source_errors(scene.ctl, "cluster") == cluster_errors  # (its first list: a start)


def test_pods_deleted_while_their_nodes_agent_is_down_wait_for_it(
    k8s_world: World, kube_server: KubeApi
) -> None:
    """Finding (a real cluster): pods deleted while their node's agent was down kept
    their addresses in stopped sandboxes' network namespaces (their DELs refused, no
    kubelet retrying them), and the controller freed those addresses as pod-gone
    meanwhile. A node the cluster lists whose agent is not registered now waits: nothing
    of it is freed on the cluster's word until its agent is back (which finishes the
    teardowns: tests/system/test_containerd.py), then the gone pods' and no other. A pod gone
    on a node whose agent runs, deleted at the same time, is freed meanwhile: the
    controller did judge the deletions."""
    w = k8s_world
    w.pool("--range", "10.71.0.0/24")
    w.node("n1", liveness=False)  # only the controller collects here
    w.node("n2", liveness=False)
    w.controller("c1")
    pods = {
        f"web-{i}": w.sim.create_pod(NS, f"web-{i}", node="n1" if i < 3 else "n2") for i in range(4)
    }
    addresses = {name: w.running(f"{NS}/{name}") for name in pods}
    w.sim.drop_del_rate = 1.0
    w.agents["n1"].stop()  # its registration revoked: the node's agent is down
    for name in ("web-0", "web-1", "web-3"):
        w.sim.delete_pod(f"{NS}/{name}")
    for name in ("web-0", "web-1", "web-3"):
        w.gone(f"{NS}/{name}")
    canary = addresses["web-3"]  # on n2, whose agent runs
    wait_for(lambda: canary not in w.records(), "the pod gone on n2 freed")
    w.wait_passes()  # more passes judging the deletions: n1's still wait
    waiting = {addresses["web-0"], addresses["web-1"]}
    assert waiting | {addresses["web-2"]} <= set(w.records()), w.freed_logs()
    w.agent("n1", liveness=False)
    wait_for(lambda: not waiting & set(w.records()), "n1's gone pods freed, its agent back")
    assert addresses["web-2"] in w.records()
    assert freed(w) == waiting | {canary}, w.freed_logs()
    w.assert_invariants()


def test_server_down_frees_nothing_then_back_relists_and_frees(
    k8s_world: World, kube_server: KubeApi
) -> None:
    """Down: the pods deleted meanwhile are unknown to the server, the source goes
    unavailable (passes skipped), nothing is freed. Back: the source lists again, the
    mirror publishes the deletions, their addresses are freed and no other."""
    w, server = k8s_world, kube_server.server
    assert server is not None
    scene = Scene(w)
    server.go_down()
    scene.delete()
    before = skipped(scene.ctl)
    wait_for(lambda: skipped(scene.ctl) >= before + 2, "passes skipped: the source unavailable")
    scene.nothing_freed()
    assert source_errors(scene.ctl, "cluster") >= 2
    lists = pod_lists(kube_server)
    server.come_back()
    wait_for(lambda: pod_lists(kube_server) > lists, "the source to list again")
    scene.back()


def test_a_stale_source_is_unavailable_and_frees_nothing(
    k8s_world: World, kube_server: KubeApi
) -> None:
    """The watches stall (no events, no bookmarks) while the pods are deleted in the
    server: the source goes stale, unavailable, passes skipped, nothing freed from what
    it held. Exactly the deleted pods' addresses are freed, and only from a fresh view:
    after the source lists again (a stream quiet for twice the bound) or the stall ends."""
    w, server = k8s_world, kube_server.server
    assert server is not None
    scene = Scene(w)
    stalled_at = time.time()
    server.stall()
    scene.delete()
    w.sim.wait_mirrored()  # the server has the deletions; the stalled watches say nothing
    before = skipped(scene.ctl)
    wait_for(lambda: skipped(scene.ctl) >= before + 1, "passes skipped: the source stale")
    assert scene.ctl.logged("garbage collection: no liveness source answered; nothing judged")
    resumed = time.time()
    server.unstall()
    scene.back()
    relists = [
        e["ts"]
        for e in scene.ctl.logged("k8s relist")
        if e["resource"] == "pods" and e["ts"] >= stalled_at
    ]
    fresh = min([resumed, *relists])
    assert all(e["ts"] >= fresh for e in w.freed_logs()), (fresh, w.freed_logs())
