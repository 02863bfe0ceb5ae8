"""Clocks that disagree (issue 21, point 3): the ADD grace holds whatever the machines'
clocks say (`ipward.gc.clocks`).

End to end, agents run on a clock of their own (libfaketime, Debian's `faketime`,
preloaded into the agent process; its monotonic clock left alone, as a real clock step
leaves it) against a real etcd, and `ipward gc`, the controller and the agent's own
reconciliation each keep a record two seconds old while its sandbox is absent (an agent
an hour behind; a forward step); a skewed node shows in the controller's log and metrics
and in `ipward status`. The controller's view is also stepped in this process on given
clocks (the rules alone: `tests/unit/test_clocks.py`)."""

from __future__ import annotations

import glob
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.controller.metrics import Metrics
from ipward.controller.view import StoreView
from ipward.core import keys
from ipward.core.records import AddressRecord, Attachment, NodeRegistration, PodInfo
from ipward.gc import clocks
from ipward.store import Store, open_backend, open_store
from ipward.store.base import Delete, Put
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.simcluster import write_sim_state
from ipward_lab.waiting import wait_for
from support import ManualClock, exec_plugin

HOUR = 3600.0
GRACE = 60.0  # the judges' ADD grace here: far longer than any test waits
NODE = "n1"
ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_UID=uid-web-0"


def libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        raise AssertionError("libfaketime is missing: apt-get install faketime (scripts/setup.sh)")
    return found[0]


def faked_clock(spec: str | Path) -> dict[str, str]:
    """The environment that runs a process on a wall clock of its own: `spec` is an
    offset ("-1h"), or a file holding one, read again at every call (to step it)."""
    env = {"LD_PRELOAD": libfaketime(), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    if isinstance(spec, Path):
        return {**env, "FAKETIME_TIMESTAMP_FILE": str(spec), "FAKETIME_NO_CACHE": "1"}
    return {**env, "FAKETIME": spec}


@pytest.fixture
def etcd_url(etcd: EtcdServer) -> str:
    """The module's etcd, emptied."""
    with open_backend(etcd.url) as store:
        store.txn([], [Delete(kv.key) for kv in store.range("")[0]])
    return etcd.url


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Callable[..., fleet.Process]]:
    """Start agents (`processes("agent", name, url, *options, env=...)`, ready) and
    controllers (`"controller"`); all killed at the end."""
    started: list[fleet.Process] = []
    # Sockets in a short directory: a pytest tmp path can pass AF_UNIX's 108 bytes.
    run = Path(tempfile.mkdtemp(prefix="ipw-"))

    def start(kind: str, name: str, url: str, *extra: str, env: Env = None) -> fleet.Process:
        logs = tmp_path / "logs"
        if kind == "agent":
            agent = fleet.Agent(NODE, url, run / name / "agent.sock", logs, extra, env)
            started.append(agent)
            return agent.wait_ready()
        controller = fleet.Controller(name, url, logs, extra, env)
        started.append(controller)
        controller.wait_started()
        return controller

    yield start
    for p in started:
        p.kill()
    shutil.rmtree(run, ignore_errors=True)


Env = dict[str, str] | None


def cni_config(agent: fleet.Process) -> dict:
    assert isinstance(agent, fleet.Agent)
    section = {"type": "ipward", "pool": "p", "agentSocket": str(agent.socket)}
    return {"cniVersion": "1.0.0", "name": "net", "ipam": section}


def add(plugin: Path, agent: fleet.Process, container: str) -> str:
    """ADD through the agent; the address."""
    result = exec_plugin(plugin, "ADD", cni_config(agent), container=container, args=ARGS)
    assert result.returncode == 0 and result.json is not None, result
    return str(result.json["ips"][0]["address"]).split("/")[0]


def records(url: str) -> dict[str, AddressRecord]:
    with open_store(url) as store:
        kvs = store.range(keys.ADDRESSES)[0]
    return {kv.key.rsplit("/", 1)[1]: AddressRecord.decode(kv.value) for kv in kvs}


def registration(url: str) -> NodeRegistration | None:
    with open_store(url) as store:
        kv = store.get(keys.node_key(NODE))
    return None if kv is None else NodeRegistration.decode(kv.value)


def no_sandbox_anywhere(state: Path, as_of: float) -> None:
    """The simulated runtime of the node lists no sandbox, and the cluster no pod: what a
    judge reads while a sandbox is being created (its runtime lists it once it is up)."""
    write_sim_state(str(state), as_of, {"pods": [], "nodes": [NODE]}, {NODE: {"sandboxes": []}})


