"""Liveness sources: who is alive, behind one interface (docs/design.md 1, 5.4, 5.5).

A source answers two questions, each with a view or `LivenessUnavailable`:
  * `node_view(node)`: the pod sandboxes the container runtime of `node` holds, ready or
    not (the runtime: CRI `ListPodSandbox`);
  * `cluster_view()`: the orchestrator's pods (UID, phase, deletion, node, owner), its
    nodes, and its StatefulSets' replicas.
"Could not list" is always `LivenessUnavailable`, never an empty view (docs/design.md
invariant 8). A source that cannot see something at all (a CRI socket sees one node and
no cluster) raises `NotCovered`, a kind of `LivenessUnavailable`.

Every view carries `as_of`: a time such that everything that existed before it is in
the view. A caller keeps a record whenever the view is not newer than the record's
creation plus the ADD grace, so a lagging source (an old `as_of`) frees nothing.

Sources by URL (`open_source`):
  * `cri:///run/containerd/containerd.sock`: containerd's CRI over its socket (ipward.cluster.cri);
  * `k8s://` (in a pod) or `k8s://?kubeconfig=PATH&context=NAME`: the Kubernetes API
    (ipward.cluster.k8s; with a node, that node's pods only);
  * any scheme an installed distribution adds (`extensions.LIVENESS_SOURCES`): the labs
    add `sim:///path/state.json`, the simulated cluster's published state
    (`ipward_lab.simcluster.source`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ipward.core import extensions
from ipward.core.errors import InvalidConfig

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
# On the mirror pod a kubelet makes in the API for a static pod (one it runs from a file):
# the static pod's own UID, its config hash. The kubelet passes that UID to the ADD
# (K8S_POD_UID), the runtime lists the sandbox with it and records hold it; the mirror
# pod has a UID of its own. The API refuses to add, change or remove it after creation.
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


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
    # `ipward.io/` ones (pool selection, sticky) and, on a mirror pod, MIRROR_ANNOTATION
    annotations: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def mirror_of(self) -> str:
        """A mirror pod's static pod UID (MIRROR_ANNOTATION); "" for any other pod."""
        return self.annotations.get(MIRROR_ANNOTATION, "")

    def has_uid(self, uid: str) -> bool:
        """Whether `uid` names this pod: its UID, or, on a mirror pod, its static pod's
        (the UID the ADD was given and the records hold)."""
        return bool(uid) and uid in (self.uid, self.mirror_of)

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
            annotations=string_dict(d.get("annotations", {})),
        )


