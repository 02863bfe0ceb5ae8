"""Room elsewhere (`ipam/claims.py`) on its own, on a real SQLite store: the one claim
walk and its writes, another of the node's blocks, a take-back, the claim of blocks
full of requested addresses, borrowing."""

from __future__ import annotations

import pytest

from ipward.core import keys
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, BlockRecord, CursorRecord, FillRecord
from ipward.ipam import blocks, claims
from ipward.ipam.allocating import ClaimFirst
from ipward.ipam.ledger import Ledger
from ipward.store.base import Delete, Put
from ledger_parts import att, commit, pod, pool
from support import ManualClock


@pytest.fixture
def ledger(sqlite_store) -> Ledger:
    return Ledger(sqlite_store, "n1", clock=ManualClock())


def offered(spec: PoolSpec, store) -> list[str]:
    return [c.block.cidr for c in claims.claims(spec, spec.range_sets[0], store.get, store.range)]


def test_the_walk_offers_released_blocks_first_then_never_claimed_ones_with_room(
    sqlite_store,
):
    spec = pool("10.0.0.0/26", exclude=["10.0.0.16/28"])  # the second block: no address
    assert offered(spec, sqlite_store) == ["10.0.0.0/28", "10.0.0.32/28", "10.0.0.48/28"]
    released = keys.released_block_key("p", 4, "10.0.0.48/28")
    sqlite_store.txn([], [Put(released, b""), Put(keys.block_key("p", "10.0.0.0/28"), b"{}")])
    assert offered(spec, sqlite_store)[:2] == ["10.0.0.48/28", "10.0.0.32/28"]


def test_claim_writes_pin_what_the_walk_read(sqlite_store):
    spec = pool("10.0.0.0/26")
    released = keys.released_block_key("p", 4, "10.0.0.16/28")
    sqlite_store.txn([], [Put(released, b"")])
    walk = claims.claims(spec, spec.range_sets[0], sqlite_store.get, sqlite_store.range)
    first, second = next(walk), next(walk)  # the released one, then block 0 (cursor)
    compares, ops = claims.claim_writes(spec, 4, "n1", [(first, 0), (second, 5)])
    entry = sqlite_store.get(released)
    assert {(c.key, c.operand) for c in compares} >= {
        (entry.key, entry.mod_revision),
        (keys.block_cursor_key("p", 4), 0),
    }
    written = {op.key: op for op in ops}
    assert isinstance(written[released], Delete)
    assert BlockRecord.decode(written[keys.block_key("p", "10.0.0.0/28")].value).next_for(0) == 5
    assert keys.affinity_key("p", "n1", "10.0.0.16/28") in written
    cursor = CursorRecord.decode(written[keys.block_cursor_key("p", 4)].value)
    assert cursor.next_for(spec.version) == 1  # past block 0, the furthest taken


def test_room_in_another_of_its_blocks_comes_before_a_claim(ledger, sqlite_store):
    spec = pool("10.0.0.0/26", cooldown=0)
    for i in range(15):  # the first /28 used up
        ledger.allocate([spec], att(i), pod(i))
    assigned = blocks.assign(sqlite_store, ledger.get_pool("p"), 4, "n1")  # the warm target's
    cache = ledger.cache
    room = claims.new_room(cache, spec, 0, spec.range_sets[0], verify=True)
    assert room is not None and room.block == assigned
    assert room.moved == "fills another of its blocks"
    fill = [op for op in room.ops if op.key == keys.fill_key("p", 4, "n1")]
    assert FillRecord.decode(fill[0].value).block == assigned


def test_a_take_back_gives_the_oldest_cooled_address_and_reactivates_the_block(
    ledger, sqlite_store
):
    clock = ledger.clock
    spec = pool("10.0.0.0/28", cooldown=30)
    for i in range(3):
        ledger.allocate([spec], att(i), pod(i))
    ledger.free(att(1))  # .2, cooling
    block = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", block, clock.now)
    cache = ledger.cache
    cache.known.clear()
    rs = spec.range_sets[0]
    assert claims.take_back(cache, spec, rs, verify=True, cooled_only=True).ip == "10.0.0.4"
    clock.now += 30
    back = claims.take_back(cache, spec, rs, verify=True, cooled_only=True)
    assert back is not None and back.ip == "10.0.0.2"
    assert back.moved.startswith("needs the space again")
    assert commit(cache, spec, 9, [back])
    state = BlockRecord.decode(sqlite_store.get(block.key).value)
    assert state.active and state.next_for(spec.version) == 0  # found again as fresh
    assert sqlite_store.range("free")[0] == []


def test_blocks_full_of_requested_addresses_are_claimed_on_their_own_past_the_limit(
    ledger, sqlite_store, monkeypatch
):
    spec = pool("10.0.0.0/26", cooldown=0)
    for i, last in enumerate(range(1, 32)):  # the first two /28s, by request
        ledger.allocate([spec], att(i), pod(i), requested=[f"10.0.0.{last}"])
    monkeypatch.setattr(claims, "MAX_FULL_CLAIMS", 2)
    cache = ledger.cache
    with pytest.raises(ClaimFirst) as full:
        claims.new_room(cache, spec, 0, spec.range_sets[0], verify=True)
    claimed = {op.key for op in full.value.ops if op.key.startswith(keys.BLOCKS)}
    assert claimed == {keys.block_key("p", "10.0.0.0/28"), keys.block_key("p", "10.0.0.16/28")}
    assert ledger.allocate([spec], att("next"), pod("next"))[0].ip == "10.0.0.32"


def test_a_borrower_takes_a_fresh_address_of_another_nodes_block(sqlite_store):
    clock = ManualClock()
    spec = pool("10.0.0.0/28", cooldown=0, borrow=True)
    n1, n2 = Ledger(sqlite_store, "n1", clock=clock), Ledger(sqlite_store, "n2", clock=clock)
    n1.allocate([spec], att(1), pod(1))
    borrowed = claims.borrow(n2.cache, spec, 0, spec.range_sets[0], verify=True)
    assert borrowed is not None and borrowed.ip == "10.0.0.2"
    assert commit(n2.cache, spec, 2, [borrowed])
    record = AddressRecord.decode(sqlite_store.get(keys.ip_key("p", "10.0.0.2")).value)
    owner = BlockRecord.decode(sqlite_store.get(keys.block_key("p", "10.0.0.0/28")).value)
    assert (record.node, owner.node) == ("n2", "n1")
