"""One conformance suite for every store backend, plus etcd's own failure cases (which
URLs and SQLite files open a store: `tests/unit/test_store_opening.py`).

Tests over the `store` fixture run against each backend. Each test writes only under its
own key prefix (`ns`), so tests sharing the module's etcd server stay independent; the few
that check exact revision steps rely on nothing else writing meanwhile, so a test that
attaches keys to a lease also ends that lease before it returns.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.store import open_backend
from ipward.store.base import (
    DELETE,
    PUT,
    Compare,
    Delete,
    Event,
    Put,
    Store,
    StoreError,
    StoreUnreachable,
    Watch,
    absent,
    at_revision,
)
from ipward_lab.servers.etcd import EtcdServer, etcd_cluster, etcd_server, free_port
from ipward_lab.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["sqlite", "etcd", pytest.param("k8s", marks=pytest.mark.kstore)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/s.db"
    if request.param == "k8s":
        return str(request.getfixturevalue("kube_store_url"))
    return str(request.getfixturevalue("etcd").url)


@pytest.fixture
def own_revisions(store_url: str) -> bool:
    """Whether the store's revisions are its own (SQLite, etcd: every write is the next
    one). The Kubernetes store's are the API server's etcd's, which everything the server
    writes bumps (its own identity lease every 10 s): there a write's revision is only
    later than the one before. What each shape keeps of "one revision per write"."""
    return not store_url.startswith("k8s://")


def step(own: bool, before: int, after: int, n: int = 1) -> bool:
    """`after` is `n` writes past `before`: exactly, or (revisions shared) later."""
    return after == before + n if own else after >= before + n


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with open_backend(store_url) as s:
        yield s


@pytest.fixture
def ns() -> str:
    return f"/t/{uuid.uuid4().hex[:8]}/"


def put(store: Store, key: str, value: bytes, lease: int = 0) -> int:
    result = store.txn([], [Put(key, value, lease)])
    assert result.succeeded
    return result.revision


class Collector:
    """Iterates a watch in a thread, so that the test can wait with a bound."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.events: queue.Queue[Event] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.watch:
                self.events.put(event)
        except BaseException as e:
            self.error = e

    def take(self, n: int, timeout: float = 5.0) -> list[Event]:
        deadline = time.monotonic() + timeout
        return [self.events.get(timeout=max(deadline - time.monotonic(), 0)) for _ in range(n)]

    def wait_iterating(self) -> None:
        """Until its thread is inside the watch's `batches`: iterating, and with nothing
        written, waiting there for events."""

        def in_batches() -> bool:
            frame = sys._current_frames().get(self.thread.ident or 0)
            while frame is not None and frame.f_code.co_name != "batches":
                frame = frame.f_back
            return frame is not None

        wait_for(in_batches, "the watch's iteration in its batches", 10, 0.005)

    def cancel(self, timeout: float = 10.0) -> None:
        self.watch.cancel()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "watch iteration did not end after cancel"


# Keys and values.


def test_get_missing(store: Store, ns: str) -> None:
    assert store.get(ns + "nothing") is None


def test_put_get_versions(store: Store, ns: str) -> None:
    key, value = ns + "k", bytes(range(256))
    rev1 = put(store, key, value)
    kv = store.get(key)
    assert kv is not None
    assert (kv.key, kv.value, kv.version, kv.lease) == (key, value, 1, 0)
    assert kv.create_revision == kv.mod_revision == rev1

    rev2 = put(store, key, b"second")
    kv = store.get(key)
    assert kv is not None
    assert (kv.value, kv.version, kv.create_revision, kv.mod_revision) == (b"second", 2, rev1, rev2)

    # Deleted and written again: a new life, counted afresh.
    assert store.txn([], [Delete(key)]).succeeded
    assert store.get(key) is None
    rev4 = put(store, key, b"third")
    kv = store.get(key)
    assert kv is not None
    assert (kv.version, kv.create_revision, kv.mod_revision) == (1, rev4, rev4)


