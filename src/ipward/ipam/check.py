"""`ipward check`: read the whole ledger and report every broken invariant
(docs/design.md 4) that can be seen from the store alone.

  duplicate-address    one address recorded twice on one network (overlapping pools),
                       or an attachment holding two addresses of one family in a pool
  index-missing        a record whose attachment index does not list it
  index-dangling       an index entry with no record, or a record owned by another
  node-index-missing   a record without its node's entry (`nodeips/<node>/<pool>/<ip>`)
  node-index-stale     a node's entry whose copy of the record differs from it
  node-index-dangling  a node's entry with no record, or whose record is another node's
  record-lost          a node's entry with no record, whose copy's attachment index lists
                       the address: the record is lost (the two witnesses of a held
                       address, the index and the copy, still say it is held)
  outside-pool         a record of an unknown pool, or of no address its pool hands out
                       now or did before its last change (a retired layout)
  free-and-allocated   an address both recorded and queued as free
  free-queue           a free record without its queue entry, or the reverse
  block-owner          a block without exactly one affinity entry (its node's), an
                       affinity entry without its block, or a block also listed as released
  sticky               a reservation whose addresses are not recorded for it (bound to the
                       sandbox it names, detached when it names none), or the reverse
  orphan               a key of a pool's own state (block, affinity, fill, cursor,
                       released block, free or queue entry) whose pool does not exist
  stale                such a key of an existing pool that its current ranges do not use,
                       when no change of its ranges explains it (none is awaiting pruning)
  pool-deleting        a pool left half-deleted ('ipward pool delete' again finishes it)
  unknown-key          a key under no prefix ipward writes (another program's, or damage)
  bad-key              a key under one of ipward's prefixes not of the form it writes there
                       (an address that is not one, a part missing): damage, or a stray write
  bad-value            a value that is not the record its key holds (not JSON, a field of
                       the wrong kind)
  integrity            what the store itself reports as damage to its data: SQLite's
                       `PRAGMA integrity_check`, etcd's CORRUPT alarms

A bad key or value is reported and left out of every other test (the rest of the store
is still checked), so one flipped byte cannot stop the tool meant to find it.

`ipward check --remove-orphans` (`repair`, then `ipam.pools.remove_orphans`) first shows
what it found, then, each by compare on the revision read: removes bad keys and values;
writes back a record that is lost (a node index copy with no record, which its
attachment's index still lists: the two witnesses of a held address); frees a record its
attachment's index does not list (a record and its index are written in one
transaction, so that is damage: a second address of one family, an index lost), through
the ledger's freeing, logged; removes orphans and stale keys; and puts the node index in
step with the records (`store.schema.repair_node_index`). Refused, writing nothing, on a
store that reports `integrity` problems: what it reads there is not to be trusted. The
rest need a person. Read-only otherwise, and at one revision: the whole store is read
with one `range`.
"""

from __future__ import annotations

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.addr import format_ip, parse_cidr, parse_ip
from ipward.core.errors import IpwardError, OwnerChanged
from ipward.core.pool import PoolSpec
from ipward.core.records import (
    AddressRecord,
    AttachmentIndex,
    BlockRecord,
    CursorRecord,
    FillRecord,
    ReservationRecord,
)
from ipward.ipam import free_queue
from ipward.ipam.free_queue import FreeRecord
from ipward.ipam.pools import stale_state
from ipward.store.base import Delete, Put, absent, at_revision
from ipward.store.schema import node_index_drift

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.ipam.ledger import Ledger
    from ipward.store.base import KeyValue, Store

# What `--remove-orphans` does about a problem (`Problem.fix`).
REMOVE = "remove"  # a bad key or value: compare-and-delete
RESTORE = "restore"  # a lost record: written back from its node index copy
FREE = "free"  # a record no attachment's index lists: freed through the ledger


class Problem:
    """One broken invariant: its kind, the key it is about, what is wrong; `fix`: what
    `--remove-orphans` does about it (empty: it is left to a person or to the other
    repairs), pinned to the key's `revision` as read."""

    __slots__ = ("detail", "fix", "key", "kind", "revision")

    def __init__(self, kind: str, key: str, detail: str, fix: str = "", revision: int = 0) -> None:
        self.kind = kind
        self.key = key
        self.detail = detail
        self.fix = fix
        self.revision = revision

    def to_dict(self) -> dict:
        out: dict = {"kind": self.kind, "key": self.key, "detail": self.detail}
        if self.fix:
            out.update(fix=self.fix, revision=self.revision)
        return out

    def __repr__(self) -> str:
        return f"{self.kind}: {self.key}: {self.detail}"


