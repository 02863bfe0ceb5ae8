"""The Kubernetes deployment (`deploy/`): the manifests render with `kubectl kustomize`,
validate against the API schemas of Kubernetes 1.26 and 1.31 and in a server-side dry
run on the real kube-apiserver, start ipward with options the code accepts, the init
container installs a plugin the runtime can exec, the RBAC grants exactly what the
agent and the controller call, and the etcd certificates the helper script makes work
with a real etcd and ipward's own store client."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from ipward.kubeapi.client import ApiError
from ipward_lab.fleet import run_cli
from ipward_lab.waiting import wait_for
from support import REPO, exec_plugin

DEPLOY = REPO / "deploy"
RENDERINGS = {
    "base": DEPLOY / "base",
    "with-etcd": DEPLOY / "overlays" / "with-etcd",
}
KUBERNETES_VERSIONS = ("1.26.0", "1.31.0")
POD_RANGES = {"ranges": [[{"subnet": "10.92.0.0/24"}]]}

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


# The only writes: the controller's to its IPPool objects, a finalizer and a status
# (docs/design.md 5.16).
WRITES = {
    ("ipward-controller", "ippools"): {"patch"},
    ("ipward-controller", "ippools/status"): {"update"},
}


@needs_kubectl
def test_nothing_writes_or_reads_secrets() -> None:
    """Least privilege: read verbs only (but the controller's finalizer and status of
    its IPPool objects), and never secrets (the etcd credentials come from a mounted
    Secret, not from the API)."""
    docs = render(RENDERINGS["with-etcd"])
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert {r["metadata"]["name"] for r in roles} == {"ipward-agent", "ipward-controller"}
    for role in roles:
        for rule in role["rules"]:
            for resource in rule["resources"]:
                writes = WRITES.get((role["metadata"]["name"], resource), set())
                assert set(rule["verbs"]) <= {"get", "list", "watch", *writes}, rule
            assert "secrets" not in rule["resources"] and "*" not in rule["resources"], rule


def _container(docs: list[dict], kind: str, name: str, container: str) -> tuple[dict, dict]:
    """The container and its pod spec."""
    spec = by_kind(docs, kind, name)["spec"]["template"]["spec"]
    found = [
        c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == container
    ]
    assert len(found) == 1
    return found[0], spec


def _container_args(docs: list[dict], kind: str, name: str, container: str) -> list[str]:
    env = {
        "NODE_NAME": "node-1",
        "POD_NAME": "ipward-controller-7d9f-x2",
        "POD_IP": "10.0.0.5",
        "ETCD_ENDPOINTS": "e0:2379,e1:2379,e2:2379",
    }
    args = []
    for arg in _container(docs, kind, name, container)[0]["args"]:
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

    from ipward.cmd.cli import cli

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
    from ipward.store import StoreUnreachable, open_store
    from ipward_lab.servers.etcd import etcd_server

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
        with pytest.raises(StoreUnreachable):  # opening it checks the store's schema
            open_store(etcd.url + tls)


def _option(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} in {args}"
    return values[0]


@needs_kubectl
def test_install_cni_writes_the_native_plugin_into_the_hosts_cni_bin_dir_only() -> None:
    """The init container writes the native plugin (`--standalone`) into a writable
    mount of the host's /opt/cni/bin, and mounts nothing else of the host's: the plugin
    needs nothing of it."""
    docs = render(RENDERINGS["base"])
    container, spec = _container(docs, "DaemonSet", "ipward-agent", "install-cni")
    args = _container_args(docs, "DaemonSet", "ipward-agent", "install-cni")
    assert "--standalone" in args
    host_paths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    bin_dir = mounts[_option(args, "--bin-dir")]
    assert host_paths[bin_dir["name"]] == "/opt/cni/bin" and not bin_dir.get("readOnly")
    assert list(mounts) == [_option(args, "--bin-dir")]


# -- RBAC: exactly what the code calls ------------------------------------------------------


def api_calls(requests: Iterable[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of each request (method, path, Accept), as RBAC names
    them."""
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    calls = set()
    for method, path, _ in requests:
        parts = urlsplit(path)
        segments = parts.path.strip("/").split("/")
        if segments[0] not in ("api", "apis"):
            continue  # /readyz and the like: no RBAC resource
        group, rest = ("", segments[2:]) if segments[0] == "api" else (segments[1], segments[3:])
        if rest[0] == "namespaces" and len(rest) >= 3:
            rest = rest[2:]  # a namespaced resource
        resource = "/".join(rest[0:1] + rest[2:3])  # with its subresource (pods/status)
        watching = parse_qs(parts.query).get("watch", [""])[0] in ("1", "true")
        if method == "GET":
            verb = "watch" if watching else "get" if len(rest) > 1 else "list"
        else:
            verb = verbs[method]
        calls.add((group, resource, verb))
    return calls


