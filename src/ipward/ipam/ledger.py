"""The ledger: allocate and free addresses for attachments (DESIGN.md 5.1, 5.2).

Over 600 lines, for now: one class holds seven concepts that share its remembered-key
cache and its pinned transactions (reads, request combining, pickers, block claims,
take-back, sticky reservations, freeing with the CNI GC verb's side). Their split into
`ipam` modules behind this class as the facade is the layout's next step.

Every change is one store transaction whose compares pin what was read: the attachment
index absent, the address record absent, the block still active at the revision read,
the free-queue entry still there. A conflict means someone else moved first: read again
and retry, a bounded number of times.

Where an address comes from, in order:
  1. the address the runtime asked for (same transaction, same checks);
  2. the oldest freed address of this node whose cooldown has passed;
  3. a never-used address of the block this node is filling (the block's `next` cursor),
     claiming the next unclaimed block of the pool when that one is used up;
  4. the oldest freed address still cooling down, when nothing else is free.
None of these reads grows with the size of the pool or the number of allocations.

A ledger remembers the keys it last read or wrote present (pool specs, its blocks, its
fill records, its own allocations), so a long-lived ledger (agent, benchmark) mostly
reads nothing but the free-queue head before it writes. That is safe because every
decision made on a remembered key is pinned by a compare in the same transaction: a
stale key fails the transaction, which forgets the compared keys and reads again.
Absence is never remembered, and a refusal (exhausted, taken, block being released)
is only given after reading everything again.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

import _thread
import time

from ipward.core import keys, log, testpoints
from ipward.core import records as rec
from ipward.core.addr import family_of, format_ip, parse_ip
from ipward.core.errors import (
    AddressOutsidePool,
    AddressTaken,
    InputTooLarge,
    InvalidConfig,
    IpwardError,
    OwnerChanged,
    PoolExhausted,
    StoreUnreachable,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.policy import ADD_GRACE
from ipward.core.pool import PoolSpec
from ipward.core.records import (
    AddressRecord,
    AttachmentIndex,
    BlockRecord,
    FillRecord,
    FreeRecord,
    ReservationRecord,
)
from ipward.ipam import blocks
from ipward.store.base import (
    Delete,
    KeyValue,
    Put,
    StoreUnavailable,
    TxnTooLarge,
    absent,
    at_revision,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ipward.core.addr import Block, RangeSet
    from ipward.core.records import Attachment, PodInfo, Sticky
    from ipward.store.base import Compare, Store

MAX_ATTEMPTS = 100
MAX_BATCH = 24  # allocations per combined transaction at most (fewer: the store's limits)
# Never-claimed blocks whose every usable address is already taken (by requested
# addresses) that one allocation claims on its way to a block with room.
MAX_FULL_CLAIMS = 16
QUEUE_WINDOW = 64  # free-queue entries looked at past those of blocks being released
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


class _Pick:
    """A chosen address and what the allocating transaction must compare and write;
    `moved`: why the node's fill block changes with it (logged once committed)."""

    __slots__ = ("block", "compares", "ip", "moved", "ops", "set_index")

    def __init__(self, set_index: int, ip: str, block: str) -> None:
        self.set_index = set_index
        self.ip = ip
        self.block = block
        self.compares: list[Compare] = []
        self.ops: list[Put | Delete] = []
        self.moved = ""


class _Request:
    """One ADD waiting to be combined into a batch (see Ledger.allocate)."""

    __slots__ = ("attachment", "done", "error", "pod", "pools", "result", "wake")

    def __init__(self, pools: list[PoolSpec], attachment: Attachment, pod: PodInfo) -> None:
        self.pools = pools
        self.attachment = attachment
        self.pod = pod
        self.result: list[Allocation] | None = None
        self.error: BaseException | None = None
        self.done = False
        self.wake = _thread.allocate_lock()  # not `threading`: it costs the plugin ~1 ms
        self.wake.acquire()


