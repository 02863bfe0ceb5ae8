"""What a ledger reads and remembers, and the one way its parts write: the remembered-key
cache, the free-queue views, the parsed pool specs, and the pinned transaction that
keeps them true (docs/design.md 5.1). Every other part of the ledger holds one `Reads`.

A ledger remembers the keys it last read or wrote present (pool specs, its blocks, its
fill records, its own allocations), so a long-lived ledger (agent, benchmark) mostly
reads nothing but the free-queue head before it writes. That is safe because every
decision made on a remembered key is pinned by a compare in the same transaction: a
stale key fails the transaction, which forgets the compared keys and reads again.
Absence is never remembered, and a refusal (exhausted, taken, block being handed back)
is only given after reading everything again.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

import time

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.addr import format_ip, parse_ip
from ipward.core.errors import AddressOutsidePool, InputTooLarge, UnknownPool
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, AttachmentIndex
from ipward.store.base import Delete, KeyValue, Put, StoreUnreachable, TxnTooLarge

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ipward.store.base import Compare, Store

MAX_ATTEMPTS = 100
QUEUE_WINDOW = 64  # free-queue entries looked at past those of blocks being handed back
QUEUE_MEMORY = 1.0  # seconds a long-lived ledger trusts its view of its free queues
KNOWN_LIMIT = 100_000  # remembered keys; past it the memory starts over


class Allocation:
    """One address of an attachment, with what a CNI result needs."""

    __slots__ = ("family", "gateway", "ip", "pool", "prefix")

    def __init__(self, pool: str, ip: str, family: int, prefix: int, gateway: str | None):
        self.pool = pool
        self.ip = ip
        self.family = family
        self.prefix = prefix
        self.gateway = gateway

    def __repr__(self) -> str:
        return f"{self.pool}/{self.ip}"


class QueueView:
    """A free queue as last read, oldest first; `complete` if that was all of it."""

    __slots__ = ("complete", "entries", "read_at")

    def __init__(self, read_at: float, entries: list[KeyValue], complete: bool) -> None:
        self.read_at = read_at
        self.entries = entries
        self.complete = complete


def unique_compares(compares: list[Compare]) -> list[Compare]:
    seen = set()
    out = []
    for c in compares:
        mark = (c.key, c.target, c.op, c.operand)
        if mark not in seen:
            seen.add(mark)
            out.append(c)
    return out


def last_write_per_key(ops: list[Put | Delete]) -> list[Put | Delete]:
    """A batch writes a block's cursor once per pick: keep the last (furthest) write."""
    last = {op.key: op for op in ops}
    return list(last.values())


def record_writes(
    pool: str, ip: str, record: AddressRecord, moved_from: str = ""
) -> list[Put | Delete]:
    """Store an allocation record with its node's index entry (`nodeips/`, holding a copy
    of the record: an agent's reconciliation reads its node's records in one range),
    dropping the entry of the node it moved from: every write of a record goes with
    these in one transaction (the delete side: `freeing.free_ops`)."""
    value = record.encode()
    ops: list[Put | Delete] = [Put(keys.ip_key(pool, ip), value)]
    if moved_from and moved_from != record.node:
        ops.append(Delete(keys.node_ip_key(moved_from, pool, ip)))
    if record.node:
        ops.append(Put(keys.node_ip_key(record.node, pool, ip), value))
    return ops


def backoff(attempt: int) -> None:
    if attempt:
        import random  # only on conflicts: ~1 ms of import on every plugin exec otherwise

        time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))


