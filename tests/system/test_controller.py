"""The controller as real `ipward controller` processes: one leader and a successor after
SIGKILL, the warm target, surplus reclaim through the hand-back handshake (the test plays
the node's agent with `blocks.answer`), refusal, abort by take-back, SIGKILL in every
handshake state, and a paused leader fenced out. SQLite throughout; the election and one
handshake also on a real etcd. Every wait polls the store, the metrics or the logs with
a deadline; nothing asserts how long anything took."""

from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ipward.controller.election import Election
from ipward.controller.metrics import Metrics
from ipward.controller.passes import Controller
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.errors import IpwardError, TryAgainLater
from ipward.core.keys import LEADER_KEY
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam import blocks, free_queue
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreError, open_store
from ipward.store.base import Delete, Put, at_revision
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.waiting import wait_for

TTL = 2  # etcd's floor
INTERVAL = 0.2
TAKEOVER = 4 * TTL + 10  # bound on waiting for a successor (process start included)


# -- helpers -----------------------------------------------------------------------------


_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class Ctl(fleet.Controller):
    """One `ipward controller` process (`ipward_lab.fleet`) with this file's timings."""

    def __init__(
        self, url: str, ident: str, tmp: Path, ready_delay: float = 0.3, interval: float = INTERVAL
    ) -> None:
        timings = ("--interval", str(interval), "--lease-ttl", str(TTL))
        super().__init__(ident, url, tmp, (*timings, "--ready-delay", str(ready_delay)))

    def terminate(self) -> int:
        return self.stop(15)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Ctl]]:
    started: list[Ctl] = []

    def start(url: str, ident: str, **kw: Any) -> Ctl:
        ctl = Ctl(url, ident, tmp_path, **kw)
        started.append(ctl)
        return ctl

    yield start
    for ctl in started:
        if ctl.proc.poll() is None:
            os.kill(ctl.pid, signal.SIGCONT)  # a stopped process would not die cleanly
            ctl.kill()


STORES = ["sqlite", "etcd", pytest.param("k8s", marks=pytest.mark.kstore)]


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    kind = getattr(request, "param", "sqlite")
    if kind == "etcd":
        with etcd_server(tmp_path / "etcd") as server:
            yield server.url
    elif kind == "k8s":
        yield request.getfixturevalue("new_kube_store_url")
    else:
        yield f"sqlite://{tmp_path}/ipward.db"


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with open_store(store_url) as s:
        yield s


def create_pool(url: str, options: str) -> None:
    run_cli("pool", "create", "p", "--cooldown", "0", *options.split(), store=url, check=True)


def pool_spec(store: Store) -> PoolSpec:
    kv = store.get(keys.pool_key("p"))
    assert kv is not None
    spec = PoolSpec.from_dict(rec.decode(kv.value))
    spec.revision = kv.mod_revision
    return spec


def register(store: Store, *nodes: str) -> None:
    store.txn([], [Put(f"nodes/{n}", rec.encode({"node": n})) for n in nodes])


def leader(store: Store) -> dict | None:
    kv = store.get(LEADER_KEY)
    return None if kv is None else rec.decode(kv.value)


def leader_id(store: Store) -> str | None:
    value = leader(store)
    return None if value is None else value["id"]


def block_states(store: Store) -> dict[str, dict]:
    return {keys.cidr_of(kv.key): rec.decode(kv.value) for kv in store.range("blocks/p/")[0]}


def of_node(store: Store, node: str, state: str | None = None) -> list[str]:
    return sorted(
        cidr
        for cidr, s in block_states(store).items()
        if s["node"] == node and (state is None or s["state"] == state)
    )


def released(store: Store) -> list[str]:
    return sorted(keys.cidr_of(kv.key) for kv in store.range("blockfree/p/")[0])


def free_of(store: Store, node: str, family: int) -> int:
    """The controller's measure: usable addresses of the node's active blocks of this
    family, less the records in them."""
    spec = pool_spec(store)
    per_block: dict[str, int] = {}
    for kv in store.range("ips/p/")[0]:
        cidr = rec.decode(kv.value)["block"]
        per_block[cidr] = per_block.get(cidr, 0) + 1
    total = 0
    for cidr in of_node(store, node, rec.ACTIVE):
        block = spec.block_by_cidr(cidr)
        assert block is not None
        if block.range_set.family == family:
            total += block.usable_count() - per_block.get(cidr, 0)
    return total


