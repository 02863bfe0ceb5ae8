"""Blocks leaving and joining nodes: the hand-back handshake (docs/design.md 5.3) and assignment.

Every step is one compare-and-swap on the block record, so the controller and the agent
can each stop at any point and the other, or a successor, resumes from the store:

    active --mark (controller)--> marked --answer (agent)--> ready | refused
    ready  --release (controller, after --ready-delay)--> deleted, listed in blockfree/
    refused --resume (controller)--> active
    marked | ready | refused --take back (agent needing space, in the ledger)--> active

Why it is safe: an allocation compares its block `active` at the revision it read, so
nothing lands in a block once it is marked. The agent answers `ready` in a transaction
that compares every address of the block absent, at a revision after the mark; from
then on the block is not active, so it stays empty until the controller deletes it by
CAS on that same revision. A take-back resets the block's cursor, so addresses whose
free entries were already cleaned are found again as fresh.
"""

from __future__ import annotations

from ipward.core import keys, log, testpoints
from ipward.core.addr import family_of
from ipward.core.keys import cidr_of
from ipward.core.policy import MAX_RELEASABLE_BLOCK
from ipward.core.pool import PoolSpec
from ipward.core.records import MARKED, READY, REFUSED, BlockRecord
from ipward.ipam import free_queue
from ipward.ipam.claims import claim_writes, claims
from ipward.store.base import Delete, KeyValue, Put, Store, absent, at_revision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.addr import Block
    from ipward.store.base import Compare


def addresses(block: Block) -> list[str]:
    out = []
    offset = block.next_usable(0)
    while offset is not None:
        out.append(block.address(offset))
        offset = block.next_usable(offset + 1)
    return out


def releasable(block: Block) -> bool:
    """Small enough for the agent's one-transaction emptiness check: one compare per
    usable address plus the block's own must fit etcd's cap."""
    return block.usable_count() + 1 <= MAX_RELEASABLE_BLOCK


def mark(store: Store, pool: str, kv: KeyValue, now: float, fence: Sequence[Compare] = ()) -> bool:
    """Controller: ask for an active block back. `fence` (here and in every controller
    step): compares that hold only while the caller is the leader."""
    state = BlockRecord.decode(kv.value)
    if not state.active:
        return False
    testpoints.pause("mark")
    done = store.txn(
        [*fence, at_revision(kv.key, kv.mod_revision)], [Put(kv.key, state.marked(now).encode())]
    )
    if done.succeeded:
        log.info("block marked", pool=pool, block=cidr_of(kv.key), node=state.node)
    return done.succeeded


def answer(
    store: Store, spec: PoolSpec, kv: KeyValue, now: float, fence: Sequence[Compare] = ()
) -> str | None:
    """Agent: answer a marked block of its own: `ready` when none of its addresses is
    allocated (checked by compares in the same transaction), else `refused`. None when
    the block changed meanwhile (read it again). The controller answers, fenced, for a
    node that is gone (its lease expired and the cluster no longer lists it)."""
    state = BlockRecord.decode(kv.value)
    block = spec.block_by_cidr(cidr_of(kv.key))
    if state.state != MARKED or block is None:
        return None
    pinned = at_revision(kv.key, kv.mod_revision)
    if releasable(block):
        empty = [absent(keys.ip_key(spec.name, ip)) for ip in addresses(block)]
        ready = state.answered(READY, now)
        if store.txn([*fence, pinned, *empty], [Put(kv.key, ready.encode())]).succeeded:
            log.info("block ready", pool=spec.name, block=block.cidr, node=state.node)
            return READY
    refused = state.answered(REFUSED, now)
    if store.txn([*fence, pinned], [Put(kv.key, refused.encode())]).succeeded:
        log.info(
            "block refused",
            pool=spec.name,
            block=block.cidr,
            node=state.node,
            reason="addresses allocated" if releasable(block) else "block too large",
        )
        return REFUSED
    return None


def resume(store: Store, pool: str, kv: KeyValue, fence: Sequence[Compare] = ()) -> bool:
    """Controller: a refused block goes back to work."""
    state = BlockRecord.decode(kv.value)
    if state.state != REFUSED:
        return False
    ok = store.txn(
        [*fence, at_revision(kv.key, kv.mod_revision)], [Put(kv.key, state.resumed().encode())]
    )
    if ok.succeeded:
        log.info(
            "block resumed",
            pool=pool,
            block=cidr_of(kv.key),
            node=state.node,
            reason="agent refused the release",
        )
    return ok.succeeded


def complete_hand_back(
    store: Store, spec: PoolSpec, kv: KeyValue, fence: Sequence[Compare] = ()
) -> bool:
    """Controller: delete a block its agent answered `ready` for. Its free entries go
    first, in chunks, each pinned to the block's `ready` revision; then the block, its
    affinity entry, and a `blockfree/` entry so it is claimed again before new blocks.
    False (nothing more done) as soon as the block changes."""
    state = BlockRecord.decode(kv.value)
    cidr = cidr_of(kv.key)
    block = spec.block_by_cidr(cidr)
    if state.state != READY or block is None:
        return False
    pinned = at_revision(kv.key, kv.mod_revision)
    ips = addresses(block)
    fenced = [*fence, pinned]
    # Defence in depth: the agent's answer proved the block empty, and nothing can land
    # in a block that is not active; a record here is a bug, so refuse and say so.
    for ip in ips:
        if store.get(keys.ip_key(spec.name, ip)) is not None:
            now = store.get(kv.key)
            if now is None or now.mod_revision != kv.mod_revision:
                return False  # taken back by its node since it was read: nothing wrong
            log.error(
                "ready block holds an allocation; not released", pool=spec.name, block=cidr, ip=ip
            )
            return False
    if not free_queue.clear(store, spec.name, ips, fenced):
        return False
    family = family_of(cidr)
    node = state.node
    done = store.txn(
        fenced,
        [
            Delete(kv.key),
            Delete(keys.affinity_key(spec.name, node, cidr)),
            Put(keys.released_block_key(spec.name, family, cidr), b""),
        ],
    )
    if done.succeeded:
        log.info(
            "block released",
            pool=spec.name,
            block=cidr,
            node=node,
            reason="surplus: empty past release_delay, agent answered ready",
        )
    return done.succeeded


def assign(
    store: Store, spec: PoolSpec, family: int, node: str, fence: Sequence[Compare] = ()
) -> str | None:
    """Controller: give `node` a block of this family (a released one first, else the
    next never claimed), by CAS, pinned to the pool spec as read (so no block is ever
    assigned in a pool being deleted or since changed). The node's agent starts filling
    it when its current block runs out. None when the pool has no block left or a race
    was lost."""
    index = spec.set_of(family)
    if index is None or spec.deleting:
        return None
    rs = spec.range_sets[index]
    claim = next(claims(spec, rs, store.get, store.range), None)
    if claim is None:
        return None
    compares, ops = claim_writes(spec, family, node, [(claim, 0)])
    if spec.revision is not None:
        compares.append(at_revision(keys.pool_key(spec.name), spec.revision))
    if not store.txn([*fence, *compares], ops).succeeded:
        return None
    cidr = claim.block.cidr
    log.info("block assigned", pool=spec.name, block=cidr, node=node, reason="warm target")
    return cidr
