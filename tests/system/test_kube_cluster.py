"""ipward under real kubelets: a cluster of 3 nodes on this machine (`ipward cluster`,
`ipward_lab.kubecluster`), ipward installed from its own image and `deploy/`, pods made
by a real Deployment controller, scheduler and kubelets. Marked `kube`: not in the
default test command (`pytest -m kube` runs it); skipped without the Kubernetes binaries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ipward_lab.kubecluster.cluster import Cluster
from ipward_lab.kubecluster.common import wait_for
from ipward_lab.kubecluster.teardown import leftovers, machine_snapshot, namespace_ids
from kube_checks import require_cluster_lab
from support import static_x86_64_executable

pytestmark = [pytest.mark.kube, pytest.mark.timeout(1800)]

IPWARD = str(Path(sys.executable).parent / "ipward")
REPLICAS = 9
RUNNING_TIMEOUT = 180.0

SPREAD = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "spread", "namespace": "default"},
    "spec": {
        "replicas": REPLICAS,
        "selector": {"matchLabels": {"app": "spread"}},
        "template": {
            "metadata": {"labels": {"app": "spread"}},
            "spec": {
                "terminationGracePeriodSeconds": 5,
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "spread"}},
                    }
                ],
                "containers": [
                    {"name": "sleep", "image": "ipward.test/sleep:lab", "imagePullPolicy": "Never"}
                ],
            },
        },
    },
}


def test_down_after_a_crash_of_up_removes_what_it_made() -> None:
    """`up` killed (SIGKILL) once a node's kubelet is started: `down` finds all it made
    from the journal, and the machine keeps nothing of it."""
    require_cluster_lab()
    # Short: the nodes' socket paths under it must fit a Unix socket's.
    state = Path(tempfile.mkdtemp(prefix="ipwc-", dir="/tmp")) / "crashed"
    up_log = state.parent / "up.log"
    with open(up_log, "wb") as log:
        up = subprocess.Popen(
            [IPWARD, "cluster", "up", "--nodes", "1", "--state", str(state)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    lab = Cluster(state)
    try:
        try:
            wait_for(
                lambda: (
                    any(e.get("name") == "n1-kubelet" for e in lab.journal.entries())
                    or up.poll() is not None
                ),
                "the kubelet started",
                120.0,
                0.1,
            )
        finally:
            up.kill()
            up.wait()
        assert up.returncode == -9, up_log.read_text()
        lab = Cluster.load(state)  # cluster.json is written before anything is made
        ns_ids = namespace_ids(lab)
        assert len(ns_ids) == 4, "fabric, control plane, the node's network and mount namespaces"
        down = subprocess.run(
            [IPWARD, "cluster", "down", "--state", str(state)], capture_output=True, text=True
        )
        assert down.returncode == 0, down.stderr
        assert leftovers(state, lab.info["id"], ns_ids) == []
    finally:
        lab.down(lambda text: None)  # whatever the test left (nothing when it passed)
        shutil.rmtree(state.parent, ignore_errors=True)


def running_pods(lab: Cluster, selector: str) -> list[dict[str, Any]]:
    pods = lab.kubectl_json("get", "pods", "-l", selector)["items"]
    return [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]


def test_deployment_spread_over_nodes_gets_addresses_from_ipward(kube_cluster: Cluster) -> None:
    lab = kube_cluster
    started = time.monotonic()
    lab.kubectl("apply", "-f", "-", input=json.dumps(SPREAD))
    pods = wait_for(
        lambda: (found := running_pods(lab, "app=spread")) and len(found) == REPLICAS and found,
        f"{REPLICAS} pods Running",
        RUNNING_TIMEOUT,
        1.0,
    )
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert nodes == {n.name for n in lab.nodes}, "the spread constraint puts pods on every node"
    addresses = [p["status"]["podIP"] for p in pods]
    assert len(set(addresses)) == REPLICAS, f"duplicate addresses: {sorted(addresses)}"

    # Every pod's address is ipward's record of its sandbox, on its node's pool.
    records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
    by_pod = {(r["pod"]["namespace"], r["pod"]["name"]): r for r in records}
    for pod in pods:
        record = by_pod.get(("default", pod["metadata"]["name"]))
        assert record is not None, f"no ipward record for {pod['metadata']['name']}"
        assert record["ip"] == pod["status"]["podIP"]
        assert record["node"] == pod["spec"]["nodeName"]
        assert record["pod"]["uid"] == pod["metadata"]["uid"]
    # ...and what every node's runtime says each sandbox has.
    runtime = {s.uid: s.ip for n in lab.nodes for s in lab.sandboxes(n) if s.namespace == "default"}
    assert {p["metadata"]["uid"]: p["status"]["podIP"] for p in pods}.items() <= runtime.items()

    # From one pod on each node to one pod on every node, across the fabric (once the
    # lab's route syncer has routed every address ipward gave).
    lab.wait_routes()
    first_on = {}
    for pod in pods:
        first_on.setdefault(pod["spec"]["nodeName"], pod)
    failed = []
    for source in first_on.values():
        for target in first_on.values():
            out = lab.in_pod_netns(
                lab.node(source["spec"]["nodeName"]),
                source["metadata"]["uid"],
                "ping", "-c", "1", "-W", "3", target["status"]["podIP"],
            )  # fmt: skip
            if out.returncode != 0:
                failed.append(f"{source['spec']['nodeName']} -> {target['status']['podIP']}")
    assert not failed, f"pings failed: {failed}"

    check = lab.ipward_run("check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    lab.kubectl("delete", "deployment", "spread", "--wait=true")  # the cluster is shared
    print(
        f"[cluster] up {lab.info['up_seconds']}s, deploy {lab.info['deploy_seconds']}s,"
        f" {REPLICAS} pods Running and checked in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )


def test_ipward_installed_by_one_apply_and_one_ippool_without_an_etcd(
    kube_cluster: Cluster,
) -> None:
    """The install is `kubectl apply -k deploy/base` and one IPPool: ipward keeps its
    ledger in the API (LedgerShard objects), the pool is an object the controller took
    (Ready, its status counting what the ledger holds), and no etcd of ipward's runs
    anywhere, nor does a Secret name one."""
    lab = kube_cluster
    assert lab.store == "k8s"
    for kind, name in (("daemonset", "ipward-agent"), ("deployment", "ipward-controller")):
        spec = lab.kubectl_json("--namespace=ipward-system", "get", kind, name)["spec"]
        args = [a for c in spec["template"]["spec"]["containers"] for a in c.get("args", [])]
        assert "--store=k8s://" in args, f"{name}: {args}"
    etcds = [
        name
        for name, p in lab.info.get("processes", {}).items()
        if any(Path(arg).name == "etcd" for arg in p["argv"])
    ]
    assert etcds == ["etcd"], f"etcds running: {etcds} (the cluster's alone expected)"
    secrets = lab.kubectl_json("--namespace=ipward-system", "get", "secrets")["items"]
    assert "ipward-etcd" not in {s["metadata"]["name"] for s in secrets}
    pool = lab.kubectl_json("get", "ippools.ipward.io", "pods")
    ready = [c for c in pool["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", pool["status"]
    pools = json.loads(lab.ipward_run("pool", "list", "--json").stdout)
    assert "pods" in {p["name"] for p in pools}, pools
    shards = lab.kubectl_json("--namespace=ipward-system", "get", "ledgershards.ipward.io")
    assert shards["items"], "no LedgerShard object: the ledger is not in the API"


def test_a_node_without_python_runs_pods_through_the_installed_plugin(
    kube_cluster: Cluster,
) -> None:
    """On a node where no Python can run (its python3* are bound over by a program that
    is not an interpreter), the DaemonSet's init container has installed the node's
    plugin, one static executable, and pods started there hold ipward's addresses."""
    lab = kube_cluster
    node = next(n for n in lab.nodes if not n.python)
    python = subprocess.run(
        lab.in_node(node, ["/usr/bin/python3", "-c", "print('python')"]),
        capture_output=True,
        text=True,
    )
    assert python.returncode != 0 and "python" not in python.stdout, "Python ran on the node"
    plugin = Path(node.dir) / "opt" / "cni" / "bin" / "ipward"
    assert static_x86_64_executable(plugin.read_bytes()), f"{plugin}: not a static executable"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "no-python", "namespace": "default"},
        "spec": {
            "nodeName": node.name,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "sleep", "image": "ipward.test/sleep:lab", "imagePullPolicy": "Never"}
            ],
        },
    }
    lab.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        running = wait_for(
            lambda: (
                (p := lab.kubectl_json("get", "pod", "no-python"))["status"].get("phase")
                == "Running"
                and p["status"].get("podIP")
                and p
            ),
            f"the pod on {node.name} Running",
            RUNNING_TIMEOUT,
            1.0,
        )
        records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
        mine = [r for r in records if r["pod"].get("uid") == running["metadata"]["uid"]]
        assert [(r["ip"], r["node"]) for r in mine] == [(running["status"]["podIP"], node.name)]
    finally:
        lab.kubectl("delete", "pod", "no-python", "--wait=true", check=False)


def test_down_leaves_the_machine_as_before(kube_cluster: Cluster) -> None:
    """Run after every other test of the cluster (conftest orders it last)."""
    if os.environ.get("IPWARD_KUBE_STATE"):
        pytest.skip("the cluster is not this run's: it stays up")
    lab = kube_cluster
    ns_ids = namespace_ids(lab)
    assert len(ns_ids) == 2 + 2 * len(lab.nodes)
    left = lab.down(lambda text: None)
    assert left == []
    assert leftovers(lab.state, lab.info["id"], ns_ids) == []
    assert machine_snapshot() == lab.machine_before  # type: ignore[attr-defined]
