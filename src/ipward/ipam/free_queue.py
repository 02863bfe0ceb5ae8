"""The free queue (docs/design.md 3): freed addresses in their cooldown
(docs/design.md invariant 9), oldest freed first, per node. Everything done to it is
here.

Two keys per freed address (their format is `core/keys`'):

    free/<pool>/<ip>                          FreeRecord: when it was freed, and the
                                              key of its queue entry
    freeq/<pool>/<family>/<node>/<ms>/<ip>    empty: the same fact in time order, in the
                                              queue of the node owning the address's
                                              block (key order: the order of freeing)

`free/` answers "is this address cooling, since when" by address, `freeq/` "which is the
oldest freed" by a range read of one node's queue. They are written together when an
address is freed (`enqueue`), taken together when one is allocated (`take`; the pickers
`from_queue`, `queued`, `queued_in`, `from_other_queues`), a stale entry is removed in
the allocating transaction of another address (`Cleanup`), both are deleted when a
block is released (`clear`), and `ipward check` holds them against each other and the
records (`drift`). A long-lived ledger remembers its queues for QUEUE_MEMORY seconds
(`QueueMemory`), kept current by its own writes.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

import time

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.addr import parse_ip
from ipward.core.errors import IpwardError
from ipward.core.records import BlockRecord
from ipward.ipam.allocation import Pick, held, unheld
from ipward.store.base import Delete, KeyValue, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from ipward.core.addr import Block
    from ipward.core.pool import PoolSpec
    from ipward.core.records import AddressRecord
    from ipward.ipam.allocation import Taken
    from ipward.ipam.cache import StoreCache
    from ipward.store.base import Compare, Store

QUEUE_WINDOW = 64  # entries looked at past those of blocks being handed back
QUEUE_MEMORY = 1.0  # seconds a long-lived ledger trusts its view of its free queues
CLEANUP_CHUNK = 40  # a released block's addresses cleared per transaction (two keys each)


class FreeRecord:
    """`free/<pool>/<ip>`: a freed address in its cooldown: when it was freed, and the
    key of its entry in its node's free queue (`freeq/`, the same fact in time order)."""

    __slots__ = ("freed_at", "queue")

    def __init__(self, freed_at: float, queue: str) -> None:
        self.freed_at = freed_at
        self.queue = queue

    def encode(self) -> bytes:
        return rec.encode({"released_at": self.freed_at, "queue": self.queue})

    @classmethod
    def decode(cls, raw: bytes) -> FreeRecord:
        d = rec.decode(raw)
        return cls(float(d.get("released_at", 0)), str(d.get("queue", "")))


# -- a ledger's memory of its queues ------------------------------------------------------


class QueueView:
    """A free queue as last read, oldest first; `complete` if that was all of it."""

    __slots__ = ("complete", "entries", "read_at")

    def __init__(self, read_at: float, entries: list[KeyValue], complete: bool) -> None:
        self.read_at = read_at
        self.entries = entries
        self.complete = complete


