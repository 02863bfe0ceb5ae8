"""The controller's store view (`ipward.controller.view`) on real stores (SQLite, and a
real etcd from `servers.etcd`): after random writes it equals a fresh whole read; a
compaction under its watch, a broken stream and its timer make it read whole, and it is
right after; a record rewritten while the view lags is not freed (the compare-and-delete
on the revision it read fails) and the next sync sees the new record."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.controller.metrics import Metrics
from ipward.controller.view import StoreView
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, BlockRecord, FillRecord, ReservationRecord
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.store import Store, open_backend
from ipward.store.base import Delete, Put
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path}/s.db"
    else:
        url = request.getfixturevalue("etcd").url
    with open_backend(url) as s:
        # Each test on the module's etcd starts from an empty keyspace.
        s.txn([], [Delete(kv.key) for kv in s.range("")[0]])
        yield s


def rereads(metrics: Metrics, reason: str) -> float:
    return metrics.view_rereads.labels(reason=reason)._value.get()


def view_of(store: Store, **options: float) -> tuple[StoreView, Metrics]:
    metrics = Metrics("test", lambda: True)
    return StoreView(store, metrics, **options), metrics  # type: ignore[arg-type]


def contents(view: StoreView) -> dict:
    """Everything the view holds, comparably."""
    pools = {
        pool: (
            {cidr: (kv.mod_revision, block.encode()) for cidr, (kv, block) in p.blocks.items()},
            {b: n for b, n in p.records.items() if n},
            dict(p.fills),
        )
        for pool, p in view.pool_keys.items()
    }
    return {
        "pools": {name: kv.mod_revision for name, kv in view.pools.items()},
        "pool_keys": {k: v for k, v in pools.items() if any(v)},
        "records": {k: (h.mod_revision, h.record.encode()) for k, h in view.records.items()},
        "reservations": {k: r.mod_revision for k, r in view.reservations.items()},
        "registered": set(view.registered),
        "affinity": dict(view.affinity),
    }


def fresh(store: Store) -> dict:
    view, _ = view_of(store)
    try:
        view.sync()
        return contents(view)
    finally:
        view.close()


def record(node: str, block: str, container: str) -> bytes:
    attachment = rec.Attachment("net", container, "eth0")
    pod = rec.PodInfo("ns", f"pod-{container}", f"uid-{container}")
    return AddressRecord.new(attachment, pod, node, block, 1_000.0, 1).encode()


def random_op(rng: random.Random) -> Put | Delete:
    """A put (sometimes unreadable) or a delete, of a small set of keys of every prefix
    the view reads and of one it does not."""
    node = f"n{rng.randrange(3)}"
    cidr = f"10.0.{rng.randrange(4)}.0/26"
    pool = f"p{rng.randrange(2)}"
    choices = [
        (keys.ip_key(pool, f"10.0.0.{rng.randrange(12)}"), record(node, cidr, f"c{rng.random()}")),
        (keys.block_key(pool, cidr), BlockRecord.claimed(node, rng.randrange(5), 1).encode()),
        (keys.affinity_key(pool, node, cidr), b"{}"),
        (f"{keys.FILL}{pool}/4/{node}", FillRecord(cidr).encode()),
        (keys.pool_key(pool), b"{}"),
        (
            f"{keys.STICKY}net/ns/web-{rng.randrange(3)}",
            ReservationRecord(["10.0.0.9"], "", "u", node, "", "", 60.0, None, 1.0).encode(),
        ),
        (f"{keys.NODES}{node}", b"{}"),
        (f"{keys.ATTACHMENTS}net/c{rng.randrange(3)}/eth0", b"{}"),  # not read by the view
    ]
    key, value = rng.choice(choices)
    if rng.random() < 0.3:
        return Delete(key)
    if rng.random() < 0.05:
        value = b"not json"  # left out of the view, as a fresh read leaves it out
    return Put(key, value)


def random_writes(store: Store, rng: random.Random, count: int) -> None:
    for _ in range(count):
        ops: dict[str, Put | Delete] = {}
        for _ in range(rng.choice((1, 1, 3))):  # some transactions change several keys
            op = random_op(rng)
            ops[op.key] = op
        store.txn([], list(ops.values()))


@pytest.mark.parametrize("seed", [1, 2])
def test_the_view_equals_a_fresh_read_after_random_writes(store: Store, seed: int) -> None:
    rng = random.Random(seed)
    view, metrics = view_of(store)
    try:
        view.sync()
        for _ in range(8):
            random_writes(store, rng, rng.randrange(1, 40))
            revision = view.sync()
            assert revision >= store.revision()
            assert contents(view) == fresh(store)
        assert view.records  # the writes did reach every kind of key
        assert any(p.blocks for p in view.pool_keys.values())
        assert rereads(metrics, "start") == 1
        assert rereads(metrics, "broken") == rereads(metrics, "compacted") == 0
    finally:
        view.close()


def test_records_per_block_follow_puts_deletes_and_moves(store: Store) -> None:
    view, _ = view_of(store)
    try:
        view.sync()
        a, b = keys.ip_key("p", "10.0.0.2"), keys.ip_key("p", "10.0.0.3")
        store.txn([], [Put(a, record("n1", "10.0.0.0/26", "c1")), Put(b, record("n1", "x", "c2"))])
        view.sync()
        assert dict(view.pool("p").records) == {"10.0.0.0/26": 1, "x": 1}
        store.txn([], [Put(b, record("n1", "10.0.0.0/26", "c2"))])  # the same key, another block
        view.sync()
        assert dict(view.pool("p").records) == {"10.0.0.0/26": 2}
        store.txn([], [Delete(a), Delete(b)])
        view.sync()
        assert dict(view.pool("p").records) == {}
    finally:
        view.close()


def etcd_compact(server: EtcdServer, revision: int) -> None:
    subprocess.run(
        ["etcdctl", f"--endpoints={server.endpoint}", "compaction", str(revision)],
        check=True,
        capture_output=True,
    )


def test_a_compaction_under_a_lagging_watch_makes_the_view_read_whole(
    etcd: EtcdServer,
) -> None:
    with open_backend(etcd.url) as store:
        store.txn([], [Delete(kv.key) for kv in store.range("")[0]])
        view, metrics = view_of(store, max_pending=5)
        try:
            view.sync()
            rng = random.Random(3)
            random_writes(store, rng, 30)  # more events than the view may hold for a pass
            wait_for(lambda: not view.receiving, "the watch to stop, too far ahead")
            random_writes(store, rng, 5)  # after it stopped: only the store's history has them
            etcd_compact(etcd, store.revision())
            view.sync()
            assert rereads(metrics, "compacted") == 1
            assert contents(view) == fresh(store)
            random_writes(store, rng, 10)  # and it follows the store again
            view.sync()
            assert contents(view) == fresh(store)
            assert rereads(metrics, "compacted") == 1
        finally:
            view.close()


def test_a_watch_that_falls_behind_resumes_where_it_was(store: Store) -> None:
    view, metrics = view_of(store, max_pending=5)
    try:
        view.sync()
        random_writes(store, random.Random(4), 30)
        wait_for(lambda: not view.receiving, "the watch to stop, too far ahead")
        view.sync()  # resumed from its revision: the history is there
        assert contents(view) == fresh(store)
        assert sum(rereads(metrics, r) for r in ("compacted", "broken", "timer")) == 0
    finally:
        view.close()


def test_a_broken_watch_stream_makes_the_view_read_whole(store: Store) -> None:
    view, metrics = view_of(store)
    try:
        view.sync()
        assert view.follower._watch is not None
        view.follower._watch.cancel()  # the stream ends under the view, as a lost connection would
        random_writes(store, random.Random(5), 10)
        view.sync()
        assert rereads(metrics, "broken") == 1
        assert contents(view) == fresh(store)
    finally:
        view.close()


def test_the_timer_makes_the_view_read_whole(store: Store) -> None:
    now = [0.0]
    view, metrics = view_of(store, reread_every=600.0, monotonic=lambda: now[0])  # type: ignore[arg-type]
    try:
        view.sync()
        random_writes(store, random.Random(6), 5)
        now[0] = 599.0
        view.sync()
        assert rereads(metrics, "timer") == 0
        now[0] = 600.0
        view.sync()
        assert rereads(metrics, "timer") == 1
        assert contents(view) == fresh(store)
    finally:
        view.close()


def test_a_record_rewritten_while_the_view_lags_is_not_freed(tmp_path: Path) -> None:
    with open_backend(f"sqlite://{tmp_path}/s.db") as store:
        spec = PoolSpec.from_dict(
            {"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]], "cooldown": 0}
        )
        store.txn([], [Put(keys.pool_key(spec.name), rec.encode(spec.to_dict()))])
        ledger = Ledger(store, "n1")
        first = rec.Attachment("net", "sb1", "eth0")
        ip = ledger.allocate([spec], first, rec.PodInfo("ns", "web-0", "u1"))[0].ip
        view, _ = view_of(store)
        try:
            view.sync()
            (stale,) = view.held()
            # While the view lags: the pod's DEL, and another pod takes the same address.
            ledger.free(first)
            second = rec.Attachment("net", "sb2", "eth0")
            ledger.allocate([spec], second, rec.PodInfo("ns", "web-1", "u2"), requested=[ip])
            verdict = gc.Verdict(stale, gc.SANDBOX_GONE, "sb1 not listed")
            assert gc.free(ledger, verdict, "test") is False
            kv = store.get(keys.ip_key("p", ip))
            assert kv is not None and AddressRecord.decode(kv.value).container == "sb2"
            view.sync()  # the next pass sees the new record, at its new revision
            (now,) = view.held()
            assert (now.container, now.mod_revision) == ("sb2", kv.mod_revision)
        finally:
            view.close()


def test_a_forgotten_view_holds_nothing_and_reads_whole_again(store: Store) -> None:
    view, metrics = view_of(store)
    try:
        random_writes(store, random.Random(7), 20)
        view.sync()
        assert view.records
        view.forget()  # the controller stepped down
        assert (view.revision, view.records, view.pool_keys, view.receiving) == (0, {}, {}, False)
        random_writes(store, random.Random(8), 5)
        view.sync()
        assert rereads(metrics, "start") == 2
        assert contents(view) == fresh(store)
    finally:
        view.close()


def test_a_watch_batch_holds_whole_transactions(store: Store) -> None:
    """What lets a pass never see part of a transaction: each batch ends at a revision's
    end, on both stores."""
    start = store.revision() + 1
    for i in range(20):
        store.txn([], [Put(f"{keys.NODES}n{i}-{k}", b"{}") for k in range(3)])
    watch = store.watch("", start)
    seen: dict[int, int] = {}
    try:
        for batch in watch.batches():
            for event in batch:
                seen[event.kv.mod_revision] = seen.get(event.kv.mod_revision, 0) + 1
            assert seen[batch[-1].kv.mod_revision] == 3  # the batch's last revision is whole
            if len(seen) == 20:
                break
    finally:
        watch.cancel()
    assert sorted(seen.values()) == [3] * 20