def test_range_prefix_order_limit(store: Store, ns: str) -> None:
    p = ns + "dir/"
    inside = [p + "a", p + "a/1", p + "b", p + "z", p + "é"]  # é sorts after z as UTF-8 bytes
    outside = [ns + "dir", ns + "dir0", ns + "di", ns + "dis/a"]
    for key in reversed(inside + outside):
        last = put(store, key, key.encode())

    kvs, revision = store.range(p)
    assert [kv.key for kv in kvs] == inside
    assert [kv.value for kv in kvs] == [k.encode() for k in inside]
    assert revision == last == store.revision()
    assert kvs[0] == store.get(p + "a")

    kvs, revision = store.range(p, limit=2)
    assert [kv.key for kv in kvs] == inside[:2]
    assert revision == last

    assert store.range(p + "a/") == ([store.get(p + "a/1")], last)
    assert store.range(ns + "none/") == ([], last)


# Transactions.


def test_txn_compares_each_target_and_operator(store: Store, ns: str) -> None:
    key, out = ns + "k", ns + "out"
    put(store, ns + "other", b"x")  # so that create_revision and mod_revision differ
    put(store, key, b"m")
    put(store, key, b"m")
    kv = store.get(key)
    assert kv is not None and kv.version == 2 and kv.create_revision < kv.mod_revision

    cases: list[tuple[str, str, int | bytes, bool]] = [
        ("value", "==", b"m", True),
        ("value", "==", b"x", False),
        ("value", "!=", b"x", True),
        ("value", "!=", b"m", False),
        ("value", "<", b"n", True),
        ("value", "<", b"m", False),
        ("value", ">", b"l", True),
        ("value", ">", b"m", False),
    ]
    for target in ("version", "create_revision", "mod_revision"):
        actual = getattr(kv, target)
        cases += [
            (target, "==", actual, True),
            (target, "==", actual + 1, False),
            (target, "!=", actual + 1, True),
            (target, "!=", actual, False),
            (target, "<", actual + 1, True),
            (target, "<", actual, False),
            (target, ">", actual - 1, True),
            (target, ">", actual, False),
        ]
    for target, op, operand, expected in cases:
        result = store.txn(
            [Compare(key, target, op, operand)], [Put(out, b"success")], [Put(out, b"failure")]
        )
        got = store.get(out)
        assert got is not None
        assert (result.succeeded, got.value) == (
            expected,
            b"success" if expected else b"failure",
        ), f"{target} {op} {operand!r}"


def test_txn_compares_on_missing_key(store: Store, ns: str) -> None:
    missing = ns + "missing"
    cases: list[tuple[Compare, bool]] = [
        (absent(missing), True),
        (at_revision(missing, 0), True),
        (Compare(missing, "create_revision", "==", 0), True),
        (Compare(missing, "version", ">", 0), False),
        # A missing key has no value: every value compare fails, even "!=".
        (Compare(missing, "value", "==", b""), False),
        (Compare(missing, "value", "!=", b"x"), False),
    ]
    for compare, expected in cases:
        assert store.txn([compare], []).succeeded is expected, compare


def test_txn_all_or_nothing(store: Store, ns: str, own_revisions: bool) -> None:
    a, b, c = ns + "a", ns + "b", ns + "c"
    rev = put(store, a, b"1")

    # One failing compare among holding ones: no success write happens, failure ones do.
    result = store.txn(
        [absent(b), Compare(a, "value", "==", b"nope")],
        [Put(b, b"x"), Put(c, b"x"), Delete(a)],
        [Put(c, b"failed")],
    )
    assert not result.succeeded
    assert step(own_revisions, rev, result.revision)
    assert store.get(b) is None
    kv_a = store.get(a)
    assert kv_a is not None and kv_a.value == b"1" and kv_a.mod_revision == rev
    kv_c = store.get(c)
    assert kv_c is not None and kv_c.value == b"failed"

    # All compares hold: every write, at one revision.
    failed_at = result.revision
    result = store.txn(
        [absent(b), Compare(a, "value", "==", b"1"), at_revision(c, failed_at)],
        [Put(b, b"y"), Put(c, b"y"), Delete(a)],
    )
    assert result.succeeded and step(own_revisions, failed_at, result.revision)
    assert store.get(a) is None
    for key in (b, c):
        kv = store.get(key)
        assert kv is not None and kv.value == b"y" and kv.mod_revision == result.revision


