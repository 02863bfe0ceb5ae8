"""The Kubernetes deployment (`deploy/`): the manifests render with `kubectl kustomize`,
validate against the API schemas of Kubernetes 1.26 and 1.31, start ipward with options
the code accepts, and the etcd certificates the helper script makes work with a real
etcd and ipward's own store client."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO

DEPLOY = REPO / "deploy"
RENDERINGS = {
    "base": DEPLOY / "base",
    "with-etcd": DEPLOY / "overlays" / "with-etcd",
}
KUBERNETES_VERSIONS = ("1.26.0", "1.31.0")

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def render(path: Path) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@needs_kubectl
@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate(rendering: str, version: str) -> None:
    import kubernetes_validate

    docs = render(RENDERINGS[rendering])
    assert docs
    for doc in docs:
        # Strict: a misspelt or misplaced field is an error, not silently dropped.
        kubernetes_validate.validate(doc, version, strict=True)
        assert doc["metadata"].get("namespace", "ipward-system") == "ipward-system", doc["kind"]


@needs_kubectl
def test_nothing_writes_or_reads_secrets() -> None:
    """Least privilege: read verbs only, and never secrets (the etcd credentials come
    from a mounted Secret, not from the API)."""
    docs = render(RENDERINGS["with-etcd"])
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert {r["metadata"]["name"] for r in roles} == {"ipward-agent", "ipward-controller"}
    for role in roles:
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            assert "secrets" not in rule["resources"] and "*" not in rule["resources"], rule


def _container_args(docs: list[dict], kind: str, name: str, container: str) -> list[str]:
    spec = by_kind(docs, kind, name)["spec"]["template"]["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    found = [c for c in containers if c["name"] == container]
    assert len(found) == 1
    env = {
        "NODE_NAME": "node-1",
        "POD_NAME": "ipward-controller-7d9f-x2",
        "POD_IP": "10.0.0.5",
        "ETCD_ENDPOINTS": "e0:2379,e1:2379,e2:2379",
    }
    args = []
    for arg in found[0]["args"]:
        for var, value in env.items():
            arg = arg.replace(f"$({var})", value)
        assert "$(" not in arg, f"unresolved variable in {arg!r}"
        args.append(arg)
    return args


@needs_kubectl
@pytest.mark.parametrize(
    ("kind", "name", "container"),
    [
        ("DaemonSet", "ipward-agent", "install-cni"),
        ("DaemonSet", "ipward-agent", "agent"),
        ("Deployment", "ipward-controller", "controller"),
    ],
)
def test_container_args_are_accepted_by_the_cli(kind: str, name: str, container: str) -> None:
    """Every container's command line parses with the real `ipward` CLI (options exist,
    values have the right types), so a renamed option cannot break the deployment."""
    import click

    from ipward.cli import cli

    args = _container_args(render(RENDERINGS["base"]), kind, name, container)
    command_name, rest = args[0], args[1:]
    command = cli.commands[command_name]
    assert isinstance(command, click.Command)
    with command.make_context(command_name, rest, resilient_parsing=False) as ctx:
        assert ctx.params
    store_urls = [a.split("=", 1)[1] for a in rest if a.startswith("--store=")]
    assert all(u.startswith("etcds://e0:2379,e1:2379,e2:2379?ca=") for u in store_urls)


@needs_kubectl
def test_etcd_certificates_from_the_script_work_with_a_real_etcd(tmp_path: Path) -> None:
    """`deploy/make-etcd-certs.sh` makes a CA, a member certificate and a client
    certificate; a real etcd started with the component's TLS flags accepts ipward's
    store client with the client Secret's files, and refuses it without them."""
    from ipward_lab.etcdlab import etcd_server
    from ipward.store import StoreUnavailable, open_store

    out = subprocess.run(
        [str(DEPLOY / "make-etcd-certs.sh"), "ipward-system", str(tmp_path / "pki")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d}
    assert set(secrets) == {"ipward-etcd-server", "ipward-etcd"}
    files: dict[str, dict[str, Path]] = {}
    for name, secret in secrets.items():
        directory = tmp_path / name
        directory.mkdir()
        files[name] = {}
        for key, value in secret["data"].items():
            path = directory / key
            path.write_bytes(base64.b64decode(value))
            files[name][key] = path
    server, client = files["ipward-etcd-server"], files["ipward-etcd"]
    assert client["endpoints"].read_text().count(":2379") == 3
    args = [
        "--client-cert-auth",
        f"--trusted-ca-file={server['ca.crt']}",
        f"--cert-file={server['tls.crt']}",
        f"--key-file={server['tls.key']}",
    ]
    with etcd_server(tmp_path / "etcd", args, client_scheme="https") as etcd:
        tls = f"?ca={client['ca.crt']}&timeout=2"
        with open_store(f"{etcd.url}{tls}&cert={client['tls.crt']}&key={client['tls.key']}") as s:
            assert s.revision() >= 1
        with pytest.raises(StoreUnavailable):  # opening it checks the store's schema
            open_store(etcd.url + tls)