# -- keys and values that cannot be read --------------------------------------------------

# The parts of each prefix's keys (`core.keys`): a name (not empty, no "/"), an address
# (in the canonical text keys are written in), a CIDR (two segments), an address family,
# a number, the rest (not empty: the CNI path checks container IDs and ifnames, the
# ledger's own callers need not, and nothing reads these parts apart). Pool specs are
# read by `_pools` (an unreadable one is `outside-pool`).
_KEY_PARTS: dict[str, tuple[str, ...]] = {
    keys.BLOCKS: ("name", "cidr"),
    keys.AFFINITY: ("name", "name", "cidr"),
    keys.FILL: ("name", "family", "name"),
    keys.BLOCK_CURSOR: ("name", "family"),
    keys.RELEASED_BLOCKS: ("name", "family", "cidr"),
    keys.ADDRESSES: ("name", "address"),
    keys.NODE_ADDRESSES: ("name", "name", "address"),
    keys.ATTACHMENTS: ("name", "name", "name", "rest"),
    keys.FREE: ("name", "address"),
    keys.FREE_QUEUES: ("name", "family", "name", "number", "address"),
    keys.STICKY: ("name", "name", "rest"),
}
# The record each prefix's values hold (the others hold nothing read: an empty value).
_VALUES: dict[str, Callable[[bytes], object]] = {
    keys.BLOCKS: BlockRecord.decode,
    keys.FILL: FillRecord.decode,
    keys.BLOCK_CURSOR: CursorRecord.decode,
    keys.ADDRESSES: AddressRecord.decode,
    keys.NODE_ADDRESSES: AddressRecord.decode,
    keys.ATTACHMENTS: AttachmentIndex.decode,
    keys.FREE: FreeRecord.decode,
    keys.STICKY: ReservationRecord.decode,
}
# What reading a malformed key part or record raises.
_UNREADABLE = (IpwardError, ValueError, TypeError, KeyError, AttributeError)


def _part_problem(kind: str, part: str) -> str | None:
    if not part:
        return "a part is empty"
    if kind == "address":
        family, value = parse_ip(part)
        if format_ip(family, value) != part:
            return f"{part!r} is not written the way ipward writes addresses"
    elif kind == "cidr":
        parse_cidr(part, strict=True)
    elif kind == "family" and part not in ("4", "6"):
        return f"{part!r} is not an address family (4 or 6)"
    elif kind == "number" and not (part.isascii() and part.isdigit()):
        return f"{part!r} is not a number"
    return None


def _key_problem(prefix: str, key: str) -> str | None:
    kinds = _KEY_PARTS.get(prefix)
    if kinds is None:
        return None
    segments = key[len(prefix) :].split("/")
    wanted = len(kinds) + kinds.count("cidr")
    if len(segments) != wanted and not (kinds[-1] == "rest" and len(segments) > wanted):
        return f"not {prefix}{'/'.join(f'<{kind}>' for kind in kinds)}"
    for kind in kinds:
        taken = {"cidr": 2, "rest": len(segments)}.get(kind, 1)
        part, segments = "/".join(segments[:taken]), segments[taken:]
        try:
            problem = _part_problem(kind, part)
        except _UNREADABLE as e:
            problem = str(e)
        if problem:
            return problem
    return None


def unreadable(kv: KeyValue) -> Problem | None:
    """A `bad-key` or `bad-value` problem when the key is not of the form ipward writes
    under its prefix, or the value is not the record it holds; None when both read.
    Every reader of whole prefixes that must go on past damage (`check`, `alloc list`)
    asks this first."""
    prefix = keys.prefix_of(kv.key)
    key_problem = _key_problem(prefix, kv.key)
    if key_problem:
        return Problem("bad-key", kv.key, key_problem, REMOVE, kv.mod_revision)
    decode = _VALUES.get(prefix)
    if decode is not None:
        try:
            decode(kv.value)
        except _UNREADABLE as e:
            return Problem("bad-value", kv.key, f"unreadable: {e}", REMOVE, kv.mod_revision)
    return None


# -- the check ----------------------------------------------------------------------------


