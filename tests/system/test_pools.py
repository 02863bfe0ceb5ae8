"""A pool's life through the real CLI and plugin on a real SQLite store: no two pools
share an address (CLI and inline, decided in the storing transaction, races included),
a network whose ranges change, a race-free and resumable `pool delete`, and the keys a
pool can leave behind (`ipward check`, `--remove-orphans`)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.ledger import Ledger
from ipward.store import open_store
from ipward.store.base import Delete, Put
from ipward_lab.fleet import IPWARD, run_cli
from ipward_lab.waiting import wait_for
from support import Gate, exec_plugin


def kv_table(url: str) -> list[tuple]:
    """Every key with its value and revision, and the store's revision."""
    with open_store(url) as store:
        kvs, revision = store.range("")
    return [(kv.key, kv.value, kv.mod_revision) for kv in kvs] + [("", b"", revision)]


def status_revision(url: str) -> int:
    return json.loads(run_cli("--json", "status", store=url, check=True).stdout)["revision"]


def check_report(url: str) -> dict:
    proc = run_cli("--json", "check", store=url)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ok"] else 1), proc
    return report


def assert_clean(url: str) -> None:
    report = check_report(url)
    assert report["ok"], report["problems"]


def create(url: str, name: str, *options: str) -> subprocess.CompletedProcess:
    return run_cli("pool", "create", name, *options, store=url)


def network(url: str, ipam: dict, name: str = "net") -> dict:
    return {"cniVersion": "1.0.0", "name": name, "ipam": {"type": "ipward", "store": url, **ipam}}


def add(plugin: Path, config: dict, container: str, **kw: object):
    return exec_plugin(plugin, "ADD", config, container=container, **kw)  # type: ignore[arg-type]


def address(result) -> str:
    assert result.returncode == 0, result
    return result.json["ips"][0]["address"].split("/")[0]


def pool_keys(url: str, pool: str) -> list[str]:
    with open_store(url) as store:
        kvs, _ = store.range("")
    return [kv.key for kv in kvs if kv.key.split("/")[1:2] == [pool] and kv.key != "poolcoverage"]


