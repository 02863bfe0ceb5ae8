"""`ipward controller`: one active per cluster. Keeps every registered node's free
addresses at or above its pool's warm target by assigning blocks, and asks surplus blocks
back through the hand-back handshake (docs/design.md 5.3, the steps in `ipward.ipam.blocks`).

Leadership: the key `controller/leader` = {id, since}, put with a lease and only when
absent (version 0). The leader keeps the lease alive every ttl/3 and checks the key is
still its own; a keepalive answering <= 0, the key no longer ours, or keepalives failing
for a whole TTL make it step down at once and go back to waiting. Waiting instances poll
the key and create it when it is gone (it disappears with its lease), so a successor
takes over within about one TTL plus one poll of the leader's death. The leader acts
only while `monotonic() < the send time of its last answered keepalive + TTL` (the
lease cannot have expired before then), and every write it makes carries the fence
`controller/leader == <its exact value>`: a leader paused past its lease (GC, SIGSTOP,
a stalled VM) cannot write when it wakes, whatever its threads believe. A write that
fails makes it read the key; not ours any more means step down. Stepping down leaves
the lease alone (it has expired or no longer holds the key; it expires by itself).
Only a clean stop (SIGTERM, SIGINT) resigns: compare-and-delete of the key, then revoke.

A pass (leader only, every --interval), per pool, from the store view
(`ipward.controller.view`: read whole once, kept current from a watch, brought up to the
store's revision at the start of the pass; a standby lets it go). Each pool's pass reads
its state, plans (`ipward.controller.plan`: pure functions, state in, actions out) and
applies (`ipward.controller.executor`: the one place it writes, fenced), in phases:
  * handshake steps on blocks of registered nodes: `refused` -> resume (an aborted
    handshake); `ready` answered at least --ready-delay ago -> release (completed);
    `marked` waits for the node's agent. A block seen in the handshake and later seen
    `active` without our resume was taken back by its node (aborted; counted from this
    process's memory, so a handshake started and taken back between two passes, or
    across a change of leader, may go uncounted).
  * per registered node and family: free = sum over its active blocks of usable
    addresses minus records. While free < warm (for the nodes the pool warms,
    `plan.warmed`: those it serves; of an inline pool, those already using it): assign
    a block (one per node short
    of its target per round, so a pool running out is shared). An active block of the
    node with no record, empty on every pass for at least the pool's release_delay
    (remembered in memory per block: a new leader starts counting again, which only
    delays), small enough for the agent's one-transaction answer, and whose addresses
    the node can do without (free - its size >= warm) is marked.
Blocks of nodes that are not registered under `nodes/` are left alone but counted in
the metrics, until the node is known gone (below). A pool being deleted is skipped;
block assignments compare the spec at the revision the pass read. A pool whose ranges
changed (retired layouts, or blocks its current layout does not use) is pruned
(`ipam.pools.prune`, fenced).

Garbage collection (with `--liveness`, every `--gc-interval`; the rules are `ipward.gc`'s):
records, registrations, then liveness; a record found leaked on two passes in a row at
one revision is freed by a fenced compare-and-delete. A node whose lease expired and
that the cluster no longer lists is gone: its records are candidates, and its blocks,
once empty, are marked and answered `ready` by the controller on its behalf (the same
transaction the agent would make, comparing every address absent), then released. Node ownership is
read from the block records themselves (one read, at one revision, and the field every
step compares), not from the affinity index.

A store error ends the pass (logged, counted, tried again next interval); any other
error ends only that pool's part of it. Nothing here is needed to resume after a
crash: every handshake state is in the store, and each step is one compare-and-swap
that either side can retry or lose.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ipward.cluster.liveness import LivenessSource
from ipward.controller import plan
from ipward.controller.collection import Collection
from ipward.controller.election import Election
from ipward.controller.executor import Executor, NotLeader
from ipward.controller.metrics import Metrics
from ipward.controller.plan import Layouts, PoolMemory, PoolState
from ipward.controller.pool_objects import PoolObjects
from ipward.controller.view import DEFAULT_REREAD_EVERY, StoreView
from ipward.core import log
from ipward.core.errors import IpwardError
from ipward.core.policy import ADD_GRACE
from ipward.core.pool import PoolSpec
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreError

WAKE_SLICE = 0.5  # seconds: the longest a pass asked for by a signal can wait

if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.kubeapi.client import ApiClient


class ControllerError(IpwardError):
    """The controller cannot start as asked (the CLI prints the message, exit status 2)."""


class Controller:
    """The passes. `run` loops until `stop` is set; `run_pass` is one pass (tests call
    it directly)."""

    def __init__(
        self,
        store: Store,
        election: Election,
        metrics: Metrics,
        *,
        interval: float,
        ready_delay: float,
        liveness: LivenessSource | None = None,
        add_grace: float = ADD_GRACE,
        gc_interval: float = 30.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        view_reread: float = DEFAULT_REREAD_EVERY,
        objects_client: ApiClient | None = None,
    ) -> None:
        self.store = store
        self.view = StoreView(
            store, metrics, reread_every=view_reread, clock=clock, monotonic=monotonic
        )
        self.liveness = liveness
        self.gc_interval = gc_interval
        self.gc_due = 0.0  # monotonic time of the next garbage-collection pass
        ledger = Ledger(store, election.ident)
        who = f"controller {election.ident} gc"
        self.collection = Collection(self.view, ledger, metrics, who, add_grace)
        self.election = election
        self.metrics = metrics
        self.interval = interval
        self.ready_delay = ready_delay
        self.clock = clock
        self.monotonic = monotonic
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self._term = -1
        self.executor = Executor(store, election, metrics, self.stopping)
        self.memory: dict[str, PoolMemory] = {}  # per pool, from one pass to the next
        self.layouts: dict[str, Layouts] = {}  # per pool, while its spec is unchanged
        # The IPPool objects, when the store's pools are objects (docs/design.md 5.16).
        self.pool_objects = (
            PoolObjects(
                objects_client, store, self.executor, metrics, self.pass_now, clock, monotonic
            )
            if objects_client is not None
            else None
        )

    def on_leadership(self, leading: bool) -> None:
        self.metrics.leader.set(1 if leading else 0)
        if leading:
            self.wake.set()  # act at once, not an interval later

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.election.leading:
                self.run_pass_logged()
            else:
                self.view.forget()  # a standby holds no view; a new term reads whole
            self._until_next_pass()

    def _until_next_pass(self) -> None:
        """Wait the interval, or until a pass is asked for (`pass_now`, leadership, stop).
        In slices: `run` is the main thread's, where Python runs signal handlers, and a
        signal the kernel hands to another thread (SIGUSR1, `pass_now`) does not wake a
        main thread blocked in a wait; its handler runs once the slice ends."""
        deadline = time.monotonic() + self.interval
        while not self.wake.is_set() and (left := deadline - time.monotonic()) > 0:
            self.wake.wait(min(left, WAKE_SLICE))
        self.wake.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def pass_now(self) -> None:
        """Start the next pass now (after the one running, if any), not an interval on."""
        self.wake.set()

    def run_pass_logged(self) -> None:
        """One pass; an error is logged and counted, never raised (the next interval
        tries again from the store)."""
        started = time.monotonic()
        try:
            self.run_pass()
        except NotLeader:
            pass
        except Exception as e:
            self.metrics.pass_errors.inc()
            log.error("pass failed; retrying next interval", error=f"{type(e).__name__}: {e}")
        finally:
            self.metrics.pass_seconds.observe(time.monotonic() - started)

    # -- one pass

    def run_pass(self) -> None:
        if self.election.term != self._term:
            # A new term: what an earlier term saw is not evidence any more.
            self._term = self.election.term
            self.memory.clear()
            self.collection.new_term()
            if self.pool_objects is not None:
                self.pool_objects.new_term()
            self.gc_due = 0.0
        self.executor.fence()
        if self.liveness is not None and self.monotonic() >= self.gc_due:
            self.gc_due = self.monotonic() + self.gc_interval
            self.gc_pass(self.liveness)
        self.view.sync()  # after garbage collection: its frees are counted
        self._pool_passes(set(self.view.registered))
        if self.pool_objects is not None:
            self.pool_objects.reconcile(self.view)

    def _pool_passes(self, registered: set[str]) -> None:
        """Every pool's pass (a pool being deleted is skipped: `ipward pool delete` is
        removing its keys); then the metrics' snapshot, and the memory of pools gone."""
        counts: dict[tuple[str, str, str], int] = {}
        deficits: dict[tuple[str, str, str], int] = {}
        passed: set[str] = set()
        failed: set[str] = set()
        for name, kv in sorted(self.view.pools.items()):
            try:
                spec = PoolSpec.decode(kv.value)
            except (IpwardError, ValueError) as e:
                log.error("pool spec unreadable; pool skipped", key=kv.key, error=str(e))
                failed.add(name)
                continue
            # Block assignments compare the spec at this revision: none lands in a pool
            # being deleted, or in ranges that changed since.
            spec.revision = kv.mod_revision
            if spec.deleting:
                continue
            try:
                state = self._pool_pass(spec, registered)
            except (NotLeader, StoreError):
                raise  # the store or leadership: the whole pass stops here
            except Exception as e:  # one pool's bad data must not stall the others
                self.metrics.pass_errors.inc()
                log.error("pool pass failed", pool=name, error=f"{type(e).__name__}: {e}")
                failed.add(name)
                continue
            passed.add(name)
            counts.update(plan.block_counts(state))
            deficits.update(plan.deficits(state, plan.warmed(state, registered)))
        # Forget pools gone or being deleted; keep what a failed pool knew.
        self.memory = {p: m for p, m in self.memory.items() if p in passed or p in failed}
        self.layouts = {p: x for p, x in self.layouts.items() if p in passed}
        snapshot = self.metrics.snapshot
        for old_values, new_values in ((snapshot.blocks, counts), (snapshot.deficits, deficits)):
            new_values.update((k, v) for k, v in old_values.items() if k[0] in failed)
        snapshot.blocks, snapshot.deficits = counts, deficits

    def gc_pass(self, source: LivenessSource) -> list[gc.Verdict]:
        """One garbage-collection pass (`controller.collection`: the rules are
        `ipward.gc`'s, judged again only where something changed). Returns what it freed."""
        executor = self.executor
        return self.collection.collect(source, executor.fence, executor.after_failed_write)

    def _pool_pass(self, spec: PoolSpec, registered: set[str]) -> PoolState:
        """One pool's pass: its state read from the view, then three phases, each
        planned (`ipward.controller.plan`) from the state the one before left and applied
        by the executor. Keeps the pool's memory for the next pass, from the state it
        left even when it stops midway: what it applied is in the store (a block it
        resumed, remembered as in the hand-back, would be counted taken back next pass)."""
        pool = spec.name
        layouts = self.layouts.get(pool)
        if layouts is None or layouts.revision != spec.revision:
            layouts = self.layouts[pool] = Layouts(spec.revision)
        state = PoolState.read(spec, self.view.pool(pool), layouts)
        memory = self.memory.get(pool) or PoolMemory()
        now, mono = self.clock(), self.monotonic()
        gone = self.collection.gone_nodes - registered
        apply = self.executor.apply
        since = memory.empty_since  # until this pass has counted its own
        try:
            steps = plan.handshake_steps(
                state, memory.in_handshake, registered, gone, now, self.ready_delay
            )
            apply(state, steps)
            apply(state, plan.ask_back_from_gone_nodes(state, gone, now))
            since = plan.empty_since(state, registered, memory.empty_since, mono)
            passed: set[tuple[str, int]] = set()
            warmed = plan.warmed(state, registered)
            while assignments := plan.warm_round(state, warmed, passed):
                passed.update((a.node, a.family) for a in apply(state, assignments))
            apply(state, plan.surplus(state, registered, since, now, mono))
            apply(state, plan.prune(state))
        finally:
            self.memory[pool] = plan.remember(state, since)
        return state


__all__ = [
    "Controller",
    "ControllerError",
    "Metrics",
]
