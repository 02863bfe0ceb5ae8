"""A DEL never wedges a pod on a config that could not have allocated (docs/design.md
5.14): a DEL whose config fails its checks frees by the attachment's identity what it
holds and succeeds when it holds nothing; where the agent cannot be reached (or the
config names none the plugin could use), the DEL fails only while the attachment's note
says an ADD of it reached an agent. The installed plugin and the native plugin (the
conftest's `forwarder`), exec'd as a runtime does, on SQLite in-process and through a
real agent."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core.records import AddressRecord
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.waiting import wait_for
from support import PluginResult, exec_plugin

RANGES = {"ranges": [[{"subnet": "10.93.0.0/24"}]]}
NETWORK = "wedge"

# Configs no ADD could allocate with, each refused by ADD in-process: (ipam fields, top
# fields). The DEL of each succeeds and changes nothing.
NEVER_ALLOCATED = [
    pytest.param({**RANGES, "gcGrace": "soon"}, {}, id="gcGrace-soon"),
    pytest.param({"pool": 123}, {}, id="pool-123"),
    pytest.param({**RANGES, "agentSocket": "rel.sock"}, {}, id="agentSocket-relative"),
    pytest.param({**RANGES, "agent_socket": 5}, {}, id="agent_socket-not-string"),
    pytest.param({**RANGES, "store": "etcd://127.0.0.1:1"}, {}, id="store-etcd-in-process"),
    pytest.param({**RANGES, "store": "sqlite://relative.db"}, {}, id="store-relative"),
    pytest.param(RANGES, {"cniVersion": "9.9.9"}, id="cniVersion-9.9.9"),
    pytest.param(RANGES, {"name": "-no-network"}, id="network-name-invalid"),
]


def config(ipam: dict, **top: object) -> dict:
    return {"cniVersion": "1.0.0", "name": NETWORK, "ipam": {"type": "ipward", **ipam}, **top}


def records(url: str) -> dict[str, str]:
    """address -> container of every allocation record."""
    with open_store(url) as store:
        kvs, _ = store.range(keys.ADDRESSES)
    return {
        kv.key.rsplit("/", 1)[1]: AddressRecord.decode(kv.value).attachment.container for kv in kvs
    }


def note_of(container: str, ifname: str = "eth0", network: str = NETWORK) -> Path:
    return Path(os.environ["IPWARD_CNI_NOTES"]) / network / container / ifname


def succeeded_empty(result: PluginResult) -> bool:
    return result.returncode == 0 and result.stdout == b""


def error_code(result: PluginResult) -> int:
    assert result.returncode == 1, result
    assert result.json is not None and len(result.stdout.strip().splitlines()) == 1, result
    return int(result.json["code"])


# -- in-process (single-node mode) ---------------------------------------------------------


@pytest.mark.parametrize(("ipam", "top"), NEVER_ALLOCATED)
def test_del_of_a_config_no_add_could_use_succeeds_and_changes_nothing(
    plugin: Path, sqlite_url: str, ipam: dict, top: dict
) -> None:
    setup = exec_plugin(plugin, "ADD", config({**RANGES, "store": sqlite_url}), container="kept")
    assert setup.returncode == 0, setup
    before = records(sqlite_url)
    bad = config({"store": sqlite_url, **ipam}, **top)
    refused = exec_plugin(plugin, "ADD", bad, container="c1")
    assert refused.returncode == 1, refused
    assert succeeded_empty(exec_plugin(plugin, "DEL", bad, container="c1"))
    assert records(sqlite_url) == before


@pytest.mark.parametrize(
    "stdin",
    [b"", b'{"cniVersion": "1.0.0",}', b"[" * 1000, b" " * ((1 << 20) + 1)],
    ids=["empty", "trailing-comma", "nested", "over-the-limit"],
)
def test_del_of_stdin_that_names_no_network_succeeds(plugin: Path, stdin: bytes) -> None:
    assert succeeded_empty(exec_plugin(plugin, "DEL", stdin, container="c1"))


def test_del_of_an_invalid_config_frees_what_the_identity_holds(
    plugin: Path, sqlite_url: str
) -> None:
    """The config was valid at ADD and is not at DEL (an upgrade that checks more): the
    address is freed by the attachment's identity, not left to GC."""
    good = config({**RANGES, "store": sqlite_url})
    added = exec_plugin(plugin, "ADD", good, container="c1")
    assert added.returncode == 0, added
    assert list(records(sqlite_url).values()) == ["c1"]
    bad = config({**RANGES, "store": sqlite_url, "gcGrace": "soon"})
    assert succeeded_empty(exec_plugin(plugin, "DEL", bad, container="c1"))
    assert records(sqlite_url) == {}


def test_del_of_a_store_that_is_not_there_creates_nothing(plugin: Path, tmp_path: Path) -> None:
    missing = tmp_path / "never" / "made.db"
    bad = config({**RANGES, "store": f"sqlite://{missing}", "pool": "x"})
    assert succeeded_empty(exec_plugin(plugin, "DEL", bad, container="c1"))
    assert not missing.parent.exists()


# -- through an agent --------------------------------------------------------------------


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ipw-del-"))  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_agent(
    tmp_path: Path, run_dir: Path, sqlite_url: str
) -> Iterator[Callable[[], fleet.Agent]]:
    started: list[fleet.Agent] = []

    def start() -> fleet.Agent:
        agent = fleet.Agent("del-node", sqlite_url, run_dir / "agent.sock", tmp_path)
        started.append(agent)
        return agent.wait_ready()

    yield start
    for agent in started:
        agent.kill()


def agent_config(socket: Path | str, **ipam: object) -> dict:
    return config({**RANGES, "agentSocket": str(socket), **ipam})


