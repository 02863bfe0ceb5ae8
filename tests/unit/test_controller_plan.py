"""The controller's pool pass decisions (`ipward.controller.plan`), pure: a pool's state in,
typed actions out, no store. What the pass does with them on real stores and processes is
`test_controller.py`'s; here each rule is pinned on its own, with the inputs around its
edges (a delay just short and just past, a target just met, a node registered, gone or
neither). The last section is the pass around the plan, in process on a real store: what
it remembers of the actions it applied."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ipward.controller import plan
from ipward.controller.election import Election
from ipward.controller.metrics import Metrics
from ipward.controller.passes import Controller
from ipward.controller.plan import (
    GONE,
    AnswerForGoneNode,
    AssignBlock,
    CompleteHandBack,
    MarkForHandBack,
    PoolMemory,
    PoolState,
    PruneLayouts,
    ResumeHandBack,
    TakenBack,
)
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import ACTIVE, MARKED, READY, REFUSED, Attachment, BlockRecord, PodInfo
from ipward.ipam import blocks
from ipward.ipam.ledger import Ledger
from ipward.ipam.pools import create_pool
from ipward.store import Store, open_store
from ipward.store.base import KeyValue, Put
from ipward_lab.simcluster import SimFileSource, write_sim_state

# /28 blocks of 10.0.0.0/24: 16 usable addresses each but the first and the last (they
# lose the range's network address, gateway or broadcast); the tests use inner ones.
A, B, C, D = "10.0.0.16/28", "10.0.0.32/28", "10.0.0.48/28", "10.0.0.64/28"
SIZE = 16
NOW = 1_000_000.0


def spec(warm: int = 20, release_delay: float = 30.0) -> PoolSpec:
    return PoolSpec(
        "p",
        [[{"subnet": "10.0.0.0/24"}]],
        block_prefix={4: 28},
        warm=warm,
        release_delay=release_delay,
    )


def state_of(
    blocks: dict[str, BlockRecord],
    records: dict[str, int] | None = None,
    fills: dict[tuple[int, str], str] | None = None,
    warm: int = 20,
    release_delay: float = 30.0,
) -> PoolState:
    kvs = {
        cidr: KeyValue(keys.block_key("p", cidr), block.encode(), 1, i + 1, 1)
        for i, (cidr, block) in enumerate(blocks.items())
    }
    return PoolState(spec(warm, release_delay), dict(blocks), kvs, records or {}, fills or {})


def active(node: str) -> BlockRecord:
    return BlockRecord(node, ACTIVE, 0)


def test_the_blocks_of_the_test_layout_hold_what_the_tests_assume() -> None:
    state = state_of({})
    for cidr in (A, B, C, D):
        layout = state.layout(cidr)
        assert layout is not None and layout.usable_count() == SIZE
    assert state.layout("10.9.0.0/28") is None


# -- the hand-back ------------------------------------------------------------------------


def test_a_ready_block_is_completed_only_past_the_ready_delay() -> None:
    ready = BlockRecord("n1", ACTIVE, 0).marked(NOW - 10).answered(READY, NOW - 5)
    state = state_of({A: ready})
    early = plan.handshake_steps(state, {A}, {"n1"}, set(), NOW, ready_delay=5.5)
    assert early == []
    due = plan.handshake_steps(state, {A}, {"n1"}, set(), NOW, ready_delay=5)
    assert due == [CompleteHandBack(A, "n1", state.kvs[A], due[0].why)]
    assert "answered ready 5.0s ago" in due[0].why


def test_a_refused_block_is_resumed_and_a_marked_one_waits_for_its_agent() -> None:
    marked = active("n1").marked(NOW)
    refused = marked.answered(REFUSED, NOW)
    state = state_of({A: refused, B: marked})
    steps = plan.handshake_steps(state, set(), {"n1"}, set(), NOW, 0)
    assert steps == [ResumeHandBack(A, "n1", state.kvs[A])]


def test_a_block_seen_in_the_handshake_and_active_now_was_taken_back() -> None:
    state = state_of({A: active("n1"), B: active("n1")})
    steps = plan.handshake_steps(state, {A}, {"n1"}, set(), NOW, 0)
    assert steps == [TakenBack(A, "n1")]


def test_a_gone_nodes_marked_block_is_answered_for_it_an_unknown_nodes_is_left_alone() -> None:
    marked = active("x").marked(NOW)
    state = state_of({A: marked, B: active("y").marked(NOW).answered(REFUSED, NOW)})
    # x is gone; y is neither registered nor known gone (its lease may come back)
    steps = plan.handshake_steps(state, set(), {"n1"}, {"x"}, NOW, 0)
    assert steps == [AnswerForGoneNode(A, "x", state.kvs[A], NOW)]
    assert plan.handshake_steps(state, set(), {"n1"}, set(), NOW, 0) == []


def test_a_block_changed_this_pass_gets_no_second_step() -> None:
    state = state_of({A: active("n1").marked(NOW).answered(REFUSED, NOW)})
    state.changed(A, state.blocks[A].resumed())
    state.changed(B, active("n1").marked(NOW).answered(REFUSED, NOW))  # no KeyValue
    assert plan.handshake_steps(state, set(), {"n1"}, set(), NOW, 0) == []


def test_a_gone_nodes_block_is_asked_back_once_emptied() -> None:
    state = state_of(
        {A: active("gone"), B: active("gone"), C: active("n1"), D: active("gone").marked(NOW)},
        records={B: 1},
    )
    # A empty: asked back; B still holds a record (GC frees it first); C is a live
    # node's; D is already in the hand-back.
    asked = plan.ask_back_from_gone_nodes(state, {"gone"}, NOW)
    assert asked == [MarkForHandBack(A, "gone", state.kvs[A], NOW, GONE)]
    assert plan.ask_back_from_gone_nodes(state, set(), NOW) == []


# -- the warm target ----------------------------------------------------------------------


def test_warm_targets_top_up_every_node_short_one_block_a_round() -> None:
    state = state_of(
        {A: active("n2"), B: active("n3"), C: active("n3"), D: active("n4")},
        records={D: 1},
        warm=16,
    )
    # n1 has nothing, n2 16, n3 32, n4 15 (a record in its block); warm 16
    round1 = plan.warm_round(state, {"n1", "n2", "n3", "n4"}, set())
    assert [(a.node, a.family, a.free) for a in round1] == [("n1", 4, 0), ("n4", 4, 15)]
    assert all(isinstance(a, AssignBlock) for a in round1)
    # warm 17: n2 (16) is short too; a node whose assignment failed is passed over
    state = state_of({A: active("n2")}, warm=17)
    assert [a.node for a in plan.warm_round(state, {"n1", "n2"}, {("n1", 4)})] == ["n2"]


def test_warm_rounds_end_once_the_assigned_blocks_meet_the_target() -> None:
    state = state_of({}, warm=20)
    state.changed(A, BlockRecord.claimed("n1", 0, 0))  # as the executor leaves it
    assert [a.free for a in plan.warm_round(state, {"n1"}, set())] == [SIZE]
    state.changed(B, BlockRecord.claimed("n1", 0, 0))
    assert plan.warm_round(state, {"n1"}, set()) == []
    assert plan.deficits(state, {"n1"}) == {("p", "n1", "4"): 0}


def test_an_unregistered_nodes_blocks_count_for_nobody() -> None:
    state = state_of({A: active("n9")}, warm=10)
    assert state.free_per_node({"n1"}) == {("n1", 4): 0}
    assert plan.deficits(state, {"n1"}) == {("p", "n1", "4"): 10}
    assert plan.block_counts(state) == {("p", "n9", ACTIVE): 1}


def test_the_warm_target_is_kept_for_the_nodes_a_pool_serves_and_an_inline_pools_users() -> None:
    """Finding (a real cluster, each node's network declaring its own range inline, as
    with host-local): the controller gave every node warm blocks of every node's pool,
    which only the declaring node ever allocates from: each node's /24 split three ways.
    An inline pool is warmed on the nodes holding a block of it; a pool naming nodes
    (`--node`) on those; any other pool on every registered node."""
    registered = {"n1", "n2", "n3"}
    state = state_of({A: active("n1")})
    assert plan.warmed(state, registered) == registered
    state.spec.source = "cni-config"
    assert plan.warmed(state, registered) == {"n1"}
    assert [a.node for a in plan.warm_round(state, plan.warmed(state, registered), set())] == ["n1"]
    state.spec.source, state.spec.nodes = "cli", ["n2", "n9"]
    assert plan.warmed(state, registered) == {"n2"}


def test_an_unreadable_block_key_of_another_node_holds_up_no_warm_block() -> None:
    """As before the split: a block key whose CIDR does not parse (bad data) fails the
    pool's pass only where the pass reads its CIDR (prune, at its end), not before the
    warm target is served; only a registered or gone node's blocks are read earlier."""
    state = state_of({"not-a-cidr/28": active("n9"), A: active("n1")}, warm=17)
    assert plan.ask_back_from_gone_nodes(state, {"n8"}, NOW) == []
    assert [a.node for a in plan.warm_round(state, {"n1"}, set())] == ["n1"]


