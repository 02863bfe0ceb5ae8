"""The cluster lab's network: every namespace a file in the state dir (`unshare
--net=FILE`, `--mount=FILE`, never `ip netns` names in /run); the fabric, a bridge in a
namespace of its own joined by a veth pair to the control plane and every node; on each
node the pods' bridge (`proxy_arp`: it answers for the addresses of the /16 that live
elsewhere) and the API's Service address (a DNAT rule, as kube-proxy would make it);
host-local's node-range routes; and the pod network's conflist on each node, host-local
or ipward as its IPAM. The routes of ipward's addresses are the route syncer's
(`route_syncer`)."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

from ipward_lab.kubecluster.common import ClusterError, run
from ipward_lab.kubecluster.layout import (
    AGENT_SOCKET,
    API_PORT,
    BRIDGE,
    CONTROL_PLANE_IP,
    FABRIC_GATEWAY,
    FABRIC_NET,
    LAB_CONFLIST,
    NETWORK,
    POD_GATEWAY,
    POD_NET,
    POOL,
    SERVICE_IP,
    Node,
)
from ipward_lab.kubecluster.state import ClusterState


def bridge_conflist(node: Node, ipam_type: str) -> dict[str, Any]:
    """The pod network on `node`: `bridge` (the node routes, pods' default route through
    it) with `ipam_type` as IPAM: host-local on the node's own range, or ipward on the
    cluster-wide pool (its `ipam` as README says to switch: the pool and the agent's
    socket). Both give pods the same gateway and prefix, so the bridge's address stays."""
    if ipam_type == "host-local":
        first = ipaddress.ip_network(node.pod_cidr).network_address
        ipam: dict[str, Any] = {
            "type": "host-local",
            "ranges": [
                [
                    {
                        "subnet": str(POD_NET),
                        "rangeStart": str(first + 1),
                        "rangeEnd": str(first + 254),
                        "gateway": POD_GATEWAY,
                    }
                ]
            ],
        }
    elif ipam_type == "ipward":
        ipam = {"type": "ipward", "pool": POOL, "agentSocket": AGENT_SOCKET}
    else:
        raise ClusterError(f"unknown IPAM {ipam_type!r}: host-local or ipward")
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": ipam,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