class QueueMemory:
    """This node's free queues as last seen, by prefix. Safe: taking an entry compares
    it, and a failed compare forgets the queue (`StoreCache.txn` tells it both)."""

    def __init__(self) -> None:
        self.views: dict[str, QueueView] = {}

    def read(
        self,
        range_: Callable[[str, int], tuple[list[KeyValue], int]],
        prefix: str,
        limit: int,
        verify: bool,
    ) -> tuple[list[KeyValue], bool]:
        """The oldest `limit` entries of one of this node's free queues, and whether that
        is all of it. Remembered for QUEUE_MEMORY seconds, kept up to date with this
        ledger's own writes (its frees append, its allocations take); entries freed by
        others show up at the next read."""
        view = self.views.get(prefix)
        now = time.monotonic()
        if (
            verify
            or view is None
            or now - view.read_at > QUEUE_MEMORY
            or (not view.complete and len(view.entries) < limit)
        ):
            # The first read of a ledger takes what it needs (a plugin: one entry); a
            # ledger that comes back for more (an agent) reads a whole window.
            want = limit if view is None else max(limit, QUEUE_WINDOW)
            kvs, _ = range_(prefix, want)
            view = QueueView(now, kvs, len(kvs) < want)
            self.views[prefix] = view
        return view.entries[:limit], view.complete and len(view.entries) <= limit

    def noted(self, ops: Iterable[Put | Delete], revision: int) -> None:
        """A committed transaction's writes of queue entries, into the views."""
        for op in ops:
            if not keys.is_queue_key(op.key):
                continue
            view = self.views.get(keys.queue_prefix_of(op.key))
            if view is None:
                continue
            if isinstance(op, Delete):
                view.entries = [kv for kv in view.entries if kv.key != op.key]
            elif view.complete and (not view.entries or op.key > view.entries[-1].key):
                view.entries.append(KeyValue(op.key, op.value, revision, revision, 1))
            elif view.complete:
                self.views.pop(keys.queue_prefix_of(op.key), None)  # out of order: read again

    def forget(self, touched: Iterable[str]) -> None:
        """The queues of keys a failed (or unknown) transaction compared or touched."""
        for key in touched:
            if keys.is_queue_key(key):
                self.views.pop(keys.queue_prefix_of(key), None)


# -- freeing into it ----------------------------------------------------------------------


def enqueue(
    cache: StoreCache, pool_name: str, ip: str, record: AddressRecord, now: float
) -> tuple[list[Put | Delete], list[Compare]]:
    """Queue a freed address (its cooldown) on the node that owns its block, if its
    pool hands it out now: one of a retired layout, or of a deleted pool, is not
    queued, as this pool version never hands it out. Pinned by compares on the pool
    spec and the block. (ops, compares)"""
    pool_key = keys.pool_key(pool_name)
    spec_kv = cache.get(pool_key)
    compares = [at_revision(pool_key, spec_kv.mod_revision if spec_kv else 0)]
    if spec_kv is None:
        return [], compares
    family, value = parse_ip(ip)
    try:
        spec = cache.parsed(spec_kv)
    except (IpwardError, ValueError):
        spec = None  # unreadable ('ipward check' says so): a DEL must still work
    if spec is not None:
        index = spec.set_of(family)
        block = spec.range_sets[index].block_of(value) if index is not None else None
        if block is None:
            return [], compares
        cidr = block.cidr
    else:
        cidr = record.block
    owner = record.node or cache.node
    block_key = keys.block_key(pool_name, cidr)
    block_kv = cache.get(block_key)
    if block_kv is not None:
        owner = BlockRecord.decode(block_kv.value).node or owner
    queue = keys.queue_key(pool_name, family, owner, now, ip)
    ops: list[Put | Delete] = [
        Put(keys.free_key(pool_name, ip), FreeRecord(now, queue).encode()),
        Put(queue, b""),
    ]
    compares.append(at_revision(block_key, block_kv.mod_revision if block_kv else 0))
    return ops, compares


# -- taking from it -----------------------------------------------------------------------


def freed(cache: StoreCache, pool: str, ip: str, fresh: bool = False) -> KeyValue | None:
    """The address's free record: it is queued (cooling or cooled), or None."""
    return cache.get(keys.free_key(pool, ip), fresh)


def not_queued(pool: str, ip: str) -> Compare:
    """The compare that the address is not queued (a never-used one)."""
    return absent(keys.free_key(pool, ip))


def take(entry: KeyValue) -> tuple[list[Compare], list[Put | Delete]]:
    """Taking an address out of the queue by its free record as read (`freed`): both
    its keys go, pinned to the record's revision."""
    return [at_revision(entry.key, entry.mod_revision)], _both_keys(entry)


def _both_keys(entry: KeyValue) -> list[Put | Delete]:
    """The deletes of a free record and of its queue entry."""
    return [Delete(entry.key), Delete(FreeRecord.decode(entry.value).queue)]


def freed_at(entry: KeyValue) -> float:
    """When the address of a free record was freed."""
    return FreeRecord.decode(entry.value).freed_at


