"""A pool's life in the store: created, changed, pruned, deleted; and the keys a pool
leaves behind. Every step is a transaction pinned by compares; the CLI only calls these.

No overlap: no two pools ever cover a common address (`pool.overlap`, retired layouts
counted). Every transaction that stores a pool or adds addresses to one (`pool create`,
the first ADD of an inline pool, an ADD whose network config changed the ranges) reads
`meta/poolcoverage` first, then every pool spec, tests the overlap, and commits only if
`meta/poolcoverage` is unchanged, rewriting it (`coverage_guard`). Two such writers cannot
both pass the test on the same view; a plain ADD on an unchanged pool never touches it.

Change (`change_pool`, an IPPool object's spec changed: docs/design.md 5.16): the new
declaration is stored the way a network config's changed ranges are (`PoolSpec.succeed`):
other fields in place; another layout as a new version, the old one retired, after the
overlap test.

Delete, safe against ADDs in flight and resumable:
  1. the spec is marked `deleting` by CAS (`mark_deleting`): every allocation compares
     the spec's revision, so one in flight fails and, reading again, is refused (an
     inline ADD too: it never resurrects or overwrites a pool being deleted);
  2. records are read at a revision after the mark: any found, `delete_pool` (`ipward
     pool delete`) puts the spec back to active (CAS on the mark) and is refused, naming
     how many; `delete_when_free` (an IPPool object's finalizer) leaves it marked and
     returns them, to be tried again once they are freed;
  3. the pool's keys go, prefix by prefix (blocks and affinity first, so no hand-back
     handshake step can write again), in bounded transactions each pinned to the mark
     (`remove_marked`);
  4. the spec last, by CAS on the mark.
A crash anywhere leaves the spec `deleting` (`ipward check` says so); running either
again finishes it.

A `fence` (the leading controller's compares, docs/design.md 5.8) rides in every
transaction of a step that takes one.

Prune (`prune`): the state a pool keeps that its current layout does not use (blocks,
affinity, released-block entries, fill records, cursors, free entries of addresses it no
longer hands out), and retired layouts that no record holds an address of any more.
Nothing new is ever allocated outside the current layout, so a retired layout's record
set only shrinks: a scan at a revision after the spec read that finds none proves it
empty for good, and the spec is rewritten by CAS on that revision. Run by the
controller's pass and by `ipward check --remove-orphans`.

On the plugin's path only through `coverage_guard` (imported when an inline pool is
stored or changed): standard library only.
"""

from __future__ import annotations

