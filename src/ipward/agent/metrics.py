"""The agent's metrics, on a registry of its own (served by `ipward.cmd.daemon`'s HTTP
endpoint)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)


class Metrics:
    """The agent's metrics, on a registry of its own (not prometheus_client's global)."""

    def __init__(self, node: str) -> None:
        disable_created_metrics()  # no `_created` series: timestamps nobody graphs
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "ipward_agent_requests",
            "CNI calls answered, by command and result code (0: success, else the CNI error code).",
            ["command", "code"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "ipward_agent_request_seconds",
            "Time to answer a CNI call, from its last byte read to its answer sent.",
            ["command"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "ipward_agent_in_flight",
            "Connections open: the request being read, waiting for a worker or served, or"
            " the answer being written.",
            registry=self.registry,
        )
        self.protocol_errors = Counter(
            "ipward_agent_protocol_errors",
            "Requests not served: not our protocol or version, too large, incomplete at"
            " their deadline (each answered with an error), or cut short by the peer.",
            registry=self.registry,
        )
        self.refused = Counter(
            "ipward_agent_refused_peers",
            "Connections refused by the peer credential check.",
            registry=self.registry,
        )
        self.turned_away = Counter(
            "ipward_agent_turned_away",
            "Connections answered 11 without being read: too many open, or too many of"
            " one peer being read at once.",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_freed = Counter(
            "ipward_agent_reconcile_freed",
            "Records freed by reconciliation with the runtime, by reason (sandbox-gone).",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_skipped = Counter(
            "ipward_agent_reconcile_skipped",
            "Reconciliation passes that freed nothing because the runtime could not be"
            " trusted: unreachable, or listing two ready sandboxes for one pod.",
            registry=self.registry,
        )
        self.teardowns_finished = Counter(
            "ipward_agent_teardowns_finished",
            "Stopped sandboxes whose teardown the agent had its runtime finish (their DEL"
            " refused while it was down is retried by no kubelet for a deleted pod).",
            registry=self.registry,
        )
        self.reconcile_passes = Counter(
            "ipward_agent_reconcile_passes",
            "Reconciliation passes completed with a runtime view.",
            registry=self.registry,
        )
        self.node_index_reads = Counter(
            "ipward_agent_node_index_reads",
            "Reads of the node's whole index for reconciliation, which a watch then keeps"
            " current, by reason: start, compacted (the watch's history was gone), broken"
            " (the stream ended or the store was unreachable).",
            ["reason"],
            registry=self.registry,
        )
        self.info = Gauge(
            "ipward_agent_info", "The node this agent serves.", ["node"], registry=self.registry
        )
        self.info.labels(node=node).set(1)
