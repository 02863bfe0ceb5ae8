"""The cluster lab's control plane, in its network namespace: the cluster's etcd (plain,
on 127.0.0.1), kube-apiserver, kube-controller-manager and kube-scheduler (`kube-node
NAME`); and, for a deployment on `--store etcd`, ipward's etcd (TLS with client
certificates, on the control plane's address: outside the cluster, as users run one)."""

from __future__ import annotations

from collections.abc import Sequence

from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import READY_TIMEOUT, wait_for
from ipward_lab.kubecluster.layout import API_PORT, CONTROL_PLANE_IP, SERVICE_CIDR
from ipward_lab.kubecluster.netns import in_netns
from ipward_lab.kubecluster.pki import client_kubeconfig
from ipward_lab.kubecluster.prerequisites import Binaries
from ipward_lab.kubecluster.processes import Daemons
from ipward_lab.kubecluster.state import ClusterState
from ipward_lab.servers.etcd import EtcdServer

IPWARD_ETCD = "ipward-etcd"  # its name among the lab's daemons


class ControlPlane:
    def __init__(self, lab: ClusterState, daemons: Daemons, clients: Clients) -> None:
        self.lab = lab
        self.daemons = daemons
        self.clients = clients

    def start(self, binaries: Binaries, tokens: dict[str, str]) -> None:
        """The cluster's etcd, then the API server once it serves, then the controllers
        with their users' `tokens` (`pki.make_pki`)."""
        p = self.lab.pki_dir
        kube_etcd = self._etcd("etcd", "127.0.0.1", "http", [])
        p_ = str(p)
        apiserver = [
            binaries.kube_apiserver,
            f"--etcd-servers=http://{kube_etcd.endpoint}",
            f"--secure-port={API_PORT}",
            "--bind-address=0.0.0.0",
            f"--advertise-address={CONTROL_PLANE_IP}",
            f"--tls-cert-file={p_}/apiserver.crt",
            f"--tls-private-key-file={p_}/apiserver.key",
            f"--client-ca-file={p_}/ca.crt",
            f"--token-auth-file={p_}/tokens.csv",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            f"--service-account-key-file={p_}/sa.pub",
            f"--service-account-signing-key-file={p_}/sa.key",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-admission-plugins=NodeRestriction",
            "--kubelet-preferred-address-types=InternalIP",
        ]
        self.daemons.launch("kube-apiserver", self.lab.in_cp(apiserver))
        wait_for(
            lambda: (
                self.daemons.alive("kube-apiserver")
                and self.clients.api("/readyz", timeout=3) == "ok"
            ),
            "kube-apiserver ready",
            READY_TIMEOUT,
            0.5,
        )
        # Each controller as its own user (system:NAME), its kubeconfig in pki/.
        controllers = {
            "kube-controller-manager": [
                "--controllers=*",
                f"--service-account-private-key-file={p_}/sa.key",
                f"--root-ca-file={p_}/ca.crt",
                f"--cluster-signing-cert-file={p_}/ca.crt",
                f"--cluster-signing-key-file={p_}/ca.key",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--bind-address=127.0.0.1",
            ],
            "kube-scheduler": ["--leader-elect=false", "--bind-address=127.0.0.1"],
        }
        for name, args in controllers.items():
            user = f"system:{name}"
            config = client_kubeconfig(
                self.lab, p / f"{name.removeprefix('kube-')}.kubeconfig", user, tokens[user]
            )
            argv = [binaries.kube_node, name, f"--kubeconfig={config}", *args]
            self.daemons.launch(name, self.lab.in_cp(argv))

    def start_ipward_etcd(self) -> None:
        """ipward's etcd (`deploy --store etcd`), unless it runs already: TLS, client
        certificates of its own CA, on the control plane's address."""
        if self.daemons.running(IPWARD_ETCD) and self.daemons.alive(IPWARD_ETCD):
            return
        p = self.lab.pki_dir
        self._etcd(
            IPWARD_ETCD,
            CONTROL_PLANE_IP,
            "https",
            [
                "--client-cert-auth",
                f"--trusted-ca-file={p}/ipward-etcd-ca.crt",
                f"--cert-file={p}/ipward-etcd-server.crt",
                f"--key-file={p}/ipward-etcd-server.key",
            ],
        )
        self.lab.write_info()

    def _etcd(self, name: str, host: str, scheme: str, extra: Sequence[str]) -> EtcdServer:
        server = EtcdServer(
            self.lab.state / name,
            name=name,
            extra_args=extra,
            client_scheme=scheme,
            host=host,
            command_prefix=["nsenter", f"--net={self.lab.cp_netns}"],
            detach=True,
        )
        server.client_port, server.peer_port, server.metrics_port = 2379, 2380, 2381
        server.initial_cluster = f"{name}={server.peer_url}"
        server.start()
        assert server.proc is not None
        self.daemons.record(name, server.proc.pid, server.args)
        in_netns(self.lab.cp_netns, server.wait_ready)
        return server
