"""The cluster lab's routing layer under ipward: a route per pod address, following
ipward's node index.

With one cluster-wide pool, an address lives wherever ipward put it: in a block of its
node, or, for a sticky address, wherever its pod went. A cluster's network follows the
IPAM's allocations (Calico programs a route per block and per borrowed address; a cloud
route controller a route per node's range); in the cluster lab this daemon does: it
reads ipward's node index (`nodeips/<node>/<pool>/<ip>`, written in the same transaction
as each allocation record) with the product's store client and follows it by a watch,
keeping in the fabric namespace a /32 route per address of the pod network (POD_NET)
through its node, and in
each node's namespace one through the other node for every address that lives
elsewhere. Each node's `cni0` answers ARP for those (`proxy_arp`), so a pod reaches any
pod of the /16 through its node.

It follows the index as ipward follows its store (`store.follower.BackgroundFollower`:
read whole, watch from the next revision, read whole again, backing off, when the watch
ends). Its routes carry the protocol ROUTE_PROTO, so a full sync (at each whole read)
compares exactly its own routes.

Run by the lab in the control plane's namespace, where the store is reached:
`python -m ipward_lab.kubecluster.route_syncer STATE`, started and stopped with the
pods' IPAM (`RouteSyncer`, which `deploy.Deployment.use_ipam` calls).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import threading
from pathlib import Path

from ipward.core import keys
from ipward.store import open_store
from ipward.store.base import DELETE, Event, KeyValue
from ipward.store.follower import BackgroundFollower, Stamp
from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import run, wait_for
from ipward_lab.kubecluster.layout import POD_NET
from ipward_lab.kubecluster.processes import Daemons
from ipward_lab.kubecluster.state import ClusterState

ROUTE_PROTO = "77"  # marks the routes this daemon owns (a number no routing daemon names)
DAEMON = "route-syncer"  # its name among the lab's daemons


class Fabric:
    """The namespaces to route in: the fabric's (every address through its node) and
    each node's (every address of another node through that node)."""

    def __init__(self, fabric_netns: str, nodes: dict[str, tuple[str, str]]) -> None:
        self.fabric_netns = fabric_netns
        self.nodes = nodes  # name -> (its address on the fabric, its netns file)

    def desired(self, owners: dict[str, str], netns: str, here: str | None) -> dict[str, str]:
        """address -> next hop, in namespace `netns` (of node `here`, None: the fabric)."""
        routes = {}
        for ip, node in owners.items():
            if node != here and node in self.nodes:
                routes[ip] = self.nodes[node][0]
        return routes

    def namespaces(self) -> list[tuple[str, str | None]]:
        return [(self.fabric_netns, None)] + [(ns, name) for name, (_, ns) in self.nodes.items()]


def _ip_batch(netns: str, lines: list[str]) -> None:
    if not lines:
        return
    # -force: a route already gone (or already there) does not stop the rest.
    subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-force", "-batch", "-"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )


def _present(netns: str) -> dict[str, str]:
    out = subprocess.run(
        ["nsenter", f"--net={netns}", "ip", "-j", "-4", "route", "show", "proto", ROUTE_PROTO],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return {r["dst"]: r.get("gateway", "") for r in json.loads(out or "[]")}


def _line(ip: str, via: str | None) -> str:
    if via is None:
        return f"route del {ip}/32 proto {ROUTE_PROTO}"
    return f"route replace {ip}/32 via {via} proto {ROUTE_PROTO}"


def sync_all(fabric: Fabric, owners: dict[str, str]) -> None:
    for netns, here in fabric.namespaces():
        want = fabric.desired(owners, netns, here)
        have = _present(netns)
        lines = [_line(ip, via) for ip, via in want.items() if have.get(ip) != via]
        lines += [_line(ip, None) for ip in have if ip not in want]
        _ip_batch(netns, lines)


def sync_changed(fabric: Fabric, owners: dict[str, str], changed: set[str]) -> None:
    for netns, here in fabric.namespaces():
        want = fabric.desired({ip: owners[ip] for ip in changed if ip in owners}, netns, here)
        _ip_batch(netns, [_line(ip, want.get(ip)) for ip in sorted(changed)])


def _routed(ip: str) -> bool:
    """An address of the pod network (a secondary network's, e.g. through Multus, lives
    on its own bridges: not routed between nodes)."""
    try:
        return ipaddress.ip_address(ip) in POD_NET
    except ValueError:
        return False


class Routes:
    """What the follower keeps current (a `store.follower.Copy`): each routed address's
    node, and the routes that go with it."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.owners: dict[str, str] = {}

    def load(self, kvs: list[KeyValue], stamp: Stamp, seen: float | None) -> None:
        self.owners = {}
        for kv in kvs:
            node, _, ip = keys.node_ip_parts(kv.key)
            if _routed(ip):
                self.owners[ip] = node
        sync_all(self.fabric, self.owners)

    def apply(self, events: list[Event], stamp: Stamp) -> None:
        changed = set()
        for event in events:
            node, _, ip = keys.node_ip_parts(event.kv.key)
            if not _routed(ip):
                continue
            if event.kind == DELETE:
                if self.owners.get(ip) == node:  # a move puts the new node's entry too
                    del self.owners[ip]
            else:
                self.owners[ip] = node
            changed.add(ip)
        sync_changed(self.fabric, self.owners, changed)


class RouteSyncer:
    """The route syncer as the lab runs it: one daemon while the pods' IPAM is ipward."""

    def __init__(self, lab: ClusterState, daemons: Daemons, clients: Clients) -> None:
        self.lab = lab
        self.daemons = daemons
        self.clients = clients

    def start(self) -> None:
        """Started (again, when it runs: a fresh whole read of the index)."""
        if self.daemons.running(DAEMON):
            self.daemons.restart(DAEMON)
        else:
            argv = [
                sys.executable,
                "-m",
                "ipward_lab.kubecluster.route_syncer",
                str(self.lab.state),
            ]
            self.daemons.launch(DAEMON, self.lab.in_cp(argv))

    def stop(self) -> None:
        """Killed, when it runs, and no longer the lab's daemon."""
        if self.daemons.running(DAEMON):
            self.daemons.forget(DAEMON)

    def wait_routes(self, timeout: float = 30.0) -> None:
        """Every address ipward has given a sandbox routed in the fabric through the node
        of its record (the route syncer caught up with the records read now)."""
        records = json.loads(self.clients.ipward_run("alloc", "list", "--json").stdout)
        node_ip = {n.name: n.ip for n in self.lab.nodes}
        want = {r["ip"]: node_ip[r["node"]] for r in records if r["container"]}

        def caught_up() -> bool:
            self.daemons.alive(DAEMON)
            out = run(
                [
                    "nsenter", f"--net={self.lab.fabric_netns}",
                    "ip", "-j", "-4", "route", "show", "proto", ROUTE_PROTO,
                ]
            )  # fmt: skip
            have = {r["dst"]: r.get("gateway") for r in json.loads(out or "[]")}
            return want.items() <= have.items()

        wait_for(caught_up, "the route syncer's routes for every address", timeout, 0.1)


def main(argv: list[str]) -> int:
    lab = ClusterState.load(Path(argv[0]))
    fabric = Fabric(lab.fabric_netns, {n.name: (n.ip, n.netns) for n in lab.nodes})
    store = open_store(lab.ipward_store_url, create=False)
    follower = BackgroundFollower(
        store,
        keys.node_ips_prefix(),
        Routes(fabric),
        name="route syncer",
        counted=lambda reason: None,
        log_fields={},
    )
    follower.start()
    threading.Event().wait()  # until the lab stops it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
