"""Blocks with node affinity and the hand-back handshake, step by step on a real store:
the ledger of two nodes, and the controller's and agent's steps from `ipward.ipam.blocks`."""

from __future__ import annotations

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.errors import PoolExhausted
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam import blocks
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from support import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def spec(**kw) -> PoolSpec:
    # /28 blocks (13..16 addresses) in a /26: four blocks in all.
    s = PoolSpec("p", [[{"subnet": "10.0.0.0/26"}]], block_prefix={4: 28}, cooldown=0, **kw)
    return s


def att(name: str) -> Attachment:
    return Attachment("net", name, "eth0")


def stored(store, pool: PoolSpec) -> PoolSpec:
    """Store the spec (as `ipward pool create` does) and read it back with its revision."""
    store.txn([], [rec_put(pool)])
    return Ledger(store, "reader").get_pool(pool.name)


def rec_put(pool: PoolSpec):
    from ipward.store.base import Put

    return Put(keys.pool_key(pool.name), rec.encode(pool.to_dict()))


def block_state(store, cidr: str) -> dict | None:
    kv = store.get(keys.block_key("p", cidr))
    return None if kv is None else rec.decode(kv.value)


def owned(store, node: str) -> list[str]:
    return [keys.cidr_of(kv.key) for kv in store.range(keys.affinity_prefix("p", node))[0]]


@pytest.fixture
def a(sqlite_store, clock) -> Ledger:
    return Ledger(sqlite_store, "node-a", clock=clock)


@pytest.fixture
def b(sqlite_store, clock) -> Ledger:
    return Ledger(sqlite_store, "node-b", clock=clock)


def test_nodes_allocate_only_from_their_own_blocks(sqlite_store, a, b):
    pool = spec()
    got_a = [a.allocate([pool], att(f"a{i}"), PodInfo())[0].ip for i in range(20)]
    got_b = [b.allocate([pool], att(f"b{i}"), PodInfo())[0].ip for i in range(5)]
    assert owned(sqlite_store, "node-a") == ["10.0.0.0/28", "10.0.0.16/28"]
    assert owned(sqlite_store, "node-b") == ["10.0.0.32/28"]
    assert all(ip.startswith("10.0.0.") and int(ip.rsplit(".")[-1]) < 32 for ip in got_a)
    assert all(32 <= int(ip.rsplit(".")[-1]) < 48 for ip in got_b)
    for kv in sqlite_store.range("ips/")[0]:
        record = rec.decode(kv.value)
        assert block_state(sqlite_store, record["block"])["node"] == record["node"]


def test_exhaustion_without_borrow_and_a_borrowed_address_with_it(sqlite_store, a, b):
    pool = spec(borrow=False)
    for i in range(3 * 16 - 1):  # three blocks for node a (the first lacks .0)
        a.allocate([pool], att(f"a{i}"), PodInfo())
    b.allocate([pool], att("b0"), PodInfo())  # the last block goes to b
    before = sqlite_store.range("")[0]
    with pytest.raises(PoolExhausted) as refused:
        a.allocate([pool], att("more"), PodInfo())
    # The error says where the free addresses are and what to change; nothing written.
    said = str(refused.value)
    assert "no IPv4 address for node node-a" in said, said
    assert "such as 10.0.0.49, in node-b's block 10.0.0.48/28" in said, said
    assert "spec.borrow: true" in said and "--block-v4" in said, said
    assert sqlite_store.range("")[0] == before
    lending = spec()  # the default borrows
    borrowed = a.allocate([lending], att("borrower"), PodInfo())[0].ip
    record = rec.decode(sqlite_store.get(keys.ip_key("p", borrowed)).value)
    assert record["node"] == "node-a"
    assert block_state(sqlite_store, record["block"])["node"] == "node-b"
    # released, it goes back to the owner's queue
    a.free(att("borrower"))
    assert sqlite_store.range("freeq/p/4/node-b/")[0]
    assert check(sqlite_store)[0] == []


def test_a_full_pool_that_does_not_borrow_says_only_that_it_is_full(sqlite_store, a, b):
    """Nowhere else to look: every address of every block held, on both nodes."""
    pool = spec(borrow=False)
    for i in range(3 * 16 - 1):
        a.allocate([pool], att(f"a{i}"), PodInfo())
    for i in range(16 - 1):  # the last block lacks the broadcast address
        b.allocate([pool], att(f"b{i}"), PodInfo())
    for ledger in (a, b):
        with pytest.raises(PoolExhausted, match=r"^pool p has no free IPv4 address \(62 in all\)$"):
            ledger.allocate([pool], att("more"), PodInfo())


