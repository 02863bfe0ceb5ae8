"""Picking (`ipam/allocating.py`: the pick order, the requested and fresh addresses) and
the witnesses of a held address (`ipam/allocation.py`), on their own on a real SQLite
store: each pick committed by hand as the allocating transaction would."""

from __future__ import annotations

import pytest

from ipward.core import keys
from ipward.core.addr import parse_ip
from ipward.core.errors import (
    AddressOutsidePool,
    AddressTaken,
    InvalidConfig,
    PoolExhausted,
    TryAgainLater,
)
from ipward.core.records import AddressRecord, BlockRecord
from ipward.ipam import blocks
from ipward.ipam.allocating import NeedsBlock, pick, requested_by_pool
from ipward.ipam.allocation import Taken, held, unheld
from ipward.ipam.cache import StoreCache
from ipward.ipam.ledger import Ledger
from ipward.store.base import Delete
from ledger_parts import att, commit, node_cache, pod, pool
from support import ManualClock


@pytest.fixture
def cache(sqlite_store) -> StoreCache:
    return node_cache(sqlite_store)


def take(cache: StoreCache, spec, i, requested: str | None = None, verify: bool = False):
    """Pick the pool's address (the requested one) for attachment `i` and commit it."""
    wanted = parse_ip(requested)[1] if requested else None
    chosen = pick(cache, spec, 0, spec.range_sets[0], wanted, verify)
    assert commit(cache, spec, i, [chosen])
    return chosen


def test_fresh_addresses_come_in_order_and_move_the_blocks_cursor(cache, sqlite_store):
    spec = pool()
    first = take(cache, spec, 1)  # the first claims a block (`claims`), in the same txn
    assert (first.ip, first.block, first.moved) == (
        "10.0.0.1",
        "10.0.0.0/28",
        "claimed a new block",
    )
    second = pick(cache, spec, 0, spec.range_sets[0], None, verify=False)
    assert second.ip == "10.0.0.2" and not second.moved
    cursor = [op for op in second.ops if op.key == keys.block_key("p", "10.0.0.0/28")]
    assert BlockRecord.decode(cursor[0].value).next_for(spec.version) == 3  # past .2
    assert {c.key for c in unheld(cache, "p", "10.0.0.2")} <= {c.key for c in second.compares}
    assert keys.free_key("p", "10.0.0.2") in {c.key for c in second.compares}  # not queued


def test_a_first_attempt_trusts_compares_a_retry_skips_what_is_held(cache, sqlite_store):
    spec = pool()
    take(cache, spec, 1)  # .1, the block's cursor at .2
    take(cache, spec, 2, requested="10.0.0.2")  # ahead of the cursor
    optimistic = pick(cache, spec, 0, spec.range_sets[0], None, verify=False)
    assert optimistic.ip == "10.0.0.2"
    assert not commit(cache, spec, 3, [optimistic])  # its compare finds the record
    # .3's record lost to damage: its node index entry still says it is held.
    take(cache, spec, 3, requested="10.0.0.3")
    sqlite_store.txn([], [Delete(keys.ip_key("p", "10.0.0.3"))])
    assert held(cache, "p", "10.0.0.3") and not held(cache, "p", "10.0.0.4")
    verified = take(cache, spec, 4, verify=True)
    assert verified.ip == "10.0.0.4"


def test_a_requested_address_is_refused_when_held_and_taken_out_of_the_queue(sqlite_store):
    clock = ManualClock()
    spec = pool(cooldown=30)
    ledger = Ledger(sqlite_store, "n1", clock=clock)
    cache = ledger.cache
    ledger.allocate([spec], att(1), pod(1))
    with pytest.raises(AddressTaken):
        pick(cache, spec, 0, spec.range_sets[0], parse_ip("10.0.0.1")[1], verify=False)
    ledger.free(att(1))  # .1 cooling in the queue
    again = take(cache, spec, 2, requested="10.0.0.1")
    assert again.requested
    assert sqlite_store.range("free")[0] == []  # both of its queue keys went with it
    record = AddressRecord.decode(sqlite_store.get(keys.ip_key("p", "10.0.0.1")).value)
    assert record.requested
    # Its record damaged away, its node index entry left: a verifying attempt refuses it.
    sqlite_store.txn([], [Delete(keys.ip_key("p", "10.0.0.1"))])
    cache.known.clear()
    with pytest.raises(AddressTaken, match="node index entry"):
        pick(cache, spec, 0, spec.range_sets[0], parse_ip("10.0.0.1")[1], verify=True)


def test_a_requested_address_of_a_block_being_handed_back_is_11(cache, sqlite_store):
    clock = cache.clock
    spec = pool()
    take(cache, spec, 1)
    block = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", block, clock.now)
    cache.known.clear()
    with pytest.raises(TryAgainLater, match="being handed back"):
        pick(cache, spec, 0, spec.range_sets[0], parse_ip("10.0.0.5")[1], verify=False)


def test_requested_addresses_are_mapped_to_their_pools_family():
    v4 = pool()
    assert requested_by_pool([v4], ["10.0.0.9"]) == {("p", 0): parse_ip("10.0.0.9")[1]}
    with pytest.raises(InvalidConfig):
        requested_by_pool([v4], ["10.0.0.9", "10.0.0.10"])
    for outside in ("10.1.0.9", "10.0.0.0", "10.0.0.255"):  # network and broadcast too
        with pytest.raises(AddressOutsidePool):
            requested_by_pool([v4], [outside])


def test_the_pick_order_queue_cooled_then_fresh_then_cooling_then_exhausted(sqlite_store):
    clock = ManualClock()
    spec = pool("10.0.0.0/29", cooldown=30)  # one block of 6 addresses
    ledger = Ledger(sqlite_store, "n1", clock=clock)
    ips = [ledger.allocate([spec], att(i), pod(i))[0].ip for i in range(5)]
    ledger.free(att(0))
    cache = ledger.cache
    rs = spec.range_sets[0]
    assert pick(cache, spec, 0, rs, None, verify=True).ip == "10.0.0.6"  # cooling held back
    clock.now += 30
    assert pick(cache, spec, 0, rs, None, verify=True).ip == ips[0]  # cooled: oldest first
    clock.now -= 30
    take(cache, spec, 5)  # .6: the last fresh one
    assert pick(cache, spec, 0, rs, None, verify=True).ip == ips[0]  # cooling: the only one
    take(cache, spec, 6)
    with pytest.raises(PoolExhausted):
        pick(cache, spec, 0, rs, None, verify=True)


def test_a_batchs_picks_are_distinct_and_never_move_blocks(cache):
    spec = pool("10.0.0.0/28", cooldown=0)  # one block of 14
    take(cache, spec, 0)
    taken = Taken(14)
    got = [pick(cache, spec, 0, spec.range_sets[0], None, False, taken).ip for _ in range(13)]
    assert len(set(got)) == 13 and taken.ips == set(got)
    assert taken.next["10.0.0.0/28"] == 15  # past .14
    with pytest.raises(NeedsBlock):  # its block used up: a batch does not claim another
        pick(cache, spec, 0, spec.range_sets[0], None, False, taken)
