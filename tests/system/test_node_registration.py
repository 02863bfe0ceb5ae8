"""One agent holds a node's registration, which publishes its clock (issue 21, point
5; `agent/duties.py`). End to end, agents on a real etcd and on SQLite: a second agent for
the node waits, naming the holder, and its stop leaves the first registered; a
registration deleted by hand comes back; the waiting agent registers once the first
stops. (The duties stepped on given clocks: `tests/unit/test_agent_duties.py`.)"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core.records import NodeRegistration
from ipward.store import open_backend, open_store
from ipward.store.base import Delete
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.waiting import wait_for

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
