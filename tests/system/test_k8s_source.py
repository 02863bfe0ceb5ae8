"""The Kubernetes source (`k8s://`) against the loopback test API server and, when
KUBE_APISERVER names it, the real kube-apiserver (the `kube` fixture); faults only
against the test server (`kube_server`). Nothing is timed: every wait is for a
condition."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from ipward.cluster.k8s import reflector
from ipward.cluster.k8s.reflector import BACKOFF_MAX, BACKOFF_MIN
from ipward.cluster.liveness import ClusterView, LivenessUnavailable, NotCovered
from ipward.core.errors import TryAgainLater
from ipward.core.records import AddressRecord, Attachment, PodInfo
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.store import open_store
from ipward_lab.fleet import run_cli
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.servers.pki import token_kubeconfig
from ipward_lab.waiting import wait_for


def view_or_none(source: Any) -> ClusterView | None:
    try:
        return source.cluster_view()  # type: ignore[no-any-return]
    except LivenessUnavailable:
        return None


def why_unavailable(source: Any) -> str:
    try:
        source.cluster_view()
    except LivenessUnavailable as e:
        return str(e)
    return ""


def wait_view(source: Any, condition: Any, what: str) -> ClusterView:
    def check() -> ClusterView | None:
        view = view_or_none(source)
        return view if view is not None and condition(view) else None

    return wait_for(check, what)  # type: ignore[no-any-return]


def wait_watching(kube_server: KubeApi, source: Any, after: int = 0) -> None:
    """Until the test server has the watch of every resource of `source` among its
    requests from the `after`th on (a stream cut from then on reaches each)."""

    def watched() -> set[str]:
        requests = list(kube_server.server.requests)[after:]
        return {p.split("?")[0] for _, p, _ in requests if "watch=1" in p}

    paths = {r.resource.path for r in source.reflectors}
    wait_for(lambda: paths <= watched(), "a watch of every resource")


def mine(view: ClusterView, namespace: str) -> dict[str, Any]:
    """The view's pods of one namespace, by name."""
    return {p.name: p for p in view.pods.values() if p.namespace == namespace}


def test_initial_list_is_paged_and_complete(kube: KubeApi) -> None:
    ns, node = kube.name("paged"), kube.name("n1")
    kube.admin.namespace(ns)
    kube.admin.node(node)
    uids = {kube.admin.pod(ns, f"p{i}", node) for i in range(7)}
    before = time.time()
    source = kube.source("page=2")
    view = wait_view(source, lambda v: True, "the first list")
    assert {p.uid for p in mine(view, ns).values()} == uids
    assert node in view.nodes
    assert view.as_of >= before - 1  # the time its list was sent, not older
    assert source.pods.lists == 1
    if kube.server is not None:
        continued = [p for m, p, _ in kube.server.requests if "continue=" in p and "/pods" in p]
        assert len(continued) >= 3  # 7 pods and more, 2 a page


def test_view_contents(kube: KubeApi) -> None:
    ns, other = kube.name("shop"), kube.name("plain")
    n1, n2 = kube.name("n1"), kube.name("n2")
    kube.admin.namespace(ns, {"ipward.io/pool": "shop-pool", "example.com/x": "dropped"})
    kube.admin.namespace(other)
    kube.admin.node(n1)
    kube.admin.node(n2)
    kube.admin.statefulset(ns, "db", 2)
    db0 = kube.admin.pod(ns, "db-0", n1, owner=("StatefulSet", "db"), grace=45)
    web = kube.admin.pod(
        ns,
        "web",
        n2,
        owner=("ReplicaSet", "web-5d2aa"),
        annotations={"ipward.io/pool": "web-pool", "ipward.io/sticky": "true", "other": "x"},
    )
    job = kube.admin.pod(other, "job", n2, owner=("Job", "job"))
    failed = kube.admin.pod(other, "failed", n1)
    kube.admin.pod_phase(ns, "db-0", "Running", "2026-11-24T05:18:50Z")
    kube.admin.pod_phase(other, "job", "Succeeded", "2026-11-24T05:20:00Z")
    kube.admin.pod_phase(other, "failed", "Failed", "2026-11-24T05:21:30Z")
    kube.admin.delete_pod(ns, "web", grace=20)  # graceful: only marked, no kubelet here

    source = kube.source()
    view = wait_view(source, lambda v: True, "the first list")
    pods = {**mine(view, ns), **mine(view, other)}
    assert {p.uid for p in pods.values()} == {db0, web, job, failed}
    d = pods["db-0"]
    assert (d.owner_kind, d.owner_name, d.phase, d.node, d.grace) == (
        "StatefulSet",
        "db",
        "Running",
        n1,
        45.0,
    )
    assert d.deleted_at is None and d.finished_at is None and not d.terminal
    w = pods["web"]
    assert (w.owner_kind, w.owner_name, w.node) == ("ReplicaSet", "web-5d2aa", n2)
    assert w.annotations == {"ipward.io/pool": "web-pool", "ipward.io/sticky": "true"}
    assert w.grace == 20.0  # the deletion's grace
    assert w.deleted_at is not None and abs(w.deleted_at - time.time()) < 600  # asked now
    j = pods["job"]
    assert j.terminal and j.finished_at == 1795497600.0  # 2026-11-24T05:20:00Z
    f = pods["failed"]
    assert f.phase == "Failed" and f.finished_at == 1795497690.0
    assert {n1, n2} <= view.nodes
    assert view.statefulsets[f"{ns}/db"] == 2
    assert view.namespaces[ns] == {"ipward.io/pool": "shop-pool"}
    assert view.namespaces[other] == {}
    # No sandboxes from the API: each node's answer says why, many at once as one alone.
    with pytest.raises(LivenessUnavailable) as one:
        source.node_view(n1)
    assert source.node_views([n1, n2]) == {n1: str(one.value), n2: str(one.value)}


