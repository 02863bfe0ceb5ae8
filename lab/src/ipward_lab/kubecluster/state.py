"""A cluster lab's state dir: `cluster.json` (what the lab is: its id, nodes, processes,
times), the journal of what it made (`made.jsonl`, which `down` reads), and where the
rest is in it (namespace files, certificates, the admin's kubeconfig)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Self

from ipward_lab.kubecluster.common import ClusterError
from ipward_lab.kubecluster.layout import (
    API_PORT,
    CHECKOUT,
    CONTROL_PLANE_IP,
    IPWARD_ETCD_PORT,
    STORES,
    Node,
)


class Journal:
    """What the lab made, one JSON line each, written (and synced) before it is made."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, kind: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):  # a line cut by a crash
                out.append(json.loads(line))
        return out


class ClusterState:
    """The cluster lab in `state`: `info` (cluster.json), its `nodes`, its `journal`, its
    paths, and the command lines that run in its namespaces. Every part of the lab reads
    it, so what one part writes (`write_info`) the others see."""

    def __init__(self, state: Path) -> None:
        self.state = Path(state).resolve()
        self.journal = Journal(self.state / "made.jsonl")
        self.info: dict[str, Any] = {}
        self.nodes: list[Node] = []

    @classmethod
    def load(cls, state: Path) -> Self:
        """The cluster that is up in `state` (its cluster.json)."""
        cluster = cls(state)
        path = cluster.state / "cluster.json"
        try:
            cluster.info = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster in {cluster.state} (no cluster.json)") from None
        cluster.nodes = [Node(**n) for n in cluster.info["nodes"]]
        return cluster

    def write_info(self, **more: Any) -> None:
        self.info.update(more)
        self.info["nodes"] = [asdict(n) for n in self.nodes]
        tmp = self.state / "cluster.json.tmp"
        tmp.write_text(json.dumps(self.info, indent=2))
        tmp.rename(self.state / "cluster.json")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterError(f"no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    # -- paths ----------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def cp_netns(self) -> str:
        return str(self.state / "ns" / "cp.net")

    @property
    def fabric_netns(self) -> str:
        return str(self.state / "ns" / "fabric.net")

    @property
    def pki_dir(self) -> Path:
        return self.state / "pki"

    @property
    def test_images(self) -> Path:
        """The test images' tarballs, and the static programs in them (`pause`, `sleep`)."""
        return self.state / "images"

    @property
    def api_url(self) -> str:
        return f"https://{CONTROL_PLANE_IP}:{API_PORT}"

    @property
    def store(self) -> str:
        """Where the deployed ipward keeps its ledger (`deploy --store`): "k8s" (the API,
        `deploy/base`) or "etcd" (the lab's etcd outside the cluster,
        `deploy/overlays/etcd`)."""
        store = str(self.info.get("store", STORES[0]))
        if store not in STORES:
            raise ClusterError(f"unknown store {store!r} in cluster.json (one of {STORES})")
        return store

    @property
    def manifests(self) -> Path:
        """The kustomization a user of this store applies."""
        return CHECKOUT / "deploy" / ("base" if self.store == "k8s" else "overlays/etcd")

    @property
    def ipward_store_url(self) -> str:
        if self.store == "k8s":
            return f"k8s://?kubeconfig={self.kubeconfig}"
        p = self.pki_dir
        return (
            f"etcds://{CONTROL_PLANE_IP}:{IPWARD_ETCD_PORT}"
            f"?ca={p}/ipward-etcd-ca.crt&cert={p}/ipward-client.crt&key={p}/ipward-client.key"
        )

    # -- command lines in its namespaces --------------------------------------------------

    def in_cp(self, args: Sequence[str]) -> list[str]:
        """`args` run in the control plane's network namespace."""
        return ["nsenter", f"--net={self.cp_netns}", *args]

    def in_node(self, node: Node, args: Sequence[str]) -> list[str]:
        """`args` run in the node's network and mount namespaces."""
        return ["nsenter", f"--net={node.netns}", f"--mount={node.mntns}", *args]