# -- surplus ------------------------------------------------------------------------------


def surplus_state() -> PoolState:
    # n1 emptied: three empty blocks (48 free), warm 20, release delay 30 s; it fills A.
    return state_of(
        {A: active("n1"), B: active("n1"), C: active("n1")},
        fills={(4, "n1"): A},
        warm=20,
        release_delay=30,
    )


def test_a_surplus_block_of_an_emptied_node_is_marked_after_its_delay() -> None:
    state = surplus_state()
    since = plan.empty_since(state, {"n1"}, {}, mono=100.0)
    assert since == {A: 100.0, B: 100.0, C: 100.0}
    assert plan.surplus(state, {"n1"}, since, NOW, mono=129.9) == []
    marks = plan.surplus(state, {"n1"}, since, NOW, mono=130.0)
    # One only: a second would leave 16 < 20. Not A, the block the node fills.
    assert [(a.cidr, a.node) for a in marks] == [(B, "n1")]
    assert isinstance(marks[0], MarkForHandBack) and "32 free without it" in marks[0].why


def test_surplus_never_takes_a_node_below_its_warm_target() -> None:
    state = surplus_state()
    since = dict.fromkeys((A, B, C), 0.0)
    marks = plan.surplus(state, {"n1"}, since, NOW, mono=1000.0)
    assert len(marks) == 1
    state = state_of({A: active("n1"), B: active("n1")}, warm=17, release_delay=0)
    assert plan.surplus(state, {"n1"}, dict.fromkeys((A, B), 0.0), NOW, 0.0) == []


