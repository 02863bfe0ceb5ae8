"""Liveness sources: who is alive, behind one interface (DESIGN 1, 5.4, 5.5).

A source answers two questions, each with a view or `LivenessUnavailable`:
  * `node_view(node)`: the pod sandboxes the container runtime of `node` holds, ready or
    not (the runtime: CRI `ListPodSandbox`);
  * `cluster_view()`: the orchestrator's pods (UID, phase, deletion, node, owner), its
    nodes, and its StatefulSets' replicas.
"Could not list" is always `LivenessUnavailable`, never an empty view (invariant 8). A
source that cannot see something at all (a CRI socket sees one node and no cluster)
raises `NotCovered`, a kind of `LivenessUnavailable`.

Every view carries `as_of`: a time such that everything that existed before it is in
the view. A caller keeps a record whenever the view is not newer than the record's
creation plus the ADD grace, so a lagging source (an old `as_of`) frees nothing.

Sources by URL (`open_source`):
  * `cri:///run/containerd/containerd.sock`: containerd's CRI over its socket (ipward.cri);
  * `sim:///path/state.json`: the simulated cluster's published state (ipward_lab.simcluster
    writes it; the format is `SimFileSource`'s docstring);
  * `k8s://` (in a pod) or `k8s://?kubeconfig=PATH&context=NAME`: the Kubernetes API
    (ipward.cluster.k8s; with a node, that node's pods only).
"""

from __future__ import annotations

import json
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

from ipward.errors import InvalidConfig

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


class LivenessUnavailable(Exception):
    """The source could not answer: nothing may be reclaimed on its account."""


class NotCovered(LivenessUnavailable):
    """The source does not see this at all (another node's runtime, or no cluster)."""


@dataclass(frozen=True)
class Sandbox:
    """A pod sandbox as the runtime lists it. Its `id` is the CNI container ID."""

    id: str
    ready: bool
    namespace: str = ""
    name: str = ""
    uid: str = ""
    created_at: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sandbox:
        return cls(
            id=str(d["id"]),
            ready=bool(d["ready"]),
            namespace=str(d.get("namespace", "")),
            name=str(d.get("name", "")),
            uid=str(d.get("uid", "")),
            created_at=float(d.get("created_at", 0.0)),
        )


@dataclass(frozen=True)
class Pod:
    """A pod as the orchestrator knows it."""

    uid: str
    namespace: str
    name: str
    phase: str  # Pending, Running, Succeeded, Failed
    node: str = ""
    deleted_at: float | None = None  # deletion requested
    grace: float = 30.0  # termination grace, seconds
    finished_at: float | None = None  # when it became Succeeded or Failed
    owner_kind: str = ""  # StatefulSet, ReplicaSet, Job, ...
    owner_name: str = ""
    annotations: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pod:
        return cls(
            uid=str(d["uid"]),
            namespace=str(d["namespace"]),
            name=str(d["name"]),
            phase=str(d["phase"]),
            node=str(d.get("node", "")),
            deleted_at=_float_or_none(d.get("deleted_at")),
            grace=float(d.get("grace", 30.0)),
            finished_at=_float_or_none(d.get("finished_at")),
            owner_kind=str(d.get("owner_kind", "")),
            owner_name=str(d.get("owner_name", "")),
            annotations=_strings(d.get("annotations", {})),
        )


def _strings(value: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _float_or_none(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


@dataclass
class NodeView:
    node: str
    as_of: float
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)

    def duplicate_pods(self) -> dict[str, list[str]]:
        """Pod UIDs with more than one ready sandbox: sandbox IDs per UID. A runtime
        showing this is not to be trusted (DESIGN 5.5)."""
        by_uid: dict[str, list[str]] = {}
        for sandbox in self.sandboxes.values():
            if sandbox.ready and sandbox.uid:
                by_uid.setdefault(sandbox.uid, []).append(sandbox.id)
        return {uid: sorted(ids) for uid, ids in by_uid.items() if len(ids) > 1}


@dataclass
class ClusterView:
    as_of: float
    pods: dict[str, Pod] = field(default_factory=dict)  # by UID
    nodes: frozenset[str] = frozenset()
    statefulsets: dict[str, int] = field(default_factory=dict)  # "ns/name" -> replicas
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)  # annotations

    def pods_named(self, namespace: str, name: str) -> list[Pod]:
        return [p for p in self.pods.values() if p.namespace == namespace and p.name == name]


