"""Room for a node when the block it fills is used up: another of its active blocks, one
of its blocks taken back from the hand-back handshake, a claimed block (a released one
first, then the pool's next never-claimed one), or an address borrowed from another
node's block. The one claim protocol: `claims` walks the blocks a node may claim and
`claim_writes` writes a claim, for the ledger (in the allocating transaction) and for
the controller's warm target (`blocks.assign`) alike.

What moves (the fill record, a block taken back or claimed, the cursor) is written by
the allocating transaction itself and pinned by its compares, so a failed ADD writes
nothing.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core.addr import family_of
from ipward.core.records import BlockRecord, CursorRecord, FillRecord
from ipward.ipam import free_queue
from ipward.ipam.allocating import ClaimFirst, free_offset, fresh_in_block, fresh_pick
from ipward.ipam.allocation import Pick, held, unheld
from ipward.store.base import Delete, KeyValue, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from ipward.core.addr import Block, RangeSet
    from ipward.core.pool import PoolSpec
    from ipward.ipam.cache import StoreCache
    from ipward.store.base import Compare

RELEASED_WINDOW = 16  # released-block entries looked at for one claim
# Never-claimed blocks whose every usable address is already taken (by requested
# addresses) that one allocation claims on its way to a block with room.
MAX_FULL_CLAIMS = 16


# -- the claim walk and its writes --------------------------------------------------------


class Claim:
    """A block a node may take: a released one (`entry`: its `blockfree/` key) or the
    next never-claimed one (`index` in the range set's block numbering, `cursor` as
    read)."""

    __slots__ = ("block", "cursor", "entry", "index")

    def __init__(
        self,
        block: Block,
        entry: KeyValue | None = None,
        cursor: KeyValue | None = None,
        index: int = 0,
    ) -> None:
        self.block = block
        self.entry = entry
        self.cursor = cursor
        self.index = index


def claims(
    spec: PoolSpec,
    rs: RangeSet,
    get: Callable[[str], KeyValue | None],
    range_: Callable[[str, int], tuple[list[KeyValue], int]],
) -> Iterator[Claim]:
    """The blocks of `rs` a node may claim, in the order they are taken: released blocks
    first, then never-claimed ones from the block cursor on. A block with no address to
    hand out is never offered (`next_usable_block` jumps over excluded spans), nor one
    that exists already. Reads only: the claim is written by `claim_writes`, in the
    caller's transaction."""
    released, _ = range_(keys.released_block_prefix(spec.name, rs.family), RELEASED_WINDOW)
    for entry in released:
        block = rs.block_by_cidr(keys.cidr_of(entry.key))
        if block is None or block.next_usable(0) is None:
            continue  # a block of an earlier layout: `ipam.pools.prune` removes the entry
        if get(keys.block_key(spec.name, block.cidr)) is None:
            yield Claim(block, entry=entry)
    cursor = get(keys.block_cursor_key(spec.name, rs.family))
    start = CursorRecord.decode(cursor.value).next_for(spec.version) if cursor else 0
    index = rs.next_usable_block(start)
    while index is not None:
        block = rs.block(index)
        assert block is not None
        if get(keys.block_key(spec.name, block.cidr)) is None:
            yield Claim(block, cursor=cursor, index=index)
        index = rs.next_usable_block(index + 1)  # claimed out of order, or since the change


def claim_writes(
    spec: PoolSpec, family: int, node: str, taken: Sequence[tuple[Claim, int]]
) -> tuple[list[Compare], list[Put | Delete]]:
    """Compares and writes that give `node` the claimed blocks, each with its `next`
    cursor (a block whose first addresses the same transaction allocates starts past
    them): each block absent, each released entry as read (and deleted), the block
    cursor as read and moved past the furthest block taken."""
    compares: list[Compare] = []
    ops: list[Put | Delete] = []
    furthest = None
    for claim, next_offset in taken:
        key = keys.block_key(spec.name, claim.block.cidr)
        state = BlockRecord.claimed(node, next_offset, spec.version)
        compares.append(absent(key))
        ops += [
            Put(key, state.encode()),
            Put(keys.affinity_key(spec.name, node, claim.block.cidr), b""),
        ]
        if claim.entry is not None:
            compares.append(at_revision(claim.entry.key, claim.entry.mod_revision))
            ops.append(Delete(claim.entry.key))
        elif furthest is None or claim.index > furthest.index:
            furthest = claim
    if furthest is not None:
        cursor_key = keys.block_cursor_key(spec.name, family)
        cursor = furthest.cursor
        compares.append(at_revision(cursor_key, cursor.mod_revision if cursor else 0))
        ops.append(Put(cursor_key, CursorRecord(furthest.index + 1, spec.version).encode()))
    return compares, ops


