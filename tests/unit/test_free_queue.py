"""The free queue (`ipam/free_queue.py`) on its own, on a real SQLite store: what freeing
writes into it, the order it gives addresses back in, what it passes over and cleans,
its memory in a long-lived ledger, its cleanup and what `ipward check` reports of it."""

from __future__ import annotations

import pytest

from ipward.core import keys
from ipward.core.records import AddressRecord
from ipward.ipam import blocks, free_queue
from ipward.ipam.free_queue import FreeRecord, QueueMemory
from ipward.ipam.ledger import Ledger
from ipward.store.base import Delete, KeyValue, Put, at_revision
from ledger_parts import att, commit, pod, pool
from support import ManualClock


@pytest.fixture
def ledger(sqlite_store) -> Ledger:
    return Ledger(sqlite_store, "n1", clock=ManualClock())


def add(ledger: Ledger, spec, i) -> str:
    return ledger.allocate([spec], att(i), pod(i))[0].ip


def queue(store, node: str = "n1") -> list[str]:
    """The addresses of a node's queue, oldest freed first."""
    return [keys.last(kv.key) for kv in store.range(keys.queue_prefix("p", 4, node))[0]]


def test_enqueue_writes_both_keys_on_the_block_owners_queue(ledger, sqlite_store):
    clock = ledger.clock
    spec = pool()
    ip = add(ledger, spec, 1)
    record = AddressRecord.new(att(1), pod(1), "n2", "10.0.0.0/28", clock.now, spec.version)
    ops, compares = free_queue.enqueue(ledger.cache, "p", ip, record, clock.now)
    entry = keys.queue_key("p", 4, "n1", clock.now, ip)  # n1 owns the block, not n2
    assert [(type(op), op.key) for op in ops] == [(Put, keys.free_key("p", ip)), (Put, entry)]
    freed = FreeRecord.decode(ops[0].value)
    assert (freed.freed_at, freed.queue) == (clock.now, entry)
    spec_kv = sqlite_store.get(keys.pool_key("p"))
    block_kv = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert {(c.key, c.operand) for c in compares} == {
        (spec_kv.key, spec_kv.mod_revision),
        (block_kv.key, block_kv.mod_revision),
    }


def test_an_address_its_pool_does_not_hand_out_now_is_not_queued(ledger, sqlite_store):
    clock = ledger.clock
    add(ledger, pool(), 1)
    record = AddressRecord.new(att(1), pod(1), "n1", "10.9.0.0/28", clock.now, 0)
    ops, compares = free_queue.enqueue(ledger.cache, "p", "10.9.0.5", record, clock.now)
    spec_kv = sqlite_store.get(keys.pool_key("p"))
    assert ops == [] and [(c.key, c.operand) for c in compares] == [
        (spec_kv.key, spec_kv.mod_revision)
    ]
    ops, compares = free_queue.enqueue(ledger.cache, "gone", "10.9.0.5", record, clock.now)
    assert ops == [] and [(c.key, c.operand) for c in compares] == [(keys.pool_key("gone"), 0)]


def test_the_oldest_freed_comes_first_once_cooled(ledger, sqlite_store):
    clock = ledger.clock
    spec = pool(cooldown=30)
    a, b, _ = (add(ledger, spec, i) for i in range(3))
    ledger.free(att(1))  # b first
    clock.now += 1
    ledger.free(att(0))
    assert queue(sqlite_store) == [b, a]
    cache = ledger.cache
    clock.now += 29.5  # b cooled, a not
    cooled = free_queue.from_queue(cache, spec, 0, None, verify=True, cooled_only=True)
    assert cooled is not None and cooled.ip == b
    clock.now -= 1  # neither cooled
    assert free_queue.from_queue(cache, spec, 0, None, verify=True, cooled_only=True) is None
    cooling = free_queue.from_queue(cache, spec, 0, None, verify=True, cooled_only=False)
    assert cooling is not None and cooling.ip == b  # still oldest first
    entry = sqlite_store.get(keys.queue_key("p", 4, "n1", clock.now - 29.5, b))
    assert [(type(op), op.key) for op in cooling.ops] == [
        (Delete, entry.key),
        (Delete, keys.free_key("p", b)),
    ]
    assert (entry.key, entry.mod_revision) in {(c.key, c.operand) for c in cooling.compares}


