"""Making one allocation in one transaction (docs/design.md 5.1): the pool guard, every
family's pick in the order the ledger takes addresses, and the transaction that pins
them (built by `allocation.writes`); retried on conflict with jittered backoff, at most
MAX_ATTEMPTS times.

Where an address comes from, in order:
  1. the address the runtime asked for (same transaction, same checks:
     `requested_address`);
  2. the oldest freed address of this node whose cooldown has passed
     (`free_queue.from_queue`);
  3. a never-used address of the block this node is filling (the block's `next` cursor:
     `fresh`), or, that one used up, room elsewhere (`claims`: another of its blocks, a
     take-back, a claim);
  4. the oldest freed address still cooling down, when nothing else is free;
  5. with `borrow`, an address of another node's block.
None of these reads grows with the size of the pool or the number of allocations.

A first attempt trusts the ledger's remembered keys and leaves absences to compares; a
verifying one (`verify`, a retry) reads what it would otherwise trust.
"""

from __future__ import annotations

from ipward.core import keys, log, testpoints
from ipward.core.addr import parse_ip
from ipward.core.errors import (
    AddressOutsidePool,
    AddressTaken,
    InvalidConfig,
    IpwardError,
    PoolExhausted,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.pool import IPPOOL
from ipward.core.records import BlockRecord, FillRecord
from ipward.ipam import free_queue
from ipward.ipam.allocation import Pick, allocations, held, held_allocations, unheld, writes
from ipward.ipam.cache import MAX_ATTEMPTS, StoreCache, backoff
from ipward.store.base import Put, StoreUnreachable, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.addr import Block, RangeSet
    from ipward.core.pool import PoolSpec
    from ipward.core.records import Attachment, PodInfo, Sticky
    from ipward.ipam.allocation import Allocation, Taken
    from ipward.store.base import Compare, Delete, KeyValue

    Guard = tuple[list[Compare], list[Put | Delete]]  # a pool's compares and writes


class StickyExists(Exception):
    """The reservation appeared while this ADD made a new one: take it over instead."""


class NeedsBlock(Exception):
    """A batch ran out of room in the blocks its node fills: getting another block is
    left to each request's own transaction."""


class ClaimFirst(Exception):
    """More never-claimed blocks than `claims.MAX_FULL_CLAIMS` are full (of requested
    addresses): claim them on their own (the ADD then goes on from past them). Here, not
    in `claims`, so that an allocation catches it without importing `claims`."""

    def __init__(self, compares: list[Compare], ops: list[Put | Delete]) -> None:
        self.compares = compares
        self.ops = ops


def refuse_deleting(spec: PoolSpec) -> None:
    if spec.deleting:
        raise UnknownPool(
            f"pool {spec.name!r} is being deleted ('ipward pool delete'); no ADD may use it"
        )


def pool_guard(cache: StoreCache, spec: PoolSpec) -> Guard:
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
    kv = cache.get(key)
    if kv is not None and kv.value == spec.encode():
        return [at_revision(key, kv.mod_revision)], []
    stored = cache.parsed(kv) if kv is not None else None
    if stored is not None:
        refuse_deleting(stored)
        if stored.source != spec.source:
            made_by = "an IPPool object" if stored.source == IPPOOL else "the CLI"
            raise InvalidConfig(
                f"pool {spec.name!r} exists and was made by {made_by}; name it with"
                " 'pool' in the CNI config instead of inline ranges, or rename the network"
            )
        if not spec.succeed(stored):
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
    from ipward.ipam.pools import coverage_guard  # only when a pool is stored or changed

    compares, ops = coverage_guard(cache.get, cache.range, spec)
    compares.append(at_revision(key, kv.mod_revision if kv else 0))
    ops.append(Put(key, spec.encode()))
    return compares, ops


def pick(
    cache: StoreCache,
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
        return requested_address(cache, pool, rs, requested, verify)
    chosen = _unrequested(cache, pool, index, rs, verify, taken)
    if taken is not None:
        taken.ips.add(chosen.ip)
    return chosen


def _unrequested(
    cache: StoreCache, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, taken: Taken | None
) -> Pick:
    queued = free_queue.from_queue(cache, pool, index, taken, verify, cooled_only=True)
    if queued is not None:
        return queued
    new = fresh(cache, pool, rs, verify, taken)
    if new is not None:
        return new
    if taken is not None:
        raise NeedsBlock  # a batch does not move blocks: each request does, alone
    # Only once the fill block is used up: ~0.2 ms of the plugin's other ADDs otherwise.
    from ipward.ipam import claims

    room = claims.new_room(cache, pool, index, rs, verify)
    if room is not None:
        return room
    queued = free_queue.from_queue(cache, pool, index, taken, verify, cooled_only=False)
    if queued is not None:
        return queued  # still cooling, but the only address left
    taken_back = claims.take_back(cache, pool, rs, verify, cooled_only=False)
    if taken_back is not None:
        return taken_back  # the same, in a block being handed back
    if pool.borrow:
        borrowed = claims.borrow(cache, pool, index, rs, verify)
        if borrowed is not None:
            return borrowed
    raise PoolExhausted(
        f"pool {pool.name} has no free {'IPv6' if rs.family == 6 else 'IPv4'} address"
        f" ({rs.capacity()} in all)"
    )


# -- addresses inside what the node holds: requested, fresh ------------------------------


def require_active(block_kv: KeyValue, pool: str) -> None:
    if not BlockRecord.decode(block_kv.value).active:
        raise TryAgainLater(f"block {block_kv.key} of pool {pool} is being handed back")


def requested_by_pool(
    pools: list[PoolSpec], requested: Sequence[str]
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


def requested_address(
    cache: StoreCache, pool: PoolSpec, rs: RangeSet, value: int, verify: bool
) -> Pick:
    """The address the runtime asked for: 101 when it is held; taken out of the free
    queue when it is cooling there."""
    block = rs.block_of(value)
    assert block is not None  # usable() was checked
    ip = block.address(value - block.base)
    if cache.get(keys.ip_key(pool.name, ip)) is not None:
        raise AddressTaken(f"requested address {ip} is already allocated in pool {pool.name}")
    pick = Pick.of(pool, ip, block.cidr)
    pick.requested = True
    block_kv = cache.get(keys.block_key(pool.name, block.cidr))
    owner = BlockRecord.decode(block_kv.value).node if block_kv is not None else ""
    if verify and held(cache, pool.name, ip, owner):
        raise AddressTaken(
            f"requested address {ip} is held in pool {pool.name}: its node index entry"
            " names it, though its record cannot be read (see 'ipward check')"
        )
    pick.compares += unheld(cache, pool.name, ip, owner)
    if block_kv is None:
        pick.compares.append(absent(keys.block_key(pool.name, block.cidr)))
    else:
        require_active(block_kv, pool.name)
        pick.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
    entry = free_queue.freed(cache, pool.name, ip)
    if entry is not None:
        compares, ops = free_queue.take(entry)
        pick.compares += compares
        pick.ops += ops
    return pick


def fresh(
    cache: StoreCache, pool: PoolSpec, rs: RangeSet, verify: bool, taken: Taken | None
) -> Pick | None:
    """A never-used address from the block this node fills, or None when it is used
    up (or the node fills none yet)."""
    fill = cache.get(keys.fill_key(pool.name, rs.family, cache.node))
    if fill is None:
        return None
    cidr = FillRecord.decode(fill.value).block
    block = rs.block_by_cidr(cidr)
    block_kv = cache.get(keys.block_key(pool.name, cidr))
    if block is None or block_kv is None:
        return None
    return fresh_in_block(cache, pool, block, block_kv, verify, taken=taken)


def fresh_in_block(
    cache: StoreCache,
    pool: PoolSpec,
    block: Block,
    block_kv: KeyValue,
    verify: bool,
    borrow: bool = False,
    taken: Taken | None = None,
) -> Pick | None:
    """The next never-used address of an active block of this node's (of another's
    when borrowing), its `next` cursor advanced past it."""
    state = BlockRecord.decode(block_kv.value)
    if not state.active or (state.node != cache.node and not borrow):
        return None
    start = state.next_for(pool.version)
    if taken is not None:
        start = max(start, taken.next.get(block.cidr, 0))
    offset = free_offset(cache, pool, block, start, verify, state.node)
    if offset is None:
        return None
    chosen = fresh_pick(cache, pool, block, offset, state.node)
    chosen.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
    advanced = state.advanced(offset + 1, pool.version)
    chosen.ops.append(Put(block_kv.key, advanced.encode()))
    if taken is not None:
        taken.next[block.cidr] = offset + 1
    return chosen


def free_offset(
    cache: StoreCache, pool: PoolSpec, block: Block, start: int, verify: bool, owner: str = ""
) -> int | None:
    """The first usable offset >= `start` of the block (of `owner`) to hand out fresh. A
    requested address may sit ahead of the cursor: the first attempt trusts the
    transaction's compares to find out; a retry reads and skips what is taken or
    queued."""
    offset = block.next_usable(start)
    while offset is not None:
        ip = block.address(offset)
        if not verify or (
            not held(cache, pool.name, ip, owner)
            and free_queue.freed(cache, pool.name, ip, fresh=True) is None
        ):
            return offset
        offset = block.next_usable(offset + 1)
    return None


def fresh_pick(
    cache: StoreCache, pool: PoolSpec, block: Block, offset: int, owner: str = ""
) -> Pick:
    """A never-used address of a block of `owner`'s (none: being claimed): held by no
    one, and not queued."""
    ip = block.address(offset)
    chosen = Pick.of(pool, ip, block.cidr)
    chosen.compares += [
        *unheld(cache, pool.name, ip, owner),
        free_queue.not_queued(pool.name, ip),
    ]
    return chosen


# -- the transaction and its retries ------------------------------------------------------


def allocate_one(
    cache: StoreCache,
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
            existing = cache.get(attachment.key_on(cache.node), fresh=True)
            if existing is not None:
                return held_allocations(cache, existing, pools)
            if sticky is not None and cache.get(sticky.key, fresh=True) is not None:
                raise StickyExists  # another sandbox of the identity made it first
            # A pool read from the store may have changed (or gone): read it again.
            pools = [cache.get_pool(p.name) if p.revision is not None else p for p in pools]
        try:
            # The pool guard first: it settles the layout version the picks use, and a
            # pool that may not be used is refused before anything is read for it.
            guards = [pool_guard(cache, pool) for pool in pools]
            wanted = requested_by_pool(pools, requested)
            # Every family's pick, block claims included, goes into one transaction:
            # a failed ADD writes nothing.
            picks = [
                pick(cache, pool, i, rs, wanted.get((pool.name, i)), verify)
                for pool in pools
                for i, rs in enumerate(pool.range_sets)
            ]
        except ClaimFirst as full:
            # Blocks entirely taken by requested addresses: claimed on their own, so
            # the walk goes on past them (pinned to the pool as the guard saw it).
            guard_compares = [c for compares, _ in guards for c in compares]
            cache.txn([*guard_compares, *full.compares], full.ops)
            continue
        except StoreUnreachable:
            raise
        except IpwardError:
            if refused_once:
                raise
            refused_once = True  # maybe decided on remembered keys: read all again
            cache.known.clear()
            continue
        compares, ops = writes(cache.node, attachment, pod, picks, cache.clock(), sticky)
        for guard_compares, guard_ops in guards:
            compares += guard_compares
            ops += guard_ops
        testpoints.pause("allocate")
        if cache.txn(compares, ops):
            _log_pool_writes(cache, pools, guards, picks)
            given = allocations(cache, [p.ref for p in picks], pools)
            log.info(
                "allocated",
                attachment=repr(attachment),
                ips=[repr(a) for a in given],
                **({"sticky": sticky.key} if sticky is not None else {}),
            )
            return given
        backoff(attempt)
    raise TryAgainLater(f"{attachment}: too much contention, no allocation made")


def _log_pool_writes(
    cache: StoreCache, pools: list[PoolSpec], guards: list[Guard], picks: list[Pick]
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
    for chosen in picks:
        if chosen.moved:
            log.info(
                "block", pool=chosen.pool, block=chosen.block, node=cache.node, reason=chosen.moved
            )
