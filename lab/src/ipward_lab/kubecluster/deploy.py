"""ipward deployed on the cluster lab as its README says: its image built here and loaded
on every node, the store and the pool `pods`, the Secret naming its etcd, `kubectl apply
-k deploy/overlays/etcd` (or the lab's overlay of it, `Tuning`), every node's network
switched from host-local to ipward and the routes with it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ipward_lab.containerd.images import build_ipward_image
from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import run, wait_for
from ipward_lab.kubecluster.layout import (
    CHECKOUT,
    CONTROL_PLANE_IP,
    IPWARD_ETCD_PORT,
    POD_GATEWAY,
    POD_NET,
    POOL,
)
from ipward_lab.kubecluster.network import Network
from ipward_lab.kubecluster.nodes import Workers
from ipward_lab.kubecluster.route_syncer import RouteSyncer
from ipward_lab.kubecluster.state import ClusterState


@dataclass(frozen=True)
class Tuning:
    """Options a deployment adds to deploy/overlays/etcd's, as an operator would in an
    overlay of their own (the lab's is written in the state dir): more arguments for the
    agent's and the controller's containers, and for `ipward pool create pods`. Empty:
    the overlay as it is."""

    agent_args: tuple[str, ...] = ()
    controller_args: tuple[str, ...] = ()
    pool_args: tuple[str, ...] = ()

    def kustomization(self, where: Path) -> Path:
        """The directory to `kubectl apply -k`: deploy/overlays/etcd itself, or an
        overlay of it made in `where` that appends the arguments."""
        base = CHECKOUT / "deploy" / "overlays" / "etcd"
        if not (self.agent_args or self.controller_args):
            return base
        patches = []
        for kind, name, args in (
            ("DaemonSet", "ipward-agent", self.agent_args),
            ("Deployment", "ipward-controller", self.controller_args),
        ):
            ops = [
                {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": arg}
                for arg in args
            ]
            if ops:
                patches.append({"target": {"kind": kind, "name": name}, "patch": json.dumps(ops)})
        where.mkdir(parents=True, exist_ok=True)
        overlay = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(base, where)],
            "patches": patches,
        }
        (where / "kustomization.yaml").write_text(json.dumps(overlay, indent=2))  # JSON is YAML
        return where


class Deployment:
    def __init__(
        self,
        lab: ClusterState,
        clients: Clients,
        network: Network,
        workers: Workers,
        route_syncer: RouteSyncer,
    ) -> None:
        self.lab = lab
        self.clients = clients
        self.network = network
        self.workers = workers
        self.route_syncer = route_syncer

    def deploy(self, say: Callable[[str], None] = print, tuning: Tuning | None = None) -> None:
        """ipward installed as its README says: its image (built here) on every node, the
        store with the pool `pods` (`ipward pool create`), the Secret naming its etcd,
        `kubectl apply -k deploy/overlays/etcd` (through an overlay of the lab's when
        `tuning` adds options); every node's network switched from host-local to ipward
        (its `ipam`), and the routes from the node ranges' to the route syncer's.

        Its etcd is outside the cluster, on the control plane's host (the overlay's
        Secret), as README says it must be: on the pod network whose IPAM is ipward, an
        etcd member would need that etcd to get its address."""
        tuning = tuning or Tuning()
        started = time.monotonic()
        image = build_ipward_image(CHECKOUT, say)
        say(f"loading {image.name} into every node's containerd")
        for node in self.lab.nodes:
            self.workers.import_images(node, [image])
        say(f"making the store and the pool {POOL} ({POD_NET}), and the Secret ipward-etcd")
        self.make_store(tuning.pool_args)
        p = self.lab.pki_dir
        # As README says, made with `kubectl create`; applied, so a second deploy works.
        for made in (
            ["create", "namespace", "ipward-system"],
            [
                "--namespace=ipward-system", "create", "secret", "generic", "ipward-etcd",
                f"--from-literal=endpoints={CONTROL_PLANE_IP}:{IPWARD_ETCD_PORT}",
                f"--from-file=ca.crt={p}/ipward-etcd-ca.crt",
                f"--from-file=tls.crt={p}/ipward-client.crt",
                f"--from-file=tls.key={p}/ipward-client.key",
            ],
        ):  # fmt: skip
            manifest = self.clients.kubectl(*made, "--dry-run=client", "--output=yaml").stdout
            self.clients.kubectl("apply", "--filename=-", input=manifest)
        # Nothing runs on the pod network yet: switching now is README's "drain each
        # node before switching it". The controllers' pods then get their addresses
        # from ipward: their first sandboxes fail (no `ipward` plugin until the
        # DaemonSet's init container installs it, then code 11 until the agent serves)
        # and the kubelet retries them.
        say(f"switching every node's network to ipward (pool {POOL}) and its routes")
        self.use_ipam("ipward")
        kustomization = tuning.kustomization(self.lab.state / "deploy")
        say(f"kubectl apply -k {kustomization}")
        self.clients.kubectl("apply", "-k", str(kustomization))
        self.wait_deployed()
        self.lab.write_info(deploy_seconds=round(time.monotonic() - started, 1))
        say(f"deployed in {time.monotonic() - started:.1f}s")

    def use_ipam(self, ipam_type: str) -> None:
        """Every node's network on `ipam_type` (`host-local` or `ipward`), and the routes
        that go with it: the node ranges' for host-local, the route syncer for ipward.
        Switch a cluster with nothing on the pod network (README: drain each node
        before switching it)."""
        for node in self.lab.nodes:
            self.network.write_conflist(node, ipam_type)
        if ipam_type == "ipward":
            self.network.node_range_routes(present=False)
            self.route_syncer.start()
        else:
            self.route_syncer.stop()
            self.network.node_range_routes(present=True)
        self.lab.write_info(cni=ipam_type)

    def make_store(self, pool_args: Sequence[str] = ()) -> None:
        """The store with the pool `pods` (POD_NET, gateway POD_GATEWAY), as README's
        deploy makes it with `ipward pool create`; kept when an earlier deploy made it."""
        if self.clients.ipward_run("pool", "list", check=False).returncode == 0:
            return
        run(
            self.clients.ipward_argv(
                [
                    "pool", "create", POOL,
                    "--range", f"{POD_NET},gateway={POD_GATEWAY}",
                    *pool_args,
                ]
            )
        )  # fmt: skip

    def wait_deployed(self, timeout: float = 600.0) -> None:
        """The agent on every node serving its socket, the plugin installed, both
        controllers available."""

        def ready() -> bool:
            ds = self.clients.kubectl_json(
                "--namespace=ipward-system", "get", "daemonset", "ipward-agent"
            )
            status = ds.get("status", {})
            if status.get("numberReady", 0) < len(self.lab.nodes):
                return False
            for node in self.lab.nodes:
                for path in (f"{node.dir}/run/ipward/agent.sock", f"{node.dir}/opt/cni/bin/ipward"):
                    if not os.path.exists(path):
                        return False
            deployment = self.clients.kubectl_json(
                "--namespace=ipward-system", "get", "deployment", "ipward-controller"
            )
            return bool(deployment.get("status", {}).get("availableReplicas", 0) >= 2)

        wait_for(ready, "ipward deployed (agents ready, controllers available)", timeout, 2.0)
