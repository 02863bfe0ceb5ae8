"""A real kube-apiserver on loopback for tests: a throwaway etcd (`ipward_lab.servers.etcd`), then
`$KUBE_APISERVER` with a self-signed serving certificate, a static token file, a client
CA (`ipward_lab.servers.pki`) and service-account keys made with `openssl`; ready when `/readyz`
answers; a kubeconfig written for it. Everything is stopped and removed when the
context manager exits, also on failure. The server alone can be stopped and started
again (`stop`, `start`): the soak's `api-down` on the real thing.

No controller-manager and no kubelet run: nothing creates a StatefulSet's pods or
removes a gracefully deleted pod (tests do what a kubelet would: status updates, delete
with grace 0). The ServiceAccount admission plugin is disabled, since nothing creates a
namespace's `default` ServiceAccount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ipward_lab.servers.etcd import (
    EtcdServer,
    etcd_server,
    first_start,
    free_port,
    wait_serving,
)
from ipward_lab.servers.pki import ClientPki, client_pki, openssl, token_kubeconfig

READY_TIMEOUT = 90.0
# token -> (user, groups). system:masters may do anything (RBAC); nobody may do nothing.
TOKENS = {
    "admin-token": ("admin", "system:masters"),
    "spare-token": ("spare", "system:masters"),
    "nobody-token": ("nobody", ""),
}
ADMIN_TOKEN = "admin-token"


def binary() -> str | None:
    """The kube-apiserver named by `KUBE_APISERVER`, when it is an executable file."""
    path = os.environ.get("KUBE_APISERVER", "")
    return path if path and os.access(path, os.X_OK) else None


class KubeLab:
    """A running kube-apiserver: its URL, CA, tokens, a kubeconfig (admin token) and its
    etcd."""

    def __init__(self, root: Path, etcd: EtcdServer) -> None:
        self.root = root
        self.port = 0  # chosen at the first start (`listen_on`)
        self.url = ""
        self.ca_file = root / "certs" / "apiserver.crt"
        self.kubeconfig = root / "kubeconfig"
        self.log_path = root / "kube-apiserver.log"
        self.tokens = dict(TOKENS)
        self.args: list[str] = []  # its command line, once set up
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_pki: ClientPki | None = None  # client certificates it accepts
        self.etcd = etcd

    def listen_on(self, port: int) -> None:
        self.port = port
        self.url = f"https://127.0.0.1:{port}"

    def start(self) -> None:
        """Start the server (again: same port, certificates and etcd); not waiting."""
        argv = [*self.args, f"--secure-port={self.port}"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 15 s); its etcd keeps the objects."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        wait_serving("kube-apiserver", self.ready, self.proc, self.log_tail, timeout, 0.2)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def ready(self) -> bool:
        try:
            self.fetch("/readyz", timeout=2)
            return True
        except (OSError, ValueError, urllib.error.URLError):
            return False  # not listening yet, or the certificate not written yet

    def fetch(self, path: str, timeout: float = 10.0) -> bytes:
        """The body of a GET of `path` as the admin (`/readyz`, `/metrics`): text, which
        the product's client (JSON only) does not read."""
        request = urllib.request.Request(
            f"{self.url}{path}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            return bytes(answer.read())

    def write_kubeconfig(self) -> None:
        token_kubeconfig(self.kubeconfig, self.url, self.ca_file, ADMIN_TOKEN, "admin")


@contextlib.contextmanager
def kube_apiserver(executable: str, tmp_dir: Path | None = None) -> Iterator[KubeLab]:
    """Start etcd and the kube-apiserver `executable`; yield when it is ready."""
    root = Path(tempfile.mkdtemp(prefix="kubelab-", dir=tmp_dir))
    try:
        with etcd_server(root / "etcd") as etcd:
            lab = KubeLab(root, etcd)
            (root / "certs").mkdir()
            openssl("genrsa", "-out", str(root / "sa.key"), "2048")
            openssl("rsa", "-in", str(root / "sa.key"), "-pubout", "-out", str(root / "sa.pub"))
            lab.client_pki = client_pki(root)
            (root / "tokens.csv").write_text(
                "".join(f'{t},{user},{user},"{groups}"\n' for t, (user, groups) in TOKENS.items())
            )
            lab.args = [
                executable,
                f"--etcd-servers=http://{etcd.endpoint}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--cert-dir={root / 'certs'}",
                f"--token-auth-file={root / 'tokens.csv'}",
                f"--client-ca-file={lab.client_pki.ca}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={root / 'sa.pub'}",
                f"--service-account-signing-key-file={root / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--disable-admission-plugins=ServiceAccount",
            ]
            try:
                first_start(lab, lambda: lab.listen_on(free_port()))
                lab.write_kubeconfig()
                yield lab
            finally:
                lab.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
