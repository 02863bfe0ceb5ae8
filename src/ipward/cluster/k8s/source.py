"""The Kubernetes API as a liveness source (`k8s://`) and as the pod directory of ADDs.

Scopes:
  * controller (no node): pods cluster-wide, nodes and namespaces (metadata only),
    StatefulSets; `cluster_view()` answers from these caches.
  * agent (a node): that node's pods (`fieldSelector=spec.nodeName=NODE`) and
    namespaces; `cluster_view()` raises `NotCovered` (it would miss every other node's
    pods, and a missing pod reads as a gone one); it answers as a `PodDirectory` (`meta`,
    `listed`): what `ipward agent --cluster k8s://` uses.
`node_view()` always raises `NotCovered`: the API lists no sandboxes; the runtime does.

Direct reads bypass the caches where an answer must be current: `meta` and `listed`
for an ADD (a pod not cached yet is read once before the answer is "try again"), and
the `confirm_*` methods, which garbage collection calls before it frees anything on the
cluster's word (it judges on the cached view; the free waits for the API's own answer).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote

from ipward.cluster.k8s.objects import (
    parse_namespace,
    parse_node,
    parse_pod,
    parse_statefulset,
)
from ipward.cluster.k8s.reflector import MIN_STALE_AFTER, Reflector, Resource
from ipward.cluster.liveness import (
    ClusterView,
    Confirmation,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    NotCovered,
    Pod,
)
from ipward.cluster.pods import PodDirectory, PodMeta
from ipward.core.errors import InvalidConfig, TryAgainLater
from ipward.kubeapi.client import METADATA, ApiClient, ApiError, ApiUnreachable
from ipward.kubeapi.config import Connection, connection

NAMESPACES = Resource("namespaces", "/api/v1/namespaces", parse_namespace, metadata_only=True)
NODES = Resource("nodes", "/api/v1/nodes", parse_node, metadata_only=True)
STATEFULSETS = Resource("statefulsets", "/apis/apps/v1/statefulsets", parse_statefulset)
NO_SANDBOXES = "the Kubernetes API lists no sandboxes (the runtime does, over CRI)"


def pods_resource(node: str = "") -> Resource[Pod]:
    selector = f"spec.nodeName={node}" if node else ""
    return Resource("pods", "/api/v1/pods", parse_pod, field_selector=selector)


@dataclass(frozen=True)
class Settings:
    """The URL's options: `k8s://?kubeconfig=PATH&context=NAME&node=NODE&stale=SECONDS
    &margin=SECONDS&page=N&timeout=SECONDS`."""

    kubeconfig: str = ""
    context: str = ""
    node: str = ""
    stale_after: float = 150.0  # a quiet resource is heard at each watch's end (60 s)
    margin: float = 5.0
    page_size: int = 500
    timeout: float = 10.0
    watch_timeout: int = 60

    @classmethod
    def from_url(cls, url: str, node: str = "", timeout: float = 10.0) -> Settings:
        scheme, _, rest = url.partition("://")
        path, _, query = rest.partition("?")
        if scheme != "k8s" or path.strip("/"):
            raise InvalidConfig(f"liveness source {url!r}: expected k8s:// or k8s://?OPTIONS")
        values: dict[str, object] = {"node": node, "timeout": timeout}
        numbers = {"stale": "stale_after", "margin": "margin", "page": "page_size"}
        for key, value in parse_qsl(query, keep_blank_values=True):
            try:
                if key in ("kubeconfig", "context", "node"):
                    values[key] = value
                elif key in numbers:
                    kind = int if key == "page" else float
                    number = kind(value)
                    if number < 0 or (number == 0 and key != "margin"):
                        raise ValueError("out of range")
                    if key == "stale" and number < MIN_STALE_AFTER:
                        raise ValueError(
                            f"at least {MIN_STALE_AFTER:g} (a watch must end within half of it)"
                        )
                    values[numbers[key]] = number
                elif key == "timeout":
                    values["timeout"] = float(value)
                else:
                    raise InvalidConfig(
                        f"liveness source {url!r}: unknown option {key!r} (kubeconfig,"
                        " context, node, stale, margin, page, timeout)"
                    )
            except ValueError as e:
                raise InvalidConfig(f"liveness source {url!r}: option {key}={value!r}: {e}") from e
        if values.get("context") and not values.get("kubeconfig"):
            raise InvalidConfig(f"liveness source {url!r}: context needs kubeconfig")
        return cls(**values)  # type: ignore[arg-type]

    def connection(self) -> Connection:
        return connection(self.kubeconfig, self.context)


class K8sSource(LivenessSource, PodDirectory):
    """The caches of one scope (see the module's docstring) and the direct reads."""

    covers_runtimes = False  # NO_SANDBOXES

    def __init__(self, client: ApiClient, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.node = settings.node
        self.covers_cluster = not self.node

        def reflector(resource: Resource) -> Reflector:
            return Reflector(
                client,
                resource,
                page_size=settings.page_size,
                watch_timeout=settings.watch_timeout,
                stale_after=settings.stale_after,
                margin=settings.margin,
            )

        self.pods: Reflector[Pod] = reflector(pods_resource(self.node))
        self.namespaces: Reflector[dict[str, str]] = reflector(NAMESPACES)
        self.nodes: Reflector[bool] | None = None if self.node else reflector(NODES)
        self.statefulsets: Reflector[int] | None = None if self.node else reflector(STATEFULSETS)
        for r in self.reflectors:
            r.start()

    @property
    def reflectors(self) -> list[Reflector]:
        return [
            r for r in (self.pods, self.namespaces, self.nodes, self.statefulsets) if r is not None
        ]

    def problems(self) -> list[str]:
        """Why each cache not trusted now is not ("Kubernetes pods: could not list: HTTP
        403 ..."); [] when every cache answers."""
        return [p for r in self.reflectors if (p := r.problem()) is not None]

    def unavailable(self) -> str | None:
        """Any cache not trusted now, with why: the API refuses or does not answer its
        list (ADDs of pods not cached get the same answer, 11), or it is not listed yet
        (at start; ADDs read each pod directly meanwhile), or it is being listed again."""
        problems = self.problems()
        return "; ".join(problems) if problems else None

    def wait_listed(self, timeout: float) -> None:
        """Until every cache has its first complete list; then LivenessUnavailable naming
        each one that has not, and why."""
        deadline = time.monotonic() + timeout
        while problems := self.problems():
            if time.monotonic() >= deadline:
                raise LivenessUnavailable(f"not listed within {timeout:g}s: {'; '.join(problems)}")
            time.sleep(0.05)

    def close(self) -> None:
        threads = [threading.Thread(target=r.stop) for r in self.reflectors]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.client.close()

    # -- LivenessSource ------------------------------------------------------------------

    def node_view(self, node: str) -> NodeView:
        raise NotCovered(NO_SANDBOXES)

    def node_views(self, nodes: Iterable[str]) -> dict[str, NodeView | str]:
        return dict.fromkeys(nodes, NO_SANDBOXES)  # one answer for all, not one raise each

    def cluster_view(self) -> ClusterView:
        if self.nodes is None or self.statefulsets is None:
            raise NotCovered(
                f"this Kubernetes source watches node {self.node}'s pods only: no cluster view"
            )
        pods_mark = self.pods.mark()
        pods, pods_as_of = self.pods.snapshot()
        nodes, nodes_as_of = self.nodes.snapshot()
        sets, sets_as_of = self.statefulsets.snapshot()
        namespaces, ns_as_of = self.namespaces.snapshot()
        return ClusterView(
            as_of=min(pods_as_of, nodes_as_of, sets_as_of, ns_as_of),
            pods=pods,
            nodes=frozenset(nodes),
            statefulsets=sets,
            namespaces=namespaces,
            pod_changes=self.pods.changed_since,
            pods_mark=pods_mark,
        )

    # -- direct reads --------------------------------------------------------------------

    def _read(self, path: str, *, metadata: bool = False) -> dict | None:
        """One GET; None on a clean NotFound. Raises ApiError, ApiUnreachable."""
        try:
            if metadata:
                return self.client.request("GET", path, accept=METADATA)
            return self.client.request("GET", path)
        except ApiError as e:
            if e.not_found:
                return None
            raise

    def read_pod(self, namespace: str, name: str) -> Pod | None:
        """The pod of that name now (None: NotFound). Raises ApiError, ApiUnreachable."""
        obj = self._read(_pod_path(namespace, name))
        return None if obj is None else parse_pod(obj)[1]

    # -- PodDirectory (ADD) --------------------------------------------------------------

    def _cached_pod(self, uid: str) -> Pod | None:
        """The cached pod `uid` names (`Pod.has_uid`): a static pod's is its mirror pod,
        cached under a UID of its own (a walk of the node's pods, for those only)."""
        if not uid:
            return None  # by name: the API's key, read below
        try:
            return self.pods.get(uid) or self.pods.find(lambda pod: pod.has_uid(uid))
        except LivenessUnavailable:
            return None

    def meta(self, namespace: str, name: str, uid: str) -> PodMeta:
        pod = self._cached_pod(uid)
        where = f"pod {namespace}/{name} ({uid or 'no UID'})"
        try:
            if pod is None:
                pod = self.read_pod(namespace, name)
                if pod is None or (uid and not pod.has_uid(uid)):
                    raise TryAgainLater(f"{where} not listed yet")
            return PodMeta(
                dict(pod.annotations),
                dict(self._namespace_annotations(namespace)),
                pod.owner_kind,
                pod.owner_name,
            )
        except (ApiError, ApiUnreachable, KeyError, TypeError, ValueError) as e:
            raise TryAgainLater(f"{where}: Kubernetes API: {e}") from e

    def _namespace_annotations(self, namespace: str) -> dict[str, str]:
        try:
            cached = self.namespaces.get(namespace)
        except LivenessUnavailable:
            cached = None
        if cached is not None:
            return cached
        obj = self._read(f"/api/v1/namespaces/{quote(namespace, safe='')}", metadata=True)
        if obj is None:
            raise TryAgainLater(f"namespace {namespace} not listed yet")
        return parse_namespace(obj)[1]

    def listed(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod with this UID still exists: True when the cache or the API
        shows it (a static pod: its mirror pod); False only when the API answers NotFound
        for its name or shows a pod of that name with another UID. Anything else raises
        TryAgainLater."""
        if self._cached_pod(uid) is not None:
            return True
        try:
            pod = self.read_pod(namespace, name)
        except (ApiError, ApiUnreachable, KeyError, TypeError, ValueError) as e:
            raise TryAgainLater(f"pod {namespace}/{name} ({uid}): Kubernetes API: {e}") from e
        return pod is not None and pod.has_uid(uid)

    # -- live confirmations (controller, before freeing on the cluster's word) -----------

    def _confirm(self, what: str, read: Callable[[], Confirmation]) -> Confirmation:
        try:
            return read()
        except (ApiError, ApiUnreachable, KeyError, TypeError, ValueError) as e:
            return Confirmation(False, f"{what}: no clean answer: {e}")

    def _confirm_pod(self, namespace: str, name: str, uid: str, terminal: bool) -> Confirmation:
        def read() -> Confirmation:
            pod = self.read_pod(namespace, name)
            if pod is None:
                return Confirmation(True, f"API: pod {namespace}/{name} not found")
            if not pod.has_uid(uid):
                return Confirmation(True, f"API: pod {namespace}/{name} is now UID {pod.uid}")
            return Confirmation(
                terminal and pod.terminal, f"API: pod {namespace}/{name} ({uid}) is {pod.phase}"
            )

        return self._confirm(f"pod {namespace}/{name}", read)

    def confirm_pod_gone(self, namespace: str, name: str, uid: str) -> Confirmation:
        """Pod-gone: confirmed when the API answers NotFound for the name, or shows a pod
        of that name with another UID (a static pod's mirror pod with another
        `kubernetes.io/config.mirror`)."""
        return self._confirm_pod(namespace, name, uid, terminal=False)

    def confirm_pod_terminal(self, namespace: str, name: str, uid: str) -> Confirmation:
        """Pod-terminal: confirmed as for `confirm_pod_gone`, or when the API shows that
        UID Succeeded or Failed (a phase a pod never leaves)."""
        return self._confirm_pod(namespace, name, uid, terminal=True)

    def confirm_node_gone(self, node: str) -> Confirmation:
        """Node-gone: confirmed only when the API answers NotFound for the node."""

        def read() -> Confirmation:
            if self._read(f"/api/v1/nodes/{quote(node, safe='')}", metadata=True) is None:
                return Confirmation(True, f"API: node {node} not found")
            return Confirmation(False, f"API: node {node} exists")

        return self._confirm(f"node {node}", read)

    def confirm_identity_retired(
        self, namespace: str, name: str, statefulset: str = ""
    ) -> Confirmation:
        """A sticky identity may be retired: no pod of that name (NotFound), and, for a
        StatefulSet's pod, the set is gone (NotFound) or its replicas no longer reach
        the pod's ordinal."""

        def read() -> Confirmation:
            pod = self.read_pod(namespace, name)
            if pod is not None:
                return Confirmation(False, f"API: pod {namespace}/{name} is {pod.phase}")
            if not statefulset:
                return Confirmation(True, f"API: pod {namespace}/{name} not found")
            obj = self._read(
                f"/apis/apps/v1/namespaces/{quote(namespace, safe='')}/statefulsets/"
                f"{quote(statefulset, safe='')}"
            )
            if obj is None:
                return Confirmation(True, f"API: StatefulSet {namespace}/{statefulset} not found")
            replicas = parse_statefulset(obj)[1]
            ordinal = name[len(statefulset) + 1 :] if name.startswith(f"{statefulset}-") else ""
            if ordinal.isdigit() and int(ordinal) >= replicas:
                return Confirmation(
                    True, f"API: ordinal {ordinal} >= {replicas} replicas of {statefulset}"
                )
            return Confirmation(
                False, f"API: StatefulSet {statefulset} has {replicas} replicas (ordinal {ordinal})"
            )

        return self._confirm(f"sticky {namespace}/{name}", read)


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"


def open_k8s(url: str, node: str = "", timeout: float = 10.0) -> K8sSource:
    """A source from `k8s://...`; `node` (or the URL's `node=`) makes it agent-scoped."""
    settings = Settings.from_url(url, node=node, timeout=timeout)
    return K8sSource(ApiClient(settings.connection(), timeout=settings.timeout), settings)
