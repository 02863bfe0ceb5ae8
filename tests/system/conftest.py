"""The system layer's fixtures: a real etcd for a module, an empty store on SQLite, on
etcd and on the Kubernetes API (`either_store`), the plugin installed into a temporary
CNI bin dir (the launcher, and the native plugin `install-cni --standalone` writes;
`forwarder`: each of them on the forwarding path), the scenario worlds
(`ipward_lab.soak.world`), Kubernetes API servers (the loopback test server, the real
kube-apiserver) and a real cluster for the `kube` tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipward.store import Store, open_backend
from ipward.store.base import Delete
from ipward_lab.fleet import IPWARD
from ipward_lab.servers.etcd import EtcdServer, etcd_server
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.soak.world import World


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for a test module; its tests empty the keyspace they use. A module
    needing one per test defines its own `etcd`."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(params=["sqlite", "etcd", pytest.param("k8s", marks=pytest.mark.kstore)])
def either_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A store without ipward's schema, empty: a SQLite file, the module's etcd
    (emptied: its tests share it), a namespace of its own on the real kube-apiserver."""
    url = f"sqlite://{tmp_path}/s.db"
    if request.param == "etcd":
        url = request.getfixturevalue("etcd").url
    if request.param == "k8s":
        url = request.getfixturevalue("new_kube_store_url")
    with open_backend(url) as s:
        s.txn([], [Delete(kv.key) for kv in s.range("")[0]])
        yield s


