"""Plays the rest of a cluster against an API server (the real kube-apiserver or the test
server, over HTTP alike): makes namespaces, nodes, pods and StatefulSets, and does what
a kubelet would (pod status updates, the final delete with grace 0), since neither
server runs a kubelet or a controller-manager here."""

from __future__ import annotations

import uuid

from ipward.cluster.k8s.client import ApiClient

IMAGE = "example.invalid/pause:1"


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
    ) -> str:
        """Create a pod bound to `node`; its UID. `owner` (kind, name): the controlling
        ownerReference (a StatefulSet must exist: its UID is looked up)."""
        meta = _meta(name, annotations)
        if owner is not None:
            kind, owner_name = owner
            uid = str(uuid.uuid4())  # an owner no server here checks (a ReplicaSet, a Job)
            if kind == "StatefulSet":
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

    def pod_phase(self, namespace: str, name: str, phase: str, finished_at: str = "") -> None:
        """Set the pod's phase as its kubelet would; a terminal phase with `finished_at`
        (RFC 3339) records the container's terminated state."""
        if phase in ("Succeeded", "Failed"):
            state: dict = {
                "terminated": {
                    "exitCode": 0 if phase == "Succeeded" else 1,
                    "reason": "Completed" if phase == "Succeeded" else "Error",
                    "startedAt": finished_at,
                    "finishedAt": finished_at,
                }
            }
        else:
            state = {"running": {"startedAt": finished_at}} if phase == "Running" else {}
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

    def delete_pod(self, namespace: str, name: str, grace: int = 0) -> None:
        self.client.request(
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={"gracePeriodSeconds": grace},
        )

    def statefulset(self, namespace: str, name: str, replicas: int) -> None:
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
        self.client.request("POST", f"/apis/apps/v1/namespaces/{namespace}/statefulsets", body=body)

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.client.request(
            "PATCH",
            f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
            body={"spec": {"replicas": replicas}},
        )

    def delete_statefulset(self, namespace: str, name: str) -> None:
        self.client.request("DELETE", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}")
