"""The `k8s://` source's parsers (`ipward.cluster.k8s.objects`) read the objects a real
kube-apiserver 1.26 sent (recorded in `tests/k8s_wire/`) right: owners, phases,
annotations, graceful deletes, namespaces and StatefulSets. (The test API server
against those exchanges: `tests/system/test_k8s_wire.py`.)"""

from __future__ import annotations

from typing import Any

from ipward.cluster.k8s.objects import api_time, parse_namespace, parse_pod, parse_statefulset
from support import recorded


def recorded_pods() -> dict[str, dict]:
    pods: dict[str, Any] = {}
    for page in ("pods-list-page1", "pods-list-page2"):
        for item in recorded(page)["body"]["items"]:
            pods[item["metadata"]["name"]] = item
    for entry in recorded("pods-watch-bookmarks")["stream"]:
        obj = entry["event"]["object"]
        if entry["event"]["type"] != "BOOKMARK":
            pods[f"{obj['metadata']['name']}@{entry['event']['type']}"] = obj
    return pods


def test_parse_recorded_pods() -> None:
    pods = recorded_pods()
    _, db0 = parse_pod(pods["db-0"])
    assert (db0.owner_kind, db0.owner_name, db0.phase, db0.node) == (
        "StatefulSet",
        "db",
        "Running",
        "n1",
    )
    assert db0.annotations == {}  # example.com/note is not ours
    _, web = parse_pod(pods["web-5d2aa-x7k2p"])
    assert web.annotations == {"ipward.io/pool": "web-pool"}
    assert web.owner_kind == "ReplicaSet"
    _, job = parse_pod(pods["job-abc12"])
    assert job.terminal and job.finished_at == api_time("2026-11-24T05:18:50Z")
    assert job.owner_kind == ""  # no controlling owner
    # A graceful delete: deletionTimestamp is the ask plus the grace.
    deleting = next(
        obj
        for key, obj in pods.items()
        if key.startswith("web-5d2aa-x7k2p@") and obj["metadata"].get("deletionTimestamp")
    )
    _, marked = parse_pod(deleting)
    stamp = api_time(deleting["metadata"]["deletionTimestamp"])
    assert marked.grace == 30.0 and marked.deleted_at == stamp - 30
    _, gone = parse_pod(pods["db-1@DELETED"])
    assert gone.grace == 0.0 and gone.deleted_at == api_time(
        pods["db-1@DELETED"]["metadata"]["deletionTimestamp"]
    )
    _, failed = parse_pod(pods["web-5d2aa-q9z8m@MODIFIED"])  # the last MODIFIED: Failed
    assert failed.phase == "Failed"


def test_parse_recorded_namespaces_and_statefulsets() -> None:
    namespaces = dict(
        parse_namespace(i) for i in recorded("namespaces-list-metadata")["body"]["items"]
    )
    assert namespaces["shop"] == {"ipward.io/pool": "shop-pool"} and namespaces["default"] == {}
    sets = dict(parse_statefulset(i) for i in recorded("statefulsets-list")["body"]["items"])
    assert sets == {"shop/db": 2}
