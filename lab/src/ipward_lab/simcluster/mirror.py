"""The simulated cluster's objects in a Kubernetes API server: what the model wants the
server to hold (`Wanted`, taken under the model's lock by `publishing`), and `KubeMirror`,
which remembers what it wrote there and brings the server to what is wanted, one round
of requests at a time (through `KubeAdmin`, over HTTP: the loopback test server and the
real kube-apiserver alike).

What the server gets, as a cluster's controllers and kubelets would write it:
  * namespaces: those given to `set_namespace` (with their annotations) and those of
    published pods; never deleted;
  * nodes: created with the model's, deleted with them (down nodes stay, as NotReady
    ones do);
  * StatefulSets with their replicas;
  * pods, once scheduled: `spec.nodeName`, the pod's annotations, the controlling
    ownerReference (a Deployment's pods name a ReplicaSet `<deployment>-<hash of its
    generation>`; StatefulSets and Jobs name themselves), status phase and container
    state (Pending: waiting; Running: running since the sandbox's ADD; Succeeded:
    terminated with `finishedAt`; a restart's Failed: waiting, no `finishedAt`); a
    deletion is a graceful DELETE (grace in whole seconds, at least 1: 0 would remove
    the pod from the API at once, before its sandbox is gone), then a DELETE with grace
    0 and the pod's UID as precondition once the model dropped the pod.

The server assigns pod UIDs: a pod is created before its kubelet may run it, and the
model takes the server's UID (`adopt`), so CNI_ARGS, records and the API agree. A pod
the model deleted before it was created is never created.

A round stops at the first request that fails (server down, refused); what was done
before is remembered and the next round goes on from there. A create whose answer was
lost shows up as 409 on the next try: the object found under that name is removed (it
is the lost one: nothing ran it) and created again.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ipward.kubeapi.client import ApiError
from ipward_lab.servers.kube_admin import KubeAdmin, api_time


@dataclass(frozen=True)
class WantedPod:
    key: str  # the model's UID for the pod: the server's, once created
    created: bool  # created in the server (then its kubelet may run it)
    namespace: str
    name: str
    node: str
    grace: int  # whole seconds, at least 1
    owner: tuple[str, str] | None  # controlling owner (kind, name)
    annotations: dict[str, str]
    status: tuple[str, str]  # phase, the time its container state carries (RFC 3339)
    deleting: bool

    @property
    def path(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Wanted:
    """What the server should hold, as of the model's `version`."""

    version: int
    namespaces: dict[str, dict[str, str]]
    nodes: frozenset[str]
    statefulsets: dict[str, int]  # "namespace/name" -> replicas
    pods: dict[str, WantedPod]  # by "namespace/name"


@dataclass
class Written:
    """A pod as this mirror last wrote it."""

    uid: str
    annotations: dict[str, str]
    status: tuple[str, str]
    deleting: bool


def replica_set_name(deployment: str, generation: int, namespace: str) -> str:
    """The ReplicaSet a Deployment's pods of one template generation belong to."""
    digest = hashlib.sha256(f"{namespace}/{deployment}/{generation}".encode()).hexdigest()
    return f"{deployment}-{digest[:10]}"


