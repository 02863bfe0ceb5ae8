"""The controller's view of the store: the keys its passes read (pools, blocks, affinity,
fills, allocation records, sticky reservations, registrations), read whole once at one
revision and then kept current from a watch, so a pass costs what changed since the
last, not what exists.

Following the store is `ipward.store.follower`'s (`SyncedFollower`): its watch thread
only receives, and the pass thread applies the store's event batches (whole revisions
each) in `sync`, up to at least the revision the store had when the pass began. So the
view is only ever changed between passes, a pass reads one state the store had (the
view's `revision`), and nothing is shared with the thread but its inbox. Read whole
again: at the start, when the watch reports compaction, when the stream breaks or does
not reach the store's revision within `catch_up_timeout`, and every `reread_every`
seconds as a safety net. A watch that gets more than `max_pending` events ahead of the
passes (a standby, a long pass) stops receiving and is resumed from the view's revision
at the next sync: the events wait in the store, not in memory (resuming past the
store's history is a compaction, read whole). What is here is the view's own shape of
state: how a key read or changed lands in it.

A view that is behind is safe: every write a pass decides compares the revisions it read
(a record's compare-and-delete, a block's compare-and-swap), so a stale view can only
make a write fail, and the next pass sees why.

Changes for garbage collection (`take_changes`): once asked for them, the view notes
every allocation record and registration an applied event changed (a record's key with
what it held before), until they are taken; a whole read, or more than `max_pending`
noted, says "everything" instead.

Clocks, for the ADD grace (`ipward.gc.clocks`): each record carries when the view first
saw its revision (`Held.seen`, the follower's rule: the controller's monotonic clock when
the watch thread received its event, or a whole read's time for a record new to it; None
for the records of the first read, which has no earlier look to compare with), and each
registration the offset of its node's clock measured from it (`offsets`: tight from an
event, loose from a whole read). A whole read keeps both for what it finds unchanged
(the same revision), so only a new term starts them over. A node's clock certainly more
than `CLOCK_SKEW_BOUND` off is logged once (again when its offset moves) and counted.

Memory: records are kept decoded (`gc.Held`, slotted), blocks as their KeyValue and
decoded record (the compare needs the revision), the rest as names; no raw record bytes.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from typing import TYPE_CHECKING, cast

from ipward.core import keys, log
from ipward.core.policy import CLOCK_SKEW_BOUND
from ipward.core.records import (
    AddressRecord,
    BlockRecord,
    FillRecord,
    NodeRegistration,
    ReservationRecord,
)
from ipward.gc.clocks import Offset, measure
from ipward.gc.rules import Held, Registrations, Reservation
from ipward.store.base import DELETE, Event, KeyValue
from ipward.store.follower import SyncedFollower

if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.controller.metrics import Metrics
    from ipward.store import Store
    from ipward.store.follower import Stamp

# What the passes read.
PREFIXES = (
    keys.POOLS,
    keys.BLOCKS,
    keys.AFFINITY,
    keys.FILL,
    keys.ADDRESSES,
    keys.STICKY,
    keys.NODES,
)

DEFAULT_REREAD_EVERY = 600.0
DEFAULT_CATCH_UP_TIMEOUT = 30.0
DEFAULT_MAX_PENDING = 50_000


class PoolKeys:
    """One pool's blocks (cidr -> its KeyValue and record), address records per block,
    and fill records ((family, node) -> block)."""

    __slots__ = ("blocks", "fills", "records")

    def __init__(self) -> None:
        self.blocks: dict[str, tuple[KeyValue, BlockRecord]] = {}
        self.records: Tally[str] = Tally()
        self.fills: dict[tuple[int, str], str] = {}


class Changes:
    """What the view's events changed since the last `take_changes`: `everything`, or
    the allocation records (`ips/` key -> the record as held before, None: absent) and
    the nodes whose registration came or went."""

    __slots__ = ("everything", "nodes", "records")

    def __init__(self, everything: bool, records: dict[str, Held | None], nodes: set[str]) -> None:
        self.everything = everything
        self.records = records
        self.nodes = nodes


class StoreView:
    """See the module docstring. Only the pass thread calls `sync` and reads the fields."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        *,
        reread_every: float = DEFAULT_REREAD_EVERY,
        catch_up_timeout: float = DEFAULT_CATCH_UP_TIMEOUT,
        max_pending: int = DEFAULT_MAX_PENDING,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.monotonic = monotonic
        self.pools: dict[str, KeyValue] = {}  # pool name -> its spec's KeyValue
        self.pool_keys: dict[str, PoolKeys] = {}
        self.records: dict[str, Held] = {}  # `ips/` key -> the record as held
        self.reservations: dict[str, Reservation] = {}
        self.registered: set[str] = set()  # nodes holding a registration
        self.runtimes: set[str] = set()  # of those, nodes whose agent judges by its runtime
        # node -> its clock's offset, measured from its registration at the revision
        self.offsets: dict[str, tuple[int, Offset]] = {}
        self.affinity: dict[str, str] = {}  # affinity key -> the node it names
        # Within a whole read: what the view held before, kept where unchanged.
        self._before: tuple[dict[str, Held], dict[str, tuple[int, Offset]]] | None = None
        self.follower = SyncedFollower(
            store,
            PREFIXES,
            self,
            name="controller view",
            counted=lambda reason: metrics.view_rereads.labels(reason=reason).inc(),
            lagging=metrics.view_lag.set,
            reread_every=reread_every,
            catch_up_timeout=catch_up_timeout,
            max_pending=max_pending,
            clock=clock,
            monotonic=monotonic,
        )

    # -- what the passes call

    @property
    def revision(self) -> int:
        """The store revision the view is at (0: not read yet)."""
        return self.follower.revision

    def sync(self) -> int:
        """Bring the view to at least the store's current revision; returns it."""
        revision = self.follower.sync()
        self.metrics.snapshot.clock_offsets = {
            node: offset.estimate for node, (_, offset) in self.offsets.items() if offset.skewed
        }
        return revision

    def registrations(self) -> Registrations:
        """The registered nodes, those whose agent judges by its runtime, and each
        one's clock offset where its registration tells it."""
        offsets = {node: offset for node, (_, offset) in self.offsets.items()}
        return Registrations(frozenset(self.registered), frozenset(self.runtimes), offsets)

    def block_nodes(self) -> set[str]:
        """Nodes some block is assigned to (by the affinity index)."""
        return {node for node in self.affinity.values() if node}

    def held(self) -> list[Held]:
        """The allocation records garbage collection judges (a detached record has no
        sandbox to judge: its reservation is retired by identity)."""
        return [h for h in self.records.values() if not h.record.is_detached]

    def take_changes(self) -> Changes:
        """What changed since the last call (the first: everything), and start over."""
        taken = self.follower.changes.take()
        records: dict[str, Held | None] = {}
        nodes: set[str] = set()
        for key, before in taken.keys.items():
            if key.startswith(keys.NODES):
                nodes.add(keys.last(key))
            else:
                records[key] = cast("Held | None", before)
        return Changes(taken.everything, records, nodes)

    def pool(self, name: str) -> PoolKeys:
        return self.pool_keys.get(name) or PoolKeys()

    @property
    def receiving(self) -> bool:
        """Whether the watch thread is taking events (it stops on an error, or when too
        far ahead of the passes, until the next sync)."""
        return self.follower.receiving

    def close(self) -> None:
        self.follower.close()

    def forget(self) -> None:
        """Let go of everything (a standby holds nothing); the next sync reads whole."""
        self.follower.forget(self._clear)

    # -- what the follower hands it

    def load(self, kvs: list[KeyValue], stamp: Stamp, seen: float | None) -> None:
        self._before = (self.records, self.offsets)
        self.records, self.offsets = {}, {}
        self._clear()
        try:
            kvs.reverse()
            while kvs:  # each raw key let go once applied: the peak is one copy, not two
                self._put(kvs.pop(), stamp, seen, fresh=False)
        finally:
            self._before = None

    def apply(self, events: list[Event], stamp: Stamp) -> None:
        for event in events:
            if event.kind == DELETE:
                self._delete(event.kv.key)
            else:
                self._put(event.kv, stamp, stamp.mono, fresh=True)

    def _clear(self) -> None:
        self.pools.clear()
        self.pool_keys.clear()
        self.records.clear()
        self.reservations.clear()
        self.registered.clear()
        self.runtimes.clear()
        self.offsets.clear()
        self.affinity.clear()

    def _put(self, kv: KeyValue, stamp: Stamp, seen: float | None, *, fresh: bool) -> None:
        """Apply a key as put, got at `stamp`, its revision first seen at `seen`; `fresh`:
        from an event, got as it was put (not in a whole read)."""
        key = kv.key
        prefix = keys.prefix_of(key)
        if prefix == keys.NODES:
            self._register(kv, stamp, fresh)
            return
        self._delete(key)  # what the key held before
        try:
            if prefix == keys.ADDRESSES:  # noted by `_delete` above
                before = self._before[0].get(key) if self._before is not None else None
                if before is not None and before.mod_revision == kv.mod_revision:
                    held = before  # unchanged: as decoded, and first seen, then
                else:
                    pool, ip = keys.ip_parts(key)
                    address = AddressRecord.decode(kv.value)
                    held = Held(pool, ip, kv.mod_revision, address, seen=seen)
                self.records[key] = held
                self._pool_keys(held.pool).records[held.record.block] += 1
            elif prefix == keys.BLOCKS:
                pool = keys.state_pool(key) or ""
                block = BlockRecord.decode(kv.value)
                self._pool_keys(pool).blocks[keys.cidr_of(key)] = (kv, block)
            elif prefix == keys.FILL:
                pool, family, node = keys.fill_parts(key)
                fill = FillRecord.decode(kv.value)
                self._pool_keys(pool).fills[(int(family), node)] = fill.block
            elif prefix == keys.POOLS:
                self.pools[keys.pool_name(key)] = kv
            elif prefix == keys.AFFINITY:
                self.affinity[key] = keys.affinity_parts(key)[1]
            elif prefix == keys.STICKY:
                record = ReservationRecord.decode(kv.value)
                self.reservations[key] = Reservation(key, kv.mod_revision, record)
        except ValueError as e:
            log.error("record unreadable; left out of the controller's view", key=key, error=str(e))

    def _register(self, kv: KeyValue, stamp: Stamp, fresh: bool) -> None:
        """A registration put: its node is registered, judged by its agent's runtime or
        not (noted when either changes: a put again, with the agent's clock, changes no
        verdict), with its clock's offset."""
        node = keys.registered_node(kv.key)
        if node is None:
            return
        if node not in self.registered:
            self.registered.add(node)
            self._note_node(node)
        try:
            runtime = NodeRegistration.decode(kv.value).runtime
        except ValueError:
            runtime = False  # judged by the cluster's word, as an agent that says nothing
        if runtime and node not in self.runtimes:
            self.runtimes.add(node)
            self._note_node(node)
        elif not runtime and node in self.runtimes:
            self.runtimes.discard(node)
            self._note_node(node)
        before = self._before[1].get(node) if self._before is not None else self.offsets.get(node)
        if before is not None and before[0] == kv.mod_revision:
            self.offsets[node] = before  # unchanged since measured
            return
        offset = measure(kv, stamp.wall, fresh=fresh)
        if offset is None:
            self.offsets.pop(node, None)
            return
        self.offsets[node] = (kv.mod_revision, offset)
        was = before[1] if before is not None else None
        if offset.skewed and (
            was is None or not was.skewed or abs(offset.estimate - was.estimate) > CLOCK_SKEW_BOUND
        ):
            log.warning(
                "node's clock is off the controller's: its records' ages are corrected for"
                " it (fix its time sync)",
                node=node,
                offset=round(offset.estimate, 3),
                clock=offset.describe(),
                bound=CLOCK_SKEW_BOUND,
            )
        elif was is not None and was.skewed and not offset.skewed:
            log.info("node's clock is back within bound", node=node, clock=offset.describe())

    def _delete(self, key: str) -> None:
        prefix = keys.prefix_of(key)
        if prefix == keys.ADDRESSES:
            self._note_record(key)
            held = self.records.pop(key, None)
            if held is not None:
                records = self._pool_keys(held.pool).records
                records[held.record.block] -= 1
                if records[held.record.block] <= 0:
                    del records[held.record.block]
        elif prefix == keys.BLOCKS:
            self.pool(keys.state_pool(key) or "").blocks.pop(keys.cidr_of(key), None)
        elif prefix == keys.FILL:
            try:
                pool, family, node = keys.fill_parts(key)
                self.pool(pool).fills.pop((int(family), node), None)
            except ValueError:
                pass  # never stored (its put was unreadable)
        elif prefix == keys.POOLS:
            self.pools.pop(keys.pool_name(key), None)
        elif prefix == keys.AFFINITY:
            self.affinity.pop(key, None)
        elif prefix == keys.STICKY:
            self.reservations.pop(key, None)
        elif prefix == keys.NODES and (registered := keys.registered_node(key)) is not None:
            self.registered.discard(registered)
            self.runtimes.discard(registered)
            self.offsets.pop(registered, None)
            self._note_node(registered)

    def _note_record(self, key: str) -> None:
        changes = self.follower.changes
        if changes.noting:
            changes.note(key, self.records.get(key))

    def _note_node(self, node: str) -> None:
        self.follower.changes.note(keys.node_key(node), None)

    def _pool_keys(self, pool: str) -> PoolKeys:
        found = self.pool_keys.get(pool)
        if found is None:
            found = self.pool_keys[pool] = PoolKeys()
        return found


__all__ = ["PREFIXES", "Changes", "PoolKeys", "StoreView"]
