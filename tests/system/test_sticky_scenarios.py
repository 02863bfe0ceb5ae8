"""Sticky-address chaos scenarios (issue 5), each on a real store with real agents
(reading pod owners and annotations from the simulated cluster, `--cluster`), real
controllers, and the simulated cluster driving the real plugin. A watcher samples the
cluster all along: no two ready pods may ever share an address. Each scenario ends with
`ipward check` clean plus its own expectation."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.soak.result import Violation
from ipward_lab.soak.world import NS, World
from ipward_lab.waiting import wait_for
from support import exec_plugin


class Watcher:
    """Runs the soak's live checks (`World.checker`: no address on two ready pods, no
    ready pod's record lost) until stopped; remembers every violation seen."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.found: list[Violation] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.found += self.world.checker.check_once()
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.samples > 0  # it did watch
        assert not self.found, f"invariants broken: {self.found[:5]}"


@pytest.fixture
def watched(world: World) -> Iterator[tuple[World, Watcher]]:
    watcher = Watcher(world)
    try:
        yield world, watcher
    finally:
        watcher._stop.set()


def running_pods(w: World, prefix: str = "") -> dict[str, str]:
    """name -> address of the Running pods with an address (whose name starts so)."""
    return {
        p.name: addr
        for p in w.sim.pods(NS)
        if p.phase == "Running"
        and p.name.startswith(prefix)
        and (addr := w.sim.address_of(p)) is not None
    }


def reservations(w: World) -> dict[str, dict]:
    return {kv.key: rec.decode(kv.value) for kv in w.store.range("sticky/")[0]}


def small_pool(w: World, n: int, *options: str) -> None:
    w.pool("--range", f"10.80.0.0/24,start=10.80.0.10,end=10.80.0.{9 + n}", *options)


def test_two_statefulsets_share_a_pool_of_five(watched: tuple[World, Watcher]) -> None:
    """The first scales 5 -> 0; the second is created when 3 of the first's pods remain;
    the first scales back to 5. The second's pods wait for the first's reservations to
    be retired; at the end exactly 5 pods run."""
    w, watcher = watched
    small_pool(w, 5, "--warm", "4")
    w.node("n1", cluster=True)
    w.controller("c1")
    w.sim.create_statefulset(NS, "a", 5)
    wait_for(lambda: len(running_pods(w, "a-")) == 5, "a: 5 running")
    w.sim.scale(NS, "a", 0)
    wait_for(lambda: len([p for p in w.sim.pods(NS) if p.name.startswith("a-")]) <= 3, "a: 3 left")
    w.sim.create_statefulset(NS, "b", 5)
    wait_for(lambda: not [p for p in w.sim.pods(NS) if p.name.startswith("a-")], "a: none left")
    w.sim.scale(NS, "a", 5)
    wait_for(lambda: len(running_pods(w)) == 5, "5 pods running", timeout=90)
    w.wait_passes()  # settle: nothing else may start, nothing moves
    final = running_pods(w)
    assert len(final) == 5 and len(set(final.values())) == 5
    watcher.stop()
    w.assert_invariants()


def test_statefulset_5_0_5_within_the_grace_gets_every_address_back(
    tmp_path: Path, plugin: Path, sqlite_url: str, world_kube: KubeApi | None
) -> None:
    with World(tmp_path, plugin, sqlite_url, grace=30.0, kube=world_kube) as w:
        w.pool("--range", "10.81.0.0/24")
        w.node("n1", cluster=True)
        w.controller("c1")
        watcher = Watcher(w)
        w.sim.create_statefulset(NS, "db", 5, ordered=False)
        wait_for(lambda: len(running_pods(w)) == 5, "5 running")
        before = running_pods(w)
        uids = {p.name: p.uid for p in w.sim.pods(NS)}
        w.sim.scale(NS, "db", 0)
        wait_for(lambda: not w.sim.pods(NS), "scaled to 0")
        assert all(not held["attachment"] for held in reservations(w).values())
        w.sim.scale(NS, "db", 5)
        wait_for(lambda: len(running_pods(w)) == 5, "5 running again")
        assert running_pods(w) == before
        assert all(uids[p.name] != p.uid for p in w.sim.pods(NS))  # new pods, old addresses
        watcher.stop()
        w.assert_invariants()


