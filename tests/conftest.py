"""Shared fixtures: a fresh SQLite store, the plugin installed into a temporary CNI bin
dir, and a helper to exec it the way a runtime does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from ipward.store import open_store
from ipward_lab.etcdlab import EtcdServer, etcd_server

# CI is a gate: the same examples every run. Local runs explore new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parent.parent
IPWARD = [sys.executable, "-m", "ipward"]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for a test module; its tests empty the keyspace they use. A module
    needing one per test defines its own `etcd`."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/ipward.db"


@pytest.fixture
def sqlite_store(sqlite_url: str):
    store = open_store(sqlite_url)
    yield store
    store.close()


@pytest.fixture(scope="session")
def cni_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CNI bin dir holding the installed `ipward` plugin (and nothing else)."""
    bin_dir = tmp_path_factory.mktemp("cni-bin")
    subprocess.run(
        [*IPWARD, "install-cni", "--bin-dir", str(bin_dir)], check=True, capture_output=True
    )
    return bin_dir


class PluginResult:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.json = json.loads(proc.stdout) if proc.stdout.strip() else None

    def __repr__(self) -> str:
        return f"PluginResult(rc={self.returncode}, stdout={self.stdout!r}, stderr={self.stderr!r})"


def exec_plugin(
    plugin: Path,
    command: str,
    config: dict | bytes | str,
    container: str = "c0",
    ifname: str = "eth0",
    args: str = "",
    netns: str = "/var/run/netns/test",
    env: dict[str, str] | None = None,
) -> PluginResult:
    """Exec the plugin as a runtime would: CNI_* environment, config on stdin."""
    data = json.dumps(config).encode() if isinstance(config, dict) else config
    if isinstance(data, str):
        data = data.encode()
    full_env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_IFNAME": ifname,
        "CNI_NETNS": netns,
        "CNI_PATH": str(plugin.parent),
        "CNI_ARGS": args,
    }
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run([str(plugin)], input=data, env=full_env, capture_output=True, timeout=60)
    return PluginResult(proc)


@pytest.fixture
def plugin(cni_bin: Path) -> Path:
    return cni_bin / "ipward"


