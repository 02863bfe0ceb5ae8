"""Damaged stores, on real ones: a SQLite file damaged by bytes written into it, as a
flipped disk sector would (one bit of a held record's key): the agent refuses to start,
a single-node ADD does not hand the held address out again (its node index entry is the
second witness)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from conftest import exec_plugin, run_cli
from ipward.core import keys

POOL = "pods"  # an inline pool is named after its network
NODE = "n1"


def network(url: str, *subnets: str) -> dict:
    ranges = [[{"subnet": subnet} for subnet in subnets]]
    ipam = {"type": "ipward", "store": url, "node": NODE, "ranges": ranges}
    return {"cniVersion": "1.0.0", "name": POOL, "ipam": ipam}


def address(out) -> str:
    assert out.returncode == 0, out
    return str(out.json["ips"][0]["address"]).split("/")[0]


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