def test_surplus_asks_only_nodes_with_an_empty_block_in_name_order() -> None:
    """Each node's free count is over all its blocks, held or not; a block that holds
    a record, or an unregistered node's, is never asked back, whatever `since` says."""
    blocks = {A: active("n2"), B: active("n2"), C: active("n1"), D: active("n1")}
    state = state_of(blocks, records={B: 1, C: 2}, warm=10, release_delay=0)
    since = dict.fromkeys((A, B, C, D), 0.0)  # B and C hold records: they do not count
    marks = plan.surplus(state, {"n1", "n2"}, since, NOW, mono=1.0)
    # n1: 14 + 16 free, D asked back (14 left >= 10); n2: 16 + 15, A asked back (15 left)
    assert [(a.cidr, a.node) for a in marks] == [(D, "n1"), (A, "n2")]
    assert "14 free without it" in marks[0].why and "15 free without it" in marks[1].why
    assert plan.surplus(state, {"n1"}, since, NOW, mono=1.0) == marks[:1]  # n2 not registered


def test_empty_since_restarts_on_a_record_or_a_change_and_holds_for_an_unregistered_node() -> None:
    state = state_of({A: active("n1"), B: active("n1"), C: active("n9")}, records={A: 1})
    before = {A: 5.0, B: 7.0, C: 3.0}
    assert plan.empty_since(state, {"n1"}, before, mono=50.0) == {B: 7.0, C: 3.0}
    assert plan.empty_since(state, {"n1"}, {}, mono=50.0) == {B: 50.0}
    # changed this pass (resumed from a refused hand-back): its empty time starts again
    state.changed(B, active("n1"))
    assert plan.empty_since(state, {"n1"}, before, mono=50.0) == {C: 3.0}


def test_what_a_pass_remembers_of_blocks_it_asked_back() -> None:
    state = surplus_state()
    since = plan.empty_since(state, {"n1"}, {}, mono=0.0)
    state.changed(B, state.blocks[B].marked(NOW))
    memory = plan.remember(state, since)
    # B is in the hand-back; if its node takes it back, its empty time starts again
    assert memory == PoolMemory({A: 0.0, C: 0.0}, frozenset({B}))


def test_a_change_of_ranges_prunes_the_pool() -> None:
    assert plan.prune(state_of({A: active("n1")})) == []
    stray = plan.prune(state_of({"10.9.0.0/28": active("n1")}))
    assert stray == [PruneLayouts("blocks outside the current layout")]