def run_cli(
    *args: str, store: str | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if store:
        env["IPWARD_STORE"] = store
    return subprocess.run(
        [*IPWARD, *args], capture_output=True, text=True, env=env, check=check, timeout=120
    )


def wait_for(
    condition: Callable[[], Any], what: str, timeout: float = 60.0, poll: float = 0.05
) -> Any:
    """Poll until `condition()` is truthy; its value. The timeout bounds a wait, it never
    asserts a speed: on a loaded machine things are slow, not wrong."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")
        time.sleep(poll)


class Gate:
    """A test point held open (`IPWARD_TEST_GATES`): the process waits at it until the
    test opens it, so the test acts exactly in the window."""

    def __init__(self, tmp: Path, point: str) -> None:
        self.dir = tmp / f"gate-{point}"
        self.dir.mkdir()
        self.point = point
        self.env = {**os.environ, "IPWARD_TEST_GATES": f"{point}={self.dir}"}

    def wait_reached(self) -> None:
        wait_for((self.dir / f"{self.point}.reached").exists, f"the {self.point} gate")

    def open(self) -> None:
        (self.dir / f"{self.point}.open").touch()


@pytest.fixture(params=["sim", "k8s"])
def world_kube(request: pytest.FixtureRequest) -> KubeApi | None:
    """Where a scenario's `World` keeps its cluster: `sim`, the state file (None); `k8s`,
    an API server read through `k8s://` (`scenario_kube`). Each scenario runs on both."""
    if request.param == "sim":
        return None
    kube: KubeApi = request.getfixturevalue("scenario_kube")
    return kube


@pytest.fixture
def world(
    tmp_path: Path, plugin: Path, sqlite_url: str, world_kube: KubeApi | None
) -> Iterator[Any]:
    """A running `simprocs.World` on SQLite (agents and controllers are added by the
    test), on both `world_kube`s; everything stopped at the end."""
    from simprocs import World  # simprocs imports this module

    with World(tmp_path, plugin, sqlite_url, kube=world_kube) as w:
        yield w


@pytest.fixture
def scenario_kube(tmp_path: Path, kube_certs: Path) -> Iterator[KubeApi]:
    """The API server of a scenario's `k8s` variant: a kube-apiserver of its own when
    KUBE_APISERVER names one (the scenarios name their nodes, namespace and pods alike,
    so they cannot share the session's), else the loopback test server."""
    from ipward_lab import kubelab

    executable = kubelab.binary()
    if executable is None:
        yield from _test_kube_server(tmp_path, kube_certs)
        return
    with kubelab.kube_apiserver(executable, tmp_path) as lab:
        api = KubeApi(lab.url, lab.kubeconfig, lab.ca_file, lab.client_pki, "t", None)
        try:
            yield api
        finally:
            api.close()


class KubeApi:
    """An API server for a test: the loopback test server (`server` set: faults can be
    injected) or the real kube-apiserver (shared by the session: names are made unique
    per test with `name`)."""

    def __init__(
        self, url: str, kubeconfig: Path, ca_file: Path, client_pki: Any, tag: str, server: Any
    ) -> None:
        from ipward.cluster.k8s.client import ApiClient
        from ipward.cluster.k8s.config import from_kubeconfig
        from ipward_lab.kubeadmin import KubeAdmin

        self.url = url
        self.kubeconfig = kubeconfig  # admin token
        self.ca_file = ca_file  # the server's certificate
        self.client_pki = client_pki  # a client certificate it accepts (ipward_lab.pki)
        self.tag = tag
        self.server = server  # KubeApiServer, or None for the real one
        self.client = ApiClient(from_kubeconfig(str(kubeconfig)))
        self.admin = KubeAdmin(self.client)
        self.sources: list[Any] = []

    def name(self, base: str) -> str:
        return f"{base}-{self.tag}"

    def source(self, *options: str, node: str = "", kubeconfig: Path | None = None) -> Any:
        """A `k8s://` source on this server (closed at the end of the test)."""
        from ipward.cluster.liveness import open_source

        query = "&".join([f"kubeconfig={kubeconfig or self.kubeconfig}", *options])
        source = open_source(f"k8s://?{query}", node=node)
        self.sources.append(source)
        return source

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self.client.close()


@pytest.fixture(scope="session")
def real_kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ipward_lab import kubelab

    executable = kubelab.binary()
    if executable is None:
        pytest.skip("KUBE_APISERVER does not name a kube-apiserver binary")
    with kubelab.kube_apiserver(executable, tmp_path_factory.mktemp("kubelab")) as lab:
        yield lab


@pytest.fixture(scope="session")
def kube_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates for the test API servers, made once per session (RSA keys are slow)."""
    return tmp_path_factory.mktemp("kube-certs")


@pytest.fixture
def kube_server(tmp_path: Path, kube_certs: Path) -> Iterator[KubeApi]:
    """The loopback test API server (faults can be injected through `.server`)."""
    yield from _test_kube_server(tmp_path, kube_certs)


def _test_kube_server(tmp_path: Path, certs: Path) -> Iterator[KubeApi]:
    from ipward_lab.kubeapi import kube_api_server

    with kube_api_server(tmp_path, certs=certs) as server:
        kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
        api = KubeApi(server.url, kubeconfig, server.ca_file, server.client_pki, "t", server)
        try:
            yield api
        finally:
            api.close()


@pytest.fixture(params=["test-server", "kube-apiserver"])
def kube(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KubeApi]:
    """A Kubernetes API: the loopback test server, and the real kube-apiserver when
    KUBE_APISERVER names it (else that parametrization is skipped)."""
    if request.param == "test-server":
        yield request.getfixturevalue("kube_server")
        return
    lab = request.getfixturevalue("real_kube_apiserver")
    tag = uuid.uuid4().hex[:8]
    api = KubeApi(lab.url, lab.kubeconfig, lab.ca_file, lab.client_pki, tag, None)
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real cluster (`ipward cluster up --nodes 3`) with ipward deployed from its image
    and manifests (`ipward cluster deploy`, tuned by `kube_checks.KUBE_TUNING` so that
    stories take seconds), shared by every `kube` test of the session and removed after
    them. The machine's state before `up` is in `.machine_before`, the times taken in
    `.info` (`up_seconds`, `deploy_seconds`). Skipped when the Kubernetes binaries are
    not found (the reason says where to get them). `IPWARD_KUBE_STATE=DIR`: the cluster
    up in DIR already (deployed with KUBE_TUNING), kept after: for working on a test."""
    from ipward_lab import kubecluster
    from kube_checks import KUBE_TUNING

    reason = kubecluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from containerd_lab import machine_lock

    # A containerd lab writes to the machine's /run/containerd and /var/lib/cni while it
    # runs, which the snapshot compares: none runs meanwhile (they take the same lock).
    machine_lock.acquire()
    try:
        given = os.environ.get("IPWARD_KUBE_STATE")
        if given:
            yield kubecluster.Cluster.load(Path(given))
            return
        before = kubecluster.machine_snapshot()
        lab = kubecluster.Cluster(tmp_path_factory.mktemp("cluster"))
        lab.machine_before = before  # type: ignore[attr-defined]
        say = lambda text: print(f"[cluster] {text}", file=sys.stderr)  # noqa: E731
        try:
            lab.up(3, say)
            lab.deploy(say, KUBE_TUNING)
            yield lab
        finally:
            left = lab.down(say)
            assert not left, f"cluster down left: {left}"
    finally:
        machine_lock.release()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test that takes the shared cluster down (`kube_cluster`) runs after every
    other test that uses it, whatever module each is in."""
    last = [i for i in items if i.name == "test_down_leaves_the_machine_as_before"]
    if last:
        items[:] = [i for i in items if i not in last] + last
