"""Memory of the Kubernetes source, measured (not asserted): the test API server filled
with a cluster of `pods` pods (realistic objects: managedFields, specs, statuses), then a
fresh process opens a source on it, waits until synced and reports its resident memory.

Two figures: a controller-scoped source (every pod, node, namespace, StatefulSet) and an
agent-scoped one (one node's pods, `per_node` of them, and the namespaces). Run with
`python -m ipward_lab.bench.k8s_memory [PODS]`, or `ipward bench --k8s [--pods N]`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ipward_lab.servers.kube_test_server import kube_api_server

# Run in the measured process: import, read the baseline, open the source, wait, read.
PROBE = """
import gc, json, sys, time
def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
from ipward.cluster.liveness import open_source
import ipward.cluster.k8s.source
gc.collect()
before = rss()
start = time.monotonic()
source = open_source(sys.argv[1], node=sys.argv[2])
source.wait_listed(1200)
synced = time.monotonic() - start
pods = len(source.pods.snapshot()[0])
gc.collect()
after = rss()
print(json.dumps({"baseline": before["VmRSS"], "rss": after["VmRSS"], "peak": after["VmHWM"],
                  "pods": pods, "sync_seconds": round(synced, 2)}))
source.close()
"""


def _pod(i: int, node: str, namespace: str, shared: dict[str, Any]) -> dict:
    name = f"web-{i:06d}-{uuid.uuid4().hex[:5]}"
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "creationTimestamp": "2026-11-24T05:18:50Z",
            "labels": {"app": "web", "pod-template-hash": "5d2aa"},
            "annotations": shared["annotations"],
            "ownerReferences": shared["owners"],
            "managedFields": shared["managed"],
        },
        "spec": {**shared["spec"], "nodeName": node},
        "status": shared["status"],
    }


def _shared() -> dict[str, Any]:
    """Sub-objects every pod holds (the server keeps one copy; every answer repeats it).
    Over 80 lines as one literal: a realistic pod's parts, kept whole to read as one."""
    container = {
        "name": "web",
        "image": "registry.example.invalid/shop/web:1.27.3",
        "ports": [{"containerPort": 8080, "protocol": "TCP"}],
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}},
        "volumeMounts": [
            {
                "name": "kube-api-access",
                "readOnly": True,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            }
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    spec = {
        "volumes": [{"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": []}}],
        "containers": [container],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
        ],
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    status = {
        "phase": "Running",
        "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": "2026-11-24T05:18:51Z"}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "hostIP": "192.0.2.10",
        "podIP": "10.90.0.2",
        "startTime": "2026-11-24T05:18:50Z",
        "containerStatuses": [
            {
                "name": "web",
                "state": {"running": {"startedAt": "2026-11-24T05:18:51Z"}},
                "ready": True,
                "restartCount": 0,
                "image": container["image"],
                "imageID": "registry.example.invalid/shop/web@sha256:" + "0" * 64,
                "containerID": "containerd://" + "a" * 64,
            }
        ],
    }
    managed = [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-24T05:18:50Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {}, "f:ownerReferences": {}}, "f:spec": {}},
        },
        {
            "manager": "kubelet",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-24T05:18:51Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {}}},
            "subresource": "status",
        },
    ]
    owners = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "web-5d2aa",
            "uid": str(uuid.uuid4()),
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    annotations = {"kubectl.kubernetes.io/restartedAt": "2026-11-24T05:00:00Z"}
    return {
        "spec": spec,
        "status": status,
        "managed": managed,
        "owners": owners,
        "annotations": annotations,
    }


def _probe(url: str, node: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, url, node],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(pods: int = 100_000, per_node: int = 110, namespaces: int = 100) -> dict[str, Any]:
    """Fill a test server and measure both scopes; figures in bytes and seconds."""
    nodes = -(-pods // per_node)
    shared = _shared()
    with tempfile.TemporaryDirectory(prefix="ipward-kubemem-") as tmp:
        root = Path(tmp)
        with kube_api_server(root, bookmark_interval=30.0) as server:
            store = server.store
            store.load("namespaces", [{"metadata": {"name": f"ns-{n}"}} for n in range(namespaces)])
            store.load("nodes", [{"metadata": {"name": f"node-{n}"}} for n in range(nodes)])
            store.load(
                "statefulsets",
                [
                    {
                        "metadata": {"name": f"db-{n}", "namespace": f"ns-{n}"},
                        "spec": {"replicas": 3},
                    }
                    for n in range(namespaces)
                ],
            )
            store.load(
                "pods",
                [_pod(i, f"node-{i % nodes}", f"ns-{i % namespaces}", shared) for i in range(pods)],
            )
            url = f"k8s://?kubeconfig={server.kubeconfig(root / 'kubeconfig')}"
            controller = _probe(url, "")
            agent = _probe(url, "node-0")
    return {
        "cluster_pods": pods,
        "nodes": nodes,
        "controller": controller,
        "agent": agent,
    }


# Issue targets for the source's caches: the controller with 100,000 pods cached, an
# agent with 110 pods on its node whatever the cluster's size.
TARGETS_MIB = {"controller": 200, "agent": 60}


def report_lines(figures: dict[str, Any]) -> list[str]:
    """One line per scope: resident memory next to its target and the bare interpreter."""
    mib = 1024 * 1024
    lines = []
    for scope in ("controller", "agent"):
        f = figures[scope]
        rss, target = f["rss"] / mib, TARGETS_MIB[scope]
        verdict = "meets" if rss <= target else "misses"
        lines.append(
            f"{scope}: {f['pods']} pods cached of {figures['cluster_pods']}; resident"
            f" {rss:.1f} MiB, target {target} MiB ({verdict}); interpreter and imports"
            f" {f['baseline'] / mib:.1f} MiB; peak {f['peak'] / mib:.1f} MiB; synced in"
            f" {f['sync_seconds']}s"
        )
    return lines


def main() -> None:
    pods = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    for line in report_lines(measure(pods)):
        print(line)


if __name__ == "__main__":
    main()
