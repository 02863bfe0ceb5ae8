"""Damaged stores, on real ones: a malformed key or value (a stray write into SQLite, an
`etcdctl put` into a real etcd) reported by `ipward check` and `alloc list` while the
rest is still checked and listed, and removed by `check --remove-orphans`; a SQLite file
damaged by bytes written into it, as a flipped disk sector would (one bit of a held
record's key): `check` reports SQLite's integrity check, the agent refuses to start, a
single-node ADD does not hand the held address out again (its node index entry is the
second witness), and the ledger moves to a sound file by export and import, where
`--remove-orphans` writes the lost record back from its copy; and a record its
attachment's index does not list (a second address of one family, as a race of one
attachment's calls left it) freed by `--remove-orphans` through the ledger's freeing."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.ipam.allocation import record_writes
from ipward.ipam.check import check, repair
from ipward.ipam.ledger import Ledger
from ipward.store import open_store
from ipward.store.base import Put
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import EtcdServer
from support import exec_plugin

POOL = "pods"  # an inline pool is named after its network
NODE = "n1"


def network(url: str, *subnets: str) -> dict:
    ranges = [[{"subnet": subnet} for subnet in subnets]]
    ipam = {"type": "ipward", "store": url, "node": NODE, "ranges": ranges}
    return {"cniVersion": "1.0.0", "name": POOL, "ipam": ipam}


def address(out) -> str:
    assert out.returncode == 0, out
    return str(out.json["ips"][0]["address"]).split("/")[0]


def report(url: str, *args: str) -> tuple[int, dict]:
    proc = run_cli("--json", "check", *args, store=url)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def problems_by_kind(found: dict) -> dict[str, set[str]]:
    kinds: dict[str, set[str]] = {}
    for p in found["problems"]:
        kinds.setdefault(p["kind"], set()).add(p["key"])
    return kinds


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/ipward.db"
    etcd: EtcdServer = request.getfixturevalue("etcd")
    etcd.etcdctl("del", "", "--from-key")
    return etcd.url


def stray_put(url: str, request: pytest.FixtureRequest, key: str, value: str) -> None:
    """A write by someone else: `etcdctl put` on etcd, a plain store write on SQLite."""
    if url.startswith("etcd://"):
        request.getfixturevalue("etcd").etcdctl("put", key, value)
    else:
        with open_store(url) as store:
            store.txn([], [Put(key, value.encode())])


def test_check_alloc_list_and_remove_orphans_go_on_past_a_bad_key_and_value(
    store_url: str, request: pytest.FixtureRequest
) -> None:
    """Before: `check`, `check --remove-orphans` and `alloc list` exited 2, "not an IP
    address", on one malformed key."""
    run_cli("pool", "create", POOL, "--range", "10.61.0.0/24", store=store_url, check=True)
    with open_store(store_url) as store:
        ledger = Ledger(store, NODE)
        spec = ledger.get_pool(POOL)
        held = sorted(
            ledger.allocate([spec], rec.Attachment("net", f"c{i}", "eth0"), rec.PodInfo())[0].ip
            for i in range(2)
        )
    bad = {
        "ips/pods/not-an-ip": ("x", "bad-key"),
        "ips/pods/10.61.0.200": ("x", "bad-value"),
        "attach/n1/net/ghost/eth0": ('{"ips": 7}', "bad-value"),
    }
    for key, (value, _) in bad.items():
        stray_put(store_url, request, key, value)

    status, found = report(store_url)
    assert status == 1
    assert problems_by_kind(found) == {
        "bad-key": {k for k, (_, kind) in bad.items() if kind == "bad-key"},
        "bad-value": {k for k, (_, kind) in bad.items() if kind == "bad-value"},
    }
    assert found["allocations"] == 2  # the rest was checked

    listed = run_cli("--json", "alloc", "list", store=store_url)
    assert listed.returncode == 0, listed
    assert sorted(row["ip"] for row in json.loads(listed.stdout)) == held
    assert "ips/pods/not-an-ip" in listed.stderr and "ips/pods/10.61.0.200" in listed.stderr

    status, repaired = report(store_url, "--remove-orphans")
    assert status == 0, repaired
    assert {(p["key"], p["fix"]) for p in repaired["repaired"]} == {(k, "remove") for k in bad}
    assert sorted(repaired["unreadable_removed"]) == sorted(bad)
    with open_store(store_url) as store:
        assert all(store.get(key) is None for key in bad)
        assert [kv.key for kv in store.range(keys.ips_prefix(POOL))[0]] == [
            keys.ip_key(POOL, ip) for ip in held
        ]


