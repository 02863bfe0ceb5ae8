"""The node index (`nodeips/<node>/<pool>/<ip>`) on real stores: written and deleted in
the transactions of the records it names (fresh and combined ADDs, DEL, release, a
sticky address taken over on another node, CNI plugin processes racing), reported by
`ipward check` when it is out of step and fixed by `--remove-orphans`, and what an
agent's reconciliation reads: its node's records only, whatever the cluster holds."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ipward.agent.reconcile import Reconciler
from ipward.agent.server import Agent
from ipward.cluster.liveness import Sandbox
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from ipward.store import schema
from ipward.store.base import Delete, KeyValue, Put, Watch
from ipward.store.sqlite import SqliteStore
from ipward_lab.fleet import run_cli
from ipward_lab.simcluster import SimFileSource, write_sim_state
from ipward_lab.waiting import wait_for
from support import exec_plugin

NET = "net"


@pytest.fixture
def pool(sqlite_store) -> PoolSpec:
    spec = PoolSpec.from_dict(
        {
            "name": "p",
            "ranges": [[{"subnet": "10.0.0.0/16"}], [{"subnet": "fd00::/64"}]],
            "blockSize": {"4": 26},
        }
    )
    sqlite_store.txn([], [Put(keys.pool_key("p"), rec.encode(spec.to_dict()))])
    return spec


def attachment(name: str) -> rec.Attachment:
    return rec.Attachment(NET, name, "eth0")


def pod(name: str) -> rec.PodInfo:
    return rec.PodInfo("ns", name, f"uid-{name}")


def index(store) -> dict[str, list[str]]:
    """The node index as stored: node -> sorted "<pool>/<ip>"."""
    out: dict[str, list[str]] = {}
    for kv in store.range(keys.node_ips_prefix())[0]:
        node, pool, ip = keys.node_ip_parts(kv.key)
        out.setdefault(node, []).append(rec.pool_ip(pool, ip))
    return {node: sorted(refs) for node, refs in out.items()}


def recorded(store) -> dict[str, list[str]]:
    """The records' nodes: node -> sorted "<pool>/<ip>"."""
    out: dict[str, list[str]] = {}
    for kv in store.range(keys.ips_prefix())[0]:
        record = rec.AddressRecord.decode(kv.value)
        out.setdefault(record.node, []).append(rec.pool_ip(*keys.ip_parts(kv.key)))
    return {node: sorted(refs) for node, refs in out.items()}


def kinds(store) -> list[str]:
    return sorted(p.kind for p in check(store)[0])


def test_every_write_of_a_record_keeps_its_node_entry(sqlite_store, pool) -> None:
    one, two = Ledger(sqlite_store, "n1"), Ledger(sqlite_store, "n2")
    one.allocate([pool], attachment("a"), pod("a"))
    one.allocate([pool], attachment("b"), pod("b"), requested=["10.0.9.9"])
    with ThreadPoolExecutor(8) as workers:  # combined into batches by the ledger
        list(
            workers.map(lambda i: two.allocate([pool], attachment(f"c{i}"), pod(f"c{i}")), range(8))
        )
    assert index(sqlite_store) == recorded(sqlite_store)
    assert len(index(sqlite_store)["n2"]) == 16  # dual stack
    one.free(attachment("a"))
    held = rec.decode(sqlite_store.get(keys.ip_key("p", "10.0.9.9")).value)
    revision = sqlite_store.get(keys.ip_key("p", "10.0.9.9")).mod_revision
    one.free_address("p", "10.0.9.9", revision, "test")
    assert held["node"] == "n1"
    assert index(sqlite_store) == recorded(sqlite_store)
    assert "n1" not in index(sqlite_store) or all(
        "10.0.9.9" not in r for r in index(sqlite_store)["n1"]
    )
    assert kinds(sqlite_store) == []


