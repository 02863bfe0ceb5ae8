"""Node names are checked wherever one enters: the CNI config's `node`, `ipward agent
--node`, and the records the controller judges (a name no node can have is never
"gone"). Store keys are split on '/', so a '/' in a node name would corrupt them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipward.cluster.liveness import ClusterView, Pod
from ipward.core.names import MAX_NODE_NAME, node_name_problem
from ipward.core.records import AddressRecord
from ipward.gc import rules as gc
from ipward.store import open_store
from ipward_lab.fleet import run_cli
from support import exec_plugin

BAD_NAMES = ["a/b", "../n1", "node 1", "n1\n", "n\x01", "-n1", "n1.", "x" * (MAX_NODE_NAME + 1)]
GOOD_NAMES = ["n1", "node-1.example.com", "Node_1", "x" * MAX_NODE_NAME]


def test_the_rule() -> None:
    assert [n for n in BAD_NAMES if node_name_problem(n) is None] == []
    assert [n for n in GOOD_NAMES if node_name_problem(n) is not None] == []


def dump(url: str) -> dict:
    with open_store(url) as store:
        kvs, revision = store.range("")
    return {"revision": revision, **{kv.key: kv.value for kv in kvs}}


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_cni_configs_node_is_checked(plugin: Path, sqlite_url: str, name: str) -> None:
    run_cli("pool", "create", "web", "--range", "10.9.0.0/24", store=sqlite_url, check=True)
    before = dump(sqlite_url)
    config = {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": sqlite_url, "pool": "web", "node": name},
    }
    out = exec_plugin(plugin, "ADD", config)
    assert out.returncode == 1 and out.json["code"] == 7, out
    assert "ipam.node" in out.json["msg"]
    assert dump(sqlite_url) == before


def test_a_good_node_name_is_recorded(plugin: Path, sqlite_url: str) -> None:
    run_cli("pool", "create", "web", "--range", "10.9.0.0/24", store=sqlite_url, check=True)
    config = {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": sqlite_url, "pool": "web", "node": "Node_1.lab"},
    }
    assert exec_plugin(plugin, "ADD", config).returncode == 0
    rows = json.loads(run_cli("--json", "alloc", "list", store=sqlite_url, check=True).stdout)
    assert [r["node"] for r in rows] == ["Node_1.lab"]
    assert run_cli("check", store=sqlite_url).returncode == 0


@pytest.mark.parametrize("name", ["a/b", "n 1", ""])
def test_the_agents_node_is_checked(tmp_path: Path, sqlite_url: str, name: str) -> None:
    sock = tmp_path / "agent.sock"
    proc = run_cli(
        "agent", "--node", name, "--socket", str(sock), "--metrics-address", "off", store=sqlite_url
    )
    assert proc.returncode == 2 and "--node" in proc.stderr, proc
    assert not sock.exists()
    assert not Path(sqlite_url[len("sqlite://") :]).exists()  # refused before opening it


def test_a_record_naming_an_impossible_node_is_never_node_gone() -> None:
    """A record written before names were checked, node "n1/x": the cluster does not list
    such a node and no agent registers it, but that proves nothing about its pod, which
    is alive. A record of a real node gone is still a candidate."""
    t0 = 1_000_000.0
    record = {
        "network": "net",
        "container": "sb1",
        "ifname": "eth0",
        "pod": {"namespace": "ns", "name": "web-0", "uid": "u1", "infra_container": "sb1"},
        "node": "n1/x",
        "block": "10.0.0.0/26",
        "created_at": t0,
    }
    live = Pod(uid="u1", namespace="ns", name="web-0", phase="Running", node="n1")
    cluster = ClusterView(t0 + 600, {"u1": live}, frozenset({"n1"}))
    evidence = gc.Evidence(10.0, {}, cluster, frozenset({"n1"}))
    live_record = gc.Held("p", "10.0.0.5", 7, AddressRecord.from_dict(record))
    assert gc.judge(live_record, evidence).reason is None
    gone = gc.Held("p", "10.0.0.6", 8, AddressRecord.from_dict({**record, "node": "n2"}))
    assert gc.judge(gone, evidence).reason == gc.NODE_GONE
