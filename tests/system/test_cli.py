"""The `ipward` command line, run as a subprocess against a real SQLite store."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo, Sticky
from ipward.ipam.ledger import Ledger
from ipward.ipam.pools import create_pool
from ipward.store import open_backend, open_store
from ipward.store.base import Put
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import etcd_server
from support import exec_plugin

ADD_CONFIG = {"cniVersion": "1.0.0", "name": "net", "ipam": {"type": "ipward", "pool": "web"}}


def dump(url: str) -> dict:
    with open_store(url) as store:
        return {
            kv.key: (kv.value, kv.mod_revision)
            for prefix in ("pools/", "ips/", "attach/", "blocks/", "free", "fill/", "blockcursor/")
            for kv in store.range(prefix)[0]
        }


def make_pool(url: str, *extra: str) -> None:
    run_cli(
        "pool",
        "create",
        "web",
        "--range",
        "10.9.0.0/24,gateway=10.9.0.1",
        *extra,
        store=url,
        check=True,
    )


def add(plugin, url: str, container: str, pod: str = "p", pool: str = "web") -> dict:
    config = {
        "cniVersion": "1.0.0",
        "name": "net",
        "ipam": {"type": "ipward", "store": url, "pool": pool},
    }
    out = exec_plugin(
        plugin,
        "ADD",
        config,
        container=container,
        args=f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={pod}",
    )
    assert out.returncode == 0, out
    return out.json


def test_pool_create_list_show_delete(sqlite_url):
    make_pool(sqlite_url, "--range", "fd09::/64", "--exclude", "10.9.0.100/30")
    listed = json.loads(run_cli("--json", "pool", "list", store=sqlite_url, check=True).stdout)
    assert listed[0]["name"] == "web"
    assert listed[0]["capacity"] == 253 - 4  # .1 gateway, .0/.255, four excluded
    shown = run_cli("pool", "show", "web", store=sqlite_url, check=True).stdout
    assert "10.9.0.0/24" in shown and "fd09::/64" in shown and "0.0%" in shown
    assert run_cli("pool", "delete", "web", store=sqlite_url).returncode == 0
    assert json.loads(run_cli("--json", "pool", "list", store=sqlite_url).stdout) == []


def test_bad_input_names_the_field_and_changes_nothing(sqlite_url):
    make_pool(sqlite_url)
    before = dump(sqlite_url)
    cases = [
        (["pool", "create", "x", "--range", "10.0.0.0/33"], "prefix"),
        (["pool", "create", "x", "--range", "10.0.0.0/24,gateway=10.1.0.1"], "gateway"),
        (["pool", "create", "x", "--range", "10.0.0.0/24,colour=red"], "--range"),
        (["pool", "create", "bad/name", "--range", "10.0.0.0/24"], "pool name"),
        (["pool", "create", "web", "--range", "10.0.0.0/24"], "already exists"),
        (["pool", "create", "x", "--range", "10.0.0.0/24", "--exclude", "nope"], "nope"),
        (["pool", "show", "missing"], "missing"),
        (["release", "--pool", "web", "--ip", "10.9.0.7", "--yes"], "not allocated"),
        (["release", "--pool", "web", "--ip", "not-an-ip", "--yes"], "not-an-ip"),
    ]
    for args, needle in cases:
        proc = run_cli(*args, store=sqlite_url)
        assert proc.returncode == 2, (args, proc)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout
    assert dump(sqlite_url) == before


def test_alloc_list_filters_and_shows_pods(plugin, sqlite_url):
    make_pool(sqlite_url)
    add(plugin, sqlite_url, "c1", pod="alpha")
    add(plugin, sqlite_url, "c2", pod="beta")
    rows = json.loads(run_cli("--json", "alloc", "list", store=sqlite_url, check=True).stdout)
    assert sorted(r["pod"]["name"] for r in rows) == ["alpha", "beta"]
    only = json.loads(
        run_cli("--json", "alloc", "list", "--pod", "ns/beta", store=sqlite_url).stdout
    )
    assert [r["container"] for r in only] == ["c2"]
    assert (
        json.loads(
            run_cli("--json", "alloc", "list", "--node", "elsewhere", store=sqlite_url).stdout
        )
        == []
    )
    table = run_cli("alloc", "list", store=sqlite_url).stdout
    assert "ns/alpha" in table and "10.9.0.2" in table


def test_release_refuses_when_owner_changed(plugin, sqlite_url):
    make_pool(sqlite_url, "--cooldown", "0")  # so the freed address is handed out again
    result = add(plugin, sqlite_url, "c1")
    ip = result["ips"][0]["address"].split("/")[0]
    rows = json.loads(run_cli("--json", "alloc", "list", store=sqlite_url).stdout)
    shown = rows[0]["revision"]
    # The pod goes away and another takes the same address before the operator acts.
    exec_plugin(
        plugin,
        "DEL",
        {
            "cniVersion": "1.0.0",
            "name": "net",
            "ipam": {"type": "ipward", "store": sqlite_url, "pool": "web"},
        },
        container="c1",
    )
    assert add(plugin, sqlite_url, "c2")["ips"][0]["address"].split("/")[0] == ip
    proc = run_cli(
        "release", "--pool", "web", "--ip", ip, "--revision", str(shown), store=sqlite_url
    )
    assert proc.returncode == 2 and "changed" in proc.stderr
    rows = json.loads(run_cli("--json", "alloc", "list", store=sqlite_url).stdout)
    assert [r["container"] for r in rows] == ["c2"]
    current = rows[0]["revision"]
    proc = run_cli(
        "release",
        "--pool",
        "web",
        "--ip",
        rows[0]["ip"],
        "--revision",
        str(current),
        store=sqlite_url,
    )
    assert proc.returncode == 0, proc
    assert json.loads(run_cli("--json", "alloc", "list", store=sqlite_url).stdout) == []
    assert run_cli("check", store=sqlite_url).returncode == 0


def test_check_reports_and_exits_one(plugin, sqlite_url):
    make_pool(sqlite_url)
    add(plugin, sqlite_url, "c1")
    assert run_cli("check", store=sqlite_url).returncode == 0
    with open_store(sqlite_url) as store:
        ghost = keys.attach_key("n1", "net", "ghost", "eth0")
        store.txn([], [Put(ghost, rec.encode({"ips": ["web/10.9.0.200"]}))])
    proc = run_cli("--json", "check", store=sqlite_url)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert [p["kind"] for p in report["problems"]] == ["index-dangling"]


def test_status_and_pool_delete_refuses_while_in_use(plugin, sqlite_url):
    make_pool(sqlite_url)
    add(plugin, sqlite_url, "c1")
    status = json.loads(run_cli("--json", "status", store=sqlite_url, check=True).stdout)
    assert status["pools"] == [{"name": "web", "used": 1, "capacity": 253}]
    proc = run_cli("pool", "delete", "web", store=sqlite_url)
    assert proc.returncode == 2 and "still has 1 allocation;" in proc.stderr


def test_install_cni_writes_an_isolated_launcher(cni_bin):
    launcher = (cni_bin / "ipward").read_text()
    assert launcher.startswith("#!/usr/bin/python3 -IS\n")
    assert (cni_bin / "ipward").stat().st_mode & 0o111


READ_ONLY = [
    ["status"],
    ["alloc", "list"],
    ["check"],
    ["pool", "list"],
    ["pool", "show", "web"],
    ["gc", "--dry-run", "--liveness", "sim:///nonexistent/state.json"],
    ["export"],
    ["migrate"],
]


def test_read_only_commands_never_create_a_store(tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "x.db"
    empty = tmp_path / "empty.db"
    empty.touch()
    for path in (typo, empty):
        for args in READ_ONLY:
            proc = run_cli(*args, store=f"sqlite://{path}")
            assert proc.returncode == 2, (args, proc)
            assert f"no store at sqlite://{path}" in proc.stderr, (args, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]  # no file, no dir
    assert empty.stat().st_size == 0


def test_read_only_commands_on_an_etcd_without_ipward_data_write_nothing(
    tmp_path: Path,
) -> None:
    with etcd_server(tmp_path) as server:
        with open_backend(server.url) as store:
            store.txn([], [Put("other/app/key", b"theirs")])  # another program's key
            revision = store.revision()
        for args in READ_ONLY:
            proc = run_cli(*args, store=server.url)
            assert proc.returncode == 2 and "no store at" in proc.stderr, (args, proc)
        with open_backend(server.url) as store:
            assert store.revision() == revision
        # What may create, creates: the schema key first, then the pool.
        make_pool(server.url)
        assert run_cli("status", store=server.url).returncode == 0


def test_global_options_work_after_the_command_too(sqlite_url: str, tmp_path: Path) -> None:
    make_pool(sqlite_url)
    wrong = f"sqlite://{tmp_path}/elsewhere.db"
    # IPWARD_STORE points elsewhere: the option after the command wins.
    listed = run_cli("pool", "list", "--json", "--store", sqlite_url, store=wrong, check=True)
    assert [p["name"] for p in json.loads(listed.stdout)] == ["web"]
    assert run_cli("check", "--store", sqlite_url, store=wrong).returncode == 0
    rows = run_cli("alloc", "list", "--json", store=sqlite_url, check=True)
    assert json.loads(rows.stdout) == []
    after = run_cli("--store", wrong, "status", "--store", sqlite_url, "--json", check=True)
    assert json.loads(after.stdout)["pools"][0]["name"] == "web"
    # `sim --store` keeps its own meaning (the kind of store it starts).
    assert "sqlite|etcd|etcd-cluster" in run_cli("sim", "--help").stdout
    assert not Path(f"{tmp_path}/elsewhere.db").exists()


def test_version_comes_from_the_package_metadata() -> None:
    proc = run_cli("--version", check=True)
    assert proc.stdout.strip() == f"ipward {importlib.metadata.version('ipward')}"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("etcd://127.0.0.1:99999", "port '99999'"),
        ("etcd://:2379", "host"),
        ("etcd://127.0.0.1:2379?timeout=nan", "timeout 'nan'"),
        ("sqlite:///tmp/ipward-test-x.db?mode=ro", "query (?mode=ro)"),
    ],
)
def test_bad_store_urls_name_the_part_and_create_nothing(
    url: str, needle: str, plugin: Path
) -> None:
    for args in (["status"], ["pool", "create", "web", "--range", "10.0.0.0/24"]):
        proc = run_cli(*args, store=url)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc)
    if url.startswith("sqlite://"):  # the only kind the plugin opens itself
        out = exec_plugin(
            plugin, "ADD", {**ADD_CONFIG, "ipam": {**ADD_CONFIG["ipam"], "store": url}}
        )
        assert out.returncode == 1 and out.json["code"] == 7 and needle in out.json["msg"], out
    assert not Path("/tmp/ipward-test-x.db?mode=ro").exists()
    assert not Path("/tmp/ipward-test-x.db").exists()


def test_pool_create_validation_names_the_field_and_changes_nothing(sqlite_url):
    """Findings of the hostile pass: each was accepted before."""
    make_pool(sqlite_url)
    before = dump(sqlite_url)
    cases = [
        (["--range", "10.1.0.0/24,gateway="], "gateway= has no value"),
        (["--range", "10.1.0.0/24,start="], "start= has no value"),
        (["--range", "10.1.0.0/24,end="], "end= has no value"),
        (["--range", "10.1.0.0/24", "--route", "10.0.0.0/8,via=nope"], "not an address"),
        (["--range", "10.1.0.0/24", "--route", "10.0.0.0/8,via="], "not an address"),
        (["--range", "10.1.0.0/24", "--route", "10.0.0.0/8,via=fd00::1"], "IPv6"),
        (["--range", "10.1.0.0/24", "--route", "10.0.0.0/8,gw=10.1.0.1"], "--route"),
        (["--range", "10.1.0.0/24", "--block-v6", "120"], "--block-v6"),
        (["--range", "fd01::/64", "--block-v4", "28"], "--block-v4"),
        (["--range", "0.0.0.0/0"], "wider than a pool takes"),
        (["--range", "::/0"], "wider than a pool takes"),
        (["--range", "10.0.0.0/7"], "wider than a pool takes"),
        (["--range", "10.1.0.0/24", "--cooldown", "-1"], "cooldown"),
    ]
    for options, needle in cases:
        proc = run_cli("pool", "create", "x", *options, store=sqlite_url)
        assert proc.returncode == 2, (options, proc)
        assert needle in proc.stderr, (options, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout
    assert dump(sqlite_url) == before
    # The widest accepted: a /8 (the benchmark uses 10.0.0.0/8) and an IPv6 /8.
    for name, subnet in (("big", "11.0.0.0/8"), ("big6", "fd00::/8"), ("v6", "fc00::/64")):
        assert run_cli("pool", "create", name, "--range", subnet, store=sqlite_url).returncode == 0


def test_cli_pool_keeps_the_first_address_as_gateway_unless_told(plugin, sqlite_url):
    """Found: a CLI pool without `gateway=` handed out .1, which a bridge with
    isGateway puts on itself; an inline host-local range kept it. Now both keep it,
    and `gateway=none` hands it out."""
    run_cli("pool", "create", "web", "--range", "10.9.0.0/24", store=sqlite_url, check=True)
    run_cli(
        "pool",
        "create",
        "bare",
        "--range",
        "10.8.0.0/24,gateway=none",
        store=sqlite_url,
        check=True,
    )
    run_cli("pool", "create", "p2p", "--range", "10.7.0.0/31", store=sqlite_url, check=True)
    result = add(plugin, sqlite_url, "c1")
    assert result["ips"] == [{"address": "10.9.0.2/24", "gateway": "10.9.0.1"}]
    result = add(plugin, sqlite_url, "c2", pool="bare")
    assert result["ips"] == [{"address": "10.8.0.1/24"}]
    result = add(plugin, sqlite_url, "c3", pool="p2p")
    assert result["ips"] == [{"address": "10.7.0.0/31"}]  # a /31 has no address to spare
    shown = json.loads(run_cli("--json", "pool", "show", "web", store=sqlite_url).stdout)
    assert shown["spec"]["ranges"][0][0]["gateway"] == "10.9.0.1"


def test_cli_lists_and_releases_a_sticky_reservation(sqlite_url, sqlite_store) -> None:
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]])
    create_pool(sqlite_store, spec)
    ledger = Ledger(sqlite_store, "n1")
    sandbox = Attachment("net", "sandbox1", "eth0")
    sticky = Sticky("net", "db", "db-0", ttl=600)
    ledger.allocate([spec], sandbox, PodInfo("db", "db-0", "u1"), sticky=sticky)
    rows = json.loads(run_cli("--json", "alloc", "list", store=sqlite_url, check=True).stdout)
    assert {r["sticky_state"]["state"] for r in rows} == {"bound"}
    refused = run_cli("release", "--sticky", "db/db-0", "--yes", store=sqlite_url)
    assert refused.returncode == 2 and "bound" in refused.stderr
    ledger.free(sandbox)
    table = run_cli("alloc", "list", store=sqlite_url, check=True).stdout
    assert "detached" in table and "TTL" in table
    bad = run_cli("release", "--sticky", "db-0", store=sqlite_url)
    assert bad.returncode == 2 and "NAMESPACE/NAME" in bad.stderr
    done = run_cli("--json", "release", "--sticky", "db/db-0", "--yes", store=sqlite_url)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["ips"]) == 2
    assert sqlite_store.range("ips/")[0] == []
    assert run_cli("check", store=sqlite_url).returncode == 0


def test_pool_create_warns_when_not_borrowing_leaves_registered_nodes_without_a_block(
    sqlite_url: str,
) -> None:
    """Three agents registered; a /28 pool in the default /26 blocks is one block. Not
    borrowing (an explicit choice now), two nodes could never take an address from it:
    the pool is made, with a warning that says so and what to change. Borrowing (the
    default), no warning."""
    with open_store(sqlite_url) as store:
        store.txn([], [Put(keys.node_key(f"n{i}"), b"{}") for i in range(3)])
    limited = run_cli(
        "pool", "create", "tiny", "--range", "10.249.0.0/28", "--no-borrow", store=sqlite_url
    )
    assert limited.returncode == 0, limited.stderr
    assert "warning: pool tiny does not borrow and has 1 IPv4 block of /26: at most 1 of 3" in (
        limited.stderr
    )
    fine = run_cli("pool", "create", "small", "--range", "10.249.1.0/28", store=sqlite_url)
    assert fine.returncode == 0 and "warning" not in fine.stderr, fine.stderr
