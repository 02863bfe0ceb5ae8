"""The agent's node duties on a real SQLite store, step by step on a given clock: the
registration is renewed every TTL/3 whatever the handshake interval (at 5,000 nodes a
keepalive a second each is 5,000 a second on etcd), handshakes are answered every
interval, and a failed keepalive is tried again within a second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ipward.agent.duties import NodeDuties
from ipward.core import keys
from ipward.store import StoreUnreachable
from ipward.store.base import KeyValue
from ipward.store.sqlite import SqliteStore

NODE = "n1"


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