def test_check_goes_on_past_a_bad_entry_under_every_prefix(sqlite_store) -> None:
    """Each prefix's keys and values, malformed one by one next to a sound ledger:
    every one is named, nothing else is, and `repair` removes them all."""
    spec = rec.encode({"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]]})
    sqlite_store.txn([], [Put(keys.pool_key("p"), spec)])
    ledger = Ledger(sqlite_store, NODE)
    ledger.allocate([ledger.get_pool("p")], rec.Attachment("net", "a", "eth0"), rec.PodInfo())
    bad_keys = [
        "blocks/p/10.0.9.0",
        "blocks/p/10.0.9.1/26",  # host bits set
        "affinity/p/n1",
        "fill/p/5/n1",
        "blockcursor/p/x",
        "blockfree/p/4/not-a-cidr/26",
        "ips/p/10.0.0.256",
        "ips/p/10.0.0.1/2",
        "ips/p/fd00:0::1",  # not the canonical text keys are written in
        "nodeips/n1/p/garbage",
        "nodeips//p/10.0.0.9",
        "attach/net/c",
        "free/p/",
        "freeq/p/4/n1/soon/10.0.0.9",
        "sticky/net/ns",
    ]
    bad_values = [
        "blocks/p/10.0.9.0/26",
        "fill/p/4/n9",
        "blockcursor/p/4",
        "ips/p/10.0.0.99",
        "nodeips/n1/p/10.0.0.98",
        "attach/n1/net/b/eth0",
        "free/p/10.0.0.97",
        "sticky/net/ns/db-0",
    ]
    writes = [Put(key, b"{}") for key in bad_keys]
    writes += [Put(key, b"[1, 2") for key in bad_values]
    sqlite_store.txn([], writes)
    problems, counts = check(sqlite_store)
    named = {(p.kind, p.key) for p in problems}
    assert named == {("bad-key", k) for k in bad_keys} | {("bad-value", k) for k in bad_values}
    assert counts["allocations"] == 1
    done = repair(ledger, problems)
    assert sorted(done["remove"]) == sorted(bad_keys + bad_values)
    assert check(sqlite_store)[0] == []


# -- a SQLite file damaged by bytes written into it ---------------------------------------


def flip_bit_of_key(db: Path, key: str, offset: int, bit: int) -> None:
    """Flip one bit of a row's key in the file, the way a bad disk sector would: the
    row stays, with another key, out of the b-tree's order. The kv table of these small
    stores is one page (a leaf of its b-tree), which holds the row once."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # every row in the file
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'kv'").fetchone()[0]
    finally:
        conn.close()
    data = bytearray(db.read_bytes())
    start = (root - 1) * page_size
    assert data[start] == 0x0A, "the kv table outgrew one page: use fewer rows"
    page = bytes(data[start : start + page_size])
    assert page.count(key.encode()) == 1, key
    data[start + page.index(key.encode()) + offset] ^= 1 << bit
    db.write_bytes(bytes(data))


@pytest.fixture
def damaged(tmp_path: Path, plugin: Path) -> tuple[str, Path, list[str]]:
    """A single-node store holding four addresses, the first one's record damaged by one
    flipped bit: `ips/pods/10.61.0.2` reads `ips/pods/10.61.0/2`, so no lookup finds it,
    while its attachment's index and its node index entry still name it. Returns the
    store URL, the file, the addresses held (c0's first)."""
    db = tmp_path / "ipward.db"
    url = f"sqlite://{db}"
    config = network(url, "10.61.0.0/24")
    held = [address(exec_plugin(plugin, "ADD", config, container=f"c{i}")) for i in range(4)]
    key = keys.ip_key(POOL, held[0])
    flip_bit_of_key(db, key, key.rindex("."), 0)  # "." (0x2e) becomes "/" (0x2f)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT 1 FROM kv WHERE key = ?", (key,)).fetchall() == []
    finally:
        conn.close()
    return url, db, held


def test_check_reports_the_damaged_file_and_remove_orphans_refuses_to_write_to_it(
    damaged: tuple[str, Path, list[str]], tmp_path: Path
) -> None:
    """Before: `check` said nothing of SQLite's integrity check (and exited 2 on the
    key). The way out the refusal names, export and import into a new file, works: there
    `--remove-orphans` removes the bad key and writes the record back from its copy."""
    url, db, held = damaged
    status, found = report(url)
    assert status == 1
    kinds = problems_by_kind(found)
    integrity = [p["detail"] for p in found["problems"] if p["kind"] == "integrity"]
    assert "SQLite: row not in PRIMARY KEY order for kv" in integrity
    flipped = keys.ip_key(POOL, held[0])[:-2] + "/" + held[0].rpartition(".")[2]
    assert kinds["bad-key"] == {flipped}
    assert kinds["record-lost"] == {keys.node_ip_key(NODE, POOL, held[0])}

    before = db.read_bytes()
    refused = run_cli("check", "--remove-orphans", store=url)
    assert refused.returncode == 2, refused
    for needle in ("is damaged", "ipward check", "ipward export", "import"):
        assert needle in refused.stderr, refused.stderr
    assert db.read_bytes() == before

    ledger_file = tmp_path / "ledger.jsonl"
    new = f"sqlite://{tmp_path}/new.db"
    run_cli("export", "-o", str(ledger_file), store=url, check=True)
    run_cli("import", str(ledger_file), store=new, check=True)
    status, repaired = report(new, "--remove-orphans")
    assert status == 0, repaired
    assert repaired["unreadable_removed"] == [flipped]
    assert repaired["records_restored"] == [keys.node_ip_key(NODE, POOL, held[0])]
    with open_store(new) as store:
        kv = store.get(keys.ip_key(POOL, held[0]))
        assert kv is not None and rec.AddressRecord.decode(kv.value).container == "c0"


def test_the_agent_refuses_to_start_on_a_damaged_sqlite_file(
    damaged: tuple[str, Path, list[str]], tmp_path: Path
) -> None:
    url, _, _ = damaged
    socket_path = tmp_path / "agent.sock"
    args = ("--node", NODE, "--socket", str(socket_path), "--metrics-address", "off")
    proc = run_cli("agent", *args, store=url)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    for needle in ("is damaged", "row not in PRIMARY KEY order", "ipward check", "ipward export"):
        assert needle in proc.stderr, proc.stderr
    assert not socket_path.exists()


def test_a_requested_address_whose_record_is_damaged_is_refused(
    damaged: tuple[str, Path, list[str]], plugin: Path
) -> None:
    """Before: the ADD asking for the address got it, while c0 held it."""
    url, _, held = damaged
    config = network(url, "10.61.0.0/24")
    out = exec_plugin(plugin, "ADD", config, container="c9", args=f"IgnoreUnknown=1;IP={held[0]}")
    assert out.returncode == 1 and out.json["code"] == 101, out
    assert "node index entry" in out.json["msg"]


def test_fresh_picking_passes_over_an_address_whose_record_is_damaged(
    damaged: tuple[str, Path, list[str]], plugin: Path
) -> None:
    """The network's ranges change, so the pool's block cursor starts over at its first
    address (the one damaged): its record reads as absent, its node index entry does
    not. Before: the ADD was handed it."""
    url, _, held = damaged
    config = network(url, "10.61.0.0/24", "10.62.0.0/24")
    given = [address(exec_plugin(plugin, "ADD", config, container=f"n{i}")) for i in range(2)]
    assert not set(given) & set(held), (given, held)


# -- a record its attachment's index does not list -----------------------------------------


def second_record(store, ledger: Ledger, attachment: rec.Attachment, ip: str) -> None:
    """What the race of one attachment's calls left (issue 21, point 1): a second
    record of one family for an attachment whose index lists only the first."""
    record = rec.AddressRecord.new(
        attachment, rec.PodInfo("ns", "dup7", "u"), NODE, "10.61.0.64/26", ledger.clock(), None
    )
    store.txn([], record_writes(POOL, ip, record))


def test_remove_orphans_frees_a_second_record_of_one_family_that_no_index_lists(
    store_url: str,
) -> None:
    """Before: `check` reported it and `check --remove-orphans` left it."""
    run_cli("pool", "create", POOL, "--range", "10.61.0.0/24", store=store_url, check=True)
    dup7 = rec.Attachment("podnet", "dup7", "eth0")
    with open_store(store_url) as store:
        ledger = Ledger(store, NODE)
        first = ledger.allocate([ledger.get_pool(POOL)], dup7, rec.PodInfo("ns", "dup7", "u"))
        second_record(store, ledger, dup7, "10.61.0.72")
    extra = keys.ip_key(POOL, "10.61.0.72")
    status, found = report(store_url)
    assert status == 1
    details = {(p["kind"], p["key"]): p["detail"] for p in found["problems"]}
    assert "also holds" in details["duplicate-address", extra]
    assert ("index-missing", extra) in details

    status, repaired = report(store_url, "--remove-orphans")
    assert status == 0, repaired
    assert repaired["unlisted_freed"] == [extra]
    with open_store(store_url) as store:
        assert store.get(extra) is None
        assert store.get(keys.node_ip_key(NODE, POOL, "10.61.0.72")) is None
        assert store.get(keys.free_key(POOL, "10.61.0.72")) is not None  # cooling down
        assert Ledger(store, NODE).lookup(dup7)[0].ip == first[0].ip  # the listed one stays


def test_an_unlisted_record_is_freed_through_the_ledger_and_logged_with_why(
    sqlite_store, tmp_path: Path
) -> None:
    sqlite_store.txn(
        [],
        [
            Put(
                keys.pool_key(POOL),
                rec.encode({"name": POOL, "ranges": [[{"subnet": "10.61.0.0/24"}]]}),
            )
        ],
    )
    ledger = Ledger(sqlite_store, NODE)
    dup7 = rec.Attachment("podnet", "dup7", "eth0")
    ledger.allocate([ledger.get_pool(POOL)], dup7, rec.PodInfo("ns", "dup7", "u"))
    second_record(sqlite_store, ledger, dup7, "10.61.0.72")
    logged = tmp_path / "log.jsonl"
    log.configure(str(logged), "info")
    try:
        done = repair(ledger, check(sqlite_store)[0])
    finally:
        log.configure(None, "warning")
    assert done["free"] == [keys.ip_key(POOL, "10.61.0.72")]
    freed = [json.loads(line) for line in logged.read_text().splitlines()]
    freed = [e for e in freed if e["msg"] == "freed"]
    assert len(freed) == 1 and freed[0]["ips"] == [f"{POOL}/10.61.0.72"], freed
    assert "does not list it" in freed[0]["reason"]
    assert check(sqlite_store)[0] == []
