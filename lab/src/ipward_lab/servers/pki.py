"""Certificates for the labs, made with `openssl`: a self-signed serving certificate, and
a client CA with one client certificate (the API server takes the user from its CN and
the groups from its O); and the kubeconfig that gives a client a token and the CA to
trust."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLIENT_USER = "cert-admin"
CLIENT_GROUP = "system:masters"


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def serving_cert(cert: Path, key: Path) -> None:
    """A self-signed certificate for 127.0.0.1, localhost and kubernetes.default.svc
    (the names a real API server's own certificate carries)."""
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
        "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip


@dataclass(frozen=True)
class ClientPki:
    ca: Path  # the CA a server trusts for client certificates
    cert: Path
    key: Path


def client_pki(directory: Path) -> ClientPki:
    """A client CA and a certificate it signed for CLIENT_USER in CLIENT_GROUP (those
    already in `directory`, when there)."""
    pki = ClientPki(directory / "client-ca.crt", directory / "client.crt", directory / "client.key")
    if pki.cert.exists():
        return pki
    ca_key = directory / "client-ca.key"
    csr = directory / "client.csr"
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=ipward-lab-client-ca", "-keyout", str(ca_key), "-out", str(pki.ca),
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/O={CLIENT_GROUP}/CN={CLIENT_USER}",
        "-keyout", str(pki.key), "-out", str(csr),
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-out", str(pki.cert),
    )  # fmt: skip
    return pki


def token_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str = "lab") -> Path:
    """Write a kubeconfig at `path` (JSON, which is YAML): `server`, trusted through
    `ca_file`, as `user` with a bearer `token`."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "lab", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}],
        "current-context": "lab",
    }
    path.write_text(json.dumps(config, indent=2))
    return path