def test_a_sticky_address_taken_over_on_another_node_moves_its_entry(sqlite_store, pool) -> None:
    identity = rec.Sticky(NET, "db", "db-0")
    first = Ledger(sqlite_store, "n1").allocate(
        [pool], attachment("s1"), rec.PodInfo("db", "db-0", "u1"), sticky=identity
    )
    Ledger(sqlite_store, "n1").free(attachment("s1"))  # detached: still n1's
    assert sorted(index(sqlite_store)["n1"]) == sorted(f"p/{a.ip}" for a in first)
    Ledger(sqlite_store, "n2").allocate(
        [pool], attachment("s2"), rec.PodInfo("db", "db-0", "u2"), sticky=identity
    )
    assert index(sqlite_store) == {"n2": sorted(f"p/{a.ip}" for a in first)}
    assert index(sqlite_store) == recorded(sqlite_store)
    assert kinds(sqlite_store) == []
    gone = Ledger(sqlite_store, "n2").free(attachment("s2"))
    key = keys.sticky_key(NET, "db", "db-0")
    Ledger(sqlite_store, "n2").free_sticky(key, sqlite_store.get(key).mod_revision, "test")
    assert gone and index(sqlite_store) == {} and kinds(sqlite_store) == []


def test_check_reports_each_node_index_problem_and_remove_orphans_fixes_them(
    sqlite_url, sqlite_store, pool
) -> None:
    ledger = Ledger(sqlite_store, "n1")
    a, b, c = (ledger.allocate([pool], attachment(n), pod(n))[0].ip for n in ("a", "b", "c"))
    copy_of_b = sqlite_store.get(keys.ip_key("p", b)).value
    sqlite_store.txn(
        [],
        [
            Delete(keys.node_ip_key("n1", "p", a)),  # a record without its entry
            Put(keys.node_ip_key("n1", "p", "10.0.200.1"), copy_of_b),  # without a record
            Put(keys.node_ip_key("n7", "p", b), copy_of_b),  # for another node's record
            Put(keys.node_ip_key("n1", "p", c), copy_of_b),  # a copy that is not its record
        ],
    )
    problems = {(p.kind, p.key) for p in check(sqlite_store)[0]}
    assert problems == {
        ("node-index-missing", keys.ip_key("p", a)),
        ("node-index-dangling", keys.node_ip_key("n1", "p", "10.0.200.1")),
        ("node-index-dangling", keys.node_ip_key("n7", "p", b)),
        ("node-index-stale", keys.node_ip_key("n1", "p", c)),
    }
    assert run_cli("check", store=sqlite_url).returncode == 1
    fixed = run_cli("--json", "check", "--remove-orphans", store=sqlite_url)
    assert fixed.returncode == 0, fixed.stderr
    assert sorted(f["fixed"] for f in json.loads(fixed.stdout)["node_index"]) == [
        "dangling",
        "dangling",
        "missing",
        "stale",
    ]
    assert index(sqlite_store) == recorded(sqlite_store)
    for ip in (a, b, c):
        entry = sqlite_store.get(keys.node_ip_key("n1", "p", ip)).value
        assert entry == sqlite_store.get(keys.ip_key("p", ip)).value


def test_plugin_processes_racing_keep_the_index_in_step(tmp_path: Path, plugin: Path) -> None:
    url = f"sqlite://{tmp_path}/ipward.db"
    config = {
        "cniVersion": "1.0.0",
        "name": NET,
        "ipam": {"type": "ipward", "store": url, "ranges": [[{"subnet": "10.5.0.0/24"}]]},
    }

    def add_then_maybe_del(i: int) -> None:
        out = exec_plugin(plugin, "ADD", config, container=f"c{i}")
        assert out.returncode == 0, out
        if i % 2:
            out = exec_plugin(plugin, "DEL", config, container=f"c{i}")
            assert out.returncode == 0, out

    with ThreadPoolExecutor(8) as workers:
        list(workers.map(add_then_maybe_del, range(24)))
    report = run_cli("--json", "check", store=url)
    assert report.returncode == 0, report.stdout
    store = SqliteStore(f"{tmp_path}/ipward.db", create=False)
    try:
        assert index(store) == recorded(store)
        assert sum(len(refs) for refs in index(store).values()) == 12
    finally:
        store.close()