@pytest.mark.parametrize(
    ("failed_for", "pending_for"),
    [(2.0, 0.0), (0.0, 2.0), (1.0, 1.0), (0.0, 0.0)],
    ids=["failed", "pending", "failed-then-pending", "running-no-address"],
)
def test_statefulset_pod_restarting_keeps_its_address(
    watched: tuple[World, Watcher], failed_for: float, pending_for: float
) -> None:
    """GC passes (every 0.3 s, grace 2 s) see the pod Failed, Pending, or Running with
    no address while it restarts: nothing is freed or retired; it comes back with the
    same address."""
    w, watcher = watched
    w.pool("--range", "10.82.0.0/24")
    w.node("n1", cluster=True)
    ctl = w.controller("c1")
    w.sim.list_delay = 0.5 if failed_for == pending_for == 0 else 0.0
    w.sim.create_statefulset(NS, "db", 1)
    address = w.running("ns/db-0")
    w.wait_past_grace([address])  # old enough for GC to judge it
    w.sim.restart_pod("ns/db-0", failed_for=failed_for, pending_for=pending_for)
    wait_for(lambda: w.sim.address_of("ns/db-0") is None, "the restart to begin")
    assert w.running("ns/db-0") == address
    w.wait_passes()  # a free judged in the restart would have landed
    assert running_pods(w) == {"db-0": address}
    assert [e for e in w.freed_logs() if e["reason"] != "CNI DEL"] == []
    assert not ctl.logged("freed")
    watcher.stop()
    w.assert_invariants()


def test_statefulset_scale_3_to_1_frees_ordinals_1_and_2(watched: tuple[World, Watcher]) -> None:
    w, watcher = watched
    w.pool("--range", "10.83.0.0/24")
    w.node("n1", cluster=True)
    ctl = w.controller("c1")
    w.sim.create_statefulset(NS, "db", 3)
    wait_for(lambda: len(running_pods(w)) == 3, "3 running")
    held = running_pods(w)
    w.sim.scale(NS, "db", 1)
    wait_for(lambda: len(w.sim.pods(NS)) == 1, "scaled to 1")
    gone_at = time.time()
    wait_for(
        lambda: held["db-1"] not in w.records() and held["db-2"] not in w.records(),
        "ordinals 1 and 2 freed",
    )
    print(f"scale down: addresses freed {time.time() - gone_at:.2f}s after the pods left")
    assert set(reservations(w)) == {keys.sticky_key("simnet", NS, "db-0")}
    assert running_pods(w) == {"db-0": held["db-0"]}
    assert ctl.metric("ipward_gc_freed_total", reason="ordinal-out-of-range") == 2
    watcher.stop()
    w.assert_invariants()


def test_node_lost_statefulset_pod_moves_with_its_address(watched: tuple[World, Watcher]) -> None:
    """The node of a StatefulSet pod is lost: while the cluster still lists the old
    pod, no new sandbox of the identity may take the address (a rogue ADD is told to
    try again); once the node is deleted the pod is recreated on the other node with
    the same address."""
    w, watcher = watched
    w.pool("--range", "10.84.0.0/24")
    w.node("n1", cluster=True)
    lost = w.node("n2", cluster=True)
    w.controller("c1")
    w.sim.create_statefulset(NS, "db", 2, ordered=False)
    wait_for(lambda: len(running_pods(w)) == 2, "2 running")
    on_n2 = next(p for p in w.sim.pods(NS) if p.node == "n2")
    address = w.sim.address_of(on_n2)
    w.sim.node_down("n2")
    lost.kill()
    rogue_args = (
        f"IgnoreUnknown=1;K8S_POD_NAMESPACE={NS};K8S_POD_NAME={on_n2.name};K8S_POD_UID=rogue"
    )
    config = {
        "cniVersion": "1.0.0",
        "name": "simnet",
        "ipam": {"type": "ipward", "pool": "p", "agentSocket": str(w.agents["n1"].socket)},
    }
    rogue = exec_plugin(w.plugin, "ADD", config, container="rogue-sandbox", args=rogue_args)
    assert rogue.json is not None and rogue.json["code"] == 11, rogue
    assert "may still be live" in rogue.json["msg"] or "not listed" in rogue.json["msg"]
    wait_for(lambda: w.store.get(keys.node_key("n2")) is None, "n2's lease to expire")
    w.wait_past_grace([address])
    w.wait_passes()  # the cluster still lists the old pod
    assert w.records()[address][0]["container"] == w.sim.sandboxes_of(on_n2)[-1]
    w.sim.delete_node("n2")
    wait_for(
        lambda: running_pods(w).get(on_n2.name) == address,
        f"{on_n2.name} running on n1 with {address}",
    )
    assert w.sim.pod(f"{NS}/{on_n2.name}").node == "n1"
    watcher.stop()
    w.assert_invariants()


