"""Freeing addresses (docs/design.md 5.2): an attachment's at DEL, one record by
compare-and-delete (the CLI's `ipward release`, garbage collection), and the CNI GC
verb's side (`collect_network`). A freed address cools down in the free queue of the
node owning its block; a sticky one is detached instead (its reservation keeps it).
A record now owned by someone else is never touched (docs/design.md invariant 5).
"""

from __future__ import annotations

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.errors import OwnerChanged, TryAgainLater
from ipward.core.policy import ADD_GRACE
from ipward.core.records import AddressRecord, AttachmentIndex, ReservationRecord
from ipward.ipam import free_queue
from ipward.ipam.allocation import record_writes
from ipward.ipam.cache import (
    MAX_ATTEMPTS,
    StoreCache,
    backoff,
    last_write_per_key,
    unique_compares,
)
from ipward.store.base import Delete, KeyValue, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.records import Attachment
    from ipward.store.base import Compare


def free(cache: StoreCache, attachment: Attachment, reason: str) -> list[str]:
    """Free the attachment's addresses (detach sticky ones); an unknown attachment is
    not an error. Returns the addresses freed or detached; each is logged with
    `reason`."""
    for attempt in range(MAX_ATTEMPTS):
        index_kv = cache.get(attachment.key_on(cache.node))
        if index_kv is None:
            return []
        compares, ops, freed, detached = free_plan(cache, index_kv, attachment)
        if cache.txn(compares, ops):
            log_free(attachment, freed, detached, reason)
            return freed + detached
        backoff(attempt)
    raise TryAgainLater(f"{attachment}: too much contention, nothing freed")


def free_plan(
    cache: StoreCache, index_kv: KeyValue, attachment: Attachment
) -> tuple[list[Compare], list[Put | Delete], list[str], list[str]]:
    """The transaction that frees an attachment: delete its index; free each of its
    records, or detach it when it is sticky. (compares, ops, freed, detached)."""
    compares: list[Compare] = [at_revision(index_kv.key, index_kv.mod_revision)]
    ops: list[Put | Delete] = [Delete(index_kv.key)]
    freed: list[str] = []
    detached: list[str] = []
    now = cache.clock()
    for ref in AttachmentIndex.decode(index_kv.value).refs:
        pool_name, ip = rec.split_pool_ip(ref)
        key = keys.ip_key(pool_name, ip)
        record_kv = cache.get(key)
        # Every decision below is pinned by a compare, so it holds at commit.
        compares.append(at_revision(key, record_kv.mod_revision if record_kv else 0))
        if record_kv is None:
            continue  # index out of step with records: drop the index entry only
        record = AddressRecord.decode(record_kv.value)
        if record.attachment != attachment:
            continue  # the address belongs to someone else now: never touch it
        if record.sticky:
            # Detach: the reservation keeps the address for the identity's next
            # sandbox (docs/design.md 2); retiring it is the controller's.
            ops += record_writes(pool_name, ip, record.detached(now))
            sticky_ops, sticky_compares = detach_reservation(
                cache, record.sticky, index_kv.key, now
            )
            ops += sticky_ops
            compares += sticky_compares
            detached.append(ref)
            continue
        record_ops, block_compare = free_ops(cache, pool_name, ip, record, now)
        ops += record_ops
        compares += block_compare
        freed.append(ref)
    return unique_compares(compares), last_write_per_key(ops), freed, detached


def log_free(
    attachment: Attachment, freed: list[str], detached: list[str], reason: str, **more: object
) -> None:
    if freed:
        log.info("freed", attachment=repr(attachment), ips=freed, reason=reason, **more)
    if detached:
        log.info("detached", attachment=repr(attachment), ips=detached, reason=reason, **more)