def check(store: Store) -> tuple[list[Problem], dict]:
    """All problems found, and counts of what was read."""
    problems = [Problem("integrity", "", said) for said in store.integrity_problems()]
    everything, revision = store.range("")
    by_prefix: dict[str, list[KeyValue]] = {prefix: [] for prefix in keys.PREFIXES}
    for kv in everything:
        prefix = keys.prefix_of(kv.key)
        if prefix not in by_prefix or (prefix == keys.META and kv.key not in keys.META_KEYS):
            problems.append(Problem("unknown-key", kv.key, "not a key ipward writes"))
            continue
        damage = unreadable(kv)
        if damage is not None:
            problems.append(damage)
        else:
            by_prefix[prefix].append(kv)
    pools = _pools(by_prefix[keys.POOLS], problems)
    records = by_prefix[keys.ADDRESSES]
    index_refs = {
        kv.key: AttachmentIndex.decode(kv.value).refs for kv in by_prefix[keys.ATTACHMENTS]
    }
    allocated, sticky_of = _records(records, pools, index_refs, problems)
    problems += _node_index(records, by_prefix[keys.NODE_ADDRESSES], index_refs)
    frees = by_prefix[keys.FREE]
    queue = by_prefix[keys.FREE_QUEUES]
    problems += [Problem(*drift) for drift in free_queue.drift(frees, queue, allocated)]
    reservations = by_prefix[keys.STICKY]
    problems += _reservations(reservations, sticky_of, index_refs)
    problems += _block_owners(by_prefix)
    problems += _leftovers(pools, by_prefix)
    counts = {
        "pools": len(pools),
        "allocations": len(records),
        "attachments": len(index_refs),
        "free": len(frees),
        "sticky": len(reservations),
        "retired_layouts": sum(len(spec.retired) for spec in pools.values() if spec),
        "revision": revision,
    }
    return problems, counts


def _pools(specs: list[KeyValue], problems: list[Problem]) -> dict[str, PoolSpec | None]:
    """Each pool's spec by name (None: unreadable)."""
    pools: dict[str, PoolSpec | None] = {}
    for kv in specs:
        name = keys.pool_name(kv.key)
        try:
            parsed = PoolSpec.decode(kv.value)
        except (IpwardError, ValueError) as e:
            pools[name] = None
            problems.append(Problem("outside-pool", kv.key, f"pool spec unreadable: {e}"))
            continue
        pools[name] = parsed
        if parsed.deleting:
            problems.append(
                Problem("pool-deleting", kv.key, f"half deleted: 'ipward pool delete {name}'")
            )
    return pools


def _records(
    records: list[KeyValue],
    pools: dict[str, PoolSpec | None],
    index_refs: dict[str, list[str]],
    problems: list[Problem],
) -> tuple[dict[str, str], dict[str, tuple[str, bool]]]:
    """The allocation records against their pools, each other and the attachment index.
    Returns the attachment of each "<pool>/<ip>", and the reservation (and whether
    detached) of each sticky one."""
    allocated: dict[str, str] = {}
    sticky_of: dict[str, tuple[str, bool]] = {}
    seen_on_network: dict[tuple[str, str], str] = {}
    families: dict[tuple[str, str, int], str] = {}
    for kv in records:
        pool_name, ip = keys.ip_parts(kv.key)
        ref = rec.pool_ip(pool_name, ip)
        record = AddressRecord.decode(kv.value)
        attachment = record.attachment
        allocated[ref] = record.index_key
        if record.sticky:
            sticky_of[ref] = (record.sticky, record.is_detached)
        family, value = parse_ip(ip)
        spec = pools.get(pool_name)
        if spec is None:
            problems.append(Problem("outside-pool", kv.key, f"pool {pool_name} does not exist"))
        elif not spec.explains(family, value):
            problems.append(
                Problem("outside-pool", kv.key, f"not an allocatable address of {pool_name}")
            )
        other = seen_on_network.setdefault((attachment.network, ip), kv.key)
        if other != kv.key:
            problems.append(Problem("duplicate-address", kv.key, f"{ip} also recorded as {other}"))
        # A detached sticky record has no sandbox: its reservation is its owner.
        holder = record.sticky if record.is_detached and record.sticky else record.index_key
        twin = families.setdefault((holder, pool_name, family), kv.key)
        if twin != kv.key:
            problems.append(
                Problem("duplicate-address", kv.key, f"{holder} also holds {twin} (same family)")
            )
        if record.is_detached:
            continue  # held by its reservation: no sandbox, no index (checked below)
        if ref not in index_refs.get(record.index_key, []):
            # Written with its index in one transaction, so unlisted it is damage: freed
            # by --remove-orphans, unless sticky (its reservation is a person's call).
            fix = "" if record.sticky else FREE
            problems.append(
                Problem(
                    "index-missing",
                    kv.key,
                    f"index {record.index_key} does not list it",
                    fix,
                    kv.mod_revision,
                )
            )
    for key, refs in index_refs.items():
        for ref in refs:
            owner = allocated.get(ref)
            if owner is None:
                problems.append(Problem("index-dangling", key, f"{ref} has no record"))
            elif owner != key:
                problems.append(Problem("index-dangling", key, f"{ref} is recorded for {owner}"))
    return allocated, sticky_of