def string_dict(value: object) -> dict[str, str]:
    """A JSON object's entries as strings (annotations); anything else gives none."""
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
        showing this is not to be trusted (docs/design.md 5.5)."""
        by_uid: dict[str, list[str]] = {}
        for sandbox in self.sandboxes.values():
            if sandbox.ready and sandbox.uid:
                by_uid.setdefault(sandbox.uid, []).append(sandbox.id)
        return {uid: sorted(ids) for uid, ids in by_uid.items() if len(ids) > 1}

    def changed_since(self, earlier: NodeView) -> set[str]:
        """Sandbox IDs listed in only one of the two views, or listed differently."""
        if self.sandboxes is earlier.sandboxes:
            return set()
        now, then = self.sandboxes, earlier.sandboxes
        return {i for i in now.keys() | then.keys() if now.get(i) != then.get(i)}


@dataclass
class ClusterView:
    as_of: float
    pods: dict[str, Pod] = field(default_factory=dict)  # by UID
    nodes: frozenset[str] = frozenset()
    statefulsets: dict[str, int] = field(default_factory=dict)  # "ns/name" -> replicas
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)  # annotations
    # A source whose pods' cache logs its changes (`Reflector.changed_since`) gives it
    # with the cache's mark when `pods` was copied; `changed_since` then asks it instead
    # of comparing every pod.
    pod_changes: Callable[[int], set[str] | None] | None = field(
        default=None, compare=False, repr=False
    )
    pods_mark: int = 0
    # Pods by (namespace, name), made on the first `pods_named`: GC asks it once per
    # detached reservation, and a walk of every pod each time costs reservations x pods.
    _by_name: dict[tuple[str, str], list[Pod]] | None = field(
        default=None, init=False, compare=False, repr=False
    )
    # Mirror pods by their static pod's UID, made on the first `pod` that misses `pods`
    # (a walk: about 10 ms at 150,000 pods, most of them without annotations).
    _by_mirror: dict[str, Pod] | None = field(default=None, init=False, compare=False, repr=False)

    def pod(self, uid: str) -> Pod | None:
        """The pod `uid` names (`Pod.has_uid`): the pod of that UID, else the mirror pod
        of the static pod of that UID. Every lookup of a pod by a record's or an ADD's
        UID goes through here: a static pod is listed only as its mirror pod."""
        pod = self.pods.get(uid)
        if pod is not None or not uid:
            return pod
        if self._by_mirror is None:
            self._by_mirror = {
                static: p for p in self.pods.values() if p.annotations and (static := p.mirror_of)
            }
        return self._by_mirror.get(uid)

    def pods_named(self, namespace: str, name: str) -> list[Pod]:
        if self._by_name is None:
            by_name: dict[tuple[str, str], list[Pod]] = {}
            for pod in self.pods.values():
                by_name.setdefault((pod.namespace, pod.name), []).append(pod)
            self._by_name = by_name
        return list(self._by_name.get((namespace, name), ()))

    def changed_since(self, earlier: ClusterView) -> tuple[set[str], set[str]]:
        """(pod UIDs, node names) listed in only one of the two views, or listed
        differently (pod UIDs: perhaps more, changed after this view was read; a mirror
        pod's change names its static pod's UID too, the one its records hold). From the
        pods' cache's log when both views come from it and it still knows; otherwise a
        walk of identity checks (sources keep an unchanged pod as the same object: a
        reflector's cache, a file's version read once)."""
        nodes = set(self.nodes.symmetric_difference(earlier.nodes))
        if self.pods is earlier.pods:
            return set(), nodes
        now, then = self.pods, earlier.pods
        pods: set[str] | None = None
        if self.pod_changes is not None and self.pod_changes == earlier.pod_changes:
            pods = self.pod_changes(earlier.pods_mark)
        if pods is None:
            pods = {
                uid for uid, pod in now.items() if (old := then.get(uid)) is not pod and old != pod
            }
            pods.update(uid for uid in then if uid not in now)
        for uid in list(pods):
            for pod in (now.get(uid), then.get(uid)):
                if pod is not None and pod.mirror_of:
                    pods.add(pod.mirror_of)
        return pods, nodes


@dataclass(frozen=True)
class Confirmation:
    """A live answer, just before freeing on a source's word: `confirmed` only when the
    source said so cleanly; any error, timeout or unexpected answer is False."""

    confirmed: bool
    evidence: str


READ_LIVE = Confirmation(True, "the view judged was read live")


class LivenessSource(ABC):
    """Views (for judging) and live confirmations (before freeing on a view's word). A
    source whose views are themselves live reads (a runtime's list, the labs' file)
    confirms what they showed; one answering from caches (`k8s://`) reads again.

    `covers_runtimes` and `covers_cluster` say which views it can give at all: a view it
    does not cover is `NotCovered`, as configured, never a failed read to count."""

    covers_runtimes = True
    covers_cluster = True

    @abstractmethod
    def node_view(self, node: str) -> NodeView:
        """The sandboxes of `node`'s runtime; raises LivenessUnavailable."""

    @abstractmethod
    def cluster_view(self) -> ClusterView:
        """The orchestrator's pods and nodes; raises LivenessUnavailable."""

    def node_views(self, nodes: Iterable[str]) -> dict[str, NodeView | str]:
        """Each node's view, or why there is none: what a pass asks of many nodes at
        once (a source that reads them together answers all from one read)."""
        return views_or_why(nodes, self.node_view)

    def finish_teardown(self, node: str, sandbox: str) -> None:
        """Have `node`'s runtime finish the teardown of a stopped sandbox (its network:
        the CNI DEL, which frees its addresses). Raises NotCovered where the source only
        reads, LivenessUnavailable when the runtime refuses or cannot be reached."""
        raise NotCovered(f"{type(self).__name__} reads the runtime; it cannot act on it")

    def wait_listed(self, timeout: float) -> None:  # noqa: B027 (most sources read live)
        """For a one-shot command (`ipward gc`, `release --liveness`), which asks once
        and cannot wait for a next pass: wait until the source answers from complete
        lists, up to `timeout` seconds; then LivenessUnavailable naming what is not
        listed, and why. A source that reads at each question (a runtime, the labs'
        file) has nothing to wait for: its failures are each answer's own."""

    def confirm_pod_gone(self, namespace: str, name: str, uid: str) -> Confirmation:
        return READ_LIVE

    def confirm_pod_terminal(self, namespace: str, name: str, uid: str) -> Confirmation:
        return READ_LIVE

    def confirm_node_gone(self, node: str) -> Confirmation:
        return READ_LIVE

    def confirm_identity_retired(
        self, namespace: str, name: str, statefulset: str = ""
    ) -> Confirmation:
        return READ_LIVE

    def close(self) -> None:  # noqa: B027 (most sources hold nothing)
        pass


def views_or_why(
    nodes: Iterable[str], view_of: Callable[[str], NodeView]
) -> dict[str, NodeView | str]:
    """`view_of` each node, or the LivenessUnavailable's words when it raises one."""
    views: dict[str, NodeView | str] = {}
    for node in nodes:
        try:
            views[node] = view_of(node)
        except LivenessUnavailable as e:
            views[node] = str(e)
    return views


def open_source(url: str, node: str = "", timeout: float = 2.0) -> LivenessSource:
    """A source from its URL; `node` is the node a runtime socket belongs to. `cri://` and
    `k8s://` are the product's own; other schemes are those installed distributions add
    (`extensions.LIVENESS_SOURCES`: the labs' `sim://`)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "k8s":
        from ipward.cluster.k8s.source import open_k8s  # urllib3 and yaml only when used

        return open_k8s(url, node=node, timeout=timeout)
    if sep and scheme == "cri":
        if not rest:
            raise InvalidConfig(f"liveness source {url!r}: expected cri:///PATH")
        if not node:
            raise InvalidConfig(
                f"liveness source {url!r}: a runtime's socket answers for one node only;"
                " name its node (`ipward gc`, `ipward release`: --node; a controller judges the"
                " whole cluster: use k8s://)"
            )
        from ipward.cluster.cri import CriSource  # grpc stays out of everything else's imports

        return CriSource(rest, node=node, timeout=timeout)
    added = extensions.added(extensions.LIVENESS_SOURCES)
    if sep and scheme in added:
        opened: LivenessSource = added[scheme].load()(url, node=node, timeout=timeout)
        return opened
    known = ", ".join(f"{name}://" for name in sorted({"cri", "k8s", *added}))
    what = f"unknown scheme {scheme!r}" if sep else "not a URL"
    raise InvalidConfig(f"liveness source {url!r}: {what} (known: {known})")