def test_txn_over_keys_of_several_directories_is_one(store: Store, ns: str) -> None:
    """Keys far apart (on the Kubernetes store, in several objects: a transaction of
    locks and a commit): all or nothing, at one revision, its compares held to the end."""
    keys = [ns + f"{d}/k" for d in ("a", "b", "c")]
    assert not store.txn(
        [absent(keys[0]), Compare(keys[2], "value", "==", b"x")], [Put(k, b"1") for k in keys]
    ).succeeded
    assert [store.get(k) for k in keys] == [None, None, None]
    done = store.txn([absent(k) for k in keys], [Put(k, b"1") for k in keys], [Put(keys[0], b"f")])
    assert done.succeeded
    assert {(kv.value, kv.mod_revision) for k in keys if (kv := store.get(k))} == {
        (b"1", done.revision)
    }
    again = store.txn(
        [absent(keys[1])],
        [Put(keys[0], b"2"), Delete(keys[2])],
        [Put(keys[0], b"failed"), Delete(keys[1])],
    )
    assert not again.succeeded
    assert [kv.value if (kv := store.get(k)) else None for k in keys] == [b"failed", None, b"1"]


def test_revision_steps(store: Store, ns: str, own_revisions: bool) -> None:
    rev = store.revision()
    r1 = put(store, ns + "a", b"1")
    assert step(own_revisions, rev, r1) and (r1 == store.revision() or not own_revisions)

    result = store.txn([], [Put(ns + "b", b"1"), Put(ns + "c", b"1"), Delete(ns + "a")])
    assert step(own_revisions, r1, result.revision)
    assert result.revision == store.revision() or not own_revisions
    kvs, at = store.range(ns)
    assert at >= result.revision and (at == result.revision or not own_revisions)
    assert [(kv.key, kv.mod_revision) for kv in kvs] == [
        (ns + "b", result.revision),
        (ns + "c", result.revision),
    ]

    # Nothing written, no new revision: a failed txn without failure writes, a read-only
    # one. (Shared revisions: nothing of this store's changed.)
    assert store.txn([absent(ns + "b")], [Put(ns + "b", b"2")]).revision <= store.revision()
    assert store.txn([absent(ns + "b")], []).revision <= store.revision()
    if own_revisions:
        assert store.revision() == result.revision
    assert [(kv.key, kv.mod_revision) for kv in store.range(ns)[0]] == [
        (ns + "b", result.revision),
        (ns + "c", result.revision),
    ]


def test_delete_missing_key_in_txn(store: Store, ns: str, own_revisions: bool) -> None:
    rev = put(store, ns + "present", b"1")
    result = store.txn([], [Delete(ns + "missing"), Put(ns + "present", b"2")])
    assert result.succeeded and step(own_revisions, rev, result.revision)
    assert store.get(ns + "missing") is None
    assert store.txn([], [Delete(ns + "missing")]).succeeded
    assert store.get(ns + "missing") is None


def test_txn_changing_nothing_makes_no_revision(store: Store, ns: str, own_revisions: bool) -> None:
    """As in etcd: "every write bumps the revision", and deleting only keys that are not
    there writes nothing."""
    rev = put(store, ns + "present", b"1")
    result = store.txn([], [Delete(ns + "missing")])
    assert result.succeeded
    assert result.revision == rev or (not own_revisions and rev <= result.revision)
    assert result.revision == store.revision() or not own_revisions
    kv = store.get(ns + "present")
    assert kv is not None and kv.mod_revision == rev


# Watches.


