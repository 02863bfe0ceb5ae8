"""`ipward controller`: one active per cluster. Keeps every registered node's free
addresses at or above its pool's warm target by assigning blocks, and asks surplus blocks
back through the release handshake (DESIGN.md 5.3, the steps in `ipward.ipam.blocks`).

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
the lease alone (it has expired, or the key is not ours; and SQLite hands a deleted
lease's id out again, so revoking an id no longer held could end someone else's lease).
Only a clean stop (SIGTERM, SIGINT) resigns: compare-and-delete of the key, then revoke.

A pass (leader only, every --interval), per pool, from the store view
(`ipward.controller.view`: read whole once, kept current from a watch, brought up to the
store's revision at the start of the pass; a standby lets it go):
  * handshake steps on blocks of registered nodes: `refused` -> resume (an aborted
    handshake); `ready` answered at least --ready-delay ago -> release (completed);
    `marked` waits for the node's agent. A block seen in the handshake and later seen
    `active` without our resume was taken back by its node (aborted; counted from this
    process's memory, so a handshake started and taken back between two passes, or
    across a change of leader, may go uncounted).
  * per registered node and family: free = sum over its active blocks of usable
    addresses minus records. While free < warm: assign a block (one per node short
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
from collections import Counter as Tally
from typing import TYPE_CHECKING

from ipward.cluster.election import Election
from ipward.cluster.liveness import LivenessSource
from ipward.controller.collection import Collection
from ipward.controller.metrics import Metrics
from ipward.controller.view import DEFAULT_REREAD_EVERY, StoreView
from ipward.core import log
from ipward.core.errors import IpwardError
from ipward.core.keys import LEADER_KEY
from ipward.core.policy import ADD_GRACE
from ipward.core.pool import PoolSpec
from ipward.core.records import (
    ACTIVE,
    MARKED,
    READY,
    REFUSED,
    BlockRecord,
)
from ipward.gc import rules as gc
from ipward.ipam import blocks, pools
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreError
from ipward.store.base import Compare

if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.core.addr import Block
    from ipward.store.base import KeyValue

DEFAULT_METRICS = "127.0.0.1:9311"


class ControllerError(IpwardError):
    """The controller cannot start as asked (the CLI prints the message, exit status 2)."""


class NotLeader(Exception):
    """Leadership is gone (or the controller is stopping): abandon the pass."""


class _PoolState:
    """What one pool pass read of a pool (blocks, records per block, fills), and what
    its steps changed since: a block whose record was rewritten has no KeyValue (it is
    no candidate again this pass)."""

    __slots__ = ("block_kvs", "blocks", "fills", "gone", "mono", "now", "records", "spec")

    def __init__(self, spec: PoolSpec, now: float, mono: float, gone: frozenset[str]) -> None:
        self.spec = spec
        self.now = now
        self.mono = mono
        self.gone = gone  # nodes known gone (lease expired, not listed by the cluster)
        self.blocks: dict[str, BlockRecord] = {}
        self.block_kvs: dict[str, KeyValue | None] = {}
        self.records: Tally[str] = Tally()  # address records per block
        self.fills: dict[tuple[int, str], str] = {}  # (family, node) -> the block it fills


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
    ) -> None:
        self.store = store
        self.view = StoreView(store, metrics, reread_every=view_reread, monotonic=monotonic)
        self.liveness = liveness
        self.add_grace = add_grace
        self.gc_interval = gc_interval
        self.gc_due = 0.0  # monotonic time of the next garbage-collection pass
        self.gone_nodes: frozenset[str] = frozenset()  # as of the last GC pass
        self.ledger = Ledger(store, election.ident)
        who = f"controller {election.ident} gc"
        self.collection = Collection(self.view, self.ledger, metrics, who, add_grace)
        self.election = election
        self.metrics = metrics
        self.interval = interval
        self.ready_delay = ready_delay
        self.clock = clock
        self.monotonic = monotonic
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self._term = -1
        # Per (pool, cidr): when first seen empty and active (monotonic); and the
        # handshake state last seen, to notice a block its node took back.
        self.empty_since: dict[tuple[str, str], float] = {}
        self.in_handshake: dict[tuple[str, str], str] = {}

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
            self.wake.wait(self.interval)
            self.wake.clear()

    def stop(self) -> None:
        self.stopping.set()
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

    # -- leadership checks around every write

    def _fence(self) -> list[Compare]:
        fence = self.election.fence()
        if fence is None or self.stopping.is_set():
            raise NotLeader
        return fence

    def _after_failed_write(self) -> None:
        """A step lost its compare-and-swap: a race with the node's agent (fine: the
        next pass reads again), or our fence (step down)."""
        mine = self.election.value()
        if mine is None:
            raise NotLeader
        kv = self.store.get(LEADER_KEY)
        if kv is None or kv.value != mine:
            self.election.step_down("fenced: a write failed and the leader key is not ours")
            raise NotLeader

    # -- one pass

    def run_pass(self) -> None:
        if self.election.term != self._term:
            # A new term: what an earlier term saw is not evidence any more.
            self._term = self.election.term
            self.empty_since.clear()
            self.in_handshake.clear()
            self.collection.forget()
            self.gone_nodes = frozenset()
            self.gc_due = 0.0
        self._fence()
        if self.liveness is not None and self.monotonic() >= self.gc_due:
            self.gc_due = self.monotonic() + self.gc_interval
            self.gc_pass(self.liveness)
        self.view.sync()  # after garbage collection: its frees are counted
        nodes = set(self.view.registered)
        counts: dict[tuple[str, str, str], int] = {}
        deficits: dict[tuple[str, str, str], int] = {}
        seen: set[tuple[str, str]] = set()
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
                continue  # `ipward pool delete` is removing its keys
            try:
                self._pool_pass(spec, nodes, counts, deficits, seen)
            except (NotLeader, StoreError):
                raise  # the store or leadership: the whole pass stops here
            except Exception as e:  # one pool's bad data must not stall the others
                self.metrics.pass_errors.inc()
                log.error("pool pass failed", pool=name, error=f"{type(e).__name__}: {e}")
                failed.add(name)
        # Forget blocks gone or out of the handshake; keep what a failed pool knew.
        for memory in (self.empty_since, self.in_handshake):
            for key in [k for k in memory if k not in seen and k[0] not in failed]:
                del memory[key]
        snapshot = self.metrics.snapshot
        for old_values, new_values in ((snapshot.blocks, counts), (snapshot.deficits, deficits)):
            new_values.update((k, v) for k, v in old_values.items() if k[0] in failed)
        snapshot.blocks, snapshot.deficits = counts, deficits

    def gc_pass(self, source: LivenessSource) -> list[gc.Verdict]:
        """One garbage-collection pass (`controller.collection`: the rules are
        `ipward.gc`'s, judged again only where something changed). Returns what it freed."""
        freed = self.collection.collect(source, self._fence, self._after_failed_write)
        self.gone_nodes = self.collection.gone_nodes
        return freed

    def _pool_pass(
        self,
        spec: PoolSpec,
        nodes: set[str],
        counts: dict[tuple[str, str, str], int],
        deficits: dict[tuple[str, str, str], int],
        seen: set[tuple[str, str]],
    ) -> None:
        """One pool's pass, in steps over one read of its state (each step's writes are
        fenced and update that state for the steps after it)."""
        state = self._read_pool(spec, nodes)
        self._handshake_steps(state, nodes, seen)  # 1. blocks already in the handshake
        self._ask_back_from_gone_nodes(state)
        mine, free = self._free_per_node(state, nodes)  # 2. per registered node and family
        self._warm(state, free)  # 3. warm target
        # 4. Surplus, then what is still missing.
        pool = spec.name
        for (node, family), own in mine.items():
            free[(node, family)] = self._surplus(
                spec,
                node,
                own,
                free[(node, family)],
                state.records,
                state.block_kvs,
                state.blocks,
                state.fills.get((family, node)),
                state.now,
                state.mono,
            )
            deficits[(pool, node, str(family))] = max(0, spec.warm - free[(node, family)])
        for block_state in state.blocks.values():
            labels = (pool, block_state.node, block_state.state)
            counts[labels] = counts.get(labels, 0) + 1
        # 5. After a change of the pool's ranges: what its new layout does not use, and
        # earlier layouts no record holds any more (`ipam.pools.prune`, fenced).
        if spec.retired or any(spec.block_by_cidr(cidr) is None for cidr in state.blocks):
            pools.prune(self.store, pool, self._fence())

    def _read_pool(self, spec: PoolSpec, nodes: set[str]) -> _PoolState:
        """The pool's blocks, records per block and fills, from the view (one revision:
        an allocation of a fresh address after it moves the block's revision, so a mark
        decided on a stale count loses its CAS). The blocks are copied: the steps change
        them for the steps after."""
        state = _PoolState(spec, self.clock(), self.monotonic(), self.gone_nodes - nodes)
        read = self.view.pool(spec.name)
        for cidr, (kv, block) in read.blocks.items():
            state.blocks[cidr] = block
            state.block_kvs[cidr] = kv
        state.records = read.records  # only read by the steps
        state.fills = read.fills
        return state

    def _handshake_steps(
        self, state: _PoolState, nodes: set[str], seen: set[tuple[str, str]]
    ) -> None:
        """The next step of every block in the handshake: a gone node's marked block
        answered for it, a refused one resumed, a ready one past the ready delay handed
        back; a block taken back by its node counted as an aborted handshake."""
        pool = state.spec.name
        for cidr in list(state.blocks):
            block_state = state.blocks[cidr]
            key = (pool, cidr)
            seen.add(key)
            st, node = block_state.state, block_state.node
            if st == ACTIVE:
                if self.in_handshake.pop(key, None) is not None:
                    self.metrics.handshakes.labels(result="aborted").inc()
                    log.info(
                        "handshake aborted",
                        pool=pool,
                        block=cidr,
                        node=node,
                        reason="the node took the block back (it needs the space)",
                    )
                continue
            if st not in (MARKED, READY, REFUSED):
                continue
            self.in_handshake[key] = st
            self.empty_since.pop(key, None)
            current = state.block_kvs[cidr]
            if current is None:
                continue
            if node in state.gone and st == MARKED:
                self._answer_for_gone_node(state, cidr, current)
            elif node not in nodes and node not in state.gone:
                continue  # an unregistered node's block: left alone until known gone
            elif st == REFUSED:
                self._resume(state, cidr, current)
            elif st == READY:
                self._complete_hand_back(state, cidr, current)

    def _answer_for_gone_node(self, state: _PoolState, cidr: str, current: KeyValue) -> None:
        """Its agent will never answer: answer for it, by the same compares."""
        answer = blocks.answer(self.store, state.spec, current, state.now, self._fence())
        if answer is None:
            self._after_failed_write()
        log.info(
            "answered for a gone node",
            pool=state.spec.name,
            block=cidr,
            node=state.blocks[cidr].node,
            answer=answer,
            reason="node lease expired and the cluster no longer lists it",
        )

    def _resume(self, state: _PoolState, cidr: str, current: KeyValue) -> None:
        pool = state.spec.name
        if not blocks.resume(self.store, pool, current, self._fence()):
            self._after_failed_write()
            return
        self.metrics.handshakes.labels(result="aborted").inc()
        del self.in_handshake[(pool, cidr)]
        state.blocks[cidr] = state.blocks[cidr].resumed()
        state.block_kvs[cidr] = None  # changed: not a candidate again this pass
        log.info(
            "handshake aborted",
            pool=pool,
            block=cidr,
            node=state.blocks[cidr].node,
            reason="the node's agent refused: addresses allocated",
        )

    def _complete_hand_back(self, state: _PoolState, cidr: str, current: KeyValue) -> None:
        answered = state.blocks[cidr].answered_at
        waited = state.now - answered if answered is not None else 0.0
        if waited < self.ready_delay:
            return
        if not blocks.complete_hand_back(self.store, state.spec, current, self._fence()):
            self._after_failed_write()
            return
        self.metrics.handshakes.labels(result="completed").inc()
        del self.in_handshake[(state.spec.name, cidr)]
        node = state.blocks.pop(cidr).node
        log.info(
            "handshake completed",
            pool=state.spec.name,
            block=cidr,
            node=node,
            reason=f"answered ready {waited:.1f}s ago (ready delay {self.ready_delay:g}s)",
        )

    def _ask_back_from_gone_nodes(self, state: _PoolState) -> None:
        """Blocks of gone nodes: emptied by garbage collection, then asked back at once."""
        pool = state.spec.name
        for cidr, block_state in state.blocks.items():
            gone_kv = state.block_kvs.get(cidr)
            block = state.spec.block_by_cidr(cidr)
            if (
                block_state.node not in state.gone
                or not block_state.active
                or state.records[cidr]
                or gone_kv is None
                or block is None
                or not blocks.releasable(block)
            ):
                continue
            if blocks.mark(self.store, pool, gone_kv, state.now, self._fence()):
                self.metrics.handshakes.labels(result="started").inc()
                self.in_handshake[(pool, cidr)] = MARKED
                state.blocks[cidr] = block_state.marked(state.now)
                log.info(
                    "handshake started",
                    pool=pool,
                    block=cidr,
                    node=block_state.node,
                    reason="its node is gone (lease expired, not listed by the cluster)",
                )
            else:
                self._after_failed_write()

    def _free_per_node(
        self, state: _PoolState, nodes: set[str]
    ) -> tuple[dict[tuple[str, int], list[tuple[str, Block]]], dict[tuple[str, int], int]]:
        """Per registered node and family: its active blocks, and what is free in them
        (and since when each block is empty, for the surplus step)."""
        pool = state.spec.name
        by_node: dict[str, list[str]] = {}
        for cidr, block_state in state.blocks.items():
            by_node.setdefault(block_state.node, []).append(cidr)
        free: dict[tuple[str, int], int] = {}
        mine: dict[tuple[str, int], list[tuple[str, Block]]] = {}
        for node in sorted(nodes):
            for rs in state.spec.range_sets:
                own = []
                for cidr in by_node.get(node, []):
                    block = rs.block_by_cidr(cidr)
                    if state.blocks[cidr].active and block is not None:
                        own.append((cidr, block))
                        if state.records[cidr] or state.block_kvs.get(cidr) is None:
                            self.empty_since.pop((pool, cidr), None)
                        else:
                            self.empty_since.setdefault((pool, cidr), state.mono)
                mine[(node, rs.family)] = own
                free[(node, rs.family)] = sum(
                    max(0, b.usable_count() - state.records[c]) for c, b in own
                )
        return mine, free

    def _warm(self, state: _PoolState, free: dict[tuple[str, int], int]) -> None:
        """Warm target: one block per node short of it per round, so a pool running out
        is shared rather than given to the first nodes in name order."""
        spec = state.spec
        short = [nf for nf in free if free[nf] < spec.warm]
        while short:
            still = []
            for node, family in short:
                before = free[(node, family)]
                given = blocks.assign(self.store, spec, family, node, self._fence())
                if given is None:
                    self._after_failed_write()
                    log.debug(
                        "no block assigned (pool exhausted or a race lost); next pass",
                        pool=spec.name,
                        node=node,
                        family=family,
                        free=before,
                        warm=spec.warm,
                    )
                    continue
                block = spec.block_by_cidr(given)
                free[(node, family)] += block.usable_count() if block is not None else 0
                state.blocks[given] = BlockRecord.claimed(node, 0, spec.version)
                self.metrics.assigned.inc()
                log.info(
                    "warm block assigned",
                    pool=spec.name,
                    block=given,
                    node=node,
                    reason=f"{before} free < warm target {spec.warm}",
                    free=free[(node, family)],
                )
                if free[(node, family)] < spec.warm:
                    still.append((node, family))
            short = still

    def _surplus(
        self,
        spec: PoolSpec,
        node: str,
        mine: list[tuple[str, Block]],
        free: int,
        records: Tally[str],
        block_kvs: dict[str, KeyValue | None],
        states: dict[str, BlockRecord],
        filling: str | None,
        now: float,
        mono: float,
    ) -> int:
        # The block the node fills fresh addresses from goes last: its agent is likely
        # about to use it.
        for cidr, block in sorted(mine, key=lambda cb: (cb[0] == filling, cb[0])):
            key = (spec.name, cidr)
            kv = block_kvs.get(cidr)
            since = self.empty_since.get(key)
            if kv is None or records[cidr] or since is None or not blocks.releasable(block):
                continue
            empty_for = mono - since
            size = block.usable_count()
            if empty_for < spec.release_delay or free - size < spec.warm:
                continue
            if blocks.mark(self.store, spec.name, kv, now, self._fence()):
                free -= size
                self.metrics.handshakes.labels(result="started").inc()
                self.in_handshake[key] = MARKED
                self.empty_since.pop(key, None)
                states[cidr] = states[cidr].marked(now)
                log.info(
                    "handshake started",
                    pool=spec.name,
                    block=cidr,
                    node=node,
                    reason=f"surplus: empty for {empty_for:.1f}s (release delay"
                    f" {spec.release_delay:g}s); {free} free without it, warm {spec.warm}",
                )
            else:
                self._after_failed_write()
        return free


__all__ = [
    "Controller",
    "ControllerError",
    "Metrics",
]
