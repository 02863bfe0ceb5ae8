"""What an ADD reads beyond its call, in the agent: its `PodDirectory` (`--cluster`),
what it reads of its pod (`k8s://` is one itself, in the node's scope; other sources
answer from their cluster view), and the node's runtime (`--liveness`): which sandboxes
it lists."""

from __future__ import annotations

from collections.abc import Callable

from ipward.cluster.liveness import ClusterView, LivenessSource, LivenessUnavailable, open_source
from ipward.cluster.pods import PodDirectory, PodMeta
from ipward.core.errors import TryAgainLater


class ClusterDirectory(PodDirectory):
    """Pod annotations and owners for ADD, from a liveness source's cluster view (read
    per call: a pod created a moment ago must be found). "Could not read" is code 11,
    and so is a pod the view does not list yet: the runtime retries."""

    def __init__(self, source: LivenessSource) -> None:
        self.source = source

    def _view(self) -> ClusterView:
        try:
            return self.source.cluster_view()
        except LivenessUnavailable as e:
            raise TryAgainLater(f"cluster source: {e}") from e

    def meta(self, namespace: str, name: str, uid: str) -> PodMeta:
        view = self._view()
        if uid:
            pod = view.pod(uid)
        else:  # no UID in CNI_ARGS: the pod of that name
            named = view.pods_named(namespace, name)
            pod = named[0] if named else None
        if pod is None:
            raise TryAgainLater(f"pod {namespace}/{name} ({uid or 'no UID'}) not listed yet")
        return PodMeta(
            dict(pod.annotations),
            dict(view.namespaces.get(namespace, {})),
            pod.owner_kind,
            pod.owner_name,
        )

    def listed(self, namespace: str, name: str, uid: str) -> bool:
        return self._view().pod(uid) is not None

    def unavailable(self) -> str | None:
        try:
            self.source.cluster_view()
        except LivenessUnavailable as e:
            return str(e)
        return None


def runtime_sandboxes(source: LivenessSource, node: str) -> Callable[[str], bool]:
    """Whether this node's runtime lists a sandbox (ready or not), for a sticky take-over
    (`Sticky.sandbox_listed`); a runtime that cannot be read is code 11."""

    def listed(sandbox: str) -> bool:
        try:
            view = source.node_view(node)
        except LivenessUnavailable as e:
            raise TryAgainLater(f"runtime: {e}") from e
        return sandbox in view.sandboxes

    return listed


def cluster_directory(url: str, node: str) -> PodDirectory:
    """The pod directory of ADDs. `k8s://` opens in this node's scope (its pods and the
    namespaces cached, any other pod read directly): it is the directory itself, and an
    agent never caches the whole cluster's pods. Other sources answer from their cluster
    view."""
    source = open_source(url, node=node) if url.startswith("k8s://") else open_source(url)
    return source if isinstance(source, PodDirectory) else ClusterDirectory(source)