def test_watch_replays_then_follows(store: Store, ns: str) -> None:
    p = ns + "w/"
    r1 = put(store, p + "a", b"1")
    r2 = put(store, p + "b", b"2")
    r3 = store.txn([], [Delete(p + "a")]).revision
    put(store, ns + "elsewhere", b"x")

    events = Collector(store.watch(p, r1))
    try:
        replay = events.take(3)
        assert [(e.kind, e.kv.key, e.kv.mod_revision) for e in replay] == [
            (PUT, p + "a", r1),
            (PUT, p + "b", r2),
            (DELETE, p + "a", r3),
        ]
        assert replay[0].kv.value == b"1"
        assert (replay[1].kv.value, replay[1].kv.version) == (b"2", 1)
        assert replay[2].kv.value == b""

        put(store, ns + "elsewhere", b"y")  # outside the prefix: not seen
        r5 = put(store, p + "c", b"3")
        r6 = store.txn([], [Put(p + "b", b"22"), Put(p + "d", b"4")]).revision
        live = events.take(3)
        assert [(e.kind, e.kv.key, e.kv.mod_revision) for e in live] == [
            (PUT, p + "c", r5),
            (PUT, p + "b", r6),
            (PUT, p + "d", r6),
        ]
        assert live[1].kv == store.get(p + "b")
        assert events.events.empty() and events.error is None
    finally:
        events.cancel()
    assert events.error is None


def test_a_watch_sees_a_transaction_over_several_directories_at_its_revision(
    store: Store, ns: str
) -> None:
    """A watched prefix's keys of a transaction over several directories come at the
    transaction's revision, in order with what follows; on the Kubernetes store the
    watched object holds them locked while the commit is recorded in another, which the
    watch does not cover."""
    events = Collector(store.watch(ns + "b/", store.revision() + 1))
    try:
        keys = [ns + f"{d}/k" for d in ("a", "b", "c")]
        r1 = store.txn([], [Put(k, b"1") for k in keys]).revision
        assert [(e.kind, e.kv.key, e.kv.mod_revision) for e in events.take(1, 15)] == [
            (PUT, ns + "b/k", r1)
        ]
        r2 = put(store, ns + "b/later", b"2")
        assert [(e.kind, e.kv.key, e.kv.mod_revision) for e in events.take(1)] == [
            (PUT, ns + "b/later", r2)
        ]
    finally:
        events.cancel()
    assert events.error is None


def test_watch_cancel_while_idle(store: Store, ns: str) -> None:
    events = Collector(store.watch(ns, store.revision() + 1))
    events.wait_iterating()
    events.cancel()
    assert events.error is None and events.events.empty()


# Leases.


def test_lease_revoke_deletes_keys(store: Store, ns: str) -> None:
    lease = store.lease_grant(30)
    put(store, ns + "leased", b"1", lease)
    put(store, ns + "kept", b"1")
    kv = store.get(ns + "leased")
    assert kv is not None and kv.lease == lease
    store.lease_revoke(lease)
    assert store.get(ns + "leased") is None
    assert store.get(ns + "kept") is not None
    assert store.lease_keepalive(lease) <= 0


def test_lease_expires_without_keepalive(store: Store, ns: str) -> None:
    lease = store.lease_grant(1)
    put(store, ns + "leased", b"1", lease)
    # etcd raises TTLs below its minimum (1.5 election timeouts, here 2 s) to it.
    wait_for(lambda: store.get(ns + "leased") is None, "the leased key to go", 30)
    assert store.lease_keepalive(lease) <= 0


def test_lease_keepalive(store: Store, ns: str) -> None:
    lease = store.lease_grant(10)
    try:
        put(store, ns + "leased", b"1", lease)
        ttl = store.lease_keepalive(lease)
        assert 0 < ttl <= 10
        assert store.get(ns + "leased") is not None
    finally:
        store.lease_revoke(lease)
    store.lease_revoke(lease)  # already gone: not an error


