"""Freeing addresses (docs/design.md 5.2): an attachment's at DEL, one record by
compare-and-delete (the CLI's `ipward release`, garbage collection), and the CNI GC
verb's side (`collect_network`). A freed address cools down in the free queue of the
node owning its block; a sticky one is detached instead (its reservation keeps it).
A record now owned by someone else is never touched (docs/design.md invariant 5).
"""

from __future__ import annotations

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.addr import parse_ip
from ipward.core.errors import IpwardError, OwnerChanged, TryAgainLater
from ipward.core.policy import ADD_GRACE
from ipward.core.records import (
    AddressRecord,
    AttachmentIndex,
    BlockRecord,
    FreeRecord,
    ReservationRecord,
)
from ipward.ipam.reads import (
    MAX_ATTEMPTS,
    Reads,
    backoff,
    last_write_per_key,
    record_writes,
    unique_compares,
)
from ipward.store.base import Delete, KeyValue, Put, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.records import Attachment
    from ipward.store.base import Compare


def free(reads: Reads, attachment: Attachment, reason: str) -> list[str]:
    """Free the attachment's addresses (detach sticky ones); an unknown attachment is
    not an error. Returns the addresses freed or detached; each is logged with
    `reason`."""
    for attempt in range(MAX_ATTEMPTS):
        index_kv = reads.get(attachment.key)
        if index_kv is None:
            return []
        compares, ops, freed, detached = free_plan(reads, index_kv, attachment)
        if reads.txn(compares, ops):
            log_free(attachment, freed, detached, reason)
            return freed + detached
        backoff(attempt)
    raise TryAgainLater(f"{attachment}: too much contention, nothing freed")


def free_plan(
    reads: Reads, index_kv: KeyValue, attachment: Attachment
) -> tuple[list[Compare], list[Put | Delete], list[str], list[str]]:
    """The transaction that frees an attachment: delete its index; free each of its
    records, or detach it when it is sticky. (compares, ops, freed, detached)."""
    compares: list[Compare] = [at_revision(index_kv.key, index_kv.mod_revision)]
    ops: list[Put | Delete] = [Delete(index_kv.key)]
    freed: list[str] = []
    detached: list[str] = []
    now = reads.clock()
    for ref in AttachmentIndex.decode(index_kv.value).refs:
        pool_name, ip = rec.split_pool_ip(ref)
        key = keys.ip_key(pool_name, ip)
        record_kv = reads.get(key)
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
            sticky_ops, sticky_compares = detach_reservation(reads, record.sticky, attachment, now)
            ops += sticky_ops
            compares += sticky_compares
            detached.append(ref)
            continue
        record_ops, block_compare = free_ops(reads, pool_name, ip, record, now)
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
    reads: Reads, key: str, attachment: Attachment, now: float
) -> tuple[list[Put | Delete], list[Compare]]:
    """The reservation's side of a detach: it no longer names a sandbox (only when it
    still names this one: a takeover may have moved it on)."""
    kv = reads.get(key, fresh=True)
    if kv is None:
        return [], [absent(key)]
    held = ReservationRecord.decode(kv.value)
    compares = [at_revision(key, kv.mod_revision)]
    if held.attachment != attachment.key:
        return [], compares
    return [Put(key, held.detached(now).encode())], compares