class LivenessSource(ABC):
    @abstractmethod
    def node_view(self, node: str) -> NodeView:
        """The sandboxes of `node`'s runtime; raises LivenessUnavailable."""

    @abstractmethod
    def cluster_view(self) -> ClusterView:
        """The orchestrator's pods and nodes; raises LivenessUnavailable."""

    def close(self) -> None:  # noqa: B027 (most sources hold nothing)
        pass


class SimFileSource(LivenessSource):
    """Reads the state the simulated cluster publishes (atomically, by rename) as JSON:

        {"as_of": <time the state reflects>,
         "cluster": {"pods": [Pod...], "nodes": [name...], "statefulsets": {"ns/n": 3},
                     "namespaces": {"ns": {annotation: value}}}
                    | {"fail": "why"} | {"stall_until": <time>},
         "runtimes": {"<node>": {"sandboxes": [Sandbox...]} | {"fail": "why"}
                                | {"stall_until": <time>}}}

    A node missing from `runtimes` is a runtime that cannot be reached (node down). A
    stall makes the call wait (at most `timeout`) and then fail, as a hung runtime does.
    """

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.path = path
        self.timeout = timeout
        # The file is replaced by rename, so (inode, mtime, size) names one version:
        # a pass asking for N nodes and the cluster parses it once, not N + 1 times.
        self._parsed: tuple[tuple[int, int, int], dict[str, Any]] | None = None

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                if self._parsed is not None and self._parsed[0] == version:
                    return self._parsed[1]
                state = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise LivenessUnavailable(f"simulated cluster state {self.path}: {e}") from e
        if not isinstance(state, dict) or "as_of" not in state:
            raise LivenessUnavailable(f"simulated cluster state {self.path}: no as_of")
        self._parsed = (version, state)
        return state

    def _answer(self, part: object, what: str) -> dict[str, Any]:
        if not isinstance(part, dict):
            raise LivenessUnavailable(f"{what}: unreachable")
        if "fail" in part:
            raise LivenessUnavailable(f"{what}: {part['fail']}")
        stall_until = part.get("stall_until")
        if stall_until is not None:
            wait = min(float(stall_until) - time.time(), self.timeout)
            if wait > 0:
                time.sleep(wait)
            raise LivenessUnavailable(f"{what}: no answer within {self.timeout:g}s")
        return part

    def node_view(self, node: str) -> NodeView:
        state = self._read()
        part = self._answer(state.get("runtimes", {}).get(node), f"runtime of node {node}")
        sandboxes = [Sandbox.from_dict(d) for d in part.get("sandboxes", [])]
        return NodeView(node, float(state["as_of"]), {s.id: s for s in sandboxes})

    def cluster_view(self) -> ClusterView:
        state = self._read()
        part = self._answer(state.get("cluster"), "cluster")
        pods = [Pod.from_dict(d) for d in part.get("pods", [])]
        return ClusterView(
            as_of=float(state["as_of"]),
            pods={p.uid: p for p in pods},
            nodes=frozenset(str(n) for n in part.get("nodes", [])),
            statefulsets={str(k): int(v) for k, v in part.get("statefulsets", {}).items()},
            namespaces={str(k): _strings(v) for k, v in part.get("namespaces", {}).items()},
        )


def write_sim_state(
    path: str,
    as_of: float,
    cluster: dict[str, Any],
    runtimes: dict[str, dict[str, Any]],
) -> None:
    """Publish a simulated state for `SimFileSource` readers: write aside, then rename,
    so a reader sees the old state or the new one, never half of one."""
    body = {"as_of": as_of, "cluster": cluster, "runtimes": runtimes}
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, default=_encode))  # one write: json.dump writes in chunks
    os.replace(tmp, path)


def _encode(obj: object) -> object:
    if isinstance(obj, Sandbox | Pod):
        return asdict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def open_source(url: str, node: str = "", timeout: float = 2.0) -> LivenessSource:
    """A source from its URL; `node` is the node a runtime socket belongs to."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "k8s":
        from ipward.cluster.k8s.source import open_k8s  # urllib3 and yaml only when used

        return open_k8s(url, node=node, timeout=timeout)
    if not sep or not rest:
        raise InvalidConfig(f"liveness source {url!r}: expected cri:///PATH, sim:///PATH or k8s://")
    if scheme == "sim":
        return SimFileSource(rest, timeout)
    if scheme == "cri":
        from ipward.cri import CriSource  # grpc stays out of everything else's imports

        return CriSource(rest, node=node, timeout=timeout)
    raise InvalidConfig(f"liveness source {url!r}: unknown scheme {scheme!r} (cri, sim, k8s)")