def test_an_entry_of_a_block_being_handed_back_is_passed_over(ledger, sqlite_store):
    clock = ledger.clock
    spec = pool(cooldown=0)
    ips = [add(ledger, spec, i) for i in range(16)]  # 15 fill the first /28, one the next
    ledger.free(att(0))  # in the first block, oldest
    clock.now += 1
    ledger.free(att(15))  # in the second
    first = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert blocks.mark(sqlite_store, "p", first, clock.now)
    cache = ledger.cache
    cache.known.clear()
    picked = free_queue.from_queue(cache, spec, 0, None, verify=True, cooled_only=True)
    assert picked is not None and picked.ip == ips[15]
    assert queue(sqlite_store) == [ips[0], ips[15]]  # passed over, kept


def test_a_stale_entry_is_removed_by_the_transaction_of_the_address_picked(ledger, sqlite_store):
    clock = ledger.clock
    spec = pool(cooldown=0)
    a = add(ledger, spec, 1)
    ledger.free(att(1))
    # A leftover of a released block (its entries go before it): the block is not there.
    gone = "10.0.0.200"
    leftover = keys.queue_key("p", 4, "n1", clock.now - 5, gone)
    sqlite_store.txn(
        [],
        [Put(leftover, b""), Put(keys.free_key("p", gone), FreeRecord(0, leftover).encode())],
    )
    cache = ledger.cache
    picked = free_queue.from_queue(cache, spec, 0, None, verify=True, cooled_only=True)
    assert picked is not None and picked.ip == a
    assert keys.block_key("p", "10.0.0.192/28") in {c.key for c in picked.compares}
    assert commit(cache, spec, 2, [picked])
    assert queue(sqlite_store) == []
    assert sqlite_store.get(keys.free_key("p", gone)) is None


def test_take_pins_the_free_record_and_deletes_both_keys(ledger, sqlite_store):
    spec = pool()
    a = add(ledger, spec, 1)
    ledger.free(att(1))
    entry = free_queue.freed(ledger.cache, "p", a, fresh=True)
    assert entry is not None
    compares, ops = free_queue.take(entry)
    assert [(c.key, c.operand) for c in compares] == [(entry.key, entry.mod_revision)]
    assert [op.key for op in ops] == [entry.key, FreeRecord.decode(entry.value).queue]
    assert free_queue.not_queued("p", a).key == keys.free_key("p", a)


def test_a_long_lived_ledger_remembers_its_queue_kept_by_its_own_writes(monkeypatch):
    moments = iter([0.0, 0.5, 0.6, 0.7, 0.8, 1.0, 2.0, 2.1])
    monkeypatch.setattr(free_queue, "time", type("T", (), {"monotonic": lambda: next(moments)}))
    prefix = keys.queue_prefix("p", 4, "n1")
    stored = [KeyValue(f"{prefix}{n:015d}/10.0.0.{n}", b"", 1, 1, 1) for n in (1, 2)]
    reads = []

    def range_(p: str, limit: int) -> tuple[list[KeyValue], int]:
        reads.append(limit)
        return stored[:limit], 1

    memory = QueueMemory()
    assert memory.read(range_, prefix, 1, verify=False) == (stored[:1], False)
    assert memory.read(range_, prefix, 2, verify=False) == (stored, True)  # came for more
    assert reads == [1, free_queue.QUEUE_WINDOW]  # a whole window, once it came back
    memory.noted([Delete(stored[0].key), Put(f"{prefix}{3:015d}/10.0.0.3", b"")], 7)
    entries, complete = memory.read(range_, prefix, 5, verify=False)
    assert [keys.last(kv.key) for kv in entries] == ["10.0.0.2", "10.0.0.3"] and complete
    memory.noted([Put(f"{prefix}{0:015d}/10.0.0.9", b"")], 8)  # out of order: read again
    assert prefix not in memory.views
    memory.read(range_, prefix, 1, verify=False)
    memory.forget([stored[1].key])  # a failed compare on one of its entries
    assert prefix not in memory.views
    memory.read(range_, prefix, 1, verify=False)
    assert len(reads) == 4
    memory.read(range_, prefix, 1, verify=False)  # trusted: 0.2 s after its read
    assert len(reads) == 4
    memory.read(range_, prefix, 1, verify=False)  # past QUEUE_MEMORY: read again
    assert len(reads) == 5
    memory.read(range_, prefix, 1, verify=True)  # a verifying attempt always reads
    assert len(reads) == 6


