"""Sticky reservations (docs/design.md 5.6): an identity's first ADD makes its
reservation in the allocating transaction, a new sandbox of the identity takes the
reserved addresses over by one CAS, and retirement (`free_sticky`) frees a detached
reservation with its records. The detach itself rides in a DEL (`freeing.free_plan`).
"""

from __future__ import annotations

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.errors import AddressTaken, InvalidConfig, OwnerChanged, TryAgainLater
from ipward.core.records import AddressRecord, ReservationRecord
from ipward.ipam.allocating import StickyExists, allocate_one
from ipward.ipam.allocation import Pick, allocations, held_allocations, writes
from ipward.ipam.cache import MAX_ATTEMPTS, StoreCache, backoff
from ipward.ipam.freeing import free_ops
from ipward.store.base import Delete, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.pool import PoolSpec
    from ipward.core.records import Attachment, PodInfo, Sticky
    from ipward.ipam.allocation import Allocation
    from ipward.store.base import Compare, KeyValue, Put


def allocate_sticky(
    cache: StoreCache,
    pools: list[PoolSpec],
    attachment: Attachment,
    pod: PodInfo,
    requested: Sequence[str],
    sticky: Sticky,
) -> list[Allocation]:
    """The identity's reserved addresses, taken over, or new ones with a new
    reservation; the attachment's own when it has them already."""
    for attempt in range(MAX_ATTEMPTS):
        existing = cache.get(attachment.key_on(cache.node), fresh=True)
        if existing is not None:
            return held_allocations(cache, existing, pools)
        reservation = cache.get(sticky.key, fresh=True)
        if reservation is None:
            try:
                return allocate_one(cache, pools, attachment, pod, requested, sticky)
            except StickyExists:
                continue
        taken = take_over(cache, reservation, attachment, pod, sticky, requested)
        if taken is not None:
            return taken
        backoff(attempt)
    raise TryAgainLater(f"{attachment}: too much contention on {sticky.key}")


def take_over(
    cache: StoreCache,
    reservation: KeyValue,
    attachment: Attachment,
    pod: PodInfo,
    sticky: Sticky,
    requested: Sequence[str],
) -> list[Allocation] | None:
    """docs/design.md 5.6: the new sandbox of the identity takes the reserved
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
    if old and old_uid != pod.uid and sticky.may_take is not None and not sticky.may_take(old_uid):
        raise TryAgainLater(
            f"{sticky.key} is bound to {old} of pod UID {old_uid}, which may still be"
            " live; the address moves once that pod is gone"
        )
    if old and old != attachment.key_on(cache.node):
        _wait_for_teardown(cache, sticky, old, held.node)
    # Its records, each as read: rewritten for this sandbox under the layout it was
    # given (moving its node index entry when the node changed).
    picks = []
    for ref in refs:
        pool_name, ip = rec.split_pool_ip(ref)
        key = keys.ip_key(pool_name, ip)
        kv = cache.get(key, fresh=True)
        record = AddressRecord.decode(kv.value) if kv is not None else None
        if kv is None or record is None or record.sticky != sticky.key:
            raise InvalidConfig(
                f"{sticky.key} lists {ref}, whose record is not its own; see 'ipward check'"
            )
        mine = Pick(pool_name, record.layout, ip, record.block)
        mine.holder = record.node
        mine.compares.append(at_revision(key, kv.mod_revision))
        picks.append(mine)
    compares, ops = writes(cache.node, attachment, pod, picks, cache.clock(), sticky, reservation)
    if old and old != attachment.key_on(cache.node):
        old_kv = cache.get(old, fresh=True)
        compares.append(at_revision(old, old_kv.mod_revision if old_kv else 0))
        if old_kv is not None:
            ops.append(Delete(old))
    if not cache.txn(compares, ops):
        return None
    given = allocations(cache, refs, layouts={p.ref: p.layout for p in picks})
    log.info(
        "sticky address taken over",
        attachment=repr(attachment),
        ips=refs,
        sticky=sticky.key,
        previous=old or "(detached)",
    )
    return given


def _wait_for_teardown(cache: StoreCache, sticky: Sticky, old: str, old_node: str) -> None:
    """A reservation still bound to another sandbox moves only once that sandbox is torn
    down, so two network namespaces never hold the address at once (a pod force-deleted:
    its successor's ADD comes before the old sandbox's DEL). On this node the runtime
    says (it lists the old sandbox until its teardown is over); on another, that node's
    agent detaches it (its DEL, or its reconciliation once its runtime lists the sandbox
    no more) unless the node is gone (its registration expired). TryAgainLater until
    then: the runtime retries the ADD."""
    _, _, container, _ = keys.attach_parts(old)
    if old_node == cache.node:
        if sticky.sandbox_listed is not None and sticky.sandbox_listed(container):
            raise TryAgainLater(
                f"{sticky.key} is bound to {old}, whose sandbox this node's runtime still"
                " lists; the address moves once its teardown is over"
            )
    elif cache.get(keys.node_key(old_node), fresh=True) is not None:
        raise TryAgainLater(
            f"{sticky.key} is bound to {old} on node {old_node}, whose agent runs; the"
            " address moves once that sandbox's DEL detaches it (or the node is gone)"
        )


def free_sticky(
    cache: StoreCache,
    key: str,
    expected_mod_revision: int,
    reason: str,
    fence: Sequence[Compare] = (),
) -> list[str]:
    """Retire a detached reservation: delete it and its records, compared at the
    revision the caller judged, and queue the addresses (cooldown). Refuses
    (OwnerChanged) when anything moved or a sandbox holds it. Returns the addresses."""
    kv = cache.get(key, fresh=True)
    if kv is None or kv.mod_revision != expected_mod_revision:
        raise OwnerChanged(f"{key} changed since it was read; look again")
    held = ReservationRecord.decode(kv.value)
    if held.bound:
        raise OwnerChanged(f"{key} is bound to {held.attachment}: its pod holds it")
    now = cache.clock()
    compares: list[Compare] = [*fence, at_revision(key, kv.mod_revision)]
    ops: list[Put | Delete] = [Delete(key)]
    for ref in held.ips:
        pool_name, ip = rec.split_pool_ip(ref)
        record_kv = cache.get(keys.ip_key(pool_name, ip), fresh=True)
        if record_kv is None:
            compares.append(absent(keys.ip_key(pool_name, ip)))
            continue
        record = AddressRecord.decode(record_kv.value)
        if record.sticky != key or not record.is_detached:
            raise OwnerChanged(f"{ref} of {key} is in use; look again")
        record_ops, block_compares = free_ops(cache, pool_name, ip, record, now)
        compares += [at_revision(record_kv.key, record_kv.mod_revision), *block_compares]
        ops += record_ops
    if not cache.txn(compares, ops):
        raise OwnerChanged(f"{key} changed while being freed; look again")
    log.info("freed", sticky=key, ips=held.ips, reason=reason)
    return list(held.ips)