def test_concurrent_cas_loses_no_update(store: Store, store_url: str, ns: str) -> None:
    """Clients incrementing one counter by compare-and-swap, each with its own store."""
    key, rounds, clients = ns + "counter", 40, 4
    put(store, key, b"0")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with open_backend(store_url) as own:
                for _ in range(rounds):
                    while True:
                        kv = own.get(key)
                        assert kv is not None
                        new = str(int(kv.value) + 1).encode()
                        if own.txn([at_revision(key, kv.mod_revision)], [Put(key, new)]).succeeded:
                            break
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    kv = store.get(key)
    assert kv is not None and int(kv.value) == rounds * clients


# etcd only: durability, failures, clusters, auth, TLS.


def test_etcd_compacted_watch(etcd: EtcdServer, ns: str) -> None:
    with open_backend(etcd.url) as store:
        first = put(store, ns + "a", b"1")
        last = put(store, ns + "a", b"2")
        etcd.etcdctl("compact", str(last))
        with pytest.raises(StoreError, match="compacted"):
            next(iter(store.watch(ns, first)))
        events = Collector(store.watch(ns, last))
        try:
            assert events.take(1)[0].kv.value == b"2"
        finally:
            events.cancel()


def test_etcd_durable_across_sigkill(tmp_path: Path, ns: str) -> None:
    with etcd_server(tmp_path) as server, open_backend(server.url) as store:
        rev = put(store, ns + "k", b"committed")
        server.kill()
        server.start()
        server.wait_ready()
        # The same store object: it reconnects by itself.
        kv = store.get(ns + "k")
        assert kv is not None and (kv.value, kv.mod_revision) == (b"committed", rev)
        assert store.revision() == rev


def test_etcd_unavailable(tmp_path: Path, ns: str) -> None:
    with etcd_server(tmp_path) as server, open_backend(server.url + "?timeout=1") as store:
        rev = put(store, ns + "k", b"1")
        lease = store.lease_grant(60)
        watching = Collector(store.watch(ns, rev))
        assert watching.take(1)[0].kv.mod_revision == rev

        server.stop()
        # An open watch ends with StoreUnreachable rather than waiting for ever.
        wait_for(lambda: not watching.thread.is_alive(), "the open watch to end", 30)
        assert isinstance(watching.error, StoreUnreachable), watching.error
        calls: list[Callable[[], object]] = [
            lambda: store.get(ns + "k"),
            lambda: store.range(ns),
            lambda: put(store, ns + "k", b"2"),
            store.revision,
            lambda: store.lease_grant(5),
            lambda: store.lease_keepalive(lease),
            lambda: store.lease_revoke(lease),
            lambda: next(iter(store.watch(ns, 1))),
        ]
        for call in calls:
            with pytest.raises(StoreUnreachable, match=server.endpoint):
                call()

        # Up again: the next call works at once, though grpc's reconnect backoff has grown.
        server.start()
        server.wait_ready()
        assert put(store, ns + "k", b"3")

        # A member that accepts connections but never answers: the timeout is kept.
        server.pause()
        with pytest.raises(StoreUnreachable, match="may or may not have been applied"):
            put(store, ns + "k", b"4")
        with pytest.raises(StoreUnreachable, match="DEADLINE_EXCEEDED"):
            store.get(ns + "k")
        server.resume()
        kv = store.get(ns + "k")
        # The write that timed out may or may not have been applied.
        assert kv is not None and kv.value in (b"3", b"4")


def write_until_done(store: Store, key: str, value: bytes) -> list[str]:
    """Write, retrying on StoreUnreachable; the errors seen before it went through."""
    errors: list[str] = []

    def written() -> bool:
        try:
            put(store, key, value)
        except StoreUnreachable as e:
            errors.append(str(e))
            raise
        return True

    wait_for(written, f"a write of {key}", 20, 0.1, passing=(StoreUnreachable,))
    return errors


