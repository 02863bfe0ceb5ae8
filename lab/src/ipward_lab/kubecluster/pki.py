"""The cluster lab's certificates and tokens, made with `openssl` in the state dir's
pki/: the cluster's CA and the API server's certificate (for its address, the Service's
and its names), the service-account keys, ipward's etcd (a CA of its own, a server
certificate for its address, a client one for ipward), and a static token per user (the
admin, the controller-manager, the scheduler, each node's kubelet)."""

from __future__ import annotations

import secrets
from pathlib import Path

from ipward_lab.kubecluster.layout import CONTROL_PLANE_IP, SERVICE_IP
from ipward_lab.kubecluster.state import ClusterState
from ipward_lab.servers.pki import openssl, token_kubeconfig


def make_pki(lab: ClusterState) -> dict[str, str]:
    """Every certificate and the token file the API server reads; the token of each
    user (`admin`, `system:kube-controller-manager`, `system:node:n1`...)."""
    p = lab.pki_dir

    def ca(name: str, cn: str) -> None:
        openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
            "-subj", f"/CN={cn}", "-keyout", str(p / f"{name}.key"),
            "-out", str(p / f"{name}.crt"),
        )  # fmt: skip

    def signed(name: str, ca_name: str, subject: str, ext: str) -> None:
        openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
            "-keyout", str(p / f"{name}.key"), "-out", str(p / f"{name}.csr"),
        )  # fmt: skip
        (p / f"{name}.ext").write_text(ext)
        openssl(
            "x509", "-req", "-in", str(p / f"{name}.csr"), "-CA", str(p / f"{ca_name}.crt"),
            "-CAkey", str(p / f"{ca_name}.key"), "-CAcreateserial", "-days", "30",
            "-extfile", str(p / f"{name}.ext"), "-out", str(p / f"{name}.crt"),
        )  # fmt: skip

    ca("ca", "ipward-cluster-ca")
    api_sans = ",".join(
        [
            f"IP:{CONTROL_PLANE_IP}", f"IP:{SERVICE_IP}", "IP:127.0.0.1", "DNS:localhost",
            "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )  # fmt: skip
    signed(
        "apiserver", "ca", "/CN=kube-apiserver",
        f"subjectAltName={api_sans}\nextendedKeyUsage=serverAuth\n",
    )  # fmt: skip
    openssl("genrsa", "-out", str(p / "sa.key"), "2048")
    openssl("rsa", "-in", str(p / "sa.key"), "-pubout", "-out", str(p / "sa.pub"))
    # ipward's etcd: its own CA, a server certificate for its address, a client one.
    ca("ipward-etcd-ca", "ipward-etcd-ca")
    signed(
        "ipward-etcd-server", "ipward-etcd-ca", "/CN=ipward-etcd",
        f"subjectAltName=IP:{CONTROL_PLANE_IP},IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n",
    )  # fmt: skip
    signed("ipward-client", "ipward-etcd-ca", "/CN=ipward", "extendedKeyUsage=clientAuth\n")
    tokens = {
        lab.info["admin_token"]: ("admin", "system:masters"),
        secrets.token_hex(16): ("system:kube-controller-manager", "system:masters"),
        secrets.token_hex(16): ("system:kube-scheduler", "system:masters"),
    }
    for node in lab.nodes:
        tokens[secrets.token_hex(16)] = (
            f"system:node:{node.name}",
            "system:nodes,system:masters",
        )
    (p / "tokens.csv").write_text(
        "".join(f'{t},{user},{user},"{groups}"\n' for t, (user, groups) in tokens.items())
    )
    return {user: t for t, (user, _) in tokens.items()}


def client_kubeconfig(lab: ClusterState, path: Path, user: str, token: str) -> Path:
    """A kubeconfig at `path` for the API server, as `user` with `token`."""
    return token_kubeconfig(path, lab.api_url, lab.pki_dir / "ca.crt", token, user)