def test_a_del_served_by_the_agent_removes_the_note_the_add_left(
    forwarder: Path, start_agent: Callable[[], fleet.Agent], sqlite_url: str
) -> None:
    agent = start_agent()
    added = exec_plugin(forwarder, "ADD", agent_config(agent.socket), container="c1")
    assert added.returncode == 0, added
    assert note_of("c1").read_text() == f"{agent.socket}\n"
    assert succeeded_empty(
        exec_plugin(forwarder, "DEL", agent_config(agent.socket), container="c1")
    )
    assert not note_of("c1").exists() and not note_of("c1").parent.exists()
    assert records(sqlite_url) == {}


@pytest.mark.parametrize(
    "bad", [{"gcGrace": "soon"}, {"pool": 123}], ids=["gcGrace-soon", "pool-123"]
)
def test_the_agent_frees_by_identity_on_an_invalid_config(
    forwarder: Path, start_agent: Callable[[], fleet.Agent], sqlite_url: str, bad: dict
) -> None:
    """Refused at ADD (7) and deleted fine; valid at ADD and invalid at DEL: freed."""
    agent = start_agent()
    invalid = {**agent_config(agent.socket), "ipam": {**agent_config(agent.socket)["ipam"], **bad}}
    assert error_code(exec_plugin(forwarder, "ADD", invalid, container="refused")) == 7
    assert succeeded_empty(exec_plugin(forwarder, "DEL", invalid, container="refused"))
    assert not note_of("refused").exists()
    assert exec_plugin(forwarder, "ADD", agent_config(agent.socket), container="c2").returncode == 0
    assert list(records(sqlite_url).values()) == ["c2"]
    assert succeeded_empty(exec_plugin(forwarder, "DEL", invalid, container="c2"))
    assert records(sqlite_url) == {}
    assert not note_of("c2").exists()


def test_a_wrong_agent_socket_never_wedges_the_del(forwarder: Path, run_dir: Path) -> None:
    nowhere = agent_config(run_dir / "no-agent-here.sock")
    assert error_code(exec_plugin(forwarder, "ADD", nowhere, container="c1")) == 11
    assert not note_of("c1").exists()
    assert succeeded_empty(exec_plugin(forwarder, "DEL", nowhere, container="c1"))


def test_a_del_while_the_agent_is_down_waits_for_it_when_an_address_may_be_held(
    forwarder: Path, start_agent: Callable[[], fleet.Agent], sqlite_url: str
) -> None:
    agent = start_agent()
    cfg = agent_config(agent.socket)
    assert exec_plugin(forwarder, "ADD", cfg, container="c1").returncode == 0
    agent.kill()
    wait_for(lambda: not agent.running, "the agent's exit")
    for _ in range(2):
        assert error_code(exec_plugin(forwarder, "DEL", cfg, container="c1")) == 11
    assert list(records(sqlite_url).values()) == ["c1"] and note_of("c1").exists()
    # Never ADDed: nothing can be held, the DEL succeeds with the agent still down.
    assert succeeded_empty(exec_plugin(forwarder, "DEL", cfg, container="other"))
    start_agent()
    assert succeeded_empty(exec_plugin(forwarder, "DEL", cfg, container="c1"))
    assert records(sqlite_url) == {} and not note_of("c1").exists()


def test_an_add_whose_note_cannot_be_written_is_not_sent(
    forwarder: Path, start_agent: Callable[[], fleet.Agent], sqlite_url: str, tmp_path: Path
) -> None:
    agent = start_agent()
    blocked = tmp_path / "notes-is-a-file"
    blocked.write_text("")
    env = {"IPWARD_CNI_NOTES": str(blocked)}
    res = exec_plugin(forwarder, "ADD", agent_config(agent.socket), container="c1", env=env)
    assert error_code(res) == 11 and "note" in res.json["msg"], res
    assert records(sqlite_url) == {}


def test_a_config_naming_no_usable_socket_deletes_unless_noted(
    forwarder: Path, start_agent: Callable[[], fleet.Agent], sqlite_url: str
) -> None:
    """The socket field broken after an ADD reached the agent: the DEL says what to fix
    (7) while the note stands; of an attachment never sent, it succeeds."""
    agent = start_agent()
    assert exec_plugin(forwarder, "ADD", agent_config(agent.socket), container="c1").returncode == 0
    broken = agent_config("relative.sock")
    res = exec_plugin(forwarder, "DEL", broken, container="c1")
    assert error_code(res) == 7 and "agentSocket" in res.json["msg"], res
    assert succeeded_empty(exec_plugin(forwarder, "DEL", broken, container="never-sent"))
    assert list(records(sqlite_url).values()) == ["c1"]


def test_notes_are_kept_per_network_and_interface(
    forwarder: Path, start_agent: Callable[[], fleet.Agent]
) -> None:
    agent = start_agent()
    cfg = agent_config(agent.socket)
    other = {
        **cfg,
        "name": "wedge2",
        "ipam": {**cfg["ipam"], "ranges": [[{"subnet": "10.94.0.0/24"}]]},
    }
    for net, ifname in ((cfg, "eth0"), (cfg, "net1"), (other, "eth0")):
        assert exec_plugin(forwarder, "ADD", net, container="c1", ifname=ifname).returncode == 0
    assert exec_plugin(forwarder, "DEL", cfg, container="c1", ifname="net1").returncode == 0
    assert note_of("c1", "eth0").exists() and not note_of("c1", "net1").exists()
    assert note_of("c1", "eth0", "wedge2").exists()
    assert json.dumps(sorted(p.name for p in note_of("c1").parent.iterdir())) == '["eth0"]'
