"""How the Kubernetes source finds and authenticates to its API server: kubeconfig forms,
in-cluster config, token files that rotate, URL options. Against the test server and
the real kube-apiserver (when KUBE_APISERVER names it) wherever a server is needed."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ipward.cluster.k8s.source import Settings
from ipward.cluster.liveness import LivenessUnavailable, open_source
from ipward.core.errors import InvalidConfig
from ipward.kubeapi.client import ApiClient, ApiError, ApiUnreachable
from ipward.kubeapi.config import from_kubeconfig, in_cluster
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.waiting import wait_for
from test_k8s_source import wait_watching


def write_config(path: Path, cluster: dict, user: dict, **extra: Any) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
        **extra,
    }
    path.write_text(json.dumps(config))
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def can_read(client: ApiClient) -> bool:
    """An authenticated, authorized read: the default namespace."""
    body = client.request("GET", "/api/v1/namespaces/default")
    return bool(body["metadata"]["name"] == "default")


def test_kubeconfig_forms(kube: KubeApi, tmp_path: Path) -> None:
    # The server may not have a default namespace yet (the test server starts empty).
    if kube.server is not None:
        kube.admin.namespace("default")
    pki = kube.client_pki
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "token").write_text("admin-token\n")
    for name in ("client.crt", "client.key"):
        (tmp_path / "sub" / name).write_bytes((pki.cert.parent / name).read_bytes())
    (tmp_path / "sub" / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    ca_file = {"server": kube.url, "certificate-authority": "sub/ca.crt"}  # relative
    ca_data = {"server": kube.url, "certificate-authority-data": b64(kube.ca_file)}
    forms = {
        "inline token, CA data": (ca_data, {"token": "admin-token"}),
        "token file (relative), CA file (relative)": (ca_file, {"tokenFile": "sub/token"}),
        "client certificate files": (
            ca_file,
            {"client-certificate": "sub/client.crt", "client-key": "sub/client.key"},
        ),
        "client certificate data": (
            ca_data,
            {"client-certificate-data": b64(pki.cert), "client-key-data": b64(pki.key)},
        ),
    }
    forms["no CA, insecure-skip-tls-verify"] = (
        {"server": kube.url, "insecure-skip-tls-verify": True},
        {"token": "admin-token"},
    )
    forms["tls-server-name"] = (
        {**ca_file, "tls-server-name": "kubernetes.default.svc"},
        {"token": "admin-token"},
    )
    for form, (cluster, user) in forms.items():
        path = write_config(tmp_path / "kubeconfig", cluster, user)
        client = ApiClient(from_kubeconfig(str(path)))
        try:
            assert can_read(client), form
        finally:
            client.close()


def test_tls_is_verified(kube: KubeApi, tmp_path: Path) -> None:
    """Without the CA, or checking another name, the server is not trusted."""
    ca = str(kube.ca_file)
    for cluster in (
        {"server": kube.url},
        {"server": kube.url, "certificate-authority": ca, "tls-server-name": "wrong.invalid"},
    ):
        path = write_config(tmp_path / "kubeconfig", cluster, {"token": "admin-token"})
        client = ApiClient(from_kubeconfig(str(path)))
        try:
            with pytest.raises(ApiUnreachable, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
                client.request("GET", "/api/v1/nodes")
        finally:
            client.close()


def test_kubeconfig_context_is_chosen(kube: KubeApi, tmp_path: Path) -> None:
    cluster = {"server": kube.url, "certificate-authority": str(kube.ca_file)}
    path = write_config(tmp_path / "kubeconfig", cluster, {"token": "wrong-token"})
    config = json.loads(path.read_text())
    config["users"].append({"name": "good", "user": {"token": "admin-token"}})
    config["contexts"].append({"name": "good", "context": {"cluster": "c", "user": "good"}})
    path.write_text(json.dumps(config))
    for context, works in (("", False), ("good", True)):
        client = ApiClient(from_kubeconfig(str(path), context))
        try:
            client.request("GET", "/api/v1/nodes")
            assert works
        except ApiError as e:
            assert not works and e.status == 401
        finally:
            client.close()
    source = kube.source("context=good", kubeconfig=path)
    wait_for(lambda: source.nodes.available, "the chosen context to list")


def test_token_file_is_read_again_when_it_changes(kube: KubeApi, tmp_path: Path) -> None:
    """A projected token rotates by rename: every request carries the current one."""
    token = tmp_path / "token"
    token.write_text("admin-token")
    cluster = {"server": kube.url, "certificate-authority": str(kube.ca_file)}
    path = write_config(tmp_path / "kubeconfig", cluster, {"tokenFile": str(token)})
    source = kube.source(kubeconfig=path)
    wait_for(lambda: source.nodes.available, "the first list")
    assert source.confirm_node_gone("nope").confirmed  # an authorized read

    def rotate(value: str) -> None:
        aside = tmp_path / "token.new"
        aside.write_text(value)
        os.replace(aside, token)  # as the kubelet does: a new file, renamed over

    rotate("revoked-token")
    answer = source.confirm_node_gone("nope")
    assert not answer.confirmed and "401" in answer.evidence
    rotate("spare-token")
    assert source.confirm_node_gone("nope").confirmed


def test_rotated_token_reaches_the_watches(kube_server: KubeApi, tmp_path: Path) -> None:
    """The old token revoked by the server, the file rotated: the next list and watch
    carry the new one, and the source answers again."""
    server = kube_server.server
    server.tokens["old-token"] = ("rotating", None)
    token = tmp_path / "token"
    token.write_text("old-token")
    cluster = {"server": kube_server.url, "certificate-authority": str(kube_server.ca_file)}
    path = write_config(tmp_path / "kubeconfig", cluster, {"tokenFile": str(token)})
    kube_server.admin.node("n1")
    source = kube_server.source(kubeconfig=path)
    wait_watching(kube_server, source)
    server.tokens["new-token"] = server.tokens.pop("old-token")
    token.write_text("new-token")
    server.cut_streams()  # every watch: the view answers once each resource relisted
    wait_for(lambda: all(r.lists >= 2 for r in source.reflectors), "relists with the new token")
    assert "n1" in source.cluster_view().nodes


def test_in_cluster_config(kube: KubeApi, tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("admin-token\n")
    (account / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    host_port = kube.url.removeprefix("https://")
    host, _, port = host_port.rpartition(":")
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    conn = in_cluster(env, str(account))
    assert conn.server == kube.url
    client = ApiClient(conn)
    try:
        client.request("GET", "/api/v1/nodes")
    finally:
        client.close()
    assert in_cluster({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, str(account)).server == (
        f"https://[fd00::1]:{port}"
    )


@pytest.mark.parametrize(
    ("env", "files", "message"),
    [
        ({}, {"token": "t", "ca.crt": "x"}, "KUBERNETES_SERVICE_HOST"),
        (
            {"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"},
            {"ca.crt": "x"},
            "token",
        ),
        (
            {"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"},
            {"token": "", "ca.crt": "x"},
            "empty",
        ),
    ],
)
def test_in_cluster_config_errors(
    tmp_path: Path, env: dict[str, str], files: dict[str, str], message: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(InvalidConfig, match=message):
        in_cluster(env, str(tmp_path))


def test_k8s_url_outside_a_pod_says_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(InvalidConfig, match=r"kubeconfig=PATH"):
        open_source("k8s://")


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}}, "exec"),
        ({"auth-provider": {"name": "oidc"}}, "auth-provider"),
        ({"client-certificate-data": "%%%"}, "not base64"),
        ({"username": "admin", "password": "secret"}, "basic auth"),
    ],
)
def test_kubeconfig_user_errors(tmp_path: Path, user: dict, message: str) -> None:
    path = write_config(tmp_path / "kc", {"server": "https://127.0.0.1:1"}, user)
    with pytest.raises(InvalidConfig, match=message) as raised:
        from_kubeconfig(str(path))
    assert str(path) in raised.value.msg


def test_kubeconfig_file_errors(tmp_path: Path) -> None:
    cluster = {"server": "https://127.0.0.1:1"}
    cases = {
        "missing": (tmp_path / "absent", "", "No such file"),
        "not yaml": (tmp_path / "bad", "", "kubeconfig"),
        "not a mapping": (tmp_path / "list", "", "not a mapping"),
        "no context": (tmp_path / "kc", "other", "no context named 'other'"),
        "no current-context": (tmp_path / "nocurrent", "", "no current-context"),
        "not a URL": (tmp_path / "url", "", "not an http"),
    }
    (tmp_path / "bad").write_text("clusters: [unclosed")
    (tmp_path / "list").write_text("- a\n- b\n")
    write_config(tmp_path / "kc", cluster, {"token": "t"})
    write_config(tmp_path / "nocurrent", cluster, {"token": "t"}, **{"current-context": ""})
    write_config(tmp_path / "url", {"server": "127.0.0.1:6443"}, {"token": "t"})
    for case, (path, context, message) in cases.items():
        with pytest.raises(InvalidConfig, match=message):
            from_kubeconfig(str(path), context)
        assert case


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("k8s://?colour=blue", "unknown option 'colour'"),
        ("k8s://?kubeconfig=x&stale=0", "stale"),
        ("k8s://?kubeconfig=x&stale=1.5", "stale=.*at least 2"),
        ("k8s://?kubeconfig=x&page=two", "page"),
        ("k8s://?kubeconfig=x&margin=-1", "margin"),
        ("k8s://?context=c", "context needs kubeconfig"),
        ("k8s://somewhere", "expected k8s://"),
    ],
)
def test_url_option_errors(url: str, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        Settings.from_url(url)


def test_url_options() -> None:
    settings = Settings.from_url("k8s://?kubeconfig=/k&context=c&node=n7&stale=30&page=50&margin=0")
    assert (settings.kubeconfig, settings.context, settings.node) == ("/k", "c", "n7")
    assert (settings.stale_after, settings.page_size, settings.margin) == (30.0, 50, 0.0)
    assert Settings.from_url("k8s://", node="n1").node == "n1"  # open_source's node
    assert Settings.from_url("k8s://?node=n2", node="n1").node == "n2"  # the URL's wins


def test_node_option_makes_an_agent_scope(kube: KubeApi) -> None:
    source = kube.source(f"node={kube.name('n1')}")
    assert source.nodes is None and source.statefulsets is None
    wait_for(lambda: source.pods.available, "the agent's list")
    with pytest.raises(LivenessUnavailable):
        source.cluster_view()