def test_blocks_in_the_handshake_are_remembered_whatever_their_node() -> None:
    state = state_of(
        {
            A: active("n1").marked(NOW),
            B: active("n9").marked(NOW).answered(READY, NOW),
            C: active("n1"),
        }
    )
    assert plan.remember(state, {}).in_handshake == {A, B}
    assert state.blocks[A].state == MARKED


# -- the pass around the plan -------------------------------------------------------------


def create_pool_p(store: Store) -> None:
    """Pool p: /28 blocks, warm 0 and release delay 1000 s, so the steps a test sets up
    are the only ones."""
    create_pool(
        store,
        PoolSpec(
            "p",
            [[{"subnet": "10.0.0.0/24"}]],
            cooldown=0,
            block_prefix={4: 28},
            warm=0,
            release_delay=1000,
        ),
    )


@contextmanager
def leading_controller(
    sqlite_url: str, store: Store, liveness: SimFileSource | None = None
) -> Iterator[Controller]:
    """A controller in process, leading, on a real SQLite store (garbage collection
    every pass when it has a liveness source); resigned after."""
    with open_store(sqlite_url) as election_store:
        election = Election(election_store, "c1", ttl=30)
        election.campaign()
        metrics = Metrics("c1", lambda: True)
        yield Controller(
            store, election, metrics, interval=1, ready_delay=1000, liveness=liveness, gc_interval=0
        )
        election.resign()


@pytest.fixture
def leading(sqlite_url: str, sqlite_store: Store) -> Iterator[Controller]:
    """A leading controller in process with pool p (`create_pool_p`)."""
    create_pool_p(sqlite_store)
    with leading_controller(sqlite_url, sqlite_store) as controller:
        yield controller


def pool_p(store: Store) -> PoolSpec:
    kv = store.get(keys.pool_key("p"))
    assert kv is not None
    return PoolSpec.decode(kv.value)


def test_a_pool_pass_stopped_midway_remembers_the_block_it_resumed(leading: Controller) -> None:
    """Finding (the split's first cut): a pool's pass that failed after resuming a block
    kept the memory of the pass before, in which the block was in the hand-back; the next
    pass took the block, active again, for one its node took back: a second aborted
    handshake counted and logged for one refusal."""
    store, registry = leading.store, leading.metrics.registry
    store.txn([], [Put("nodes/n1", rec.encode({"node": "n1"}))])
    spec = pool_p(store)
    cidr = blocks.assign(store, spec, 4, "n1")
    assert cidr is not None
    Ledger(store, "n1").allocate([spec], Attachment("net", "x", "eth0"), PodInfo())
    key = keys.block_key("p", cidr)
    assert blocks.mark(store, "p", store.get(key), time.time())
    leading.run_pass()  # the block is marked: its agent's turn
    # The agent refuses (an address is allocated); the pool then holds a block key the
    # pass cannot read (one pool's bad data: its pass fails after the resume).
    assert blocks.answer(store, spec, store.get(key), time.time()) == REFUSED
    bad = BlockRecord("n9", ACTIVE, 0).encode()
    store.txn([], [Put(keys.block_key("p", "not-a-cidr/28"), bad)])
    aborted = {"result": "aborted"}
    leading.run_pass_logged()
    assert rec.decode(store.get(key).value)["state"] == ACTIVE  # resumed
    assert registry.get_sample_value("ipward_controller_pass_errors_total") == 1
    assert registry.get_sample_value("ipward_controller_handshakes_total", aborted) == 1
    leading.run_pass_logged()
    assert registry.get_sample_value("ipward_controller_pass_errors_total") == 2
    assert registry.get_sample_value("ipward_controller_handshakes_total", aborted) == 1


def test_a_gone_nodes_block_answered_for_it_is_counted_in_its_new_state(
    leading: Controller,
) -> None:
    """Finding: the answer the controller wrote for a gone node was not folded into the
    pass's state, so the pass's snapshot counted the block `marked` while the store held
    it `ready`, until the next pass."""
    store, snapshot = leading.store, leading.metrics.snapshot
    cidr = blocks.assign(store, pool_p(store), 4, "gone")  # of a node never registered
    assert cidr is not None
    key = keys.block_key("p", cidr)
    leading.run_pass()  # a new term: what it knew of gone nodes is forgotten
    assert snapshot.blocks == {("p", "gone", ACTIVE): 1}
    leading.collection.gone_nodes = frozenset({"gone"})  # as a garbage-collection pass finds it
    leading.run_pass()  # asked back
    assert rec.decode(store.get(key).value)["state"] == MARKED
    leading.run_pass()  # answered for it
    assert rec.decode(store.get(key).value)["state"] == READY
    assert snapshot.blocks == {("p", "gone", READY): 1}