def test_controller_assigned_block_is_filled_when_the_current_one_runs_out(sqlite_store, a, clock):
    pool = stored(sqlite_store, spec())
    first = a.allocate([pool], att("first"), PodInfo())[0].ip
    assigned = blocks.assign(sqlite_store, pool, 4, "node-a")
    assert assigned == "10.0.0.16/28"
    for i in range(14):  # the rest of the first block (.1-.15)
        a.allocate([pool], att(f"x{i}"), PodInfo())
    nxt = a.allocate([pool], att("next"), PodInfo())[0].ip
    assert first == "10.0.0.1" and nxt == "10.0.0.16"  # switched, not a new claim
    assert owned(sqlite_store, "node-a") == ["10.0.0.0/28", "10.0.0.16/28"]


def test_full_handshake_releases_an_empty_block(sqlite_store, a, clock):
    pool = stored(sqlite_store, spec())
    a.allocate([pool], att("x"), PodInfo())
    extra = blocks.assign(sqlite_store, pool, 4, "node-a")
    kv = sqlite_store.get(keys.block_key("p", extra))
    assert blocks.mark(sqlite_store, "p", kv, clock.now)
    kv = sqlite_store.get(kv.key)
    assert blocks.answer(sqlite_store, pool, kv, clock.now) == rec.READY
    kv = sqlite_store.get(kv.key)
    assert blocks.complete_hand_back(sqlite_store, pool, kv)
    assert block_state(sqlite_store, extra) is None
    assert owned(sqlite_store, "node-a") == ["10.0.0.0/28"]
    assert [keys.cidr_of(k.key) for k in sqlite_store.range("blockfree/p/4/")[0]] == [extra]
    # the released block is claimed again before any new one
    assert blocks.assign(sqlite_store, pool, 4, "node-b") == extra
    assert check(sqlite_store)[0] == []


def test_agent_refuses_a_block_holding_allocations(sqlite_store, a, clock):
    pool = stored(sqlite_store, spec())
    a.allocate([pool], att("x"), PodInfo())
    kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", kv, clock.now)
    kv = sqlite_store.get(kv.key)
    assert blocks.answer(sqlite_store, pool, kv, clock.now) == rec.REFUSED
    kv = sqlite_store.get(kv.key)
    assert not blocks.complete_hand_back(sqlite_store, pool, kv)  # never without `ready`
    assert blocks.resume(sqlite_store, "p", kv)
    assert block_state(sqlite_store, "10.0.0.0/28")["state"] == rec.ACTIVE


def test_mark_stops_allocation_in_the_block(sqlite_store, a, clock):
    """With room elsewhere, a node allocates nothing new in its marked block, and the
    block stays marked (no take-back is needed)."""
    pool = stored(sqlite_store, spec())
    a.allocate([pool], att("x"), PodInfo())  # fills 10.0.0.0/28
    assert blocks.assign(sqlite_store, pool, 4, "node-a") == "10.0.0.16/28"
    kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", kv, clock.now)
    got = [a.allocate([pool], att(f"y{i}"), PodInfo())[0].ip for i in range(5)]
    assert all(16 <= int(ip.rsplit(".")[-1]) < 32 for ip in got), got
    assert block_state(sqlite_store, "10.0.0.0/28")["state"] == rec.MARKED


def test_node_needing_space_takes_its_block_back(sqlite_store, a, clock):
    pool = stored(
        sqlite_store, PoolSpec("p", [[{"subnet": "10.0.0.0/28"}]], block_prefix={4: 28}, cooldown=0)
    )
    a.allocate([pool], att("x"), PodInfo())
    a.free(att("x"))
    kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    blocks.mark(sqlite_store, "p", kv, clock.now)
    kv = sqlite_store.get(kv.key)
    assert blocks.answer(sqlite_store, pool, kv, clock.now) == rec.READY
    ready_kv = sqlite_store.get(kv.key)
    # the only block of the pool: a new ADD aborts the handshake
    assert a.allocate([pool], att("y"), PodInfo())[0].ip
    state = block_state(sqlite_store, "10.0.0.0/28")
    assert state["state"] == rec.ACTIVE
    assert not blocks.complete_hand_back(sqlite_store, pool, ready_kv)  # the controller's CAS fails
    assert block_state(sqlite_store, "10.0.0.0/28") is not None
    assert check(sqlite_store)[0] == []