def granted(docs: list[dict], role: str) -> set[tuple[str, str, str]]:
    rules = by_kind(docs, "ClusterRole", role)["rules"]
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def k8s_options(
    docs: list[dict], kind: str, name: str, container: str, kubeconfig: Path
) -> list[str]:
    """The container's options that name the Kubernetes API (in the cluster: `k8s://`,
    the service account), pointed at `kubeconfig` instead."""
    out = []
    for arg in _container_args(docs, kind, name, container):
        option, _, value = arg.partition("=")
        if value.startswith("k8s://"):
            assert value == "k8s://", f"{arg}: options the test does not carry over"
            out += [option, f"k8s://?kubeconfig={kubeconfig}"]
    assert out, f"{container} does not read the Kubernetes API"
    return out


def _difference(role: str, calls: set, grants: set) -> str:
    return (
        f"{role}: called but not granted {sorted(calls - grants)};"
        f" granted but never called {sorted(grants - calls)}"
    )


@needs_kubectl
def test_rbac_grants_exactly_what_the_agent_and_the_controller_call(
    tmp_path: Path, kube_server: Any, sqlite_url: str
) -> None:
    """The real agent and controller, started with the options the manifests give them
    (their API pointed at the loopback test server), do their work: the agent answers an
    ADD exec'd through the plugin the init container installs (its args, the host's root
    a temp dir), the controller makes a garbage-collection pass that reads the cluster.
    Every request they make, as (group, resource, verb), must be granted by their
    ClusterRole, and every grant must be used: a new call without its grant, or a grant
    left behind, fails here."""
    from ipward_lab import fleet

    docs = render(RENDERINGS["base"])
    server = kube_server.server
    kube_server.admin.namespace("shop")
    kube_server.admin.node("n1")
    uid = kube_server.admin.pod("shop", "web-0", "n1")
    server.requests.clear()

    host = tmp_path / "host"
    host.mkdir()
    (host / "usr").symlink_to("/usr")  # the host's /usr, as the DaemonSet mounts it
    install_args = [
        a.replace("/host", str(host))
        for a in _container_args(docs, "DaemonSet", "ipward-agent", "install-cni")
    ]
    done = run_cli(*install_args)
    assert done.returncode == 0, done.stderr
    plugin = host / "opt" / "cni" / "bin" / "ipward"

    run_dir = Path(tempfile.mkdtemp(prefix="ipw-rbac-"))  # AF_UNIX paths are short
    extra = k8s_options(docs, "DaemonSet", "ipward-agent", "agent", kube_server.kubeconfig)
    agent = fleet.Agent("n1", sqlite_url, run_dir / "agent.sock", tmp_path, extra=tuple(extra))
    try:
        agent.wait_ready()
        config = {
            "cniVersion": "1.1.0",
            "name": "podnet",
            "ipam": {"type": "ipward", "agentSocket": str(agent.socket), **POD_RANGES},
        }
        args = f"K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_UID={uid}"
        added = wait_for(
            lambda: (
                (r := exec_plugin(plugin, "ADD", config, "sb1", args=args)).returncode == 0 and r
            ),
            "an ADD the agent answers from the cluster's view",
        )
        assert added.json["ips"][0]["address"].startswith("10.92.0.")
        # A pod (and namespace) the agent's watches have not brought yet: read directly.
        server.stall()
        try:
            admin_from = len(server.requests)  # the admin's creates are not the agent's
            kube_server.admin.namespace("late")
            late = kube_server.admin.pod("late", "job-0", "n1")
            admin_to = len(server.requests)
            args = f"K8S_POD_NAMESPACE=late;K8S_POD_NAME=job-0;K8S_POD_UID={late}"
            read = exec_plugin(plugin, "ADD", config, "sb2", args=args)
            assert read.returncode == 0, read
        finally:
            server.unstall()
    finally:
        agent.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    requests = list(server.requests)
    del requests[admin_from:admin_to]
    agent_calls = api_calls(requests)
    # web-0 is deleted: its record is freed on the cluster's word, after a live read.
    kube_server.admin.delete_pod("shop", "web-0")
    server.requests.clear()

    extra = k8s_options(
        docs, "Deployment", "ipward-controller", "controller", kube_server.kubeconfig
    )
    options = (*extra, "--gc-interval", "1", "--add-grace", "0")
    # n1's agent runs (a node whose agent is down waits for it), without the API: the
    # requests counted below are the controller's.
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-rbac-"))
    n1 = fleet.Agent("n1", sqlite_url, run_dir / "agent.sock", tmp_path).wait_ready()
    controller = fleet.Controller("c1", sqlite_url, tmp_path, extra=options)
    try:
        wait_for(
            lambda: controller.metric("ipward_gc_freed_total", reason="pod-gone"),
            "web-0's address freed as pod-gone",
        )
    finally:
        controller.stop()
        n1.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    # The other live reads before a free (a gone node, a retired StatefulSet identity)
    # need records of other nodes and sticky reservations: asked here through the source
    # the controller's own option opens.
    from ipward.cluster.liveness import open_source

    source = open_source(extra[extra.index("--liveness") + 1])
    try:
        assert source.confirm_node_gone("n-gone").confirmed
        assert source.confirm_identity_retired("shop", "db-3", "db").confirmed
    finally:
        source.close()
    controller_calls = api_calls(server.requests)

    for role, calls in (("ipward-agent", agent_calls), ("ipward-controller", controller_calls)):
        # The IPPools' grants are the next test's: a controller on a k8s:// store calls them.
        grants = {g for g in granted(docs, role) if g[0] != "ipward.io"}
        assert calls == grants, _difference(role, calls, grants)