def test_could_not_list_is_unavailable_never_empty(kube: KubeApi, tmp_path: Any) -> None:
    """401 and 403: the source answers LivenessUnavailable with the reason, for as long
    as it cannot list; GC on it keeps everything."""
    ns, node = kube.name("auth"), kube.name("n1")
    kube.admin.namespace(ns)
    kube.admin.node(node)
    kube.admin.pod(ns, "p", node)
    for token, reason in (("wrong-token", "401"), ("nobody-token", "403")):
        config = _kubeconfig(kube, tmp_path / f"{token}.yaml", token=token)
        source = kube.source(kubeconfig=config)
        wait_for(lambda s=source, r=reason: r in why_unavailable(s), f"a {reason}")
        assert source.pods.lists == 0
        evidence = gc.gather(source, [], grace=0)
        assert isinstance(evidence.cluster, str) and reason in evidence.cluster


def test_unavailable_until_the_first_list_completes(kube_server: KubeApi) -> None:
    kube_server.admin.namespace("a")
    kube_server.server.slow(1.0)  # every answer waits: the first list is not done at once
    source = kube_server.source()
    with pytest.raises(LivenessUnavailable, match="not listed yet"):
        source.cluster_view()
    assert "Kubernetes pods: not listed yet" in source.unavailable()  # an agent's /healthz
    kube_server.server.slow(0)
    view = wait_view(source, lambda v: True, "the first list")
    assert "a" in view.namespaces
    assert source.unavailable() is None


def test_events_update_the_view(kube: KubeApi) -> None:
    ns, n1, n2 = kube.name("ev"), kube.name("n1"), kube.name("n2")
    kube.admin.namespace(ns)
    kube.admin.node(n1)
    opened = time.time()
    source = kube.source("margin=0")
    first = wait_view(source, lambda v: n1 in v.nodes, "the first list")
    assert opened <= first.as_of <= time.time()  # when the list was sent
    added = time.time()
    uid = kube.admin.pod(ns, "p", n1)
    view = wait_view(source, lambda v: uid in v.pods, "the ADDED pod")
    # The pods' as_of moved to the event's receipt; the view takes its oldest resource.
    assert first.as_of <= view.as_of <= time.time()
    assert added <= source.pods.snapshot()[1] <= time.time()
    kube.admin.pod_phase(ns, "p", "Failed", "2026-11-24T05:21:30Z")
    wait_view(source, lambda v: v.pods[uid].terminal, "the MODIFIED pod")
    kube.admin.delete_pod(ns, "p", grace=0)
    wait_view(source, lambda v: uid not in v.pods, "the DELETED pod")
    again = kube.admin.pod(ns, "p", n1)  # same name, another pod
    view = wait_view(source, lambda v: again in v.pods, "the new pod of that name")
    assert [p.uid for p in view.pods_named(ns, "p")] == [again]
    kube.admin.node(n2)
    kube.admin.delete_node(n1)
    wait_view(source, lambda v: n2 in v.nodes and n1 not in v.nodes, "the node events")
    kube.admin.statefulset(ns, "db", 3)
    wait_view(source, lambda v: v.statefulsets.get(f"{ns}/db") == 3, "the StatefulSet")
    kube.admin.scale(ns, "db", 1)
    wait_view(source, lambda v: v.statefulsets.get(f"{ns}/db") == 1, "the scale down")
    kube.admin.delete_statefulset(ns, "db")
    wait_view(source, lambda v: f"{ns}/db" not in v.statefulsets, "the deleted StatefulSet")
    kube.admin.annotate_namespace(ns, {"ipward.io/pool": "later"})
    wait_view(source, lambda v: v.namespaces[ns] == {"ipward.io/pool": "later"}, "annotation")
    assert source.pods.lists == 1  # all of it by watch, no relist


