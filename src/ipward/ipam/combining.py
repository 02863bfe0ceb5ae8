"""Request combining: concurrent ADDs of one process for the same pools (the agent's
worker threads) queue up, and one of them commits a batch of them in one transaction
(distinct addresses picked in memory, every compare kept), instead of all of them
racing for the same queue head and block cursor. A batch that fails falls back to one
transaction per request. Only a ledger whose calls may be concurrent combines (not the
plugin's short-lived one: `Ledger`); a call alone is its own batch of one.
"""

from __future__ import annotations

import _thread

from ipward.core import log, testpoints
from ipward.core.errors import InputTooLarge, IpwardError
from ipward.ipam.allocating import NeedsBlock, allocate_one, pick, pool_guard
from ipward.ipam.allocation import Taken, allocations, writes
from ipward.ipam.cache import StoreCache, last_write_per_key, unique_compares

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.core.pool import PoolSpec
    from ipward.core.records import Attachment, PodInfo
    from ipward.ipam.allocation import Allocation, Pick
    from ipward.store.base import Compare, Delete, Put

MAX_BATCH = 24  # allocations per combined transaction at most (fewer: the store's limits)


class Request:
    """One ADD waiting to be combined into a batch."""

    __slots__ = ("attachment", "done", "error", "pod", "pools", "result", "wake")

    def __init__(self, pools: list[PoolSpec], attachment: Attachment, pod: PodInfo) -> None:
        self.pools = pools
        self.attachment = attachment
        self.pod = pod
        self.result: list[Allocation] | None = None
        self.error: BaseException | None = None
        self.done = False
        self.wake = _thread.allocate_lock()  # not `threading`: it costs the plugin ~1 ms
        self.wake.acquire()


class Combiner:
    """The requests waiting per set of pools, and which sets have a caller leading."""

    def __init__(self, cache: StoreCache) -> None:
        self.cache = cache
        self._lock = _thread.allocate_lock()
        self._waiting: dict[tuple[str, ...], list[Request]] = {}
        self._leading: set[tuple[str, ...]] = set()

    def allocate(
        self, pools: list[PoolSpec], attachment: Attachment, pod: PodInfo
    ) -> list[Allocation]:
        """Queue up; lead a batch when no caller leads one for these pools, else wait to
        be served or handed the lead."""
        me = Request(pools, attachment, pod)
        key = tuple(p.name for p in pools)
        with self._lock:
            waiting = self._waiting.setdefault(key, [])
            waiting.append(me)
            leads = key not in self._leading
            if leads:
                self._leading.add(key)
        if not leads:
            me.wake.acquire()  # served, or handed the lead
        if not me.done:
            self._lead(key)
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    def _lead(self, key: tuple[str, ...]) -> None:
        """Serve one batch of the waiting requests (this caller's first among them), then
        hand the lead to the next waiting request, so no caller serves others forever.
        Whatever serving raises, every request of the batch is answered (a result or an
        error) or back in line, and the lead passes on."""
        with self._lock:
            batch = self._waiting[key][:MAX_BATCH]
            del self._waiting[key][:MAX_BATCH]
        answered = len(batch)
        try:
            answered = self._serve(batch)
        except BaseException as e:  # a bug, or an interrupt: its callers must still hear
            for request in batch:
                if request.result is None and request.error is None:
                    request.error = e
            raise
        finally:
            served, unserved = batch[:answered], batch[answered:]
            for request in served:
                request.done = True
            with self._lock:
                waiting = self._waiting[key]
                waiting[:0] = unserved  # did not fit this batch's transaction: next in line
                successor = waiting[0] if waiting else None
                if successor is None:
                    self._leading.discard(key)
                    del self._waiting[key]
            for request in served:
                if request.wake.locked():
                    request.wake.release()
            if successor is not None:
                successor.wake.release()  # it wakes not done, so it leads

    def _serve(self, batch: list[Request]) -> int:
        """Answer the first requests of `batch`, as many as one transaction of the store
        holds: combined when they commit together, else one by one. How many it answered
        (at least one: the lead's own)."""
        count, results = 1, None
        if len(batch) > 1:
            try:
                count, results = self._allocate_group(batch)
            except Exception as e:  # whatever it was, each request finds its own answer
                foreseen = isinstance(e, NeedsBlock | IpwardError)
                if not foreseen or isinstance(e, InputTooLarge):  # the store's limits?
                    log.warning(
                        "combined allocation failed; serving one by one",
                        error=f"{type(e).__name__}: {e}",
                        batch=len(batch),
                    )
                count, results = len(batch), None
        for position, request in enumerate(batch[:count]):
            if results is not None:
                request.result = results[position]
                continue
            try:
                request.result = allocate_one(
                    self.cache, request.pools, request.attachment, request.pod
                )
            except Exception as e:  # handed to the caller, raised in its own thread
                request.error = e
        return count

    def _allocate_group(self, batch: list[Request]) -> tuple[int, list[list[Allocation]] | None]:
        """One transaction for the first requests of the batch, as many as fit the
        store's transaction limits (each member's compares and writes are counted as it is
        added, after the batch's shared ones are merged), on a first, optimistic attempt.
        (How many it took, their allocations or None if they are to be served one by one:
        it did not commit, or only one fitted.)"""
        cache = self.cache
        pools = batch[0].pools
        compares: list[Compare] = []
        ops: list[Put | Delete] = []
        for guard_compares, guard_ops in (pool_guard(cache, pool) for pool in pools):
            compares += guard_compares
            ops += guard_ops
        taken = Taken(len(batch))
        picks_of: list[list[Pick]] = []
        now = cache.clock()
        members: set[Attachment] = set()
        for request in batch:
            if request.attachment in members:
                # One transaction, one write of an attachment: a second call of it waits
                # for the next batch, where it finds the first's addresses.
                break
            members.add(request.attachment)
            picks = [
                pick(cache, pool, i, rs, None, False, taken)
                for pool in pools
                for i, rs in enumerate(pool.range_sets)
            ]
            member_compares, member_ops = writes(
                cache.node, request.attachment, request.pod, picks, now
            )
            grown_compares = unique_compares(compares + member_compares)
            grown_ops = last_write_per_key(ops + member_ops)
            if cache.store.txn_problem(grown_compares, grown_ops) is not None:
                break  # this one and the rest wait for the next batch
            compares, ops = grown_compares, grown_ops
            picks_of.append(picks)
        if len(picks_of) < 2:
            return 1, None
        testpoints.pause("allocate")
        if not cache.txn(compares, ops):
            return len(picks_of), None
        results = []
        for request, picks in zip(batch, picks_of, strict=False):
            given = allocations(cache, [p.ref for p in picks], pools)
            log.info(
                "allocated",
                attachment=repr(request.attachment),
                ips=[repr(a) for a in given],
                batch=len(picks_of),
            )
            results.append(given)
        return len(picks_of), results