def cooled(cache: StoreCache, pool: PoolSpec, head: KeyValue) -> bool:
    """A queue entry's cooldown has passed."""
    return keys.queued_at(head.key) + pool.cooldown <= cache.clock()


class Cleanup:
    """The removal of stale entries (`deleted`), valid while `read` is as it was read."""

    __slots__ = ("compares", "ops")

    def __init__(self, read: list[KeyValue], deleted: list[str]) -> None:
        self.compares = [at_revision(kv.key, kv.mod_revision) for kv in read]
        self.ops: list[Put | Delete] = [Delete(key) for key in deleted]


def with_cleanups(pick: Pick, stale: list[Cleanup]) -> Pick:
    """The pick, with the removal of the stale entries passed over on the way to it:
    they ride in its transaction, so a failed ADD writes nothing."""
    for removal in stale:
        pick.compares += removal.compares
        pick.ops += removal.ops
    return pick


def from_queue(
    cache: StoreCache,
    pool: PoolSpec,
    index: int,
    taken: Taken | None,
    verify: bool,
    cooled_only: bool,
) -> Pick | None:
    """The oldest queued address of this node that is free to take: not taken by the
    batch already, in one of its active blocks (entries of a block being handed back are
    passed over, so a surplus block is not taken back while others have room), and,
    if `cooled_only`, past its cooldown. Reads the head first (the common case), and
    the oldest QUEUE_WINDOW entries only when the head cannot be used."""
    skip = taken.ips if taken is not None else ()
    prefix = keys.queue_prefix(pool.name, pool.range_sets[index].family, cache.node)
    first = taken.size if taken is not None else 1  # a batch reads its share at once
    stale: list[Cleanup] = []
    looked: set[str] = set()  # the window's read starts over at the head
    for limit in (first + len(skip), QUEUE_WINDOW + len(skip)):
        kvs, complete = cache.queues.read(cache.range, prefix, limit, verify)
        for kv in kvs:
            if keys.last(kv.key) in skip or kv.key in looked:
                continue
            looked.add(kv.key)
            if cooled_only and not cooled(cache, pool, kv):
                return None  # oldest freed first: the rest are cooling too
            pick = queued(cache, pool, index, kv, stale, verify=verify)
            if pick is not None:
                return with_cleanups(pick, stale)
        if complete:
            return None  # that was all of it
    return None


def queued(
    cache: StoreCache,
    pool: PoolSpec,
    index: int,
    head: KeyValue,
    stale: list[Cleanup],
    owner: str | None = None,
    verify: bool = True,
) -> Pick | None:
    """The queue entry's address, or None when its block is not `owner`'s (this
    node's, unless borrowing) active block (being handed back: the ledger looks
    elsewhere, and takes the block back only if it must). A first attempt leaves the
    address's absence to the transaction's compare; a verifying one reads it. A stale
    entry (its address allocated by request meanwhile, outside the pool since its
    ranges changed, or of a released block) is passed over and its removal added to
    `stale`: it rides in the transaction of the address picked instead, so a failed
    ADD writes nothing."""
    ip = keys.last(head.key)
    record = cache.get(keys.ip_key(pool.name, ip), fresh=True) if verify else None
    if record is not None:
        stale.append(Cleanup([head, record], [head.key]))
        return None
    block = pool.range_sets[index].block_of(parse_ip(ip)[1])
    if block is None:
        stale.append(Cleanup([head], [head.key, keys.free_key(pool.name, ip)]))
        return None
    block_key = keys.block_key(pool.name, block.cidr)
    block_kv = cache.get(block_key)
    if block_kv is None:
        # A released block's entries are deleted before it; one left over is stale.
        gone = Cleanup([head], [head.key, keys.free_key(pool.name, ip)])
        gone.compares.append(absent(block_key))
        stale.append(gone)
        return None
    state = BlockRecord.decode(block_kv.value)
    if not state.active or state.node != (owner or cache.node):
        return None
    if verify and held(cache, pool.name, ip, state.node):
        return None  # its record is unreadable (damage), not gone: passed over, kept
    pick = Pick.of(pool, ip, block.cidr)
    pick.compares += [
        at_revision(head.key, head.mod_revision),
        *unheld(cache, pool.name, ip, state.node),
        at_revision(block_kv.key, block_kv.mod_revision),
    ]
    pick.ops += [Delete(head.key), Delete(keys.free_key(pool.name, ip))]
    return pick