def test_a_running_controller_judges_blocks_by_the_layout_of_the_spec_now(
    sqlite_url: str, sqlite_store: Store
) -> None:
    """The pass keeps each pool's blocks as its layout has them from pass to pass
    (`plan.Layouts`), for one revision of the spec: when an inline pool's ranges change
    under a running controller, its next pass judges the old block by the new layout
    (not one of its blocks: it counts for no node's free addresses), and prunes it."""
    store = sqlite_store

    def declared(subnet: str) -> PoolSpec:
        ranges = [[{"subnet": subnet}]]
        return PoolSpec("q", ranges, block_prefix={4: 28}, cooldown=0, warm=0, source="cni-config")

    store.txn([], [Put("nodes/n1", rec.encode({"node": "n1"}))])
    ledger = Ledger(store, "n1")
    ledger.allocate([declared("10.20.0.0/24")], Attachment("net", "a", "eth0"), PodInfo())
    ledger.free(Attachment("net", "a", "eth0"))
    with leading_controller(sqlite_url, store) as controller:
        controller.run_pass()  # the old layout's block, kept as a block of it
        assert [kv.key for kv in store.range("blocks/q/")[0]] == ["blocks/q/10.20.0.0/28"]
        assert controller.layouts["q"].blocks["10.20.0.0/28"][0] is not None
        ledger.allocate([declared("10.30.0.0/24")], Attachment("net", "c", "eth0"), PodInfo())
        controller.run_pass()
        assert controller.layouts["q"].blocks["10.20.0.0/28"] == (None, 0)
    assert [kv.key for kv in store.range("blocks/q/")[0]] == ["blocks/q/10.30.0.0/28"]


def test_a_new_term_does_not_act_on_the_gone_nodes_an_earlier_term_found(
    sqlite_url: str, sqlite_store: Store, tmp_path: Path
) -> None:
    """Finding (review): gone nodes are evidence of the term whose garbage collection
    found them. After a new term whose sources do not answer, the pass kept the earlier
    term's gone nodes (garbage collection kept them, the pass copied them) and asked
    back an emptied block of a node it had no evidence of."""
    store = sqlite_store
    create_pool_p(sqlite_store)
    on_gone = Attachment("net", "x", "eth0")
    Ledger(store, "gone").allocate([pool_p(store)], on_gone, PodInfo())  # never registered
    state = tmp_path / "cluster.json"
    write_sim_state(str(state), time.time(), {"pods": [], "nodes": []}, {})
    with leading_controller(sqlite_url, store, SimFileSource(str(state))) as controller:
        controller.run_pass()  # "gone" found gone; its block holds a record: kept
        controller.election.resign()
        controller.election.campaign()  # a new term
        state.unlink()  # whose sources do not answer
        Ledger(store, "gone").free(on_gone)  # the block is empty now
        controller.run_pass()
    assert [rec.decode(kv.value)["state"] for kv in store.range("blocks/p/")[0]] == [ACTIVE]


def test_a_running_controller_warms_an_inline_pool_only_on_the_node_using_it(
    sqlite_url: str, sqlite_store: Store
) -> None:
    """The finding above through a pass on a real store: n1's network declares its own
    range inline (the pool is stored by its first ADD); n2 and n3 are registered too and
    get no block of it, so n1 keeps the whole range."""
    inline = PoolSpec("pods-n1", [[{"subnet": "10.44.1.0/24"}]], source="cni-config")
    Ledger(sqlite_store, "n1").allocate([inline], Attachment("pods-n1", "c", "eth0"), PodInfo())
    for node in ("n1", "n2", "n3"):
        sqlite_store.txn([], [Put(keys.node_key(node), rec.encode({"node": node}))])
    with leading_controller(sqlite_url, sqlite_store) as controller:
        controller.run_pass()
    owners = {BlockRecord.decode(kv.value).node for kv in sqlite_store.range(keys.BLOCKS)[0]}
    assert owners == {"n1"}
