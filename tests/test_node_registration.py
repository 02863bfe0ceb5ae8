"""One agent holds a node's registration, which publishes its clock (issue 21, point
5; `agent/duties.py`). End to end, agents on a real etcd and on SQLite: a second agent for
the node waits, naming the holder, and its stop leaves the first registered; a
registration deleted by hand comes back; the waiting agent registers once the first
stops. Stepped on given clocks over a real SQLite store: the same holding, and the clock
put every refresh and at once when it steps."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import run_cli, wait_for
from ipward.agent.duties import NodeDuties
from ipward.core import keys
from ipward.core import records as rec
from ipward.core.records import NodeRegistration
from ipward.store import open_backend, open_store
from ipward.store.base import Delete, KeyValue
from ipward_lab import fleet
from ipward_lab.etcdlab import EtcdServer

NODE = "n1"
HOUR = 3600.0
AGENT_OPTIONS = ("--node-ttl", "2", "--duty-interval", "0.2", "--registration-refresh", "1")
HELD_LOGGED = "node held by another agent; waiting for its registration to go"


@pytest.fixture
def etcd_url(etcd: EtcdServer) -> str:
    """The module's etcd, emptied."""
    with open_backend(etcd.url) as store:
        store.txn([], [Delete(kv.key) for kv in store.range("")[0]])
    return etcd.url


@pytest.fixture(params=["etcd", "sqlite"])
def store_url(request: pytest.FixtureRequest) -> str:
    name = "etcd_url" if request.param == "etcd" else "sqlite_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
def agents(tmp_path: Path, store_url: str) -> Iterator[Callable[[str], fleet.Agent]]:
    """Start agents for `NODE` (ready), each on a socket of its own; killed at the end."""
    started: list[fleet.Agent] = []
    # Sockets in a short directory: a pytest tmp path can pass AF_UNIX's 108 bytes.
    run = Path(tempfile.mkdtemp(prefix="ipw-"))

    def start(name: str) -> fleet.Agent:
        socket = run / name / "agent.sock"
        agent = fleet.Agent(NODE, store_url, socket, tmp_path / "logs", AGENT_OPTIONS)
        started.append(agent)
        return agent.wait_ready()

    yield start
    for agent in started:
        agent.kill()
    shutil.rmtree(run, ignore_errors=True)


def registration(url: str) -> NodeRegistration | None:
    with open_store(url) as store:
        kv = store.get(keys.node_key(NODE))
    return None if kv is None else NodeRegistration.decode(kv.value)


# -- end to end -------------------------------------------------------------------------


def test_a_second_agent_for_the_node_waits_and_its_stop_leaves_the_first_registered(
    store_url: str, agents: Callable[[str], fleet.Agent]
) -> None:
    """Found: a second agent for one node put its registration over the first's; its
    stop revoked its lease, which deleted the key, and the first, still running, never
    registered again (`status` counted one node fewer for good). Now the second waits,
    naming the holder; its stop leaves the first's registration; a registration deleted
    by hand comes back; and when the first stops, the waiting one registers."""
    run_cli("pool", "create", "p", "--range", "10.75.0.0/24", store=store_url, check=True)
    first = agents("first")

    def held_by(agent: fleet.Process) -> bool:
        held = registration(store_url)
        return held is not None and held.pid == agent.pid

    wait_for(lambda: held_by(first), "the first agent's registration")
    second = agents("second")
    (waiting,) = wait_for(lambda: second.logged(HELD_LOGGED), "the second agent waiting")
    assert waiting["holder_pid"] == first.pid
    assert held_by(first)
    assert second.stop() == 0
    wait_for(lambda: held_by(first), "the first's registration after the second's stop", 10)
    status = json.loads(run_cli("--json", "status", store=store_url, check=True).stdout)
    assert status["nodes"] == [NODE]
    with open_store(store_url) as store:
        store.txn([], [Delete(keys.node_key(NODE))])
    wait_for(lambda: held_by(first), "the registration put back after its deletion")
    third = agents("third")
    wait_for(lambda: third.logged(HELD_LOGGED), "the third agent waiting")
    assert first.stop() == 0
    wait_for(lambda: held_by(third), "the waiting agent registered once the first stopped")


# -- the duties, stepped on given clocks -------------------------------------------------


class Manual:
    """A clock that moves when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_duties_hold_the_node_against_a_second_and_put_a_deleted_key_back(sqlite_store) -> None:
    """Two duties for one node on one store, stepped: the second waits while the first
    holds; the second's stop leaves the first's registration; a key deleted is put back
    at the first's next refresh; once the first stops, the second registers."""
    store, wall = sqlite_store, Manual(1_000.0)

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
    wall = Manual(1_000.0)
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