def cli_in_background(url: str, gate: Gate, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*IPWARD, *args],
        env={**gate.env, "IPWARD_STORE": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# -- no two pools share an address -------------------------------------------------------


def test_overlapping_pools_are_refused_by_the_cli(sqlite_url: str) -> None:
    """Found: `pool create a --range 10.0.0.0/24` and `pool create b --range
    10.0.0.0/24` both succeeded, and ADDs on a and on b got the same address."""
    assert (
        create(sqlite_url, "a", "--range", "10.0.0.0/24", "--range", "fd00:a::/64").returncode == 0
    )
    before = kv_table(sqlite_url)
    for name, options, both in (
        ("b", ["--range", "10.0.0.0/24"], "10.0.0.1-10.0.0.254"),
        ("b", ["--range", "10.0.0.200/29"], "10.0.0.201-10.0.0.206"),
        ("b", ["--range", "10.0.0.0/16,start=10.0.0.250,end=10.0.1.5"], "10.0.0.1"),  # gateway
        ("b", ["--range", "10.0.0.0/16,start=10.0.0.250,gateway=none"], "10.0.0.250-10.0.0.254"),
        (
            "b",
            ["--range", "10.9.0.0/24", "--range", "fd00:a::1:0/112"],
            "fd00:a::1:1-fd00:a::1:ffff",
        ),
    ):
        proc = create(sqlite_url, name, *options)
        assert proc.returncode == 2, proc
        assert "would overlap pool a: both cover" in proc.stderr and both in proc.stderr, proc
        assert "Traceback" not in proc.stderr
    assert kv_table(sqlite_url) == before
    # Neighbours are fine, and so is a range another pool excludes.
    assert create(sqlite_url, "c", "--range", "10.0.1.0/24").returncode == 0
    options = ["--range", "10.7.0.0/24", "--exclude", "10.7.0.128/25"]
    assert create(sqlite_url, "d", *options).returncode == 0
    assert create(sqlite_url, "e", "--range", "10.7.0.128/25").returncode == 0
    assert_clean(sqlite_url)


def test_an_inline_network_overlapping_a_pool_is_invalid_config(
    plugin: Path, sqlite_url: str
) -> None:
    assert create(sqlite_url, "a", "--range", "10.0.0.0/24").returncode == 0
    inline_b = network(sqlite_url, {"ranges": [[{"subnet": "10.1.0.0/24"}]]}, name="b")
    address(add(plugin, inline_b, "c1"))
    before = kv_table(sqlite_url)
    for name, subnet, other in (
        ("c", "10.0.0.128/25", "pool a"),
        ("c", "10.1.0.0/16", "pool b"),
        ("b", "10.0.0.0/23", "pool a"),  # b changing its ranges into a
    ):
        config = network(sqlite_url, {"subnet": subnet}, name=name)
        res = add(plugin, config, "c2")
        assert res.returncode != 0 and res.json["code"] == 7, res
        assert f"would overlap {other}" in res.json["msg"], res
        assert kv_table(sqlite_url) == before
    # and the other way round: the CLI refuses to cover an inline pool
    proc = create(sqlite_url, "x", "--range", "10.1.0.64/26")
    assert proc.returncode == 2 and "would overlap pool b" in proc.stderr, proc
    assert kv_table(sqlite_url) == before
    assert_clean(sqlite_url)


def test_a_pool_list_takes_one_pool_per_family(plugin: Path, sqlite_url: str) -> None:
    """Found: `"pool": "a,b"` over overlapping pools returned 10.0.0.1 twice. Two pools
    of one family in a list are refused, overlapping or not."""
    create(sqlite_url, "a", "--range", "10.0.0.0/24")
    create(sqlite_url, "b", "--range", "10.1.0.0/24")
    create(sqlite_url, "v6", "--range", "fd00:6::/64")
    before = kv_table(sqlite_url)
    for pools, named in (
        ("a,b", "pools a and b both serve IPv4"),
        ("a,a", "pool a is listed twice"),
    ):
        res = add(plugin, network(sqlite_url, {"pool": pools}), "c1")
        assert res.returncode != 0 and res.json["code"] == 7 and named in res.json["msg"], res
        assert kv_table(sqlite_url) == before
    res = add(plugin, network(sqlite_url, {"pool": "a,v6"}), "c1")
    assert res.returncode == 0 and len(res.json["ips"]) == 2, res


def test_concurrent_overlapping_creates_one_wins(tmp_path: Path, sqlite_url: str) -> None:
    """Both creations pass their overlap test on the same view (held at the `pool-create`
    point), then commit: the `poolcoverage` compare lets exactly one through, and the
    other, reading again, names it."""
    create(sqlite_url, "seed", "--range", "10.99.0.0/24")  # the store exists
    gate = Gate(tmp_path, "pool-create")
    first = cli_in_background(sqlite_url, gate, "pool", "create", "a", "--range", "10.0.0.0/24")
    gate.wait_reached()
    (gate.dir / "pool-create.reached").unlink()
    second = cli_in_background(sqlite_url, gate, "pool", "create", "b", "--range", "10.0.0.0/25")
    gate.wait_reached()
    gate.open()
    outs = [p.communicate(timeout=120) for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    assert codes == [0, 2], outs
    loser = outs[[first.returncode, second.returncode].index(2)][1]
    assert "would overlap pool" in loser, outs
    names = [
        s["name"] for s in json.loads(run_cli("--json", "pool", "list", store=sqlite_url).stdout)
    ]
    assert sorted(names) in (["a", "seed"], ["b", "seed"])
    assert_clean(sqlite_url)


def test_an_inline_pool_stored_in_the_window_of_a_cli_create(
    tmp_path: Path, plugin: Path, sqlite_url: str
) -> None:
    """The CLI and an inline ADD guard coverage through the same key: an inline pool
    stored while a CLI creation waits between its test and its commit makes the
    creation fail, naming it."""
    create(sqlite_url, "seed", "--range", "10.99.0.0/24")
    gate = Gate(tmp_path, "pool-create")
    creating = cli_in_background(sqlite_url, gate, "pool", "create", "a", "--range", "10.5.0.0/24")
    gate.wait_reached()
    address(add(plugin, network(sqlite_url, {"subnet": "10.5.0.0/28"}, name="inl"), "c1"))
    gate.open()
    _, err = creating.communicate(timeout=120)
    assert creating.returncode == 2 and "would overlap pool inl" in err, err
    assert_clean(sqlite_url)


# -- a network whose ranges change ----------------------------------------------------------


def test_a_network_config_change_is_a_new_version_of_its_pool(
    plugin: Path, sqlite_url: str
) -> None:
    """Found: after ADD/DEL on 10.20.0.0/24, switching the config to 10.30.0.0/26
    answered 100 forever with no pod, and `check` marked the old records outside-pool.
    Now: old pods keep their addresses until their DEL, new ones come from the new
    range, check is clean at every step, and failed calls change nothing."""
    old_net = network(sqlite_url, {"ranges": [[{"subnet": "10.20.0.0/24"}]], "cooldown": 0})
    new_net = network(sqlite_url, {"ranges": [[{"subnet": "10.30.0.0/26"}]], "cooldown": 0})
    held = {f"old{i}": address(add(plugin, old_net, f"old{i}")) for i in range(3)}
    assert exec_plugin(plugin, "DEL", old_net, container="old2").returncode == 0
    del held["old2"]
    assert_clean(sqlite_url)
    fresh = address(add(plugin, new_net, "new0"))
    assert fresh == "10.30.0.2"  # .1 is the gateway (host-local's rule)
    assert_clean(sqlite_url)
    # An old pod's ADD again (a retry) answers its own address, prefix and gateway.
    again = add(plugin, new_net, "old0")
    assert again.json["ips"] == [{"address": f"{held['old0']}/24", "gateway": "10.20.0.1"}]
    # A request for an address of the old range is refused, and changes nothing.
    revision = status_revision(sqlite_url)
    res = add(plugin, new_net, "static", args="IgnoreUnknown=1;IP=10.20.0.50")
    assert res.returncode != 0 and res.json["code"] == 102, res
    assert status_revision(sqlite_url) == revision
    # The new range serves all its addresses; the 62nd ADD is refused with 100.
    for i in range(1, 61):
        assert address(add(plugin, new_net, f"new{i}")).startswith("10.30.0.")
    revision = status_revision(sqlite_url)
    res = add(plugin, new_net, "new61")
    assert res.returncode != 0 and res.json["code"] == 100, res
    assert status_revision(sqlite_url) == revision
    # Old pods' DELs (with the config present at teardown) free their addresses.
    for container in held:
        assert exec_plugin(plugin, "DEL", new_net, container=container).returncode == 0
        assert_clean(sqlite_url)
    report = check_report(sqlite_url)
    assert report["retired_layouts"] == 1
    # The earlier version still counts against other pools until it is pruned.
    proc = create(sqlite_url, "reuse", "--range", "10.20.0.0/24")
    assert proc.returncode == 2 and "an earlier version of net" in proc.stderr, proc
    proc = run_cli("--json", "check", "--remove-orphans", store=sqlite_url)
    assert proc.returncode == 0, proc
    assert json.loads(proc.stdout)["pruned"]["net"]["layouts"] == 1
    assert check_report(sqlite_url)["retired_layouts"] == 0
    assert create(sqlite_url, "reuse", "--range", "10.20.0.0/24").returncode == 0
    assert_clean(sqlite_url)


# -- pool delete -------------------------------------------------------------------------


def test_add_in_the_window_of_pool_delete_fails_and_leaves_nothing(
    tmp_path: Path, plugin: Path, sqlite_url: str
) -> None:
    """Found: with a pause after its check for allocations, an ADD landed in a deleted
    pool. The spec is marked `deleting` before the check; an ADD in the window between
    the check and the removal (`pool-delete` point) is refused, nothing is left."""
    create(sqlite_url, "p", "--range", "10.0.0.0/24")
    config = network(sqlite_url, {"pool": "p"})
    address(add(plugin, config, "before"))
    assert exec_plugin(plugin, "DEL", config, container="before").returncode == 0
    gate = Gate(tmp_path, "pool-delete")
    deleting = cli_in_background(sqlite_url, gate, "pool", "delete", "p")
    gate.wait_reached()
    res = add(plugin, config, "in-window")
    assert res.returncode != 0 and res.json["code"] == 103, res
    assert "being deleted" in res.json["msg"], res
    gate.open()
    out, err = deleting.communicate(timeout=120)
    assert deleting.returncode == 0, (out, err)
    assert pool_keys(sqlite_url, "p") == []
    res = add(plugin, config, "after")
    assert res.returncode != 0 and res.json["code"] == 103, res
    assert_clean(sqlite_url)


def test_add_in_flight_across_pool_delete_fails_or_makes_it_refuse(
    tmp_path: Path, plugin: Path, sqlite_url: str
) -> None:
    """An ADD that read the pool before the delete and commits after it (held at the
    `allocate` point): its transaction compares the spec, so it fails and, reading
    again, finds no pool. Either the ADD fails or the delete refuses; never both done."""
    create(sqlite_url, "p", "--range", "10.0.0.0/24")
    config = network(sqlite_url, {"pool": "p"})
    gate = Gate(tmp_path, "allocate")
    adding = subprocess.Popen(
        [str(plugin)],
        env={
            **gate.env,
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "in-flight",
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/x",
            "CNI_PATH": str(plugin.parent),
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert adding.stdin is not None
    adding.stdin.write(json.dumps(config).encode())
    adding.stdin.close()
    gate.wait_reached()
    deleted = run_cli("pool", "delete", "p", store=sqlite_url)
    gate.open()
    out = adding.stdout.read() if adding.stdout else b""
    adding.wait(timeout=120)
    answer = json.loads(out)
    if deleted.returncode == 0:
        assert adding.returncode != 0 and answer["code"] == 103, answer
        assert pool_keys(sqlite_url, "p") == []
    else:
        assert adding.returncode == 0 and "allocation" in deleted.stderr, deleted
    assert_clean(sqlite_url)


def test_refused_delete_puts_the_pool_back(plugin: Path, sqlite_url: str) -> None:
    create(sqlite_url, "p", "--range", "10.0.0.0/24")
    config = network(sqlite_url, {"pool": "p"})
    address(add(plugin, config, "c1"))
    address(add(plugin, config, "c2"))
    proc = run_cli("pool", "delete", "p", store=sqlite_url)
    assert proc.returncode == 2 and "still has 2 allocations" in proc.stderr, proc
    with open_store(sqlite_url) as store:
        spec = rec.decode(store.get("pools/p").value)  # type: ignore[union-attr]
    assert "state" not in spec  # active again
    address(add(plugin, config, "c3"))
    assert_clean(sqlite_url)


def test_a_crashed_delete_is_reported_and_finished_by_running_it_again(
    tmp_path: Path, plugin: Path, sqlite_url: str
) -> None:
    create(sqlite_url, "p", "--range", "10.0.0.0/24", "--cooldown", "0")
    config = network(sqlite_url, {"pool": "p"})
    for i in range(5):
        address(add(plugin, config, f"c{i}"))
        assert exec_plugin(plugin, "DEL", config, container=f"c{i}").returncode == 0
    gate = Gate(tmp_path, "pool-delete")
    deleting = cli_in_background(sqlite_url, gate, "pool", "delete", "p")
    gate.wait_reached()
    deleting.send_signal(signal.SIGKILL)
    deleting.wait(timeout=60)
    report = check_report(sqlite_url)
    assert [p["kind"] for p in report["problems"]] == ["pool-deleting"], report
    res = add(plugin, config, "meanwhile")  # never resurrected while deleting
    assert res.returncode != 0 and res.json["code"] == 103, res
    inline = network(sqlite_url, {"subnet": "10.0.0.0/24"}, name="p")
    res = add(plugin, inline, "inline")  # not even by a network named like it
    assert res.returncode != 0 and res.json["code"] == 103, res
    assert run_cli("pool", "delete", "p", store=sqlite_url).returncode == 0
    assert pool_keys(sqlite_url, "p") == []
    assert_clean(sqlite_url)


def churn(url: str, node: str, tag: str, stop: threading.Event, errors: list) -> None:
    """ADD then DEL, over and over, in pool `p`, as a node's agent would."""
    from ipward.core.errors import IpwardError

    with open_store(url) as store:
        ledger = Ledger(store, node)
        i = 0
        while not stop.is_set():
            attachment = Attachment("net", f"{node}-{tag}-{i}", "eth0")
            try:
                ledger.allocate([ledger.get_pool("p", fresh=True)], attachment, PodInfo())
            except IpwardError:
                pass  # the pool is being deleted, or gone
            except BaseException as e:
                errors.append(e)
                return
            ledger.free(attachment)
            i += 1


def test_deletes_under_add_del_loops_leave_no_key_behind(sqlite_url: str) -> None:
    """Found: 9 of 36 deletes under ADD/DEL loops left `free/` and `freeq/` keys that
    check did not see. Rounds of: a pool, two threads allocating and releasing in it
    (two ledgers, as two nodes' agents), and `pool delete` until it succeeds."""
    for round_ in range(6):
        assert create(sqlite_url, "p", "--range", "10.0.0.0/26", "--cooldown", "0").returncode == 0
        stop = threading.Event()
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=churn, args=(sqlite_url, node, str(round_), stop, errors))
            for node in ("n1", "n2")
        ]
        for t in threads:
            t.start()
        try:
            wait_for(
                lambda: run_cli("pool", "delete", "p", store=sqlite_url).returncode == 0,
                "a pool delete that succeeds",
                poll=0.2,
            )
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert pool_keys(sqlite_url, "p") == []
        assert_clean(sqlite_url)


# -- what a pool can leave behind -------------------------------------------------------


def test_check_names_orphans_and_removal_leaves_it_clean(sqlite_url: str) -> None:
    """Keys of every kind without their pool, a half-deleted pool, a key ipward does not
    write, stale keys of a pool, and a record no attachment's index lists: check names
    each; `--remove-orphans` removes the orphans and stale keys by compare-and-delete,
    frees the record (a record and its index are written together: it is damage), and
    nothing else."""
    create(sqlite_url, "live", "--range", "10.1.0.0/24")
    create(sqlite_url, "gone-soon", "--range", "10.2.0.0/24")
    block = rec.encode({"node": "n1", "state": "active", "next": 0})
    queued = "freeq/ghost/4/n1/000001700000000/10.9.0.7"
    orphans = {
        "blocks/ghost/10.9.0.0/26": block,
        "affinity/ghost/n1/10.9.0.0/26": b"",
        "fill/ghost/4/n1": rec.encode({"block": "10.9.0.0/26"}),
        "blockcursor/ghost/4": rec.encode({"next": 3}),
        "blockfree/ghost/4/10.9.0.64/26": b"",
        "free/ghost/10.9.0.7": rec.encode({"released_at": 1.0, "queue": queued}),
        queued: b"",
    }
    stale = {
        "blocks/live/10.200.0.0/26": block,  # not a block of its ranges
        "affinity/live/n1/10.200.0.0/26": b"",
        "blockcursor/live/6": rec.encode({"next": 3}),  # a family it does not have
    }
    record = {"network": "net", "container": "c", "ifname": "eth0", "node": "n1", "block": ""}
    with open_store(sqlite_url) as store:
        spec = rec.decode(store.get("pools/gone-soon").value)  # type: ignore[union-attr]
        writes = [Put(k, v) for k, v in {**orphans, **stale}.items()]
        writes += [
            Put("ips/ghost/10.9.0.9", rec.encode(record)),  # a record: never swept
            Put("somebody/else", b"x"),
            Put("pools/gone-soon", rec.encode({**spec, "state": "deleting"})),
        ]
        store.txn([], writes)
    report = check_report(sqlite_url)
    kinds: dict[str, set[str]] = {}
    for p in report["problems"]:
        kinds.setdefault(p["kind"], set()).add(p["key"])
    assert kinds["orphan"] == set(orphans)
    assert kinds["stale"] == set(stale)
    assert kinds["pool-deleting"] == {"pools/gone-soon"}
    assert kinds["unknown-key"] == {"somebody/else"}
    assert "ips/ghost/10.9.0.9" in kinds["outside-pool"]
    proc = run_cli("--json", "check", "--remove-orphans", store=sqlite_url)
    assert proc.returncode == 1, proc  # what needs a person is still reported
    after = json.loads(proc.stdout)
    assert sorted(after["removed"]) == sorted(orphans)
    assert after["pruned"]["live"]["keys"] == len(stale)
    assert after["unlisted_freed"] == ["ips/ghost/10.9.0.9"]
    left = {p["kind"] for p in after["problems"]}
    assert left == {"pool-deleting", "unknown-key"}
    with open_store(sqlite_url) as store:
        assert store.get("ips/ghost/10.9.0.9") is None
        assert store.get(keys.node_ip_key("n1", "ghost", "10.9.0.9")) is None
        assert store.get("somebody/else") is not None
        # The rest needs a person: the key of another program, the delete run again.
        store.txn([], [Delete("somebody/else")])
    assert run_cli("pool", "delete", "gone-soon", store=sqlite_url).returncode == 0
    assert_clean(sqlite_url)


@pytest.mark.parametrize("old_range", ["10.50.0.0/24", "fd00:50::/120"])
def test_prune_drops_a_layout_only_once_no_record_holds_it(sqlite_url: str, old_range: str) -> None:
    """`prune` drops a retired layout only once no record holds one of its addresses,
    and the stale state of the old ranges with it."""
    from ipward.ipam import pools

    with open_store(sqlite_url) as store:
        ledger = Ledger(store, "n1")
        old = PoolSpec("net", [[{"subnet": old_range}]], cooldown=0, source="cni-config")
        new = PoolSpec("net", [[{"subnet": "10.60.0.0/24"}]], cooldown=0, source="cni-config")
        ledger.allocate([old], Attachment("net", "a", "eth0"), PodInfo())
        ledger.allocate([old], Attachment("net", "b", "eth0"), PodInfo())
        ledger.free(Attachment("net", "b", "eth0"))  # a free entry of the old range
        ledger.allocate([new], Attachment("net", "c", "eth0"), PodInfo())
        keys, layouts = pools.prune(store, "net")
        assert layouts == 0  # "a" still holds an address of the old range
        assert keys >= 4  # its block, affinity, free and queue entries (its fill too)
        assert len(ledger.get_pool("net", fresh=True).retired) == 1
        assert_clean(sqlite_url)
        ledger.free(Attachment("net", "a", "eth0"))
        assert pools.prune(store, "net")[1] == 1
        assert ledger.get_pool("net", fresh=True).retired == []
        assert_clean(sqlite_url)


def test_prune_and_delete_of_a_large_pool_fit_etcd_transactions(tmp_path: Path) -> None:
    """On a real etcd (128 operations per transaction at most): a pool with hundreds of
    free entries and several blocks in an earlier layout is pruned, then deleted, in
    bounded transactions, and nothing of it is left."""
    from ipward.ipam import pools
    from ipward_lab.servers.etcd import etcd_server

    with etcd_server(tmp_path / "etcd") as server, open_store(server.url) as store:
        ledger = Ledger(store, "n1")
        old = PoolSpec("net", [[{"subnet": "10.70.0.0/23"}]], cooldown=0, source="cni-config")
        new = PoolSpec("net", [[{"subnet": "10.71.0.0/24"}]], cooldown=0, source="cni-config")
        for i in range(300):
            ledger.allocate([old], Attachment("net", f"o{i}", "eth0"), PodInfo())
        for i in range(300):
            ledger.free(Attachment("net", f"o{i}", "eth0"))
        for i in range(200):
            ledger.allocate([new], Attachment("net", f"n{i}", "eth0"), PodInfo())
        keys, layouts = pools.prune(store, "net")
        assert layouts == 1 and keys >= 600  # 300 free and 300 queue entries, 5 blocks...
        assert_clean(server.url)
        for i in range(200):
            ledger.free(Attachment("net", f"n{i}", "eth0"))
        assert pools.delete_pool(store, "net") >= 400
        assert pool_keys(server.url, "net") == []
        assert_clean(server.url)