def test_clear_deletes_a_released_blocks_entries_in_pinned_chunks(
    ledger, sqlite_store, monkeypatch
):
    spec = pool()
    ips = [add(ledger, spec, i) for i in range(5)]
    for i in range(5):
        ledger.free(att(i))
    monkeypatch.setattr(free_queue, "CLEANUP_CHUNK", 2)
    block = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert not free_queue.clear(sqlite_store, "p", ips, [at_revision(block.key, 1)])
    assert len(queue(sqlite_store)) == 5  # a lost pin: nothing cleared
    before = sqlite_store.revision()
    assert free_queue.clear(sqlite_store, "p", ips, [at_revision(block.key, block.mod_revision)])
    assert sqlite_store.revision() - before == 3  # 2 + 2 + 1
    assert queue(sqlite_store) == [] and sqlite_store.range("free/")[0] == []


def test_drift_names_what_check_reports_of_the_queue():
    entry = keys.queue_key("p", 4, "n1", 1.0, "10.0.0.2")
    orphan = keys.queue_key("p", 4, "n1", 2.0, "10.0.0.3")
    frees = [
        KeyValue(keys.free_key("p", "10.0.0.2"), FreeRecord(1.0, entry).encode(), 1, 1, 1),
        KeyValue(keys.free_key("p", "10.0.0.4"), FreeRecord(1.0, "freeq/x").encode(), 1, 1, 1),
    ]
    queue_kvs = [KeyValue(k, b"", 1, 1, 1) for k in (entry, orphan)]
    found = list(free_queue.drift(frees, queue_kvs, {"p/10.0.0.2": "attach/net/c1/eth0"}))
    assert [(kind, key) for kind, key, _ in found] == [
        ("free-and-allocated", keys.free_key("p", "10.0.0.2")),
        ("free-queue", keys.free_key("p", "10.0.0.4")),
        ("free-queue", orphan),
    ]


def test_a_borrower_takes_another_nodes_cooled_entry(sqlite_store):
    clock = ManualClock()
    spec = pool(cooldown=0, borrow=True)
    n1, n2 = Ledger(sqlite_store, "n1", clock=clock), Ledger(sqlite_store, "n2", clock=clock)
    a = add(n1, spec, 1)
    n1.free(att(1))
    assert free_queue.from_queue(n2.cache, spec, 0, None, True, cooled_only=False) is None
    borrowed = free_queue.from_other_queues(n2.cache, spec, 0)
    assert borrowed is not None and borrowed.ip == a
    block = sqlite_store.get(keys.block_key("p", "10.0.0.0/28"))
    assert (block.key, block.mod_revision) in {(c.key, c.operand) for c in borrowed.compares}
    assert commit(n2.cache, spec, 2, [borrowed])
    assert queue(sqlite_store) == []
    record = AddressRecord.decode(sqlite_store.get(keys.ip_key("p", a)).value)
    assert record.node == "n2"
