"""The store's schema version and the stores that are not ipward's to use: every process
(plugin, agent, controller, CLI) refuses them with a permanent error (CNI code 106, CLI
exit status 2) and changes nothing; `ipward migrate` brings an old store up."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.records import Attachment, PodInfo, Sticky
from ipward.ipam.ledger import Ledger
from ipward.store import open_backend, open_store, schema
from ipward.store.base import Delete, Put
from ipward_lab import fleet
from ipward_lab.fleet import IPWARD, run_cli
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.waiting import wait_for
from support import exec_plugin

INCOMPATIBLE = 106


@pytest.fixture(params=["sqlite", "etcd"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL with nothing there yet: a path, or an etcd of its own."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path}/store/ipward.db"
        return
    with etcd_server(tmp_path / "etcd") as server:
        yield server.url


def dump(url: str) -> tuple[dict[str, bytes], int]:
    """Every key and the revision, read without opening the store the ipward way (which
    would mark an old SQLite file)."""
    if url.startswith("sqlite://"):
        with sqlite3.connect(f"file:{url[len('sqlite://') :]}?mode=ro", uri=True) as db:
            kvs = dict(db.execute("SELECT key, value FROM kv"))
            (revision,) = db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        return kvs, revision
    with open_backend(url) as store:  # an etcd of the test's own: every key is ipward's
        kvs_list, revision = store.range("")
    return {kv.key: kv.value for kv in kvs_list}, revision


def config(url: str, **ipam: object) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": url, "pool": "web", **ipam},
    }


def fill(url: str, sticky: bool = False) -> None:
    """A ledger as ipward writes it: a dual-stack pool, allocations, one released; with
    `sticky`, one more held for a StatefulSet pod (its reservation)."""
    run_cli(
        "pool",
        "create",
        "web",
        "--range",
        "10.9.0.0/24",
        "--range",
        "fd09::/64",
        store=url,
        check=True,
    )
    with open_store(url) as store:
        ledger = Ledger(store, "n1")
        spec = ledger.get_pool("web")
        for i in range(3):
            ledger.allocate(
                [spec], Attachment("net", f"c{i}", "eth0"), PodInfo("ns", f"p{i}", f"u{i}")
            )
        ledger.free(Attachment("net", "c0", "eth0"))
        if sticky:
            identity = Sticky("net", "ns", "db-0", owner_kind="StatefulSet", owner_name="db")
            pod = PodInfo("ns", "db-0", "u-db")
            ledger.allocate([spec], Attachment("net", "s0", "eth0"), pod, sticky=identity)


def make_unversioned(url: str) -> None:
    """Turn the store into one made before the schema key existed (version 0): no key,
    and on SQLite no mark in the file, exactly as the code before both wrote it."""
    with open_backend(url) as store:
        assert store.txn([], [Delete(keys.SCHEMA_KEY)]).succeeded
    if url.startswith("sqlite://"):
        with sqlite3.connect(url[len("sqlite://") :]) as db:
            db.execute("PRAGMA application_id = 0")
            db.execute("PRAGMA user_version = 0")


def start_agent(url: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return run_cli(
        "agent",
        "--node",
        "n1",
        "--socket",
        str(tmp_path / "agent.sock"),
        "--metrics-address",
        "off",
        store=url,
    )


def start_controller(url: str) -> subprocess.CompletedProcess:
    return run_cli("controller", "--metrics-address", "off", "--interval", "0.1", store=url)


def refused_everywhere(url: str, tmp_path: Path, plugin: Path, needles: list[str]) -> None:
    """Plugin (on SQLite), agent, controller and CLI refuse the store naming `needles`,
    and nothing in it changes."""
    before = dump(url)
    if url.startswith("sqlite://"):
        for command in ("ADD", "DEL", "CHECK"):
            out = exec_plugin(plugin, command, config(url), container="c9")
            assert out.returncode == 1 and out.json["code"] == INCOMPATIBLE, (command, out)
            assert all(n in out.json["msg"] for n in needles), out.json
    for proc in (
        start_agent(url, tmp_path),
        start_controller(url),
        run_cli("status", store=url),
        run_cli("alloc", "list", store=url),
        run_cli("check", store=url),
        run_cli("export", store=url),
        run_cli("pool", "create", "other", "--range", "10.8.0.0/24", store=url),
    ):
        assert proc.returncode == 2, proc
        assert all(n in proc.stderr for n in needles), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "agent.sock").exists()
    assert dump(url) == before


def test_a_new_store_gets_the_schema_key_as_its_first_write(url: str) -> None:
    with open_store(url) as store:
        kv = store.get(keys.SCHEMA_KEY)
        assert kv is not None and json.loads(kv.value) == {"version": schema.VERSION}
        watch = store.watch("", 1)
        try:
            first = next(iter(watch))
        finally:
            watch.cancel()
    assert first.kv.key == keys.SCHEMA_KEY


def test_a_store_from_before_the_schema_key_is_refused_until_migrated(
    url: str, tmp_path: Path, plugin: Path
) -> None:
    fill(url)
    kept = {k: v for k, v in dump(url)[0].items() if k != keys.SCHEMA_KEY}
    make_unversioned(url)
    refused_everywhere(url, tmp_path, plugin, ["schema version 0", "ipward migrate"])

    # Two at once, as two operators might: both succeed, the step is applied once.
    procs = [
        subprocess.Popen(
            [*IPWARD, "--json", "--store", url, "migrate"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(v for r in results for v in r["steps"]) == [1, 2, 3]  # each step once
    again = run_cli("migrate", store=url, check=True)
    assert "nothing to do" in again.stdout

    kvs, _ = dump(url)
    assert json.loads(kvs.pop(keys.SCHEMA_KEY)) == {"version": schema.VERSION}
    assert kvs == kept  # the migration wrote the key and nothing else
    assert run_cli("check", store=url).returncode == 0
    listed = json.loads(run_cli("--json", "alloc", "list", store=url, check=True).stdout)
    assert sorted(r["container"] for r in listed) == ["c1", "c1", "c2", "c2"]
    if url.startswith("sqlite://"):
        out = exec_plugin(plugin, "ADD", config(url), container="c9")
        assert out.returncode == 0, out
        with sqlite3.connect(url[len("sqlite://") :]) as db:
            marks = db.execute("SELECT * FROM pragma_application_id(), pragma_user_version()")
            assert marks.fetchone() != (0, 0)  # the file is marked as ipward's again


def test_a_newer_schema_is_refused_naming_both_versions(
    url: str, tmp_path: Path, plugin: Path
) -> None:
    fill(url)
    with open_store(url) as store:
        store.txn([], [Put(keys.SCHEMA_KEY, schema.record(schema.VERSION + 41))])
    needles = [f"schema version {schema.VERSION + 41}", f"({schema.VERSION})", "upgrade ipward"]
    refused_everywhere(url, tmp_path, plugin, needles)
    migrate = run_cli("migrate", store=url)
    assert migrate.returncode == 2 and all(n in migrate.stderr for n in needles)


def as_version_1(url: str) -> list[str]:
    """Turn the store into one of schema version 1 (no node index); the entries it had."""
    with open_backend(url) as store:
        entries = [kv.key for kv in store.range(keys.node_ips_prefix())[0]]
        ops = [Delete(key) for key in entries] + [Put(keys.SCHEMA_KEY, schema.record(1))]
        assert store.txn([], ops).succeeded
    return entries


def node_index(url: str) -> list[str]:
    return sorted(key for key in dump(url)[0] if key.startswith(keys.node_ips_prefix()))


def test_a_version_1_store_gets_its_node_index_from_migrate_with_no_process_running(
    url: str, tmp_path: Path, plugin: Path
) -> None:
    fill(url)
    entries = as_version_1(url)
    assert len(entries) == 4  # c1 and c2, dual stack
    refused_everywhere(url, tmp_path, plugin, ["schema version 1", "ipward migrate"])
    # A running agent of version 1 would write records without their entries: refused.
    with open_backend(url) as store:
        lease = store.lease_grant(60)
        assert store.txn([], [Put(keys.node_key("n1"), b"{}", lease=lease)]).succeeded
        before = dump(url)
        refused = run_cli("migrate", store=url)
        assert refused.returncode == 2 and "stop them first" in refused.stderr, refused
        assert keys.node_key("n1") in refused.stderr and dump(url) == before
        store.lease_revoke(lease)
    done = json.loads(run_cli("--json", "migrate", store=url, check=True).stdout)
    assert done["found"] == 1 and done["steps"] == [2, 3]
    assert node_index(url) == sorted(entries)
    assert json.loads(dump(url)[0][keys.SCHEMA_KEY]) == {"version": schema.VERSION}
    assert run_cli("check", store=url).returncode == 0


def test_an_interrupted_index_build_is_refused_until_migrate_finishes_it(
    url: str, tmp_path: Path, plugin: Path
) -> None:
    """A migrate stopped after its bump (the store says version 2, building) leaves a
    store every process refuses; the next `ipward migrate` completes the index."""
    fill(url)
    entries = as_version_1(url)
    with open_backend(url) as store:
        half = [Put(entries[0], b""), Put(keys.SCHEMA_KEY, schema.record(2, building="index"))]
        assert store.txn([], half).succeeded
    refused_everywhere(url, tmp_path, plugin, ["being migrated", "ipward migrate"])
    done = json.loads(run_cli("--json", "migrate", store=url, check=True).stdout)
    assert done["found"] == 2 and done["steps"] == [2, 3]
    assert node_index(url) == sorted(entries)
    assert run_cli("check", store=url).returncode == 0


def as_version_2(url: str) -> dict[str, str]:
    """Turn the store into one of schema version 2: each attachment index where version
    2 kept it, `attach/<network>/<container>/<ifname>`, and each reservation naming its
    sandbox by that key; the keys each index had (old -> new)."""
    moved = {}
    with open_backend(url) as store:
        ops: list[Put | Delete] = [Put(keys.SCHEMA_KEY, schema.record(2))]
        for kv in store.range(keys.ATTACHMENTS)[0]:
            _, network, container, ifname = keys.attach_parts(kv.key)
            old = f"{keys.ATTACHMENTS}{network}/{container}/{ifname}"
            moved[old] = kv.key
            ops += [Delete(kv.key), Put(old, kv.value)]
        for kv in store.range(keys.STICKY)[0]:
            held = rec.ReservationRecord.decode(kv.value)
            _, network, container, ifname = keys.attach_parts(held.attachment)
            held.attachment = f"{keys.ATTACHMENTS}{network}/{container}/{ifname}"
            ops.append(Put(kv.key, held.encode()))
        assert store.txn([], ops).succeeded
    return moved


def test_a_version_2_store_gets_its_attachment_index_under_nodes_from_migrate(
    url: str, tmp_path: Path, plugin: Path
) -> None:
    """Version 3 keeps an attachment's index under its node; a version 2 store is
    refused until `ipward migrate` (no process running) moves each index, and a
    reservation's name of its sandbox with it. A retried ADD then answers what the
    attachment holds; `ipward check` finds nothing wrong."""
    fill(url, sticky=True)
    moved = as_version_2(url)
    assert moved and all(old != new for old, new in moved.items())
    refused_everywhere(url, tmp_path, plugin, ["schema version 2", "ipward migrate"])
    with open_backend(url) as store:
        lease = store.lease_grant(60)
        assert store.txn([], [Put(keys.node_key("n1"), b"{}", lease=lease)]).succeeded
        refused = run_cli("migrate", store=url)
        assert refused.returncode == 2 and "stop them first" in refused.stderr, refused
        store.lease_revoke(lease)
    done = json.loads(run_cli("--json", "migrate", store=url, check=True).stdout)
    assert done["found"] == 2 and done["steps"] == [3]
    index = sorted(k for k in dump(url)[0] if k.startswith(keys.ATTACHMENTS))
    assert index == sorted(moved.values())
    with open_backend(url) as store:
        for kv in store.range(keys.STICKY)[0]:
            assert rec.ReservationRecord.decode(kv.value).attachment in moved.values()
    assert run_cli("check", store=url).returncode == 0
    if url.startswith("sqlite://"):
        listed = json.loads(run_cli("--json", "alloc", "list", store=url, check=True).stdout)
        held = {r["ip"] for r in listed if r["container"] == "c1"}
        out = exec_plugin(plugin, "ADD", config(url, node="n1"), container="c1")
        assert out.returncode == 0, out
        assert {ip["address"].split("/")[0] for ip in out.json["ips"]} == held


def garbage(path: Path) -> None:
    path.write_text("log line\n" * 100)


def other_programs_database(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
    sqlite3.connect(path).close()


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (garbage, "not an SQLite database"),
        (other_programs_database, "not ipward's"),
        (Path.mkdir, "is a directory"),
    ],
    ids=["garbage", "other-program", "directory"],
)
def test_a_store_that_is_not_ipwards_is_a_permanent_error(
    tmp_path: Path, plugin: Path, make: Callable[[Path], object], needle: str
) -> None:
    path = tmp_path / "ipward.db"
    make(path)
    url = f"sqlite://{path}"

    def files() -> list[tuple[str, bytes]]:
        return sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in tmp_path.iterdir())

    before = files()
    for command in ("ADD", "DEL", "CHECK", "GC"):
        cfg = {**config(url), "cniVersion": "1.1.0", "cni.dev/valid-attachments": []}
        out = exec_plugin(plugin, command, cfg)
        assert out.returncode == 1 and out.json["code"] == INCOMPATIBLE, (command, out)
        assert needle in out.json["msg"]
    for args in (["status"], ["pool", "create", "web", "--range", "10.0.0.0/24"], ["migrate"]):
        proc = run_cli(*args, store=url)
        assert proc.returncode == 2 and needle in proc.stderr, proc
    assert start_agent(url, tmp_path).returncode == 2
    assert files() == before


def test_dev_null_is_not_a_store(plugin: Path) -> None:
    out = exec_plugin(plugin, "ADD", config("sqlite:///dev/null"))
    assert out.returncode == 1 and out.json["code"] == INCOMPATIBLE, out
    assert "not a regular file" in out.json["msg"]


def test_many_first_uses_at_once_make_one_store(tmp_path: Path, plugin: Path) -> None:
    url = f"sqlite://{tmp_path}/new/ipward.db"
    inline = {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": url, "subnet": "10.7.0.0/24"},
    }
    procs = {
        c: subprocess.Popen(
            [str(plugin)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={
                "CNI_COMMAND": "ADD",
                "CNI_CONTAINERID": c,
                "CNI_IFNAME": "eth0",
                "CNI_NETNS": "/x",
                "CNI_PATH": str(plugin.parent),
            },
        )
        for c in (f"c{i}" for i in range(8))
    }
    answers = {
        c: json.loads(p.communicate(json.dumps(inline).encode(), timeout=60)[0])
        for c, p in procs.items()
    }
    assert all(p.returncode == 0 for p in procs.values()), answers
    assert len({a["ips"][0]["address"] for a in answers.values()}) == len(procs)
    kvs, _ = dump(url)
    assert json.loads(kvs[keys.SCHEMA_KEY]) == {"version": schema.VERSION}
    assert run_cli("check", store=url).returncode == 0


def test_an_agent_waits_for_a_store_it_cannot_reach_and_checks_it_before_serving(
    tmp_path: Path, plugin: Path
) -> None:
    """The store is down when the agent starts: it waits (logged) and serves nothing, so
    the plugin answers 11 meanwhile; once the store answers and its schema is checked,
    the agent serves."""
    with etcd_server(tmp_path / "etcd") as server:
        run_cli("pool", "create", "web", "--range", "10.9.0.0/24", store=server.url, check=True)
        server.stop()
        agent = fleet.Agent("n1", server.url, tmp_path / "agent.sock", tmp_path, metrics=False)
        try:
            wait_for(lambda: agent.logged("store unreachable at start; waiting for it"), "wait")
            cfg = config("", agentSocket=str(agent.socket))
            out = exec_plugin(plugin, "ADD", cfg)
            assert out.returncode == 1 and out.json["code"] == 11, out
            assert not agent.socket.exists()
            server.start()
            server.wait_ready()
            agent.wait_ready()
            assert exec_plugin(plugin, "ADD", cfg).returncode == 0
            assert agent.stop() == 0
        finally:
            agent.kill()