def pool(url: str, subnet: str) -> None:
    run_cli("pool", "create", "p", "--range", subnet, store=url, check=True)


def behind_agent(processes: Callable[..., fleet.Process], url: str, *extra: str) -> fleet.Process:
    """An agent whose clock is an hour behind, registered (its clock published)."""
    agent = processes("agent", "behind", url, *extra, env=faked_clock("-1h"))
    wait_for(lambda: registration(url), "the agent's registration")
    return agent


# -- point 3: the grace holds across clocks, end to end ----------------------------------


def test_one_shot_gc_keeps_a_young_record_of_an_agent_an_hour_behind(
    etcd_url: str, plugin: Path, processes: Callable[..., fleet.Process], tmp_path: Path
) -> None:
    """Found: `ipward gc` freed a record two seconds old as sandbox-gone "read 3600s after
    the ADD": its agent's clock was an hour behind. Now the agent's offset, measured from
    its registration, corrects the record's age: it is kept, and the verdict says why."""
    pool(etcd_url, "10.71.0.0/24")
    agent = behind_agent(processes, etcd_url)
    ip = add(plugin, agent, "c-young")
    created = records(etcd_url)[ip].created_at
    assert created is not None and created < time.time() - HOUR + 60  # the agent's clock
    state = tmp_path / "state.json"
    no_sandbox_anywhere(state, time.time())
    liveness = f"sim://{state}"
    grace = str(GRACE)
    res = run_cli(
        "--json", "gc", "--liveness", liveness, "--add-grace", grace, "--confirm-after", "0",
        "--all", store=etcd_url,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["freed"] == [] and out["candidates"] == []
    (kept,) = out["kept"]
    assert f"{NODE}'s clock" in kept["evidence"] and "behind" in kept["evidence"], kept
    assert ip in records(etcd_url)


def test_controller_keeps_a_young_record_of_an_agent_an_hour_behind(
    etcd_url: str, plugin: Path, processes: Callable[..., fleet.Process], tmp_path: Path
) -> None:
    """The controller's GC on the same record: judged on pass after pass (two at one
    revision freed it before), kept; and the node's skew is logged and counted, tight
    once the view has seen a registration put (here every second) from its watch."""
    pool(etcd_url, "10.72.0.0/24")
    agent = behind_agent(processes, etcd_url, "--registration-refresh", "1")
    state = tmp_path / "state.json"
    no_sandbox_anywhere(state, time.time())
    controller = processes(
        "controller", "c1", etcd_url, "--interval", "0.2", "--lease-ttl", "2",
        "--liveness", f"sim://{state}", "--add-grace", str(GRACE), "--gc-interval", "0.2",
    )  # fmt: skip
    wait_for(lambda: controller.metric("ipward_controller_leader") == 1, "leadership")
    ip = add(plugin, agent, "c-young")
    no_sandbox_anywhere(state, time.time())  # a view read after the ADD

    def passes_with_the_record() -> int:
        return len([e for e in controller.logged("garbage collection pass") if e["records"]])

    wait_for(lambda: passes_with_the_record() >= 4, "four GC passes judging the record")
    assert ip in records(etcd_url)
    assert not controller.logged("freed")

    def measured() -> float | None:
        return controller.metric("ipward_node_clock_offset_seconds", node=NODE)

    wait_for(lambda: abs((measured() or 0) + HOUR) < 10, "the node's offset measured tight")
    assert controller.metric("ipward_clock_skewed_nodes") == 1
    warnings = [e for e in controller.logged(SKEW_LOGGED) if e["node"] == NODE]
    assert warnings and abs(warnings[-1]["offset"] + HOUR) < 10, warnings


SKEW_LOGGED = (
    "node's clock is off the controller's: its records' ages are corrected for it (fix its"
    " time sync)"
)


def test_status_shows_a_node_whose_clock_is_an_hour_behind(
    etcd_url: str, processes: Callable[..., fleet.Process]
) -> None:
    pool(etcd_url, "10.73.0.0/24")
    behind_agent(processes, etcd_url)
    res = run_cli("status", store=etcd_url)
    assert res.returncode == 0, res.stderr
    (line,) = [line for line in res.stdout.splitlines() if line.startswith("clock")]
    assert NODE in line and "behind" in line, res.stdout
    data = json.loads(run_cli("--json", "status", store=etcd_url, check=True).stdout)
    assert data["nodes"] == [NODE] and data["clocks_skewed"] == [NODE]
    measured = data["clocks"][NODE]
    assert -HOUR - 70 < measured["offset_min"] <= measured["offset_max"] < -HOUR + 70


def test_reconciliation_keeps_a_young_record_across_a_forward_clock_step(
    etcd_url: str, plugin: Path, processes: Callable[..., fleet.Process], tmp_path: Path
) -> None:
    """The agent's clock steps an hour forward while a sandbox is being created: its
    runtime's next list (stamped on the stepped clock) has no sandbox, and the record
    looked an hour old to its reconciliation. Now its copy of the node index knows when
    it first saw the record: kept. And the agent publishes its new clock at once."""
    pool(etcd_url, "10.74.0.0/24")
    spec = tmp_path / "faketime"
    spec.write_text("+0\n")
    state = tmp_path / "state.json"
    no_sandbox_anywhere(state, time.time())
    agent = processes(
        "agent", "stepped", etcd_url, "--liveness", f"sim://{state}", "--add-grace",
        str(GRACE), "--reconcile-interval", "0.2", "--duty-interval", "0.2",
        env=faked_clock(spec),
    )  # fmt: skip
    wait_for(lambda: registration(etcd_url), "the agent's registration")
    ip = add(plugin, agent, "c-young")
    spec.write_text("+1h\n")
    no_sandbox_anywhere(state, time.time() + HOUR)  # as its runtime would stamp it now
    passes = agent.metric("ipward_agent_reconcile_passes_total") or 0.0
    wait_for(
        lambda: (agent.metric("ipward_agent_reconcile_passes_total") or 0) >= passes + 3,
        "three reconcile passes after the step",
    )
    assert ip in records(etcd_url)
    assert not agent.logged("freed")
    wait_for(
        lambda: (r := registration(etcd_url)) is not None and r.clock > time.time() + HOUR - 60,
        "the registration put again with the stepped clock",
        timeout=10,
    )


# -- the controller's view, stepped on given clocks ------------------------------------------


def test_the_view_measures_offsets_and_keeps_first_sightings_across_a_whole_read(
    etcd_url: str,
) -> None:
    """The controller's view: a registration's offset, loose from the first whole read,
    tight from its next put's event; a record of the first read has no first sighting
    (nothing to compare with), one put later is first seen when its event came; a whole
    read (its timer) that finds them unchanged keeps all of it; a registration put again
    notes no change (its node's records are not judged again for it)."""
    wall, mono = ManualClock(10_000.0), ManualClock(50.0)
    with open_backend(etcd_url) as store:
        view = StoreView(
            store, Metrics("t", lambda: True), reread_every=600, clock=wall, monotonic=mono
        )
        try:
            put_registration(store, clock=wall.now - HOUR)
            put_record(store, "10.0.0.2")
            view.sync()
            view.take_changes()
            loose = view.registrations().offsets[NODE]
            assert loose.low == -HOUR and loose.high is not None and loose.high > loose.low
            assert [h.seen for h in view.held()] == [None]
            wall.now, mono.now = wall.now + 30, mono.now + 30
            put_registration(store, clock=wall.now - HOUR)
            put_record(store, "10.0.0.3")
            view.sync()
            assert view.registrations().offsets[NODE] == clocks.Offset(-HOUR, -HOUR)
            assert not view.take_changes().nodes
            first_seen = {h.ip: h.seen for h in view.held()}
            assert first_seen == {"10.0.0.2": None, "10.0.0.3": 80.0}
            mono.now += 600  # the view's timer: read whole
            view.sync()
            assert view.registrations().offsets[NODE] == clocks.Offset(-HOUR, -HOUR)
            assert {h.ip: h.seen for h in view.held()} == first_seen
        finally:
            view.close()


def put_registration(store: Store, clock: float) -> None:
    value = NodeRegistration(NODE, 1, clock, clock, 60.0).encode()
    store.txn([], [Put(keys.node_key(NODE), value)])


def put_record(store: Store, ip: str) -> None:
    record = AddressRecord.new(
        Attachment("net", "sb-1", "eth0"), PodInfo("ns", "web-0", "u1"), NODE, "10.0.0.0/28",
        1.0, None,
    )  # fmt: skip
    store.txn([], [Put(keys.ip_key("p", ip), record.encode())])