def test_take_back_after_partial_cleanup_loses_no_address(sqlite_store, a, clock):
    """The controller cleaned the free entries of a ready block, then lost the final
    CAS to the agent taking the block back: every address is still allocatable."""
    pool = stored(
        sqlite_store, PoolSpec("p", [[{"subnet": "10.0.0.0/28"}]], block_prefix={4: 28}, cooldown=0)
    )
    for i in range(14):  # the whole /28: .1-.14
        a.allocate([pool], att(f"x{i}"), PodInfo())
    for i in range(14):
        a.free(att(f"x{i}"))
    kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    blocks.mark(sqlite_store, "p", kv, clock.now)
    blocks.answer(sqlite_store, pool, sqlite_store.get(kv.key), clock.now)
    ready = sqlite_store.get(kv.key)
    from ipward.store.base import Delete

    for free in sqlite_store.range("free/p/")[0][:7]:  # half the cleanup, then stop
        sqlite_store.txn([], [Delete(free.key), Delete(rec.decode(free.value)["queue"])])
    got = {a.allocate([pool], att(f"y{i}"), PodInfo())[0].ip for i in range(14)}
    assert len(got) == 14
    assert not blocks.complete_hand_back(sqlite_store, pool, ready)
    assert check(sqlite_store)[0] == []


def test_borrowing_takes_another_nodes_freed_address(sqlite_store, a, b):
    """The pool's only block is b's and full; b frees one address; a borrows it from
    b's free queue (not a fresh one: there is none), and giving it back returns it to
    b's queue."""
    pool = PoolSpec(
        "p", [[{"subnet": "10.0.0.0/28"}]], block_prefix={4: 28}, cooldown=0, borrow=True
    )
    for i in range(14):
        b.allocate([pool], att(f"b{i}"), PodInfo())
    b.free(att("b3"))
    got = a.allocate([pool], att("borrower"), PodInfo())[0].ip
    assert got == "10.0.0.4"
    record = rec.decode(sqlite_store.get(keys.ip_key("p", got)).value)
    assert record["node"] == "node-a" and record["block"] == "10.0.0.0/28"
    a.free(att("borrower"))
    assert [kv.key.rsplit("/", 1)[-1] for kv in sqlite_store.range("freeq/p/4/node-b/")[0]] == [got]
    assert check(sqlite_store)[0] == []


def test_one_claim_walk_skips_blocks_without_an_address(sqlite_store, b):
    """The controller's assignment and the ledger's claim walk the same way (one
    function): blocks whose every address is excluded are never claimed."""
    pool = stored(
        sqlite_store,
        PoolSpec("p", [[{"subnet": "10.0.0.0/26"}]], exclude=["10.0.0.0/27"], block_prefix={4: 28}),
    )
    assert blocks.assign(sqlite_store, pool, 4, "node-a") == "10.0.0.32/28"
    assert b.allocate([pool], att("b0"), PodInfo())[0].ip == "10.0.0.48"
    assert blocks.assign(sqlite_store, pool, 4, "node-a") is None  # nothing left
    assert sorted(keys.cidr_of(kv.key) for kv in sqlite_store.range("blocks/")[0]) == [
        "10.0.0.32/28",
        "10.0.0.48/28",
    ]
    assert check(sqlite_store)[0] == []


def test_assign_compares_the_spec_it_read(sqlite_store):
    """A block is never assigned in a pool being deleted or whose ranges changed since
    the controller read it."""
    from ipward.store.base import Put

    pool = stored(sqlite_store, spec())
    kv = sqlite_store.get("pools/p")
    deleting = rec.encode({**rec.decode(kv.value), "state": "deleting"})
    sqlite_store.txn([], [Put("pools/p", deleting)])
    revision = sqlite_store.revision()
    assert blocks.assign(sqlite_store, pool, 4, "node-a") is None
    assert blocks.assign(sqlite_store, Ledger(sqlite_store, "x").get_pool("p"), 4, "n") is None
    assert sqlite_store.revision() == revision


@pytest.mark.parametrize("cooldown", [0, 300])
def test_a_block_whose_every_address_is_queued_is_taken_back(sqlite_store, a, clock, cooldown):
    """The node's only room is a block in the handshake whose every address is freed
    (queued, none fresh): the ADD takes the block back for its oldest freed address,
    still cooling if nothing else is left (docs/design.md invariant 9 allows it then)."""
    pool = stored(
        sqlite_store,
        PoolSpec("p", [[{"subnet": "10.0.0.0/28"}]], block_prefix={4: 28}, cooldown=cooldown),
    )
    for i in range(14):
        a.allocate([pool], att(f"x{i}"), PodInfo())
    order = []
    for i in (5, 2, 9, *range(14)):
        if f"x{i}" not in order:
            order.append(f"x{i}")
            a.free(att(f"x{i}"))
            clock.now += 1
    kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", kv, clock.now)
    assert blocks.answer(sqlite_store, pool, sqlite_store.get(kv.key), clock.now) == rec.READY
    got = a.allocate([pool], att("y"), PodInfo())[0].ip
    assert got == "10.0.0.6"  # x5's, freed first
    assert block_state(sqlite_store, "10.0.0.0/28")["state"] == rec.ACTIVE
    more = {a.allocate([pool], att(f"z{i}"), PodInfo())[0].ip for i in range(13)}
    assert len(more | {got}) == 14
    assert check(sqlite_store)[0] == []
