"""The ledger: allocate and free addresses for attachments (docs/design.md 5.1, 5.2).

`Ledger` is the facade every caller uses (the plugin's verbs, the agent, the controller,
garbage collection, the CLI, the labs). Its parts, one concept each, share one
`StoreCache` (the ledger's cache of the store and its pinned transaction):
  cache       what a ledger reads and remembers; its transactions
  allocation  what one allocation is: a pick, the witnesses, its writes, its answer
  allocating  making one: the pool guard, the pick order, requested and fresh addresses
  free_queue  freed addresses in their cooldown: freeing into it, picking from it
  claims      room elsewhere: other blocks, take-back, the one claim walk, borrowing
  combining   concurrent ADDs of one process committed in one transaction
  sticky      reservations: make, take over, retire
  freeing     free an attachment or one record; detach; the CNI GC verb's side
`freeing` and `sticky` are imported where used, `claims` once the fill block is used up,
`combining` by a ledger whose calls may be concurrent: the plugin's ADD imports no part
it does not use (docs/architecture.md, Plugin start path).

Every change is one store transaction whose compares pin what was read: the attachment
index absent, the address record absent, the block still active at the revision read,
the free-queue entry still there. A conflict means someone else moved first: read again
and retry, a bounded number of times.

Standard library only: this runs inside the CNI plugin in single-node mode.
"""

from __future__ import annotations

import _thread
import time

from ipward.core import log
from ipward.core.policy import ADD_GRACE
from ipward.ipam.allocating import allocate_one
from ipward.ipam.allocation import Allocation, held_allocations
from ipward.ipam.cache import StoreCache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.core.pool import PoolSpec
    from ipward.core.records import AddressRecord, Attachment, PodInfo, Sticky
    from ipward.ipam.combining import Combiner
    from ipward.store.base import Compare, Store

__all__ = ["Allocation", "Ledger"]


class Turns:
    """Calls of one attachment take turns: an ADD and a DEL (or two ADDs) of one
    attachment arriving together in one process (a runtime's retry after a timeout) act
    one after the other, so a DEL never returns while an ADD of its attachment is still
    to commit. Calls of other attachments never wait for each other."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()  # not `threading`: it costs the plugin ~1 ms
        self._turns: dict[str, tuple[_thread.LockType, int]] = {}  # key -> (turn, waiting)

    def take(self, key: str) -> None:
        with self._lock:
            turn, waiting = self._turns.get(key) or (_thread.allocate_lock(), 0)
            self._turns[key] = (turn, waiting + 1)
        if waiting:
            log.info("a call waits for another call of its attachment", attachment=key)
        turn.acquire()

    def give_back(self, key: str) -> None:
        with self._lock:
            turn, waiting = self._turns[key]
            if waiting == 1:
                del self._turns[key]
            else:
                self._turns[key] = (turn, waiting - 1)
        turn.release()


class Ledger:
    """`short_lived`: one call in the process's life (the plugin's), so none is
    concurrent with another: it goes straight to its transaction, never through a
    batch (`combining`, for the callers of a long-lived ledger: the agent's workers)."""

    def __init__(
        self,
        store: Store,
        node: str,
        clock: Callable[[], float] = time.time,
        short_lived: bool = False,
    ) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.cache = StoreCache(store, node, clock)
        self._combiner: Combiner | None = None
        if not short_lived:
            from ipward.ipam.combining import Combiner  # not the plugin's: ~0.2 ms

            self._combiner = Combiner(self.cache)
        self._turns = Turns()

    # -- pools ------------------------------------------------------------------------

    def get_pool(self, name: str, fresh: bool = False) -> PoolSpec:
        return self.cache.get_pool(name, fresh)

    def stored_pools(self) -> list[PoolSpec]:
        """Every pool as the store has it now (one range read, never from memory)."""
        return self.cache.stored_pools()

    # -- ADD --------------------------------------------------------------------------

    def lookup(self, attachment: Attachment) -> list[Allocation] | None:
        """The attachment's addresses, or None if it has none (read from the store: an
        answer, not a decision a compare would check)."""
        kv = self.cache.get(attachment.key_on(self.cache.node), fresh=True)
        if kv is None:
            return None
        return held_allocations(self.cache, kv)

    def allocate(
        self,
        pools: list[PoolSpec],
        attachment: Attachment,
        pod: PodInfo,
        requested: Sequence[str] = (),
        sticky: Sticky | None = None,
    ) -> list[Allocation]:
        """One address per range set of each pool for the attachment, or the addresses it
        already has. `requested` addresses (bare, no prefix) are used for their family.
        With `sticky`, the identity's reservation is taken over when there is one (its
        addresses, whatever the pools), else made in the allocating transaction.

        Calls of one attachment take turns (`Turns`); concurrent calls of others for
        the same pools are combined (`combining`) by a ledger that is not short-lived;
        requests with a requested address never are (their refusals are their own)."""
        self._turns.take(repr(attachment))
        try:
            if sticky is not None:
                from ipward.ipam import sticky as reservations  # not on every ADD: ~0.2 ms

                return reservations.allocate_sticky(
                    self.cache, pools, attachment, pod, requested, sticky
                )
            if requested or self._combiner is None:
                return allocate_one(self.cache, pools, attachment, pod, requested)
            return self._combiner.allocate(pools, attachment, pod)
        finally:
            self._turns.give_back(repr(attachment))

    # -- DEL, GC, CLI -----------------------------------------------------------------

    def free(self, attachment: Attachment, reason: str = "CNI DEL") -> list[str]:
        """Free the attachment's addresses (detach sticky ones); an unknown attachment is
        not an error. Returns the addresses freed or detached; each is logged with
        `reason`. Waits for its turn after calls of the attachment in flight (`Turns`)."""
        from ipward.ipam import freeing  # DEL's, not ADD's: ~0.2 ms of every ADD otherwise

        self._turns.take(repr(attachment))
        try:
            return freeing.free(self.cache, attachment, reason)
        finally:
            self._turns.give_back(repr(attachment))

    def free_address(
        self,
        pool: str,
        ip: str,
        expected_mod_revision: int,
        reason: str,
        fence: Sequence[Compare] = (),
    ) -> AddressRecord:
        """Compare-and-delete one record (`freeing.free_address`)."""
        from ipward.ipam import freeing

        return freeing.free_address(self.cache, pool, ip, expected_mod_revision, reason, fence)

    def free_sticky(
        self, key: str, expected_mod_revision: int, reason: str, fence: Sequence[Compare] = ()
    ) -> list[str]:
        """Retire a detached reservation (`sticky.free_sticky`)."""
        from ipward.ipam import sticky as reservations

        return reservations.free_sticky(self.cache, key, expected_mod_revision, reason, fence)

    def collect_network(
        self, network: str, keep: set[tuple[str, str]], grace: float = ADD_GRACE
    ) -> list[str]:
        """CNI GC on this node (`freeing.collect_network`). Returns the addresses freed."""
        from ipward.ipam import freeing

        return freeing.collect_network(self.cache, network, keep, grace)
