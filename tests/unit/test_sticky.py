"""Sticky reservations on a real SQLite store, through the ledger: made with the first
allocation, detached by DEL, taken over by the identity's next sandbox, retired by
identity; every step leaves `check` clean and the old sandbox's late DEL changes
nothing. Then the retirement rules record by record. (Through the CLI:
`tests/system/test_cli.py`.)"""

from __future__ import annotations

import pytest

from ipward.cluster.liveness import ClusterView, Pod
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.errors import OwnerChanged, TryAgainLater
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, ReservationRecord
from ipward.gc import rules as gc
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from ipward.store.base import Delete, Put

NET = "net"


@pytest.fixture
def pool(sqlite_store) -> PoolSpec:
    spec = PoolSpec.from_dict(
        {"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]]}
    )
    sqlite_store.txn([], [Put(keys.pool_key("p"), rec.encode(spec.to_dict()))])
    return spec


def sandbox(n: int) -> rec.Attachment:
    return rec.Attachment(NET, f"sandbox{n}", "eth0")


def identity(**kw: object) -> rec.Sticky:
    return rec.Sticky(NET, "db", "db-0", **kw)  # type: ignore[arg-type]


def assert_clean(store) -> None:
    problems, _ = check(store)
    assert problems == []


def ips(allocations) -> list[str]:
    return sorted(a.ip for a in allocations)


def test_reserved_with_the_first_allocation_and_taken_over(sqlite_store, pool) -> None:
    ledger = Ledger(sqlite_store, "n1")
    first = ips(
        ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    )
    held = rec.decode(sqlite_store.get(keys.sticky_key(NET, "db", "db-0")).value)
    assert held["attachment"] == sandbox(1).key_on("n1") and len(held["ips"]) == 2  # dual stack
    assert_clean(sqlite_store)
    # DEL detaches: the reservation keeps both addresses, no index.
    assert sorted(ledger.free(sandbox(1))) == sorted(held["ips"])
    assert sqlite_store.get(sandbox(1).key_on("n1")) is None
    assert all(
        AddressRecord.decode(sqlite_store.get(keys.ip_key(*rec.split_pool_ip(r))).value).is_detached
        for r in held["ips"]
    )
    assert_clean(sqlite_store)
    # A plain pod cannot get them meanwhile.
    other = ips(ledger.allocate([pool], sandbox(9), rec.PodInfo("db", "web", "u9")))
    assert not set(other) & set(first)
    # The identity's next sandbox (a new pod UID) gets them back.
    again = ledger.allocate([pool], sandbox(2), rec.PodInfo("db", "db-0", "u2"), sticky=identity())
    assert ips(again) == first
    assert_clean(sqlite_store)
    # The old sandbox's late DEL changes nothing.
    revision = sqlite_store.revision()
    assert ledger.free(sandbox(1)) == []
    assert sqlite_store.revision() == revision


def test_new_sandbox_before_the_old_ones_del(sqlite_store, pool) -> None:
    """Takeover of a bound reservation: the old sandbox's record is replaced (one
    record per address), its index dropped, so its DEL finds nothing."""
    ledger = Ledger(sqlite_store, "n1")
    first = ips(
        ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    )
    second = ledger.allocate([pool], sandbox(2), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    assert ips(second) == first
    assert sqlite_store.get(sandbox(1).key_on("n1")) is None
    records = [rec.decode(kv.value) for kv in sqlite_store.range("ips/")[0]]
    assert {r["container"] for r in records} == {"sandbox2"} and len(records) == 2
    revision = sqlite_store.revision()
    assert ledger.free(sandbox(1)) == []
    assert sqlite_store.revision() == revision
    assert_clean(sqlite_store)


def test_no_takeover_from_a_pod_that_may_be_live(sqlite_store, pool) -> None:
    ledger = Ledger(sqlite_store, "n1")
    ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    revision = sqlite_store.revision()
    with pytest.raises(TryAgainLater, match="may still be"):
        ledger.allocate(
            [pool],
            sandbox(2),
            rec.PodInfo("db", "db-0", "u2"),
            sticky=identity(may_take=lambda uid: False),
        )
    assert sqlite_store.revision() == revision
    taken = ledger.allocate(
        [pool],
        sandbox(2),
        rec.PodInfo("db", "db-0", "u2"),
        sticky=identity(may_take=lambda uid: uid == "u1"),
    )
    assert len(taken) == 2
    assert_clean(sqlite_store)


def test_a_takeover_waits_for_the_old_sandbox_this_node_still_lists(sqlite_store, pool) -> None:
    """Finding (a real cluster: `kubectl delete pod db-0 --force --grace-period=0`): the
    new db-0 took the sticky address 40-90 ms before the old sandbox's teardown ended, and
    two namespaces on the bridge held one address. The old pod is gone from the API
    (`may_take` says so), but while this node's runtime lists its sandbox the address
    stays (11, nothing written); once the runtime lists it no more, or its DEL detaches
    it, the new sandbox takes it over."""
    ledger = Ledger(sqlite_store, "n1")
    first = ips(
        ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    )
    listed = {"sandbox1"}
    new_pod = rec.PodInfo("db", "db-0", "u2")
    forced = identity(may_take=lambda uid: True, sandbox_listed=lambda id: id in listed)
    revision = sqlite_store.revision()
    with pytest.raises(TryAgainLater, match="still lists"):
        ledger.allocate([pool], sandbox(2), new_pod, sticky=forced)
    assert sqlite_store.revision() == revision
    listed.clear()  # its teardown is over
    assert ips(ledger.allocate([pool], sandbox(2), new_pod, sticky=forced)) == first
    assert_clean(sqlite_store)


@pytest.mark.parametrize("end", ["its DEL", "the node gone"])
def test_a_takeover_from_another_node_waits_for_its_del_or_its_end(
    sqlite_store, pool, end: str
) -> None:
    """The old sandbox on another node: its runtime is not ours to ask. While that node's
    agent runs (registered), the address moves only once the sandbox's DEL there
    detaches it, or the node is gone (its registration expired)."""
    n1, n2 = Ledger(sqlite_store, "n1"), Ledger(sqlite_store, "n2")
    registration = rec.NodeRegistration("n1", 1, 0.0, 0.0, None).encode()
    sqlite_store.txn([], [Put(keys.node_key("n1"), registration)])
    first = ips(n1.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity()))
    new_pod = rec.PodInfo("db", "db-0", "u2")
    forced = identity(may_take=lambda uid: True, sandbox_listed=lambda id: False)
    revision = sqlite_store.revision()
    with pytest.raises(TryAgainLater, match="node n1, whose agent runs"):
        n2.allocate([pool], sandbox(2), new_pod, sticky=forced)
    assert sqlite_store.revision() == revision
    if end == "its DEL":
        n1.free(sandbox(1))
    else:
        sqlite_store.txn([], [Delete(keys.node_key("n1"))])
    assert ips(n2.allocate([pool], sandbox(2), new_pod, sticky=forced)) == first
    assert_clean(sqlite_store)


def test_free_sticky_only_when_detached_and_unchanged(sqlite_store, pool) -> None:
    ledger = Ledger(sqlite_store, "n1")
    ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    key = keys.sticky_key(NET, "db", "db-0")
    with pytest.raises(OwnerChanged, match="bound"):
        ledger.free_sticky(key, sqlite_store.get(key).mod_revision, "test")
    ledger.free(sandbox(1))
    kv = sqlite_store.get(key)
    with pytest.raises(OwnerChanged):
        ledger.free_sticky(key, kv.mod_revision - 1, "test")
    freed = ledger.free_sticky(key, kv.mod_revision, "test")
    assert len(freed) == 2
    assert sqlite_store.range("ips/")[0] == [] and sqlite_store.get(key) is None
    assert len(sqlite_store.range("free/")[0]) == 2  # cooling down, like any freed address
    assert_clean(sqlite_store)


def test_gc_of_a_bound_sticky_record_detaches_it(sqlite_store, pool) -> None:
    """A sticky pod's sandbox vanished without DEL: GC detaches (the identity comes
    back), never frees."""
    ledger = Ledger(sqlite_store, "n1", clock=lambda: 1000.0)
    ledger.allocate([pool], sandbox(1), rec.PodInfo("db", "db-0", "u1"), sticky=identity())
    ev = gc.Evidence(10.0, {}, ClusterView(2000.0, {}, frozenset({"n1"})), frozenset({"n1"}))
    verdicts = [gc.judge(h, ev) for h in gc.snapshot(sqlite_store)]
    assert {v.reason for v in verdicts} == {gc.POD_GONE}
    assert gc.free(ledger, verdicts[0], "test")
    assert len(sqlite_store.range("ips/")[0]) == 2
    assert gc.snapshot(sqlite_store) == []  # detached: not judged as leaked again
    assert (
        rec.decode(sqlite_store.get(keys.sticky_key(NET, "db", "db-0")).value)["attachment"] == ""
    )
    assert_clean(sqlite_store)


def reservation(**held: object) -> gc.Reservation:
    base = {"ips": ["p/10.0.0.5"], "attachment": "", "detached_at": 1000.0, "ttl": None}
    base.update(held)
    return gc.Reservation("sticky/net/db/db-2", 3, ReservationRecord.from_dict(base))


def view(*pods: Pod, sets: dict[str, int] | None = None, as_of: float = 1100.0) -> ClusterView:
    return ClusterView(as_of, {p.uid: p for p in pods}, frozenset(), sets or {})


STATEFUL = {"owner_kind": "StatefulSet", "owner_name": "db"}


def test_pods_named_gives_every_pod_of_that_name_and_no_other() -> None:
    """Retiring a reservation asks the view for the pods of its name (indexed once per
    view, not a walk of every pod per reservation): two UIDs of one name both, a name in
    another namespace not, and the same answer asked again."""
    old, new = Pod("u1", "db", "db-0", "Failed"), Pod("u2", "db", "db-0", "Pending")
    cluster = view(
        old, new, Pod("u3", "db", "db-1", "Running"), Pod("u4", "web", "db-0", "Running")
    )
    for _ in range(2):
        assert sorted(p.uid for p in cluster.pods_named("db", "db-0")) == ["u1", "u2"]
        assert [p.uid for p in cluster.pods_named("web", "db-0")] == ["u4"]
        assert cluster.pods_named("db", "db-9") == []
    cluster.pods_named("db", "db-0").clear()  # an answer is the caller's own list
    assert len(cluster.pods_named("db", "db-0")) == 2


@pytest.mark.parametrize(
    ("r", "cluster", "reason"),
    [
        pytest.param(
            reservation(**STATEFUL), view(sets={"db/db": 2}), gc.ORDINAL_OUT, id="scaled-down"
        ),
        pytest.param(reservation(**STATEFUL), view(sets={"db/db": 3}), None, id="ordinal-in-range"),
        pytest.param(reservation(**STATEFUL), view(), gc.SET_DELETED, id="set-deleted"),
        pytest.param(
            reservation(**STATEFUL),
            view(Pod("u3", "db", "db-2", "Pending"), sets={"db/db": 2}),
            None,
            id="pod-pending",
        ),
        pytest.param(
            reservation(**STATEFUL),
            view(Pod("u3", "db", "db-2", "Failed"), sets={"db/db": 2}),
            None,
            id="pod-failed-restarting",
        ),
        pytest.param(
            reservation(**STATEFUL),
            view(sets={"db/db": 2}, as_of=1005.0),
            None,
            id="view-too-early",
        ),
        pytest.param(reservation(**STATEFUL), "cluster unreachable", None, id="no-cluster"),
        pytest.param(
            reservation(attachment="attach/net/sb/eth0", **STATEFUL), view(), None, id="bound"
        ),
        pytest.param(reservation(ttl=60), view(), gc.TTL_EXPIRED, id="ttl-passed"),
        pytest.param(reservation(ttl=600), view(), None, id="ttl-running"),
    ],
)
def test_judge_reservation(
    r: gc.Reservation, cluster: ClusterView | str, reason: str | None
) -> None:
    retirement = gc.judge_reservation(r, cluster, grace=30.0)
    assert retirement.reason == reason, retirement.evidence


def test_two_detached_reservations_check_clean(sqlite_store, pool) -> None:
    """Detached records have no sandbox; two of them are not one attachment's twins."""
    ledger = Ledger(sqlite_store, "n1")
    for n, name in ((1, "db-0"), (2, "db-1")):
        ledger.allocate(
            [pool], sandbox(n), rec.PodInfo("db", name, f"u{n}"), sticky=rec.Sticky(NET, "db", name)
        )
        ledger.free(sandbox(n))
    assert len(sqlite_store.range("ips/")[0]) == 4
    assert_clean(sqlite_store)
