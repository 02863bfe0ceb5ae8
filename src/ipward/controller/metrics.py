"""The controller's metrics, on a registry of its own (served by `ipward.cmd.daemon`'s HTTP
endpoint): leadership, handshakes, blocks by state, warm deficits, garbage collection,
nodes' clocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ipward.core.policy import CLOCK_SKEW_BOUND
from ipward.gc import rules as gc
from ipward.store.follower import READ_REASONS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

M = TypeVar("M", Counter, Gauge, Histogram)


class _Snapshot(Collector):
    """Per-pass gauges, replaced whole at the end of each pass (so a scrape never sees
    a half-updated set, and label sets of vanished blocks disappear)."""

    def __init__(self, leading: Callable[[], bool]) -> None:
        self.leading = leading
        self.blocks: dict[tuple[str, str, str], int] = {}
        self.deficits: dict[tuple[str, str, str], int] = {}
        self.clock_offsets: dict[str, float] = {}  # node -> seconds, the skewed ones only

    def collect(self) -> Iterator[GaugeMetricFamily]:
        blocks_family = GaugeMetricFamily(
            "ipward_controller_blocks",
            "Blocks per pool, node and state (every node's, registered or not), as of the"
            " last pass of the leader.",
            labels=["pool", "node", "state"],
        )
        deficit_family = GaugeMetricFamily(
            "ipward_controller_warm_deficit",
            "Addresses a registered node is short of its pool's warm target, per family,"
            " after the last pass (left over when the pool has no block to give).",
            labels=["pool", "node", "family"],
        )
        skewed_family = GaugeMetricFamily(
            "ipward_clock_skewed_nodes",
            f"Registered nodes whose clock is certainly more than {CLOCK_SKEW_BOUND:g} s off"
            " the leader's, as measured from their registrations.",
        )
        offset_family = GaugeMetricFamily(
            "ipward_node_clock_offset_seconds",
            "A skewed node's clock minus the leader's (only the nodes counted in"
            " ipward_clock_skewed_nodes).",
            labels=["node"],
        )
        if self.leading():
            for labels, n in sorted(self.blocks.items()):
                blocks_family.add_metric(list(labels), n)
            for labels, n in sorted(self.deficits.items()):
                deficit_family.add_metric(list(labels), n)
            skewed_family.add_metric([], len(self.clock_offsets))
            for node, seconds in sorted(self.clock_offsets.items()):
                offset_family.add_metric([node], seconds)
        yield blocks_family
        yield deficit_family
        yield skewed_family
        yield offset_family


# The metrics: name -> help (the README lists them).
HELP = {
    "ipward_controller_leader": "1 while this instance is the active controller, else 0.",
    "ipward_controller_handshakes": "Block hand-back handshakes: started (marked), completed"
    " (handed back), aborted (refused and resumed, or taken back by the node).",
    "ipward_controller_blocks_assigned": "Blocks assigned to nodes to keep their warm target.",
    "ipward_controller_pass_seconds": "Time of one pass over every pool.",
    "ipward_controller_pass_errors": "Passes abandoned on an error (logged; the pass runs"
    " again next interval).",
    "ipward_gc_candidates": "Records found leaked by the last garbage-collection pass, by"
    " reason (freed when found again on the next pass at the same revision).",
    "ipward_gc_freed": "Records freed by garbage collection, by reason.",
    "ipward_gc_skipped_passes": "Garbage-collection passes that judged nothing: no liveness"
    " source answered.",
    "ipward_gc_source_errors": "Liveness reads that failed (nothing reclaimed on their"
    " account), by source.",
    "ipward_gc_pass_seconds": "Time of one garbage-collection pass, liveness reads included.",
    "ipward_controller_view_lag_revisions": "Revisions the controller's store view (kept from"
    " a watch) was behind the store when the last pass began (it catches up before the pass"
    " reads it).",
    "ipward_controller_view_rereads": "Whole reads of the store by the controller's view, by"
    " reason: start, compacted (the watch's history was gone), timer (the safety net),"
    " broken (the watch stream broke or fell behind).",
    "ipward_controller_pool_status_writes": "Status writes of IPPool objects (at most one per"
    " pool every 5 s, only when it changed; k8s:// stores whose pools are objects).",
    "ipward_controller_info": "This instance's id.",
}
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
GC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
HANDSHAKE_RESULTS = ("started", "completed", "aborted")
LIVENESS_SOURCES = ("runtime", "cluster")


class Metrics:
    """The controller's metrics, on a registry of its own; every label value known in
    advance is there from the start (at 0)."""

    def __init__(self, ident: str, leading: Callable[[], bool]) -> None:
        disable_created_metrics()
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def made(kind: type[M], name: str, labels: tuple[str, ...] = (), **more: Any) -> M:
            return kind(name, HELP[name], labels, registry=registry, **more)

        self.leader = made(Gauge, "ipward_controller_leader")
        self.handshakes = made(Counter, "ipward_controller_handshakes", ("result",))
        self.assigned = made(Counter, "ipward_controller_blocks_assigned")
        self.pass_seconds = made(Histogram, "ipward_controller_pass_seconds", buckets=PASS_BUCKETS)
        self.pass_errors = made(Counter, "ipward_controller_pass_errors")
        self.gc_candidates = made(Gauge, "ipward_gc_candidates", ("reason",))
        self.gc_freed = made(Counter, "ipward_gc_freed", ("reason",))
        self.gc_skipped = made(Counter, "ipward_gc_skipped_passes")
        self.gc_source_errors = made(Counter, "ipward_gc_source_errors", ("source",))
        self.gc_seconds = made(Histogram, "ipward_gc_pass_seconds", buckets=GC_BUCKETS)
        self.view_lag = made(Gauge, "ipward_controller_view_lag_revisions")
        self.view_rereads = made(Counter, "ipward_controller_view_rereads", ("reason",))
        self.pool_status_writes = made(Counter, "ipward_controller_pool_status_writes")
        self.info = made(Gauge, "ipward_controller_info", ("id",))
        for result in HANDSHAKE_RESULTS:
            self.handshakes.labels(result=result)
        for reason in (*gc.REASONS, *gc.RETIRE_REASONS):
            self.gc_candidates.labels(reason=reason).set(0)
            self.gc_freed.labels(reason=reason)
        for source in LIVENESS_SOURCES:
            self.gc_source_errors.labels(source=source)
        for reason in READ_REASONS:
            self.view_rereads.labels(reason=reason)
        self.info.labels(id=ident).set(1)
        self.snapshot = _Snapshot(leading)
        self.registry.register(self.snapshot)