def test_etcd_cluster_failover(tmp_path: Path, ns: str) -> None:
    key = ns + "k"
    with etcd_cluster(tmp_path) as cluster:
        leader = cluster.leader()
        followers = [m for m in cluster.members if m is not leader]
        # The store starts on the first endpoint, then moves along the list.
        order = [followers[0], leader, followers[1]]
        url = "etcd://" + ",".join(m.endpoint for m in order) + "?timeout=2"
        with open_backend(url) as store:
            put(store, key, b"0")

            # The member in use, a follower, dies: the next call moves on to the leader. If
            # grpc has not yet seen the connection close, that write goes out on it and
            # fails with its outcome unknown: one StoreUnreachable, then writes go through.
            cluster.kill(order[0])
            errors = write_until_done(store, key, b"1")
            assert len(errors) <= 1 and all("may or may not" in e for e in errors), errors
            kv = store.get(key)
            assert kv is not None and kv.value == b"1"

            # The member in use now, the leader, dies: writes stop until a new leader is
            # elected among the other two (election timeout 1 s).
            cluster.restart(order[0])
            was_leader = cluster.leader() is order[1]
            cluster.kill(order[1])
            started = time.monotonic()
            errors = write_until_done(store, key, b"2")
            print(
                f"killed member in use (leader: {was_leader}): write went through after"
                f" {time.monotonic() - started:.2f}s and {len(errors)} StoreUnreachable: {errors}"
            )
            kv = store.get(key)
            assert kv is not None and kv.value == b"2"
            assert cluster.leader() in (order[0], order[2])


@pytest.fixture
def auth_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with etcd_server(tmp_path) as server:
        server.etcdctl("user", "add", "root", "--new-user-password=rootpw", "--interactive=false")
        server.etcdctl("auth", "enable")
        yield server


def root_etcdctl(server: EtcdServer, *args: str, stdin: str = "") -> str:
    return server.etcdctl("--user=root", "--password=rootpw", *args, stdin=stdin)


def test_etcd_auth(auth_etcd: EtcdServer, ns: str) -> None:
    with open_backend(auth_etcd.url) as anonymous, pytest.raises(StoreError) as e:
        anonymous.get(ns + "k")
    assert not isinstance(e.value, StoreUnreachable)

    with open_backend(auth_etcd.url + "?user=root&password=wrong") as wrong:
        with pytest.raises(StoreError, match="authentication failed") as e:
            wrong.get(ns + "k")
        assert not isinstance(e.value, StoreUnreachable)

    with open_backend(auth_etcd.url + "?user=root&password=rootpw") as store:
        rev = put(store, ns + "k", b"1")
        assert root_etcdctl(auth_etcd, "get", "--print-value-only", ns + "k").strip() == "1"
        # Setting a user's password (even to the same one) makes etcd refuse the tokens it
        # issued to that user before: the store authenticates again by itself.
        root_etcdctl(auth_etcd, "user", "passwd", "root", "--interactive=false", stdin="rootpw\n")
        kv = store.get(ns + "k")
        assert kv is not None and kv.mod_revision == rev
        assert put(store, ns + "k", b"2") == rev + 1
        events = Collector(store.watch(ns, rev))
        try:
            assert [e.kv.value for e in events.take(2)] == [b"1", b"2"]
        finally:
            events.cancel()


