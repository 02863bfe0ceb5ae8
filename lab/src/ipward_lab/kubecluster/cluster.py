"""`Cluster`, the cluster lab as its users hold it (`ipward cluster`, the `kube` tests,
`ipward bench --kube`): made by `up`, ipward installed by `deploy`, removed by `down`;
its state dir (`state.ClusterState`) and its parts, each a module of this package."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ipward_lab.containerd.images import PAUSE_IMAGE, SLEEP_IMAGE, build_test_images
from ipward_lab.kubecluster import teardown
from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import READY_TIMEOUT, ClusterError, wait_for
from ipward_lab.kubecluster.controlplane import ControlPlane
from ipward_lab.kubecluster.deploy import Deployment
from ipward_lab.kubecluster.layout import (
    CONTROL_PLANE_IP,
    FABRIC_GATEWAY,
    SERVICE_IP,
    Node,
    node_plan,
)
from ipward_lab.kubecluster.multus import Multus
from ipward_lab.kubecluster.network import Network
from ipward_lab.kubecluster.nodes import Workers
from ipward_lab.kubecluster.pki import client_kubeconfig, make_pki
from ipward_lab.kubecluster.prerequisites import find_binaries, missing_tools
from ipward_lab.kubecluster.processes import Daemons
from ipward_lab.kubecluster.route_syncer import RouteSyncer
from ipward_lab.kubecluster.state import ClusterState


class Cluster(ClusterState):
    """A cluster lab in `state` (see the package doc). `up` makes it, `deploy` installs
    ipward on it, `down` removes all it made; `Cluster.load(state)` reads one that is up
    (cluster.json). Each of its other methods is a part's, named where it is made."""

    def __init__(self, state: Path) -> None:
        super().__init__(state)
        daemons = Daemons(self)
        clients = Clients(self)
        network = Network(self)
        workers = Workers(self, daemons, clients, network)
        multus = Multus(self, clients)
        route_syncer = RouteSyncer(self, daemons, clients)
        control_plane = ControlPlane(self, daemons, clients)
        deployment = Deployment(self, clients, network, workers, route_syncer, control_plane)
        self._network = network
        self._control_plane = control_plane
        self._workers = workers
        self._route_syncer = route_syncer
        # What its users call, from the part that does it.
        self.kill = daemons.kill
        self.api = clients.api
        self.kubectl = clients.kubectl
        self.kubectl_json = clients.kubectl_json
        self.make_namespace = clients.make_namespace
        self.ipward_argv = clients.ipward_argv
        self.ipward_run = clients.ipward_run
        self.metrics = clients.metrics
        self.import_images = workers.import_images
        self.sandboxes = workers.sandboxes
        self.sandbox_pid = workers.sandbox_pid
        self.in_pod_netns = workers.in_pod_netns
        self.node_pids = workers.node_pids
        self.power_off = workers.power_off
        self.install_multus = multus.install
        self.remove_multus = multus.remove
        self.wait_routes = route_syncer.wait_routes
        self.deploy = deployment.deploy
        self.move_store = deployment.move_store
        self.use_ipam = deployment.use_ipam

    def up(self, count: int, say: Callable[[str], None] = print, without_python: int = 0) -> None:
        """Make the cluster: control plane, `count` nodes Ready with host-local as IPAM,
        the last `without_python` of them with no Python (`nodes`)."""
        if count < 1:
            raise ClusterError("--nodes must be at least 1")
        if not 0 <= without_python <= count:
            raise ClusterError(f"--without-python must be 0 to --nodes ({count})")
        binaries = find_binaries()
        missing = missing_tools()
        if missing:
            raise ClusterError(
                f"the cluster lab needs: {', '.join(missing)} (scripts/setup.sh installs"
                " the packages)"
            )
        if (self.state / "made.jsonl").exists():
            raise ClusterError(
                f"{self.state} holds a cluster already: `ipward cluster down --state"
                f" {self.state}` first"
            )
        self.state.mkdir(parents=True, exist_ok=True)
        if len(f"{self.state}/nodes/n{count}/run/containerd/containerd.sock.ttrpc") > 100:
            raise ClusterError(f"state dir path too long for the nodes' sockets: {self.state}")
        cluster_id = secrets.token_hex(3)
        self.journal.record("state", path=str(self.state))
        for sub in ("ns", "logs", "pki", "nodes", "images"):
            (self.state / sub).mkdir(exist_ok=True)
        self.nodes = node_plan(self.state, cluster_id, count, without_python)
        self.info = {
            "id": cluster_id,
            "kubeconfig": str(self.kubeconfig),
            "api": self.api_url,
            "control_plane": {"ip": CONTROL_PLANE_IP, "netns": self.cp_netns},
            "fabric": {"netns": self.fabric_netns, "gateway": FABRIC_GATEWAY},
            "service_ip": SERVICE_IP,
            "pause_image": PAUSE_IMAGE,
            "test_image": SLEEP_IMAGE,
            "admin_token": secrets.token_hex(16),
            "cni": "host-local",
        }
        self.write_info()
        started = time.monotonic()
        say(f"making namespaces and the fabric for {count} node(s)")
        self._network.make()
        self._network.node_range_routes(present=True)
        say("certificates, etcd, kube-apiserver, controller-manager, scheduler")
        tokens = make_pki(self)
        self._control_plane.start(binaries, tokens)
        images = build_test_images(self.test_images)
        say(
            "nodes: " + ", ".join(n.name + ("" if n.python else " (no Python)") for n in self.nodes)
        )
        for node in self.nodes:
            self._workers.start(node, binaries, images, tokens[f"system:node:{node.name}"])
        client_kubeconfig(self, self.kubeconfig, "admin", self.info["admin_token"])
        self._workers.wait_ready()
        wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            "the default ServiceAccount",
            READY_TIMEOUT,
            0.5,
        )
        self.write_info(up_seconds=round(time.monotonic() - started, 1))
        say(f"up in {time.monotonic() - started:.1f}s: kubeconfig {self.kubeconfig}")

    def power_on(self, node: Node) -> None:
        """The node booted after `power_off` (`nodes.Workers.power_on`), and the route
        syncer started again when it runs, so that its whole read routes in the node's
        new namespace, as a node's routing agent does at boot."""
        self._workers.power_on(node)
        if self.info.get("cni") == "ipward":
            self._route_syncer.start()

    def down(self, say: Callable[[str], None] = print) -> list[str]:
        """`teardown.down`: all it made removed; what could not be, as messages."""
        return teardown.down(self, say)


@contextlib.contextmanager
def cluster(state: Path, nodes: int, say: Callable[[str], None] = print) -> Iterator[Cluster]:
    """A cluster that is up for the block, removed after it (also on failure)."""
    lab = Cluster(state)
    try:
        lab.up(nodes, say)
        yield lab
    finally:
        left = lab.down(say)
        if left:
            raise ClusterError("cluster down left: " + "; ".join(left))