class Network:
    def __init__(self, lab: ClusterState) -> None:
        self.lab = lab

    def make(self) -> None:
        """The namespaces and the fabric, each node's bridge and Service address."""
        self._namespaces()
        self._fabric()

    def _namespaces(self) -> None:
        ns_dir = self.lab.state / "ns"
        # A mount namespace can be kept in a file only on a mount of private propagation.
        self.lab.journal.record("mount", path=str(ns_dir))
        run(["mount", "--bind", str(ns_dir), str(ns_dir)])
        run(["mount", "--make-private", str(ns_dir)])
        for path in (
            self.lab.fabric_netns,
            self.lab.cp_netns,
            *(n.netns for n in self.lab.nodes),
        ):
            Path(path).touch()
            self.lab.journal.record("mount", path=path)
            run(["unshare", f"--net={path}", "true"])
        for node in self.lab.nodes:
            Path(node.mntns).touch()
            self.lab.journal.record("mount", path=node.mntns)
            run(["unshare", f"--mount={node.mntns}", "--propagation=private", "true"])

    def _ip(self, netns: str, *args: str) -> None:
        run(["nsenter", f"--net={netns}", "ip", *args])

    def _sysctl(self, netns: str, key: str, value: str) -> None:
        run(["nsenter", f"--net={netns}", "sysctl", "-qw", f"{key}={value}"])

    def _fabric(self) -> None:
        fabric = self.lab.fabric_netns
        self._ip(fabric, "link", "set", "lo", "up")
        self._ip(fabric, "link", "add", "fabric0", "type", "bridge")
        self._ip(
            fabric, "addr", "add", f"{FABRIC_GATEWAY}/{FABRIC_NET.prefixlen}", "dev", "fabric0"
        )
        self._ip(fabric, "link", "set", "fabric0", "up")
        self._sysctl(fabric, "net.ipv4.ip_forward", "1")
        self._plug("cp", self.lab.cp_netns, CONTROL_PLANE_IP)
        for node in self.lab.nodes:
            self._boot(node)

    def _plug(self, name: str, netns: str, ip: str) -> None:
        """Namespace `netns` joined to the fabric (its `eth0`, the fabric's port `name`)
        with address `ip` and the fabric as its default route, forwarding."""
        self._ip(netns, "link", "set", "lo", "up")
        self._ip(
            netns, "link", "add", "eth0", "type", "veth", "peer", "name", name,
            "netns", self.lab.fabric_netns,
        )  # fmt: skip
        self._ip(self.lab.fabric_netns, "link", "set", name, "master", "fabric0", "up")
        self._ip(netns, "addr", "add", f"{ip}/{FABRIC_NET.prefixlen}", "dev", "eth0")
        self._ip(netns, "link", "set", "eth0", "up")
        self._ip(netns, "route", "add", "default", "via", FABRIC_GATEWAY)
        self._sysctl(netns, "net.ipv4.ip_forward", "1")

    def _boot(self, node: Node) -> None:
        """The node's network as its boot makes it, in its (empty) namespace: its link to
        the fabric, the pods' bridge and the API's Service address."""
        self._plug(node.name, node.netns, node.ip)
        # The pods' bridge, made before `bridge` finds it so that it answers ARP for the
        # addresses of the /16 that live elsewhere (routed out of eth0).
        self._ip(node.netns, "link", "add", BRIDGE, "type", "bridge")
        self._ip(node.netns, "link", "set", BRIDGE, "up")
        self._sysctl(node.netns, f"net.ipv4.conf.{BRIDGE}.proxy_arp", "1")
        # The API's Service address, as kube-proxy would make it (none exists here).
        for chain in ("OUTPUT", "PREROUTING"):
            run(
                [
                    "nsenter", f"--net={node.netns}", "iptables", "-w", "-t", "nat",
                    "-A", chain, "-d", SERVICE_IP, "-p", "tcp", "--dport", "443",
                    "-j", "DNAT", "--to-destination", f"{CONTROL_PLANE_IP}:{API_PORT}",
                ]
            )  # fmt: skip

    def power_off(self, node: Node) -> None:
        """The node's network state gone, as a machine's at power off: its namespace
        unmounted (destroyed with every link, address, route and rule in it, once no
        process is left in it) and its port on the fabric removed. `power_on` makes it
        again."""
        self._ip(self.lab.fabric_netns, "link", "del", node.name)  # and its end, eth0
        run(["umount", node.netns])

    def power_on(self, node: Node) -> None:
        """A new, empty network namespace for the node (`power_off`), as its boot
        configures it (`_boot`); the node-range routes through it, under host-local."""
        run(["unshare", f"--net={node.netns}", "true"])
        self._boot(node)
        if self.lab.info.get("cni") == "host-local":
            self.node_range_routes(present=True)

    def node_range_routes(self, present: bool) -> None:
        """The routes of host-local's node ranges (each node's range through that node),
        in the fabric and in the other nodes (straight to the node, not through the
        fabric): made (`present`) or removed (also when they are not there)."""
        for node in self.lab.nodes:
            for netns, via in [(self.lab.fabric_netns, node.ip)] + [
                (other.netns, node.ip) for other in self.lab.nodes if other is not node
            ]:
                if present:
                    self._ip(netns, "route", "replace", node.pod_cidr, "via", via)
                else:
                    self._ip(netns, "route", "flush", "exact", node.pod_cidr)

    def write_conflist(self, node: Node, ipam_type: str) -> None:
        """The node's pod network on `ipam_type` (`bridge_conflist`), its conflist written
        in place (containerd 1.6 does not see a file renamed into its conf dir)."""
        text = json.dumps(bridge_conflist(node, ipam_type), indent=2)
        run(
            self.lab.in_node(node, ["sh", "-ec", f"cat > {LAB_CONFLIST}"]),
            input=text,
        )
