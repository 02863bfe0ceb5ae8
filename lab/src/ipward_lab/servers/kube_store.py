"""The Kubernetes store's resources on a test API server, as `kubectl apply -k
deploy/base` installs them on a cluster: ipward's custom resource definitions
(`deploy/base/crds/`, established before use) and a namespace for the ledger; and the
`k8s://` URL of a store there."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import yaml

from ipward.kubeapi.client import ApiClient, ApiError
from ipward.kubeapi.config import from_kubeconfig
from ipward_lab.waiting import wait_for

CHECKOUT = Path(__file__).resolve().parents[4]  # lab/src/ipward_lab/servers/ -> the checkout
CRDS = CHECKOUT / "deploy" / "base" / "crds"


def install(kubeconfig: Path | str, namespace: str) -> None:
    """ipward's CRDs (kept when there) and `namespace` (kept when there)."""
    paths = sorted(CRDS.glob("*.yaml"))
    if not paths:
        raise FileNotFoundError(f"no CRDs in {CRDS}")
    client = ApiClient(from_kubeconfig(str(kubeconfig)))
    try:
        for path in paths:
            crd = yaml.safe_load(path.read_text())
            _create(client, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            name = str(crd["metadata"]["name"])
            wait_for(partial(_established, client, name), f"CRD {name} established", timeout=60)
        namespace_body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        _create(client, "/api/v1/namespaces", namespace_body)
    finally:
        client.close()


def store_url(kubeconfig: Path | str, namespace: str) -> str:
    return f"k8s://?kubeconfig={kubeconfig}&namespace={namespace}"


def _create(client: ApiClient, path: str, body: dict) -> None:
    try:
        client.request("POST", path, body=body)
    except ApiError as e:
        if e.status != 409:
            raise


def _established(client: ApiClient, name: str) -> bool:
    crd = client.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
