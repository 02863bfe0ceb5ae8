"""An agent refuses to serve from a store that knows nothing of the addresses its node's
running pods hold (`agent/continuity.py`, docs/design.md 5.15): an upgrade pointing
agents at a new, empty store would hand those addresses out again. The evidence: the
plugin's notes on the node and the runtime's ready sandboxes (here `sim://`)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.cluster.liveness import Sandbox
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.ledger import Ledger
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.simcluster import write_sim_state

NODE = "n1"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The node's runtime (a `sim://` state file with two ready sandboxes and a stopped
    one) and a notes directory of its own."""
    state = tmp_path / "cluster.json"
    sandboxes = [
        Sandbox(id="sb1", ready=True, namespace="ns", name="a", uid="u1"),
        Sandbox(id="sb2", ready=True, namespace="ns", name="b", uid="u2"),
        Sandbox(id="sb3", ready=False, namespace="ns", name="c", uid="u3"),
    ]
    write_sim_state(
        str(state), time.time(), {"pods": [], "nodes": [NODE]}, {NODE: {"sandboxes": sandboxes}}
    )
    notes = tmp_path / "notes"
    notes.mkdir()
    yield state, notes


def note(notes: Path, container: str, network: str = "net", ifname: str = "eth0") -> None:
    path = notes / network / container / ifname
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("/run/ipward/agent.sock\n")


def start(url: str, state: Path, notes: Path, run_dir: Path) -> fleet.Agent:
    return fleet.Agent(
        NODE,
        url,
        run_dir / "agent.sock",
        run_dir,
        ("--liveness", f"sim://{state}"),
        env={"IPWARD_CNI_NOTES": str(notes)},
        metrics=False,
    )


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ipw-cont-"))  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_agent(url: str, state: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """`ipward agent` in the foreground (the notes directory: the test's environment)."""
    return run_cli(
        "agent",
        "--node",
        NODE,
        "--socket",
        str(run_dir / "agent.sock"),
        "--metrics-address",
        "off",
        "--liveness",
        f"sim://{state}",
        store=url,
    )


def test_an_agent_refuses_a_store_that_knows_none_of_its_running_pods(
    node: tuple[Path, Path], sqlite_url: str, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, notes = node
    monkeypatch.setenv("IPWARD_CNI_NOTES", str(notes))
    for container in ("sb1", "sb2", "sb3"):
        note(notes, container)
    run_cli("pool", "create", "p", "--range", "10.70.0.0/24", store=sqlite_url, check=True)
    refused = run_agent(sqlite_url, state, run_dir)
    assert refused.returncode == 2, refused
    for words in ("knows none of the 2 attachments", "node n1", "net/sb1/eth0", "import"):
        assert words in refused.stderr, refused.stderr
    assert not (run_dir / "agent.sock").exists()


def test_an_agent_serves_from_the_store_its_pods_are_in(
    node: tuple[Path, Path], sqlite_url: str, run_dir: Path
) -> None:
    """The store holds one of the two running attachments' addresses (the other's
    note can outlive a refused ADD): it is this node's store."""
    state, notes = node
    for container in ("sb1", "sb2"):
        note(notes, container)
    run_cli("pool", "create", "p", "--range", "10.70.0.0/24", store=sqlite_url, check=True)
    with open_store(sqlite_url) as store:
        ledger = Ledger(store, NODE)
        ledger.allocate([ledger.get_pool("p")], Attachment("net", "sb1", "eth0"), PodInfo())
    agent = start(sqlite_url, state, notes, run_dir).wait_ready()
    agent.kill()


@pytest.mark.parametrize("noted", [[], ["sb3"], ["gone"]], ids=["no-notes", "stopped", "gone"])
def test_an_agent_serves_where_no_running_pod_got_an_address_from_ipward(
    node: tuple[Path, Path], sqlite_url: str, run_dir: Path, noted: list[str]
) -> None:
    """A node ipward never served, or whose noted sandboxes no longer run: nothing to
    lose, any store will do (a new install, a ledger whose pods are gone)."""
    state, notes = node
    for container in noted:
        note(notes, container)
    agent = start(sqlite_url, state, notes, run_dir).wait_ready()
    agent.kill()