def queued_in(
    cache: StoreCache, pool: PoolSpec, index: int, block: Block, verify: bool
) -> Pick | None:
    """This node's oldest cooled queue entry inside `block`, a block it is about to
    claim: an address it was given by request before it held the block, and freed.
    The claim hands it out before any never-used one (oldest freed first)."""
    rs = pool.range_sets[index]
    prefix = keys.queue_prefix(pool.name, rs.family, cache.node)
    for kv in cache.queues.read(cache.range, prefix, QUEUE_WINDOW, verify)[0]:
        if not cooled(cache, pool, kv):
            return None  # oldest freed first: the rest are cooling too
        ip = keys.last(kv.key)
        inside = rs.block_of(parse_ip(ip)[1])
        if inside is None or inside.cidr != block.cidr:
            continue
        if verify and held(cache, pool.name, ip):
            continue  # allocated by request meanwhile: a stale entry, for a later pass
        pick = Pick.of(pool, ip, block.cidr)
        pick.compares += [at_revision(kv.key, kv.mod_revision), *unheld(cache, pool.name, ip)]
        pick.ops += [Delete(kv.key), Delete(keys.free_key(pool.name, ip))]
        return pick
    return None


def from_other_queues(cache: StoreCache, pool: PoolSpec, index: int) -> Pick | None:
    """Borrowing: the oldest cooled entry of the other nodes' queues (of the pool's
    first QUEUE_WINDOW entries of this family) in an active block of its node's.
    Freed, the address goes back to that node's queue."""
    family = pool.range_sets[index].family
    entries, _ = cache.range(keys.queues_prefix(pool.name, family), limit=QUEUE_WINDOW)
    stale: list[Cleanup] = []
    for kv in entries:
        owner = keys.queue_node(kv.key)
        if owner != cache.node and cooled(cache, pool, kv):
            pick = queued(cache, pool, index, kv, stale, owner=owner)
            if pick is not None:
                return with_cleanups(pick, stale)
    return None


# -- a released block's entries, and the check --------------------------------------------


def clear(store: Store, pool: str, ips: list[str], pinned: list[Compare]) -> bool:
    """Delete the free records and queue entries of `ips` (a released block's), in
    chunks, each transaction with the `pinned` compares. False as soon as one fails."""
    frees = [f for f in (store.get(keys.free_key(pool, ip)) for ip in ips) if f]
    for start in range(0, len(frees), CLEANUP_CHUNK):
        ops: list[Put | Delete] = []
        for free in frees[start : start + CLEANUP_CHUNK]:
            ops += _both_keys(free)
        if not store.txn(pinned, ops).succeeded:
            return False
    return True


def drift(
    frees: list[KeyValue], queue: list[KeyValue], allocated: dict[str, str]
) -> Iterator[tuple[str, str, str]]:
    """What `ipward check` reports of the queue, as (kind, key, detail): a free record
    of an allocated address (`free-and-allocated`), one without its queue entry, or an
    entry without its free record (`free-queue`)."""
    entries = {kv.key for kv in queue}
    referenced = set()
    for kv in frees:
        pool_name, ip = keys.ip_parts(kv.key)
        ref = rec.pool_ip(pool_name, ip)
        if ref in allocated:
            yield "free-and-allocated", kv.key, f"{ref} is also allocated"
        entry = FreeRecord.decode(kv.value).queue
        referenced.add(entry)
        if entry not in entries:
            yield "free-queue", kv.key, f"queue entry {entry} missing"
    for key in sorted(entries - referenced):
        yield "free-queue", key, "queue entry without a free record"
