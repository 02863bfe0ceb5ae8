"""The controller's garbage collection, judged incrementally: a steady pass judges again
only the records whose verdict may have changed since the last pass, and keeps every
other record's last verdict, so it costs what changed, not what exists.

The rules are `ipward.gc.rules`' (`gather`, `judge`, `Confirmations`, `confirmed_live`,
`free`), in their order: the view brought to the store's revision (records and
registrations read), then liveness read, then judging; a candidate is freed when the
previous pass found it too at the same revision, confirmed live, by a fenced
compare-and-delete on that revision.

What a record's verdict depends on: the record; its node's runtime view (its sandbox's
entry, or which way the runtime failed); the cluster view (its pod by UID, whether its
node is listed) and its node's registration; and time, through the ADD grace (with its
node's clock offset and when the view first saw the record, `ipward.gc.clocks`) and a
terminal pod's grace. `judge` says which verdicts are `settled`: kept, and kept for as
long as the record and those subjects stay the same, however time passes (a later
`as_of` only ends graces; an earlier one only starts them, which keeps). Everything else
is unsettled (a candidate, a record inside a grace) and judged again every pass. So a
pass judges again:
  * the records the view's events changed (`StoreView.take_changes`);
  * the records of a node whose registration came or went, whose listing in the cluster
    changed, or whose runtime answered differently (of a runtime listing both times,
    only the records whose sandbox is listed differently);
  * the records of a pod UID the cluster view lists differently;
  * the unsettled ones.
and everything when the cluster view started or stopped answering, the view was read
whole (at the start, on compaction, a broken watch, and its re-read timer: the periodic
full judgement), it noted too many changes, no source answered at the last pass, or a
new term began.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipward.cluster.liveness import ClusterView, LivenessSource, NodeView
from ipward.core import log
from ipward.core.names import node_name_problem
from ipward.gc import rules as gc

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from ipward.controller.metrics import Metrics
    from ipward.controller.view import Changes, StoreView
    from ipward.gc.rules import Held
    from ipward.ipam.ledger import Ledger
    from ipward.store.base import Compare


@dataclass
class Seen:
    """One incremental look: what it read and judged."""

    records: int  # records held (the judged ones and those whose verdict was kept)
    judged: int  # records judged on this pass
    nodes: list[str]  # the nodes of the records
    evidence: gc.Evidence
    candidates: list[gc.Verdict]  # every record found leaked, judged on this pass
    retirements: list[gc.Retirement]


class Collection:
    """Garbage collection over a `StoreView`, remembering between passes what it needs
    to judge only what changed (see the module's docstring)."""

    def __init__(
        self, view: StoreView, ledger: Ledger, metrics: Metrics, who: str, grace: float
    ) -> None:
        self.view = view
        self.ledger = ledger
        self.metrics = metrics
        self.who = who
        self.grace = grace
        self.new_term()

    def new_term(self) -> None:
        """What an earlier term saw is no evidence: forget it, gone nodes too."""
        self.gone_nodes: frozenset[str] = frozenset()  # as of the last pass with a cluster view
        self.forget()

    def forget(self) -> None:
        """Judge everything at the next pass, confirming nothing of the earlier ones (a
        new term; no source answered)."""
        self.confirmations = gc.Confirmations()
        self.retirements = gc.Confirmations()
        self._known = False  # nothing judged yet: the next look judges everything
        self._by_node: dict[str, set[str]] = {}  # node -> `ips/` keys of its records
        self._by_uid: dict[str, tuple[str, ...]] = {}  # pod UID -> its records' keys
        self._unsettled: dict[str, gc.Verdict] = {}  # judged again every pass
        self._runtimes: dict[str, NodeView | str] = {}  # the last look's answers
        self._cluster: ClusterView | str = "not asked"

    # -- one pass

    def collect(
        self,
        source: LivenessSource,
        fence: Callable[[], Sequence[Compare]],
        after_failed_write: Callable[[], None],
    ) -> list[gc.Verdict]:
        """One garbage-collection pass: look, then free what the previous pass found
        too, each fenced (`fence()`, which raises once leadership is gone); a free that
        loses its compare calls `after_failed_write`. Returns what it freed."""
        started = time.monotonic()
        seen = self.look(source)
        nodes, evidence = seen.nodes, seen.evidence
        cluster_ok = isinstance(evidence.cluster, ClusterView)
        runtime_ok = [n for n in nodes if isinstance(evidence.nodes.get(n), NodeView)]
        # Only what the source covers can fail: a `k8s://` controller has no runtimes.
        if source.covers_cluster and not cluster_ok:
            self.metrics.gc_source_errors.labels(source="cluster").inc()
        if source.covers_runtimes and len(runtime_ok) < len(nodes):
            self.metrics.gc_source_errors.labels(source="runtime").inc()
        if not cluster_ok and not runtime_ok:
            self.metrics.gc_skipped.inc()
            self.forget()
            log.warning(
                "garbage collection: no liveness source answered; nothing judged",
                cluster=evidence.cluster,
                records=seen.records,
            )
            return []
        if isinstance(evidence.cluster, ClusterView):
            unlisted = {*nodes, *self.view.block_nodes()}
            unlisted -= evidence.registered
            unlisted -= evidence.cluster.nodes
            unnamed = sorted(n for n in unlisted if node_name_problem(n))
            if unnamed:  # written before names were checked: never judged gone
                log.error("records name invalid nodes; not judged gone", nodes=unnamed)
            self.gone_nodes = frozenset(unlisted.difference(unnamed))
        candidates = Tally(
            [v.reason for v in seen.candidates] + [r.reason for r in seen.retirements if r.reason]
        )
        for reason in (*gc.REASONS, *gc.RETIRE_REASONS):
            self.metrics.gc_candidates.labels(reason=reason).set(candidates[reason])
        freed = []
        for verdict in self.confirmations.confirm(seen.candidates):
            if not gc.confirmed_live(source, verdict):
                continue
            if gc.free(self.ledger, verdict, self.who, fence()):
                self.metrics.gc_freed.labels(reason=str(verdict.reason)).inc()
                freed.append(verdict)
            else:
                after_failed_write()
        for retirement in self.retirements.confirm(seen.retirements):
            if not gc.confirmed_live(source, retirement):
                continue
            if gc.retire(self.ledger, retirement, self.who, fence()):
                self.metrics.gc_freed.labels(reason=str(retirement.reason)).inc()
            else:
                after_failed_write()
        self.metrics.gc_seconds.observe(time.monotonic() - started)
        log.debug(
            "garbage collection pass",
            records=seen.records,
            judged=seen.judged,
            candidates=dict(candidates),
            freed=len(freed),
            gone_nodes=sorted(self.gone_nodes),
        )
        return freed

    def look(self, source: LivenessSource | None) -> Seen:
        """Records (the view at the store's revision), registrations, then liveness;
        then judge what may have changed (all of it the first time)."""
        view = self.view
        view.sync()
        changes = view.take_changes()
        registered = view.registrations()
        everything = changes.everything or not self._known
        self._known = False  # until this look is done: one that fails leaves no half memory
        if everything:
            self._index_all()
            dirty: set[str] = set(view.records)
        else:
            dirty = self._records_changed(changes)
        nodes = sorted(self._by_node)
        evidence = gc.gather(
            source,
            nodes,
            grace=self.grace,
            registered=registered.nodes,
            runtimes=registered.runtimes,
            agents=True,  # a controller serves agents: cluster mode
            offsets=registered.offsets,
            clock=view.clock,
            monotonic=view.monotonic,
        )
        if not everything:
            changed = self._liveness_changed(evidence)
            dirty = set(view.records) if changed is None else dirty | changed
        dirty.update(self._unsettled)
        judged = 0
        for key in dirty:
            held = view.records.get(key)
            if held is None or held.record.is_detached:
                self._unsettled.pop(key, None)
                continue
            verdict = gc.judge(held, evidence)
            judged += 1
            if verdict.settled:
                self._unsettled.pop(key, None)
            else:
                self._unsettled[key] = verdict
        self._runtimes = dict(evidence.nodes)
        self._cluster = evidence.cluster
        self._known = True
        return Seen(
            sum(map(len, self._by_node.values())),
            judged,
            nodes,
            evidence,
            [v for v in self._unsettled.values() if v.reason],
            [
                gc.judge_reservation(r, evidence.cluster, self.grace)
                for r in view.reservations.values()
            ],
        )

    def verdict_of(self, key: str) -> str | None:
        """The reason the last look found the record `key` leaked, None when kept."""
        verdict = self._unsettled.get(key)
        return None if verdict is None else verdict.reason

    # -- what changed

    def _index_all(self) -> None:
        self._by_node = {}
        self._by_uid = {}
        self._unsettled = {}
        for key, held in self.view.records.items():
            self._index(key, held)

    def _index(self, key: str, held: Held) -> None:
        if held.record.is_detached:
            return  # no sandbox to judge: its reservation is retired by identity
        self._by_node.setdefault(held.node, set()).add(key)
        if uid := held.pod.uid:
            self._by_uid[uid] = (*self._by_uid.get(uid, ()), key)

    def _unindex(self, key: str, held: Held) -> None:
        if held.record.is_detached:
            return
        of_node = self._by_node.get(held.node, set())
        of_node.discard(key)
        if not of_node:
            self._by_node.pop(held.node, None)
        if uid := held.pod.uid:
            left = tuple(k for k in self._by_uid.get(uid, ()) if k != key)
            if left:
                self._by_uid[uid] = left
            else:
                self._by_uid.pop(uid, None)

    def _records_changed(self, changes: Changes) -> set[str]:
        """Index what the view's events changed; the records to judge again for them
        (the changed records, and those of a node registered or unregistered)."""
        records = self.view.records
        for key, before in changes.records.items():
            if before is not None:
                self._unindex(key, before)
            now = records.get(key)
            if now is not None:
                self._index(key, now)
            else:
                self._unsettled.pop(key, None)
        dirty = set(changes.records)
        for node in changes.nodes:
            dirty.update(self._by_node.get(node, ()))
        return dirty

    def _liveness_changed(self, evidence: gc.Evidence) -> set[str] | None:
        """The records whose liveness answers differ from the last look's (None: the
        cluster view came or went, judge everything)."""
        records = self.view.records
        dirty: set[str] = set()
        for node, now in evidence.nodes.items():
            then = self._runtimes.get(node)
            if now is then:
                continue
            of_node: Iterable[str] = self._by_node.get(node, ())
            if isinstance(now, NodeView) and isinstance(then, NodeView):
                sandboxes = now.changed_since(then)
                of_node = [k for k in of_node if records[k].container in sandboxes]
            elif isinstance(now, str) and isinstance(then, str):
                continue  # still no runtime answer: the reason's words changed, no verdict
            dirty.update(of_node)
        cluster, then_cluster = evidence.cluster, self._cluster
        if isinstance(cluster, ClusterView) and isinstance(then_cluster, ClusterView):
            if cluster is not then_cluster:
                pods, listed = cluster.changed_since(then_cluster)
                for uid in pods:
                    dirty.update(self._by_uid.get(uid, ()))
                for node in listed:
                    dirty.update(self._by_node.get(node, ()))
        elif isinstance(cluster, ClusterView) or isinstance(then_cluster, ClusterView):
            return None
        return dirty