def test_exact_capacity_churn_with_controller_kills(watched: tuple[World, Watcher]) -> None:
    """Two StatefulSets, two Deployments and two Jobs of 3 pods each compete for exactly
    18 addresses. Random scaling keeps the total at 18 while controllers are killed at
    random; then every pod restarts (StatefulSet addresses unchanged); then everything
    is deleted: the pool ends empty and the store checks clean."""
    w, watcher = watched
    rng = random.Random(5)
    # Two nodes, exactly 18 addresses: small blocks, and borrowing, so no address is
    # stranded in a block of the node that has no pod left to use it.
    small_pool(w, 18, "--block-v4", "29", "--warm", "2", "--borrow")
    w.node("n1", cluster=True)
    w.node("n2", cluster=True)
    controllers = [w.controller("c1"), w.controller("c2")]
    for name in ("s1", "s2"):
        w.sim.create_statefulset(NS, name, 3, ordered=False)
    for name in ("d1", "d2"):
        w.sim.create_deployment(NS, name, 3)
    for name in ("j1", "j2"):
        w.sim.create_job(NS, name, completions=3, parallelism=3, duration=3600)
    wait_for(lambda: len(running_pods(w)) == 18, "18 running", timeout=90)
    replicas = {"s1": 3, "s2": 3, "d1": 3, "d2": 3}
    for step in range(6):
        up, down = rng.sample(sorted(replicas), 2)
        if replicas[down] == 0:
            continue
        replicas[down] -= 1
        w.sim.scale(NS, down, replicas[down])
        replicas[up] += 1
        w.sim.scale(NS, up, replicas[up])
        if step % 2 == 0:  # kill a controller at random, start a new one
            victim = controllers.pop(rng.randrange(len(controllers)))
            victim.kill()
            controllers.append(w.controller(f"c{step + 3}"))
        wait_for(lambda: len(running_pods(w)) == 18, f"18 running after step {step}", 120)
    # Per workload, not only in all: the simulated cluster scales in the background, and
    # 18 in all can hold while a pod of one is still to go and one of another to come
    # (found flaky in CI: the pod still to go was then restarted below).
    wanted = Tally({**replicas, "j1": 3, "j2": 3})

    def settled() -> bool:
        pods = w.sim.pods(NS)
        return (
            Tally(p.owner_name for p in pods) == wanted
            and all(p.deleted_at is None for p in pods)
            and len(running_pods(w)) == 18
        )

    wait_for(settled, "every workload's pods, all running, none being deleted")
    stateful = {n: a for n, a in running_pods(w).items() if n.startswith("s")}
    for pod in w.sim.pods(NS):
        w.sim.restart_pod(pod)
    wait_for(lambda: len(running_pods(w)) == 18, "18 running after the restarts", 120)
    assert {n: a for n, a in running_pods(w).items() if n.startswith("s")} == stateful
    for name in ("s1", "s2"):
        w.sim.delete_statefulset(NS, name)
    for name in ("d1", "d2"):
        w.sim.delete_deployment(NS, name)
    for name in ("j1", "j2"):
        w.sim.delete_job(NS, name)
    wait_for(lambda: not w.sim.pods(NS), "every pod gone")
    wait_for(lambda: not w.records() and not reservations(w), "the pool empty", 90)
    watcher.stop()
    w.assert_invariants()
