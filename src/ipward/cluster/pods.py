"""What an ADD may read of its pod in the cluster: its annotations, its namespace's, and
its owner (`PodMeta`), through a `PodDirectory` (the agent's `--cluster` source:
`ipward.cluster.k8s`). The plugin's path names these in types only (`cni.selection`);
kept standard library only and free of imports, as everything on that path."""

from __future__ import annotations


class PodMeta:
    """What the cluster says about the pod of an ADD."""

    __slots__ = ("annotations", "namespace_annotations", "owner_kind", "owner_name")

    def __init__(
        self,
        annotations: dict[str, str],
        namespace_annotations: dict[str, str],
        owner_kind: str = "",
        owner_name: str = "",
    ) -> None:
        self.annotations = annotations
        self.namespace_annotations = namespace_annotations
        self.owner_kind = owner_kind
        self.owner_name = owner_name


class PodDirectory:
    """The cluster as an ADD sees it. Both methods raise TryAgainLater when the cluster
    cannot be read."""

    def meta(self, namespace: str, name: str, uid: str) -> PodMeta:
        raise NotImplementedError

    def listed(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod with this UID (named namespace/name when it was bound) still
        exists. The name lets a source that does not cache every pod ask for it."""
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why the cluster cannot be read as it should now (for the agent's `/healthz`):
        a source refused, unreachable, or not listed yet; None when it can."""
        return None