def assert_single_owners(store: Store) -> None:
    """Every block record has exactly one affinity entry (its node's) and the reverse; a
    released block has neither, and no address record lies in one."""
    states = block_states(store)
    owners: dict[str, list[str]] = {}
    for kv in store.range("affinity/p/")[0]:
        node, _, cidr = kv.key[len("affinity/p/") :].partition("/")
        owners.setdefault(cidr, []).append(node)
    for cidr, state in states.items():
        assert owners.get(cidr) == [state["node"]], (cidr, state, owners.get(cidr))
    assert set(owners) <= set(states), set(owners) - set(states)
    gone = released(store)
    assert not set(gone) & (set(states) | set(owners)), gone
    for kv in store.range("ips/p/")[0]:
        record = rec.decode(kv.value)
        assert record["block"] not in gone, (kv.key, record)
        assert states.get(record["block"]) is not None, (kv.key, record)


def records_outside_blocks(store: Store) -> list[str]:
    """Records whose block did not exist at some moment while they existed unchanged
    (read the records, then the blocks, then each suspect again at its revision)."""
    records = store.range("ips/p/")[0]
    live = set(block_states(store))
    out = []
    for kv in records:
        if rec.decode(kv.value)["block"] not in live:
            again = store.get(kv.key)
            if again is not None and again.mod_revision == kv.mod_revision:
                out.append(kv.key)
    return out


def assert_check_clean(url: str) -> None:
    out = run_cli("--json", "check", store=url)
    assert out.returncode == 0, out.stdout + out.stderr


class AgentStandIn:
    """Plays a node's agent in the handshake: answers the node's marked blocks."""

    def __init__(self, url: str, node: str) -> None:
        self.store = open_store(url)
        self.node = node
        self.answers: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AgentStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.store.close()

    def _run(self) -> None:
        while not self.stopping.wait(0.05):
            try:
                spec = pool_spec(self.store)
                for kv in self.store.range("blocks/p/")[0]:
                    state = rec.decode(kv.value)
                    if state["node"] == self.node and state["state"] == rec.MARKED:
                        answer = blocks.answer(self.store, spec, kv, time.time())
                        if answer:
                            self.answers.append((keys.cidr_of(kv.key), answer))
            except StoreError:
                continue  # a busy store: try again, as an agent would