AUDIT_POLICY = """
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:ipward-system"]
  - level: None
"""


@needs_kubectl
@pytest.mark.kstore
def test_rbac_grants_exactly_what_the_pool_objects_reconciliation_calls(tmp_path: Path) -> None:
    """The controller on a `k8s://` store whose pools are objects, as the manifests'
    service account (its ClusterRole and binding as rendered), on a real kube-apiserver
    of its own that keeps an audit log: it holds an object applied without its
    finalizer, applies it, writes its status, deletes its pool and releases it once the
    object is deleted. Its requests to IPPools, as the API server's audit log has them,
    must be exactly what its ClusterRole grants of them. (The ledger's own objects,
    `ledgershards`, it reaches through a stand-in Role here: not the IPPools' part.)"""
    from ipward.core import ippool
    from ipward.kubeapi.client import ApiClient
    from ipward.kubeapi.config import from_kubeconfig
    from ipward.store.kube import DEFAULT_NAMESPACE
    from ipward_lab import fleet
    from ipward_lab.servers import kube_apiserver, kube_store
    from ipward_lab.servers.pki import token_kubeconfig

    executable = kube_apiserver.binary()
    if executable is None:
        pytest.skip("KUBE_APISERVER does not name a kube-apiserver binary")
    docs = render(RENDERINGS["base"])
    policy, audit = tmp_path / "audit-policy.yaml", tmp_path / "audit.log"
    policy.write_text(AUDIT_POLICY)
    with kube_apiserver.kube_apiserver(executable, tmp_path) as lab:
        lab.stop()  # again, keeping an audit log
        lab.args += [f"--audit-policy-file={policy}", f"--audit-log-path={audit}"]
        lab.start()
        lab.wait_ready()
        kube_store.install(lab.kubeconfig, DEFAULT_NAMESPACE)
        admin = ApiClient(from_kubeconfig(str(lab.kubeconfig)))
        controller = None
        try:
            for kind, path in (
                ("ServiceAccount", f"/api/v1/namespaces/{DEFAULT_NAMESPACE}/serviceaccounts"),
                ("ClusterRole", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
                ("ClusterRoleBinding", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"),
            ):
                admin.request("POST", path, body=by_kind(docs, kind, "ipward-controller"))
            _stand_in_ledger_role(admin, DEFAULT_NAMESPACE)
            token = admin.request(
                "POST",
                f"/api/v1/namespaces/{DEFAULT_NAMESPACE}/serviceaccounts/ipward-controller/token",
                body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
            )["status"]["token"]
            config = token_kubeconfig(tmp_path / "sa.kubeconfig", lab.url, lab.ca_file, token)
            url = kube_store.store_url(config, DEFAULT_NAMESPACE)
            as_admin = kube_store.store_url(lab.kubeconfig, DEFAULT_NAMESPACE)
            made = run_cli("pool", "create", "web", "--range", "10.93.0.0/24", store=as_admin)
            assert made.returncode == 0, made.stderr  # the store made, and a held object
            body = {"apiVersion": ippool.API_VERSION, "kind": ippool.KIND}
            spec = {"ranges": [{"subnet": "10.94.0.0/24"}]}
            admin.request(
                "POST", ippool.PATH, body={**body, "metadata": {"name": "db"}, "spec": spec}
            )
            extra = ("--interval", "0.2", "--lease-ttl", "2")
            controller = fleet.Controller("c1", url, tmp_path, extra)

            def ready(name: str) -> bool:
                obj = ippool.parse(admin.request("GET", ippool.path(name)))[1]
                found = ippool.condition(obj, ippool.READY)
                return found is not None and found["status"] == "True"

            wait_for(lambda: ready("web") and ready("db"), "both objects Ready")
            admin.request("DELETE", ippool.path("db"))
            wait_for(lambda: "db" not in _names(admin), "db's object released and gone")
            controller.stop()
        finally:
            if controller is not None:
                controller.kill()
            admin.close()
    calls = set()
    for line in audit.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if ref.get("apiGroup") == ippool.GROUP and ref.get("resource") == ippool.PLURAL:
            subresource = f"/{ref['subresource']}" if ref.get("subresource") else ""
            calls.add((ippool.GROUP, f"{ippool.PLURAL}{subresource}", event["verb"]))
    grants = {g for g in granted(docs, "ipward-controller") if g[0] == ippool.GROUP}
    assert calls == grants, _difference("ipward-controller", calls, grants)


def _stand_in_ledger_role(admin: Any, namespace: str) -> None:
    """The ledger's objects for the controller's service account (what the store needs
    of them is the Kubernetes store's part of the manifests, not checked here)."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    rule = {"apiGroups": ["ipward.io"], "resources": ["ledgershards"], "verbs": ["*"]}
    role = {"metadata": {"name": "ledger-stand-in"}, "rules": [rule]}
    admin.request("POST", f"{rbac}/namespaces/{namespace}/roles", body=role)
    binding = {
        "metadata": {"name": "ledger-stand-in"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "ledger-stand-in",
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": "ipward-controller", "namespace": namespace}
        ],
    }
    admin.request("POST", f"{rbac}/namespaces/{namespace}/rolebindings", body=binding)


def _names(admin: Any) -> list[str]:
    from ipward.core import ippool

    return [item["metadata"]["name"] for item in admin.request("GET", ippool.PATH)["items"]]


@needs_kubectl
@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_manifests_are_accepted_by_a_real_kube_apiserver(
    rendering: str, real_kube_apiserver: Any
) -> None:
    """A server-side dry run on the real kube-apiserver (its own validation, admission
    and strict field checks), the namespace made first as `kubectl apply` would."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(RENDERINGS[rendering])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kubectl = ["kubectl", f"--kubeconfig={real_kube_apiserver.kubeconfig}"]
    namespace = subprocess.run(
        [*kubectl, "create", "namespace", "ipward-system", "--dry-run=client", "-o", "yaml"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    subprocess.run([*kubectl, "apply", "-f", "-"], input=namespace, text=True, check=True)
    applied = subprocess.run(
        [*kubectl, "apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        input=out,
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, applied.stderr
    assert "(server dry run)" in applied.stdout


# -- the agent's health when its RBAC goes ----------------------------------------------------


def _manifest_identity(client: Any, tag: str) -> tuple[str, str, dict]:
    """The agent's identity as `deploy/base/agent-rbac.yaml` makes it, on a real API
    server shared with other tests (names suffixed with `tag`): its ServiceAccount, its
    ClusterRole's rules and the binding. (A token for the account from the TokenRequest
    API, the binding's path, the binding) to remove and restore it."""
    docs = {
        d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "base" / "agent-rbac.yaml").read_text())
    }
    namespace, name = "ipward-system", f"ipward-agent-{tag}"
    try:
        client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    except ApiError as e:
        if e.status != 409:  # made by an earlier test: fine
            raise
    client.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        body={"metadata": {"name": name}},
    )
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    role = {**docs["ClusterRole"], "metadata": {"name": name}}
    client.request("POST", f"{rbac}/clusterroles", body=role)
    binding = {
        **docs["ClusterRoleBinding"],
        "metadata": {"name": name},
        "roleRef": {**docs["ClusterRoleBinding"]["roleRef"], "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    token = client.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    )["status"]["token"]
    return token, f"{rbac}/clusterrolebindings", binding


def test_agent_healthz_reports_its_cluster_source_refused(
    real_kube_apiserver: Any, plugin: Path, sqlite_url: str, tmp_path: Path
) -> None:
    """Finding (issue 21, 7): with the agent's RBAC removed, its ADDs answered 11 while
    `/healthz` said ok. The agent, with the identity the manifests make and `--cluster
    k8s://`: ok; its ClusterRoleBinding deleted: 503 naming the source and the API's 403
    (and an ADD answers 11); the binding back: ok again, and the ADD is served."""
    import uuid

    from ipward.kubeapi.client import ApiClient
    from ipward.kubeapi.config import from_kubeconfig
    from ipward_lab import fleet
    from ipward_lab.servers.kube_admin import KubeAdmin

    lab = real_kube_apiserver
    tag = uuid.uuid4().hex[:8]
    admin_client = ApiClient(from_kubeconfig(str(lab.kubeconfig)))
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-health-"))  # AF_UNIX paths are short
    agent = None
    try:
        token, bindings, binding = _manifest_identity(admin_client, tag)
        admin_client.request("POST", bindings, body=binding)
        kubeconfig = json.loads(lab.kubeconfig.read_text())
        kubeconfig["users"][0]["user"] = {"token": token}
        (tmp_path / "agent.kubeconfig").write_text(json.dumps(kubeconfig))
        admin = KubeAdmin(admin_client)
        ns, node = f"health-{tag}", f"n1-{tag}"
        admin.namespace(ns)
        admin.node(node)
        uid = admin.pod(ns, "web-0", node)
        cluster = f"k8s://?kubeconfig={tmp_path / 'agent.kubeconfig'}&stale=2"  # watches of 1 s
        agent = fleet.Agent(
            node, sqlite_url, run_dir / "agent.sock", tmp_path, extra=("--cluster", cluster)
        ).wait_ready()
        wait_for(lambda: agent.healthz() == "ok", "healthz ok with the manifests' rights")

        admin_client.request("DELETE", f"{bindings}/{binding['metadata']['name']}")
        refused = wait_for(
            lambda: (h := agent.healthz()) != "ok" and h, "healthz to see the source refused"
        )
        assert refused.startswith("503: cluster source: Kubernetes ") and "HTTP 403" in refused
        config = {
            "cniVersion": "1.1.0",
            "name": "podnet",
            "ipam": {"type": "ipward", "agentSocket": str(agent.socket), **POD_RANGES},
        }
        args = f"K8S_POD_NAMESPACE={ns};K8S_POD_NAME=web-0;K8S_POD_UID={uid}"
        add = exec_plugin(plugin, "ADD", config, "sb1", args=args)
        assert add.json["code"] == 11 and "403" in add.json["msg"], add

        admin_client.request("POST", bindings, body=binding)
        wait_for(lambda: agent.healthz() == "ok", "healthz ok once the binding is back")
        add = exec_plugin(plugin, "ADD", config, "sb1", args=args)
        assert add.returncode == 0, add
    finally:
        if agent is not None:
            agent.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        admin_client.close()
