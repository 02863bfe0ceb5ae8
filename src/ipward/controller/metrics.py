"""The controller's metrics, on a registry of its own (served by `ipward.cmd.daemon`'s HTTP
endpoint): leadership, handshakes, blocks by state, warm deficits, garbage collection."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ipward.gc import rules as gc

REREAD_REASONS = ("start", "compacted", "timer", "broken")  # `view`'s, named there

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


class _Snapshot(Collector):
    """Per-pass gauges, replaced whole at the end of each pass (so a scrape never sees
    a half-updated set, and label sets of vanished blocks disappear)."""

    def __init__(self, leading: Callable[[], bool]) -> None:
        self.leading = leading
        self.blocks: dict[tuple[str, str, str], int] = {}
        self.deficits: dict[tuple[str, str, str], int] = {}

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
        if self.leading():
            for labels, n in sorted(self.blocks.items()):
                blocks_family.add_metric(list(labels), n)
            for labels, n in sorted(self.deficits.items()):
                deficit_family.add_metric(list(labels), n)
        yield blocks_family
        yield deficit_family


class Metrics:
    """The controller's metrics, on a registry of its own."""

    def __init__(self, ident: str, leading: Callable[[], bool]) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.leader = Gauge(
            "ipward_controller_leader",
            "1 while this instance is the active controller, else 0.",
            registry=self.registry,
        )
        self.handshakes = Counter(
            "ipward_controller_handshakes",
            "Block release handshakes: started (marked), completed (released), aborted"
            " (refused and resumed, or taken back by the node).",
            ["result"],
            registry=self.registry,
        )
        for result in ("started", "completed", "aborted"):
            self.handshakes.labels(result=result)
        self.assigned = Counter(
            "ipward_controller_blocks_assigned",
            "Blocks assigned to nodes to keep their warm target.",
            registry=self.registry,
        )
        self.pass_seconds = Histogram(
            "ipward_controller_pass_seconds",
            "Time of one pass over every pool.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.pass_errors = Counter(
            "ipward_controller_pass_errors",
            "Passes abandoned on an error (logged; the pass runs again next interval).",
            registry=self.registry,
        )
        self.gc_candidates = Gauge(
            "ipward_gc_candidates",
            "Records found leaked by the last garbage-collection pass, by reason (freed"
            " when found again on the next pass at the same revision).",
            ["reason"],
            registry=self.registry,
        )
        self.gc_freed = Counter(
            "ipward_gc_freed",
            "Records freed by garbage collection, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.gc_skipped = Counter(
            "ipward_gc_skipped_passes",
            "Garbage-collection passes that judged nothing: no liveness source answered.",
            registry=self.registry,
        )
        self.gc_source_errors = Counter(
            "ipward_gc_source_errors",
            "Liveness reads that failed (nothing reclaimed on their account), by source.",
            ["source"],
            registry=self.registry,
        )
        self.gc_seconds = Histogram(
            "ipward_gc_pass_seconds",
            "Time of one garbage-collection pass, liveness reads included.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        for reason in (*gc.REASONS, *gc.RETIRE_REASONS):
            self.gc_candidates.labels(reason=reason).set(0)
            self.gc_freed.labels(reason=reason)
        for source in ("runtime", "cluster"):
            self.gc_source_errors.labels(source=source)
        self.view_lag = Gauge(
            "ipward_controller_view_lag_revisions",
            "Revisions the controller's store view (kept from a watch) was behind the store"
            " when the last pass began (it catches up before the pass reads it).",
            registry=self.registry,
        )
        self.view_rereads = Counter(
            "ipward_controller_view_rereads",
            "Whole reads of the store by the controller's view, by reason: start, compacted"
            " (the watch's history was gone), timer (the safety net), broken (the watch"
            " stream broke or fell behind).",
            ["reason"],
            registry=self.registry,
        )
        for reason in REREAD_REASONS:
            self.view_rereads.labels(reason=reason)
        self.info = Gauge(
            "ipward_controller_info", "This instance's id.", ["id"], registry=self.registry
        )
        self.info.labels(id=ident).set(1)
        self.snapshot = _Snapshot(leading)
        self.registry.register(self.snapshot)


# -- the passes --------------------------------------------------------------------------