def _node_index(
    records: list[KeyValue], entries: list[KeyValue], index_refs: dict[str, list[str]]
) -> list[Problem]:
    """The node index as the store shows it: one entry per record, under its node, a copy
    of it. An entry without its record whose copy's attachment index lists the address
    is the record lost (`record-lost`): the two witnesses of a held address agree."""
    problems = []
    remedy = "fix with 'ipward check --remove-orphans'"
    for kind, record_kv, entry, key in node_index_drift(records, entries):
        if kind == "missing":
            assert record_kv is not None
            problems.append(
                Problem("node-index-missing", record_kv.key, f"no entry {key} ({remedy})")
            )
        elif kind == "stale":
            problems.append(
                Problem("node-index-stale", key, f"its copy of the record differs ({remedy})")
            )
        elif record_kv is None:
            assert entry is not None
            _, pool, ip = keys.node_ip_parts(key)
            holder = AddressRecord.decode(entry.value).index_key
            if rec.pool_ip(pool, ip) in index_refs.get(holder, []):
                problems.append(
                    Problem(
                        "record-lost",
                        key,
                        f"no record {keys.ip_key(pool, ip)}, yet {holder} lists it"
                        " ('ipward check --remove-orphans' writes it back from this copy)",
                        RESTORE,
                        entry.mod_revision,
                    )
                )
            else:
                problems.append(Problem("node-index-dangling", key, f"no record ({remedy})"))
        else:
            node = AddressRecord.decode(record_kv.value).node or "no node"
            problems.append(
                Problem("node-index-dangling", key, f"the record is {node}'s ({remedy})")
            )
    return problems


def _leftovers(
    pools: dict[str, PoolSpec | None], by_prefix: dict[str, list[KeyValue]]
) -> list[Problem]:
    """Keys of a pool's own state without their pool (orphans), and those of an existing
    pool that its current ranges do not use while no retired layout explains them
    (stale: with retired layouts they await pruning)."""
    problems = []
    of_pool: dict[str, list[KeyValue]] = {}
    for prefix in keys.POOL_STATE_PREFIXES:
        for kv in by_prefix[prefix]:
            pool = keys.state_pool(kv.key)
            if pool is not None:
                of_pool.setdefault(pool, []).append(kv)
    remedy = "remove with 'ipward check --remove-orphans'"
    for pool, kvs in sorted(of_pool.items()):
        if pool not in pools:
            problems += [
                Problem("orphan", kv.key, f"pool {pool} does not exist ({remedy})") for kv in kvs
            ]
            continue
        spec = pools[pool]
        if spec is None or spec.retired:
            continue
        problems += [
            Problem("stale", kv.key, f"not used by pool {pool}'s current ranges ({remedy})")
            for kv in stale_state(spec, kvs)
        ]
    return problems


def _reservations(
    reservations: list[KeyValue],
    sticky_of: dict[str, tuple[str, bool]],
    index_refs: dict[str, list[str]],
) -> list[Problem]:
    """What the store shows of docs/design.md invariant 6: a reservation's addresses
    are recorded for it (bound to the sandbox it names, or detached when it names
    none), and no record claims a reservation that does not list it."""
    problems = []
    listed: set[str] = set()
    for kv in reservations:
        held = ReservationRecord.decode(kv.value)
        bound = held.attachment
        for ref in held.ips:
            listed.add(ref)
            owner = sticky_of.get(ref)
            if owner is None or owner[0] != kv.key:
                problems.append(Problem("sticky", kv.key, f"{ref} is not recorded for it"))
            elif owner[1] == bool(bound):
                state = "detached" if owner[1] else "bound"
                problems.append(Problem("sticky", kv.key, f"{ref} is {state}, the reservation not"))
            elif bound and ref not in index_refs.get(bound, []):
                problems.append(Problem("sticky", kv.key, f"{bound} does not list {ref}"))
    for ref, (key, _) in sorted(sticky_of.items()):
        if ref not in listed:
            problems.append(Problem("sticky", ref, f"recorded for {key}, which does not list it"))
    return problems