def free_ops(
    reads: Reads, pool_name: str, ip: str, record: AddressRecord, now: float
) -> tuple[list[Put | Delete], list[Compare]]:
    """Delete a record and, if its pool hands the address out now, queue it (the
    cooldown) on the node that owns its block. An address the pool does not cover
    any more (a retired layout's, or a deleted pool's) is not queued: this pool
    version never hands it out. Pinned by compares on the pool spec and the block."""
    pool_key = keys.pool_key(pool_name)
    spec_kv = reads.get(pool_key)
    compares = [at_revision(pool_key, spec_kv.mod_revision if spec_kv else 0)]
    ops: list[Put | Delete] = [Delete(keys.ip_key(pool_name, ip))]
    if record.node:
        ops.append(Delete(keys.node_ip_key(record.node, pool_name, ip)))
    if spec_kv is None:
        return ops, compares
    family, value = parse_ip(ip)
    try:
        spec = reads.parsed(spec_kv)
    except (IpwardError, ValueError):
        spec = None  # unreadable ('ipward check' says so): a DEL must still work
    if spec is not None:
        index = spec.set_of(family)
        block = spec.range_sets[index].block_of(value) if index is not None else None
        if block is None:
            return ops, compares
        cidr = block.cidr
    else:
        cidr = record.block
    owner = record.node or reads.node
    block_key = keys.block_key(pool_name, cidr)
    block_kv = reads.get(block_key)
    if block_kv is not None:
        owner = BlockRecord.decode(block_kv.value).node or owner
    queue = keys.queue_key(pool_name, family, owner, now, ip)
    ops += [
        Put(keys.free_key(pool_name, ip), FreeRecord(now, queue).encode()),
        Put(queue, b""),
    ]
    compares.append(at_revision(block_key, block_kv.mod_revision if block_kv else 0))
    return ops, compares


def free_address(
    reads: Reads,
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
        record_kv = reads.get(key, fresh=True)
        if record_kv is None or record_kv.mod_revision != expected_mod_revision:
            raise OwnerChanged(
                f"{pool}/{ip} changed since it was read (revision {expected_mod_revision});"
                " look again and retry"
            )
        record = AddressRecord.decode(record_kv.value)
        attachment = record.attachment
        index_kv = reads.get(attachment.key, fresh=True)
        if record.sticky:
            # A sticky address is detached with its whole attachment, never freed
            # here: retiring the reservation is `free_sticky`'s.
            if index_kv is None or record.is_detached:
                raise OwnerChanged(f"{pool}/{ip} is reserved by {record.sticky}, detached")
            compares, ops, freed, detached = free_plan(reads, index_kv, attachment)
        else:
            ops, compares = free_ops(reads, pool, ip, record, reads.clock())
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
        if reads.txn(compares, ops):
            log_free(attachment, freed, detached, reason, revision=expected_mod_revision)
            return record
        if not all(c.holds(reads.get(c.key, fresh=True)) for c in fence):
            raise OwnerChanged(f"{pool}/{ip} not freed: its fence no longer holds")
        backoff(attempt)
    raise TryAgainLater(f"{pool}/{ip}: too much contention, nothing freed")


def collect_network(
    reads: Reads, network: str, keep: set[tuple[str, str]], grace: float = ADD_GRACE
) -> list[str]:
    """CNI GC, with garbage collection's rules (ipward.gc) and the runtime's list as
    the evidence: free each address of `network` on this node whose attachment
    (container, ifname) the runtime did not list as valid, and whose ADD is older
    than `grace` (one in flight may not be listed yet), by compare-and-delete on the
    revision read. Only this node's (read through its index): the runtime lists its
    own attachments, so another node's are never in its list. Returns the addresses
    freed."""
    kvs, _ = reads.range(keys.node_ips_prefix(reads.node))
    now = reads.clock()
    freed = []
    for kv in kvs:
        _, pool, ip = keys.node_ip_parts(kv.key)
        try:
            copy = AddressRecord.decode(kv.value)
        except ValueError:
            continue  # 'ipward check' reports it
        if copy.network != network or (copy.container, copy.ifname) in keep:
            continue
        record_kv = reads.get(keys.ip_key(pool, ip), fresh=True)
        if record_kv is None:
            continue
        record = AddressRecord.decode(record_kv.value)
        age = now - (record.created_at if record.created_at is not None else now)
        if (
            record.is_detached
            or record.node != reads.node
            or record.attachment != copy.attachment
            or age < grace
        ):
            continue
        reason = (
            f"CNI GC: not in cni.dev/valid-attachments, {age:.0f}s after its ADD (grace {grace:g}s)"
        )
        try:
            free_address(reads, pool, ip, record_kv.mod_revision, reason)
        except OwnerChanged:
            continue  # freed or replaced meanwhile: not ours to touch
        freed.append(rec.pool_ip(pool, ip))
    return freed
