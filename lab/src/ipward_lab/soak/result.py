"""What a soak run is asked (`Options`) and what it found (`Result`: violations,
per-second samples, faults, GC frees), with the names it works under."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

API_FAULTS = ("api-expire", "api-cut", "api-down", "api-stall")
STORE_FAULTS = ("store-api-kill", "store-conflicts", "store-relist")  # --store k8s
FAULTS = (
    "kill-agent",
    "kill-leader",
    "kill-etcd",
    "stall-runtime",
    "drop-del",
    "delay-del",
    *API_FAULTS,
    *STORE_FAULTS,
)
BACKENDS = ("sqlite", "etcd", "etcd-cluster", "k8s")
APIS = ("none", "test", "real")  # where the cluster is published: file only, or an API server
# The ADD grace must outlast an ADD from its commit to its return to the runtime, which
# lists the sandbox only then (docs/design.md 5.4). On the Kubernetes store, under its
# API server's faults, that is up to the store's call timeout (10 s): a run found a
# record judged sandbox-gone 3.6 s after its commit, its ADD not yet returned, with 3 s.
K8S_GRACE = 12.0
NS = "soak"
NETWORK = "soaknet"
POOL = "soak"
GC_REASONS = re.compile(
    r"(sandbox-gone|pod-gone|pod-terminal|node-gone|statefulset-deleted"
    r"|ordinal-out-of-range|ttl-expired)"
)


@dataclass
class Options:
    nodes: int = 3
    pods: int = 30
    rate: float = 4.0  # workload actions per second
    duration: float = 60.0
    seed: int = 1
    faults: tuple[str, ...] = FAULTS
    backend: str = "sqlite"
    api: str = "none"
    grace: float = 3.0  # ADD grace of agents and controllers (K8S_GRACE on --store k8s)
    gc_interval: float = 0.5
    settle: float = 120.0  # longest wait for convergence at the end


def fault_unavailable(kind: str, backend: str, api: str) -> str | None:
    """Why fault `kind` cannot be made in a run on this store and API server; None when
    it can."""
    if kind == "kill-etcd" and backend != "etcd-cluster":
        return "needs --store etcd-cluster (a member of three to kill)"
    if kind in STORE_FAULTS and backend != "k8s":
        return "needs --store k8s (the store's own kube-apiserver)"
    if kind in API_FAULTS and api == "none":
        return "needs an API server (--api test or real)"
    if kind in API_FAULTS and api == "real" and kind != "api-down":
        return "needs --api test (the real kube-apiserver can only be restarted: api-down)"
    return None


class SoakError(Exception):
    """The run cannot be set up as asked (a missing binary)."""


@dataclass
class Violation:
    at: float
    kind: str  # shared-address, live-loss, not-converged, check, leak, stale-answered,
    # fault-missed (a store-relist after which no follower read the ledger whole again)
    address: str
    detail: str
    history: list[str] = field(default_factory=list)


@dataclass
class Sample:
    """One second of the run, for the live view and the report."""

    at: float
    pods: int
    running: int
    records: int
    adds: int  # successful ADDs ended in this second
    add_ms: list[float]


@dataclass
class Result:
    options: Options
    started: float = 0.0
    violations: list[Violation] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, detail)
    gc_frees: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    checks: int = 0
    converged_after: float | None = None
    emptied_after: float | None = None
    add_calls: int = 0
    add_failures: Counter[str] = field(default_factory=Counter)  # by CNI error code

    @property
    def ok(self) -> bool:
        return not self.violations
