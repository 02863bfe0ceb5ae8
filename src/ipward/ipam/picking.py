"""Address pickers inside what a node holds: a requested address, the head of its free
queue, a never-used address of a block it fills (docs/design.md 5.1 step 3). Each returns a
`Pick`: the address and what the allocating transaction must compare and write for it.
Getting room elsewhere (another block, a take-back, a claim, a borrow) is `claims`'.

A first attempt trusts the ledger's remembered keys and leaves absences to compares; a
verifying one (`verify`, a retry) reads what it would otherwise trust.

An address is free only when two witnesses say so (`unheld`, `held`): no record, and no
node index entry (`nodeips/<node>/<pool>/<ip>`, written and deleted with the record in
one transaction) under the allocating node or the block's owner, the nodes whose
records an allocation of its blocks meets. One damaged record (a flipped byte in its
SQLite key reads as absent) then does not hand its address out again. A record another
node holds in the block (borrowed, requested there, a sticky one moved with its pod)
has its entry under that node, which this does not read: the SQLite file's integrity
check (`ipward check`, and every daemon's start) finds such damage.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core.addr import parse_ip
from ipward.core.errors import AddressOutsidePool, AddressTaken, InvalidConfig, TryAgainLater
from ipward.core.records import BlockRecord, FillRecord, FreeRecord
from ipward.ipam.reads import QUEUE_WINDOW, Reads
from ipward.store.base import Delete, KeyValue, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.addr import Block, RangeSet
    from ipward.core.pool import PoolSpec
    from ipward.store.base import Compare


class Pick:
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


class Taken:
    """What earlier requests of a batch of `size` picked: addresses, block cursors moved."""

    __slots__ = ("ips", "next", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ips: set[str] = set()
        self.next: dict[str, int] = {}


class Cleanup:
    """The removal of stale entries (`deleted`), valid while `read` is as it was read."""

    __slots__ = ("compares", "ops")

    def __init__(self, read: list[KeyValue], deleted: list[str]) -> None:
        self.compares = [at_revision(kv.key, kv.mod_revision) for kv in read]
        self.ops: list[Put | Delete] = [Delete(key) for key in deleted]


class ClaimFirst(Exception):
    """More never-claimed blocks than `claims.MAX_FULL_CLAIMS` are full (of requested
    addresses): claim them on their own (the ADD then goes on from past them). Here, not
    in `claims`, so that an allocation catches it without importing `claims`."""

    def __init__(self, compares: list[Compare], ops: list[Put | Delete]) -> None:
        self.compares = compares
        self.ops = ops


def _witnesses(reads: Reads, owner: str) -> tuple[str, ...]:
    """The nodes whose node index entry of an address an allocation reads: its own and
    the block owner's."""
    return (reads.node,) if owner in ("", reads.node) else (reads.node, owner)


def unheld(reads: Reads, pool: str, ip: str, owner: str = "") -> list[Compare]:
    """The compares that the address is held by no one (see the module's docstring):
    its record absent, and its node index entries under this node and the block's
    `owner`."""
    return [
        absent(keys.ip_key(pool, ip)),
        *(absent(keys.node_ip_key(node, pool, ip)) for node in _witnesses(reads, owner)),
    ]


def held(reads: Reads, pool: str, ip: str, owner: str = "") -> bool:
    """On a verifying attempt: the address has a record, or one of the node index
    entries `unheld` compares absent (read from the store)."""
    if reads.get(keys.ip_key(pool, ip), fresh=True) is not None:
        return True
    return any(
        reads.get(keys.node_ip_key(node, pool, ip), fresh=True) is not None
        for node in _witnesses(reads, owner)
    )


def with_cleanups(pick: Pick, stale: list[Cleanup]) -> Pick:
    for removal in stale:
        pick.compares += removal.compares
        pick.ops += removal.ops
    return pick


def cooled(reads: Reads, pool: PoolSpec, head: KeyValue) -> bool:
    return keys.queued_at(head.key) + pool.cooldown <= reads.clock()


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
    reads: Reads, pool: PoolSpec, index: int, rs: RangeSet, value: int, verify: bool
) -> Pick:
    block = rs.block_of(value)
    assert block is not None  # usable() was checked
    ip = block.address(value - block.base)
    if reads.get(keys.ip_key(pool.name, ip)) is not None:
        raise AddressTaken(f"requested address {ip} is already allocated in pool {pool.name}")
    pick = Pick(index, ip, block.cidr)
    block_kv = reads.get(keys.block_key(pool.name, block.cidr))
    owner = BlockRecord.decode(block_kv.value).node if block_kv is not None else ""
    if verify and held(reads, pool.name, ip, owner):
        raise AddressTaken(
            f"requested address {ip} is held in pool {pool.name}: its node index entry"
            " names it, though its record cannot be read (see 'ipward check')"
        )
    pick.compares += unheld(reads, pool.name, ip, owner)
    if block_kv is None:
        pick.compares.append(absent(keys.block_key(pool.name, block.cidr)))
    else:
        require_active(block_kv, pool.name)
        pick.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
    free_kv = reads.get(keys.free_key(pool.name, ip))
    if free_kv is not None:
        pick.compares.append(at_revision(free_kv.key, free_kv.mod_revision))
        pick.ops += [Delete(free_kv.key), Delete(FreeRecord.decode(free_kv.value).queue)]
    return pick