from ipward.core import keys, log, testpoints
from ipward.core import records as rec
from ipward.core.addr import parse_ip
from ipward.core.errors import (
    InvalidConfig,
    IpwardError,
    PoolExists,
    PoolsOverlap,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.pool import DELETING, PoolSpec, overlap
from ipward.core.records import AddressRecord, FillRecord
from ipward.store.base import Delete, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.store.base import Compare, KeyValue, Store

MAX_ATTEMPTS = 20
CHUNK = 64  # keys deleted per transaction (etcd caps a transaction at 128 operations)
CLI_DELETE = "ipward pool delete"
OBJECT_DELETED = "its IPPool object is being deleted"


# -- overlap --------------------------------------------------------------------------


def coverage_guard(
    get: Callable[[str], KeyValue | None],
    range_: Callable[[str], tuple[list[KeyValue], int]],
    spec: PoolSpec,
) -> tuple[list[Compare], list[Put | Delete]]:
    """The compares and writes that store `spec` (new, or with a new layout) only if no
    other pool covers any of its addresses: raises PoolsOverlap naming the first other
    pool it would overlap. `meta/poolcoverage` is read before the specs, so any change of
    coverage committed after that read fails the returned compare."""
    coverage_kv = get(keys.POOL_COVERAGE_KEY)
    for kv in range_(keys.POOLS)[0]:
        name = keys.pool_name(kv.key)
        if name == spec.name:
            continue
        try:
            other = PoolSpec.decode(kv.value)
        except (IpwardError, ValueError) as e:
            raise InvalidConfig(
                f"pool {name}'s stored spec is unreadable ({e}), so pool {spec.name} cannot"
                " be checked against it; see 'ipward check'"
            ) from None
        why = overlap(spec, other)
        if why is not None:
            raise PoolsOverlap(why, other.name)
    generation = rec.decode(coverage_kv.value).get("generation", 0) if coverage_kv else 0
    compares = [at_revision(keys.POOL_COVERAGE_KEY, coverage_kv.mod_revision if coverage_kv else 0)]
    written = rec.encode({"generation": generation + 1, "pool": spec.name})
    return compares, [Put(keys.POOL_COVERAGE_KEY, written)]


def create_pool(store: Store, spec: PoolSpec, fence: Sequence[Compare] = ()) -> None:
    """Store a new pool (`ipward pool create`, an IPPool object): refused if the name
    exists (PoolExists) or if any other pool covers one of its addresses (PoolsOverlap),
    decided in the transaction that stores it."""
    key = keys.pool_key(spec.name)
    for _ in range(MAX_ATTEMPTS):
        existing = store.get(key)
        if existing is not None:
            state = rec.decode(existing.value).get("state")
            raise PoolExists(
                f"pool {spec.name} already exists"
                + (" and is being deleted ('ipward pool delete' finishes it)" if state else "")
            )
        compares, ops = coverage_guard(store.get, store.range, spec)
        testpoints.pause("pool-create")
        done = store.txn([absent(key), *compares, *fence], [Put(key, spec.encode()), *ops])
        if done.succeeded:
            log.info(
                "pool created",
                pool=spec.name,
                source=spec.source,
                capacity=spec.attachments_capacity(),
            )
            return
    raise TryAgainLater(f"pool {spec.name}: pools kept changing while it was created; try again")


def check_overlap(store: Store, spec: PoolSpec) -> None:
    """Raise PoolsOverlap when another pool covers an address of `spec`, as the store
    has them now (a test ahead of a write; the write's own guard decides)."""
    coverage_guard(store.get, store.range, spec)


def change_pool(store: Store, spec: PoolSpec, fence: Sequence[Compare] = ()) -> bool:
    """Store `spec` as the new declaration of its existing pool (see the module's
    docstring), pinned to the spec read. False when the pool already holds it (nothing
    written). Raises UnknownPool when there is none, InvalidConfig when it is being
    deleted, PoolsOverlap when a new layout would overlap another pool."""
    key = keys.pool_key(spec.name)
    for _ in range(MAX_ATTEMPTS):
        kv = store.get(key)
        if kv is None:
            raise UnknownPool(f"pool {spec.name} does not exist")
        stored = PoolSpec.decode(kv.value)
        if stored.deleting:
            raise InvalidConfig(f"pool {spec.name} is being deleted; it cannot change")
        new_layout = spec.succeed(stored)
        if not new_layout and spec.declaration() == stored.declaration():
            return False
        compares: list[Compare] = [at_revision(key, kv.mod_revision), *fence]
        ops: list[Put | Delete] = [Put(key, spec.encode())]
        if new_layout:
            guard, coverage = coverage_guard(store.get, store.range, spec)
            compares += guard
            ops += coverage
        if store.txn(compares, ops).succeeded:
            log.info(
                "pool changed",
                pool=spec.name,
                source=spec.source,
                version=spec.version,
                retired=len(spec.retired),
            )
            return True
    raise TryAgainLater(f"pool {spec.name}: pools kept changing while it was changed; try again")


# -- delete ---------------------------------------------------------------------------


def mark_deleting(
    store: Store, name: str, reason: str, fence: Sequence[Compare] = ()
) -> tuple[dict, int] | None:
    """Step 1: the spec marked `deleting` (kept if it is already). Returns the spec as it
    was and the mark's revision, every later step's pin; None when there is no pool of
    that name."""
    key = keys.pool_key(name)
    kv = store.get(key)
    if kv is None:
        return None
    spec = rec.decode(kv.value)
    if spec.get("state") == DELETING:
        return spec, kv.mod_revision
    done = store.txn(
        [at_revision(key, kv.mod_revision), *fence],
        [Put(key, rec.encode({**spec, "state": DELETING}))],
    )
    if not done.succeeded:
        raise TryAgainLater(f"pool {name} changed while being deleted; try again")
    log.info("pool deleting", pool=name, reason=reason)
    return spec, done.revision


def remove_marked(
    store: Store, name: str, mark: int, reason: str, fence: Sequence[Compare] = ()
) -> int:
    """Steps 3 and 4, once no record holds an address of the pool: its keys, then its
    spec, each transaction pinned to the mark. Returns how many keys went besides the
    spec."""
    testpoints.pause("pool-delete")
    key = keys.pool_key(name)
    pinned = [at_revision(key, mark), *fence]
    removed = 0
    for prefix in keys.POOL_STATE_PREFIXES:
        while True:
            kvs, _ = store.range(keys.state_prefix(prefix, name), CHUNK)
            if not kvs:
                break
            if not store.txn(pinned, [Delete(k.key) for k in kvs]).succeeded:
                raise TryAgainLater(f"pool {name} changed while being deleted; run it again")
            removed += len(kvs)
    if not store.txn(pinned, [Delete(key)]).succeeded:
        raise TryAgainLater(f"pool {name} changed while being deleted; run it again")
    log.info("pool deleted", pool=name, keys=removed, reason=reason)
    return removed


def delete_pool(store: Store, name: str) -> int:
    """`ipward pool delete`: delete a pool with no allocations (see the module's
    docstring). Returns how many of its other keys went with it. Refuses
    (InvalidConfig) while records exist, putting the pool back."""
    marked = mark_deleting(store, name, CLI_DELETE)
    if marked is None:
        raise UnknownPool(f"pool {name} does not exist")
    spec, mark = marked
    records, _ = store.range(keys.ips_prefix(name))  # at a revision after the mark
    if records:
        key = keys.pool_key(name)
        active = {k: v for k, v in spec.items() if k != "state"}
        back = store.txn([at_revision(key, mark)], [Put(key, rec.encode(active))])
        raise InvalidConfig(
            f"pool {name} still has {len(records)} allocation"
            f"{'' if len(records) == 1 else 's'}; release them first"
            f" ('ipward alloc list --pool {name}')"
            + ("" if back.succeeded else "; it stays marked deleting (the spec changed)")
        )
    return remove_marked(store, name, mark, CLI_DELETE)


def delete_when_free(store: Store, name: str, fence: Sequence[Compare] = ()) -> list[KeyValue]:
    """An IPPool object's finalizer (docs/design.md 5.16): the pool marked deleting and
    kept so (ADDs get 103) while records hold its addresses, which are returned; once
    none does, its keys removed. [] when it is gone (or was not there)."""
    marked = mark_deleting(store, name, OBJECT_DELETED, fence)
    if marked is None:
        return []
    records, _ = store.range(keys.ips_prefix(name))  # at a revision after the mark
    if records:
        return records
    remove_marked(store, name, marked[1], OBJECT_DELETED, fence)
    return []


# -- what a pool leaves behind ----------------------------------------------------------


def stale_state(spec: PoolSpec, kvs: Sequence[KeyValue]) -> list[KeyValue]:
    """The pool's own keys (from `kvs`) that its current layout does not use: blocks,
    affinity and released-block entries not of its current blocks; fill records naming
    such a block or a family it has no more; cursors of such a family; free and queue
    entries of addresses it does not hand out now. All left by a change of its ranges;
    none is ever read as a decision (an allocation only uses current blocks and drops
    a queue entry outside the pool), so deleting them (pinned to the spec) is safe."""
    families = {rs.family for rs in spec.range_sets}

    def current_block(cidr: str) -> bool:
        return spec.block_by_cidr(cidr) is not None

    def handed_out(ip: str) -> bool:
        family, value = parse_ip(ip)
        return spec.usable(family, value)

    stale = []
    for kv in kvs:
        kind = keys.prefix_of(kv.key)
        if kind in (keys.BLOCKS, keys.AFFINITY, keys.RELEASED_BLOCKS):
            keep = current_block(keys.cidr_of(kv.key))
        elif kind == keys.FILL:
            family = keys.fill_parts(kv.key)[1]
            keep = family in {str(f) for f in families} and current_block(
                FillRecord.decode(kv.value).block
            )
        elif kind == keys.BLOCK_CURSOR:
            keep = keys.last(kv.key) in {str(f) for f in families}
        elif kind in (keys.FREE, keys.FREE_QUEUES):
            keep = handed_out(keys.last(kv.key))
        else:
            keep = True
        if not keep:
            stale.append(kv)
    return stale


def _pool_state(store: Store, name: str) -> list[KeyValue]:
    return [
        kv
        for prefix in keys.POOL_STATE_PREFIXES
        for kv in store.range(keys.state_prefix(prefix, name))[0]
    ]


def _delete_pinned(store: Store, pinned: Sequence[Compare], kvs: Sequence[KeyValue]) -> bool:
    """Compare-and-delete each key at its revision read, in bounded transactions that
    also carry `pinned`. False as soon as one does not commit."""
    for start in range(0, len(kvs), CHUNK // 2):
        chunk = kvs[start : start + CHUNK // 2]
        compares = [*pinned, *(at_revision(kv.key, kv.mod_revision) for kv in chunk)]
        if not store.txn(compares, [Delete(kv.key) for kv in chunk]).succeeded:
            return False
    return True


def prune(store: Store, name: str, fence: Sequence[Compare] = ()) -> tuple[int, int]:
    """Remove the pool's stale state, then the retired layouts no record holds an
    address of (see the module's docstring). Returns (keys removed, layouts pruned);
    stops early, harmlessly, when the spec changes meanwhile. `fence`: the controller's
    leadership compare."""
    key = keys.pool_key(name)
    kv = store.get(key)
    if kv is None:
        return 0, 0
    spec = PoolSpec.decode(kv.value)
    if spec.deleting:
        return 0, 0
    pinned = [*fence, at_revision(key, kv.mod_revision)]
    stale = stale_state(spec, _pool_state(store, name))
    if stale and not _delete_pinned(store, pinned, stale):
        return 0, 0
    if stale:
        log.info("pool state pruned", pool=name, keys=len(stale), reason="outside its ranges")
    if not spec.retired:
        return len(stale), 0
    needed = set()
    for kv in store.range(keys.ips_prefix(name))[0]:  # at a revision after the spec read
        family, value = parse_ip(keys.last(kv.key))
        version = _layout_of(kv.value)
        for i, layout in enumerate(spec.retired):
            # the layout its record names answers for it (its prefix, its gateway);
            # a record that names none is held by the first layout it is usable in
            if layout.version == version or (
                version is None and not spec.usable(family, value) and layout.usable(family, value)
            ):
                needed.add(i)
    kept = [layout for i, layout in enumerate(spec.retired) if i in needed]
    if len(kept) == len(spec.retired):
        return len(stale), 0
    pruned = len(spec.retired) - len(kept)
    spec.retired = kept
    if not store.txn(pinned, [Put(key, spec.encode())]).succeeded:
        return len(stale), 0
    log.info(
        "pool layouts pruned",
        pool=name,
        layouts=pruned,
        reason="no record holds an address of an earlier version any more",
    )
    return len(stale), pruned


def _layout_of(raw: bytes) -> int | None:
    """The layout version an allocation record names (None: none, or not a record,
    which `ipward check` reports)."""
    try:
        return AddressRecord.decode(raw).layout
    except ValueError:
        return None


def remove_orphans(store: Store) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """`ipward check --remove-orphans`: delete every key of a pool's own state whose
    pool does not exist (compare-and-delete: the key at its revision read and the pool
    still absent), then prune every pool. Never an allocation record (`ipward
    release`), never a key ipward does not know (it may be another program's).
    Returns the orphan keys removed and, per pool, what `prune` did."""
    pools = {keys.pool_name(kv.key) for kv in store.range(keys.POOLS)[0]}
    removed = []
    for prefix in keys.POOL_STATE_PREFIXES:
        for kv in store.range(prefix)[0]:
            pool = keys.state_pool(kv.key)
            if pool is None or pool in pools:
                continue
            compares = [absent(keys.pool_key(pool)), at_revision(kv.key, kv.mod_revision)]
            if store.txn(compares, [Delete(kv.key)]).succeeded:
                removed.append(kv.key)
    if removed:
        log.info("orphan keys removed", keys=len(removed), reason="their pool does not exist")
    pruned = {}
    for name in sorted(pools):
        try:
            done = prune(store, name)
        except (IpwardError, ValueError):
            continue  # an unreadable spec: `ipward check` reports it
        if any(done):
            pruned[name] = done
    return removed, pruned


__all__ = [
    "change_pool",
    "check_overlap",
    "coverage_guard",
    "create_pool",
    "delete_pool",
    "delete_when_free",
    "mark_deleting",
    "prune",
    "remove_marked",
    "remove_orphans",
    "stale_state",
]