# -- the ledger's room beyond its fill block ----------------------------------------------


def new_room(
    cache: StoreCache, pool: PoolSpec, index: int, rs: RangeSet, verify: bool
) -> Pick | None:
    """An address from elsewhere when the block this node fills is used up, in order:
    1. a fresh one of another of its active blocks (one the controller assigned);
    2. one of its blocks in the hand-back handshake, taken back (it needs the space),
       for a fresh or cooled freed address of it;
    3. a released block (`blockfree/`), before
    4. the pool's next never-claimed block (`blockcursor/`).
    None when there is no room anywhere."""
    fill_key = keys.fill_key(pool.name, rs.family, cache.node)
    fill = cache.get(fill_key)
    filling = FillRecord.decode(fill.value).block if fill else None
    for block, kv, _ in node_blocks(cache, pool, rs, active=True):
        if block.cidr == filling:
            continue  # used up (the fresh pick found nothing in it)
        pick = fresh_in_block(cache, pool, block, kv, verify)
        if pick is not None:
            return fills(pick, fill_key, fill, "fills another of its blocks")
    taken_back = take_back(cache, pool, rs, verify, cooled_only=True)
    if taken_back is not None:
        return taken_back
    return _claimed(cache, pool, index, rs, verify, fill_key, fill)


def _claimed(
    cache: StoreCache,
    pool: PoolSpec,
    index: int,
    rs: RangeSet,
    verify: bool,
    fill_key: str,
    fill: KeyValue | None,
) -> Pick | None:
    """An address of the first block the claim walk offers that has one to hand out (its
    oldest cooled freed address, else its first fresh one), with the claim's writes;
    blocks passed over on the way (all taken by request) are claimed in the same
    transaction, or on their own past MAX_FULL_CLAIMS (`ClaimFirst`)."""
    full: list[tuple[Claim, int]] = []
    for claim in claims(pool, rs, cache.get, cache.range):
        offset = free_offset(cache, pool, claim.block, 0, verify)
        queued = free_queue.queued_in(cache, pool, index, claim.block, verify)
        if offset is None and queued is None:  # all taken by request: claim it, go on
            full.append((claim, claim.block.size))
            if len(full) >= MAX_FULL_CLAIMS:
                raise ClaimFirst(*claim_writes(pool, rs.family, cache.node, full))
            continue
        if queued is not None:  # oldest freed first, fresh ones after it
            pick, cursor = queued, claim.block.size if offset is None else offset
        else:
            assert offset is not None
            pick = fresh_pick(cache, pool, claim.block, offset)
            cursor = offset + 1
        compares, ops = claim_writes(pool, rs.family, cache.node, [*full, (claim, cursor)])
        pick.compares += compares
        pick.ops += ops
        moved = "claimed a released block" if claim.entry else "claimed a new block"
        return fills(pick, fill_key, fill, moved)
    return None


def own_blocks(cache: StoreCache, pool: PoolSpec, family: int) -> list[tuple[str, KeyValue]]:
    """This node's blocks of one family (from the affinity index, not a pool scan)."""
    kvs, _ = cache.range(keys.affinity_prefix(pool.name, cache.node))
    out = []
    for kv in kvs:
        cidr = keys.cidr_of(kv.key)
        if family_of(cidr) == family:
            block_kv = cache.get(keys.block_key(pool.name, cidr))
            if block_kv is not None:
                out.append((cidr, block_kv))
    return out


def node_blocks(
    cache: StoreCache, pool: PoolSpec, rs: RangeSet, active: bool
) -> list[tuple[Block, KeyValue, BlockRecord]]:
    """This node's blocks of the current layout in `rs`, active or (`active=False`)
    in the hand-back handshake."""
    out = []
    for cidr, kv in own_blocks(cache, pool, rs.family):
        block = rs.block_by_cidr(cidr)
        state = BlockRecord.decode(kv.value)
        if block is None or state.node != cache.node:
            continue
        if state.active == active:
            out.append((block, kv, state))
    return out