def from_queue(
    reads: Reads,
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
    prefix = keys.queue_prefix(pool.name, pool.range_sets[index].family, reads.node)
    first = taken.size if taken is not None else 1  # a batch reads its share at once
    stale: list[Cleanup] = []
    looked: set[str] = set()  # the window's read starts over at the head
    for limit in (first + len(skip), QUEUE_WINDOW + len(skip)):
        kvs, complete = reads.queue_read(prefix, limit, verify)
        for kv in kvs:
            if keys.last(kv.key) in skip or kv.key in looked:
                continue
            looked.add(kv.key)
            if cooled_only and not cooled(reads, pool, kv):
                return None  # oldest freed first: the rest are cooling too
            pick = queued(reads, pool, index, kv, stale, verify=verify)
            if pick is not None:
                return with_cleanups(pick, stale)
        if complete:
            return None  # that was all of it
    return None


def queued(
    reads: Reads,
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
    record = reads.get(keys.ip_key(pool.name, ip), fresh=True) if verify else None
    if record is not None:
        stale.append(Cleanup([head, record], [head.key]))
        return None
    block = pool.range_sets[index].block_of(parse_ip(ip)[1])
    if block is None:
        stale.append(Cleanup([head], [head.key, keys.free_key(pool.name, ip)]))
        return None
    block_key = keys.block_key(pool.name, block.cidr)
    block_kv = reads.get(block_key)
    if block_kv is None:
        # A released block's entries are deleted before it; one left over is stale.
        gone = Cleanup([head], [head.key, keys.free_key(pool.name, ip)])
        gone.compares.append(absent(block_key))
        stale.append(gone)
        return None
    state = BlockRecord.decode(block_kv.value)
    if not state.active or state.node != (owner or reads.node):
        return None
    if verify and held(reads, pool.name, ip, state.node):
        return None  # its record is unreadable (damage), not gone: passed over, kept
    pick = Pick(index, ip, block.cidr)
    pick.compares += [
        at_revision(head.key, head.mod_revision),
        *unheld(reads, pool.name, ip, state.node),
        at_revision(block_kv.key, block_kv.mod_revision),
    ]
    pick.ops += [Delete(head.key), Delete(keys.free_key(pool.name, ip))]
    return pick


def fresh(
    reads: Reads, pool: PoolSpec, index: int, rs: RangeSet, verify: bool, taken: Taken | None
) -> Pick | None:
    """A never-used address from the block this node fills, or None when it is used
    up (or the node fills none yet)."""
    fill = reads.get(keys.fill_key(pool.name, rs.family, reads.node))
    if fill is None:
        return None
    cidr = FillRecord.decode(fill.value).block
    block = rs.block_by_cidr(cidr)
    block_kv = reads.get(keys.block_key(pool.name, cidr))
    if block is None or block_kv is None:
        return None
    return fresh_in_block(reads, pool, index, block, block_kv, verify, taken=taken)


def fresh_in_block(
    reads: Reads,
    pool: PoolSpec,
    index: int,
    block: Block,
    block_kv: KeyValue,
    verify: bool,
    borrow: bool = False,
    taken: Taken | None = None,
) -> Pick | None:
    state = BlockRecord.decode(block_kv.value)
    if not state.active or (state.node != reads.node and not borrow):
        return None
    start = state.next_for(pool.version)
    if taken is not None:
        start = max(start, taken.next.get(block.cidr, 0))
    offset = free_offset(reads, pool, block, start, verify, state.node)
    if offset is None:
        return None
    pick = fresh_pick(reads, pool, index, block, offset, state.node)
    pick.compares.append(at_revision(block_kv.key, block_kv.mod_revision))
    advanced = state.advanced(offset + 1, pool.version)
    pick.ops.append(Put(block_kv.key, advanced.encode()))
    if taken is not None:
        taken.next[block.cidr] = offset + 1
    return pick


def free_offset(
    reads: Reads, pool: PoolSpec, block: Block, start: int, verify: bool, owner: str = ""
) -> int | None:
    """The first usable offset >= `start` of the block (of `owner`) to hand out fresh. A
    requested address may sit ahead of the cursor: the first attempt trusts the
    transaction's compares to find out; a retry reads and skips what is taken or
    queued."""
    offset = block.next_usable(start)
    while offset is not None:
        ip = block.address(offset)
        if not verify or (
            not held(reads, pool.name, ip, owner)
            and reads.get(keys.free_key(pool.name, ip), fresh=True) is None
        ):
            return offset
        offset = block.next_usable(offset + 1)
    return None


def queued_in(reads: Reads, pool: PoolSpec, index: int, block: Block, verify: bool) -> Pick | None:
    """This node's oldest cooled queue entry inside `block`, a block it is about to
    claim: an address it was given by request before it held the block, and freed.
    The claim hands it out before any never-used one (oldest freed first)."""
    rs = pool.range_sets[index]
    prefix = keys.queue_prefix(pool.name, rs.family, reads.node)
    for kv in reads.queue_read(prefix, QUEUE_WINDOW, verify)[0]:
        if not cooled(reads, pool, kv):
            return None  # oldest freed first: the rest are cooling too
        ip = keys.last(kv.key)
        inside = rs.block_of(parse_ip(ip)[1])
        if inside is None or inside.cidr != block.cidr:
            continue
        if verify and held(reads, pool.name, ip):
            continue  # allocated by request meanwhile: a stale entry, for a later pass
        pick = Pick(index, ip, block.cidr)
        pick.compares += [at_revision(kv.key, kv.mod_revision), *unheld(reads, pool.name, ip)]
        pick.ops += [Delete(kv.key), Delete(keys.free_key(pool.name, ip))]
        return pick
    return None


def fresh_pick(
    reads: Reads, pool: PoolSpec, index: int, block: Block, offset: int, owner: str = ""
) -> Pick:
    """A never-used address of a block of `owner`'s (none: being claimed): held by no
    one, and its free entry absent."""
    ip = block.address(offset)
    pick = Pick(index, ip, block.cidr)
    pick.compares += [*unheld(reads, pool.name, ip, owner), absent(keys.free_key(pool.name, ip))]
    return pick
