"""The garbage-collection rules (`ipward.gc`) record by record, then the two-pass
confirmation and the compare-and-delete on a real SQLite store, and the simulated
cluster's file source (`ipward gc` as a subprocess: `tests/system/test_gc_command.py`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ipward.cluster.liveness import (
    ClusterView,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    Pod,
    Sandbox,
)
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.store.base import Put
from ipward_lab.simcluster import SimFileSource, write_sim_state

GRACE = 10.0
T0 = 1_000_000.0  # the ADD of every record below


def held(
    container: str = "sb1",
    node: str = "n1",
    uid: str = "u1",
    name: str = "web-0",
    created_at: float = T0,
    revision: int = 7,
) -> gc.Held:
    record = {
        "network": "net",
        "container": container,
        "ifname": "eth0",
        "pod": {"namespace": "ns", "name": name, "uid": uid, "infra_container": container},
        "node": node,
        "block": "10.0.0.0/26",
        "created_at": created_at,
    }
    return gc.Held("p", "10.0.0.5", revision, AddressRecord.from_dict(record))


def runtime(*sandboxes: Sandbox, as_of: float = T0 + 60, node: str = "n1") -> NodeView:
    return NodeView(node, as_of, {s.id: s for s in sandboxes})


def cluster(*pods: Pod, as_of: float = T0 + 60, nodes: tuple[str, ...] = ("n1",)) -> ClusterView:
    return ClusterView(as_of, {p.uid: p for p in pods}, frozenset(nodes))


def pod(uid: str = "u1", phase: str = "Running", **kw: object) -> Pod:
    return Pod(uid=uid, namespace="ns", name="web-0", phase=phase, node="n1", **kw)  # type: ignore[arg-type]


def evidence(
    node: NodeView | str = "runtime unreachable",
    cluster_view: ClusterView | str = "cluster unreachable",
    registered: tuple[str, ...] = ("n1",),
    runtimes: tuple[str, ...] = (),
) -> gc.Evidence:
    """`runtimes`: nodes whose agent judges by its runtime; given, in cluster mode."""
    return gc.Evidence(
        GRACE,
        {"n1": node},
        cluster_view,
        frozenset(registered),
        frozenset(runtimes),
        agents=bool(runtimes),
    )


READY = Sandbox("sb1", ready=True, namespace="ns", name="web-0", uid="u1")
STOPPED = Sandbox("sb1", ready=False, namespace="ns", name="web-0", uid="u1")
OTHER = Sandbox("sb2", ready=True, namespace="ns", name="web-0", uid="u2")


@pytest.mark.parametrize(
    ("ev", "reason"),
    [
        pytest.param(evidence(runtime(OTHER)), gc.SANDBOX_GONE, id="runtime-lists-no-sandbox"),
        pytest.param(evidence(runtime(READY), cluster()), None, id="sandbox-ready"),
        pytest.param(
            evidence(runtime(READY), cluster(pod(uid="u9"))), None, id="ready-beats-pod-gone"
        ),
        pytest.param(evidence(runtime(OTHER, as_of=T0 + 5)), None, id="runtime-view-within-grace"),
        pytest.param(evidence(), None, id="no-source-answered"),
        pytest.param(evidence(cluster_view=cluster()), gc.POD_GONE, id="no-pod-with-uid"),
        pytest.param(
            evidence(cluster_view=cluster(pod(uid="u2"))), gc.POD_GONE, id="same-name-other-uid"
        ),
        pytest.param(evidence(cluster_view=cluster(pod())), None, id="pod-running"),
        pytest.param(evidence(cluster_view=cluster(as_of=T0 + 3)), None, id="cluster-view-lagging"),
        pytest.param(
            evidence(cluster_view=cluster(pod(phase="Succeeded", finished_at=T0 + 20, grace=30))),
            gc.POD_TERMINAL,
            id="terminal-past-its-grace",
        ),
        pytest.param(
            evidence(cluster_view=cluster(pod(phase="Failed", finished_at=T0 + 50, grace=30))),
            None,
            id="terminal-within-its-grace",
        ),
        pytest.param(
            evidence(runtime(STOPPED), cluster(pod(phase="Succeeded", finished_at=T0, grace=1))),
            gc.POD_TERMINAL,
            id="stopped-sandbox-terminal-pod",
        ),
        pytest.param(
            evidence(runtime(STOPPED), cluster(pod())), None, id="stopped-sandbox-running-pod"
        ),
        pytest.param(evidence(runtime(STOPPED)), None, id="stopped-sandbox-no-cluster"),
        pytest.param(
            evidence(cluster_view=cluster(pod(), nodes=()), registered=()),
            gc.NODE_GONE,
            id="node-lease-expired-and-not-listed",
        ),
        pytest.param(
            evidence(cluster_view=cluster(pod(), nodes=())), None, id="node-still-registered"
        ),
        pytest.param(
            evidence(cluster_view=cluster(pod()), registered=()), None, id="node-still-listed"
        ),
        pytest.param(
            evidence(cluster_view=cluster(), runtimes=("n1",)),
            None,
            id="pod-gone-on-a-node-whose-agent-judges-by-its-runtime",
        ),
        pytest.param(
            evidence(
                cluster_view=cluster(pod(phase="Succeeded", finished_at=T0, grace=1)),
                runtimes=("n1",),
            ),
            gc.POD_TERMINAL,
            id="terminal-pod-on-a-node-whose-agent-judges-by-its-runtime",
        ),
        pytest.param(
            evidence(runtime(OTHER), cluster(), runtimes=("n1",)),
            gc.SANDBOX_GONE,
            id="that-agent-with-its-runtime-view",
        ),
        pytest.param(
            evidence(cluster_view=cluster(), runtimes=("n2",)),
            gc.POD_GONE,
            id="pod-gone-on-a-node-whose-agent-has-no-runtime",
        ),
    ],
)
def test_judge(ev: gc.Evidence, reason: str | None) -> None:
    verdict = gc.judge(held(), ev)
    assert verdict.reason == reason, verdict.evidence
    assert verdict.evidence


def test_record_without_pod_uid_needs_the_runtime() -> None:
    anonymous = held(uid="")
    assert gc.judge(anonymous, evidence(cluster_view=cluster())).reason is None
    assert gc.judge(anonymous, evidence(runtime())).reason == gc.SANDBOX_GONE


class FixedSource(LivenessSource):
    def __init__(self, view: NodeView) -> None:
        self.view = view

    def node_view(self, node: str) -> NodeView:
        return self.view

    def cluster_view(self) -> ClusterView:
        raise LivenessUnavailable("no cluster here")


def test_runtime_with_two_ready_sandboxes_for_one_pod_is_not_evidence() -> None:
    twin = Sandbox("sb3", ready=True, namespace="ns", name="web-1", uid="u7")
    twin2 = Sandbox("sb4", ready=True, namespace="ns", name="web-1", uid="u7")
    ev = gc.gather(FixedSource(runtime(twin, twin2)), ["n1"], grace=GRACE)
    assert isinstance(ev.nodes["n1"], str) and "untrusted" in ev.nodes["n1"]
    assert gc.judge(held(), ev).reason is None  # sb1 absent, yet nothing is judged gone


def test_confirmation_needs_two_passes_at_one_revision() -> None:
    ev = evidence(runtime())
    c = gc.Confirmations()
    first = gc.judge(held(), ev)
    assert c.confirm([first]) == []
    assert c.confirm([first]) == [first]
    # A new revision (the address changed hands) starts over.
    moved = gc.judge(held(revision=9), ev)
    assert c.confirm([moved]) == []
    # A pass where it is not a candidate breaks the run.
    kept = gc.judge(held(revision=9), evidence(runtime(READY)))
    assert c.confirm([kept]) == []
    assert c.confirm([moved]) == []


def make_pool(store) -> PoolSpec:
    spec = PoolSpec.from_dict({"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]], "cooldown": 0})
    store.txn([], [Put(keys.pool_key(spec.name), rec.encode(spec.to_dict()))])
    return spec


def test_free_compares_the_revision_judged(sqlite_store) -> None:
    spec = make_pool(sqlite_store)
    ledger = Ledger(sqlite_store, "n1", clock=lambda: T0)
    a = rec.Attachment("net", "sb1", "eth0")
    ip = ledger.allocate([spec], a, rec.PodInfo("ns", "web-0", "u1"))[0].ip
    stale = gc.snapshot(sqlite_store)[0]
    # The pod's DEL frees it and another pod takes the same address.
    ledger.free(a)
    b = rec.Attachment("net", "sb2", "eth0")
    ledger.allocate([spec], b, rec.PodInfo("ns", "web-1", "u2"), requested=[ip])
    verdict = gc.judge(stale, evidence(runtime(OTHER)))
    assert verdict.reason == gc.SANDBOX_GONE
    assert gc.free(ledger, verdict, "test") is False
    now = gc.snapshot(sqlite_store)
    assert [(h.ip, h.container) for h in now] == [(ip, "sb2")]
    fresh = gc.judge(now[0], evidence(runtime(READY, as_of=T0 + 60)))
    assert fresh.reason == gc.SANDBOX_GONE  # sb2 not listed in this made-up view
    assert gc.free(ledger, fresh, "test") is True
    assert gc.snapshot(sqlite_store) == []
    assert sqlite_store.get(b.key_on("n1")) is None


def publish(path: Path, pods: list[Pod], sandboxes: list[Sandbox], as_of: float) -> None:
    write_sim_state(
        str(path),
        as_of,
        {"pods": pods, "nodes": ["n1"], "statefulsets": {}},
        {"n1": {"sandboxes": sandboxes}},
    )


def test_sim_file_source_round_trip_and_faults(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    source = SimFileSource(str(path), timeout=0.2)
    with pytest.raises(LivenessUnavailable):
        source.node_view("n1")  # nothing published yet: unavailable, not empty
    assert all(isinstance(v, str) for v in source.node_views(["n1", "n2"]).values())
    publish(path, [pod()], [READY], 123.0)
    view = source.node_view("n1")
    assert view.as_of == 123.0 and view.sandboxes == {"sb1": READY}
    assert source.cluster_view().pods == {"u1": pod()}
    with pytest.raises(LivenessUnavailable) as unreachable:
        source.node_view("n2")  # not published: its runtime cannot be reached
    # Many nodes at once answer as each alone does, from one read of the file.
    assert source.node_views(["n1", "n2"]) == {"n1": view, "n2": str(unreachable.value)}
    state = json.loads(path.read_text())
    state["runtimes"]["n1"] = {"fail": "connection refused"}
    state["cluster"] = {"stall_until": time.time() + 60}
    path.write_text(json.dumps(state))
    with pytest.raises(LivenessUnavailable, match="connection refused"):
        source.node_view("n1")
    started = time.monotonic()
    with pytest.raises(LivenessUnavailable, match="no answer"):
        source.cluster_view()
    assert time.monotonic() - started >= 0.2
