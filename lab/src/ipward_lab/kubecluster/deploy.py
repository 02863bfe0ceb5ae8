"""ipward deployed on the cluster lab as its README says, its image built here and loaded
on every node. On the `k8s://` store (the default): `kubectl apply -k deploy/base`, then
one IPPool, `pods`, with `kubectl apply -f`: nothing else. On `--store etcd`: the lab's
etcd outside the cluster, the pool made with `ipward pool create`, the Secret naming the
etcd, `kubectl apply -k deploy/overlays/etcd`. Either through the lab's overlay of those
manifests when a `Tuning` adds options; then every node's network switched from
host-local to ipward and the routes with it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipward_lab.containerd.images import build_ipward_image
from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import ClusterError, run, wait_for
from ipward_lab.kubecluster.controlplane import ControlPlane
from ipward_lab.kubecluster.layout import (
    CHECKOUT,
    CONTROL_PLANE_IP,
    IPWARD_ETCD_PORT,
    POD_GATEWAY,
    POD_NET,
    POOL,
    STORES,
)
from ipward_lab.kubecluster.network import Network, bridge_conflist
from ipward_lab.kubecluster.nodes import Workers
from ipward_lab.kubecluster.route_syncer import RouteSyncer
from ipward_lab.kubecluster.state import ClusterState

# The IPPool spec's fields a tuning may set, and `ipward pool create`'s options for them
# (on etcd, where pools are made with the CLI).
POOL_OPTIONS = {
    "warm": "--warm",
    "releaseDelaySeconds": "--release-delay",
    "cooldownSeconds": "--cooldown",
    "blockSize.ipv4": "--block-v4",
    "blockSize.ipv6": "--block-v6",
}


def pool_spec(tuned: Mapping[str, Any]) -> dict[str, Any]:
    """The spec of the lab's pool `pods` (POD_NET, gateway POD_GATEWAY), with a tuning's
    fields."""
    return {"ranges": [{"subnet": str(POD_NET), "gateway": POD_GATEWAY}], **tuned}


def pool_create_args(tuned: Mapping[str, Any]) -> list[str]:
    """`ipward pool create`'s options for a tuning's IPPool spec fields."""
    flat: dict[str, Any] = {}
    for key, value in tuned.items():
        if isinstance(value, dict):  # blockSize: {ipv4, ipv6}
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    unknown = sorted(set(flat) - set(POOL_OPTIONS))
    if unknown:
        raise ClusterError(f"a tuning's pool fields the lab cannot pass on etcd: {unknown}")
    return [f"{POOL_OPTIONS[k]}={v}" for k, v in flat.items()]


@dataclass(frozen=True)
class Tuning:
    """Options a deployment adds to the store's manifests (`ClusterState.manifests`), as
    an operator would in an overlay of their own (the lab's is written in the state
    dir): more arguments for the agent's and the controller's containers, and fields of
    the pool `pods`'s spec (an IPPool's; on etcd, `ipward pool create`'s options). Empty:
    the manifests as they are."""

    agent_args: tuple[str, ...] = ()
    controller_args: tuple[str, ...] = ()
    pool: Mapping[str, Any] = field(default_factory=dict)

    def kustomization(self, lab: ClusterState) -> Path:
        """The directory to `kubectl apply -k`: the store's manifests themselves, or an
        overlay of them made in the lab's state dir that appends the arguments."""
        base = lab.manifests
        if not (self.agent_args or self.controller_args):
            return base
        where = lab.state / "deploy"
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
        control_plane: ControlPlane,
    ) -> None:
        self.lab = lab
        self.clients = clients
        self.network = network
        self.workers = workers
        self.route_syncer = route_syncer
        self.control_plane = control_plane

    def deploy(
        self,
        say: Callable[[str], None] = print,
        tuning: Tuning | None = None,
        store: str = STORES[0],
    ) -> None:
        """ipward installed as its README says, its ledger on `store` ("k8s": the API,
        "etcd": an etcd of the lab's outside the cluster), see the module's doc; every
        node's network switched from host-local to ipward (its `ipam`), and the routes
        from the node ranges' to the route syncer's.

        On etcd, the etcd is outside the cluster, on the control plane's host (the
        overlay's Secret), as README says it must be: on the pod network whose IPAM is
        ipward, an etcd member would need that etcd to get its address."""
        if store not in STORES:
            raise ClusterError(f"unknown store {store!r}: one of {', '.join(STORES)}")
        tuning = tuning or Tuning()
        started = time.monotonic()
        image = build_ipward_image(CHECKOUT, say)
        say(f"loading {image.name} into every node's containerd")
        for node in self.lab.nodes:
            self.workers.import_images(node, [image])
        self.lab.write_info(store=store)  # which the store's URL and manifests follow
        if store == "etcd":
            self.prepare_etcd(say, tuning)
        kustomization = tuning.kustomization(self.lab)
        say(f"kubectl apply -k {kustomization}")
        self.clients.kubectl("apply", "-k", str(kustomization))
        if store == "k8s":
            self.apply_pool(say, tuning)
        # Nothing runs on the pod network yet (README: "drain each node before
        # switching it"), and nothing of ipward's needs it: its agents and controllers
        # run on the host's network.
        say(f"switching every node's network to ipward (pool {POOL}) and its routes")
        self.use_ipam("ipward")
        self.wait_deployed()
        self.lab.write_info(deploy_seconds=round(time.monotonic() - started, 1))
        say(f"deployed in {time.monotonic() - started:.1f}s")

    def move_store(self, to: str, say: Callable[[str], None], tuning: Tuning | None = None) -> None:
        """ipward's ledger moved to store `to` ("k8s" or "etcd") as README's upgrade
        says, with pods running: the controllers scaled to 0 and the agent DaemonSet
        deleted (pods keep their addresses; a new one would wait), `ipward export` from
        the store in use and `ipward import` into the other one, made empty first (on
        k8s, with deploy/base's CRDs), then that store's manifests applied (through
        `tuning`'s overlay) and the route syncer following it."""
        if to not in STORES or to == self.lab.store:
            raise ClusterError(f"cannot move the ledger from {self.lab.store} to {to!r}")
        tuning = tuning or Tuning()
        system = "--namespace=ipward-system"
        say(f"moving the ledger from {self.lab.store} to {to}: ipward stopped")
        self.clients.kubectl(system, "scale", "deployment", "ipward-controller", "--replicas=0")
        self.clients.kubectl(
            system, "delete", "daemonset", "ipward-agent", "--cascade=foreground", "--wait=true"
        )
        wait_for(
            lambda: (
                not self.clients.kubectl_json(
                    system,
                    "get",
                    "pods",
                    "--selector=app.kubernetes.io/name in (ipward-agent,ipward-controller)",
                )["items"]
            ),
            "ipward's pods gone",
            300.0,
            1.0,
        )
        ledger = self.lab.state / f"ledger-{self.lab.store}.jsonl"
        self.clients.ipward_run("export", "-o", str(ledger))
        self.lab.write_info(store=to)
        if to == "etcd":
            self.control_plane.start_ipward_etcd()
            self.make_etcd_secret()
        else:
            # README: after deploy/base's CRDs exist; the ledger left there by an
            # earlier stay on k8s:// goes first (import wants an empty store).
            self.clients.kubectl("apply", f"--filename={CHECKOUT}/deploy/base/crds")
            self.wait_crds()
            self.clients.kubectl(system, "delete", "ledgershards.ipward.io", "--all")
        say(f"ipward import into {to}")
        self.clients.ipward_run("import", str(ledger))
        kustomization = tuning.kustomization(self.lab)
        say(f"kubectl apply -k {kustomization}")
        self.clients.kubectl("apply", "-k", str(kustomization))
        self.route_syncer.start()
        self.wait_deployed()

    def wait_crds(self) -> None:
        self.clients.kubectl(
            "wait", "--for=condition=Established", "--timeout=120s",
            "customresourcedefinition/ippools.ipward.io",
            "customresourcedefinition/ledgershards.ipward.io",
        )  # fmt: skip

    def apply_pool(self, say: Callable[[str], None], tuning: Tuning) -> None:
        """The pool `pods` as an IPPool object (`kubectl apply -f`), once its resource
        is served; waited for until the controller has taken it (Ready), so that the
        ledger is there for the route syncer."""
        self.wait_crds()
        pool = {
            "apiVersion": "ipward.io/v1alpha1",
            "kind": "IPPool",
            "metadata": {"name": POOL},
            "spec": pool_spec(tuning.pool),
        }
        say(f"kubectl apply -f: IPPool {POOL} ({POD_NET})")
        self.clients.kubectl("apply", "--filename=-", input=json.dumps(pool))
        self.clients.kubectl(
            "wait", "--for=condition=Ready", "--timeout=300s", f"ippool.ipward.io/{POOL}"
        )

    def prepare_etcd(self, say: Callable[[str], None], tuning: Tuning) -> None:
        """What the etcd overlay needs before it is applied: the etcd (the lab's, on the
        control plane's host), the pool made with `ipward pool create`, the namespace
        and the Secret `ipward-etcd`."""
        say(f"ipward's etcd, the pool {POOL} ({POD_NET}) and the Secret ipward-etcd")
        self.control_plane.start_ipward_etcd()
        if self.clients.ipward_run("pool", "show", POOL, check=False).returncode != 0:
            run(
                self.clients.ipward_argv(
                    [
                        "pool",
                        "create",
                        POOL,
                        "--range",
                        f"{POD_NET},gateway={POD_GATEWAY}",
                        *pool_create_args(tuning.pool),
                    ]
                )
            )
        self.make_etcd_secret()

    def make_etcd_secret(self) -> None:
        """The namespace and the Secret `ipward-etcd` naming the lab's etcd."""
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

    def use_ipam(self, ipam_type: str) -> None:
        """Every node's network on `ipam_type` (`host-local` or `ipward`), and the routes
        that go with it: the node ranges' for host-local, the route syncer for ipward.
        Switch a cluster with nothing on the pod network (README: drain each node
        before switching it)."""
        for node in self.lab.nodes:
            self.network.write_conflist(node, ipam_type)
        wait_for(
            lambda: all(
                self.workers.loaded_network(n) == bridge_conflist(n, ipam_type)
                for n in self.lab.nodes
            ),
            f"every node's containerd on the {ipam_type} conflist",
            60.0,
            0.2,
        )
        if ipam_type == "ipward":
            self.network.node_range_routes(present=False)
            self.route_syncer.start()
        else:
            self.route_syncer.stop()
            self.network.node_range_routes(present=True)
        self.lab.write_info(cni=ipam_type)

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
