"""The controller's incremental garbage collection (`controller/collection.py`): on a
real SQLite store, with the simulated cluster's published state (`sim://`) as liveness,
a controller in this process judges only what changed, and finds and frees exactly what
a full look (`gc.look_at` over every record) finds and frees."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ipward.cluster.liveness import ClusterView, NodeView
from ipward.controller.collection import Collection
from ipward.controller.election import Election
from ipward.controller.metrics import Metrics
from ipward.controller.passes import Controller
from ipward.controller.view import StoreView
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.ipam.pools import create_pool
from ipward.store import Store, open_store
from ipward.store.base import Delete, Put
from ipward_lab.simcluster import SimFileSource, write_sim_state

GRACE = 30.0
T0 = 1_000_000.0
NODES = ("n1", "n2", "n3", "n4")


@dataclass
class PodState:
    node: str
    phase: str = "Running"
    finished_at: float | None = None
    sandbox: str = "ready"  # ready, stopped, gone


@dataclass
class World:
    """The simulated cluster around a real store: pods (one attachment each), node
    runtimes, the cluster's node list, registrations; published to `state`."""

    store: Store
    state: Path
    now: float = T0
    pods: dict[int, PodState] = field(default_factory=dict)  # pod i: sandbox sb-i, uid u-i
    allocated: set[int] = field(default_factory=set)
    gone_pods: set[int] = field(default_factory=set)  # deleted from the cluster
    runtimes_down: set[str] = field(default_factory=set)
    unlisted: set[str] = field(default_factory=set)
    cluster_down: bool = False
    as_of_offset: float = 60.0
    # The controller's monotonic clock (its view's re-read timer, when it first saw a
    # record) moves with `now`, and by `mono` on its own.
    mono: float = 0.0

    def __post_init__(self) -> None:
        self.spec = PoolSpec.from_dict(
            {"name": "p", "ranges": [[{"subnet": "10.0.0.0/20"}]], "cooldown": 0}
        )
        create_pool(self.store, self.spec)
        self.store.txn([], [self._registration(n) for n in NODES])

    def ledger(self, node: str) -> Ledger:
        return Ledger(self.store, node, clock=lambda: self.now)

    def add(self, i: int, node: str) -> None:
        self.pods[i] = PodState(node)
        pod = PodInfo("ns", f"pod-{i}", f"u-{i}")
        self.ledger(node).allocate([self.spec], Attachment("net", f"sb-{i}", "eth0"), pod)
        self.allocated.add(i)

    def delete(self, i: int) -> None:
        self.ledger(self.pods[i].node).free(Attachment("net", f"sb-{i}", "eth0"))
        self.allocated.discard(i)

    def register(self, node: str, registered: bool, runtime: bool = False) -> None:
        op = self._registration(node, runtime) if registered else Delete(keys.node_key(node))
        self.store.txn([], [op])

    def _registration(self, node: str, runtime: bool = False) -> Put:
        """As its agent puts it, its clock the world's; `runtime`: the agent judges its
        node by its runtime (the controller leaves the node to it without a runtime view)."""
        value = rec.NodeRegistration(node, 1, self.now, self.now, 60.0, runtime).encode()
        return Put(keys.node_key(node), value)

    def clock(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now + self.mono

    def publish(self) -> None:
        pods = [
            {
                "uid": f"u-{i}",
                "namespace": "ns",
                "name": f"pod-{i}",
                "phase": p.phase,
                "node": p.node,
                "finished_at": p.finished_at,
                "grace": 5.0,
            }
            for i, p in self.pods.items()
            if i not in self.gone_pods
        ]
        runtimes = {
            node: {
                "sandboxes": [
                    {"id": f"sb-{i}", "ready": p.sandbox == "ready", "uid": f"u-{i}"}
                    for i, p in self.pods.items()
                    if p.node == node and p.sandbox != "gone"
                ]
            }
            for node in NODES
            if node not in self.runtimes_down
        }
        listed = [n for n in NODES if n not in self.unlisted]
        cluster = {"fail": "down"} if self.cluster_down else {"pods": pods, "nodes": listed}
        write_sim_state(str(self.state), self.now + self.as_of_offset, cluster, runtimes)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with open_store(f"sqlite://{tmp_path}/ipward.db") as s:
        yield s


@pytest.fixture
def world(store: Store, tmp_path: Path) -> World:
    return World(store, tmp_path / "state.json")


@pytest.fixture
def controller(store: Store, world: World) -> Iterator[Controller]:
    election = Election(store, "incremental", ttl=600)
    election.campaign()
    assert election.leading
    ctl = Controller(
        store,
        election,
        Metrics("incremental", lambda: True),
        interval=3600,
        ready_delay=3600,
        liveness=SimFileSource(str(world.state)),
        add_grace=GRACE,
        clock=world.clock,
        monotonic=world.monotonic,
    )
    yield ctl
    ctl.view.close()


def source_of(ctl: Controller) -> SimFileSource:
    assert isinstance(ctl.liveness, SimFileSource)
    return ctl.liveness


def held_keys(store: Store) -> set[str]:
    return {kv.key for kv in store.range(keys.ADDRESSES)[0]}


def key_of(store: Store, i: int) -> str:
    (key,) = [
        kv.key
        for kv in store.range(keys.ADDRESSES)[0]
        if rec.AddressRecord.decode(kv.value).container == f"sb-{i}"
    ]
    return key


def churn(world: World, rng: random.Random, next_pod: int) -> int:
    """A few random changes of records, pods, sandboxes, runtimes and nodes; the
    world's clock moves on. Returns the next pod number."""
    for _ in range(rng.randint(0, 6)):
        live = sorted(world.allocated)
        what = rng.random()
        if what < 0.25 or not live:
            world.add(next_pod, rng.choice(NODES))
            next_pod += 1
            continue
        i = rng.choice(live)
        pod = world.pods[i]
        if what < 0.35:
            world.delete(i)
        elif what < 0.45:
            world.gone_pods.add(i)
        elif what < 0.55:
            pod.phase = rng.choice(["Succeeded", "Failed"])
            pod.finished_at = world.now - rng.uniform(0, 10)
        elif what < 0.7:
            pod.sandbox = rng.choice(["ready", "stopped", "gone"])
        elif what < 0.78:
            node = rng.choice(NODES)
            world.runtimes_down ^= {node}
        elif what < 0.86:
            world.register(rng.choice(NODES), rng.random() < 0.5, rng.random() < 0.5)
        elif what < 0.94:
            world.unlisted ^= {rng.choice(NODES)}
        elif what < 0.97:
            world.cluster_down = not world.cluster_down
        else:
            world.gone_pods.discard(i)
    world.now += rng.uniform(0, 8)
    world.as_of_offset = rng.uniform(-5, 2 * GRACE)  # lagging views, graces ending
    return next_pod


@pytest.mark.parametrize("seed", range(4))
def test_the_incremental_pass_finds_and_frees_what_a_full_look_does(
    world: World, controller: Controller, seed: int
) -> None:
    """Random churn of records, pods, sandboxes, runtimes, node listings and
    registrations between passes (the state published again or not, so views are new
    objects, equal ones, or the same ones): every record's verdict equals a full look's
    over every record on the same answers, and each pass frees exactly what the full
    looks' two-pass confirmation would."""
    rng = random.Random(seed)
    source = source_of(controller)
    reference = gc.Confirmations()
    next_pod = 0
    for i in range(12):
        world.add(next_pod + i, NODES[i % len(NODES)])
    next_pod = 12
    world.publish()
    freed_total = 0
    for _ in range(60):
        next_pod = churn(world, rng, next_pod)
        if rng.random() < 0.7:
            world.publish()
        view = controller.view
        view.sync()
        full = gc.look_at(
            view.held(),
            [],
            view.registrations(),
            source,
            controller.collection.grace,
            view.clock,
            view.monotonic,
            agents=True,  # as the controller judges
        )
        answered = isinstance(full.evidence.cluster, ClusterView) or any(
            isinstance(a, NodeView) for a in full.evidence.nodes.values()
        )
        if answered:
            expected = {v.key for v in reference.confirm(full.verdicts)}
        else:
            reference = gc.Confirmations()  # nothing judged: confirmations start over
            expected = set()
        freed = controller.gc_pass(source)
        assert {v.key for v in freed} == expected
        if answered:
            found = {k: controller.collection.verdict_of(k) for k in view.records}
            assert found == {v.key: v.reason for v in full.verdicts}
        for verdict in freed:
            world.allocated.discard(int(verdict.held.container.removeprefix("sb-")))
        freed_total += len(freed)
        assert held_keys(world.store) == set(view.records) - {v.key for v in freed}
    assert freed_total > 0  # the churn made leaks, and they were freed


def test_a_steady_pass_judges_only_what_changed(world: World, controller: Controller) -> None:
    """Nothing changed: nothing judged; one record, one pod, one sandbox changed: only
    their records; the view read whole (its safety-net timer): everything again."""
    for i in range(40):
        world.add(i, NODES[i % len(NODES)])
    world.publish()
    collection = controller.collection
    source = source_of(controller)
    assert collection.look(source).judged == 40
    assert collection.look(source).judged == 0
    world.publish()  # the same state again: new objects, equal answers
    assert collection.look(source).judged == 0
    world.delete(1)
    world.add(40, "n1")
    world.pods[2].sandbox = "gone"
    world.pods[3].sandbox = "stopped"
    world.publish()
    seen = collection.look(source)
    # 1 freed, 40 new, 2's sandbox gone (a candidate: judged again until it goes), 3
    # stopped.
    assert seen.judged == 3 and seen.records == 40
    assert [v.held.container for v in seen.candidates] == ["sb-2"]
    assert collection.look(source).judged == 1  # the candidate only
    world.mono += controller.view.follower.reread_every  # its timer: read whole at the next sync
    assert collection.look(source).judged == 40


def test_a_pod_gone_while_its_record_is_unchanged_is_freed_after_two_passes(
    world: World, controller: Controller
) -> None:
    """The record does not change; only the cluster's pod goes away: the settled
    verdict is judged again from the cluster's change, a candidate on the next pass,
    freed on the one after."""
    world.add(0, "n1")
    world.add(1, "n1")
    world.runtimes_down.add("n1")  # the cluster's word only, as for a controller
    world.publish()
    source = source_of(controller)
    key = key_of(world.store, 0)
    assert controller.gc_pass(source) == []
    assert controller.gc_pass(source) == []
    assert controller.collection.verdict_of(key) is None
    world.gone_pods.add(0)
    world.publish()
    assert controller.gc_pass(source) == []  # found: the first pass
    assert controller.collection.verdict_of(key) == gc.POD_GONE
    (freed,) = controller.gc_pass(source)
    assert freed.key == key
    assert held_keys(world.store) == {key_of(world.store, 1)}


@pytest.mark.parametrize("grace", ["add", "terminal"])
def test_a_record_inside_a_grace_is_judged_again_when_it_ends(
    world: World, controller: Controller, grace: str
) -> None:
    """Only the view's `as_of` moves (the same pods, published again): the ADD grace
    of a record whose pod is not listed, or a terminal pod's grace, ends, and the record
    becomes a candidate, then is freed."""
    world.add(0, "n1")
    world.add(1, "n1")
    world.runtimes_down.add("n1")
    if grace == "add":
        world.gone_pods.add(0)  # an ADD in flight: its pod is not listed yet
        world.as_of_offset = 1.0  # views read 1 s after the ADD
    else:
        world.pods[0].phase = "Succeeded"
        world.pods[0].finished_at = world.now + GRACE + 1  # the pod's grace is 5 s
        world.as_of_offset = GRACE + 2  # 1 s after it finished
    world.publish()
    source = source_of(controller)
    key = key_of(world.store, 0)
    for _ in range(2):
        assert controller.gc_pass(source) == []
        assert controller.collection.verdict_of(key) is None
    world.as_of_offset += GRACE  # both graces are over; nothing else changed
    world.publish()
    assert controller.gc_pass(source) == []
    assert controller.collection.verdict_of(key) == (
        gc.POD_GONE if grace == "add" else gc.POD_TERMINAL
    )
    (freed,) = controller.gc_pass(source)
    assert freed.key == key


def test_more_changes_than_the_view_notes_make_the_next_pass_judge_everything(
    world: World, store: Store
) -> None:
    """The view notes changed records up to its bound (`max_pending`); past it, it says
    "everything" and the next look judges every record, not the few it noted."""
    view = StoreView(
        store,
        Metrics("bounded", lambda: True),
        max_pending=5,
        clock=world.clock,
        monotonic=world.monotonic,
    )
    ledger = Ledger(store, "bounded")
    collection = Collection(view, ledger, Metrics("bounded-gc", lambda: True), "test", GRACE)
    source = SimFileSource(str(world.state))
    try:
        for i in range(12):
            world.add(i, NODES[i % len(NODES)])
        world.publish()
        assert collection.look(source).judged == 12
        world.delete(0)
        world.delete(1)
        world.pods[2].sandbox = "gone"
        world.publish()
        assert collection.look(source).judged == 1  # 0 and 1 gone: only 2 left to judge
        for i in range(3, 9):  # six records: more than the five the view notes
            world.delete(i)
        seen = collection.look(source)
        assert seen.records == 4 and seen.judged == 4  # 2, 9, 10, 11: all of them
    finally:
        view.close()
