"""CNI plugin spec tests: exec the installed `ipward` executable the way a runtime does
(CNI_* environment, network config on stdin) against a real SQLite store in tmp_path.

Nothing is mocked. The store is read back with the sqlite3 module (read-only) to check
what each call changed, and every test that writes ends with `ipward check`.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from ipward_lab.fleet import run_cli
from support import PluginResult, exec_plugin

SUPPORTED = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
HOST = os.uname().nodename  # the plugin's node in single-node mode (config `node` unset)
V4 = {"ranges": [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}]]}
# GC and STATUS are not about one attachment: runtimes leave these unset.
NO_ATTACHMENT = {"CNI_CONTAINERID": None, "CNI_IFNAME": None, "CNI_NETNS": None}


# -- helpers ----------------------------------------------------------------------------


def net_config(
    url: str, ipam: dict | None = None, *, version: str = "1.0.0", name: str = "net1", **top
) -> dict:
    """A network config whose ipam section uses `url` as its store."""
    section = {"type": "ipward", "store": url, **(V4 if ipam is None else ipam)}
    return {"cniVersion": version, "name": name, "ipam": section, **top}


def add(plugin: Path, config: dict, container: str = "c0", **kw) -> PluginResult:
    res = exec_plugin(plugin, "ADD", config, container=container, **kw)
    assert res.returncode == 0, res
    assert res.json is not None and res.json["ips"], res
    return res


def addresses(res: PluginResult) -> list[str]:
    return [ip["address"] for ip in res.json["ips"]]


def bare(address: str) -> str:
    return address.split("/")[0]


def db_path(url: str) -> str:
    return url.removeprefix("sqlite://")


def dump(url: str) -> tuple[int, list[tuple]] | None:
    """The whole store: its revision and every kv row (read-only; None if no file)."""
    path = db_path(url)
    if not os.path.exists(path):
        return None
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT key, value, create_revision, mod_revision, version, lease FROM kv ORDER BY key"
        ).fetchall()
        revision = conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0]
    finally:
        conn.close()
    return revision, rows


def keys(url: str, prefix: str = "") -> dict[str, dict | None]:
    """Keys under `prefix` with their decoded values (None for empty values)."""
    snapshot = dump(url)
    assert snapshot is not None
    return {k: (json.loads(v) if v else None) for k, v, *_ in snapshot[1] if k.startswith(prefix)}


def rows_of(url: str, network: str) -> list[tuple]:
    """Every row of one inline network: its pool, blocks, records, index, free queue."""
    snapshot = dump(url)
    assert snapshot is not None
    return [row for row in snapshot[1] if row[0].split("/")[1:2] == [network]]


def assert_cni_error(res: PluginResult, code: int, version: str | None = None) -> dict:
    """A CNI error: non-zero exit, exactly one JSON error object on stdout, no traceback."""
    assert res.returncode != 0, res
    assert b"Traceback" not in res.stdout, res
    assert len(res.stdout.strip().splitlines()) == 1, res
    err = res.json
    assert isinstance(err, dict), res
    assert set(err) <= {"cniVersion", "code", "msg", "details"}, err
    assert err["code"] == code, res
    assert isinstance(err["msg"], str) and err["msg"], err
    assert err["cniVersion"] in SUPPORTED, err
    if version is not None:
        assert err["cniVersion"] == version, err
    return err


def assert_consistent(url: str) -> None:
    proc = run_cli("check", store=url)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def alloc_list(url: str) -> list[dict]:
    proc = run_cli("--json", "alloc", "list", store=url)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if proc.stdout.strip().startswith("[") else []


def create_pool(url: str, name: str, *options: str) -> None:
    proc = run_cli("pool", "create", name, *options, store=url)
    assert proc.returncode == 0, proc.stderr


def prepare(plugin: Path, url: str) -> None:
    """A store that exists and holds one allocation, so 'unchanged' means something."""
    add(plugin, net_config(url), container="keeper")


# -- ADD result format per cniVersion ----------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED)
def test_add_result_format(plugin: Path, sqlite_url: str, version: str) -> None:
    routes = [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.0.0.254"}]
    dns = {"nameservers": ["10.0.0.53"], "domain": "example.org", "search": ["example.org"]}
    ipam = {
        "ranges": [
            [{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}],
            [{"subnet": "fd00:10::/64", "gateway": "fd00:10::1"}],
        ],
        "routes": routes,
        "dns": dns,
    }
    res = add(plugin, net_config(sqlite_url, ipam, version=version))
    result = res.json
    assert res.stdout.count(b"\n") <= 1  # one document, nothing else on stdout
    assert set(result) == {"cniVersion", "ips", "routes", "dns"}
    assert result["cniVersion"] == version
    assert result["routes"] == routes
    assert result["dns"] == dns
    v4, v6 = result["ips"]
    assert v4["address"] == "10.0.0.2/24" and v4["gateway"] == "10.0.0.1"
    assert v6["address"].endswith("/64") and v6["address"].startswith("fd00:10::")
    assert v6["gateway"] == "fd00:10::1"
    if version.startswith("0."):
        assert v4["version"] == "4" and v6["version"] == "6"
    else:
        assert "version" not in v4 and "version" not in v6
    for entry in (v4, v6):
        assert "interface" not in entry  # an IPAM plugin knows no interfaces
    assert_consistent(sqlite_url)


@pytest.mark.parametrize("version", ["0.3.1", "1.1.0"])
def test_add_result_without_gateway_routes_dns(plugin: Path, sqlite_url: str, version: str) -> None:
    ipam = {"range": "10.0.0.0/24"}  # whereabouts: no gateway unless one is given
    result = add(plugin, net_config(sqlite_url, ipam, version=version)).json
    assert set(result) == {"cniVersion", "ips"}
    (entry,) = result["ips"]
    assert "gateway" not in entry
    assert entry["address"] == "10.0.0.1/24"


@pytest.mark.parametrize(
    "ipam",
    [
        pytest.param({"ranges": [[{"subnet": "10.0.0.0/24"}]]}, id="ranges"),
        pytest.param({"subnet": "10.0.0.0/24"}, id="subnet"),
        pytest.param({"ranges": [[{"subnet": "fd00::/64"}]]}, id="ipv6"),
    ],
)
def test_host_local_range_without_gateway_keeps_the_first_address(
    plugin: Path, sqlite_url: str, ipam: dict
) -> None:
    """As host-local: the subnet's first address is the gateway, never a pod's (a bridge
    with isGateway takes it; found by the containerd end-to-end test)."""
    result = add(plugin, net_config(sqlite_url, ipam)).json
    (entry,) = result["ips"]
    first = "fd00::1" if "fd00" in json.dumps(ipam) else "10.0.0.1"
    assert entry["gateway"] == first
    assert entry["address"].split("/")[0] != first


# -- dialects -------------------------------------------------------------------------

# One network, 10.0.0.10-10.0.0.12 of 10.0.0.0/24 with gateway 10.0.0.1, in each dialect.
DIALECTS = {
    "host-local-ranges": {
        "ranges": [
            [
                {
                    "subnet": "10.0.0.0/24",
                    "rangeStart": "10.0.0.10",
                    "rangeEnd": "10.0.0.12",
                    "gateway": "10.0.0.1",
                }
            ]
        ]
    },
    "host-local-subnet": {
        "subnet": "10.0.0.0/24",
        "rangeStart": "10.0.0.10",
        "rangeEnd": "10.0.0.12",
        "gateway": "10.0.0.1",
    },
    "whereabouts-range": {
        "range": "10.0.0.0/24",
        "range_start": "10.0.0.10",
        "range_end": "10.0.0.12",
        "gateway": "10.0.0.1",
    },
    "whereabouts-first-last": {"range": "10.0.0.10-10.0.0.12/24", "gateway": "10.0.0.1"},
    "whereabouts-ipRanges": {
        "ipRanges": [
            {"range": "10.0.0.0/24", "range_start": "10.0.0.10", "range_end": "10.0.0.12"}
        ],
        "gateway": "10.0.0.1",
    },
    "named-pool": {"pool": "p1"},
}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_dialects_behave_the_same(plugin: Path, sqlite_url: str, dialect: str) -> None:
    if dialect == "named-pool":
        create_pool(
            sqlite_url, "p1", "--range", "10.0.0.0/24,start=10.0.0.10,end=10.0.0.12,gw=10.0.0.1"
        )
    config = net_config(sqlite_url, DIALECTS[dialect])
    got = []
    for i in range(3):
        (entry,) = add(plugin, config, container=f"c{i}").json["ips"]
        assert entry["gateway"] == "10.0.0.1"
        got.append(entry["address"])
    assert sorted(got) == ["10.0.0.10/24", "10.0.0.11/24", "10.0.0.12/24"]
    before = dump(sqlite_url)
    assert_cni_error(exec_plugin(plugin, "ADD", config, container="c3"), 100, "1.0.0")
    assert dump(sqlite_url) == before
    assert len(keys(sqlite_url, "ips/")) == 3
    assert_consistent(sqlite_url)


def test_host_local_ranges_dual_stack(plugin: Path, sqlite_url: str) -> None:
    ipam = {"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]]}
    got = []
    for container in ("a", "b"):
        v4, v6 = addresses(add(plugin, net_config(sqlite_url, ipam), container=container))
        assert v4.startswith("10.0.0.") and v4.endswith("/24")
        assert v6.startswith("fd00::") and v6.endswith("/64")
        got += [v4, v6]
    assert len(set(got)) == 4
    assert len(keys(sqlite_url, "ips/")) == 4
    index = keys(sqlite_url, "attach/")
    assert {k: len(v["ips"]) for k, v in index.items()} == {
        f"attach/{HOST}/net1/a/eth0": 2,
        f"attach/{HOST}/net1/b/eth0": 2,
    }
    assert_consistent(sqlite_url)


def test_host_local_several_ranges_in_one_set_give_one_address(
    plugin: Path, sqlite_url: str
) -> None:
    # Each /29 keeps .1 for its gateway (host-local's default) and hands out .2-.6.
    ipam = {"ranges": [[{"subnet": "10.0.0.0/29"}, {"subnet": "10.0.1.0/29"}]]}
    got = [
        addresses(add(plugin, net_config(sqlite_url, ipam), container=f"c{i}")) for i in range(10)
    ]
    assert all(len(a) == 1 for a in got)
    assert sorted(a[0] for a in got) == [
        f"10.0.{net}.{host}/29" for net in (0, 1) for host in range(2, 7)
    ]
    assert_cni_error(exec_plugin(plugin, "ADD", net_config(sqlite_url, ipam), container="x"), 100)
    assert_consistent(sqlite_url)


def test_whereabouts_exclude_never_handed_out(plugin: Path, sqlite_url: str) -> None:
    ipam = {
        "range": "10.2.0.0/28",
        "range_start": "10.2.0.2",
        "range_end": "10.2.0.12",
        "exclude": ["10.2.0.4/30", "10.2.0.9/32", "10.2.0.11"],
        "gateway": "10.2.0.1",
    }
    config = net_config(sqlite_url, ipam)
    got = set()
    for i in range(20):
        res = exec_plugin(plugin, "ADD", config, container=f"c{i}")
        if res.returncode != 0:
            assert_cni_error(res, 100)
            break
        got.add(bare(addresses(res)[0]))
    else:
        pytest.fail("the pool never ran out")
    assert got == {"10.2.0.2", "10.2.0.3", "10.2.0.8", "10.2.0.10", "10.2.0.12"}
    assert_consistent(sqlite_url)


def test_whereabouts_requested_excluded_address_refused(plugin: Path, sqlite_url: str) -> None:
    ipam = {"range": "10.2.0.0/24", "exclude": ["10.2.0.100/30"]}
    add(plugin, net_config(sqlite_url, ipam), container="keeper")
    before = dump(sqlite_url)
    config = net_config(sqlite_url, ipam, runtimeConfig={"ips": ["10.2.0.101/24"]})
    assert_cni_error(exec_plugin(plugin, "ADD", config, container="x"), 102)
    assert dump(sqlite_url) == before


def test_whereabouts_ip_ranges_dual_stack(plugin: Path, sqlite_url: str) -> None:
    ipam = {
        "ipRanges": [
            {"range": "10.4.0.0/24", "exclude": ["10.4.0.1/32"]},
            {"range": "fd04::/64", "exclude": ["fd04::1/128"]},
        ]
    }
    v4, v6 = addresses(add(plugin, net_config(sqlite_url, ipam)))
    assert v4 == "10.4.0.2/24"
    assert v6 == "fd04::2/64"
    assert_consistent(sqlite_url)


def test_whereabouts_ip_ranges_dual_stack_with_top_level_gateway(
    plugin: Path, sqlite_url: str
) -> None:
    ipam = {"ipRanges": [{"range": "10.4.0.0/24"}, {"range": "fd04::/64"}], "gateway": "10.4.0.1"}
    res = exec_plugin(plugin, "ADD", net_config(sqlite_url, ipam))
    assert res.returncode == 0, res
    v4, v6 = res.json["ips"]
    assert v4["gateway"] == "10.4.0.1"
    assert bare(v4["address"]) != "10.4.0.1"
    assert v6.get("gateway") in (None, "")  # an IPv4 gateway is not an IPv6 route


def test_named_pool_routes_and_ipam_routes(plugin: Path, sqlite_url: str) -> None:
    create_pool(
        sqlite_url,
        "p1",
        "--range",
        "10.8.0.0/24,gateway=10.8.0.1",
        "--route",
        "0.0.0.0/0,via=10.8.0.1",
    )
    result = add(plugin, net_config(sqlite_url, {"pool": "p1"})).json
    assert result["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.8.0.1"}]
    assert result["ips"] == [{"address": "10.8.0.2/24", "gateway": "10.8.0.1"}]
    # Routes of the ipam section take the place of the pool's.
    own = [{"dst": "10.0.0.0/8"}]
    result = add(plugin, net_config(sqlite_url, {"pool": "p1", "routes": own}), container="b").json
    assert result["routes"] == own
    assert_consistent(sqlite_url)


def test_named_pool_shared_by_two_networks(plugin: Path, sqlite_url: str) -> None:
    create_pool(sqlite_url, "shared", "--range", "10.9.0.0/29")
    got = set()
    for network in ("neta", "netb"):
        for container in ("a", "b"):
            config = net_config(sqlite_url, {"pool": "shared"}, name=network)
            got.update(addresses(add(plugin, config, container=container)))
    assert len(got) == 4  # one address space: no address twice
    assert_consistent(sqlite_url)


def test_inline_network_named_like_cli_pool_is_invalid_config(
    plugin: Path, sqlite_url: str
) -> None:
    create_pool(sqlite_url, "net1", "--range", "10.8.0.0/24")
    before = dump(sqlite_url)
    res = exec_plugin(plugin, "ADD", net_config(sqlite_url))  # inline ranges, name net1
    assert_cni_error(res, 7, "1.0.0")
    assert dump(sqlite_url) == before


# -- idempotency and DEL ----------------------------------------------------------------


def test_add_is_idempotent(plugin: Path, sqlite_url: str) -> None:
    ipam = {"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]]}
    first = add(plugin, net_config(sqlite_url, ipam), container="a")
    before = dump(sqlite_url)
    second = add(plugin, net_config(sqlite_url, ipam), container="a")
    assert second.json == first.json
    assert dump(sqlite_url) == before  # a retried ADD writes nothing
    assert len(keys(sqlite_url, "ips/")) == 2
    assert list(keys(sqlite_url, "attach/")) == [f"attach/{HOST}/net1/a/eth0"]
    # A requested address does not move an attachment that already has one.
    config = net_config(sqlite_url, ipam, runtimeConfig={"ips": ["10.0.0.77/24"]})
    assert add(plugin, config, container="a").json == first.json
    assert dump(sqlite_url) == before
    assert_consistent(sqlite_url)


def test_other_ifname_is_another_attachment(plugin: Path, sqlite_url: str) -> None:
    eth0 = addresses(add(plugin, net_config(sqlite_url), container="a", ifname="eth0"))
    net1 = addresses(add(plugin, net_config(sqlite_url), container="a", ifname="net1"))
    assert eth0 != net1
    assert set(keys(sqlite_url, "attach/")) == {
        f"attach/{HOST}/net1/a/eth0",
        f"attach/{HOST}/net1/a/net1",
    }
    assert_consistent(sqlite_url)


def test_del_unknown_attachment_succeeds(plugin: Path, sqlite_url: str) -> None:
    prepare(plugin, sqlite_url)
    before = dump(sqlite_url)
    res = exec_plugin(plugin, "DEL", net_config(sqlite_url), container="never-added")
    assert res.returncode == 0, res
    assert res.stdout == b""
    assert dump(sqlite_url) == before


def test_del_frees_and_repeated_del_changes_nothing(plugin: Path, sqlite_url: str) -> None:
    prepare(plugin, sqlite_url)
    ip = bare(addresses(add(plugin, net_config(sqlite_url), container="a"))[0])
    res = exec_plugin(plugin, "DEL", net_config(sqlite_url), container="a")
    assert res.returncode == 0 and res.stdout == b"", res
    assert f"ips/net1/{ip}" not in keys(sqlite_url, "ips/")
    assert f"attach/{HOST}/net1/a/eth0" not in keys(sqlite_url, "attach/")
    assert f"free/net1/{ip}" in keys(sqlite_url, "free/")
    assert any(k.endswith(f"/{ip}") for k in keys(sqlite_url, "freeq/"))
    assert "ips/net1/10.0.0.2" in keys(sqlite_url, "ips/")  # the keeper is untouched
    after_first = dump(sqlite_url)
    for _ in range(2):
        res = exec_plugin(plugin, "DEL", net_config(sqlite_url), container="a")
        assert res.returncode == 0 and res.stdout == b"", res
        assert dump(sqlite_url) == after_first
    assert_cni_error(exec_plugin(plugin, "CHECK", net_config(sqlite_url), container="a"), 3)
    assert_consistent(sqlite_url)


def test_del_without_netns_succeeds(plugin: Path, sqlite_url: str) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    res = exec_plugin(plugin, "DEL", net_config(sqlite_url), container="a", env={"CNI_NETNS": None})
    assert res.returncode == 0 and res.stdout == b"", res
    assert keys(sqlite_url, "ips/") == {}
    assert_consistent(sqlite_url)


def test_del_after_failed_add(plugin: Path, sqlite_url: str) -> None:
    taken = bare(addresses(add(plugin, net_config(sqlite_url), container="owner"))[0])
    config = net_config(sqlite_url, runtimeConfig={"ips": [taken]})
    before = dump(sqlite_url)
    assert_cni_error(exec_plugin(plugin, "ADD", config, container="x"), 101)
    assert dump(sqlite_url) == before
    res = exec_plugin(plugin, "DEL", config, container="x")
    assert res.returncode == 0 and res.stdout == b"", res
    assert dump(sqlite_url) == before  # the owner's address stays the owner's
    res = exec_plugin(plugin, "CHECK", net_config(sqlite_url), container="owner")
    assert res.returncode == 0, res
    assert_consistent(sqlite_url)


def test_freed_address_cools_down(plugin: Path, sqlite_url: str) -> None:
    first = addresses(add(plugin, net_config(sqlite_url), container="a"))
    assert exec_plugin(plugin, "DEL", net_config(sqlite_url), container="a").returncode == 0
    second = addresses(add(plugin, net_config(sqlite_url), container="b"))
    assert second != first  # other addresses are free: the freed one waits
    assert_consistent(sqlite_url)


# -- requested addresses -----------------------------------------------------------------


def test_requested_via_runtime_config(plugin: Path, sqlite_url: str) -> None:
    config = net_config(sqlite_url, runtimeConfig={"ips": ["10.0.0.50/24"]})
    res = add(plugin, config)
    assert res.json["ips"] == [{"address": "10.0.0.50/24", "gateway": "10.0.0.1"}]
    (row,) = alloc_list(sqlite_url)
    assert row["ip"] == "10.0.0.50" and row["requested"] is True
    assert_consistent(sqlite_url)


def test_requested_via_cni_args(plugin: Path, sqlite_url: str) -> None:
    res = add(plugin, net_config(sqlite_url), args="IgnoreUnknown=1;IP=10.0.0.51")
    assert addresses(res) == ["10.0.0.51/24"]
    assert_consistent(sqlite_url)


def test_requested_via_args_cni_ips(plugin: Path, sqlite_url: str) -> None:
    config = net_config(sqlite_url, args={"cni": {"ips": ["10.0.0.52"]}})
    assert addresses(add(plugin, config)) == ["10.0.0.52/24"]
    assert_consistent(sqlite_url)


def test_requested_dual_stack(plugin: Path, sqlite_url: str) -> None:
    ipam = {"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]]}
    config = net_config(sqlite_url, ipam, runtimeConfig={"ips": ["10.0.0.50/24", "fd00::50/64"]})
    assert addresses(add(plugin, config, container="a")) == ["10.0.0.50/24", "fd00::50/64"]
    # Only one family asked for: the other is picked as usual.
    config = net_config(sqlite_url, ipam, runtimeConfig={"ips": ["fd00::51"]})
    v4, v6 = addresses(add(plugin, config, container="b"))
    assert v6 == "fd00::51/64" and v4.startswith("10.0.0.")
    assert_consistent(sqlite_url)


def test_requested_address_is_skipped_by_later_picks(plugin: Path, sqlite_url: str) -> None:
    config = net_config(sqlite_url, runtimeConfig={"ips": ["10.0.0.3"]})
    add(plugin, config, container="static")
    got = {
        bare(addresses(add(plugin, net_config(sqlite_url), container=f"c{i}"))[0]) for i in range(3)
    }
    assert got == {"10.0.0.2", "10.0.0.4", "10.0.0.5"}
    assert_consistent(sqlite_url)


@pytest.mark.parametrize(
    ("requested", "code"),
    [
        pytest.param("10.0.0.40", 101, id="taken"),
        pytest.param("10.9.0.50", 102, id="outside-pool"),
        pytest.param("10.0.0.1", 102, id="gateway"),
        pytest.param("10.0.0.201", 102, id="excluded"),
        pytest.param("10.0.0.0", 102, id="network-address"),
        pytest.param("10.0.0.255", 102, id="broadcast"),
        pytest.param("fd00::5", 102, id="family-not-in-pool"),
    ],
)
def test_requested_address_refused(
    plugin: Path, sqlite_url: str, requested: str, code: int
) -> None:
    ipam = {**V4, "exclude": ["10.0.0.200/29"]}
    add(plugin, net_config(sqlite_url, ipam, runtimeConfig={"ips": ["10.0.0.40"]}), container="a")
    before = dump(sqlite_url)
    for config, args in (
        (net_config(sqlite_url, ipam, runtimeConfig={"ips": [requested]}), ""),
        (net_config(sqlite_url, ipam), f"IgnoreUnknown=1;IP={requested}"),
    ):
        res = exec_plugin(plugin, "ADD", config, container="x", args=args)
        assert_cni_error(res, code, "1.0.0")
        assert dump(sqlite_url) == before
    assert_consistent(sqlite_url)


# -- exhaustion -------------------------------------------------------------------------


def test_exhaustion(plugin: Path, sqlite_url: str) -> None:
    ipam = {"ranges": [[{"subnet": "10.0.0.0/29", "gateway": "10.0.0.1"}]]}
    config = net_config(sqlite_url, ipam)
    got = [bare(addresses(add(plugin, config, container=f"c{i}"))[0]) for i in range(5)]
    assert sorted(got) == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
    before = dump(sqlite_url)
    for _ in range(2):
        assert_cni_error(exec_plugin(plugin, "ADD", config, container="late"), 100, "1.0.0")
        assert dump(sqlite_url) == before
    # DEL of the failed ADD is fine; then a freed address (cooling, but the only one
    # free) goes to the next attachment.
    assert exec_plugin(plugin, "DEL", config, container="late").returncode == 0
    assert dump(sqlite_url) == before
    assert exec_plugin(plugin, "DEL", config, container="c2").returncode == 0
    assert addresses(add(plugin, config, container="late")) == [f"{got[2]}/29"]
    assert_consistent(sqlite_url)


def test_failed_dual_stack_add_changes_nothing(plugin: Path, sqlite_url: str) -> None:
    ipam = {
        "ranges": [
            # one block per range; each keeps .1 for its gateway: .2 .3, then .2
            [{"subnet": "10.0.0.0/29", "rangeEnd": "10.0.0.3"}, {"subnet": "10.0.1.0/30"}],
            [{"subnet": "fd00::/120", "rangeStart": "fd00::1", "rangeEnd": "fd00::3"}],
        ]
    }
    config = net_config(sqlite_url, ipam)
    for container in ("a", "b"):
        add(plugin, config, container=container)
    before = dump(sqlite_url)
    assert_cni_error(exec_plugin(plugin, "ADD", config, container="c"), 100)
    assert dump(sqlite_url) == before


# -- CNI_ARGS ---------------------------------------------------------------------------


def test_k8s_args_are_stored(plugin: Path, sqlite_url: str) -> None:
    args = (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=web-0;"
        "K8S_POD_UID=6f1c-uid;K8S_POD_INFRA_CONTAINER_ID=sandbox123"
    )
    add(plugin, net_config(sqlite_url), container="sandbox123", args=args)
    (row,) = alloc_list(sqlite_url)
    assert row["pod"] == {
        "namespace": "team-a",
        "name": "web-0",
        "uid": "6f1c-uid",
        "infra_container": "sandbox123",
    }
    assert (row["network"], row["container"], row["ifname"]) == ("net1", "sandbox123", "eth0")
    assert row["requested"] is False
    assert_consistent(sqlite_url)


def test_cni_args_repeated_alike_as_multus_passes_them(plugin: Path, sqlite_url: str) -> None:
    """Finding (a real cluster, a secondary network through Multus 4.0.2): Multus passes
    the runtime's CNI_ARGS with its own after them, each K8S_POD_* key twice and
    IgnoreUnknown as `1` and as `true`, and every such ADD was refused with 4 ("given
    twice"). A key given again with the same meaning is taken; with another, refused."""
    pod = "K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=web-0;K8S_POD_UID=u-1"
    args = f"IgnoreUnknown=1;{pod};K8S_POD_INFRA_CONTAINER_ID=sb1;IgnoreUnknown=true;{pod}"
    add(plugin, net_config(sqlite_url), container="sb1", args=args)
    (row,) = alloc_list(sqlite_url)
    assert (row["pod"]["namespace"], row["pod"]["name"], row["pod"]["uid"]) == (
        "team-a",
        "web-0",
        "u-1",
    )
    assert_consistent(sqlite_url)


@pytest.mark.parametrize("ignore", ["1", "true", "True"])
def test_unknown_cni_arg_with_ignore_unknown(plugin: Path, sqlite_url: str, ignore: str) -> None:
    add(plugin, net_config(sqlite_url), args=f"IgnoreUnknown={ignore};FOO=bar;K8S_POD_NAME=p")
    (row,) = alloc_list(sqlite_url)
    assert row["pod"]["name"] == "p"


@pytest.mark.parametrize(
    "args",
    [
        pytest.param("FOO=bar", id="unknown-key"),
        pytest.param("IgnoreUnknown=0;FOO=bar", id="ignore-unknown-false"),
        pytest.param("K8S_POD_NAME=p;garbage", id="not-key-value"),
    ],
)
def test_bad_cni_args(plugin: Path, sqlite_url: str, args: str) -> None:
    prepare(plugin, sqlite_url)
    before = dump(sqlite_url)
    for command in ("ADD", "CHECK"):
        res = exec_plugin(plugin, command, net_config(sqlite_url), container="x", args=args)
        assert_cni_error(res, 4, "1.0.0")
    assert dump(sqlite_url) == before


# -- errors -----------------------------------------------------------------------------


def _cfg(ipam: dict | None = None, **top):
    return lambda url: net_config(url, ipam, **top)


def _without(field: str):
    def make(url: str) -> dict:
        config = net_config(url)
        del config[field]
        return config

    return make


def _raw(data: bytes):
    return lambda url: data


ERROR_CASES = [
    # version
    pytest.param("ADD", _cfg(version="9.9.9"), {}, 1, id="cniVersion-9.9.9"),
    pytest.param("ADD", _cfg(version="0.2.0"), {}, 1, id="cniVersion-0.2.0"),
    # environment
    pytest.param("ADD", _cfg(), {"env": {"CNI_COMMAND": None}}, 4, id="no-CNI_COMMAND"),
    pytest.param("FROB", _cfg(), {}, 4, id="unknown-command"),
    pytest.param("add", _cfg(), {}, 4, id="lowercase-command"),
    pytest.param("ADD", _cfg(), {"env": {"CNI_CONTAINERID": None}}, 4, id="no-CNI_CONTAINERID"),
    pytest.param("ADD", _cfg(), {"container": "bad/id"}, 4, id="container-id-slash"),
    pytest.param("DEL", _cfg(), {"container": "bad id"}, 4, id="DEL-container-id-space"),
    pytest.param("ADD", _cfg(), {"env": {"CNI_IFNAME": None}}, 4, id="no-CNI_IFNAME"),
    pytest.param("ADD", _cfg(), {"ifname": "x" * 16}, 4, id="ifname-too-long"),
    pytest.param("ADD", _cfg(), {"ifname": "a/b"}, 4, id="ifname-slash"),
    pytest.param("ADD", _cfg(), {"ifname": ".."}, 4, id="ifname-dotdot"),
    pytest.param("ADD", _cfg(), {"container": "."}, 4, id="container-id-dot"),
    pytest.param("DEL", _cfg(), {"container": ".."}, 4, id="DEL-container-id-dotdot"),
    pytest.param("ADD", _cfg(), {"container": "-c1"}, 4, id="container-id-leading-dash"),
    pytest.param("ADD", _cfg(), {"container": "c" * 257}, 4, id="container-id-257"),
    pytest.param("DEL", _cfg(), {"container": "c" * 100_000}, 4, id="DEL-container-id-100k"),
    pytest.param("ADD", _cfg(), {"container": "c1\nx"}, 4, id="container-id-newline"),
    pytest.param("ADD", _cfg(), {"ifname": "\u00e9" * 8}, 4, id="ifname-16-bytes-8-chars"),
    pytest.param("ADD", _cfg(), {"ifname": "eth\x01"}, 4, id="ifname-control"),
    pytest.param("ADD", _cfg(), {"ifname": "eth\x0b0"}, 4, id="ifname-vertical-tab"),
    pytest.param("ADD", _cfg(), {"ifname": "eth 0"}, 4, id="ifname-space"),
    pytest.param("ADD", _cfg(), {"ifname": "eth:0"}, 4, id="ifname-colon"),
    pytest.param("ADD", _cfg(), {"ifname": "eth\udcff"}, 4, id="ifname-not-utf8"),
    pytest.param("ADD", _cfg(), {"netns": "/x\x7f"}, 4, id="netns-control"),
    pytest.param("ADD", _cfg(), {"netns": "/" + "n" * 4096}, 4, id="netns-too-long"),
    pytest.param("ADD", _cfg(), {"args": "IP=banana"}, 4, id="cni-args-ip-banana"),
    pytest.param("ADD", _cfg(), {"args": "IP=10.0.0.5/99"}, 4, id="cni-args-ip-bad-prefix"),
    pytest.param(
        "ADD", _cfg(), {"args": "IP=10.0.0.5,10.0.0.6"}, 4, id="cni-args-two-ips-one-family"
    ),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAME=a\x01b"}, 4, id="cni-args-control"),
    pytest.param(
        "ADD", _cfg(), {"args": "IgnoreUnknown=1;X=" + "y" * 8192}, 4, id="cni-args-too-long"
    ),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAME=Web-0"}, 4, id="pod-name-uppercase"),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAME=a/b"}, 4, id="pod-name-slash"),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAME=" + "a" * 254}, 4, id="pod-name-254"),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAMESPACE=a.b"}, 4, id="namespace-dot"),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_NAMESPACE=" + "a" * 64}, 4, id="namespace-64"),
    pytest.param("ADD", _cfg(), {"args": "K8S_POD_UID=a/b"}, 4, id="pod-uid-slash"),
    pytest.param(
        "ADD", _cfg(), {"args": "K8S_POD_INFRA_CONTAINER_ID=.."}, 4, id="infra-container-dotdot"
    ),
    pytest.param(
        "ADD", _cfg(), {"args": "K8S_POD_NAME=a;K8S_POD_NAME=b"}, 4, id="cni-args-key-twice-other"
    ),
    pytest.param("ADD", _cfg(), {"args": "IgnoreUnknown=1;BAD KEY=1"}, 4, id="cni-args-bad-key"),
    pytest.param("ADD", _cfg(), {"env": {"CNI_NETNS": None}}, 4, id="ADD-no-CNI_NETNS"),
    pytest.param("CHECK", _cfg(), {"env": {"CNI_NETNS": None}}, 4, id="CHECK-no-CNI_NETNS"),
    # decoding
    pytest.param("ADD", _raw(b""), {}, 6, id="empty-stdin"),
    pytest.param("ADD", _raw(b"  \n\t"), {}, 6, id="blank-stdin"),
    pytest.param("ADD", _raw(b"\xff\xfe\x00{"), {}, 6, id="not-utf8"),
    pytest.param(
        "ADD",
        _raw(b"{not json"),
        {},
        6,
        id="malformed-json",
    ),
    pytest.param(
        "ADD",
        _raw(b'{"cniVersion": "1.0.0", "name": "net1"'),
        {},
        6,
        id="truncated-json",
    ),
    pytest.param(
        "ADD",
        _raw(b"[" * 100_000),
        {},
        6,
        id="deeply-nested",
    ),
    # config
    pytest.param("ADD", _raw(b"[1, 2]"), {}, 7, id="config-not-object"),
    pytest.param("ADD", _without("cniVersion"), {}, 7, id="no-cniVersion"),
    pytest.param("ADD", _without("ipam"), {}, 7, id="no-ipam"),
    pytest.param("ADD", _without("name"), {}, 7, id="no-name"),
    pytest.param("ADD", _cfg(name="bad/name"), {}, 7, id="bad-network-name"),
    pytest.param("ADD", _cfg(name=""), {}, 7, id="empty-network-name"),
    pytest.param("ADD", _cfg({}), {}, 7, id="no-pool-no-ranges"),
    pytest.param("ADD", _cfg({"ranges": []}), {}, 7, id="empty-ranges"),
    pytest.param("ADD", _cfg({"ranges": [[{"subnet": "bad"}]]}), {}, 7, id="bad-subnet"),
    pytest.param("ADD", _cfg({"subnet": "10.0.0.0/33"}), {}, 7, id="bad-prefix"),
    pytest.param(
        "ADD",
        _cfg({"subnet": "10.0.0.0/24", "rangeStart": "10.1.0.1"}),
        {},
        7,
        id="rangeStart-outside-subnet",
    ),
    pytest.param(
        "ADD",
        _cfg({"ranges": [[{"subnet": "10.0.0.0/24", "rangeEnd": "10.0.1.9"}]]}),
        {},
        7,
        id="rangeEnd-outside-subnet",
    ),
    pytest.param(
        "ADD", _cfg({"subnet": "10.0.0.0/24", "gateway": "10.5.0.1"}), {}, 7, id="gateway-outside"
    ),
    pytest.param(
        "ADD",
        _cfg({"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.9", "rangeEnd": "10.0.0.5"}),
        {},
        7,
        id="start-after-end",
    ),
    pytest.param(
        "ADD",
        _cfg({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.1.0.0/24"}]]}),
        {},
        7,
        id="two-sets-one-family",
    ),
    pytest.param("ADD", _cfg({**V4, "pool": "p1"}), {}, 7, id="pool-and-ranges"),
    pytest.param("ADD", _cfg({"range": 5}), {}, 7, id="whereabouts-range-not-string"),
    pytest.param("ADD", _cfg({**V4, "exclude": "10.0.0.5"}), {}, 7, id="exclude-not-list"),
    pytest.param("ADD", _cfg({**V4, "routes": [{"gw": "1.2.3.4"}]}), {}, 7, id="route-no-dst"),
    pytest.param("ADD", _cfg({**V4, "dns": ["8.8.8.8"]}), {}, 7, id="dns-not-object"),
    pytest.param("ADD", _cfg({**V4, "agentSocket": "/run/x.sock"}), {}, 11, id="agent-unreachable"),
    pytest.param("ADD", _cfg(runtimeConfig={"ips": "10.0.0.9"}), {}, 7, id="ips-not-list"),
    pytest.param("ADD", _cfg(runtimeConfig={"ips": ["nope"]}), {}, 7, id="ips-not-address"),
    pytest.param("ADD", _cfg({"pool": "nope"}), {}, 103, id="unknown-pool"),
    # every field, checked before use
    pytest.param("ADD", _cfg(name="n" * 254), {}, 7, id="network-name-254"),
    pytest.param("ADD", _cfg(name="-net"), {}, 7, id="network-name-leading-dash"),
    pytest.param("ADD", _cfg(name=None), {}, 7, id="network-name-null"),
    pytest.param("ADD", _cfg(cniVersion=None), {}, 7, id="cniVersion-null"),
    pytest.param("ADD", _cfg(runtimeConfig="x"), {}, 7, id="runtimeConfig-not-object"),
    pytest.param("ADD", _cfg(args=[]), {}, 7, id="args-not-object"),
    pytest.param("ADD", _cfg(args={"cni": 5}), {}, 7, id="args-cni-not-object"),
    pytest.param("ADD", _cfg(args={"cni": {"ips": ["x"]}}), {}, 7, id="args-cni-ips-bad"),
    pytest.param("ADD", _cfg({**V4, "node": "a/b"}), {}, 7, id="node-slash"),
    pytest.param("ADD", _cfg({**V4, "node": None}), {}, 7, id="node-null"),
    pytest.param("ADD", _cfg({**V4, "logLevel": "loud"}), {}, 7, id="logLevel-unknown"),
    pytest.param("ADD", _cfg({**V4, "logFile": "/tmp/a\u0000b"}), {}, 7, id="logFile-nul"),
    pytest.param("ADD", _cfg({**V4, "store": "sqlite:///x\u0001"}), {}, 7, id="store-control"),
    pytest.param("ADD", _cfg({**V4, "gcGrace": 1e400}), {}, 7, id="gcGrace-infinite"),
    pytest.param("ADD", _cfg({**V4, "stickyTTL": None}), {}, 7, id="stickyTTL-null"),
    pytest.param("ADD", _cfg({**V4, "sticky": "yes"}), {}, 7, id="sticky-not-bool"),
    pytest.param("ADD", _cfg({**V4, "dns": {"nameservers": "1.1.1.1"}}), {}, 7, id="dns-ns-str"),
    pytest.param("ADD", _cfg({**V4, "dns": {"nameservers": ["x"]}}), {}, 7, id="dns-ns-bad"),
    pytest.param("ADD", _cfg({**V4, "dns": {"domain": 5}}), {}, 7, id="dns-domain-not-str"),
    pytest.param("ADD", _cfg({**V4, "dns": {"search": [None]}}), {}, 7, id="dns-search-null"),
    pytest.param("ADD", _cfg({**V4, "pool": None}), {}, 7, id="pool-null-with-ranges"),
    pytest.param("ADD", _cfg({"pool": ["p" * 254]}), {}, 7, id="pool-name-254"),
    pytest.param("ADD", _cfg({**V4, "agentSocket": 5}), {}, 7, id="agentSocket-not-string"),
    pytest.param("ADD", _cfg({**V4, "agentSocket": "rel.sock"}), {}, 7, id="agentSocket-relative"),
    pytest.param("ADD", _cfg({**V4, "agentSocket": "/a\u0000b"}), {}, 7, id="agentSocket-nul"),
    pytest.param(
        "ADD", _cfg({**V4, "agentSocket": "/" + "s" * 107}), {}, 7, id="agentSocket-too-long"
    ),
    # CHECK's prevResult (it crashed with 999 on these)
    pytest.param("CHECK", _cfg(prevResult={"ips": [{"address": 5}]}), {}, 7, id="prev-address-5"),
    pytest.param(
        "CHECK", _cfg(prevResult={"ips": [{"address": None}]}), {}, 7, id="prev-address-null"
    ),
    pytest.param("CHECK", _cfg(prevResult={"ips": [None]}), {}, 7, id="prev-ip-null"),
    pytest.param("CHECK", _cfg(prevResult={"ips": None}), {}, 7, id="prev-ips-null"),
    pytest.param("CHECK", _cfg(prevResult={"ips": "x"}), {}, 7, id="prev-ips-string"),
    pytest.param("CHECK", _cfg(prevResult=None), {}, 7, id="prev-null"),
    pytest.param("CHECK", _cfg(prevResult=[]), {}, 7, id="prev-list"),
    pytest.param(
        "CHECK", _cfg(prevResult={"ips": [{"address": "banana"}]}), {}, 7, id="prev-banana"
    ),
    pytest.param(
        "CHECK", _cfg(prevResult={"ips": [{"address": "10.0.0.5/99"}]}), {}, 7, id="prev-prefix"
    ),
    # store
    pytest.param("ADD", _cfg({**V4, "store": "etcd://127.0.0.1:1"}), {}, 7, id="store-etcd"),
    pytest.param("ADD", _cfg({**V4, "store": "mysql://x/y"}), {}, 7, id="store-unknown-scheme"),
    pytest.param("ADD", _cfg({**V4, "store": "sqlite://rel.db"}), {}, 7, id="store-relative"),
    pytest.param("ADD", _cfg({**V4, "store": 5}), {}, 7, id="store-not-string"),
    pytest.param(
        "ADD", _cfg({**V4, "store": "sqlite:///proc/ipward.db"}), {}, 11, id="store-unopenable"
    ),
    pytest.param(
        "ADD",
        _cfg({**V4, "store": "sqlite:///proc/nope/x.db"}),
        {},
        11,
        id="store-dir-uncreatable",
    ),
    pytest.param(
        "DEL",
        _cfg({**V4, "store": "sqlite:///proc/ipward.db"}),
        {},
        11,
        id="DEL-store-unopenable",
    ),
]


# Findings of the hostile pass, each accepted before: (ipam section, network name, what
# the message must name).
INLINE_FINDINGS = [
    pytest.param({**V4, "cooldown": True}, "net1", "cooldown", id="cooldown-true"),
    pytest.param({**V4, "cooldown": False}, "net1", "cooldown", id="cooldown-false"),
    pytest.param(
        {**V4, "routes": [{"dst": "0.0.0.0/0", "gw": "nope"}]},
        "net1",
        "ipam.routes[0].gw 'nope' is not an address",
        id="route-gw-not-address",
    ),
    pytest.param(
        {**V4, "routes": [{"dst": "0.0.0.0/0", "gw": "fd00::1"}]},
        "net1",
        "ipam.routes[0]: gw fd00::1 is IPv6",
        id="route-gw-other-family",
    ),
    pytest.param({"subnet": "0.0.0.0/0"}, "net1", "wider than a pool takes", id="subnet-slash-0"),
    pytest.param({"range": "::/0"}, "net1", "wider than a pool takes", id="v6-slash-0"),
    pytest.param(
        {"range": "10.44.0.1-/24"}, "net1", "needs both the first and the last", id="range-no-last"
    ),
    pytest.param(
        {"range": "-10.44.0.9/24"}, "net1", "needs both the first and the last", id="range-no-first"
    ),
    pytest.param(V4, "net2", "would overlap pool net1", id="overlaps-another-network"),
]


@pytest.mark.parametrize(("ipam", "name", "needle"), INLINE_FINDINGS)
def test_inline_config_findings_are_invalid_config_and_change_nothing(
    plugin: Path, sqlite_url: str, ipam: dict, name: str, needle: str
) -> None:
    prepare(plugin, sqlite_url)
    before = dump(sqlite_url)
    res = exec_plugin(plugin, "ADD", net_config(sqlite_url, ipam, name=name), container="c1")
    err = assert_cni_error(res, 7)
    assert needle in err["msg"], err
    assert dump(sqlite_url) == before
    assert_consistent(sqlite_url)


def test_empty_inline_addresses_are_unset_as_in_host_local(plugin: Path, sqlite_url: str) -> None:
    """host-local and whereabouts read an empty address as not given (Go's net.IP of
    ""): the default gateway applies, the range is the subnet's."""
    ipam = {"ranges": [[{"subnet": "10.6.0.0/24", "gateway": "", "rangeStart": ""}]]}
    res = add(plugin, net_config(sqlite_url, ipam))
    assert res.json["ips"] == [{"address": "10.6.0.2/24", "gateway": "10.6.0.1"}]
    res = add(plugin, net_config(sqlite_url, {"range": "10.7.0.0/24", "range_end": ""}, name="w"))
    assert bare(addresses(res)[0]) == "10.7.0.1"


@pytest.mark.parametrize(("command", "stdin", "kwargs", "code"), ERROR_CASES)
def test_error_object_and_store_unchanged(
    plugin: Path, sqlite_url: str, command: str, stdin, kwargs: dict, code: int
) -> None:
    prepare(plugin, sqlite_url)
    before = dump(sqlite_url)
    data = stdin(sqlite_url)
    version = data.get("cniVersion") if isinstance(data, dict) else None
    res = exec_plugin(plugin, command, data, **{"container": "c1", **kwargs})
    assert_cni_error(res, code, version if version in SUPPORTED else None)
    assert dump(sqlite_url) == before
    assert_consistent(sqlite_url)


@pytest.mark.parametrize("version", SUPPORTED)
def test_error_answers_in_the_requested_version(
    plugin: Path, sqlite_url: str, version: str
) -> None:
    config = net_config(sqlite_url, {"pool": "nope"}, version=version)
    assert_cni_error(exec_plugin(plugin, "ADD", config), 103, version)


# -- logFile ----------------------------------------------------------------------------


def _log_case_outside(url: str, log: str) -> tuple[dict, str]:
    return net_config(url, {**V4, "logFile": log}, runtimeConfig={"ips": ["10.9.9.9"]}), ""


def _log_case_args(url: str, log: str) -> tuple[dict, str]:
    return net_config(url, {**V4, "logFile": log}), "FOO=bar"


def _log_case_config(url: str, log: str) -> tuple[dict, str]:
    bad = {"subnet": "10.0.0.0/24", "rangeStart": "10.7.0.1", "logFile": log}
    return net_config(url, bad), ""


def _log_case_version(url: str, log: str) -> tuple[dict, str]:
    return net_config(url, {**V4, "logFile": log}, version="9.9.9"), ""


@pytest.mark.parametrize(
    ("case", "code"),
    [
        pytest.param(_log_case_outside, 102, id="requested-outside-pool"),
        pytest.param(_log_case_args, 4, id="bad-cni-args"),
        pytest.param(
            _log_case_config,
            7,
            id="invalid-range",
        ),
        pytest.param(
            _log_case_version,
            1,
            id="unsupported-version",
        ),
    ],
)
def test_log_file_gets_the_error(
    plugin: Path, sqlite_url: str, tmp_path: Path, case, code: int
) -> None:
    log = tmp_path / "logs" / "ipward.log"
    log.parent.mkdir()
    config, args = case(sqlite_url, str(log))
    res = exec_plugin(plugin, "ADD", config, container="x", args=args)
    err = assert_cni_error(res, code)
    assert log.exists(), res
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(line.get("code") == code and line.get("msg") == err["msg"] for line in lines), lines
    assert res.stderr == b""  # with a logFile, logs go there


def test_log_file_records_allocations(plugin: Path, sqlite_url: str, tmp_path: Path) -> None:
    log = tmp_path / "ipward.log"
    ip = bare(addresses(add(plugin, net_config(sqlite_url, {**V4, "logFile": str(log)})))[0])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(line["msg"] == "allocated" and f"net1/{ip}" in line["ips"] for line in lines)


def test_unwritable_log_file_does_not_fail_add(plugin: Path, sqlite_url: str) -> None:
    config = net_config(sqlite_url, {**V4, "logFile": "/proc/nope/ipward.log"})
    res = exec_plugin(plugin, "ADD", config)
    assert res.returncode == 0, res


# -- CHECK ------------------------------------------------------------------------------


def test_check_existing_attachment(plugin: Path, sqlite_url: str) -> None:
    result = add(plugin, net_config(sqlite_url), container="a").json
    before = dump(sqlite_url)
    for version in ("0.4.0", "1.0.0", "1.1.0"):
        res = exec_plugin(plugin, "CHECK", net_config(sqlite_url, version=version), container="a")
        assert res.returncode == 0 and res.stdout == b"", res
        config = net_config(sqlite_url, version=version, prevResult=result)
        res = exec_plugin(plugin, "CHECK", config, container="a")
        assert res.returncode == 0 and res.stdout == b"", res
    assert dump(sqlite_url) == before


def test_check_unknown_attachment(plugin: Path, sqlite_url: str) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    before = dump(sqlite_url)
    for container, ifname in (("b", "eth0"), ("a", "net1")):
        res = exec_plugin(
            plugin, "CHECK", net_config(sqlite_url), container=container, ifname=ifname
        )
        assert_cni_error(res, 3, "1.0.0")
    res = exec_plugin(plugin, "CHECK", net_config(sqlite_url, name="net2"), container="a")
    assert_cni_error(res, 3, "1.0.0")
    assert dump(sqlite_url) == before


def test_check_prev_result_address_not_held(plugin: Path, sqlite_url: str) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    other = addresses(add(plugin, net_config(sqlite_url), container="b"))[0]
    before = dump(sqlite_url)
    prev = {"cniVersion": "1.0.0", "ips": [{"address": other, "gateway": "10.0.0.1"}]}
    res = exec_plugin(plugin, "CHECK", net_config(sqlite_url, prevResult=prev), container="a")
    err = assert_cni_error(res, 3, "1.0.0")
    assert bare(other) in err["msg"]
    assert dump(sqlite_url) == before


# -- GC ---------------------------------------------------------------------------------


def gc_config(
    url: str, valid: list[dict] | None, ipam: dict | None = None, grace: float = 0, **kw
) -> dict:
    """A GC call's config; `grace` 0 unless said: these tests judge records just made."""
    config = net_config(url, ipam, version=kw.pop("version", "1.1.0"), **kw)
    config["ipam"]["gcGrace"] = grace
    if valid is not None:
        config["cni.dev/valid-attachments"] = valid
    return config


def test_gc_frees_attachments_not_listed(plugin: Path, sqlite_url: str) -> None:
    neta = {"ranges": [[{"subnet": "10.0.0.0/24"}]]}
    netb = {"ranges": [[{"subnet": "10.1.0.0/24"}]]}
    held = {}
    for container, ifname in (("a", "eth0"), ("b", "eth0"), ("c", "eth0"), ("a", "net1")):
        config = net_config(sqlite_url, neta, name="neta", version="1.1.0")
        res = add(plugin, config, container=container, ifname=ifname)
        held[(container, ifname)] = bare(addresses(res)[0])
    for container in ("a", "z"):
        add(plugin, net_config(sqlite_url, netb, name="netb", version="1.1.0"), container=container)
    other_network = rows_of(sqlite_url, "netb")
    assert other_network
    valid = [
        {"containerID": "a", "ifname": "eth0"},
        {"containerID": "c", "ifname": "eth0"},
        {"containerID": "z", "ifname": "eth0"},  # another network's: irrelevant here
    ]
    res = exec_plugin(
        plugin, "GC", gc_config(sqlite_url, valid, neta, name="neta"), env=NO_ATTACHMENT
    )
    assert res.returncode == 0 and res.stdout == b"", res
    assert set(keys(sqlite_url, f"attach/{HOST}/neta/")) == {
        f"attach/{HOST}/neta/a/eth0",
        f"attach/{HOST}/neta/c/eth0",
    }
    kept = {held[("a", "eth0")], held[("c", "eth0")]}
    gone = {held[("b", "eth0")], held[("a", "net1")]}
    assert {k.rsplit("/", 1)[1] for k in keys(sqlite_url, "ips/neta/")} == kept
    assert {k.rsplit("/", 1)[1] for k in keys(sqlite_url, "free/neta/")} == gone
    assert rows_of(sqlite_url, "netb") == other_network  # byte for byte, same revisions
    # A second identical GC changes nothing.
    before = dump(sqlite_url)
    res = exec_plugin(
        plugin, "GC", gc_config(sqlite_url, valid, neta, name="neta"), env=NO_ATTACHMENT
    )
    assert res.returncode == 0, res
    assert dump(sqlite_url) == before
    config = net_config(sqlite_url, neta, name="neta")
    assert exec_plugin(plugin, "CHECK", config, container="a").returncode == 0
    assert_cni_error(exec_plugin(plugin, "CHECK", config, container="b"), 3)
    assert_consistent(sqlite_url)


def test_gc_leaves_records_younger_than_the_grace(plugin: Path, sqlite_url: str) -> None:
    """An ADD in flight is not in the runtime's list yet: its record is kept until the
    grace has passed, and then freed by the same call."""
    add(plugin, net_config(sqlite_url), container="inflight")
    before = dump(sqlite_url)
    res = exec_plugin(plugin, "GC", gc_config(sqlite_url, [], grace=3600), env=NO_ATTACHMENT)
    assert res.returncode == 0, res
    assert dump(sqlite_url) == before
    res = exec_plugin(plugin, "GC", gc_config(sqlite_url, [], grace=0), env=NO_ATTACHMENT)
    assert res.returncode == 0, res
    assert keys(sqlite_url, "ips/") == {}
    assert_consistent(sqlite_url)


@pytest.mark.parametrize("grace", [-1, "60", True, None])
def test_gc_bad_grace_names_the_field(plugin: Path, sqlite_url: str, grace: object) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    before = dump(sqlite_url)
    config = gc_config(sqlite_url, [])
    config["ipam"]["gcGrace"] = grace
    err = assert_cni_error(exec_plugin(plugin, "GC", config, env=NO_ATTACHMENT), 7, "1.1.0")
    assert "ipam.gcGrace" in err["msg"]
    assert dump(sqlite_url) == before


def test_gc_in_shared_pool_leaves_other_network(plugin: Path, sqlite_url: str) -> None:
    create_pool(sqlite_url, "shared", "--range", "10.9.0.0/24")
    pool = {"pool": "shared"}
    add(plugin, net_config(sqlite_url, pool, name="neta"), container="x")
    b_ip = bare(addresses(add(plugin, net_config(sqlite_url, pool, name="netb"), container="y"))[0])
    res = exec_plugin(plugin, "GC", gc_config(sqlite_url, [], pool, name="neta"), env=NO_ATTACHMENT)
    assert res.returncode == 0, res
    assert list(keys(sqlite_url, "ips/shared/")) == [f"ips/shared/{b_ip}"]
    assert list(keys(sqlite_url, "attach/")) == [f"attach/{HOST}/netb/y/eth0"]
    assert_consistent(sqlite_url)


@pytest.mark.parametrize(
    "valid",
    [
        pytest.param(None, id="missing"),
        pytest.param({"containerID": "a", "ifname": "eth0"}, id="not-a-list"),
        pytest.param(["a"], id="entry-not-object"),
        pytest.param([{"ifname": "eth0"}], id="entry-without-containerID"),
    ],
)
def test_gc_bad_valid_attachments(plugin: Path, sqlite_url: str, valid) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    before = dump(sqlite_url)
    config = net_config(sqlite_url, version="1.1.0")
    if valid is not None:
        config["cni.dev/valid-attachments"] = valid
    assert_cni_error(exec_plugin(plugin, "GC", config, env=NO_ATTACHMENT), 7, "1.1.0")
    assert dump(sqlite_url) == before


def test_gc_entry_without_ifname_frees_nothing(plugin: Path, sqlite_url: str) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    before = dump(sqlite_url)
    config = gc_config(sqlite_url, [{"containerID": "a"}])
    res = exec_plugin(plugin, "GC", config, env=NO_ATTACHMENT)
    assert dump(sqlite_url) == before, res
    assert_cni_error(res, 7, "1.1.0")


def test_gc_needs_cni_version_1_1(plugin: Path, sqlite_url: str) -> None:
    add(plugin, net_config(sqlite_url), container="a")
    before = dump(sqlite_url)
    res = exec_plugin(plugin, "GC", gc_config(sqlite_url, [], version="1.0.0"), env=NO_ATTACHMENT)
    assert dump(sqlite_url) == before, res
    assert_cni_error(res, 1, "1.0.0")


# -- STATUS and VERSION -----------------------------------------------------------------


def test_status_ok(plugin: Path, sqlite_url: str) -> None:
    create_pool(sqlite_url, "p1", "--range", "10.8.0.0/24")
    for ipam in ({"pool": "p1"}, V4):
        config = net_config(sqlite_url, ipam, version="1.1.0")
        res = exec_plugin(plugin, "STATUS", config, env=NO_ATTACHMENT)
        assert res.returncode == 0 and res.stdout == b"", res
    assert keys(sqlite_url, "ips/") == {}


@pytest.mark.parametrize(
    "ipam",
    [
        pytest.param({"pool": "nope"}, id="unknown-pool"),
        pytest.param({**V4, "store": "sqlite:///proc/ipward.db"}, id="store-unopenable"),
    ],
)
def test_status_not_available(plugin: Path, sqlite_url: str, ipam: dict) -> None:
    create_pool(sqlite_url, "p1", "--range", "10.8.0.0/24")
    before = dump(sqlite_url)
    config = net_config(sqlite_url, ipam, version="1.1.0")
    assert_cni_error(exec_plugin(plugin, "STATUS", config, env=NO_ATTACHMENT), 50, "1.1.0")
    assert dump(sqlite_url) == before


@pytest.mark.parametrize("version", SUPPORTED)
def test_version(plugin: Path, sqlite_url: str, version: str) -> None:
    config = net_config(sqlite_url, version=version)
    res = exec_plugin(plugin, "VERSION", config, env=NO_ATTACHMENT)
    assert res.returncode == 0, res
    assert res.json == {"cniVersion": version, "supportedVersions": list(SUPPORTED)}
    assert dump(sqlite_url) is None  # VERSION never touches the store


def test_version_without_config(plugin: Path) -> None:
    for stdin in (b"", b'{"cniVersion": "1.0.0"}'):
        res = exec_plugin(plugin, "VERSION", stdin, env=NO_ATTACHMENT)
        assert res.returncode == 0, res
        assert set(res.json["supportedVersions"]) == set(SUPPORTED)
        assert res.json["cniVersion"] in SUPPORTED