class Reads:
    """A ledger's reads, what it remembers of them, and its transactions."""

    def __init__(self, store: Store, node: str, clock: Callable[[], float]) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.known: dict[str, KeyValue] = {}  # keys as last read or written, present
        self.queues: dict[str, QueueView] = {}  # this node's free queues, as last seen
        self.specs: dict[str, PoolSpec] = {}  # pools as last parsed, with their revision

    def get(self, key: str, fresh: bool = False) -> KeyValue | None:
        """The key as last read or written here, or as the store has it now when it is
        not remembered (or `fresh`)."""
        if not fresh:
            known = self.known.get(key)
            if known is not None:
                return known
        kv = self.store.get(key)
        if kv is None:
            self.known.pop(key, None)
        else:
            self.remember(kv)
        return kv

    def remember(self, kv: KeyValue) -> None:
        if len(self.known) >= KNOWN_LIMIT:
            self.known.clear()
        self.known[kv.key] = kv

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        return self.store.range(prefix, limit)

    def txn(self, compares: list[Compare], ops: list[Put | Delete]) -> bool:
        problem = self.store.txn_problem(compares, ops)
        if problem is not None:
            raise InputTooLarge(f"one transaction would need {problem}; nothing was done")
        try:
            result = self.store.txn(compares, ops)
        except TxnTooLarge as e:  # limits set lower than the store's defaults
            raise InputTooLarge(f"the store refused a transaction as too large: {e}") from e
        except StoreUnreachable:
            # Applied or not, nobody can tell: forget all it touched.
            touched = {c.key for c in compares} | {op.key for op in ops}
            for key in touched:
                self.known.pop(key, None)
            self._forget_queues(touched)
            raise
        if not result.succeeded:
            for c in compares:
                self.known.pop(c.key, None)
            self._forget_queues([c.key for c in compares])
            return False
        self._note_queue_writes(ops, result.revision)
        for op in ops:
            if isinstance(op, Put):
                self.remember(KeyValue(op.key, op.value, 0, result.revision, 0, op.lease))
            else:
                self.known.pop(op.key, None)
        return True

    # -- free queues ------------------------------------------------------------------

    def queue_read(self, prefix: str, limit: int, verify: bool) -> tuple[list[KeyValue], bool]:
        """The oldest `limit` entries of one of this node's free queues, and whether that
        is all of it. A long-lived ledger remembers the queue for QUEUE_MEMORY seconds,
        kept up to date with its own writes (its frees append, its allocations take);
        entries freed by others show up at the next read. Safe: taking an entry compares
        it, and a failed compare forgets the queue."""
        view = self.queues.get(prefix)
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
            kvs, _ = self.range(prefix, limit=want)
            view = QueueView(now, kvs, len(kvs) < want)
            self.queues[prefix] = view
        return view.entries[:limit], view.complete and len(view.entries) <= limit

    def _note_queue_writes(self, ops: list[Put | Delete], revision: int) -> None:
        for op in ops:
            if not keys.is_queue_key(op.key):
                continue
            view = self.queues.get(keys.queue_prefix_of(op.key))
            if view is None:
                continue
            if isinstance(op, Delete):
                view.entries = [kv for kv in view.entries if kv.key != op.key]
            elif view.complete and (not view.entries or op.key > view.entries[-1].key):
                view.entries.append(KeyValue(op.key, op.value, revision, revision, 1))
            elif view.complete:
                self.queues.pop(keys.queue_prefix_of(op.key), None)  # out of order: read again

    def _forget_queues(self, touched: object) -> None:
        for key in touched:  # type: ignore[attr-defined]
            if keys.is_queue_key(key):
                self.queues.pop(keys.queue_prefix_of(key), None)

    # -- pools ------------------------------------------------------------------------

    def get_pool(self, name: str, fresh: bool = False) -> PoolSpec:
        kv = self.get(keys.pool_key(name), fresh)
        if kv is None:
            raise UnknownPool(f"pool {name!r} does not exist (create it with 'ipward pool create')")
        return self.parsed(kv)

    def stored_pools(self) -> list[PoolSpec]:
        """Every pool as the store has it now (one range read, never from memory)."""
        return [self.parsed(kv) for kv in self.range(keys.POOLS)[0]]

    def parsed(self, kv: KeyValue) -> PoolSpec:
        """The stored spec, parsed once per revision (not on every ADD of an agent)."""
        name = keys.pool_name(kv.key)
        parsed = self.specs.get(name)
        if parsed is not None and parsed.revision == kv.mod_revision:
            return parsed
        spec = PoolSpec.decode(kv.value)
        spec.revision = kv.mod_revision
        self.specs[name] = spec
        return spec

    # -- answers ----------------------------------------------------------------------

    def allocations(
        self,
        refs: list[str],
        known: Sequence[PoolSpec] = (),
        layouts: Mapping[str, int | None] | None = None,
    ) -> list[Allocation]:
        """Each address with the prefix and gateway of the layout it was given under:
        `layouts` names that version per ref (its record's); without one, the first
        layout (current, then retired) in which the address is usable."""
        out = []
        specs = {spec.name: spec for spec in known}
        for ref in refs:
            pool_name, ip = rec.split_pool_ip(ref)
            spec = specs.get(pool_name) or specs.setdefault(pool_name, self.get_pool(pool_name))
            family, value = parse_ip(ip)
            version = (layouts or {}).get(ref)
            given = [lay for lay in spec.layouts() if lay.version == version] + [
                lay for lay in spec.layouts() if lay.usable(family, value)
            ]
            ranges = (rs.range_of(value) for lay in given if (rs := lay.set_of(family)))
            r = next((r for r in ranges if r is not None), None)
            if r is None:
                raise AddressOutsidePool(f"{ref} is no longer inside pool {pool_name}")
            gateway = None
            if r.gateway is not None:
                gateway = format_ip(family, r.gateway)
            out.append(Allocation(pool_name, ip, family, r.prefix, gateway))
        return out

    def held_allocations(self, index: KeyValue, known: Sequence[PoolSpec] = ()) -> list[Allocation]:
        """An attachment's allocations, from its index, as its records say they were
        given (a repeated ADD, a lookup): each record names its layout version."""
        refs = AttachmentIndex.decode(index.value).refs
        layouts: dict[str, int | None] = {}
        for ref in refs:
            kv = self.get(keys.ip_key(*rec.split_pool_ip(ref)), fresh=True)
            layouts[ref] = AddressRecord.decode(kv.value).layout if kv is not None else None
        return self.allocations(refs, known, layouts)