def openssl(command: str) -> None:
    subprocess.run(["openssl", *command.split()], check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, in `d`."""
    new_key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
    openssl(f"req -x509 {new_key} -days 1 -subj /CN=ca -keyout {d}/ca.key -out {d}/ca.pem")
    for name, ext in [
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl(f"req {new_key} -subj /CN={name} -keyout {d}/{name}.key -out {d}/{name}.csr")
        openssl(
            f"x509 -req -days 1 -in {d}/{name}.csr -CA {d}/ca.pem -CAkey {d}/ca.key"
            f" -CAcreateserial -extfile {d}/{name}.ext -out {d}/{name}.pem"
        )


def test_etcd_tls(tmp_path: Path, ns: str) -> None:
    make_pki(tmp_path)
    args = [
        f"--cert-file={tmp_path / 'server.pem'}",
        f"--key-file={tmp_path / 'server.key'}",
        "--client-cert-auth",
        f"--trusted-ca-file={tmp_path / 'ca.pem'}",
    ]
    with etcd_server(tmp_path, args, client_scheme="https") as server:
        tls = f"?ca={tmp_path / 'ca.pem'}&timeout=2"
        client = f"&cert={tmp_path / 'client.pem'}&key={tmp_path / 'client.key'}"
        with open_backend(server.url + tls + client) as store:
            rev = put(store, ns + "k", b"1")
            kv = store.get(ns + "k")
            assert kv is not None and kv.mod_revision == rev
        # Without a client certificate the handshake fails; grpc reports that only as
        # "unavailable", with the reason in the message.
        with open_backend(server.url + tls) as store, pytest.raises(StoreUnreachable):
            store.get(ns + "k")
        plain = server.url.replace("etcds", "etcd")
        with open_backend(plain) as store, pytest.raises(StoreUnreachable):
            store.get(ns + "k")


def test_snapshot_reads_every_prefix_at_one_revision(
    store: Store, store_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several prefixes, read in pages of 2 on etcd, while another client keeps writing
    to all of them: every key is as it was at the one revision returned."""
    from ipward.store import etcd

    monkeypatch.setattr(etcd, "SNAPSHOT_PAGE", 2)
    prefixes = [ns + "a/", ns + "b/", ns + "c/"]
    history: dict[str, list[tuple[int, bytes]]] = {}  # key -> [(revision, value)]
    for p in prefixes:
        for i in range(5):
            history[p + str(i)] = [(put(store, p + str(i), b"0"), b"0")]
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        with open_backend(store_url) as other:
            while not stop.is_set():
                n = writes[0] = writes[0] + 1
                key = prefixes[n % 3] + str(n % 5)
                history[key].append((put(other, key, str(n).encode()), str(n).encode()))

    thread = threading.Thread(target=writer)
    thread.start()
    snapshots = []
    try:
        while writes[0] < 300:  # snapshots all through 300 writes
            snapshots.append(store.snapshot(prefixes))
    finally:
        stop.set()
        thread.join(10)
    for kvs, revision in snapshots:
        assert [kv.key for kv in kvs] == sorted(history)  # prefix by prefix, key order
        for kv in kvs:
            as_of = [value for rev, value in history[kv.key] if rev <= revision][-1]
            assert kv.value == as_of, (kv.key, revision)


# SQLite: the commits of another process.


WRITER = """
import sys
from ipward.store import open_backend
from ipward.store.base import Put
store = open_backend(sys.argv[1])
for line in sys.stdin:
    store.txn([], [Put("k", line.strip().encode())])
    print("written", flush=True)
"""


def test_sqlite_commits_of_the_process_that_made_the_file_stay_visible(tmp_path: Path) -> None:
    """A long-lived process makes the store, other processes come and go: each sees its
    every commit. (Found: making a file looked at its header through a descriptor of
    its own; closing it dropped the process's POSIX locks on the file, so the next
    process to close thought itself the last, deleted the WAL, and every later commit
    of the first went to a deleted file.)"""
    url = f"sqlite://{tmp_path}/new.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        for value in ("1", "2", "3"):
            writer.stdin.write(value + "\n")
            writer.stdin.flush()
            assert writer.stdout.readline() == "written\n"
            with open_backend(url) as reader:  # opens and closes a connection
                kv = reader.get("k")
                assert kv is not None and kv.value == value.encode()
    finally:
        writer.stdin.close()
        writer.wait(30)


def test_the_etcd_lab_takes_other_ports_when_its_first_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port free when chosen can be taken (by another test's server, choosing at random
    too) before etcd binds it: the fixture then starts on other ports, not fails."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = taken.getsockname()[1]
        chosen = iter([first])
        monkeypatch.setattr(
            "ipward_lab.servers.etcd.free_port", lambda: next(chosen, None) or free_port()
        )
        with etcd_server(tmp_path) as server:
            assert server.client_port != first and server.healthy()
            assert "address already in use" in server.log_path.read_text()