def test_expired_watch_relists_and_finds_a_deletion_made_while_away(
    kube_server: KubeApi,
) -> None:
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    gone = api.pod("ns", "gone", "n1")
    stays = api.pod("ns", "stays", "n1")
    source = kube_server.source()
    wait_view(source, lambda v: gone in v.pods, "the first list")
    server.stall()  # the watch hears nothing from here
    api.delete_pod("ns", "gone", grace=0)
    server.expire_history()  # the deletion's event is out of the window
    expired = time.time()
    server.unstall()  # the open watch gets ERROR 410
    view = wait_view(source, lambda v: source.pods.lists == 2, "the relist")
    assert gone not in view.pods and stays in view.pods
    assert source.pods.snapshot()[1] >= expired  # as of the relist, not of the old list


def test_the_pods_cache_names_what_changed_since_a_view(
    kube_server: KubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pods' cache logs its events: a later view names exactly the pods added,
    changed and deleted since an earlier one, from that log; after a relist, or once
    more keys changed than it keeps, the log does not know (None) and the views are
    compared pod by pod, which still finds the change."""
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    changed, deleted, kept = (api.pod("ns", name, "n1") for name in ("a", "b", "c"))
    source = kube_server.source()
    first = wait_view(source, lambda v: kept in v.pods, "the first list")
    api.pod_phase("ns", "a", "Failed", "2026-11-24T05:21:30Z")
    api.delete_pod("ns", "b", grace=0)
    added = api.pod("ns", "d", "n1")
    later = wait_view(
        source,
        lambda v: added in v.pods and deleted not in v.pods and v.pods[changed].terminal,
        "the events",
    )
    assert source.pods.changed_since(first.pods_mark) == {changed, deleted, added}
    assert later.changed_since(first) == ({changed, deleted, added}, set())
    assert later.changed_since(later) == (set(), set())
    server.stall()  # the watch hears nothing from here
    api.delete_pod("ns", "d", grace=0)
    server.expire_history()  # the deletion's event is out of the window
    server.unstall()  # the open watch gets ERROR 410: a relist
    relisted = wait_view(source, lambda v: source.pods.lists == 2, "the relist")
    assert source.pods.changed_since(later.pods_mark) is None
    assert relisted.changed_since(later) == ({added}, set())
    monkeypatch.setattr(reflector, "CHANGES_KEPT", 1)
    api.pod_phase("ns", "c", "Succeeded", "2026-11-24T05:21:30Z")
    api.delete_pod("ns", "a", grace=0)  # two keys changed: the first is no longer kept
    last = wait_view(source, lambda v: changed not in v.pods, "both events")
    assert source.pods.changed_since(relisted.pods_mark) is None
    assert last.changed_since(relisted) == ({kept, changed}, set())


def test_expired_continue_token_starts_the_list_over(kube_server: KubeApi) -> None:
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    uids = {api.pod("ns", f"p{i}", "n1") for i in range(6)}
    server.slow(0.3)  # room to expire between two pages
    source = kube_server.source("page=2")
    wait_for(lambda: any("continue=" in p for _, p, _ in server.requests), "a second page")
    server.expire_history()
    server.slow(0)
    view = wait_view(source, lambda v: True, "the list")
    assert {p.uid for p in view.pods.values()} == uids
    firsts = [
        p for _, p, _ in server.requests if p.startswith("/api/v1/pods?") and "continue" not in p
    ]
    assert len([p for p in firsts if "watch" not in p]) >= 2  # started over


@pytest.mark.parametrize("inside_a_chunk", [False, True], ids=["between-chunks", "inside-a-chunk"])
def test_cut_stream_relists(kube_server: KubeApi, inside_a_chunk: bool) -> None:
    """A stream cut (a dropped connection, a proxy's idle cut) is not a clean end: what
    was in flight may be lost, so the source lists again rather than watching on."""
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    source = kube_server.source()
    wait_view(source, lambda v: "n1" in v.nodes, "the first list")
    wait_watching(kube_server, source)
    server.stall()
    uid = api.pod("ns", "while-cut", "n1")
    server.cut_streams(inside_a_chunk)  # no last chunk: a broken stream
    server.unstall()
    view = wait_view(source, lambda v: source.pods.lists == 2, "the relist")
    assert uid in view.pods


def test_a_quiet_resource_is_heard_at_each_clean_end(kube_server: KubeApi) -> None:
    """Nothing changes: the server sends no bookmark (nor does the real one), but ends
    each watch cleanly at its timeoutSeconds, which the source asks at most half its
    staleness bound: the source stays available and its as_of moves on, with no relist."""
    kube_server.admin.node("n1")
    source = kube_server.source("stale=4", "margin=0")
    listed = wait_view(source, lambda v: "n1" in v.nodes, "the first list").as_of

    def moved_on() -> bool:
        return source.cluster_view().as_of > listed + 4  # raises once unavailable

    wait_for(moved_on, "the view's as_of to move past two clean ends")
    assert all(r.lists == 1 for r in source.reflectors)
    watches = [p for _, p, _ in kube_server.server.requests if "watch=1" in p]
    assert watches and all("timeoutSeconds=2&" in f"{p}&" for p in watches)


def test_a_watch_ended_before_its_timeout_is_not_heard(kube_server: KubeApi) -> None:
    """A proxy (or a server shutting down) ends every watch cleanly after 0.3 s, not at
    the timeoutSeconds asked: that proves nothing about what was in flight. The quiet
    source is not heard from, goes stale, and lists again instead of watching on."""
    kube_server.admin.node("n1")
    kube_server.server.end_watches_after(0.3)
    source = kube_server.source("stale=4")
    wait_view(source, lambda v: "n1" in v.nodes, "the first list")
    wait_for(lambda: source.nodes.lists >= 2, "a relist once the source went stale")


@pytest.mark.parametrize(
    "line",
    [
        b"{not json",
        b'{"type":"MODIFIED","object":{"metadata":{"resourceVersion":"1","name":"x"}}}',
        b'{"type":"SURPRISE","object":{"metadata":{"resourceVersion":"999999"}}}',
        b'{"type":"ERROR","object":{"kind":"Status","code":500,"reason":"InternalError"}}',
        b'{"type":"ADDED"}',
    ],
    ids=["garbage", "gap", "unknown-type", "error-500", "no-object"],
)
def test_bad_event_relists(kube_server: KubeApi, line: bytes) -> None:
    """Anything the watch cannot follow: list again, replace the cache whole."""
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    source = kube_server.source()
    wait_view(source, lambda v: "n1" in v.nodes, "the first list")
    server.stall()
    server.store.delete("nodes", "", "n1")  # held back from the watches
    server.inject(line)
    server.unstall()
    view = wait_view(source, lambda v: all(r.lists >= 2 for r in source.reflectors), "relists")
    assert "n1" not in view.nodes


def test_server_down_is_unavailable_and_frees_nothing_then_relists(kube_server: KubeApi) -> None:
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    api.node("n1")
    deleted = api.pod("ns", "deleted-while-down", "n1")
    source = kube_server.source()
    wait_view(source, lambda v: deleted in v.pods, "the first list")
    server.go_down()
    wait_for(lambda: view_or_none(source) is None, "the source to notice")
    record = {"network": "net", "container": "c9", "ifname": "eth0", "node": "n1"}
    record.update(created_at=0.0, pod={"uid": "x"})
    held = gc.Held("p", "10.0.0.9", 7, AddressRecord.from_dict(record))
    evidence = gc.gather(source, [], grace=0)
    assert isinstance(evidence.cluster, str)
    assert gc.judge(held, evidence).reason is None  # nothing may be freed
    server.store.delete("pods", "ns", "deleted-while-down", 0)
    server.come_back()
    view = wait_view(source, lambda v: deleted not in v.pods, "the relist after the server is back")
    assert source.pods.lists >= 2 and "n1" in view.nodes


def test_backoff_starts_over_once_the_server_works_again(kube_server: KubeApi) -> None:
    """Down, the server is asked less and less often (the delay doubles up to
    BACKOFF_MAX); back, a list and the watch after it started: the next failure is
    retried after BACKOFF_MIN again, not after the longest delay reached while it was
    down. The resource is quiet: no event or bookmark marks the recovery."""
    server = kube_server.server
    kube_server.admin.node("n1")
    source = kube_server.source()
    nodes = source.nodes
    wait_for(lambda: nodes.available, "the first list")
    server.go_down()
    wait_for(lambda: nodes.retry_delay == BACKOFF_MAX, "the longest delay", timeout=120)
    lists, requests = nodes.lists, len(server.requests)
    server.come_back()
    wait_for(lambda: nodes.lists > lists, "the list once the server is back")
    wait_watching(kube_server, source, requests)  # every resource watched again
    server.cut_streams()
    wait_for(lambda: nodes.lists > lists + 1, "the relist after the cut")
    assert nodes.retry_delay == BACKOFF_MIN


def test_a_watch_refused_at_once_does_not_start_the_backoff_over(kube_server: KubeApi) -> None:
    """Lists answered, every watch refused in its first line (ERROR 410): the list and
    watch did not start, so the server is asked less and less often, not relisted in a
    tight loop."""
    kube_server.admin.node("n1")
    kube_server.server.refuse_watches()
    source = kube_server.source()
    wait_for(lambda: source.nodes.retry_delay == BACKOFF_MAX, "the longest delay", timeout=120)
    assert source.nodes.lists >= 5  # each list answered, each watch refused


def test_stale_when_nothing_arrives(kube_server: KubeApi) -> None:
    """No event and no bookmark for `stale` seconds, the stream still open: unavailable,
    whatever the cache holds; once the stream is given up the source lists again and
    answers."""
    kube_server.admin.node("n1")
    source = kube_server.source("stale=2")
    wait_view(source, lambda v: "n1" in v.nodes, "the first list")
    lists = source.nodes.lists
    kube_server.server.stall()
    wait_for(lambda: "nothing heard" in why_unavailable(source), "the source to call itself stale")
    wait_for(lambda: source.nodes.lists > lists, "the quiet stream to be given up and relisted")
    kube_server.server.unstall()
    wait_view(source, lambda v: "n1" in v.nodes, "the source to answer again")


def test_agent_scope_watches_its_node_only(kube: KubeApi) -> None:
    ns, n1, n2 = kube.name("agent"), kube.name("n1"), kube.name("n2")
    kube.admin.namespace(ns, {"ipward.io/pool": "ns-pool"})
    here = kube.admin.pod(ns, "here", n1, annotations={"ipward.io/pool": "mine"})
    kube.admin.pod(ns, "there", n2)
    source = kube.source(node=n1)
    wait_for(lambda: source.pods.available and source.namespaces.available, "the agent lists")
    pods, _ = source.pods.snapshot()
    assert set(pods) == {here}
    with pytest.raises(NotCovered):
        source.cluster_view()  # a node's pods are not the cluster's: no view
    with pytest.raises(NotCovered):
        source.node_view(n1)
    meta = source.meta(ns, "here", here)
    assert meta.annotations == {"ipward.io/pool": "mine"}
    assert meta.namespace_annotations == {"ipward.io/pool": "ns-pool"}
    later = kube.admin.pod(ns, "later", n1)
    wait_for(lambda: source.pods.get(later) is not None, "the watch to bring the new pod")
    if kube.server is not None:
        selectors = {p for _, p, _ in kube.server.requests if p.startswith("/api/v1/pods?")}
        assert selectors and all(f"spec.nodeName%3D{n1}" in p for p in selectors)


def test_metadata_only_for_nodes_and_namespaces(kube: KubeApi) -> None:
    ns, node = kube.name("meta"), kube.name("n1")
    kube.admin.namespace(ns, {"ipward.io/pool": "p"})
    kube.admin.node(node)
    source = kube.source()
    view = wait_view(source, lambda v: node in v.nodes, "the first list")
    assert view.namespaces[ns] == {"ipward.io/pool": "p"}
    if kube.server is not None:
        accepts = {
            (p.split("?")[0], a)
            for _, p, a in kube.server.requests
            if p.startswith(("/api/v1/nodes?", "/api/v1/namespaces?"))
        }
        assert all("as=PartialObjectMetadata" in a for _, a in accepts), accepts
        assert {p for p, _ in accepts} == {"/api/v1/nodes", "/api/v1/namespaces"}


def test_direct_get_for_a_pod_not_cached(kube: KubeApi) -> None:
    """The agent's cache holds its node's pods; a pod it does not hold (another node's,
    or one the watch has not brought yet) is read once before the answer is 11."""
    ns, n1, n2 = kube.name("get"), kube.name("n1"), kube.name("n2")
    kube.admin.namespace(ns)
    elsewhere = kube.admin.pod(ns, "elsewhere", n2, owner=("ReplicaSet", "rs"))
    source = kube.source(node=n1)
    wait_for(lambda: source.pods.available, "the agent's list")
    assert source.pods.get(elsewhere) is None
    meta = source.meta(ns, "elsewhere", elsewhere)
    assert (meta.owner_kind, meta.owner_name) == ("ReplicaSet", "rs")
    assert source.meta(ns, "elsewhere", "").owner_name == "rs"  # no UID: the pod of that name
    with pytest.raises(TryAgainLater, match="not listed yet"):
        source.meta(ns, "nothing-here", "uid-1")
    with pytest.raises(TryAgainLater, match="not listed yet"):
        source.meta(ns, "elsewhere", "another-uid")  # that name is another pod


def test_direct_get_when_the_watch_lags(kube_server: KubeApi) -> None:
    api, server = kube_server.admin, kube_server.server
    api.namespace("ns")
    source = kube_server.source(node="n1")
    wait_for(lambda: source.pods.available, "the agent's list")
    server.stall()  # the watch brings nothing now
    uid = api.pod("ns", "new", "n1", annotations={"ipward.io/pool": "fresh"})
    assert source.pods.get(uid) is None
    assert source.meta("ns", "new", uid).annotations == {"ipward.io/pool": "fresh"}


def test_listed_for_sticky_takeover(kube: KubeApi) -> None:
    ns, node = kube.name("sticky"), kube.name("n1")
    kube.admin.namespace(ns)
    old = kube.admin.pod(ns, "db-0", node)
    source = kube.source(node=kube.name("elsewhere"))  # the old pod is not in its cache
    wait_for(lambda: source.pods.available, "the agent's list")
    assert source.listed(ns, "db-0", old) is True
    kube.admin.delete_pod(ns, "db-0", grace=0)
    assert source.listed(ns, "db-0", old) is False  # NotFound
    kube.admin.pod(ns, "db-0", node)
    assert source.listed(ns, "db-0", old) is False  # the name is another pod now


def test_live_confirmation(kube: KubeApi, tmp_path: Any) -> None:
    ns, node = kube.name("confirm"), kube.name("n1")
    kube.admin.namespace(ns)
    kube.admin.node(node)
    kube.admin.statefulset(ns, "db", 1)
    running = kube.admin.pod(ns, "running", node)
    done = kube.admin.pod(ns, "done", node)
    kube.admin.pod_phase(ns, "done", "Succeeded", "2026-11-24T05:20:00Z")
    replaced = kube.admin.pod(ns, "replaced", node)
    kube.admin.delete_pod(ns, "replaced", grace=30)  # graceful first, as kubectl
    kube.admin.delete_pod(ns, "replaced", grace=0)
    kube.admin.pod(ns, "replaced", node)
    source = kube.source()

    assert source.confirm_pod_gone(ns, "never-was", "u").confirmed
    assert source.confirm_pod_gone(ns, "replaced", replaced).confirmed  # another UID now
    still = source.confirm_pod_gone(ns, "running", running)
    assert not still.confirmed and "Pending" in still.evidence
    assert not source.confirm_pod_terminal(ns, "running", running).confirmed
    assert source.confirm_pod_terminal(ns, "done", done).confirmed
    assert not source.confirm_pod_gone(ns, "done", done).confirmed  # terminal is not gone
    assert source.confirm_node_gone(kube.name("gone-node")).confirmed
    assert not source.confirm_node_gone(node).confirmed
    assert not source.confirm_identity_retired(ns, "running").confirmed
    assert source.confirm_identity_retired(ns, "db-5", "db").confirmed  # ordinal >= 1
    assert not source.confirm_identity_retired(ns, "db-0", "db").confirmed  # in range
    assert source.confirm_identity_retired(ns, "x-0", "x").confirmed  # no such set
    assert source.confirm_identity_retired(ns, "no-pod").confirmed

    # An answer other than a clean one keeps: 403 here.
    refused = kube.source(kubeconfig=_kubeconfig(kube, tmp_path / "n.yaml", "nobody-token"))
    for answer in (
        refused.confirm_pod_gone(ns, "never-was", "u"),
        refused.confirm_pod_terminal(ns, "done", done),
        refused.confirm_node_gone(kube.name("gone-node")),
        refused.confirm_identity_retired(ns, "no-pod"),
    ):
        assert not answer.confirmed and "403" in answer.evidence


def test_live_confirmation_keeps_when_the_server_is_down(kube_server: KubeApi) -> None:
    source = kube_server.source()
    kube_server.server.go_down()
    for answer in (
        source.confirm_pod_gone("ns", "p", "u"),
        source.confirm_node_gone("n1"),
        source.confirm_identity_retired("ns", "p"),
    ):
        assert not answer.confirmed and "no clean answer" in answer.evidence
    with pytest.raises(TryAgainLater):
        source.listed("ns", "p", "u")
    with pytest.raises(TryAgainLater):
        source.meta("ns", "p", "u")


def _kubeconfig(kube: KubeApi, path: Path, token: str) -> Path:
    return token_kubeconfig(path, kube.url, kube.ca_file, token)


def test_gc_judges_on_the_kubernetes_view(kube: KubeApi) -> None:
    """The GC rules read this source's view as they read the simulated cluster's."""
    ns, n1, gone_node = kube.name("gc"), kube.name("n1"), kube.name("gone")
    kube.admin.namespace(ns)
    kube.admin.node(n1)
    running = kube.admin.pod(ns, "running", n1)
    kube.admin.pod_phase(ns, "running", "Running", "2026-11-24T05:18:50Z")
    done = kube.admin.pod(ns, "done", n1)
    kube.admin.pod_phase(ns, "done", "Succeeded", "2026-11-24T05:20:00Z")  # long past grace
    deleted = kube.admin.pod(ns, "deleted", n1)
    kube.admin.delete_pod(ns, "deleted", grace=0)
    source = kube.source()
    view = wait_view(source, lambda v: deleted not in v.pods and done in v.pods, "the view")

    def record(uid: str, node: str = n1) -> gc.Held:
        record = {"network": "net", "container": "c1", "ifname": "eth0", "created_at": 0.0}
        record.update(node=node, pod={"uid": uid})
        return gc.Held("p", "10.0.0.1", 1, AddressRecord.from_dict(record))

    evidence = gc.Evidence(grace=1.0, cluster=view, registered=frozenset({n1}))
    assert gc.judge(record(running), evidence).reason is None
    assert gc.judge(record(done), evidence).reason == gc.POD_TERMINAL
    assert gc.judge(record(deleted), evidence).reason == gc.POD_GONE
    assert gc.judge(record(running, gone_node), evidence).reason == gc.NODE_GONE


def test_a_free_on_the_cached_view_waits_for_the_apis_own_word(
    kube_server: KubeApi, tmp_path: Path
) -> None:
    """GC rule 7: the cached view says node n2 is gone (its watch stalled before the node
    was made), the API has it: a live read keeps the record, on every pass. Once the API
    answers NotFound too, the record is freed."""
    url = f"sqlite://{tmp_path}/ipward.db"
    run_cli("pool", "create", "p", "--range", "10.0.0.0/24", store=url, check=True)
    source = kube_server.source("margin=0")
    source.wait_listed(30)
    with open_store(url) as store:
        ledger = Ledger(store, "n2")
        pod = PodInfo("shop", "web-0", "u-web")
        ledger.allocate([ledger.get_pool("p")], Attachment("net", "sb1", "eth0"), pod)
        added = time.time()
        # An event of each resource: the whole view is heard after the ADD.
        kube_server.admin.namespace("shop")
        kube_server.admin.node("n1")
        kube_server.admin.pod("shop", "other", "n1")
        kube_server.admin.statefulset("shop", "db", 1)
        wait_for(lambda: source.cluster_view().as_of > added, "a view from after the ADD")
        kube_server.server.stall()
        try:
            kube_server.admin.node("n2")  # in the API; the stalled watch does not bring it

            def collect() -> tuple[list[gc.Verdict], list[gc.Verdict]]:
                return gc.collect_once(
                    ledger, source, grace=0, confirm_after=0, who="test", sleep=lambda _: None
                )

            for _ in range(2):
                verdicts, freed = collect()
                assert [v.reason for v in verdicts] == [gc.NODE_GONE] and freed == []
            assert len(gc.snapshot(store)) == 1
            kube_server.admin.delete_node("n2")
            verdicts, freed = collect()
            assert [v.reason for v in freed] == [gc.NODE_GONE]
            assert gc.snapshot(store) == []
        finally:
            kube_server.server.unstall()  # the watches end, the source closes at once


def _records_of(url: str, node: str, pods: dict[str, tuple[str, str]]) -> int:
    """A pool `p` and one record per sandbox of `pods` (sandbox -> (pod name, UID), in
    the namespace of the name before the slash), made now on `node`; the revision."""
    run_cli("pool", "create", "p", "--range", "10.0.0.0/24", store=url, check=True)
    with open_store(url) as store:
        ledger = Ledger(store, node)
        for sandbox, (name, uid) in pods.items():
            namespace, _, pod = name.partition("/")
            ledger.allocate(
                [ledger.get_pool("p")],
                Attachment("net", sandbox, "eth0"),
                PodInfo(namespace, pod, uid),
            )
        return store.revision()


def test_one_shot_gc_waits_for_the_first_list(kube: KubeApi, tmp_path: Path) -> None:
    """Finding (issue 21, 6): `ipward gc --dry-run --all --liveness k8s://...` judged the
    caches before their first list: every record "no evidence: ... not listed yet",
    nothing a candidate, nothing ever freed. A one-shot command waits for the first
    complete list: the gone pod's record is a candidate, the live one's kept, and a run
    frees the first (after the API's own NotFound)."""
    ns, node = kube.name("oneshot"), kube.name("n1")
    kube.admin.namespace(ns)
    kube.admin.node(node)
    alive = kube.admin.pod(ns, "alive", node)
    gone = kube.admin.pod(ns, "gone", node)
    kube.admin.delete_pod(ns, "gone", grace=0)
    url = f"sqlite://{tmp_path}/ipward.db"
    _records_of(url, node, {"sb-alive": (f"{ns}/alive", alive), "sb-gone": (f"{ns}/gone", gone)})
    liveness = ("--liveness", f"k8s://?kubeconfig={kube.kubeconfig}", "--add-grace", "0")
    dry = run_cli("--json", "gc", "--dry-run", "--all", *liveness, store=url)
    assert dry.returncode == 0, dry.stderr
    out = json.loads(dry.stdout)
    assert [(c["pod"], c["reason"]) for c in out["candidates"]] == [(f"{ns}/gone", gc.POD_GONE)]
    assert [(k["pod"], k["evidence"]) for k in out["kept"]] == [
        (f"{ns}/alive", f"pod {ns}/alive Pending")
    ]
    run = run_cli("--json", "gc", *liveness, "--confirm-after", "0", store=url)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["freed"] == [out["candidates"][0]["address"]]


def test_one_shot_gc_names_what_it_could_not_list(kube: KubeApi, tmp_path: Path) -> None:
    """Finding (issue 21, 6): a source that cannot list (a token without rights, a
    server that does not answer) made `ipward gc` judge nothing and exit 0. Now it waits
    `--timeout`, then exits 2 naming each resource it could not list and why; nothing
    changed."""
    node = kube.name("n1")
    url = f"sqlite://{tmp_path}/ipward.db"
    before = _records_of(url, node, {"sb-gone": ("shop/gone", "uid-gone")})
    refused = _kubeconfig(kube, tmp_path / "nobody.yaml", "nobody-token")
    with socket.socket() as closed:  # a port nothing listens on once it is closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    nowhere = tmp_path / "nowhere.yaml"
    nowhere.write_text(
        _kubeconfig(kube, tmp_path / "n.yaml", "admin-token")
        .read_text()
        .replace(kube.url, f"https://127.0.0.1:{port}")
    )
    for kubeconfig, why, dry in (
        (refused, "HTTP 403", ("--dry-run",)),
        (refused, "HTTP 403", ()),
        (nowhere, "Connection refused", ("--dry-run",)),
    ):
        res = run_cli(
            "gc",
            *dry,
            "--liveness",
            f"k8s://?kubeconfig={kubeconfig}",
            "--add-grace",
            "0",
            "--confirm-after",
            "0",
            "--timeout",
            "0.5",
            store=url,
        )
        assert res.returncode == 2 and res.stdout == "", res
        assert "Traceback" not in res.stderr and "within 0.5s" in res.stderr, res.stderr
        for resource in ("pods", "nodes", "namespaces", "statefulsets"):
            assert f"Kubernetes {resource}: could not list" in res.stderr, res.stderr
        assert why in res.stderr, res.stderr
    with open_store(url) as store:
        assert store.revision() == before


def test_release_with_liveness_refuses_a_live_pods_address(kube: KubeApi, tmp_path: Path) -> None:
    """Finding (issue 21, 7): `ipward release --yes` freed a live pod's address without a
    word. With `--liveness` the record is judged as garbage collection judges it: refused
    (exit 2, nothing changed) while the cluster has the pod, saying so; released once
    the pod is gone (after the API's own NotFound). Without `--liveness`, a line on
    stderr says nothing was checked."""
    ns, node = kube.name("release"), kube.name("n1")
    kube.admin.namespace(ns)
    kube.admin.node(node)
    alive = kube.admin.pod(ns, "alive", node)
    gone = kube.admin.pod(ns, "gone", node)
    kube.admin.delete_pod(ns, "gone", grace=0)
    url = f"sqlite://{tmp_path}/ipward.db"
    before = _records_of(
        url, node, {"sb-alive": (f"{ns}/alive", alive), "sb-gone": (f"{ns}/gone", gone)}
    )
    rows = json.loads(run_cli("--json", "alloc", "list", store=url, check=True).stdout)
    ip_of = {r["pod"]["name"]: r["ip"] for r in rows}
    liveness = ("--yes", "--liveness", f"k8s://?kubeconfig={kube.kubeconfig}", "--add-grace", "0")

    refused = run_cli("release", "--pool", "p", "--ip", ip_of["alive"], *liveness, store=url)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused
    assert f"p/{ip_of['alive']} not released: pod {ns}/alive Pending" in refused.stderr
    with open_store(url) as store:
        assert store.revision() == before
    released = run_cli(
        "--json", "release", "--pool", "p", "--ip", ip_of["gone"], *liveness, store=url
    )
    assert released.returncode == 0, released
    assert json.loads(released.stdout)["checked"].startswith(f"{gc.POD_GONE}: cluster has no pod")
    unchecked = run_cli("release", "--pool", "p", "--ip", ip_of["alive"], "--yes", store=url)
    assert unchecked.returncode == 0, unchecked
    assert f"nothing checked that pod {ns}/alive" in unchecked.stderr, unchecked.stderr
    assert json.loads(run_cli("--json", "alloc", "list", store=url).stdout) == []
