"""The ledger's cache of the store, and the one way its parts read and write it
(docs/design.md 5.1, "Memory"): the keys it last read or wrote present, this node's free
queues (`free_queue.QueueMemory`), the parsed pool specs, and the pinned transaction
that keeps all three true. Every part of the ledger takes the ledger's one
`StoreCache`; it is what a `Ledger` is, under its facade.

A long-lived ledger (agent, benchmark) then mostly reads nothing but the free-queue
head before it writes. That is safe because every decision made on a remembered key is
pinned by a compare in the same transaction: a stale key fails the transaction, which
forgets the compared keys and reads again. Absence is never remembered, and a refusal
(exhausted, taken, block being handed back) is only given after reading everything
again.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

import time

from ipward.core import keys
from ipward.core.errors import InputTooLarge, UnknownPool
from ipward.core.pool import PoolSpec
from ipward.ipam.free_queue import QueueMemory
from ipward.store.base import KeyValue, Put, StoreUnreachable, TxnTooLarge

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.store.base import Compare, Delete, Store

MAX_ATTEMPTS = 100  # transactions one call tries before it answers 11
KNOWN_LIMIT = 100_000  # remembered keys; past it the memory starts over


def unique_compares(compares: list[Compare]) -> list[Compare]:
    seen = set()
    out = []
    for c in compares:
        mark = (c.key, c.target, c.op, c.operand)
        if mark not in seen:
            seen.add(mark)
            out.append(c)
    return out


def last_write_per_key(ops: list[Put | Delete]) -> list[Put | Delete]:
    """A batch writes a block's cursor once per pick: keep the last (furthest) write."""
    last = {op.key: op for op in ops}
    return list(last.values())


def backoff(attempt: int) -> None:
    if attempt:
        import random  # only on conflicts: ~1 ms of import on every plugin exec otherwise

        time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))


class StoreCache:
    """One node's ledger's view of the store: cached reads, pinned transactions."""

    def __init__(self, store: Store, node: str, clock: Callable[[], float]) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.known: dict[str, KeyValue] = {}  # keys as last read or written, present
        self.queues = QueueMemory()  # this node's free queues, as last seen
        self.specs: dict[str, PoolSpec] = {}  # pools as last parsed, with their revision

    def get(self, key: str, fresh: bool = False) -> KeyValue | None:
        """The key as last read or written here, or as the store has it now when it is
        not remembered (or `fresh`)."""
        if not fresh:
            known = self.known.get(key)
            if known is not None:
                return known
        kv = self.store.get(key)
        if kv is None:
            self.known.pop(key, None)
        else:
            self.remember(kv)
        return kv

    def remember(self, kv: KeyValue) -> None:
        if len(self.known) >= KNOWN_LIMIT:
            self.known.clear()
        self.known[kv.key] = kv

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        return self.store.range(prefix, limit)

    def txn(self, compares: list[Compare], ops: list[Put | Delete]) -> bool:
        problem = self.store.txn_problem(compares, ops)
        if problem is not None:
            raise InputTooLarge(f"one transaction would need {problem}; nothing was done")
        try:
            result = self.store.txn(compares, ops)
        except TxnTooLarge as e:  # limits set lower than the store's defaults
            raise InputTooLarge(f"the store refused a transaction as too large: {e}") from e
        except StoreUnreachable:
            # Applied or not, nobody can tell: forget all it touched.
            touched = {c.key for c in compares} | {op.key for op in ops}
            for key in touched:
                self.known.pop(key, None)
            self.queues.forget(touched)
            raise
        if not result.succeeded:
            for c in compares:
                self.known.pop(c.key, None)
            self.queues.forget(c.key for c in compares)
            return False
        self.queues.noted(ops, result.revision)
        for op in ops:
            if isinstance(op, Put):
                self.remember(KeyValue(op.key, op.value, 0, result.revision, 0, op.lease))
            else:
                self.known.pop(op.key, None)
        return True

    # -- pools ------------------------------------------------------------------------

    def get_pool(self, name: str, fresh: bool = False) -> PoolSpec:
        kv = self.get(keys.pool_key(name), fresh)
        if kv is None:
            raise UnknownPool(f"pool {name!r} does not exist (create it with 'ipward pool create')")
        return self.parsed(kv)

    def stored_pools(self) -> list[PoolSpec]:
        """Every pool as the store has it now (one range read, never from memory)."""
        return [self.parsed(kv) for kv in self.range(keys.POOLS)[0]]

    def parsed(self, kv: KeyValue) -> PoolSpec:
        """The stored spec, parsed once per revision (not on every ADD of an agent)."""
        name = keys.pool_name(kv.key)
        parsed = self.specs.get(name)
        if parsed is not None and parsed.revision == kv.mod_revision:
            return parsed
        spec = PoolSpec.decode(kv.value)
        spec.revision = kv.mod_revision
        self.specs[name] = spec
        return spec
