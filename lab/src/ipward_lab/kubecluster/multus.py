"""Multus CNI 4.0 on the cluster lab, as its thin plugin is installed: for the stories
with a secondary network (`k8s.v1.cni.cncf.io/networks`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import run, wait_for
from ipward_lab.kubecluster.layout import LAB_CONFLIST
from ipward_lab.kubecluster.pki import client_kubeconfig
from ipward_lab.kubecluster.prerequisites import find_multus
from ipward_lab.kubecluster.state import ClusterState

# The NetworkAttachmentDefinition CRD as Multus's own deployment declares it.
NAD_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "network-attachment-definitions.k8s.cni.cncf.io"},
    "spec": {
        "group": "k8s.cni.cncf.io",
        "scope": "Namespaced",
        "names": {
            "plural": "network-attachment-definitions",
            "singular": "network-attachment-definition",
            "kind": "NetworkAttachmentDefinition",
            "shortNames": ["net-attach-def"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "properties": {"config": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}
MULTUS_CONF = "/etc/cni/net.d/00-multus.conf"  # before the pod network's: the runtime's
MULTUS_KUBECONFIG = "/etc/cni/net.d/multus.d/multus.kubeconfig"


class Multus:
    def __init__(self, lab: ClusterState, clients: Clients) -> None:
        self.lab = lab
        self.clients = clients

    def install(self) -> None:
        """Multus as its thin plugin is installed: the NetworkAttachmentDefinition CRD, a
        ServiceAccount `multus` in kube-system allowed to read pods and attachments and
        to write pods' status, and on every node the `multus` binary, a kubeconfig with
        that account's token and a conf naming the pod network as `clusterNetwork`,
        first in the conf dir, so the runtime calls Multus, which calls `bridge` and
        the networks pods ask for (`k8s.v1.cni.cncf.io/networks`)."""
        multus = find_multus()
        rbac = [
            NAD_CRD,
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "multus", "namespace": "kube-system"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "multus"},
             "rules": [
                 {"apiGroups": ["k8s.cni.cncf.io"], "resources": ["*"], "verbs": ["*"]},
                 {"apiGroups": [""], "resources": ["pods", "pods/status"],
                  "verbs": ["get", "list", "update", "watch"]},
                 {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
                  "verbs": ["create", "patch", "update"]},
             ]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "multus"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "multus"},
             "subjects": [{"kind": "ServiceAccount", "name": "multus",
                           "namespace": "kube-system"}]},
        ]  # fmt: skip
        self.clients.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}),
        )
        wait_for(
            lambda: (
                self.clients.kubectl(
                    "get", "network-attachment-definitions", "-A", check=False
                ).returncode
                == 0
            ),
            "the NetworkAttachmentDefinition CRD served",
            60.0,
            0.5,
        )
        token = self.clients.kubectl(
            "--namespace=kube-system", "create", "token", "multus", "--duration=24h"
        ).stdout.strip()
        kubeconfig = client_kubeconfig(
            self.lab, self.lab.state / "multus.kubeconfig", "multus", token
        ).read_text()
        conf = {
            "cniVersion": "0.3.1",
            "name": "multus-cni-network",
            "type": "multus",
            "kubeconfig": MULTUS_KUBECONFIG,
            "clusterNetwork": LAB_CONFLIST,
            "cniDir": "/var/lib/cni/multus",
            "binDir": "/opt/cni/bin",
        }
        for node in self.lab.nodes:
            shutil.copy(multus, f"{node.dir}/opt/cni/bin/multus")
            run(
                self.lab.in_node(
                    node,
                    [
                        "sh",
                        "-ec",
                        f"mkdir -p {Path(MULTUS_KUBECONFIG).parent}; cat > {MULTUS_KUBECONFIG}",
                    ],
                ),
                input=kubeconfig,
            )
            run(
                self.lab.in_node(node, ["sh", "-ec", f"cat > {MULTUS_CONF}"]),
                input=json.dumps(conf),
            )

    def remove(self) -> None:
        """Every node's runtime back on the pod network's conf alone."""
        for node in self.lab.nodes:
            run(self.lab.in_node(node, ["rm", "-f", MULTUS_CONF]))
