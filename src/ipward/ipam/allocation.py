"""What one allocation is made of, for every path that allocates (`allocating`,
`combining`, `sticky`'s take-over) and every picker (`allocating`, `free_queue`,
`claims`): a `Pick` (a chosen address, and what the allocating transaction compares and
writes for it), the witnesses that an address is held by no one (`unheld`, `held`), the
one builder of an allocation's writes (`writes`: the attachment index, the records with
their node index entries, the reservation), and the answer (`Allocation`).
`allocating` makes one: the pool guard, the pick order, the retries.

An address is free only when two witnesses say so (`unheld`, `held`): no record, and no
node index entry (`nodeips/<node>/<pool>/<ip>`, written and deleted with the record in
one transaction, `record_writes`) under the allocating node or the block's owner, the
nodes whose records an allocation of its blocks meets. One damaged record (a flipped
byte in its SQLite key reads as absent) then does not hand its address out again. A
record another node holds in the block (borrowed, requested there, a sticky one moved
with its pod) has its entry under that node, which this does not read: the SQLite
file's integrity check (`ipward check`, and every daemon's start) finds such damage.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.addr import format_ip, parse_ip
from ipward.core.errors import AddressOutsidePool
from ipward.core.records import AddressRecord, AttachmentIndex
from ipward.store.base import Delete, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ipward.core.pool import PoolSpec
    from ipward.core.records import Attachment, PodInfo, Sticky
    from ipward.ipam.cache import StoreCache
    from ipward.store.base import Compare, KeyValue


class Pick:
    """A chosen address of a pool (its `layout` version: the one the record names) and
    what the allocating transaction must compare and write for it. `requested`: the
    runtime asked for it; `holder`: the node whose record of it this one replaces (a
    take-over: its node index entry moves); `moved`: why the node's fill block changes
    with it (logged once committed)."""

    __slots__ = ("block", "compares", "holder", "ip", "layout", "moved", "ops", "pool", "requested")

    def __init__(self, pool: str, layout: int | None, ip: str, block: str) -> None:
        self.pool = pool
        self.layout = layout
        self.ip = ip
        self.block = block
        self.compares: list[Compare] = []
        self.ops: list[Put | Delete] = []
        self.requested = False
        self.holder = ""
        self.moved = ""

    @classmethod
    def of(cls, spec: PoolSpec, ip: str, block: str) -> Pick:
        """A pick of the pool's current layout."""
        return cls(spec.name, spec.version, ip, block)

    @property
    def ref(self) -> str:
        return rec.pool_ip(self.pool, self.ip)


class Taken:
    """What earlier requests of a batch of `size` picked: addresses, block cursors moved."""

    __slots__ = ("ips", "next", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ips: set[str] = set()
        self.next: dict[str, int] = {}


# -- the witnesses ------------------------------------------------------------------------


def _witnesses(cache: StoreCache, owner: str) -> tuple[str, ...]:
    """The nodes whose node index entry of an address an allocation reads: its own and
    the block owner's."""
    return (cache.node,) if owner in ("", cache.node) else (cache.node, owner)


def unheld(cache: StoreCache, pool: str, ip: str, owner: str = "") -> list[Compare]:
    """The compares that the address is held by no one (see the module's docstring):
    its record absent, and its node index entries under this node and the block's
    `owner`."""
    return [
        absent(keys.ip_key(pool, ip)),
        *(absent(keys.node_ip_key(node, pool, ip)) for node in _witnesses(cache, owner)),
    ]


def held(cache: StoreCache, pool: str, ip: str, owner: str = "") -> bool:
    """On a verifying attempt: the address has a record, or one of the node index
    entries `unheld` compares absent (read from the store)."""
    if cache.get(keys.ip_key(pool, ip), fresh=True) is not None:
        return True
    return any(
        cache.get(keys.node_ip_key(node, pool, ip), fresh=True) is not None
        for node in _witnesses(cache, owner)
    )


# -- the writes ---------------------------------------------------------------------------


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


def writes(
    node: str,
    attachment: Attachment,
    pod: PodInfo,
    picks: Sequence[Pick],
    now: float,
    sticky: Sticky | None = None,
    reservation: KeyValue | None = None,
) -> tuple[list[Compare], list[Put | Delete]]:
    """What giving the picked addresses to the attachment compares and writes, on every
    path that does (a single, a combined or a sticky ADD, a take-over): its index,
    compared absent (docs/design.md invariant 1); each pick's compares and writes, and
    its record on `node`, stamped `now`, with its node index entry (`record_writes`);
    with `sticky`, the reservation bound to them: made (compared absent) or, as read
    (`reservation`), taken over."""
    refs = [pick.ref for pick in picks]
    index = attachment.key_on(node)
    compares: list[Compare] = [absent(index)]
    ops: list[Put | Delete] = [Put(index, AttachmentIndex(refs).encode())]
    if sticky is not None:
        compares.append(
            absent(sticky.key)
            if reservation is None
            else at_revision(reservation.key, reservation.mod_revision)
        )
        made = sticky.record(refs, attachment, pod.uid, node, now)
        ops.append(Put(sticky.key, made.encode()))
    for pick in picks:
        record = AddressRecord.new(
            attachment,
            pod,
            node,
            pick.block,
            now,
            pick.layout,
            requested=pick.requested,
            sticky=sticky.key if sticky is not None else None,
        )
        compares += pick.compares
        ops += pick.ops
        ops += record_writes(pick.pool, pick.ip, record, moved_from=pick.holder)
    return compares, ops


# -- the answer ---------------------------------------------------------------------------


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


def allocations(
    cache: StoreCache,
    refs: Sequence[str],
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
        spec = specs.get(pool_name) or specs.setdefault(pool_name, cache.get_pool(pool_name))
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


def held_allocations(
    cache: StoreCache, index: KeyValue, known: Sequence[PoolSpec] = ()
) -> list[Allocation]:
    """An attachment's allocations, from its index, as its records say they were
    given (a repeated ADD, a lookup): each record names its layout version."""
    refs = AttachmentIndex.decode(index.value).refs
    layouts: dict[str, int | None] = {}
    for ref in refs:
        kv = cache.get(keys.ip_key(*rec.split_pool_ip(ref)), fresh=True)
        layouts[ref] = AddressRecord.decode(kv.value).layout if kv is not None else None
    return allocations(cache, refs, known, layouts)
