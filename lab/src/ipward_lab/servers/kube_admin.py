"""Plays the rest of a cluster against an API server (the real kube-apiserver or the test
server, over HTTP alike): makes namespaces, nodes, pods and StatefulSets, and does what
a kubelet would (pod status updates, the final delete with grace 0), since neither
server runs a kubelet or a controller-manager here. The simulated cluster publishes
through it (`ipward_lab.simcluster.mirror`). `KubeApi`: a handle on either server
(its URL, credentials, an admin and `k8s://` sources), as tests and scenario worlds
hold it."""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipward.kubeapi.client import ApiClient
from ipward.kubeapi.config import from_kubeconfig

if TYPE_CHECKING:
    from ipward.cluster.liveness import LivenessSource
    from ipward_lab.servers.kube_apiserver import KubeLab
    from ipward_lab.servers.kube_test_server import KubeApiServer

IMAGE = "example.invalid/pause:1"


def api_time(at: float) -> str:
    """`at` (seconds since the epoch) as the API writes times: RFC 3339 in whole seconds,
    rounded up, so a time the API shows is never earlier than the one it stands for."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(at)))


def _meta(name: str, annotations: dict[str, str] | None) -> dict:
    meta: dict = {"name": name}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


class KubeAdmin:
    def __init__(self, client: ApiClient) -> None:
        self.client = client

    def namespace(self, name: str, annotations: dict[str, str] | None = None) -> None:
        self.client.request(
            "POST", "/api/v1/namespaces", body={"metadata": _meta(name, annotations)}
        )

    def annotate_namespace(self, name: str, annotations: dict[str, str | None]) -> None:
        self.client.request(
            "PATCH", f"/api/v1/namespaces/{name}", body={"metadata": {"annotations": annotations}}
        )

    def node(self, name: str) -> None:
        self.client.request("POST", "/api/v1/nodes", body={"metadata": {"name": name}})

    def delete_node(self, name: str) -> None:
        self.client.request("DELETE", f"/api/v1/nodes/{name}")

    def pod(
        self,
        namespace: str,
        name: str,
        node: str,
        *,
        owner: tuple[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        grace: int = 30,
        owner_uid: str = "",
    ) -> str:
        """Create a pod bound to `node`; its UID (the server's: a UID sent is ignored).
        `owner` (kind, name): the controlling ownerReference, with `owner_uid`, else a
        StatefulSet's looked up (it must exist) and any other kind's made up (a
        ReplicaSet, a Job: no server here checks them)."""
        meta = _meta(name, annotations)
        if owner is not None:
            kind, owner_name = owner
            uid = owner_uid or str(uuid.uuid4())
            if kind == "StatefulSet" and not owner_uid:
                path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{owner_name}"
                uid = self.client.request("GET", path)["metadata"]["uid"]
            meta["ownerReferences"] = [
                {
                    "apiVersion": "batch/v1" if kind == "Job" else "apps/v1",
                    "kind": kind,
                    "name": owner_name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        body = {
            "metadata": meta,
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": grace,
                "containers": [{"name": "c", "image": IMAGE}],
            },
        }
        created = self.client.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
        return str(created["metadata"]["uid"])

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge `annotations` into the pod's (None removes a key)."""
        self.client.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={"metadata": {"annotations": annotations}},
        )

    def pod_phase(self, namespace: str, name: str, phase: str, finished_at: str = "") -> None:
        """Set the pod's phase as its kubelet would; a terminal phase with `finished_at`
        (RFC 3339) records the container's terminated state, without it the container
        waits to restart (no `finishedAt`: the pod is not finished); Running with
        `finished_at` records it as the container's start; Pending: it is being made."""
        if phase in ("Succeeded", "Failed") and not finished_at:
            state: dict = {"waiting": {"reason": "CrashLoopBackOff"}}
        elif phase in ("Succeeded", "Failed"):
            state = {
                "terminated": {
                    "exitCode": 0 if phase == "Succeeded" else 1,
                    "reason": "Completed" if phase == "Succeeded" else "Error",
                    "startedAt": finished_at,
                    "finishedAt": finished_at,
                }
            }
        elif phase == "Running":
            state = {"running": {"startedAt": finished_at}} if finished_at else {"running": {}}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "c",
                    "state": state,
                    "ready": phase == "Running",
                    "restartCount": 0,
                    "image": IMAGE,
                    "imageID": "",
                }
            ],
        }
        self.client.request(
            "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", body={"status": status}
        )

    def delete_pod(self, namespace: str, name: str, grace: int = 0, uid: str = "") -> None:
        """Delete the pod (grace 0: at once, as a kubelet does once it is stopped); with
        `uid`, only that pod (a precondition: 409 when the name is another pod's now)."""
        body: dict = {"gracePeriodSeconds": grace}
        if uid:
            body["preconditions"] = {"uid": uid}
        self.client.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body=body)

    def statefulset(self, namespace: str, name: str, replicas: int) -> str:
        """Create a StatefulSet; its UID."""
        labels = {"app": name}
        body = {
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": IMAGE}]},
                },
            },
        }
        path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets"
        return str(self.client.request("POST", path, body=body)["metadata"]["uid"])

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.client.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
            body={"spec": {"replicas": replicas}},
        )

    def delete_statefulset(self, namespace: str, name: str) -> None:
        self.client.request("DELETE", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}")


class KubeApi:
    """An API server for a test: the loopback test server (`server` set: faults can be
    injected) or the real kube-apiserver (maybe shared by many tests: names are made
    unique per test with `name`)."""

    def __init__(
        self, url: str, kubeconfig: Path, ca_file: Path, client_pki: Any, tag: str, server: Any
    ) -> None:
        self.url = url
        self.kubeconfig = kubeconfig  # admin token
        self.ca_file = ca_file  # the server's certificate
        self.client_pki = client_pki  # a client certificate it accepts (ipward_lab.servers.pki)
        self.tag = tag
        self.server: KubeApiServer | None = server  # None for the real one
        self.client = ApiClient(from_kubeconfig(str(kubeconfig)))
        self.admin = KubeAdmin(self.client)
        self.sources: list[LivenessSource] = []

    @classmethod
    def of_test_server(cls, server: KubeApiServer, kubeconfig: Path) -> KubeApi:
        """The test server, read with an admin kubeconfig written to `kubeconfig`."""
        written = server.kubeconfig(kubeconfig)
        return cls(server.url, written, server.ca_file, server.client_pki, "t", server)

    @classmethod
    def of_real_server(cls, lab: KubeLab, tag: str = "t") -> KubeApi:
        return cls(lab.url, lab.kubeconfig, lab.ca_file, lab.client_pki, tag, None)

    def name(self, base: str) -> str:
        return f"{base}-{self.tag}"

    def source(
        self, *options: str, node: str = "", kubeconfig: Path | None = None
    ) -> LivenessSource:
        """A `k8s://` source on this server (closed by `close`)."""
        from ipward.cluster.liveness import open_source

        query = "&".join([f"kubeconfig={kubeconfig or self.kubeconfig}", *options])
        source = open_source(f"k8s://?{query}", node=node)
        self.sources.append(source)
        return source

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self.client.close()