def detach_reservation(
    cache: StoreCache, key: str, index: str, now: float
) -> tuple[list[Put | Delete], list[Compare]]:
    """The reservation's side of a detach: it no longer names a sandbox (only when it
    still names this one, by its index key `index`: a takeover may have moved it on)."""
    kv = cache.get(key, fresh=True)
    if kv is None:
        return [], [absent(key)]
    held = ReservationRecord.decode(kv.value)
    compares = [at_revision(key, kv.mod_revision)]
    if held.attachment != index:
        return [], compares
    return [Put(key, held.detached(now).encode())], compares


def free_ops(
    cache: StoreCache, pool_name: str, ip: str, record: AddressRecord, now: float
) -> tuple[list[Put | Delete], list[Compare]]:
    """Delete a record with its node index entry (the write side: `record_writes`), and
    queue the address for its cooldown (`free_queue.enqueue`)."""
    ops: list[Put | Delete] = [Delete(keys.ip_key(pool_name, ip))]
    if record.node:
        ops.append(Delete(keys.node_ip_key(record.node, pool_name, ip)))
    queue_ops, compares = free_queue.enqueue(cache, pool_name, ip, record, now)
    return ops + queue_ops, compares


def free_address(
    cache: StoreCache,
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
        record_kv = cache.get(key, fresh=True)
        if record_kv is None or record_kv.mod_revision != expected_mod_revision:
            raise OwnerChanged(
                f"{pool}/{ip} changed since it was read (revision {expected_mod_revision});"
                " look again and retry"
            )
        record = AddressRecord.decode(record_kv.value)
        attachment = record.attachment
        index_kv = cache.get(record.index_key, fresh=True)
        if record.sticky:
            # A sticky address is detached with its whole attachment, never freed
            # here: retiring the reservation is `free_sticky`'s.
            if index_kv is None or record.is_detached:
                raise OwnerChanged(f"{pool}/{ip} is reserved by {record.sticky}, detached")
            compares, ops, freed, detached = free_plan(cache, index_kv, attachment)
        else:
            ops, compares = free_ops(cache, pool, ip, record, cache.clock())
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
        if cache.txn(compares, ops):
            log_free(attachment, freed, detached, reason, revision=expected_mod_revision)
            return record
        if not all(c.holds(cache.get(c.key, fresh=True)) for c in fence):
            raise OwnerChanged(f"{pool}/{ip} not freed: its fence no longer holds")
        backoff(attempt)
    raise TryAgainLater(f"{pool}/{ip}: too much contention, nothing freed")


def collect_network(
    cache: StoreCache, network: str, keep: set[tuple[str, str]], grace: float = ADD_GRACE
) -> list[str]:
    """CNI GC, with garbage collection's rules (ipward.gc) and the runtime's list as
    the evidence: free each address of `network` on this node whose attachment
    (container, ifname) the runtime did not list as valid, and whose ADD is older
    than `grace` (one in flight may not be listed yet), by compare-and-delete on the
    revision read. Only this node's (read through its index): the runtime lists its
    own attachments, so another node's are never in its list. Returns the addresses
    freed."""
    kvs, _ = cache.range(keys.node_ips_prefix(cache.node))
    now = cache.clock()
    freed = []
    for kv in kvs:
        _, pool, ip = keys.node_ip_parts(kv.key)
        try:
            copy = AddressRecord.decode(kv.value)
        except ValueError:
            continue  # 'ipward check' reports it
        if copy.network != network or (copy.container, copy.ifname) in keep:
            continue
        record_kv = cache.get(keys.ip_key(pool, ip), fresh=True)
        if record_kv is None:
            continue
        record = AddressRecord.decode(record_kv.value)
        age = now - (record.created_at if record.created_at is not None else now)
        if (
            record.is_detached
            or record.node != cache.node
            or record.attachment != copy.attachment
            or age < grace
        ):
            continue
        reason = (
            f"CNI GC: not in cni.dev/valid-attachments, {age:.0f}s after its ADD (grace {grace:g}s)"
        )
        try:
            free_address(cache, pool, ip, record_kv.mod_revision, reason)
        except OwnerChanged:
            continue  # freed or replaced meanwhile: not ours to touch
        freed.append(rec.pool_ip(pool, ip))
    return freed
