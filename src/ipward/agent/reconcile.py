"""Reconciliation (docs/design.md 5.5): the agent frees its node's records whose sandbox the
runtime reports gone, with garbage collection's rules."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ipward.agent.node_index import NodeIndex
from ipward.cluster.liveness import (
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    NotCovered,
)
from ipward.core import keys, log
from ipward.core.records import AddressRecord
from ipward.gc import rules as gc
from ipward.gc.clocks import OWN_CLOCK
from ipward.store import StoreError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.agent.server import Agent
    from ipward.store import Store


def confirmed(store: Store, verdict: gc.Verdict) -> gc.Verdict | None:
    """The verdict on the record itself: the same judgement, pinned to the record's own
    revision, when the record is still what its index entry's copy said (written in one
    transaction, they can only differ when it changed since the pass read it: then it
    is judged again next pass). None otherwise."""
    held = verdict.held
    kv = store.get(keys.ip_key(held.pool, held.ip))
    if kv is None or AddressRecord.decode(kv.value).encode() != held.record.encode():
        return None
    return gc.Verdict(replace(held, mod_revision=kv.mod_revision), verdict.reason, verdict.evidence)


FIRST_READ_WAITS = 40  # quarter seconds the first pass waits for the node index's copy


class Reconciler:
    """docs/design.md 5.5: on start and every `interval`, free this node's records whose sandbox
    the runtime positively reports gone, older than the ADD grace (the rules are
    `ipward.gc`'s; only `sandbox-gone` applies here, the runtime being the one source
    asked). A runtime that cannot be read, or that lists two ready sandboxes for one pod,
    frees nothing; the next try comes sooner (1 s, doubling up to `interval`). The node's
    records come from its index's copy (`index`), which the reconciler starts and stops.

    And it has the runtime finish the teardown of every sandbox listed stopped on two
    passes in a row, once (`finish_teardowns`): a DEL refused while the agent was down
    leaves a stopped sandbox whose network namespace still holds its address, and no
    kubelet retries the teardown of a deleted pod; finishing it sends the DEL, which
    frees the address in the order a teardown does (the namespace goes first)."""

    def __init__(
        self,
        agent: Agent,
        source: LivenessSource,
        *,
        grace: float,
        interval: float,
    ) -> None:
        self.agent = agent
        self.source = source
        self.grace = grace
        self.interval = interval
        self.index = NodeIndex(agent.store, agent.node, agent.metrics)
        self._stopped: set[str] = set()  # sandboxes listed stopped by the last pass
        self._finished: set[str] = set()  # those whose teardown the runtime was asked to finish
        self._can_finish = True  # the source can act (a runtime, not a file of views)
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)

    def start(self) -> None:
        self.index.start()
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=10)  # a source call ends within its own timeout
        self.index.stop()
        self.source.close()

    def _loop(self) -> None:
        # The first pass waits for the node index's copy rather than be refused at start.
        for _ in range(FIRST_READ_WAITS):
            if self.index.wait_read(0.25) or self.stopping.is_set():
                break
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                done = self.run_once() is not None
            except StoreError as e:
                log.warning("reconcile: store unreachable", node=self.agent.node, error=str(e))
                done = False
            except Exception as e:  # never let the thread die: log and retry
                log.error(
                    "reconcile failed", node=self.agent.node, error=f"{type(e).__name__}: {e}"
                )
                done = False
            if done:
                backoff = 1.0
                self.stopping.wait(self.interval)
            else:
                self.stopping.wait(min(backoff, self.interval))
                backoff = min(backoff * 2, self.interval)

    def run_once(self) -> list[gc.Verdict] | None:
        """One pass; the records freed, or None when the runtime gave no usable view."""
        node = self.agent.node
        started = time.perf_counter()
        held = self.index.held()  # records first, then the runtime
        # The node's records are its agent's: written on this clock (a step of it is
        # covered by when the copy first saw each record).
        evidence = gc.gather(
            self.source, [node], grace=self.grace, ask_cluster=False, offsets={node: OWN_CLOCK}
        )
        view = evidence.nodes[node]
        if not isinstance(view, NodeView):
            self.agent.metrics.reconcile_skipped.inc()
            log.warning("reconcile: nothing freed, runtime not usable", node=node, reason=view)
            return None
        self.finish_teardowns(view)
        freed = []
        for h in held:
            verdict = gc.judge(h, evidence)
            if verdict.reason is None:
                continue
            sure = confirmed(self.agent.store, verdict)
            if sure is None:
                continue
            if gc.free(self.agent.ledger, sure, f"agent {node} reconcile"):
                self.agent.metrics.reconcile_freed.labels(reason=sure.reason).inc()
                freed.append(sure)
        self.agent.metrics.reconcile_passes.inc()
        log.debug(
            "reconciled",
            node=node,
            records=len(held),
            sandboxes=len(view.sandboxes),
            freed=len(freed),
            ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return freed

    def finish_teardowns(self, view: NodeView) -> None:
        """Ask the runtime, once each, to finish the teardown of the sandboxes it lists
        stopped on this pass and the last (one pass leaves the kubelet its own teardown
        in flight); its DEL comes back through the agent."""
        stopped = {sid for sid, sandbox in view.sandboxes.items() if not sandbox.ready}
        due = sorted((stopped & self._stopped) - self._finished)
        self._stopped = stopped
        self._finished &= stopped  # a sandbox removed is forgotten
        for sandbox in due if self._can_finish else ():
            try:
                self.source.finish_teardown(view.node, sandbox)
            except NotCovered:
                self._can_finish = False  # a source that only reads: nothing to ask
                return
            except LivenessUnavailable as e:
                log.warning(
                    "runtime refused to finish a stopped sandbox's teardown; asked again next pass",
                    node=view.node,
                    sandbox=sandbox,
                    error=str(e),
                )
                continue
            self._finished.add(sandbox)
            self.agent.metrics.teardowns_finished.inc()
            log.info(
                "had the runtime finish a stopped sandbox's teardown",
                node=view.node,
                sandbox=sandbox,
                reason="listed stopped on two passes: a DEL it refused while the agent was"
                " down is retried by no kubelet for a deleted pod",
            )