def pause(ctl: Ctl, url: str) -> None:
    """SIGSTOP, but not while the process holds SQLite's write lock: a stopped writer
    would stall every process on the file (SQLite's nature, not the controller's)."""
    from ipward.store.sqlite import SqliteStore

    for _ in range(50):
        os.kill(ctl.pid, signal.SIGSTOP)
        probe = SqliteStore(url[len("sqlite://") :], busy_timeout=0.3)
        try:
            probe.txn([], [Put("test/probe", b"")])
            return
        except StoreError:
            os.kill(ctl.pid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            probe.close()
    raise AssertionError("the process always held the write lock")


def att(name: str) -> Attachment:
    return Attachment("net", name, "eth0")


# -- 1. election -------------------------------------------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_one_leader_and_a_successor_after_sigkill(store_url, store, spawn):
    first, second = spawn(store_url, "c1"), spawn(store_url, "c2")
    by_id = {"c1": first, "c2": second}
    boss = by_id[wait_for(lambda: leader_id(store), "a leader", TAKEOVER)]
    standby = second if boss is first else first
    wait_for(
        lambda: (
            boss.metric("ipward_controller_leader") == 1
            and standby.metric("ipward_controller_leader") == 0
        ),
        "the leader metric on both",
        10,
    )
    # Through several keepalives, one leader and one waiting: past 1.5 TTL, a lease not
    # kept alive would have expired and the standby taken over.
    since = time.monotonic()

    def one_leader_past_the_ttl() -> bool:
        assert leader_id(store) == boss.ident
        assert standby.metric("ipward_controller_leader") == 0
        return time.monotonic() > since + 1.5 * TTL

    wait_for(one_leader_past_the_ttl, "1.5 TTL of one leader", 3 * TTL, 0.2)
    assert boss.healthz() == "ok: leader" and standby.healthz() == "ok: standby"

    boss.kill()
    wait_for(
        lambda: (
            leader_id(store) == standby.ident and standby.metric("ipward_controller_leader") == 1
        ),
        "the standby to take over",
        TAKEOVER,
    )
    assert standby.logged("leadership acquired")
    # A clean stop revokes the lease before the process exits: the key is gone already.
    assert standby.terminate() == 0
    assert leader(store) is None
    assert standby.logged("leadership released")


# -- 2. warm target ----------------------------------------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_warm_target_per_node_and_family_with_a_ledger_racing(store_url, store, spawn):
    create_pool(
        store_url,
        "--range 10.0.0.0/24 --range fd00::/120 --block-v4 28 --block-v6 124"
        " --warm 20 --release-delay 1000",
    )
    register(store, "n1", "n2")
    ctl = spawn(store_url, "c1")
    errors: list[BaseException] = []

    def allocate() -> None:  # node n1's agent, claiming blocks as the controller assigns
        with open_store(store_url) as own:
            ledger = Ledger(own, "n1")
            try:
                spec = ledger.get_pool("p")
                for i in range(25):
                    ledger.allocate([spec], att(f"a{i}"), PodInfo())
                    time.sleep(0.05)
            except BaseException as e:
                errors.append(e)

    wait_for(lambda: leader_id(store) == "c1", "the controller to lead", TAKEOVER)
    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join(60)
    assert not errors, errors
    wait_for(
        lambda: all(free_of(store, n, f) >= 20 for n in ("n1", "n2") for f in (4, 6)),
        "every node at its warm target in both families",
        20,
    )
    wait_for(
        lambda: all(
            ctl.metric("ipward_controller_warm_deficit", pool="p", node=n, family=f) == 0
            for n in ("n1", "n2")
            for f in ("4", "6")
        ),
        "no warm deficit in the metrics",
        10,
    )
    assert (ctl.metric("ipward_controller_blocks_assigned_total") or 0) >= 4
    assert ctl.terminate() == 0
    assert_single_owners(store)
    assert len(store.range("ips/p/")[0]) == 50  # 25 attachments, one address per family
    assert_check_clean(store_url)


# -- 3. surplus reclaim ------------------------------------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_surplus_blocks_are_marked_answered_and_released(store_url, store, spawn):
    create_pool(store_url, "--range 10.0.0.0/24 --block-v4 28 --warm 10 --release-delay 1")
    spec = pool_spec(store)
    extra = [blocks.assign(store, spec, 4, "n1") for _ in range(4)]  # 63 free, warm 10
    assert None not in extra
    register(store, "n1")
    with AgentStandIn(store_url, "n1") as agent:
        ctl = spawn(store_url, "c1")
        wait_for(
            lambda: len(of_node(store, "n1")) == 1 and len(released(store)) == 3,
            "three surplus blocks released, one kept",
            30,
        )
        wait_for(
            lambda: ctl.metric("ipward_controller_handshakes_total", result="completed") == 3,
            "three completed handshakes in the metrics",
            10,
        )
        assert ctl.metric("ipward_controller_handshakes_total", result="started") == 3
        assert sorted(c for c, a in agent.answers if a == rec.READY) == released(store)
    assert of_node(store, "n1", rec.ACTIVE) == of_node(store, "n1")
    assert free_of(store, "n1", 4) >= 10
    assert set(released(store)) | set(of_node(store, "n1")) == set(extra)
    assert len(ctl.logged("handshake completed")) == 3
    assert ctl.terminate() == 0
    assert_single_owners(store)
    assert_check_clean(store_url)


# -- 4. refused --------------------------------------------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_a_refused_block_is_resumed(store_url, store, spawn):
    create_pool(store_url, "--range 10.0.0.0/24 --block-v4 28 --warm 1 --release-delay 1000")
    register(store, "n1")
    ctl = spawn(store_url, "c1")
    [cidr] = wait_for(lambda: of_node(store, "n1"), "a block assigned to n1", TAKEOVER)
    spec = pool_spec(store)
    ip = Ledger(store, "n1").allocate([spec], att("x"), PodInfo())[0].ip
    assert rec.decode(store.get(keys.ip_key("p", ip)).value)["block"] == cidr
    # A mark decided on a record count read before this allocation (as a controller's
    # pass can): the agent finds the address allocated and refuses.
    kv = store.get(keys.block_key("p", cidr))
    assert blocks.mark(store, "p", kv, time.time())
    assert blocks.answer(store, spec, store.get(kv.key), time.time()) == rec.REFUSED
    wait_for(
        lambda: block_states(store)[cidr]["state"] == rec.ACTIVE, "the controller's resume", 10
    )
    wait_for(
        lambda: ctl.metric("ipward_controller_handshakes_total", result="aborted") == 1,
        "one aborted handshake in the metrics",
        10,
    )
    assert [e["block"] for e in ctl.logged("block resumed")] == [cidr]
    assert "marked_at" not in block_states(store)[cidr]
    assert store.get(keys.ip_key("p", ip)) is not None
    assert ctl.terminate() == 0
    assert_single_owners(store)
    assert_check_clean(store_url)


# -- 5. abort: the node takes its block back ---------------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_a_node_needing_space_takes_a_ready_block_back(store_url, store, spawn):
    # One block in the whole pool, warm 0: once empty it is surplus.
    create_pool(store_url, "--range 10.0.0.0/28 --block-v4 28 --warm 0 --release-delay 1")
    register(store, "n1")
    ledger = Ledger(store, "n1")
    spec = pool_spec(store)
    ledger.allocate([spec], att("x"), PodInfo())
    ledger.free(att("x"))
    [cidr] = of_node(store, "n1")
    ctl = spawn(store_url, "c1", ready_delay=60)  # it would release a ready block only later
    wait_for(lambda: of_node(store, "n1", rec.MARKED), "the surplus block marked", TAKEOVER)
    kv = store.get(keys.block_key("p", cidr))
    assert blocks.answer(store, spec, kv, time.time()) == rec.READY
    ready = store.get(kv.key)
    # The node needs an address and the marked block is its only room: it takes it back.
    ip = ledger.allocate([spec], att("y"), PodInfo())[0].ip
    state = block_states(store)[cidr]
    assert state["state"] == rec.ACTIVE and state["node"] == "n1"
    assert rec.decode(store.get(keys.ip_key("p", ip)).value)["block"] == cidr
    # The release the controller would make, at the revision it read, fails its CAS.
    assert not blocks.complete_hand_back(store, spec, ready)
    wait_for(
        lambda: ctl.metric("ipward_controller_handshakes_total", result="aborted") == 1,
        "the take-back counted as an aborted handshake",
        10,
    )
    assert ctl.logged("handshake aborted")
    assert ctl.metric("ipward_controller_handshakes_total", result="completed") == 0
    assert ctl.terminate() == 0
    assert of_node(store, "n1") == [cidr] and released(store) == []
    assert_single_owners(store)
    assert_check_clean(store_url)


# -- 6. controller killed in every handshake state ---------------------------------------


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_controller_killed_in_every_handshake_state(store_url, store, spawn):
    # Four /26 blocks, all n1's, with 254 free entries: two cleanup chunks per block
    # (no gateway: every address of the /24 is handed out).
    create_pool(
        store_url, "--range 10.0.0.0/24,gateway=none --block-v4 26 --warm 10 --release-delay 1"
    )
    register(store, "n1")
    spec = pool_spec(store)
    ledger = Ledger(store, "n1")
    for i in range(254):
        ledger.allocate([spec], att(f"s{i}"), PodInfo())
    for i in range(254):
        ledger.free(att(f"s{i}"))
    every_block = of_node(store, "n1")
    assert len(every_block) == 4 and len(store.range("free/p/")[0]) == 254

    # Killed after marking: the marks stay; nobody answers them yet.
    first = spawn(store_url, "k0")
    marked = wait_for(lambda: of_node(store, "n1", rec.MARKED), "surplus marked", TAKEOVER)
    first.kill()
    marked = of_node(store, "n1", rec.MARKED)
    assert len(marked) >= 1 and len(of_node(store, "n1")) == 4

    # Killed after the agent answered: ready blocks with no controller alive...
    for cidr in marked:
        kv = store.get(keys.block_key("p", cidr))
        assert blocks.answer(store, spec, kv, time.time()) == rec.READY
    # ...and killed during a release: the first cleanup chunk of a ready block done (the
    # very transaction `blocks.complete_hand_back` makes first), the rest not.
    kv = store.get(keys.block_key("p", marked[0]))
    block = spec.block_by_cidr(marked[0])
    assert block is not None
    frees = [f for ip in blocks.addresses(block) if (f := store.get(keys.free_key("p", ip)))]
    ops: list[Put | Delete] = []
    for free in frees[: free_queue.CLEANUP_CHUNK]:
        ops += [Delete(free.key), Delete(rec.decode(free.value)["queue"])]
    assert store.txn([at_revision(kv.key, kv.mod_revision)], ops).succeeded

    # Successors killed at random moments of their leadership, while the node fills
    # blocks (claiming released ones back, taking marked ones back) and empties them
    # again, so every round finds new surplus to hand back.
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    stop_churn = threading.Event()
    churn_errors: list[BaseException] = []
    retried: list[int] = []

    def churn() -> None:
        rng_churn = random.Random(seed)
        with open_store(store_url) as own:
            node = Ledger(own, "n1")
            i = 0
            try:
                while not stop_churn.is_set():
                    live = []
                    for _ in range(rng_churn.randrange(20, 90)):
                        if stop_churn.is_set():
                            break
                        try:
                            node.allocate([spec], att(f"c{i}"), PodInfo())
                            live.append(att(f"c{i}"))
                        except TryAgainLater:
                            # A long-lived ledger can answer 11 spuriously after a block
                            # it freed addresses into was released and claimed back (its
                            # memory of the deleted free entries; reported as a ledger
                            # bug). Retried with a new ledger, as after an agent restart.
                            retried.append(i)
                            node = Ledger(own, "n1")
                        i += 1
                    for a in live:
                        node.free(a)
                    stop_churn.wait(rng_churn.uniform(0.5, 1.5))
            except (IpwardError, StoreError) as e:
                churn_errors.append(e)

    orphans: list[str] = []

    def watch_records() -> None:  # all along: no record ever outside a live block
        with open_store(store_url) as own:
            while not stop_churn.wait(0.1):
                orphans.extend(records_outside_blocks(own))

    churner = threading.Thread(target=churn)
    watcher = threading.Thread(target=watch_records)
    at_kill: list[Tally[str]] = []  # block states right after each kill, for the message
    with AgentStandIn(store_url, "n1"):
        churner.start()
        watcher.start()
        try:
            for round_ in range(4):
                victim = spawn(store_url, f"k{round_ + 1}")
                wait_for(
                    lambda name=victim.ident: leader_id(store) == name,
                    f"{victim.ident} to take over",
                    TAKEOVER,
                )
                time.sleep(rng.uniform(0, 1.5))
                victim.kill()
                at_kill.append(Tally(s["state"] for s in block_states(store).values()))
        finally:
            stop_churn.set()
            churner.join(60)
            watcher.join(60)
        assert not churner.is_alive() and not churn_errors, (seed, churn_errors)
        assert orphans == [], (seed, orphans)
        last = spawn(store_url, "final")
        wait_for(
            lambda: len(of_node(store, "n1")) == 1 and len(released(store)) == 3,
            f"every surplus block released in the end (seed {seed}, at kills {at_kill},"
            f" ADDs retried {len(retried)})",
            40,
        )
        assert last.terminate() == 0
    # No block lost or owned twice: each of the four is n1's active block or released.
    [kept] = of_node(store, "n1", rec.ACTIVE)
    assert sorted([kept, *released(store)]) == every_block
    assert store.range("ips/p/")[0] == []
    assert_single_owners(store)
    assert_check_clean(store_url)


# -- 7. fencing --------------------------------------------------------------------------


def test_a_paused_leader_is_fenced_out_and_steps_down(store_url, store, spawn):
    release_delay = 4.0
    create_pool(
        store_url, f"--range 10.0.0.0/24 --block-v4 28 --warm 10 --release-delay {release_delay:g}"
    )
    register(store, "n1")
    old = spawn(store_url, "old")
    wait_for(lambda: leader_id(store) == "old" and of_node(store, "n1"), "leader", TAKEOVER)
    new = spawn(store_url, "new")
    spec = pool_spec(store)
    for _ in range(2):  # surplus: 47 free where 10 are wanted
        assert blocks.assign(store, spec, 4, "n1")
    wait_for(
        lambda: old.metric("ipward_controller_blocks", pool="p", node="n1", state="active") == 3,
        "the leader to see the new empty blocks",
        10,
    )
    seen = time.monotonic()  # the old leader started counting them empty before this
    pause(old, store_url)
    wait_for(lambda: leader_id(store) == "new", "the successor to take over", TAKEOVER)
    # Wake the old leader once, by its own count, the blocks have been empty long enough
    # to be marked: were it to act on its stale belief, it would mark them now.
    wait_for(
        lambda: time.monotonic() > seen + release_delay + 0.5,
        "the blocks empty for the release delay, by the old leader's count",
        release_delay + 1,
    )
    os.kill(old.pid, signal.SIGCONT)
    wait_for(
        lambda: old.metric("ipward_controller_leader") == 0 and old.logged("leadership lost"),
        "the old leader to step down",
        10,
    )
    wait_for(lambda: len(of_node(store, "n1", rec.MARKED)) == 2, "the new leader's marks", 20)
    assert leader_id(store) == "new"
    assert old.logged("handshake started") == [] and old.logged("block marked") == []
    assert old.metric("ipward_controller_handshakes_total", result="started") == 0
    assert sorted(e["block"] for e in new.logged("handshake started")) == of_node(
        store, "n1", rec.MARKED
    )
    assert old.proc.poll() is None and old.healthz() == "ok: standby"


def everything(store: Store) -> list[tuple[str, int]]:
    prefixes = ("affinity/", "blockcursor/", "blockfree/", "blocks/", "controller/", "pools/")
    return [(kv.key, kv.mod_revision) for p in prefixes for kv in store.range(p)[0]]


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_a_write_of_a_stale_leader_fails_its_fence(store_url, store):
    """In process, deterministically: a controller that still believes it leads (its
    lease was revoked and the key taken by another) tries to act; every write fails the
    fence, nothing changes, and it steps down."""
    create_pool(store_url, "--range 10.0.0.0/24 --block-v4 28 --warm 20 --release-delay 0")
    register(store, "n1", "n2")
    spec = pool_spec(store)
    for _ in range(3):
        blocks.assign(store, spec, 4, "n1")  # surplus on n1; n2 has nothing (a deficit)
    with open_store(store_url) as e1_store, open_store(store_url) as e2_store:
        stale = Election(e1_store, "stale", ttl=30)
        stale.campaign()
        assert stale.leading
        ctl = Controller(store, stale, Metrics("stale", lambda: True), interval=1, ready_delay=0)
        lease = rec.decode(store.get(LEADER_KEY).value)
        assert lease["id"] == "stale"
        # Its lease revoked behind its back, a successor elected.
        e2_store.lease_revoke(store.get(LEADER_KEY).lease)
        successor = Election(e2_store, "successor", ttl=30)
        successor.campaign()
        assert successor.leading and stale.leading  # the stale one does not know yet
        before = everything(store)
        ctl.run_pass_logged()
        assert everything(store) == before
        assert not stale.leading
        assert leader_id(store) == "successor"
        successor.resign()
        assert leader(store) is None


# -- 8. pools that change or go ----------------------------------------------------------


def passes(ctl: Ctl) -> float:
    return ctl.metric("ipward_controller_pass_seconds_count") or 0


def test_sigusr1_runs_a_pass_now(store_url, store, spawn):
    """`kill -USR1`: the next pass now, not an interval (an hour here) later."""
    ctl = spawn(store_url, "c1", interval=3600)
    wait_for(lambda: passes(ctl) >= 1, "the first pass, on taking the lead", TAKEOVER)

    def signalled_pass() -> None:
        wanted = passes(ctl) + 1
        os.kill(ctl.pid, signal.SIGUSR1)
        wait_for(lambda: passes(ctl) >= wanted, "a pass after SIGUSR1", TAKEOVER)

    signalled_pass()
    signalled_pass()  # and again: the handler stays
    assert ctl.terminate() == 0


SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


@pytest.mark.skipif(SYS_TGKILL is None, reason="tgkill's syscall number unknown here")
def test_sigusr1_handed_to_another_thread_runs_a_pass(store_url, store, spawn):
    """Found flaky: the kernel may hand a process's signal to any of its threads, and
    Python runs the handler on the main thread, which a wait of the whole interval (an
    hour here) kept from noticing. Sent to each other thread of the controller in turn
    (tgkill), each is followed by a pass."""
    ctl = spawn(store_url, "c1", interval=3600)
    wait_for(lambda: passes(ctl) >= 1, "the first pass, on taking the lead", TAKEOVER)
    threads = [int(t) for t in os.listdir(f"/proc/{ctl.pid}/task") if int(t) != ctl.pid]
    assert threads  # the election, the metrics server, the store's client
    libc = ctypes.CDLL(None, use_errno=True)
    for thread in threads:
        wanted = passes(ctl) + 1
        if libc.syscall(SYS_TGKILL, ctl.pid, thread, signal.SIGUSR1) != 0:
            continue  # the thread ended meanwhile
        done = partial(lambda n: passes(ctl) >= n, wanted)
        wait_for(done, f"a pass after SIGUSR1 to thread {thread}", TAKEOVER)
    assert ctl.terminate() == 0


def test_the_controller_prunes_an_earlier_layout_once_no_record_holds_it(store_url, store, spawn):
    """An inline pool whose config changed keeps its earlier layout while a record holds
    one of its addresses; the controller's pass removes what the new layout does not
    use (the old block, its free entries), then the layout itself once empty."""
    register(store, "n1")
    ledger = Ledger(store, "n1")

    def declared(subnet: str) -> PoolSpec:
        return PoolSpec(
            "p",
            [[{"subnet": subnet}]],
            block_prefix={4: 28},
            cooldown=0,
            warm=0,
            source="cni-config",
        )

    ledger.allocate([declared("10.20.0.0/24")], att("a"), PodInfo())
    ledger.allocate([declared("10.20.0.0/24")], att("b"), PodInfo())
    ledger.free(att("b"))
    ledger.allocate([declared("10.30.0.0/24")], att("c"), PodInfo())
    assert len(pool_spec(store).retired) == 1
    ctl = spawn(store_url, "c1")
    wait_for(
        lambda: list(block_states(store)) == ["10.30.0.0/28"] and not store.range("free/p/")[0],
        "the old layout's block and free entries removed",
        TAKEOVER,
    )
    start = passes(ctl)
    wait_for(lambda: passes(ctl) >= start + 2, "two more passes", 10)
    assert len(pool_spec(store).retired) == 1  # "a" still holds 10.20.0.1
    assert_check_clean(store_url)
    ledger.free(att("a"))
    wait_for(lambda: pool_spec(store).retired == [], "the earlier layout pruned", 10)
    assert ctl.logged("pool layouts pruned")
    assert ctl.terminate() == 0
    assert_single_owners(store)
    assert_check_clean(store_url)


def test_the_controller_leaves_a_pool_being_deleted_alone(store_url, store, spawn):
    """A pool marked `deleting` gets no block (an assignment also compares the spec it
    read), so `pool delete` finishes with nothing written behind it."""
    create_pool(store_url, "--range 10.0.0.0/24 --block-v4 28 --warm 20")
    kv = store.get(keys.pool_key("p"))
    store.txn([], [Put(kv.key, rec.encode({**rec.decode(kv.value), "state": "deleting"}))])
    register(store, "n1")
    ctl = spawn(store_url, "c1")
    wait_for(lambda: passes(ctl) >= 3, "three passes", TAKEOVER)
    assert block_states(store) == {}
    assert run_cli("pool", "delete", "p", store=store_url).returncode == 0
    assert ctl.terminate() == 0
    assert store.range("blockcursor/")[0] == [] and store.range("affinity/")[0] == []
    assert_check_clean(store_url)
