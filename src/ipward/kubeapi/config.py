"""Where the Kubernetes API is and how to prove who we are: in-cluster (the pod's service
account) or a kubeconfig file (a context's cluster and user).

Credentials supported: a bearer token (inline or a file, the file read again whenever it
changes, as projected service-account tokens rotate), a client certificate (files or
inline data). Credential plugins (`exec`, `auth-provider`) are refused with a clear
error: running them is the official client's job, and ipward's own client does not pull
that in. Basic auth (`username`/`password`) is refused too: API servers dropped it in
Kubernetes 1.19.
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ipward.core.errors import InvalidConfig

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class TokenFile:
    """A bearer token kept in a file that may be replaced at any time (kubelet rotates
    projected tokens by an atomic rename): read again when its inode, mtime or size
    changed, so every request carries the current token."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._version: tuple[int, int, int] | None = None
        self._token = ""

    def token(self) -> str:
        with self._lock:
            try:
                st = os.stat(self.path)
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                if version != self._version:
                    with open(self.path, encoding="utf-8") as f:
                        self._token = f.read().strip()
                    self._version = version
            except (OSError, UnicodeDecodeError) as e:
                # The last token read stays usable: the server says when it is not.
                if not self._token:
                    raise InvalidConfig(f"token file {self.path}: {e}") from e
            if not self._token:
                raise InvalidConfig(f"token file {self.path} is empty")
            return self._token


@dataclass(frozen=True)
class Connection:
    """One API server and the credentials to use with it."""

    server: str  # https://host:port (or http://, for a local proxy)
    ca_file: str = ""
    ca_data: str = ""  # PEM
    insecure: bool = False  # insecure-skip-tls-verify
    tls_server_name: str = ""
    cert_file: str = ""
    key_file: str = ""
    cert_data: bytes = b""  # PEM
    key_data: bytes = b""
    token: str = ""
    token_file: TokenFile | None = None


def in_cluster(
    environ: dict[str, str] | os._Environ[str] = os.environ,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
) -> Connection:
    """The API as a pod sees it: KUBERNETES_SERVICE_HOST/PORT, the service account's
    token (re-read as it rotates) and CA."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise InvalidConfig(
            "k8s://: not running in a pod (KUBERNETES_SERVICE_HOST/PORT unset);"
            " give a kubeconfig: k8s://?kubeconfig=PATH"
        )
    token_path = os.path.join(service_account_dir, "token")
    ca_path = os.path.join(service_account_dir, "ca.crt")
    for path in (token_path, ca_path):
        if not os.access(path, os.R_OK):
            raise InvalidConfig(f"k8s://: service account file {path} is not readable")
    token_file = TokenFile(token_path)
    token_file.token()  # an unreadable or empty token is a config error now, not later
    host = f"[{host}]" if ":" in host else host
    return Connection(server=f"https://{host}:{port}", ca_file=ca_path, token_file=token_file)


def connection(kubeconfig: str = "", context: str = "") -> Connection:
    """What a `k8s://` URL names: a kubeconfig's context when it gives one, else the
    pod's own service account."""
    return from_kubeconfig(kubeconfig, context) if kubeconfig else in_cluster()


def from_kubeconfig(path: str, context: str = "") -> Connection:
    """The cluster and user of `context` (default: the file's current-context)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InvalidConfig(f"kubeconfig {path}: {e}") from e
    if not isinstance(config, dict):
        raise InvalidConfig(f"kubeconfig {path}: not a mapping")
    name = context or config.get("current-context") or ""
    if not name:
        raise InvalidConfig(f"kubeconfig {path}: no current-context; give ?context=NAME")
    ctx = _named(config, "contexts", "context", name, path)
    cluster = _named(config, "clusters", "cluster", str(ctx.get("cluster", "")), path)
    user_name = str(ctx.get("user", ""))
    user = _named(config, "users", "user", user_name, path) if user_name else {}
    base = Path(path).resolve().parent
    where = f"kubeconfig {path}, context {name}"

    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise InvalidConfig(
                f"{where}: user {user_name} gets its credentials from a credential plugin"
                f" ({plugin}); ipward's client does not run plugins (the official kubernetes"
                " client does): give the user a token, tokenFile or client certificate"
            )
    if user.get("username") or user.get("password"):
        raise InvalidConfig(
            f"{where}: user {user_name} uses basic auth (username/password), which API"
            " servers no longer accept: give a token, tokenFile or client certificate"
        )
    server = str(cluster.get("server", ""))
    if not server.startswith(("https://", "http://")):
        raise InvalidConfig(f"{where}: cluster server {server!r} is not an http(s) URL")
    token_path = _file(user, "tokenFile", base)
    return Connection(
        server=server.rstrip("/"),
        ca_file=_file(cluster, "certificate-authority", base),
        ca_data=_data(cluster, "certificate-authority-data", where).decode("ascii", "replace"),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        tls_server_name=str(cluster.get("tls-server-name", "")),
        cert_file=_file(user, "client-certificate", base),
        key_file=_file(user, "client-key", base),
        cert_data=_data(user, "client-certificate-data", where),
        key_data=_data(user, "client-key-data", where),
        token=str(user.get("token", "") or ""),
        token_file=TokenFile(token_path) if token_path else None,
    )


def _named(config: dict[str, Any], section: str, field: str, name: str, path: str) -> dict:
    for entry in config.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(field)
            return body if isinstance(body, dict) else {}
    raise InvalidConfig(f"kubeconfig {path}: no {section[:-1]} named {name!r}")


def _file(section: dict, key: str, base: Path) -> str:
    value = section.get(key)
    return str(base / str(value)) if value else ""  # relative to the kubeconfig's directory


def _data(section: dict, key: str, where: str) -> bytes:
    value = section.get(key)
    if not value:
        return b""
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidConfig(f"{where}: {key} is not base64: {e}") from e