class ReadCounting(SqliteStore):
    """The real SQLite store, noting every key its reads return."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.read: list[str] = []
        self.watched: list[str] = []  # the prefixes watched

    def get(self, key: str) -> KeyValue | None:
        kv = super().get(key)
        if kv is not None:
            self.read.append(kv.key)
        return kv

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        kvs, revision = super().range(prefix, limit)
        self.read += [kv.key for kv in kvs]
        return kvs, revision

    def watch(self, prefix: str, start_revision: int) -> Watch:
        self.watched.append(prefix)
        return super().watch(prefix, start_revision)


def copied(reconciler: Reconciler, store: SqliteStore) -> None:
    """Wait until the reconciler's copy of the node's index has every write so far (the
    last write is always to its node's entries here)."""
    wait_for(lambda: reconciler.index.revision >= store.revision(), "the node index's copy")


def test_reconciliation_reads_none_of_other_nodes_records(tmp_path: Path, pool, sqlite_url) -> None:
    store = ReadCounting(sqlite_url[len("sqlite://") :])
    schema.ensure(store, sqlite_url, create=False)
    others = [Ledger(store, f"other{n}") for n in range(4)]
    for n, ledger in enumerate(others):
        for i in range(10):
            ledger.allocate([pool], attachment(f"o{n}-{i}"), pod(f"o{n}-{i}"))
    mine = Ledger(store, "n1")
    for name in ("live", "gone"):
        mine.allocate([pool], attachment(name), pod(name))
    live = Sandbox("live", ready=True, namespace="ns", name="live", uid="uid-live")
    state = tmp_path / "state.json"
    cluster = {"pods": [], "nodes": ["n1"], "statefulsets": {}}
    write_sim_state(str(state), time.time() + 3600, cluster, {"n1": {"sandboxes": [live]}})
    agent = Agent(store, "n1", str(tmp_path / "agent.sock"))
    try:
        reconciler = Reconciler(agent, SimFileSource(str(state)), grace=0.0, interval=60)
        store.read.clear()
        reconciler.index.start()
        copied(reconciler, store)
        freed = reconciler.run_once()
        read = set(store.read)
        assert store.watched == [keys.node_ips_prefix("n1")]
        assert freed is not None
        assert sorted(v.held.container for v in freed) == ["gone", "gone"]  # dual stack
        their_records = {
            keys.ip_key(*rec.split_pool_ip(ref))
            for node, refs in recorded(store).items()
            if node != "n1"
            for ref in refs
        }
        assert len(their_records) == 80
        assert not their_records & read
        assert not [k for k in read if k.startswith(keys.node_ips_prefix()) and "/n1/" not in k]
        # The record decides, not its copy: an entry saying the live sandbox's address
        # is another (unlisted) sandbox's frees nothing ...
        ip = mine.lookup(attachment("live"))[0].ip
        record = rec.AddressRecord.decode(store.get(keys.ip_key("p", ip)).value)
        record.container = "elsewhere"
        store.txn([], [Put(keys.node_ip_key("n1", "p", ip), record.encode())])
        # ... and an entry written after its record (as `ipward migrate` builds them)
        # still frees a gone sandbox's address, at the record's own revision.
        late = mine.allocate([pool], attachment("late"), pod("late"))[0].ip
        record_kv = store.get(keys.ip_key("p", late))
        store.txn([], [Put(keys.node_ip_key("n1", "p", late), record_kv.value)])
        copied(reconciler, store)
        freed = reconciler.run_once()
        assert freed is not None
        assert sorted(v.held.container for v in freed) == ["late", "late"]  # dual stack
        assert store.get(keys.ip_key("p", ip)) is not None
        assert store.get(keys.ip_key("p", late)) is None
    finally:
        reconciler.index.stop()
        agent.close(wait=True)
