"""End to end in cluster mode: one etcd, three agents (three simulated nodes: separate
processes and sockets), the controller, and pods as network namespaces attached by
Debian's `bridge` plugin with ipward as its IPAM, one throwaway host namespace per node.
Pods are created concurrently across nodes, every pod pings, no address is handed out
twice, `ipward check` is clean; then every pod is deleted and the controller takes the
nodes' blocks back (release delay shortened for the test)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.store import open_store
from ipward_lab.fleet import IPWARD, run_cli
from ipward_lab.netlab import NetLab, Pod, bridge_network_config, skip_reason
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.waiting import wait_for
from test_agent import AgentProcess

pytestmark = [
    pytest.mark.net,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

NODES = ("node-1", "node-2", "node-3")
PODS_PER_NODE = 4
POOL = "pods"
SUBNET = "10.93.0.0/16"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict]:
    with etcd_server(tmp_path / "etcd") as etcd:
        run_cli(
            "pool",
            "create",
            POOL,
            "--range",
            f"{SUBNET},gateway=10.93.0.1",
            "--block-v4",
            "28",
            "--warm",
            "0",
            "--release-delay",
            "1",
            "--cooldown",
            "0",
            store=etcd.url,
            check=True,
        )
        agents = [
            AgentProcess(
                tmp_path,
                etcd.url,
                tmp_path / node / "agent.sock",
                node=node,
                extra=("--duty-interval", "0.2", "--node-ttl", "3"),
            )
            for node in NODES
        ]
        controller_log = tmp_path / "controller.log"
        controller = subprocess.Popen(
            [
                *IPWARD,
                "controller",
                "--store",
                etcd.url,
                "--interval",
                "0.3",
                "--lease-ttl",
                "3",
                "--ready-delay",
                "0.5",
                "--metrics-address",
                "off",
                "--log-file",
                str(controller_log),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        labs: list[NetLab] = []
        try:
            for agent in agents:
                agent.wait_ready()
            labs = [NetLab(prefix="ipwc") for _ in NODES]
            yield {"etcd": etcd, "agents": agents, "labs": labs, "log": controller_log}
        finally:
            for lab in labs:
                lab.close()
            controller.terminate()
            try:
                controller.wait(15)
            except subprocess.TimeoutExpired:
                controller.kill()
            for agent in agents:
                agent.kill()


def network(lab: NetLab, agent: AgentProcess) -> dict:
    ipam = {"type": "ipward", "pool": POOL, "agentSocket": str(agent.socket)}
    return bridge_network_config("e2e", lab.bridge, ipam)


def test_three_nodes_and_the_controller(cluster, cni_bin: Path) -> None:
    url = cluster["etcd"].url
    agents, labs = cluster["agents"], cluster["labs"]
    cni_path = [str(cni_bin), "/usr/lib/cni"]
    pods: list[tuple[int, Pod]] = [
        (n, labs[n].add_pod(f"p{n}-{i}", k8s_namespace="e2e"))
        for n in range(len(NODES))
        for i in range(PODS_PER_NODE)
    ]
    results: dict[str, str] = {}
    errors: list[str] = []
    barrier = threading.Barrier(len(pods))

    def attach(n: int, pod: Pod) -> None:
        barrier.wait()
        outcome = labs[n].cni("ADD", pod, "eth0", network(labs[n], agents[n]), cni_path=cni_path)
        if outcome.ok:
            results[pod.name] = outcome.ips[0].split("/")[0]
        else:
            errors.append(outcome.describe())

    threads = [threading.Thread(target=attach, args=(n, pod)) for n, pod in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results.values())) == len(pods)  # no address twice

    # Each address is on its pod's eth0, comes from a block of its own node, and pings.
    with open_store(url) as store:
        for n, pod in pods:
            ip = results[pod.name]
            assert labs[n].addresses(pod) == [f"{ip}/16"]
            record = rec.decode(store.get(keys.ip_key(POOL, ip)).value)
            assert record["node"] == NODES[n]
            block = rec.decode(store.get(keys.block_key(POOL, record["block"])).value)
            assert block["node"] == NODES[n]
    for n, pod in pods:
        neighbours = [p for m, p in pods if m == n and p is not pod]
        for other in neighbours:
            assert labs[n].ping(pod, results[other.name]), (pod.name, other.name)
        assert labs[n].ping(pod, "10.93.0.1")
    assert run_cli("check", store=url).returncode == 0

    # Every pod deleted (DEL twice, as containerd does): the pool empties and the
    # controller takes every block back through the handshake.
    for n, pod in pods:
        for _ in range(2):
            outcome = labs[n].cni(
                "DEL", pod, "eth0", network(labs[n], agents[n]), cni_path=cni_path
            )
            assert outcome.ok, outcome.describe()
    with open_store(url) as store:
        assert store.range(f"ips/{POOL}/")[0] == []
        wait_for(lambda: not store.range(f"blocks/{POOL}/")[0], "blocks to be released")
        assert store.range(f"affinity/{POOL}/")[0] == []
        assert store.range(f"blockfree/{POOL}/")[0]  # claimed again before new ones
    assert run_cli("check", store=url).returncode == 0
    released = [
        line for line in cluster["log"].read_text().splitlines() if "block released" in line
    ]
    assert released
