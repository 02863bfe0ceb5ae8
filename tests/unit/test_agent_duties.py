"""The agent's node duties on a real SQLite store, step by step on a given clock: the
registration is renewed every TTL/3 whatever the handshake interval (at 5,000 nodes a
keepalive a second each is 5,000 a second on etcd), handshakes are answered every
interval, and a failed keepalive is tried again within a second; one agent holds the
node (a second waits; a deleted key is put back), and the registration publishes the
clock every refresh and at once when it steps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ipward.agent.duties import NodeDuties
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.records import NodeRegistration
from ipward.store import StoreUnreachable
from ipward.store.base import Delete, KeyValue
from ipward.store.sqlite import SqliteStore
from support import ManualClock

NODE = "n1"
HOUR = 3600.0


class Counting(SqliteStore):
    """The real SQLite store, counting lease keepalives and handshake scans; a keepalive
    fails while `failing` is set."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.keepalives = 0
        self.scans = 0
        self.failing = False

    def lease_keepalive(self, lease: int) -> int:
        if self.failing:
            raise StoreUnreachable("sqlite store: failing on purpose")
        self.keepalives += 1
        return super().lease_keepalive(lease)

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        if prefix == keys.POOLS:
            self.scans += 1
        return super().range(prefix, limit)


@pytest.fixture
def store(sqlite_url: str, sqlite_store) -> Iterator[Counting]:  # sqlite_store: the schema made
    counting = Counting(sqlite_url[len("sqlite://") :])
    yield counting
    counting.close()


def test_keepalives_every_ttl_third_and_answers_every_interval(store: Counting) -> None:
    duties = NodeDuties(store, NODE, interval=1.0, ttl=30)
    now, wakes = 0.0, []
    while now <= 30.0:  # as its thread does: each step at the time the last one named
        now = duties.step(now)
        wakes.append(now)
    assert store.get(keys.node_key(NODE)) is not None  # registered at the first step
    assert store.scans == 31  # every interval, 0 to 30 s
    assert store.keepalives == 3  # at 10, 20 and 30 s: TTL/3, not 30 times
    assert wakes[:3] == [1.0, 2.0, 3.0]


def test_a_failed_keepalive_is_tried_again_within_a_second(store: Counting) -> None:
    duties = NodeDuties(store, NODE, interval=5.0, ttl=9)  # keepalives every 3 s
    duties.step(0.0)
    store.failing = True
    assert duties.step(3.0) == pytest.approx(4.0)  # not 6: the failure is retried in 1 s
    store.failing = False
    duties.step(4.0)
    assert store.keepalives == 1
    assert duties.step(5.0) == pytest.approx(7.0)  # the answers' turn, then TTL/3 again
    assert store.get(keys.node_key(NODE)) is not None


# -- the node's registration (end to end: tests/system/test_node_registration.py) ------


def test_duties_hold_the_node_against_a_second_and_put_a_deleted_key_back(sqlite_store) -> None:
    """Two duties for one node on one store, stepped: the second waits while the first
    holds; the second's stop leaves the first's registration; a key deleted is put back
    at the first's next refresh; once the first stops, the second registers."""
    store, wall = sqlite_store, ManualClock(1_000.0)

    def duties() -> NodeDuties:
        return NodeDuties(store, NODE, interval=5.0, ttl=30, refresh=60.0, clock=wall)

    def at(now: float, *each: NodeDuties) -> KeyValue | None:
        """Step `each` at monotonic `now` (the wall clock moving with it); the key."""
        wall.now = 1_000.0 + now
        for d in each:
            d.step(now)
        return store.get(keys.node_key(NODE))

    first, second = duties(), duties()
    kv = at(0.0, first, second)
    assert kv is not None and kv.lease == first.lease and second.lease == 0
    assert second.holder_lease == first.lease
    second.stop()
    assert store.get(keys.node_key(NODE)) is not None
    store.txn([], [Delete(keys.node_key(NODE))])
    assert at(30.0, first) is None  # a keepalive; the refresh is not due: not looked at
    kv = at(60.0, first)
    assert kv is not None and kv.lease == first.lease
    third = duties()
    assert at(60.0, third).lease == first.lease  # type: ignore[union-attr]
    first.stop()
    assert store.get(keys.node_key(NODE)) is None
    kv = at(70.0, third)
    assert kv is not None and kv.lease == third.lease
    third.stop()


def test_duties_publish_the_clock_every_refresh_and_at_once_when_it_steps(sqlite_store) -> None:
    wall = ManualClock(1_000.0)
    duties = NodeDuties(sqlite_store, NODE, interval=5.0, ttl=30, refresh=60.0, clock=wall)

    def published() -> float:
        kv = sqlite_store.get(keys.node_key(NODE))
        return NodeRegistration.decode(kv.value).clock

    duties.step(0.0)
    assert published() == 1_000.0
    wall.now = 1_005.0
    duties.step(5.0)  # the handshakes' turn; the clock moved with the monotonic one
    assert published() == 1_000.0
    wall.now = 1_010.0 + HOUR  # stepped
    assert duties.step(10.0) <= 15.0
    assert published() == 1_010.0 + HOUR
    wall.now = 1_070.0 + HOUR
    duties.step(70.0)
    assert published() == 1_070.0 + HOUR  # the refresh
    duties.stop()


def test_a_registration_of_an_older_agent_still_measures_its_clock() -> None:
    """Written before `clock` existed: its `since` was the clock at its put."""
    old = rec.encode({"node": NODE, "pid": 7, "since": 123.5})
    registration = NodeRegistration.decode(old)
    assert (registration.clock, registration.refresh) == (123.5, None)
