"""Static pods: a kubelet runs them from files and gives their ADD their own UID (the
config hash); the API lists only their mirror pods, of another UID, carrying that one in
the annotation `kubernetes.io/config.mirror`. Every lookup of a pod by UID finds a static
pod by its mirror pod: the agent's ADD (`--cluster k8s://`), the sticky takeover's
`listed`, garbage collection's view and its live confirmation. On both API servers (the
`kube` fixture: the real kube-apiserver when KUBE_APISERVER names it, mirror pods made
through the API as a kubelet makes them) and on the simulated cluster's `sim://`."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.agent.directory import ClusterDirectory
from ipward.cluster.liveness import MIRROR_ANNOTATION, Pod
from ipward.controller.collection import Collection
from ipward.controller.election import Election
from ipward.controller.metrics import Metrics
from ipward.controller.passes import Controller
from ipward.controller.view import StoreView
from ipward.core import keys
from ipward.core.records import Attachment, NodeRegistration, PodInfo
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.kubeapi.client import ApiError
from ipward.store import Store, open_store
from ipward.store.base import Put
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.simcluster import SimFileSource, write_sim_state
from ipward_lab.waiting import wait_for
from support import exec_plugin

POOL_RANGE = "10.77.0.0/24"


class StaticPod:
    """A static pod as a kubelet shows it: its UID (the config hash, the ADD's
    K8S_POD_UID) and, made through the API, its mirror pod (another UID)."""

    def __init__(self, kube: KubeApi, base: str) -> None:
        self.kube = kube
        self.namespace = kube.name(base)
        self.node = kube.name("n1")
        self.name = f"static-web-{self.node}"  # the kubelet names it after its node
        self.uid = uuid.uuid4().hex  # a config hash: 32 hex digits
        kube.admin.namespace(self.namespace)
        kube.admin.node(self.node)
        annotations = {
            "kubernetes.io/config.hash": self.uid,
            MIRROR_ANNOTATION: self.uid,
            "kubernetes.io/config.source": "file",
        }
        self.mirror_uid = kube.admin.pod(
            self.namespace, self.name, self.node, annotations=annotations
        )
        kube.admin.pod_phase(self.namespace, self.name, "Running", "2026-11-24T05:18:50Z")
        assert self.mirror_uid != self.uid

    @property
    def info(self) -> PodInfo:
        return PodInfo(self.namespace, self.name, self.uid)

    def delete_mirror(self) -> None:
        """The kubelet no longer runs it: it deletes the mirror pod."""
        self.kube.admin.delete_pod(self.namespace, self.name, grace=0)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for an agent's socket (a socket path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ipw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_static_pod_add_through_a_k8s_agent_gets_an_address(
    kube: KubeApi, tmp_path: Path, plugin: Path, sqlite_url: str, socket_dir: Path
) -> None:
    """The ADD of a static pod (K8S_POD_UID = its config hash) through an agent reading
    the API (`--cluster k8s://`): answered with an address, not 11 "not listed yet"
    (which the runtime would retry forever: the API never lists that UID)."""
    static = StaticPod(kube, "static-add")
    run_cli("pool", "create", "pods", "--range", POOL_RANGE, store=sqlite_url, check=True)
    agent = fleet.Agent(
        static.node,
        sqlite_url,
        socket_dir / "agent.sock",
        tmp_path,
        ("--cluster", f"k8s://?kubeconfig={kube.kubeconfig}"),
        metrics=False,
    ).wait_ready()
    try:
        config = {
            "cniVersion": "1.0.0",
            "name": "net",
            "ipam": {"type": "ipward", "pool": "pods", "agentSocket": str(agent.socket)},
        }
        args = (
            f"IgnoreUnknown=1;K8S_POD_NAMESPACE={static.namespace};K8S_POD_NAME={static.name}"
            f";K8S_POD_UID={static.uid};K8S_POD_INFRA_CONTAINER_ID=sb-static"
        )
        res = exec_plugin(plugin, "ADD", config, container="sb-static", args=args)
        assert res.returncode == 0, res
        assert res.json is not None and res.json["ips"][0]["address"].startswith("10.77.0."), res
    finally:
        agent.kill()


def test_static_pod_found_by_its_hash_in_the_agents_cache_and_live_reads(kube: KubeApi) -> None:
    """The agent-scoped source finds the static pod by its hash in its cache and by a
    direct read; `listed` (the sticky takeover's question) says it exists while its
    mirror pod does; the live confirmation before a free does not call it gone."""
    static = StaticPod(kube, "static-find")
    source = kube.source(node=static.node)
    wait_for(
        lambda: source.pods.available and source.pods.get(static.mirror_uid) is not None,
        "the agent's cache to hold the mirror pod",
    )
    ns, name = static.namespace, static.name
    assert source._cached_pod(static.uid) is not None  # from the cache, no GET
    assert source.meta(ns, name, static.uid).owner_kind == ""
    assert source.listed(ns, name, static.uid) is True
    elsewhere = kube.source(node=kube.name("elsewhere"))  # not in its cache: a GET
    wait_for(lambda: elsewhere.pods.available, "the other agent's list")
    assert elsewhere.listed(ns, name, static.uid) is True
    assert elsewhere.meta(ns, name, static.uid).namespace_annotations == {}
    assert not source.confirm_pod_gone(ns, name, static.uid).confirmed
    assert not source.confirm_pod_terminal(ns, name, static.uid).confirmed
    static.delete_mirror()
    assert elsewhere.listed(ns, name, static.uid) is False
    assert source.confirm_pod_gone(ns, name, static.uid).confirmed


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite://{tmp_path}/ipward.db"
    run_cli("pool", "create", "pods", "--range", POOL_RANGE, store=url, check=True)
    with open_store(url) as s:
        yield s


def allocate(store: Store, node: str, pod: PodInfo) -> str:
    """A record of `pod` on `node`, made an hour ago (long past the ADD grace), its node
    registered as by its agent (a node whose agent is down waits for it): its key."""
    now = time.time()
    registration = NodeRegistration(node, 1, now, now, 60.0).encode()
    store.txn([], [Put(keys.node_key(node), registration)])
    ledger = Ledger(store, node, clock=lambda: time.time() - 3600)
    ledger.allocate([ledger.get_pool("pods")], Attachment("net", "sb-static", "eth0"), pod)
    (kv,) = store.range(keys.ADDRESSES)[0]
    return kv.key


def test_controller_gc_keeps_a_running_static_pod_then_frees_it_once_its_mirror_pod_is_gone(
    kube: KubeApi, store: Store
) -> None:
    """The controller's garbage collection on `k8s://`: the record of a running static
    pod is kept, pass after pass (it was freed as pod-gone: the API lists no pod of its
    UID). Once the mirror pod is deleted, its change reaches the record (the incremental
    pass judges again the records of the pods that changed) and the record is freed,
    pod-gone, on the second pass."""
    static = StaticPod(kube, "static-gc")
    key = allocate(store, static.node, static.info)
    source = kube.source()
    wait_for(
        lambda: not source.problems() and static.mirror_uid in source.cluster_view().pods,
        "the controller's view to list the mirror pod",
    )
    election = Election(store, "static", ttl=600)
    election.campaign()
    controller = Controller(
        store,
        election,
        Metrics("static", lambda: True),
        interval=3600,
        ready_delay=3600,
        liveness=source,
        add_grace=1.0,
    )
    try:
        for _ in range(3):
            assert controller.gc_pass(source) == []
            assert controller.collection.verdict_of(key) is None
        assert [kv.key for kv in store.range(keys.ADDRESSES)[0]] == [key]
        static.delete_mirror()
        wait_for(
            lambda: static.mirror_uid not in source.cluster_view().pods,
            "the view to drop the mirror pod",
        )
        assert controller.gc_pass(source) == []  # found: the first pass
        assert controller.collection.verdict_of(key) == gc.POD_GONE
        (freed,) = controller.gc_pass(source)
        assert (freed.key, freed.reason) == (key, gc.POD_GONE)
        assert store.range(keys.ADDRESSES)[0] == []
    finally:
        controller.view.close()


def test_a_mirror_pods_annotation_is_checked_as_the_real_server_does(kube: KubeApi) -> None:
    """The test server answers like kube-apiserver 1.26: a mirror pod names its node,
    and its annotation is never added, changed or removed (422 Invalid)."""
    ns, node = kube.name("mirror-rules"), kube.name("n1")
    kube.admin.namespace(ns)
    body = {
        "metadata": {"name": "unbound", "annotations": {MIRROR_ANNOTATION: "h1"}},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/pause:1"}]},
    }
    with pytest.raises(ApiError) as unbound:
        kube.client.request("POST", f"/api/v1/namespaces/{ns}/pods", body=body)
    assert (unbound.value.status, unbound.value.reason) == (422, "Invalid")
    assert unbound.value.message == (
        f'Pod "unbound" is invalid: metadata.annotations[{MIRROR_ANNOTATION}]: Invalid value:'
        ' "h1": must set spec.nodeName if mirror pod annotation is set'
    )
    kube.admin.pod(ns, "mirror", node, annotations={MIRROR_ANNOTATION: "h1"})
    kube.admin.pod(ns, "plain", node)
    for name, value, what in (
        ("plain", "h1", "may not add"),
        ("mirror", "h2", "may not remove or update"),
        ("mirror", None, "may not remove or update"),
    ):
        with pytest.raises(ApiError) as refused:
            kube.admin.annotate_pod(ns, name, {MIRROR_ANNOTATION: value})
        assert (refused.value.status, refused.value.reason) == (422, "Invalid")
        assert refused.value.message == (
            f'Pod "{name}" is invalid: metadata.annotations[{MIRROR_ANNOTATION}]: Forbidden:'
            f" {what} mirror pod annotation"
        )
        (cause,) = refused.value.body["details"]["causes"]
        assert cause["field"] == f"metadata.annotations[{MIRROR_ANNOTATION}]"
    kube.admin.annotate_pod(ns, "mirror", {"ipward.io/pool": "p"})  # other annotations may


def test_sim_source_finds_a_static_pod_by_its_mirror_pod(tmp_path: Path, store: Store) -> None:
    """The simulated cluster's state carries a pod's annotations as the API does: a
    mirror pod there is the static pod's too, for the ADD (`ClusterDirectory`) and for
    the controller's incremental collection, which judges the record again when the
    mirror pod goes (a walk of the two views, not the reflector's log)."""
    state = tmp_path / "state.json"
    mirror = Pod(
        uid="mirror-uid",
        namespace="kube-system",
        name="static-web-n1",
        phase="Running",
        node="n1",
        annotations={MIRROR_ANNOTATION: "hash-1"},
    )

    def publish(pods: list[Pod]) -> None:
        cluster = {"pods": pods, "nodes": ["n1"], "namespaces": {"kube-system": {}}}
        write_sim_state(str(state), time.time(), cluster, {})

    publish([mirror])
    source = SimFileSource(str(state))
    directory = ClusterDirectory(source)
    assert directory.meta("kube-system", "static-web-n1", "hash-1").annotations == {
        MIRROR_ANNOTATION: "hash-1"
    }
    assert directory.listed("kube-system", "static-web-n1", "hash-1")
    key = allocate(store, "n1", PodInfo("kube-system", "static-web-n1", "hash-1"))
    view = StoreView(store, Metrics("sim-static", lambda: True))
    collection = Collection(view, Ledger(store, "test"), Metrics("sim-gc", lambda: True), "t", 1.0)
    try:
        assert collection.look(source).judged == 1
        assert collection.verdict_of(key) is None
        publish([mirror])  # the same pods again: new objects, nothing to judge
        assert collection.look(source).judged == 0
        publish([])
        seen = collection.look(source)
        assert seen.judged == 1 and collection.verdict_of(key) == gc.POD_GONE
        assert not directory.listed("kube-system", "static-web-n1", "hash-1")
    finally:
        view.close()