def _block_owners(by_prefix: dict[str, list[KeyValue]]) -> list[Problem]:
    """What the store shows of docs/design.md invariant 7: a block belongs to exactly one node."""
    problems = []
    owners: dict[str, str] = {}  # "<pool>/<cidr>" -> node, from the block records
    for kv in by_prefix[keys.BLOCKS]:
        owners[keys.block_ref(kv.key)] = BlockRecord.decode(kv.value).node
    listed: dict[str, list[str]] = {}
    for kv in by_prefix[keys.AFFINITY]:
        pool, node, cidr = keys.affinity_parts(kv.key)
        listed.setdefault(f"{pool}/{cidr}", []).append(node)
    for block, node in sorted(owners.items()):
        if listed.get(block) != [node]:
            problems.append(
                Problem(
                    "block-owner",
                    f"{keys.BLOCKS}{block}",
                    f"owned by {node}, listed for {listed.get(block, [])}",
                )
            )
    for block in sorted(set(listed) - set(owners)):
        problems.append(
            Problem(
                "block-owner",
                f"{keys.AFFINITY}{block}",
                f"listed for {listed[block]} but no such block",
            )
        )
    for kv in by_prefix[keys.RELEASED_BLOCKS]:
        pool, cidr = keys.released_block_parts(kv.key)
        if f"{pool}/{cidr}" in owners:
            problems.append(Problem("block-owner", kv.key, "released, yet still a block"))
    return problems


# -- repairing damage (`ipward check --remove-orphans`) ----------------------------------


def repair(ledger: Ledger, problems: Sequence[Problem]) -> dict[str, list[str]]:
    """Do each problem's `fix`, on the problems as `check` found them (and the caller
    showed them), each pinned to the revision it was read at: remove bad keys and
    values, then write back lost records from their node index copies (a lost record's
    key may have held a bad value), then free records no attachment's index lists.
    Anything changed since it was read is left alone (`check` again). The caller
    refuses first a store that reports damage (`store.refuse_damaged`): what such a
    store reads back is not to be trusted. Returns, by fix, the keys acted on."""
    store = ledger.store
    done: dict[str, list[str]] = {REMOVE: [], RESTORE: [], FREE: []}
    for p in problems:
        if (
            p.fix == REMOVE
            and store.txn([at_revision(p.key, p.revision)], [Delete(p.key)]).succeeded
        ):
            log.info("key removed", key=p.key, revision=p.revision, reason=f"{p.kind}: {p.detail}")
            done[REMOVE].append(p.key)
    for p in problems:
        if p.fix == RESTORE and _restore(store, p):
            done[RESTORE].append(p.key)
    for p in problems:
        if p.fix == FREE and _free_unlisted(ledger, p):
            done[FREE].append(p.key)
    return done


def _restore(store: Store, p: Problem) -> bool:
    """Write a lost record back from its node index copy: the copy as read, the record
    still absent, its attachment's index still listing it (both compared)."""
    _, pool, ip = keys.node_ip_parts(p.key)
    ref = rec.pool_ip(pool, ip)
    entry = store.get(p.key)
    if entry is None or entry.mod_revision != p.revision:
        return False
    try:
        copy = AddressRecord.decode(entry.value)
        index = store.get(copy.index_key)
        if index is None or ref not in AttachmentIndex.decode(index.value).refs:
            return False
    except _UNREADABLE:
        return False  # changed since `check` read it: check again
    record_key = keys.ip_key(pool, ip)
    compares = [
        at_revision(p.key, p.revision),
        absent(record_key),
        at_revision(index.key, index.mod_revision),
    ]
    if not store.txn(compares, [Put(record_key, entry.value)]).succeeded:
        return False
    log.info(
        "record restored",
        attachment=repr(copy.attachment),
        ip=ref,
        revision=p.revision,
        reason="lost, yet its attachment's index lists it; written back from its node index copy",
    )
    return True


def _free_unlisted(ledger: Ledger, p: Problem) -> bool:
    """Free a record its attachment's index does not list, through the ledger's freeing
    (queued, cooled down, logged): the record at the revision read, the index still
    as read now (still not listing it)."""
    pool, ip = keys.ip_parts(p.key)
    store = ledger.store
    kv = store.get(p.key)
    if kv is None or kv.mod_revision != p.revision:
        return False
    try:
        record = AddressRecord.decode(kv.value)
        index = store.get(record.index_key)
        if index is not None and rec.pool_ip(pool, ip) in AttachmentIndex.decode(index.value).refs:
            return False
    except _UNREADABLE:
        return False
    if record.sticky:
        return False
    fence = [at_revision(record.index_key, index.mod_revision if index else 0)]
    reason = (
        "ipward check --remove-orphans: its attachment's index does not list it (a record"
        " and its index are written in one transaction: damage)"
    )
    try:
        ledger.free_address(pool, ip, p.revision, reason, fence)
    except OwnerChanged:
        return False
    return True
