"""The writes of an allocation (`ipam/allocation.py:writes`, the one builder every path
that allocates uses) and the combining of concurrent ADDs into one transaction
(`ipam/combining.py`), on their own on a real SQLite store; and a short-lived ledger,
which allocates without combining."""

from __future__ import annotations

import pytest

from ipward.core import keys
from ipward.core.records import AddressRecord, AttachmentIndex, ReservationRecord, Sticky
from ipward.ipam.allocation import Pick, writes
from ipward.ipam.cache import StoreCache
from ipward.ipam.check import check
from ipward.ipam.combining import MAX_BATCH, Combiner, Request
from ipward.ipam.ledger import Ledger
from ipward.store.base import Delete, KeyValue, Put, absent
from ledger_parts import NOW, att, node_cache, pod, pool
from support import ManualClock


@pytest.fixture
def cache(sqlite_store) -> StoreCache:
    return node_cache(sqlite_store)


def requests(spec, names) -> list[Request]:
    return [Request([spec], att(name), pod(name)) for name in names]


def written(ops) -> dict[str, Put | Delete]:
    return {op.key: op for op in ops}


def test_writes_are_the_index_the_records_with_their_node_index_and_the_picks():
    chosen = Pick("p", 3, "10.0.0.7", "10.0.0.0/28")
    chosen.requested = True
    chosen.compares.append(absent("blocks/p/x"))
    chosen.ops.append(Put("blocks/p/x", b"{}"))
    compares, ops = writes("n1", att(1), pod(1), [chosen], NOW)
    assert [c.key for c in compares] == [att(1).key_on("n1"), "blocks/p/x"]
    out = written(ops)
    assert AttachmentIndex.decode(out[att(1).key_on("n1")].value).refs == ["p/10.0.0.7"]
    record = AddressRecord.decode(out[keys.ip_key("p", "10.0.0.7")].value)
    assert (record.node, record.layout, record.requested, record.created_at) == (
        "n1",
        3,
        True,
        NOW,
    )
    assert out[keys.node_ip_key("n1", "p", "10.0.0.7")].value == record.encode()
    assert "blocks/p/x" in out


def test_writes_make_a_reservation_or_take_one_over_moving_the_node_index():
    identity = Sticky("net", "db", "db-0")
    made = Pick("p", 0, "10.0.0.7", "10.0.0.0/28")
    compares, ops = writes("n1", att(1), pod(1), [made], NOW, identity)
    assert identity.key in {c.key for c in compares}
    reservation = ReservationRecord.decode(written(ops)[identity.key].value)
    assert reservation.ips == ["p/10.0.0.7"] and reservation.attachment == att(1).key_on("n1")
    # The take-over on n2 of what n1 held: the reservation as read, the entry moved.
    held = KeyValue(identity.key, reservation.encode(), 5, 9, 2)
    moved = Pick("p", 0, "10.0.0.7", "10.0.0.0/28")
    moved.holder = "n1"
    compares, ops = writes("n2", att(2), pod(2), [moved], NOW, identity, held)
    assert (identity.key, 9) in {(c.key, c.operand) for c in compares}
    out = written(ops)
    assert isinstance(out[keys.node_ip_key("n1", "p", "10.0.0.7")], Delete)
    assert keys.node_ip_key("n2", "p", "10.0.0.7") in out
    record = AddressRecord.decode(out[keys.ip_key("p", "10.0.0.7")].value)
    assert (record.sticky, record.node) == (identity.key, "n2")


def test_a_batch_commits_distinct_addresses_in_one_transaction(cache, sqlite_store):
    spec = pool(cooldown=0)
    combiner = Combiner(cache)
    combiner.allocate([spec], att("warm"), pod("warm"))  # the block claimed, alone
    before = sqlite_store.revision()
    count, results = combiner._allocate_group(requests(spec, range(5)))
    assert count == 5 and results is not None
    assert sqlite_store.revision() == before + 1  # one transaction
    ips = [given[0].ip for given in results]
    assert len(set(ips)) == 5 and "10.0.0.1" not in ips
    assert check(sqlite_store)[0] == []


def test_a_batch_holds_one_call_of_an_attachment(cache, sqlite_store):
    spec = pool(cooldown=0)
    combiner = Combiner(cache)
    combiner.allocate([spec], att("warm"), pod("warm"))
    count, results = combiner._allocate_group(requests(spec, ["a", "b", "a", "c"]))
    assert count == 2 and results is not None and len(results) == 2  # "a" again: next batch


def test_a_batch_takes_members_while_the_store_takes_its_transaction(cache, sqlite_store):
    spec = pool(cooldown=0)
    combiner = Combiner(cache)
    combiner.allocate([spec], att("warm"), pod("warm"))
    sqlite_store.max_txn_ops = 10  # a fresh member writes 4 (index, cursor, record, entry)
    count, results = combiner._allocate_group(requests(spec, range(MAX_BATCH)))
    assert results is not None and 2 <= count < MAX_BATCH
    assert check(sqlite_store)[0] == []


def test_a_batch_that_needs_another_block_is_served_one_by_one(cache, sqlite_store):
    spec = pool("10.0.0.0/27", cooldown=0)  # two /28 blocks
    combiner = Combiner(cache)
    combiner.allocate([spec], att("warm"), pod("warm"))
    batch = requests(spec, range(20))  # more than the first block holds
    assert combiner._serve(batch) == 20
    assert all(r.error is None and r.result is not None for r in batch)
    ips = {r.result[0].ip for r in batch if r.result}
    assert len(ips) == 20 and check(sqlite_store)[0] == []


def test_a_short_lived_ledger_allocates_without_combining(sqlite_store):
    clock = ManualClock()
    ledger = Ledger(sqlite_store, "n1", clock=clock, short_lived=True)
    assert ledger._combiner is None
    assert [a.ip for a in ledger.allocate([pool()], att(1), pod(1))] == ["10.0.0.1"]
    assert [a.ip for a in ledger.allocate([pool()], att(1), pod(1))] == ["10.0.0.1"]
    assert Ledger(sqlite_store, "n1", clock=clock)._combiner is not None