class _Taken:
    """What earlier requests of a batch of `size` picked: addresses, block cursors moved."""

    __slots__ = ("ips", "next", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ips: set[str] = set()
        self.next: dict[str, int] = {}


class _QueueView:
    """A free queue as last read, oldest first; `complete` if that was all of it."""

    __slots__ = ("complete", "entries", "read_at")

    def __init__(self, read_at: float, entries: list[KeyValue], complete: bool) -> None:
        self.read_at = read_at
        self.entries = entries
        self.complete = complete


class _Cleanup:
    """The removal of stale entries (`deleted`), valid while `read` is as it was read."""

    __slots__ = ("compares", "ops")

    def __init__(self, read: list[KeyValue], deleted: list[str]) -> None:
        self.compares = [at_revision(kv.key, kv.mod_revision) for kv in read]
        self.ops: list[Put | Delete] = [Delete(key) for key in deleted]


def _with_cleanups(pick: _Pick, stale: list[_Cleanup]) -> _Pick:
    for removal in stale:
        pick.compares += removal.compares
        pick.ops += removal.ops
    return pick


def _refuse_deleting(spec: PoolSpec) -> None:
    if spec.deleting:
        raise UnknownPool(
            f"pool {spec.name!r} is being deleted ('ipward pool delete'); no ADD may use it"
        )


def _unique_compares(compares: list[Compare]) -> list[Compare]:
    seen = set()
    out = []
    for c in compares:
        mark = (c.key, c.target, c.op, c.operand)
        if mark not in seen:
            seen.add(mark)
            out.append(c)
    return out


def _last_write_per_key(ops: list[Put | Delete]) -> list[Put | Delete]:
    """A batch writes a block's cursor once per pick: keep the last (furthest) write."""
    last = {op.key: op for op in ops}
    return list(last.values())


def record_writes(
    pool: str, ip: str, record: AddressRecord, moved_from: str = ""
) -> list[Put | Delete]:
    """Store an allocation record with its node's index entry (`nodeips/`, holding a copy
    of the record: an agent's reconciliation reads its node's records in one range),
    dropping the entry of the node it moved from: every write of a record goes with
    these in one transaction (the delete side: `_free_ops`)."""
    value = record.encode()
    ops: list[Put | Delete] = [Put(keys.ip_key(pool, ip), value)]
    if moved_from and moved_from != record.node:
        ops.append(Delete(keys.node_ip_key(moved_from, pool, ip)))
    if record.node:
        ops.append(Put(keys.node_ip_key(record.node, pool, ip), value))
    return ops


class _Conflict(Exception):
    """What was read changed before it could be used; read again."""


class _StickyExists(Exception):
    """The reservation appeared while this ADD made a new one: take it over instead."""


class _NeedsBlock(Exception):
    """A batch ran out of room in the blocks its node fills: getting another block is
    left to each request's own transaction."""


class _ClaimFirst(Exception):
    """More never-claimed blocks than MAX_FULL_CLAIMS are full (of requested addresses):
    claim them on their own (the ADD then goes on from past them)."""

    def __init__(self, compares: list[Compare], ops: list[Put | Delete]) -> None:
        self.compares = compares
        self.ops = ops


class Ledger:
    def __init__(self, store: Store, node: str, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self._known: dict[str, KeyValue] = {}  # keys as last read or written, present
        self._combining = _thread.allocate_lock()
        self._waiting: dict[tuple[str, ...], list[_Request]] = {}
        self._leading: set[tuple[str, ...]] = set()
        self._queues: dict[str, _QueueView] = {}  # this node's free queues, as last seen
        self._specs: dict[str, PoolSpec] = {}  # pools as last parsed, with their revision

    # -- pools ------------------------------------------------------------------------

    def get_pool(self, name: str, fresh: bool = False) -> PoolSpec:
        kv = self._get(keys.pool_key(name), fresh)
        if kv is None:
            raise UnknownPool(f"pool {name!r} does not exist (create it with 'ipward pool create')")
        return self._parsed(kv)

    def stored_pools(self) -> list[PoolSpec]:
        """Every pool as the store has it now (one range read, never from memory)."""
        return [self._parsed(kv) for kv in self.store_range(keys.POOLS)[0]]

    def _parsed(self, kv: KeyValue) -> PoolSpec:
        """The stored spec, parsed once per revision (not on every ADD of an agent)."""
        name = keys.pool_name(kv.key)
        parsed = self._specs.get(name)
        if parsed is not None and parsed.revision == kv.mod_revision:
            return parsed
        spec = PoolSpec.decode(kv.value)
        spec.revision = kv.mod_revision
        self._specs[name] = spec
        return spec

    def _pool_guard(self, spec: PoolSpec) -> tuple[list[Compare], list[Put | Delete]]:
        """What an allocation must compare (and write) about its pool. A spec read from
        the store must be unchanged and not being deleted. A declared spec (CNI config)
        is stored by the allocating transaction itself, so a failed ADD leaves nothing
        behind: it takes its layout version and retired layouts from the stored one; a
        new pool, or a change of its layout (a new version; the old layout is retired),
        passes the overlap test against every other pool in the same transaction
        (`ipam.pools.coverage_guard`). A plain ADD on an unchanged pool only compares."""
        key = keys.pool_key(spec.name)
        if spec.revision is not None:
            _refuse_deleting(spec)
            return [at_revision(key, spec.revision)], []
        kv = self._get(key)
        if kv is not None and kv.value == spec.encode():
            return [at_revision(key, kv.mod_revision)], []
        stored = self._parsed(kv) if kv is not None else None
        if stored is not None:
            _refuse_deleting(stored)
            if stored.source != spec.source:
                raise InvalidConfig(
                    f"pool {spec.name!r} exists and was created with the CLI; name it with"
                    " 'pool' in the CNI config instead of inline ranges, or rename the network"
                )
            spec.retired = list(stored.retired)
            spec.layout.version = stored.version
            if spec.same_layout(stored):
                compares = [at_revision(key, kv.mod_revision)]  # type: ignore[union-attr]
                if spec.declaration() == stored.declaration():
                    return compares, []
                return compares, [Put(key, spec.encode())]  # routes, cooldown...
            spec.retired.append(stored.layout)  # records may hold its addresses
            spec.layout.version = stored.version + 1
        from ipward.ipam.pools import coverage_guard  # only when a pool is stored or changed

        compares, ops = coverage_guard(self._get, self.store_range, spec)
        compares.append(at_revision(key, kv.mod_revision if kv else 0))
        ops.append(Put(key, spec.encode()))
        return compares, ops

    # -- ADD --------------------------------------------------------------------------

    def lookup(self, attachment: Attachment) -> list[Allocation] | None:
        """The attachment's addresses, or None if it has none (read from the store: an
        answer, not a decision a compare would check)."""
        kv = self._get(attachment.key, fresh=True)
        if kv is None:
            return None
        return self._held_allocations(kv)

    def allocate(
        self,
        pools: list[PoolSpec],
        attachment: Attachment,
        pod: PodInfo,
        requested: Sequence[str] = (),
        sticky: Sticky | None = None,
    ) -> list[Allocation]:
        """One address per range set of each pool for the attachment, or the addresses it
        already has. `requested` addresses (bare, no prefix) are used for their family.
        With `sticky`, the identity's reservation is taken over when there is one (its
        addresses, whatever the pools), else made in the allocating transaction.

        Concurrent calls for the same pools are combined: one caller commits a batch of
        them in one transaction (distinct addresses, every compare kept), instead of all
        of them racing for the same queue head and block cursor. A batch that fails falls
        back to one transaction per request. Alone, a call is its own batch of one."""
        if sticky is not None:
            return self._allocate_sticky(pools, attachment, pod, requested, sticky)
        if requested:
            return self._allocate_one(pools, attachment, pod, requested)
        me = _Request(pools, attachment, pod)
        key = tuple(p.name for p in pools)
        with self._combining:
            waiting = self._waiting.setdefault(key, [])
            waiting.append(me)
            leads = key not in self._leading
            if leads:
                self._leading.add(key)
        if not leads:
            me.wake.acquire()  # served, or handed the lead
        if not me.done:
            self._lead(key)
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _lead(self, key: tuple[str, ...]) -> None:
        """Serve one batch of the waiting requests (this caller's first among them), then
        hand the lead to the next waiting request, so no caller serves others forever.
        Whatever serving raises, every request of the batch is answered (a result or an
        error) or back in line, and the lead passes on."""
        with self._combining:
            batch = self._waiting[key][:MAX_BATCH]
            del self._waiting[key][:MAX_BATCH]
        answered = len(batch)
        try:
            answered = self._serve(batch)
        except BaseException as e:  # a bug, or an interrupt: its callers must still hear
            for request in batch:
                if request.result is None and request.error is None:
                    request.error = e
            raise
        finally:
            served, unserved = batch[:answered], batch[answered:]
            for request in served:
                request.done = True
            with self._combining:
                waiting = self._waiting[key]
                waiting[:0] = unserved  # did not fit this batch's transaction: next in line
                successor = waiting[0] if waiting else None
                if successor is None:
                    self._leading.discard(key)
                    del self._waiting[key]
            for request in served:
                if request.wake.locked():
                    request.wake.release()
            if successor is not None:
                successor.wake.release()  # it wakes not done, so it leads

    def _serve(self, batch: list[_Request]) -> int:
        """Answer the first requests of `batch`, as many as one transaction of the store
        holds: combined when they commit together, else one by one. How many it answered
        (at least one: the lead's own)."""
        count, results = 1, None
        if len(batch) > 1:
            try:
                count, results = self._allocate_group(batch)
            except Exception as e:  # whatever it was, each request finds its own answer
                foreseen = isinstance(e, _Conflict | _NeedsBlock | IpwardError)
                if not foreseen or isinstance(e, InputTooLarge):  # the store's limits?
                    log.warning(
                        "combined allocation failed; serving one by one",
                        error=f"{type(e).__name__}: {e}",
                        batch=len(batch),
                    )
                count, results = len(batch), None
        for position, request in enumerate(batch[:count]):
            if results is not None:
                request.result = results[position]
                continue
            try:
                request.result = self._allocate_one(request.pools, request.attachment, request.pod)
            except Exception as e:  # handed to the caller, raised in its own thread
                request.error = e
        return count

    def _allocate_group(self, batch: list[_Request]) -> tuple[int, list[list[Allocation]] | None]:
        """One transaction for the first requests of the batch, as many as fit the
        store's transaction limits (each member's compares and writes are counted as it is
        added, after the batch's shared ones are merged), on a first, optimistic attempt.
        (How many it took, their allocations or None if they are to be served one by one:
        it did not commit, or only one fitted.)"""
        pools = batch[0].pools
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        for guard_compares, guard_ops in (self._pool_guard(pool) for pool in pools):
            compares += guard_compares
            ops += guard_ops
        taken = _Taken(len(batch))
        refs_of = []
        now = self.clock()
        for request in batch:
            picks = [
                (pool, self._pick(pool, i, rs, None, False, taken))
                for pool in pools
                for i, rs in enumerate(pool.range_sets)
            ]
            refs = [rec.pool_ip(p.name, k.ip) for p, k in picks]
            member_compares = [absent(request.attachment.key)]
            member_ops: list[Put | Delete] = [
                Put(request.attachment.key, AttachmentIndex(refs).encode())
            ]
            for pool, pick in picks:
                record = AddressRecord.new(
                    request.attachment, request.pod, self.node, pick.block, now, pool.version
                )
                member_compares += pick.compares
                member_ops += pick.ops
                member_ops += record_writes(pool.name, pick.ip, record)
            grown_compares = _unique_compares(compares + member_compares)
            grown_ops = _last_write_per_key(ops + member_ops)
            if self.store.txn_problem(grown_compares, grown_ops) is not None:
                break  # this one and the rest wait for the next batch
            compares, ops = grown_compares, grown_ops
            refs_of.append(refs)
        if len(refs_of) < 2:
            return 1, None
        testpoints.pause("allocate")
        if not self._txn(compares, ops):
            return len(refs_of), None
        results = []
        for request, refs in zip(batch, refs_of, strict=False):
            allocations = self._allocations(refs, pools)
            log.info(
                "allocated",
                attachment=repr(request.attachment),
                ips=[repr(a) for a in allocations],
                batch=len(refs_of),
            )
            results.append(allocations)
        return len(refs_of), results

    def _allocate_one(
        self,
        pools: list[PoolSpec],
        attachment: Attachment,
        pod: PodInfo,
        requested: Sequence[str] = (),
        sticky: Sticky | None = None,
    ) -> list[Allocation]:
        refused_once = False
        for attempt in range(MAX_ATTEMPTS):
            # The first attempt leaves the attachment's absence to a compare; a retry reads
            # it (from the store: returning it is an answer) and whatever else the first
            # attempt left to compares.
            verify = attempt > 0
            if verify:
                existing = self._get(attachment.key, fresh=True)
                if existing is not None:
                    return self._held_allocations(existing, pools)
                if sticky is not None and self._get(sticky.key, fresh=True) is not None:
                    raise _StickyExists  # another sandbox of the identity made it first
                # A pool read from the store may have changed (or gone): read it again.
                pools = [self.get_pool(p.name) if p.revision is not None else p for p in pools]
            try:
                # The pool guard first: it settles the layout version the picks use, and a
                # pool that may not be used is refused before anything is read for it.
                guards = [self._pool_guard(pool) for pool in pools]
                wanted = self._requested_by_pool(pools, requested)
                # Every family's pick, block claims included, goes into one transaction:
                # a failed ADD writes nothing.
                picks = [
                    (pool, self._pick(pool, i, rs, wanted.get((pool.name, i)), verify))
                    for pool in pools
                    for i, rs in enumerate(pool.range_sets)
                ]
            except _Conflict:
                self._backoff(attempt)
                continue
            except _ClaimFirst as full:
                # Blocks entirely taken by requested addresses: claimed on their own, so
                # the walk goes on past them (pinned to the pool as the guard saw it).
                guard_compares = [c for compares, _ in guards for c in compares]
                self._txn([*guard_compares, *full.compares], full.ops)
                continue
            except StoreUnreachable:
                raise
            except IpwardError:
                if refused_once:
                    raise
                refused_once = True  # maybe decided on remembered keys: read all again
                self._known.clear()
                continue
            now = self.clock()
            refs = [rec.pool_ip(p.name, k.ip) for p, k in picks]
            compares: list[Compare] = [absent(attachment.key)]
            ops: list[Put | Delete] = [Put(attachment.key, AttachmentIndex(refs).encode())]
            if sticky is not None:
                compares.append(absent(sticky.key))
                ops.append(
                    Put(
                        sticky.key,
                        sticky.record(refs, attachment, pod.uid, self.node, now).encode(),
                    )
                )
            for guard_compares, guard_ops in guards:
                compares += guard_compares
                ops += guard_ops
            for pool, pick in picks:
                record = AddressRecord.new(
                    attachment,
                    pod,
                    self.node,
                    pick.block,
                    now,
                    pool.version,
                    requested=(pool.name, pick.set_index) in wanted,
                    sticky=sticky.key if sticky is not None else None,
                )
                compares += pick.compares
                ops += pick.ops
                ops += record_writes(pool.name, pick.ip, record)
            testpoints.pause("allocate")
            if self._txn(compares, ops):
                self._log_pool_writes(pools, guards, picks)
                allocations = self._allocations(refs, pools)
                log.info(
                    "allocated",
                    attachment=repr(attachment),
                    ips=[repr(a) for a in allocations],
                    **({"sticky": sticky.key} if sticky is not None else {}),
                )
                return allocations
            self._backoff(attempt)
        raise TryAgainLater(f"{attachment}: too much contention, no allocation made")

    def _log_pool_writes(
        self,
        pools: list[PoolSpec],
        guards: list[tuple[list[Compare], list[Put | Delete]]],
        picks: list[tuple[PoolSpec, _Pick]],
    ) -> None:
        """Log what a committed allocation changed besides its records: a pool stored or
        changed by its CNI config, a block claimed or taken back."""
        for pool, (_, guard_ops) in zip(pools, guards, strict=True):
            if guard_ops:
                log.info(
                    "pool stored",
                    pool=pool.name,
                    version=pool.version,
                    retired=len(pool.retired),
                    reason="declared by the network config",
                )
        for pool, pick in picks:
            if pick.moved:
                log.info(
                    "block", pool=pool.name, block=pick.block, node=self.node, reason=pick.moved
                )

    def _allocate_sticky(
        self,
        pools: list[PoolSpec],
        attachment: Attachment,
        pod: PodInfo,
        requested: Sequence[str],
        sticky: Sticky,
    ) -> list[Allocation]:
        for attempt in range(MAX_ATTEMPTS):
            existing = self._get(attachment.key, fresh=True)
            if existing is not None:
                return self._held_allocations(existing, pools)
            reservation = self._get(sticky.key, fresh=True)
            if reservation is None:
                try:
                    return self._allocate_one(pools, attachment, pod, requested, sticky)
                except _StickyExists:
                    continue
            taken = self._take_over(reservation, attachment, pod, sticky, requested)
            if taken is not None:
                return taken
            self._backoff(attempt)
        raise TryAgainLater(f"{attachment}: too much contention on {sticky.key}")

    def _take_over(
        self,
        reservation: KeyValue,
        attachment: Attachment,
        pod: PodInfo,
        sticky: Sticky,
        requested: Sequence[str],
    ) -> list[Allocation] | None:
        """DESIGN 5.1 step 2: the new sandbox of the identity takes the reserved
        addresses by one CAS over the reservation, its records and the old sandbox's
        index (deleted: its DEL then finds nothing). None when something moved."""
        held = ReservationRecord.decode(reservation.value)
        refs = held.ips
        asked = set(requested)
        if asked and not asked <= {rec.split_pool_ip(r)[1] for r in refs}:
            raise AddressTaken(
                f"{sticky.key} holds {', '.join(refs)}; the runtime asked for"
                f" {', '.join(sorted(asked))}"
            )
        old = held.attachment
        old_uid = held.uid
        if (
            old
            and old_uid != pod.uid
            and sticky.may_take is not None
            and not sticky.may_take(old_uid)
        ):
            raise TryAgainLater(
                f"{sticky.key} is bound to {old} of pod UID {old_uid}, which may still be"
                " live; the address moves once that pod is gone"
            )
        now = self.clock()
        compares: list[Compare] = [
            at_revision(reservation.key, reservation.mod_revision),
            absent(attachment.key),
        ]
        ops: list[Put | Delete] = [
            Put(attachment.key, AttachmentIndex(refs).encode()),
            Put(
                reservation.key,
                sticky.record(refs, attachment, pod.uid, self.node, now).encode(),
            ),
        ]
        if old and old != attachment.key:
            old_kv = self._get(old, fresh=True)
            compares.append(at_revision(old, old_kv.mod_revision if old_kv else 0))
            if old_kv is not None:
                ops.append(Delete(old))
        layouts: dict[str, int | None] = {}
        for ref in refs:
            pool_name, ip = rec.split_pool_ip(ref)
            key = keys.ip_key(pool_name, ip)
            kv = self._get(key, fresh=True)
            record = AddressRecord.decode(kv.value) if kv is not None else None
            if kv is None or record is None or record.sticky != sticky.key:
                raise InvalidConfig(
                    f"{sticky.key} lists {ref}, whose record is not its own; see 'ipward check'"
                )
            mine = AddressRecord.new(
                attachment, pod, self.node, record.block, now, record.layout, sticky=sticky.key
            )
            layouts[ref] = record.layout
            compares.append(at_revision(key, kv.mod_revision))
            ops += record_writes(pool_name, ip, mine, moved_from=record.node)
        if not self._txn(compares, ops):
            return None
        allocations = self._allocations(refs, layouts=layouts)
        log.info(
            "sticky address taken over",
            attachment=repr(attachment),
            ips=refs,
            sticky=sticky.key,
            previous=old or "(detached)",
        )
        return allocations

    def _requested_by_pool(
        self, pools: list[PoolSpec], requested: Sequence[str]
    ) -> dict[tuple[str, int], int]:
        """Map each requested address to the (pool, range set) of its family."""
        wanted: dict[tuple[str, int], int] = {}
        for text in requested:
            family, value = parse_ip(text)
            for pool in pools:
                index = pool.set_of(family)
                if index is not None and pool.range_sets[index].usable(value):
                    if (pool.name, index) in wanted:
                        raise InvalidConfig(f"two addresses requested for one family: {text}")
                    wanted[(pool.name, index)] = value
                    break
            else:
                raise AddressOutsidePool(
                    f"requested address {text} is not an allocatable address of pool"
                    f" {', '.join(p.name for p in pools)} (outside its ranges, excluded,"
                    " or the gateway)"
                )
        return wanted

    def _pick(
        self,
        pool: PoolSpec,
        index: int,
        rs: RangeSet,
        requested: int | None,
        verify: bool,
        taken: _Taken | None = None,
    ) -> _Pick:
        if requested is not None:
            return self._pick_requested(pool, index, rs, requested)
        pick = self._pick_unrequested(pool, index, rs, verify, taken)
        if taken is not None:
            taken.ips.add(pick.ip)
        return pick

    def _pick_unrequested(
        self, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, taken: _Taken | None
    ) -> _Pick:
        queued = self._pick_from_queue(pool, index, taken, verify, cooled_only=True)
        if queued is not None:
            return queued
        fresh = self._pick_fresh(pool, index, rs, verify, taken)
        if fresh is not None:
            return fresh
        if taken is not None:
            raise _NeedsBlock  # a batch does not move blocks: each request does, alone
        room = self._pick_new_room(pool, index, rs, verify)
        if room is not None:
            return room
        queued = self._pick_from_queue(pool, index, taken, verify, cooled_only=False)
        if queued is not None:
            return queued  # still cooling, but the only address left
        taken_back = self._take_back(pool, index, rs, verify, cooled_only=False)
        if taken_back is not None:
            return taken_back  # the same, in a block being released
        if pool.borrow:
            borrowed = self._borrow(pool, index, rs, verify)
            if borrowed is not None:
                return borrowed
        raise PoolExhausted(
            f"pool {pool.name} has no free {'IPv6' if rs.family == 6 else 'IPv4'} address"
            f" ({rs.capacity()} in all)"
        )

    def _pick_requested(self, pool: PoolSpec, index: int, rs: RangeSet, value: int) -> _Pick:
        block = rs.block_of(value)
        assert block is not None  # usable() was checked
        ip = block.address(value - block.base)
        if self._get(keys.ip_key(pool.name, ip)) is not None:
            raise AddressTaken(f"requested address {ip} is already allocated in pool {pool.name}")
        pick = _Pick(index, ip, block.cidr)
        pick.compares.append(absent(keys.ip_key(pool.name, ip)))
        block_kv = self._get(keys.block_key(pool.name, block.cidr))
        if block_kv is None:
            pick.compares.append(absent(keys.block_key(pool.name, block.cidr)))
        else:
            self._require_active(block_kv, pool.name)
            pick.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
        free_kv = self._get(keys.free_key(pool.name, ip))
        if free_kv is not None:
            pick.compares.append(at_revision(free_kv.key, free_kv.mod_revision))
            pick.ops += [Delete(free_kv.key), Delete(FreeRecord.decode(free_kv.value).queue)]
        return pick

    def _pick_from_queue(
        self,
        pool: PoolSpec,
        index: int,
        taken: _Taken | None,
        verify: bool,
        cooled_only: bool,
    ) -> _Pick | None:
        """The oldest queued address of this node that is free to take: not taken by the
        batch already, in one of its active blocks (entries of a block being released are
        passed over, so a surplus block is not taken back while others have room), and,
        if `cooled_only`, past its cooldown. Reads the head first (the common case), and
        the oldest QUEUE_WINDOW entries only when the head cannot be used."""
        skip = taken.ips if taken is not None else ()
        prefix = keys.queue_prefix(pool.name, pool.range_sets[index].family, self.node)
        first = taken.size if taken is not None else 1  # a batch reads its share at once
        stale: list[_Cleanup] = []
        looked: set[str] = set()  # the window's read starts over at the head
        for limit in (first + len(skip), QUEUE_WINDOW + len(skip)):
            kvs, complete = self._queue_read(prefix, limit, verify)
            for kv in kvs:
                if keys.last(kv.key) in skip or kv.key in looked:
                    continue
                looked.add(kv.key)
                if cooled_only and not self._cooled(pool, kv):
                    return None  # in release order: the rest are cooling too
                pick = self._pick_queued(pool, index, kv, stale, verify=verify)
                if pick is not None:
                    return _with_cleanups(pick, stale)
            if complete:
                return None  # that was all of it
        return None

    def _queue_read(self, prefix: str, limit: int, verify: bool) -> tuple[list[KeyValue], bool]:
        """The oldest `limit` entries of one of this node's free queues, and whether that
        is all of it. A long-lived ledger remembers the queue for QUEUE_MEMORY seconds,
        kept up to date with its own writes (its releases append, its allocations take);
        entries freed by others show up at the next read. Safe: taking an entry compares
        it, and a failed compare forgets the queue."""
        view = self._queues.get(prefix)
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
            kvs, _ = self.store_range(prefix, limit=want)
            view = _QueueView(now, kvs, len(kvs) < want)
            self._queues[prefix] = view
        return view.entries[:limit], view.complete and len(view.entries) <= limit

    def _note_queue_writes(self, ops: list[Put | Delete], revision: int) -> None:
        for op in ops:
            if not keys.is_queue_key(op.key):
                continue
            view = self._queues.get(keys.queue_prefix_of(op.key))
            if view is None:
                continue
            if isinstance(op, Delete):
                view.entries = [kv for kv in view.entries if kv.key != op.key]
            elif view.complete and (not view.entries or op.key > view.entries[-1].key):
                view.entries.append(KeyValue(op.key, op.value, revision, revision, 1))
            elif view.complete:
                self._queues.pop(keys.queue_prefix_of(op.key), None)  # out of order: read again

    def _forget_queues(self, touched: object) -> None:
        for key in touched:  # type: ignore[attr-defined]
            if keys.is_queue_key(key):
                self._queues.pop(keys.queue_prefix_of(key), None)

    def _cooled(self, pool: PoolSpec, head: KeyValue) -> bool:
        return keys.queued_at(head.key) + pool.cooldown <= self.clock()

    def _pick_queued(
        self,
        pool: PoolSpec,
        index: int,
        head: KeyValue,
        stale: list[_Cleanup],
        owner: str | None = None,
        verify: bool = True,
    ) -> _Pick | None:
        """The queue entry's address, or None when its block is not `owner`'s (this
        node's, unless borrowing) active block (being released: the ledger looks
        elsewhere, and takes the block back only if it must). A first attempt leaves the
        address's absence to the transaction's compare; a verifying one reads it. A stale
        entry (its address allocated by request meanwhile, outside the pool since its
        ranges changed, or of a released block) is passed over and its removal added to
        `stale`: it rides in the transaction of the address picked instead, so a failed
        ADD writes nothing."""
        ip = keys.last(head.key)
        record = self._get(keys.ip_key(pool.name, ip), fresh=True) if verify else None
        if record is not None:
            stale.append(_Cleanup([head, record], [head.key]))
            return None
        block = pool.range_sets[index].block_of(parse_ip(ip)[1])
        if block is None:
            stale.append(_Cleanup([head], [head.key, keys.free_key(pool.name, ip)]))
            return None
        block_key = keys.block_key(pool.name, block.cidr)
        block_kv = self._get(block_key)
        if block_kv is None:
            # A released block's entries are deleted before it; one left over is stale.
            gone = _Cleanup([head], [head.key, keys.free_key(pool.name, ip)])
            gone.compares.append(absent(block_key))
            stale.append(gone)
            return None
        state = BlockRecord.decode(block_kv.value)
        if not state.active or state.node != (owner or self.node):
            return None
        pick = _Pick(index, ip, block.cidr)
        pick.compares += [
            at_revision(head.key, head.mod_revision),
            absent(keys.ip_key(pool.name, ip)),
            at_revision(block_kv.key, block_kv.mod_revision),
        ]
        pick.ops += [Delete(head.key), Delete(keys.free_key(pool.name, ip))]
        return pick

    def _pick_fresh(
        self, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, taken: _Taken | None
    ) -> _Pick | None:
        """A never-used address from the block this node fills, or None when it is used
        up (or the node fills none yet)."""
        fill = self._get(keys.fill_key(pool.name, rs.family, self.node))
        if fill is None:
            return None
        cidr = FillRecord.decode(fill.value).block
        block = rs.block_by_cidr(cidr)
        block_kv = self._get(keys.block_key(pool.name, cidr))
        if block is None or block_kv is None:
            return None
        return self._fresh_in_block(pool, index, block, block_kv, verify, taken=taken)

    def _fresh_in_block(
        self,
        pool: PoolSpec,
        index: int,
        block: Block,
        block_kv: KeyValue,
        verify: bool,
        borrow: bool = False,
        taken: _Taken | None = None,
    ) -> _Pick | None:
        state = BlockRecord.decode(block_kv.value)
        if not state.active or (state.node != self.node and not borrow):
            return None
        start = state.next_for(pool.version)
        if taken is not None:
            start = max(start, taken.next.get(block.cidr, 0))
        offset = self._free_offset(pool, block, start, verify)
        if offset is None:
            return None
        pick = self._fresh_pick(pool, index, block, offset)
        pick.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
        advanced = state.advanced(offset + 1, pool.version)
        pick.ops.append(Put(block_kv.key, advanced.encode()))
        if taken is not None:
            taken.next[block.cidr] = offset + 1
        return pick

    def _free_offset(self, pool: PoolSpec, block: Block, start: int, verify: bool) -> int | None:
        """The first usable offset >= `start` of the block to hand out fresh. A requested
        address may sit ahead of the cursor: the first attempt trusts the transaction's
        compares to find out; a retry reads and skips what is taken or queued."""
        offset = block.next_usable(start)
        while offset is not None:
            ip = block.address(offset)
            if not verify or (
                self._get(keys.ip_key(pool.name, ip), fresh=True) is None
                and self._get(keys.free_key(pool.name, ip), fresh=True) is None
            ):
                return offset
            offset = block.next_usable(offset + 1)
        return None

    def _queued_in(self, pool: PoolSpec, index: int, block: Block, verify: bool) -> _Pick | None:
        """This node's oldest cooled queue entry inside `block`, a block it is about to
        claim: an address it was given by request before it held the block, and freed.
        The claim hands it out before any never-used one (oldest freed first)."""
        rs = pool.range_sets[index]
        prefix = keys.queue_prefix(pool.name, rs.family, self.node)
        for kv in self._queue_read(prefix, QUEUE_WINDOW, verify)[0]:
            if not self._cooled(pool, kv):
                return None  # in release order: the rest are cooling too
            ip = keys.last(kv.key)
            inside = rs.block_of(parse_ip(ip)[1])
            if inside is None or inside.cidr != block.cidr:
                continue
            if verify and self._get(keys.ip_key(pool.name, ip), fresh=True) is not None:
                continue  # allocated by request meanwhile: a stale entry, for a later pass
            pick = _Pick(index, ip, block.cidr)
            pick.compares += [
                at_revision(kv.key, kv.mod_revision),
                absent(keys.ip_key(pool.name, ip)),
            ]
            pick.ops += [Delete(kv.key), Delete(keys.free_key(pool.name, ip))]
            return pick
        return None

    @staticmethod
    def _fresh_pick(pool: PoolSpec, index: int, block: Block, offset: int) -> _Pick:
        """A never-used address: its record and free entry must still be absent."""
        ip = block.address(offset)
        pick = _Pick(index, ip, block.cidr)
        pick.compares += [absent(keys.ip_key(pool.name, ip)), absent(keys.free_key(pool.name, ip))]
        return pick

    def _own_blocks(self, pool: PoolSpec, family: int) -> list[tuple[str, KeyValue]]:
        """This node's blocks of one family (from the affinity index, not a pool scan)."""
        kvs, _ = self.store_range(keys.affinity_prefix(pool.name, self.node))
        out = []
        for kv in kvs:
            cidr = keys.cidr_of(kv.key)
            if family_of(cidr) == family:
                block_kv = self._get(keys.block_key(pool.name, cidr))
                if block_kv is not None:
                    out.append((cidr, block_kv))
        return out

    def _pick_new_room(
        self, pool: PoolSpec, index: int, rs: RangeSet, verify: bool
    ) -> _Pick | None:
        """An address from elsewhere when the block this node fills is used up, in order:
        1. a fresh one of another of its active blocks (one the controller assigned);
        2. one of its blocks in the release handshake, taken back (it needs the space),
           for a fresh or cooled freed address of it;
        3. a released block (`blockfree/`), before
        4. the pool's next never-claimed block (`blockcursor/`).
        What moves (the fill record, a block taken back or claimed, the cursor) is
        written by the allocating transaction itself and pinned by its compares, so a
        failed ADD writes nothing. None when there is no room anywhere."""
        fill_key = keys.fill_key(pool.name, rs.family, self.node)
        fill = self._get(fill_key)
        filling = FillRecord.decode(fill.value).block if fill else None
        for block, kv, _ in self._node_blocks(pool, rs, active=True):
            if block.cidr == filling:
                continue  # used up (the fresh pick found nothing in it)
            pick = self._fresh_in_block(pool, index, block, kv, verify)
            if pick is not None:
                return self._fills(pick, fill_key, fill, "fills another of its blocks")
        taken_back = self._take_back(pool, index, rs, verify, cooled_only=True)
        if taken_back is not None:
            return taken_back
        full: list[tuple[blocks.Claim, int]] = []
        for claim in blocks.claims(pool, rs, self._get, self.store_range):
            offset = self._free_offset(pool, claim.block, 0, verify)
            queued = self._queued_in(pool, index, claim.block, verify)
            if offset is None and queued is None:  # all taken by request: claim it, go on
                full.append((claim, claim.block.size))
                if len(full) >= MAX_FULL_CLAIMS:
                    raise _ClaimFirst(*blocks.claim_writes(pool, rs.family, self.node, full))
                continue
            if queued is not None:  # oldest freed first, fresh ones after it
                pick, cursor = queued, claim.block.size if offset is None else offset
            else:
                assert offset is not None
                pick, cursor = self._fresh_pick(pool, index, claim.block, offset), offset + 1
            compares, ops = blocks.claim_writes(
                pool, rs.family, self.node, [*full, (claim, cursor)]
            )
            pick.compares += compares
            pick.ops += ops
            moved = "claimed a released block" if claim.entry else "claimed a new block"
            return self._fills(pick, fill_key, fill, moved)
        return None

    def _node_blocks(
        self, pool: PoolSpec, rs: RangeSet, active: bool
    ) -> list[tuple[Block, KeyValue, BlockRecord]]:
        """This node's blocks of the current layout in `rs`, active or (`active=False`)
        in the release handshake."""
        out = []
        for cidr, kv in self._own_blocks(pool, rs.family):
            block = rs.block_by_cidr(cidr)
            state = BlockRecord.decode(kv.value)
            if block is None or state.node != self.node:
                continue
            if state.active == active:
                out.append((block, kv, state))
        return out

    def _take_back(
        self, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, cooled_only: bool
    ) -> _Pick | None:
        """An address of one of this node's blocks in the release handshake, taking the
        block back (active again; the controller's next step fails its CAS): its oldest
        freed address past the cooldown, else a fresh one, else (unless `cooled_only`)
        its oldest freed address still cooling. A first attempt trusts compares; a
        verify one reads each address of the block."""
        fill_key = keys.fill_key(pool.name, rs.family, self.node)
        for block, kv, state in self._node_blocks(pool, rs, active=False):
            pick = self._available_in(pool, index, block, verify, cooled_only)
            if pick is None:
                continue
            # next = 0: addresses whose free entries the controller already cleaned are
            # found again as fresh (those still recorded or queued are skipped).
            pick.compares.append(at_revision(kv.key, kv.mod_revision))
            pick.ops.append(Put(kv.key, state.taken_back(pool.version).encode()))
            moved = "needs the space again: release handshake aborted"
            return self._fills(pick, fill_key, self._get(fill_key), moved)
        return None

    def _available_in(
        self, pool: PoolSpec, index: int, block: Block, verify: bool, cooled_only: bool
    ) -> _Pick | None:
        """The address `_take_back` wants from one block: its oldest freed address past
        the cooldown, else its first fresh one, else (unless `cooled_only`) its oldest
        freed one still cooling. Reads every address of the block, on a verifying attempt
        only (a first one proposes the first address and lets the compares judge)."""
        offset = block.next_usable(0)
        if not verify:
            return None if offset is None else self._fresh_pick(pool, index, block, offset)
        fresh: int | None = None
        oldest: dict[bool, tuple[float, KeyValue]] = {}  # cooled? -> oldest freed
        now = self.clock()
        while offset is not None:
            ip = block.address(offset)
            if self._get(keys.ip_key(pool.name, ip), fresh=True) is None:
                free = self._get(keys.free_key(pool.name, ip), fresh=True)
                if free is None:
                    fresh = offset if fresh is None else fresh
                else:
                    released = FreeRecord.decode(free.value).freed_at
                    cooled = released + pool.cooldown <= now
                    if cooled not in oldest or released < oldest[cooled][0]:
                        oldest[cooled] = (released, free)
            offset = block.next_usable(offset + 1)
        queued = oldest.get(True) or (None if cooled_only else oldest.get(False))
        if queued is None:
            return None if fresh is None else self._fresh_pick(pool, index, block, fresh)
        free = queued[1]
        ip = keys.last(free.key)
        pick = _Pick(index, ip, block.cidr)
        pick.compares += [
            absent(keys.ip_key(pool.name, ip)),
            at_revision(free.key, free.mod_revision),
        ]
        pick.ops += [Delete(free.key), Delete(FreeRecord.decode(free.value).queue)]
        return pick

    @staticmethod
    def _fills(pick: _Pick, fill_key: str, fill: KeyValue | None, moved: str) -> _Pick:
        """The pick's block becomes the one this node fills."""
        pick.compares.append(at_revision(fill_key, fill.mod_revision if fill else 0))
        pick.ops.append(Put(fill_key, FillRecord(pick.block).encode()))
        pick.moved = moved
        return pick

    def _borrow(self, pool: PoolSpec, index: int, rs: RangeSet, verify: bool) -> _Pick | None:
        """One address of another node's active block (the pool allows borrowing and no
        block is free): the oldest entry of the other nodes' free queues, else a
        never-used address of the block another node fills. Reads grow with the number
        of nodes, not the pool's size. Released, the address goes back to its owner."""
        family = rs.family
        queued, _ = self.store_range(keys.queues_prefix(pool.name, family), limit=QUEUE_WINDOW)
        stale: list[_Cleanup] = []
        for kv in queued:
            owner = keys.queue_node(kv.key)
            if owner != self.node and self._cooled(pool, kv):
                pick = self._pick_queued(pool, index, kv, stale, owner=owner)
                if pick is not None:
                    return _with_cleanups(pick, stale)
        fills, _ = self.store_range(keys.fills_prefix(pool.name, family))
        for fill in fills:
            if keys.last(fill.key) == self.node:
                continue
            cidr = FillRecord.decode(fill.value).block
            block, block_kv = rs.block_by_cidr(cidr), self._get(keys.block_key(pool.name, cidr))
            if block is None or block_kv is None:
                continue
            pick = self._fresh_in_block(pool, index, block, block_kv, verify, borrow=True)
            if pick is not None:
                return pick
        return None

    def _require_active(self, block_kv: KeyValue, pool: str) -> None:
        if not BlockRecord.decode(block_kv.value).active:
            raise TryAgainLater(f"block {block_kv.key} of pool {pool} is being released")

    # -- DEL --------------------------------------------------------------------------

    def release(self, attachment: Attachment, reason: str = "CNI DEL") -> list[str]:
        """Free the attachment's addresses (detach sticky ones); an unknown attachment is
        not an error. Returns the addresses freed or detached; each is logged with
        `reason`."""
        for attempt in range(MAX_ATTEMPTS):
            index_kv = self._get(attachment.key)
            if index_kv is None:
                return []
            compares, ops, freed, detached = self._release_plan(index_kv, attachment)
            if self._txn(compares, ops):
                self._log_release(attachment, freed, detached, reason)
                return freed + detached
            self._backoff(attempt)
        raise TryAgainLater(f"{attachment}: too much contention, nothing released")

    def _release_plan(
        self, index_kv: KeyValue, attachment: Attachment
    ) -> tuple[list[Compare], list[Put | Delete], list[str], list[str]]:
        """The transaction that releases an attachment: delete its index; free each of
        its records, or detach it when it is sticky. (compares, ops, freed, detached)."""
        compares: list[Compare] = [at_revision(index_kv.key, index_kv.mod_revision)]
        ops: list[Put | Delete] = [Delete(index_kv.key)]
        freed: list[str] = []
        detached: list[str] = []
        now = self.clock()
        for ref in AttachmentIndex.decode(index_kv.value).refs:
            pool_name, ip = rec.split_pool_ip(ref)
            key = keys.ip_key(pool_name, ip)
            record_kv = self._get(key)
            # Every decision below is pinned by a compare, so it holds at commit.
            compares.append(at_revision(key, record_kv.mod_revision if record_kv else 0))
            if record_kv is None:
                continue  # index out of step with records: drop the index entry only
            record = AddressRecord.decode(record_kv.value)
            if record.attachment != attachment:
                continue  # the address belongs to someone else now: never touch it
            if record.sticky:
                # Detach: the reservation keeps the address for the identity's next
                # sandbox (DESIGN 2); retiring it is the controller's.
                ops += record_writes(pool_name, ip, record.detached(now))
                sticky_ops, sticky_compares = self._detach_reservation(
                    record.sticky, attachment, now
                )
                ops += sticky_ops
                compares += sticky_compares
                detached.append(ref)
                continue
            free_ops, block_compare = self._free_ops(pool_name, ip, record, now)
            ops += free_ops
            compares += block_compare
            freed.append(ref)
        return _unique_compares(compares), _last_write_per_key(ops), freed, detached

    @staticmethod
    def _log_release(
        attachment: Attachment, freed: list[str], detached: list[str], reason: str, **more: object
    ) -> None:
        if freed:
            log.info("released", attachment=repr(attachment), ips=freed, reason=reason, **more)
        if detached:
            log.info("detached", attachment=repr(attachment), ips=detached, reason=reason, **more)

    def _detach_reservation(
        self, key: str, attachment: Attachment, now: float
    ) -> tuple[list[Put | Delete], list[Compare]]:
        """The reservation's side of a detach: it no longer names a sandbox (only when it
        still names this one: a takeover may have moved it on)."""
        kv = self._get(key, fresh=True)
        if kv is None:
            return [], [absent(key)]
        held = ReservationRecord.decode(kv.value)
        compares = [at_revision(key, kv.mod_revision)]
        if held.attachment != attachment.key:
            return [], compares
        return [Put(key, held.detached(now).encode())], compares

    def free_sticky(
        self, key: str, expected_mod_revision: int, reason: str, fence: Sequence[Compare] = ()
    ) -> list[str]:
        """Retire a detached reservation: delete it and its records, compared at the
        revision the caller judged, and queue the addresses (cooldown). Refuses
        (OwnerChanged) when anything moved or a sandbox holds it. Returns the addresses."""
        kv = self._get(key, fresh=True)
        if kv is None or kv.mod_revision != expected_mod_revision:
            raise OwnerChanged(f"{key} changed since it was read; look again")
        held = ReservationRecord.decode(kv.value)
        if held.bound:
            raise OwnerChanged(f"{key} is bound to {held.attachment}: its pod holds it")
        now = self.clock()
        compares: list[Compare] = [*fence, at_revision(key, kv.mod_revision)]
        ops: list[Put | Delete] = [Delete(key)]
        for ref in held.ips:
            pool_name, ip = rec.split_pool_ip(ref)
            record_kv = self._get(keys.ip_key(pool_name, ip), fresh=True)
            if record_kv is None:
                compares.append(absent(keys.ip_key(pool_name, ip)))
                continue
            record = AddressRecord.decode(record_kv.value)
            if record.sticky != key or not record.is_detached:
                raise OwnerChanged(f"{ref} of {key} is in use; look again")
            free_ops, block_compares = self._free_ops(pool_name, ip, record, now)
            compares += [at_revision(record_kv.key, record_kv.mod_revision), *block_compares]
            ops += free_ops
        if not self._txn(compares, ops):
            raise OwnerChanged(f"{key} changed while being freed; look again")
        log.info("released", sticky=key, ips=held.ips, reason=reason)
        return list(held.ips)

    def _free_ops(
        self, pool_name: str, ip: str, record: AddressRecord, now: float
    ) -> tuple[list[Put | Delete], list[Compare]]:
        """Delete a record and, if its pool hands the address out now, queue it (the
        cooldown) on the node that owns its block. An address the pool does not cover
        any more (a retired layout's, or a deleted pool's) is not queued: this pool
        version never hands it out. Pinned by compares on the pool spec and the block."""
        pool_key = keys.pool_key(pool_name)
        spec_kv = self._get(pool_key)
        compares = [at_revision(pool_key, spec_kv.mod_revision if spec_kv else 0)]
        ops: list[Put | Delete] = [Delete(keys.ip_key(pool_name, ip))]
        if record.node:
            ops.append(Delete(keys.node_ip_key(record.node, pool_name, ip)))
        if spec_kv is None:
            return ops, compares
        family, value = parse_ip(ip)
        try:
            spec = self._parsed(spec_kv)
        except (IpwardError, ValueError):
            spec = None  # unreadable ('ipward check' says so): a DEL must still work
        if spec is not None:
            index = spec.set_of(family)
            block = spec.range_sets[index].block_of(value) if index is not None else None
            if block is None:
                return ops, compares
            cidr = block.cidr
        else:
            cidr = record.block
        owner = record.node or self.node
        block_key = keys.block_key(pool_name, cidr)
        block_kv = self._get(block_key)
        if block_kv is not None:
            owner = BlockRecord.decode(block_kv.value).node or owner
        queue = keys.queue_key(pool_name, family, owner, now, ip)
        ops += [
            Put(keys.free_key(pool_name, ip), FreeRecord(now, queue).encode()),
            Put(queue, b""),
        ]
        compares.append(at_revision(block_key, block_kv.mod_revision if block_kv else 0))
        return ops, compares

    def release_address(
        self,
        pool: str,
        ip: str,
        expected_mod_revision: int,
        reason: str,
        fence: Sequence[Compare] = (),
    ) -> AddressRecord:
        """Compare-and-delete one record (the CLI's `release`, garbage collection):
        refuses when the record is not exactly the one the caller saw. `fence`: compares
        that must hold too (a controller's leadership). Returns the record freed. A
        commit refused by a key read from the remembered cache (its pool spec, its block,
        changed by another writer) is tried again on fresh reads: only a change of the
        record itself is the caller's to hear."""
        key = keys.ip_key(pool, ip)
        for attempt in range(MAX_ATTEMPTS):
            record_kv = self._get(key, fresh=True)
            if record_kv is None or record_kv.mod_revision != expected_mod_revision:
                raise OwnerChanged(
                    f"{pool}/{ip} changed since it was read (revision {expected_mod_revision});"
                    " look again and retry"
                )
            record = AddressRecord.decode(record_kv.value)
            attachment = record.attachment
            index_kv = self._get(attachment.key, fresh=True)
            if record.sticky:
                # A sticky address is detached with its whole attachment, never freed
                # here: retiring the reservation is `free_sticky`'s.
                if index_kv is None or record.is_detached:
                    raise OwnerChanged(f"{pool}/{ip} is reserved by {record.sticky}, detached")
                compares, ops, freed, detached = self._release_plan(index_kv, attachment)
            else:
                ops, compares = self._free_ops(pool, ip, record, self.clock())
                if index_kv is not None:
                    ref = rec.pool_ip(pool, ip)
                    refs = [r for r in AttachmentIndex.decode(index_kv.value).refs if r != ref]
                    compares.append(at_revision(index_kv.key, index_kv.mod_revision))
                    ops.append(
                        Put(index_kv.key, AttachmentIndex(refs).encode())
                        if refs
                        else Delete(index_kv.key)
                    )
                freed, detached = [rec.pool_ip(pool, ip)], []
            compares += [*fence, at_revision(key, record_kv.mod_revision)]
            if self._txn(compares, ops):
                self._log_release(
                    attachment, freed, detached, reason, revision=expected_mod_revision
                )
                return record
            if not all(c.holds(self._get(c.key, fresh=True)) for c in fence):
                raise OwnerChanged(f"{pool}/{ip} not released: its fence no longer holds")
            self._backoff(attempt)
        raise TryAgainLater(f"{pool}/{ip}: too much contention, nothing released")

    def collect_network(
        self, network: str, keep: set[tuple[str, str]], grace: float = ADD_GRACE
    ) -> list[str]:
        """CNI GC, with garbage collection's rules (ipward.gc) and the runtime's list as
        the evidence: free each address of `network` on this node whose attachment
        (container, ifname) the runtime did not list as valid, and whose ADD is older
        than `grace` (one in flight may not be listed yet), by compare-and-delete on the
        revision read. Only this node's (read through its index): the runtime lists its
        own attachments, so another node's are never in its list. Returns the addresses
        freed."""
        kvs, _ = self.store_range(keys.node_ips_prefix(self.node))
        now = self.clock()
        freed = []
        for kv in kvs:
            _, pool, ip = keys.node_ip_parts(kv.key)
            try:
                copy = AddressRecord.decode(kv.value)
            except ValueError:
                continue  # 'ipward check' reports it
            if copy.network != network or (copy.container, copy.ifname) in keep:
                continue
            record_kv = self._get(keys.ip_key(pool, ip), fresh=True)
            if record_kv is None:
                continue
            record = AddressRecord.decode(record_kv.value)
            age = now - (record.created_at if record.created_at is not None else now)
            if (
                record.is_detached
                or record.node != self.node
                or record.attachment != copy.attachment
                or age < grace
            ):
                continue
            reason = (
                f"CNI GC: not in cni.dev/valid-attachments, {age:.0f}s after its ADD"
                f" (grace {grace:g}s)"
            )
            try:
                self.release_address(pool, ip, record_kv.mod_revision, reason)
            except OwnerChanged:
                continue  # released or replaced meanwhile: not ours to touch
            freed.append(rec.pool_ip(pool, ip))
        return freed

    # -- plumbing ---------------------------------------------------------------------

    def _allocations(
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

    def _held_allocations(
        self, index: KeyValue, known: Sequence[PoolSpec] = ()
    ) -> list[Allocation]:
        """An attachment's allocations, from its index, as its records say they were
        given (a repeated ADD, a lookup): each record names its layout version."""
        refs = AttachmentIndex.decode(index.value).refs
        layouts: dict[str, int | None] = {}
        for ref in refs:
            kv = self._get(keys.ip_key(*rec.split_pool_ip(ref)), fresh=True)
            layouts[ref] = AddressRecord.decode(kv.value).layout if kv is not None else None
        return self._allocations(refs, known, layouts)

    def _get(self, key: str, fresh: bool = False) -> KeyValue | None:
        """The key as last read or written here, or as the store has it now when it is
        not remembered (or `fresh`)."""
        if not fresh:
            known = self._known.get(key)
            if known is not None:
                return known
        try:
            kv = self.store.get(key)
        except StoreUnavailable as e:
            raise StoreUnreachable(f"store unreachable: {e}") from e
        if kv is None:
            self._known.pop(key, None)
        else:
            self._remember(kv)
        return kv

    def _remember(self, kv: KeyValue) -> None:
        if len(self._known) >= KNOWN_LIMIT:
            self._known.clear()
        self._known[kv.key] = kv

    def store_range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        try:
            return self.store.range(prefix, limit)
        except StoreUnavailable as e:
            raise StoreUnreachable(f"store unreachable: {e}") from e

    def _txn(self, compares: list[Compare], ops: list[Put | Delete]) -> bool:
        problem = self.store.txn_problem(compares, ops)
        if problem is not None:
            raise InputTooLarge(f"one transaction would need {problem}; nothing was done")
        try:
            result = self.store.txn(compares, ops)
        except TxnTooLarge as e:  # limits set lower than the store's defaults
            raise InputTooLarge(f"the store refused a transaction as too large: {e}") from e
        except StoreUnavailable as e:
            # Applied or not, nobody can tell: forget all it touched.
            touched = {c.key for c in compares} | {op.key for op in ops}
            for key in touched:
                self._known.pop(key, None)
            self._forget_queues(touched)
            raise StoreUnreachable(f"store unreachable: {e}") from e
        if not result.succeeded:
            for c in compares:
                self._known.pop(c.key, None)
            self._forget_queues([c.key for c in compares])
            return False
        self._note_queue_writes(ops, result.revision)
        for op in ops:
            if isinstance(op, Put):
                self._remember(KeyValue(op.key, op.value, 0, result.revision, 0, op.lease))
            else:
                self._known.pop(op.key, None)
        return True

    @staticmethod
    def _backoff(attempt: int) -> None:
        if attempt:
            import random  # only on conflicts: ~1 ms of import on every plugin exec otherwise

            time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
