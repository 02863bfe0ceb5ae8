"""Reconciliation (DESIGN 5.5): the agent frees its node's records whose sandbox the
runtime reports gone, with garbage collection's rules."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ipward.cluster.liveness import (
    LivenessSource,
    NodeView,
)
from ipward.core import keys, log
from ipward.core.records import AddressRecord
from ipward.gc import rules as gc
from ipward.store import StoreError
from ipward.store.base import KeyValue

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.agent.server import Agent
    from ipward.store import Store


def node_records(store: Store, node: str) -> list[gc.Held]:
    """The node's allocation records that hold a sandbox, as its index (`nodeips/<node>/`)
    has copies of them, read with one range: what a pass reads grows with the node's
    records, never with the cluster's. Each carries its entry's revision; a free is
    confirmed against the record itself first (`confirmed`)."""
    copies = [
        KeyValue(keys.ip_key(pool, ip), kv.value, kv.create_revision, kv.mod_revision, 0)
        for kv in store.range(keys.node_ips_prefix(node))[0]
        for _, pool, ip in [keys.node_ip_parts(kv.key)]
    ]
    return gc.held_records(copies, node)


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


class Reconciler:
    """DESIGN 5.5: on start and every `interval`, free this node's records whose sandbox
    the runtime positively reports gone, older than the ADD grace (the rules are
    `ipward.gc`'s; only `sandbox-gone` applies here, the runtime being the one source
    asked). A runtime that cannot be read, or that lists two ready sandboxes for one pod,
    frees nothing; the next try comes sooner (1 s, doubling up to `interval`)."""

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
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=10)  # a source call ends within its own timeout
        self.source.close()

    def _loop(self) -> None:
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
        held = node_records(self.agent.store, node)  # records first, then the runtime
        evidence = gc.gather(self.source, [node], grace=self.grace, ask_cluster=False)
        view = evidence.nodes[node]
        if not isinstance(view, NodeView):
            self.agent.metrics.reconcile_skipped.inc()
            log.warning("reconcile: nothing freed, runtime not usable", node=node, reason=view)
            return None
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