def owner_uid(kind: str, namespace: str, name: str) -> str:
    """A stable UID for an owner that is not an object in the server (ReplicaSet, Job)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{kind}/{namespace}/{name}"))


def _replaced(old: dict[str, str], new: dict[str, str]) -> dict[str, str | None]:
    """A merge patch turning annotations `old` into `new` (None removes a key)."""
    return {**{k: None for k in old if k not in new}, **new}


class KubeMirror:
    def __init__(self, admin: KubeAdmin) -> None:
        self.admin = admin
        self.url = admin.client.conn.server
        self.namespaces: dict[str, dict[str, str]] = {}
        self.nodes: set[str] = set()
        self.statefulsets: dict[str, tuple[str, int]] = {}  # key -> (uid, replicas)
        self.pods: dict[str, Written] = {}  # by "namespace/name"

    def apply(self, wanted: Wanted, adopt: Callable[[str, str], None]) -> None:
        """One round: the requests that bring the server to `wanted`. `adopt(key, uid)`
        is called for every pod created. Raises ApiError or ApiUnreachable at the first
        request that fails."""
        for namespace, wanted_annotations in wanted.namespaces.items():
            self._namespace(namespace, wanted_annotations)
        for node in sorted(wanted.nodes - self.nodes):
            self._ignoring(409, self.admin.node, node)
            self.nodes.add(node)
        for key, replicas in wanted.statefulsets.items():
            self._statefulset(key, replicas)
        for key in sorted(set(self.statefulsets) - set(wanted.statefulsets)):
            namespace, _, name = key.partition("/")
            self._ignoring(404, self.admin.delete_statefulset, namespace, name)
            del self.statefulsets[key]
        self._remove_pods(wanted)
        for pod in wanted.pods.values():
            if pod.created:
                self._update_pod(pod)
            else:
                self._create_pod(pod, adopt)
        for node in sorted(self.nodes - wanted.nodes):
            self._ignoring(404, self.admin.delete_node, node)
            self.nodes.discard(node)

    @staticmethod
    def _ignoring(status: int, request: Callable[..., object], *args: object) -> bool:
        """Make the request; False when the server answered `status` (already there,
        already gone), which is what the request was for."""
        try:
            request(*args)
        except ApiError as e:
            if e.status != status:
                raise
            return False
        return True

    def _uid_of(self, path: str) -> str:
        """The UID of the object at `path` now."""
        return str(self.admin.client.request("GET", path)["metadata"]["uid"])

    def _namespace(self, name: str, annotations: dict[str, str]) -> None:
        if name not in self.namespaces:
            if self._ignoring(409, self.admin.namespace, name, annotations):
                self.namespaces[name] = dict(annotations)
                return
            self.namespaces[name] = {}  # there already: ours are merged in below
        written = self.namespaces[name]
        if written != annotations:
            self.admin.annotate_namespace(name, _replaced(written, annotations))
            self.namespaces[name] = dict(annotations)

    def _statefulset(self, key: str, replicas: int) -> None:
        namespace, _, name = key.partition("/")
        if key not in self.statefulsets:
            try:
                uid = self.admin.statefulset(namespace, name, replicas)
            except ApiError as e:
                if e.status != 409:
                    raise
                uid = self._uid_of(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}")
                self.statefulsets[key] = (uid, -1)  # its replicas are set below
            else:
                self.statefulsets[key] = (uid, replicas)
        uid, written = self.statefulsets[key]
        if written != replicas:
            self.admin.scale(namespace, name, replicas)
            self.statefulsets[key] = (uid, replicas)

    def _remove_pods(self, wanted: Wanted) -> None:
        """Pods the model no longer has (the kubelet removed them), and pods whose name
        another pod of the model holds now: DELETE with grace 0, that UID only."""
        for path, written in sorted(self.pods.items()):
            pod = wanted.pods.get(path)
            if pod is not None and pod.created and pod.key == written.uid:
                continue
            namespace, _, name = path.partition("/")
            try:
                self.admin.delete_pod(namespace, name, 0, written.uid)
            except ApiError as e:
                if e.status not in (404, 409):  # gone, or the name is another pod's
                    raise
            del self.pods[path]

    def _create_pod(self, pod: WantedPod, adopt: Callable[[str, str], None]) -> None:
        owner_ref = None
        uid_of_owner = ""
        if pod.owner is not None:
            kind, name = pod.owner
            owner_ref = pod.owner
            written_set = self.statefulsets.get(f"{pod.namespace}/{name}")
            if kind == "StatefulSet" and written_set is not None:
                uid_of_owner = written_set[0]
            else:
                uid_of_owner = owner_uid(kind, pod.namespace, name)
        try:
            uid = self.admin.pod(
                pod.namespace,
                pod.name,
                pod.node,
                owner=owner_ref,
                annotations=pod.annotations,
                grace=pod.grace,
                owner_uid=uid_of_owner,
            )
        except ApiError as e:
            if e.status != 409:
                raise
            # A pod of that name is there: a create of ours whose answer was lost (nothing
            # runs it: its kubelet waits for the UID). Remove it; the next round creates.
            stale = self._uid_of(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}")
            self._ignoring(404, self.admin.delete_pod, pod.namespace, pod.name, 0, stale)
            raise
        self.pods[pod.path] = Written(uid, dict(pod.annotations), ("Pending", ""), False)
        adopt(pod.key, uid)

    def _update_pod(self, pod: WantedPod) -> None:
        written = self.pods.get(pod.path)
        if written is None:
            return  # the server removed it (a terminal pod's delete is at once)
        try:
            if written.status != pod.status:
                phase, at = pod.status
                self.admin.pod_phase(pod.namespace, pod.name, phase, at)
                written.status = pod.status
            if written.annotations != pod.annotations:
                change = _replaced(written.annotations, pod.annotations)
                self.admin.annotate_pod(pod.namespace, pod.name, change)
                written.annotations = dict(pod.annotations)
            if pod.deleting and not written.deleting:
                self.admin.delete_pod(pod.namespace, pod.name, pod.grace, written.uid)
                written.deleting = True
        except ApiError as e:
            if e.status not in (404, 409):
                raise
            del self.pods[pod.path]  # removed by the server meanwhile (409: the UID moved on)


def status_of(
    phase: str, running_since: float | None, finished_at: float | None
) -> tuple[str, str]:
    """A pod's (phase, time of its container state) as `KubeAdmin.pod_phase` writes it:
    Running since the ADD, Succeeded/Failed at `finished_at` (none: the restart's Failed,
    not finished), Pending without a time."""
    if phase == "Running" and running_since is not None:
        return phase, api_time(running_since)
    if phase in ("Succeeded", "Failed") and finished_at is not None:
        return phase, api_time(finished_at)
    return phase, ""
