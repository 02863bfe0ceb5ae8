"""`ipward check`: read the whole ledger and report every broken invariant
(docs/design.md 4) that can be seen from the store alone.

  duplicate-address    one address recorded twice on one network (overlapping pools),
                       or an attachment holding two addresses of one family in a pool
  index-missing        a record whose attachment index does not list it
  index-dangling       an index entry with no record, or a record owned by another
  node-index-missing   a record without its node's entry (`nodeips/<node>/<pool>/<ip>`)
  node-index-stale     a node's entry whose copy of the record differs from it
  node-index-dangling  a node's entry with no record, or whose record is another node's
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

Orphans and stale keys are removed by `ipward check --remove-orphans`
(`ipam.pools.remove_orphans`), which also puts the node index in step with the records
(`store.schema.repair_node_index`: the index is derived from them); the rest need a
person. Read-only, and at one revision:
the whole store is read with one `range`.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.addr import parse_ip
from ipward.core.errors import IpwardError
from ipward.core.pool import PoolSpec
from ipward.core.records import (
    AddressRecord,
    AttachmentIndex,
    BlockRecord,
    FreeRecord,
    ReservationRecord,
)
from ipward.ipam.pools import stale_state
from ipward.store.schema import node_index_drift

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.store.base import KeyValue, Store


class Problem:
    __slots__ = ("detail", "key", "kind")

    def __init__(self, kind: str, key: str, detail: str) -> None:
        self.kind = kind
        self.key = key
        self.detail = detail

    def to_dict(self) -> dict:
        return {"kind": self.kind, "key": self.key, "detail": self.detail}

    def __repr__(self) -> str:
        return f"{self.kind}: {self.key}: {self.detail}"


def check(store: Store) -> tuple[list[Problem], dict]:
    """All problems found, and counts of what was read."""
    problems: list[Problem] = []
    everything, revision = store.range("")
    by_prefix: dict[str, list[KeyValue]] = {prefix: [] for prefix in keys.PREFIXES}
    for kv in everything:
        prefix = keys.prefix_of(kv.key)
        if prefix in by_prefix and (prefix != keys.META or kv.key in keys.META_KEYS):
            by_prefix[prefix].append(kv)
        else:
            problems.append(Problem("unknown-key", kv.key, "not a key ipward writes"))
    pools = _pools(by_prefix[keys.POOLS], problems)
    records = by_prefix[keys.ADDRESSES]
    index_refs = {
        kv.key: AttachmentIndex.decode(kv.value).refs for kv in by_prefix[keys.ATTACHMENTS]
    }
    allocated, sticky_of = _records(records, pools, index_refs, problems)
    problems += _node_index(records, by_prefix[keys.NODE_ADDRESSES])
    frees = by_prefix[keys.FREE]
    _free_queues(frees, by_prefix[keys.FREE_QUEUES], allocated, problems)
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
        allocated[ref] = attachment.key
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
        holder = record.sticky if record.is_detached and record.sticky else attachment.key
        twin = families.setdefault((holder, pool_name, family), kv.key)
        if twin != kv.key:
            problems.append(
                Problem("duplicate-address", kv.key, f"{holder} also holds {twin} (same family)")
            )
        if record.is_detached:
            continue  # held by its reservation: no sandbox, no index (checked below)
        if ref not in index_refs.get(attachment.key, []):
            problems.append(
                Problem("index-missing", kv.key, f"index {attachment.key} does not list it")
            )
    for key, refs in index_refs.items():
        for ref in refs:
            owner = allocated.get(ref)
            if owner is None:
                problems.append(Problem("index-dangling", key, f"{ref} has no record"))
            elif owner != key:
                problems.append(Problem("index-dangling", key, f"{ref} is recorded for {owner}"))
    return allocated, sticky_of


def _free_queues(
    frees: list[KeyValue],
    queue: list[KeyValue],
    allocated: dict[str, str],
    problems: list[Problem],
) -> None:
    """Free records against the allocations and their queue entries."""
    queued = {kv.key for kv in queue}
    referenced = set()
    for kv in frees:
        pool_name, ip = keys.ip_parts(kv.key)
        ref = rec.pool_ip(pool_name, ip)
        if ref in allocated:
            problems.append(Problem("free-and-allocated", kv.key, f"{ref} is also allocated"))
        queue_key = FreeRecord.decode(kv.value).queue
        referenced.add(queue_key)
        if queue_key not in queued:
            problems.append(Problem("free-queue", kv.key, f"queue entry {queue_key} missing"))
    for key in sorted(queued - referenced):
        problems.append(Problem("free-queue", key, "queue entry without a free record"))


def _node_index(records: list[KeyValue], entries: list[KeyValue]) -> list[Problem]:
    """The node index as the store shows it: one entry per record, under its node, a copy
    of it."""
    problems = []
    remedy = "fix with 'ipward check --remove-orphans'"
    for kind, record_kv, _, key in node_index_drift(records, entries):
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