def take_back(
    cache: StoreCache, pool: PoolSpec, rs: RangeSet, verify: bool, cooled_only: bool
) -> Pick | None:
    """An address of one of this node's blocks in the hand-back handshake, taking the
    block back (active again; the controller's next step fails its CAS): its oldest
    freed address past the cooldown, else a fresh one, else (unless `cooled_only`)
    its oldest freed address still cooling. A first attempt trusts compares; a
    verify one reads each address of the block."""
    fill_key = keys.fill_key(pool.name, rs.family, cache.node)
    for block, kv, state in node_blocks(cache, pool, rs, active=False):
        pick = _available_in(cache, pool, block, verify, cooled_only)
        if pick is None:
            continue
        # next = 0: addresses whose free entries the controller already cleaned are
        # found again as fresh (those still recorded or queued are skipped).
        pick.compares.append(at_revision(kv.key, kv.mod_revision))
        pick.ops.append(Put(kv.key, state.taken_back(pool.version).encode()))
        moved = "needs the space again: hand-back handshake aborted"
        return fills(pick, fill_key, cache.get(fill_key), moved)
    return None


def _available_in(
    cache: StoreCache, pool: PoolSpec, block: Block, verify: bool, cooled_only: bool
) -> Pick | None:
    """The address `take_back` wants from one block: its oldest freed address past
    the cooldown, else its first fresh one, else (unless `cooled_only`) its oldest
    freed one still cooling. Reads every address of the block, on a verifying attempt
    only (a first one proposes the first address and lets the compares judge)."""
    offset = block.next_usable(0)
    if not verify:
        return None if offset is None else fresh_pick(cache, pool, block, offset)
    fresh: int | None = None
    oldest: dict[bool, tuple[float, KeyValue]] = {}  # cooled? -> oldest freed
    now = cache.clock()
    while offset is not None:
        ip = block.address(offset)
        if not held(cache, pool.name, ip):
            free = free_queue.freed(cache, pool.name, ip, fresh=True)
            if free is None:
                fresh = offset if fresh is None else fresh
            else:
                freed_at = free_queue.freed_at(free)
                cooled = freed_at + pool.cooldown <= now
                if cooled not in oldest or freed_at < oldest[cooled][0]:
                    oldest[cooled] = (freed_at, free)
        offset = block.next_usable(offset + 1)
    queued = oldest.get(True) or (None if cooled_only else oldest.get(False))
    if queued is None:
        return None if fresh is None else fresh_pick(cache, pool, block, fresh)
    free = queued[1]
    ip = keys.last(free.key)
    pick = Pick.of(pool, ip, block.cidr)
    compares, ops = free_queue.take(free)
    pick.compares += [*unheld(cache, pool.name, ip), *compares]
    pick.ops += ops
    return pick


def fills(pick: Pick, fill_key: str, fill: KeyValue | None, moved: str) -> Pick:
    """The pick's block becomes the one this node fills."""
    pick.compares.append(at_revision(fill_key, fill.mod_revision if fill else 0))
    pick.ops.append(Put(fill_key, FillRecord(pick.block).encode()))
    pick.moved = moved
    return pick


def borrow(
    cache: StoreCache, pool: PoolSpec, index: int, rs: RangeSet, verify: bool
) -> Pick | None:
    """One address of another node's active block (the pool allows borrowing and no
    block is free): the oldest entry of the other nodes' free queues
    (`free_queue.from_other_queues`), else a never-used address of the block another
    node fills. Reads grow with the number of nodes, not the pool's size. Freed, the
    address goes back to its owner."""
    queued = free_queue.from_other_queues(cache, pool, index)
    if queued is not None:
        return queued
    fill_kvs, _ = cache.range(keys.fills_prefix(pool.name, rs.family))
    for fill in fill_kvs:
        if keys.last(fill.key) == cache.node:
            continue
        cidr = FillRecord.decode(fill.value).block
        block, block_kv = rs.block_by_cidr(cidr), cache.get(keys.block_key(pool.name, cidr))
        if block is None or block_kv is None:
            continue
        pick = fresh_in_block(cache, pool, block, block_kv, verify, borrow=True)
        if pick is not None:
            return pick
    return None
