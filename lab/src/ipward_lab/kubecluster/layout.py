"""Where everything of a cluster lab is: its addresses (the fabric, the control plane, the
API's Service, the pod network), the names the nodes share (the CNI network, ipward's
pool and socket, the pods' bridge, the conflist), and each node's plan (`Node`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[4]  # lab/src/ipward_lab/kubecluster/ -> the checkout
DEFAULT_STATE = Path("/tmp/ipward-cluster")
FABRIC_NET = ipaddress.ip_network("10.250.0.0/24")
FABRIC_GATEWAY = "10.250.0.1"
CONTROL_PLANE_IP = "10.250.0.2"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service
API_PORT = 6443
IPWARD_ETCD_PORT = 2379  # on CONTROL_PLANE_IP, with `deploy --store etcd`
STORES = ("k8s", "etcd")  # where `deploy` has ipward keep its ledger; the first by default
POD_NET = ipaddress.ip_network("10.244.0.0/16")
POD_GATEWAY = "10.244.0.1"  # on every node's cni0
NETWORK = "pods"  # the CNI network's name, the same on every node
POOL = "pods"  # ipward's cluster-wide pool on POD_NET, made by `deploy`
CNI_PLUGINS = Path("/usr/lib/cni")
AGENT_SOCKET = "/run/ipward/agent.sock"
BRIDGE = "cni0"
LAB_CONFLIST = "/etc/cni/net.d/10-lab.conflist"  # the pod network's, on every node


@dataclass
class Node:
    name: str
    index: int
    ip: str  # on the fabric; the kubelet's --node-ip
    pod_cidr: str  # its range under host-local
    dir: str
    netns: str  # file of its network namespace
    mntns: str  # file of its mount namespace
    cgroup_root: str  # the kubelet's cgroupRoot, e.g. /ipward-cluster-1a2b3c-n1
    python: bool = True  # False: no Python can run in its mount namespace (`nodes`)

    @property
    def containerd_socket(self) -> str:
        """containerd's socket as seen from the machine (its /run is the node's dir)."""
        return f"{self.dir}/run/containerd/containerd.sock"


def node_plan(state: Path, cluster_id: str, count: int, without_python: int = 0) -> list[Node]:
    """`count` nodes, the last `without_python` of them with no Python."""
    nodes = []
    for i in range(1, count + 1):
        name = f"n{i}"
        nodes.append(
            Node(
                name=name,
                index=i,
                ip=str(FABRIC_NET.network_address + 10 + i),
                pod_cidr=f"10.244.{i}.0/24",
                dir=str(state / "nodes" / name),
                netns=str(state / "ns" / f"{name}.net"),
                mntns=str(state / "ns" / f"{name}.mnt"),
                cgroup_root=f"/ipward-cluster-{cluster_id}-{name}",
                python=i <= count - without_python,
            )
        )
    return nodes