@pytest.fixture(scope="session")
def cni_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CNI bin dir holding the installed `ipward` plugin (and nothing else)."""
    bin_dir = tmp_path_factory.mktemp("cni-bin")
    subprocess.run(
        [*IPWARD, "install-cni", "--bin-dir", str(bin_dir)], check=True, capture_output=True
    )
    return bin_dir


@pytest.fixture
def plugin(cni_bin: Path) -> Path:
    return cni_bin / "ipward"


@pytest.fixture(scope="session")
def native_plugin() -> Iterator[Path]:
    """The native plugin as `ipward install-cni --standalone` installs it, in a directory
    every user may enter (tests run it as another user too)."""
    bin_dir = Path(tempfile.mkdtemp(prefix="ipw-native-"))
    bin_dir.chmod(0o755)
    done = subprocess.run(
        [*IPWARD, "install-cni", "--standalone", "--bin-dir", str(bin_dir)], capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    yield bin_dir / "ipward"
    shutil.rmtree(bin_dir, ignore_errors=True)


@pytest.fixture(params=["python", "native"])
def forwarder(request: pytest.FixtureRequest) -> Path:
    """What a runtime execs in cluster mode: the installed plugin's forwarding path
    (`cni/plugin.py`), or the native plugin a Kubernetes node gets; each takes the same
    decisions, in the same words."""
    if request.param == "python":
        return request.getfixturevalue("plugin")  # type: ignore[no-any-return]
    return request.getfixturevalue("native_plugin")  # type: ignore[no-any-return]


@pytest.fixture(params=["sim", "k8s", pytest.param("k8s-store", marks=pytest.mark.kstore)])
def world_kube(request: pytest.FixtureRequest) -> KubeApi | None:
    """Where a scenario's `World` keeps its cluster: `sim`, the state file (None); `k8s`,
    an API server read through `k8s://` (`scenario_kube`); `k8s-store`, the real
    kube-apiserver, which holds the ledger too (`--store k8s://`). Each scenario runs on
    all three."""
    if request.param == "sim":
        return None
    if request.param == "k8s-store" and not os.environ.get("KUBE_APISERVER"):
        pytest.skip("the Kubernetes store needs a real kube-apiserver (KUBE_APISERVER)")
    kube: KubeApi = request.getfixturevalue("scenario_kube")
    return kube


@pytest.fixture
def world(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    plugin: Path,
    sqlite_url: str,
    world_kube: KubeApi | None,
) -> Iterator[World]:
    """A running `World` (agents and controllers are added by the test) on SQLite, or
    with `k8s-store` on the Kubernetes store of its API server; everything stopped at
    the end."""
    url = sqlite_url
    if world_kube is not None and request.node.callspec.params.get("world_kube") == "k8s-store":
        from ipward_lab.servers import kube_store

        kube_store.install(world_kube.kubeconfig, "ipward-system")
        url = kube_store.store_url(world_kube.kubeconfig, "ipward-system")
    with World(tmp_path, plugin, url, kube=world_kube) as w:
        yield w


@pytest.fixture
def scenario_kube(tmp_path: Path, kube_certs: Path) -> Iterator[KubeApi]:
    """The API server of a scenario's `k8s` variant: a kube-apiserver of its own when
    KUBE_APISERVER names one (the scenarios name their nodes, namespace and pods alike,
    so they cannot share the session's), else the loopback test server."""
    from ipward_lab.servers import kube_apiserver

    executable = kube_apiserver.binary()
    if executable is None:
        yield from _test_kube_server(tmp_path, kube_certs)
        return
    with kube_apiserver.kube_apiserver(executable, tmp_path) as lab:
        api = KubeApi.of_real_server(lab)
        try:
            yield api
        finally:
            api.close()


@pytest.fixture(scope="session")
def real_kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ipward_lab.servers import kube_apiserver

    executable = kube_apiserver.binary()
    if executable is None:
        pytest.skip("KUBE_APISERVER does not name a kube-apiserver binary")
    with kube_apiserver.kube_apiserver(executable, tmp_path_factory.mktemp("kubelab")) as lab:
        yield lab


@pytest.fixture(scope="session")
def kube_store_url(real_kube_apiserver: Any) -> str:
    """A `k8s://` store on the real kube-apiserver (ipward's CRDs installed, a namespace
    of its own): the session's; tests keep to keys of their own."""
    from ipward_lab.servers import kube_store

    namespace = f"store-{uuid.uuid4().hex[:8]}"
    kube_store.install(real_kube_apiserver.kubeconfig, namespace)
    return kube_store.store_url(real_kube_apiserver.kubeconfig, namespace)


@pytest.fixture
def new_kube_store_url(real_kube_apiserver: Any, kube_store_url: str) -> str:
    """An empty `k8s://` store of the test's own: a new namespace (the CRDs installed
    once, with the session's)."""
    from ipward_lab.servers import kube_store

    namespace = f"store-{uuid.uuid4().hex[:8]}"
    kube_store.install(real_kube_apiserver.kubeconfig, namespace)
    return kube_store.store_url(real_kube_apiserver.kubeconfig, namespace)


@pytest.fixture(scope="session")
def kube_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates for the test API servers, made once per session (RSA keys are slow)."""
    return tmp_path_factory.mktemp("kube-certs")


@pytest.fixture
def kube_server(tmp_path: Path, kube_certs: Path) -> Iterator[KubeApi]:
    """The loopback test API server (faults can be injected through `.server`)."""
    yield from _test_kube_server(tmp_path, kube_certs)


def _test_kube_server(tmp_path: Path, certs: Path) -> Iterator[KubeApi]:
    from ipward_lab.servers.kube_test_server import kube_api_server

    with kube_api_server(tmp_path, certs=certs) as server:
        api = KubeApi.of_test_server(server, tmp_path / "kubeconfig")
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
    api = KubeApi.of_real_server(lab, tag=uuid.uuid4().hex[:8])
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real cluster (`ipward cluster up --nodes 3 --without-python 1`: n3 has no
    Python, so every story runs a third of its pods through a plugin that needs none)
    with ipward deployed from its image
    and manifests (`ipward cluster deploy`, tuned by `kube_checks.KUBE_TUNING` so that
    stories take seconds), shared by every `kube` test of the session and removed after
    them. The machine's state before `up` is in `.machine_before`, the times taken in
    `.info` (`up_seconds`, `deploy_seconds`). Skipped when the Kubernetes binaries are
    not found (the reason says where to get them), failed when they are but something
    else the tests need is not (`kube_checks.require_cluster_lab`).
    `IPWARD_KUBE_STATE=DIR`: the cluster up in DIR already (deployed with KUBE_TUNING),
    kept after: for working on a test.
    `IPWARD_KUBE_NEW_STATE=DIR`: the cluster made in DIR (else a temporary dir), so that
    whoever ran the tests can remove what a killed run left (`.ci/run`: `ipward cluster
    down --state DIR`)."""
    from ipward_lab.kubecluster.cluster import Cluster
    from ipward_lab.kubecluster.teardown import machine_snapshot
    from kube_checks import KUBE_TUNING, require_cluster_lab

    require_cluster_lab()
    from ipward_lab.containerd.lab import machine_lock

    # A containerd lab writes to the machine's /run/containerd and /var/lib/cni while it
    # runs, which the snapshot compares: none runs meanwhile (they take the same lock).
    machine_lock.acquire()
    try:
        given = os.environ.get("IPWARD_KUBE_STATE")
        if given:
            yield Cluster.load(Path(given))
            return
        before = machine_snapshot()
        new_state = os.environ.get("IPWARD_KUBE_NEW_STATE")
        lab = Cluster(Path(new_state) if new_state else tmp_path_factory.mktemp("cluster"))
        lab.machine_before = before  # type: ignore[attr-defined]
        say = lambda text: print(f"[cluster] {text}", file=sys.stderr)  # noqa: E731
        try:
            lab.up(3, say, without_python=1)  # n3 runs every story with no Python
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
