"""One allocation in one transaction (docs/design.md 5.1): the pool guard, every family's pick
in the order the ledger takes addresses, and the transaction that pins them; retried on
conflict with jittered backoff, at most MAX_ATTEMPTS times.

Where an address comes from, in order:
  1. the address the runtime asked for (same transaction, same checks);
  2. the oldest freed address of this node whose cooldown has passed;
  3. a never-used address of the block this node is filling (the block's `next` cursor),
     or, that one used up, room elsewhere (`claims`: another of its blocks, a take-back,
     a claim);
  4. the oldest freed address still cooling down, when nothing else is free;
  5. with `borrow`, an address of another node's block.
None of these reads grows with the size of the pool or the number of allocations.
"""

from __future__ import annotations

from ipward.core import keys, log, testpoints
from ipward.core import records as rec
from ipward.core.errors import (
    InvalidConfig,
    IpwardError,
    PoolExhausted,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.records import AddressRecord, AttachmentIndex
from ipward.ipam import picking
from ipward.ipam.reads import MAX_ATTEMPTS, Allocation, Reads, backoff, record_writes
from ipward.store.base import Put, StoreUnreachable, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.addr import RangeSet
    from ipward.core.pool import PoolSpec
    from ipward.core.records import Attachment, PodInfo, Sticky
    from ipward.ipam.picking import Pick, Taken
    from ipward.store.base import Compare, Delete

    Guard = tuple[list[Compare], list[Put | Delete]]  # a pool's compares and writes


class StickyExists(Exception):
    """The reservation appeared while this ADD made a new one: take it over instead."""


class NeedsBlock(Exception):
    """A batch ran out of room in the blocks its node fills: getting another block is
    left to each request's own transaction."""


def refuse_deleting(spec: PoolSpec) -> None:
    if spec.deleting:
        raise UnknownPool(
            f"pool {spec.name!r} is being deleted ('ipward pool delete'); no ADD may use it"
        )


def pool_guard(reads: Reads, spec: PoolSpec) -> Guard:
    """What an allocation must compare (and write) about its pool. A spec read from
    the store must be unchanged and not being deleted. A declared spec (CNI config)
    is stored by the allocating transaction itself, so a failed ADD leaves nothing
    behind: it takes its layout version and retired layouts from the stored one; a
    new pool, or a change of its layout (a new version; the old layout is retired),
    passes the overlap test against every other pool in the same transaction
    (`ipam.pools.coverage_guard`). A plain ADD on an unchanged pool only compares."""
    key = keys.pool_key(spec.name)
    if spec.revision is not None:
        refuse_deleting(spec)
        return [at_revision(key, spec.revision)], []
    kv = reads.get(key)
    if kv is not None and kv.value == spec.encode():
        return [at_revision(key, kv.mod_revision)], []
    stored = reads.parsed(kv) if kv is not None else None
    if stored is not None:
        refuse_deleting(stored)
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
        if any(old.to_dict() == spec.layout.to_dict() for old in stored.retired):
            # Changed back; or nodes declaring different ranges under one network name
            # (per-node ranges, as with host-local), which flips it at every ADD.
            log.warning(
                "network's ranges changed back to an earlier version's",
                pool=spec.name,
                version=stored.version + 1,
                retired=len(stored.retired) + 1,
                reason="if nodes declare different ranges for one network, give each"
                " node's network its own name, or name one pool made with 'ipward pool"
                " create' in every node's config",
            )
        spec.retired.append(stored.layout)  # records may hold its addresses
        spec.layout.version = stored.version + 1
    from ipward.ipam.pools import coverage_guard  # only when a pool is stored or changed

    compares, ops = coverage_guard(reads.get, reads.range, spec)
    compares.append(at_revision(key, kv.mod_revision if kv else 0))
    ops.append(Put(key, spec.encode()))
    return compares, ops


def pick(
    reads: Reads,
    pool: PoolSpec,
    index: int,
    rs: RangeSet,
    requested: int | None,
    verify: bool,
    taken: Taken | None = None,
) -> Pick:
    """The address of one range set: the requested one, else one of the node's own
    (queue, fill block), else room elsewhere; `taken`: a batch's picks so far (a batch
    never moves blocks: `NeedsBlock`)."""
    if requested is not None:
        return picking.requested_address(reads, pool, index, rs, requested, verify)
    chosen = _unrequested(reads, pool, index, rs, verify, taken)
    if taken is not None:
        taken.ips.add(chosen.ip)
    return chosen


def _unrequested(
    reads: Reads, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, taken: Taken | None
) -> Pick:
    queued = picking.from_queue(reads, pool, index, taken, verify, cooled_only=True)
    if queued is not None:
        return queued
    fresh = picking.fresh(reads, pool, index, rs, verify, taken)
    if fresh is not None:
        return fresh
    if taken is not None:
        raise NeedsBlock  # a batch does not move blocks: each request does, alone
    # Only once the fill block is used up: ~0.2 ms of the plugin's other ADDs otherwise.
    from ipward.ipam import claims

    room = claims.new_room(reads, pool, index, rs, verify)
    if room is not None:
        return room
    queued = picking.from_queue(reads, pool, index, taken, verify, cooled_only=False)
    if queued is not None:
        return queued  # still cooling, but the only address left
    taken_back = claims.take_back(reads, pool, index, rs, verify, cooled_only=False)
    if taken_back is not None:
        return taken_back  # the same, in a block being handed back
    if pool.borrow:
        borrowed = claims.borrow(reads, pool, index, rs, verify)
        if borrowed is not None:
            return borrowed
    raise PoolExhausted(
        f"pool {pool.name} has no free {'IPv6' if rs.family == 6 else 'IPv4'} address"
        f" ({rs.capacity()} in all)"
    )


def allocate_one(
    reads: Reads,
    pools: list[PoolSpec],
    attachment: Attachment,
    pod: PodInfo,
    requested: Sequence[str] = (),
    sticky: Sticky | None = None,
) -> list[Allocation]:
    """The attachment's addresses in one transaction of its own, retried on conflict."""
    refused_once = False
    for attempt in range(MAX_ATTEMPTS):
        # The first attempt leaves the attachment's absence to a compare; a retry reads
        # it (from the store: returning it is an answer) and whatever else the first
        # attempt left to compares.
        verify = attempt > 0
        if verify:
            existing = reads.get(attachment.key, fresh=True)
            if existing is not None:
                return reads.held_allocations(existing, pools)
            if sticky is not None and reads.get(sticky.key, fresh=True) is not None:
                raise StickyExists  # another sandbox of the identity made it first
            # A pool read from the store may have changed (or gone): read it again.
            pools = [reads.get_pool(p.name) if p.revision is not None else p for p in pools]
        try:
            # The pool guard first: it settles the layout version the picks use, and a
            # pool that may not be used is refused before anything is read for it.
            guards = [pool_guard(reads, pool) for pool in pools]
            wanted = picking.requested_by_pool(pools, requested)
            # Every family's pick, block claims included, goes into one transaction:
            # a failed ADD writes nothing.
            picks = [
                (pool, pick(reads, pool, i, rs, wanted.get((pool.name, i)), verify))
                for pool in pools
                for i, rs in enumerate(pool.range_sets)
            ]
        except picking.ClaimFirst as full:
            # Blocks entirely taken by requested addresses: claimed on their own, so
            # the walk goes on past them (pinned to the pool as the guard saw it).
            guard_compares = [c for compares, _ in guards for c in compares]
            reads.txn([*guard_compares, *full.compares], full.ops)
            continue
        except StoreUnreachable:
            raise
        except IpwardError:
            if refused_once:
                raise
            refused_once = True  # maybe decided on remembered keys: read all again
            reads.known.clear()
            continue
        compares, ops, refs = _allocation_txn(reads, attachment, pod, sticky, guards, picks, wanted)
        testpoints.pause("allocate")
        if reads.txn(compares, ops):
            _log_pool_writes(reads, pools, guards, picks)
            allocations = reads.allocations(refs, pools)
            log.info(
                "allocated",
                attachment=repr(attachment),
                ips=[repr(a) for a in allocations],
                **({"sticky": sticky.key} if sticky is not None else {}),
            )
            return allocations
        backoff(attempt)
    raise TryAgainLater(f"{attachment}: too much contention, no allocation made")


def _allocation_txn(
    reads: Reads,
    attachment: Attachment,
    pod: PodInfo,
    sticky: Sticky | None,
    guards: list[Guard],
    picks: list[tuple[PoolSpec, Pick]],
    wanted: dict[tuple[str, int], int],
) -> tuple[list[Compare], list[Put | Delete], list[str]]:
    """The allocating transaction: the attachment's index (and, when sticky, its new
    reservation), the pools' guards, each pick's compares and writes and its record.
    (compares, ops, the refs allocated)."""
    now = reads.clock()
    refs = [rec.pool_ip(p.name, k.ip) for p, k in picks]
    compares: list[Compare] = [absent(attachment.key)]
    ops: list[Put | Delete] = [Put(attachment.key, AttachmentIndex(refs).encode())]
    if sticky is not None:
        compares.append(absent(sticky.key))
        made = sticky.record(refs, attachment, pod.uid, reads.node, now)
        ops.append(Put(sticky.key, made.encode()))
    for guard_compares, guard_ops in guards:
        compares += guard_compares
        ops += guard_ops
    for pool, chosen in picks:
        record = AddressRecord.new(
            attachment,
            pod,
            reads.node,
            chosen.block,
            now,
            pool.version,
            requested=(pool.name, chosen.set_index) in wanted,
            sticky=sticky.key if sticky is not None else None,
        )
        compares += chosen.compares
        ops += chosen.ops
        ops += record_writes(pool.name, chosen.ip, record)
    return compares, ops, refs


def _log_pool_writes(
    reads: Reads,
    pools: list[PoolSpec],
    guards: list[Guard],
    picks: list[tuple[PoolSpec, Pick]],
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
    for pool, chosen in picks:
        if chosen.moved:
            log.info(
                "block", pool=pool.name, block=chosen.block, node=reads.node, reason=chosen.moved
            )
