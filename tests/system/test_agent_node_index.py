"""The agent's copy of its node's index (`ipward.agent.node_index`) on real stores
(SQLite and a real etcd): it follows the node's entries through allocations, frees and
direct writes, holds no other node's, reads whole again when its watch stream breaks or
the store goes down, and refuses a pass while it has no copy."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.agent.metrics import Metrics
from ipward.agent.node_index import NodeIndex
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreUnreachable, open_backend, schema
from ipward.store.base import Delete, Put
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

NODE = "n1"


@pytest.fixture(params=["sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite://{tmp_path}/s.db"
    if request.param == "etcd":
        url = request.getfixturevalue("etcd").url
    with open_backend(url) as s:
        s.txn([], [Delete(kv.key) for kv in s.range("")[0]])  # the module's etcd: start empty
        schema.ensure(s, url, create=True)
        yield s


@pytest.fixture
def pool(store: Store) -> PoolSpec:
    spec = PoolSpec.from_dict({"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]]})
    store.txn([], [Put(keys.pool_key("p"), rec.encode(spec.to_dict()))])
    return spec


@pytest.fixture
def index(store: Store) -> Iterator[tuple[NodeIndex, Metrics]]:
    metrics = Metrics(NODE)
    node_index = NodeIndex(store, NODE, metrics)
    node_index.start()
    try:
        yield node_index, metrics
    finally:
        node_index.stop()


def reads(metrics: Metrics, reason: str) -> float:
    return metrics.node_index_reads.labels(reason=reason)._value.get()


def copy_of(index: NodeIndex) -> dict[str, tuple[int, bytes]]:
    return {h.ref: (h.mod_revision, h.record.encode()) for h in index.held()}


def stored(store: Store) -> dict[str, tuple[int, bytes]]:
    """The node's entries as the store has them, whose records hold a sandbox."""
    out = {}
    for kv in store.range(keys.node_ips_prefix(NODE))[0]:
        _, pool, ip = keys.node_ip_parts(kv.key)
        record = rec.AddressRecord.decode(kv.value)
        if not record.is_detached:
            out[rec.pool_ip(pool, ip)] = (kv.mod_revision, record.encode())
    return out


def churn(store: Store, pool: PoolSpec, rng: random.Random, steps: int) -> None:
    """Allocations and frees on this node and another, through the ledger."""
    ledgers = {node: Ledger(store, node) for node in (NODE, "n2")}
    held: list[tuple[str, rec.Attachment]] = []
    for step in range(steps):
        if held and rng.random() < 0.4:
            node, attachment = held.pop(rng.randrange(len(held)))
            ledgers[node].free(attachment)
        else:
            node = rng.choice(sorted(ledgers))
            attachment = rec.Attachment("net", f"c{rng.random():.9f}", "eth0")
            pod = rec.PodInfo("ns", f"pod{step}", f"uid{step}")
            ledgers[node].allocate([pool], attachment, pod)
            held.append((node, attachment))


def churned(store: Store, pool: PoolSpec, index: NodeIndex, rng: random.Random, steps: int) -> None:
    """`churn`, then wait until the copy holds all of it."""
    churn(store, pool, rng, steps)
    wait_for(lambda: follows(store, index), f"the copy to follow {steps} steps of churn")


def follows(store: Store, index: NodeIndex) -> bool:
    try:
        return copy_of(index) == stored(store)
    except StoreUnreachable:
        return False


def refused(index: NodeIndex) -> bool:
    try:
        index.held()
    except StoreUnreachable:
        return True
    return False


def test_the_copy_follows_the_nodes_entries_and_holds_no_others(
    store: Store, pool: PoolSpec, index: tuple[NodeIndex, Metrics]
) -> None:
    node_index, metrics = index
    rng = random.Random(1)
    churned(store, pool, node_index, rng, 60)
    assert len(node_index.held()) > 5
    assert {h.node for h in node_index.held()} == {NODE}
    # An entry rewritten in place (as `ipward migrate` writes them) and one removed.
    first, second = sorted(store.range(keys.node_ips_prefix(NODE))[0], key=lambda kv: kv.key)[:2]
    store.txn([], [Put(first.key, second.value), Delete(second.key)])
    wait_for(lambda: follows(store, node_index), "the copy to follow a rewrite and a delete")
    assert reads(metrics, "start") == 1
    assert reads(metrics, "broken") == reads(metrics, "compacted") == 0


def test_a_broken_watch_stream_makes_the_copy_read_whole(
    store: Store, pool: PoolSpec, index: tuple[NodeIndex, Metrics]
) -> None:
    node_index, metrics = index
    rng = random.Random(2)
    churned(store, pool, node_index, rng, 10)
    assert node_index.follower._watch is not None
    node_index.follower._watch.cancel()  # the stream ends under it, as a lost connection would
    churn(store, pool, rng, 20)  # written while nobody follows
    wait_for(lambda: reads(metrics, "broken") == 1, "the copy to be read whole again")
    wait_for(lambda: follows(store, node_index), "the copy to hold what was written meanwhile")


def test_no_pass_is_served_before_the_copy_is_read(store: Store) -> None:
    node_index = NodeIndex(store, NODE, Metrics(NODE))
    with pytest.raises(StoreUnreachable, match="not read yet"):
        node_index.held()


@pytest.mark.parametrize("store", ["etcd"], indirect=True)
def test_the_store_down_refuses_passes_until_the_copy_is_read_again(
    etcd: EtcdServer, store: Store, pool: PoolSpec, index: tuple[NodeIndex, Metrics]
) -> None:
    node_index, metrics = index
    rng = random.Random(3)
    churned(store, pool, node_index, rng, 10)
    etcd.kill()
    try:
        wait_for(lambda: refused(node_index), "passes to be refused")
        with pytest.raises(StoreUnreachable, match=f"node index of {NODE}: "):
            node_index.held()
    finally:
        etcd.restart()
    churned(store, pool, node_index, rng, 10)  # read again, then followed
    assert reads(metrics, "broken") >= 1
