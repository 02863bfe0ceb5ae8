"""The SQLite store's WAL stays bounded when each writer is a process that commits once
and exits, as every plugin exec is (docs/architecture.md "Plugin start path")."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from ipward.core import keys
from ipward.store import open_store
from ipward.store.base import Put
from ipward.store.sqlite import WAL_LIMIT, SqliteStore
from support import exec_plugin


def test_wal_stays_bounded_over_plugin_execs(plugin: Path, tmp_path: Path) -> None:
    """SQLite's own checkpoints never start the WAL over in such a process: before the
    fix it grew by every ADD (about 25 KiB each; 12 MB after 400) and each exec read
    it all. Here it is emptied whenever a commit leaves it over WAL_LIMIT, and every
    address given stays in the store."""
    db = tmp_path / "ipward.db"
    ipam = {"type": "ipward", "store": f"sqlite://{db}", "ranges": [[{"subnet": "10.5.0.0/16"}]]}
    config = {"cniVersion": "1.0.0", "name": "walnet", "ipam": ipam}
    wal = Path(f"{db}-wal")
    sizes, addresses = [], set()
    for n in range(90):  # 2 MiB and more of WAL without the bound
        result = exec_plugin(plugin, "ADD", config, container=f"c{n}")
        assert result.returncode == 0, result
        addresses.add(result.json["ips"][0]["address"])
        sizes.append(wal.stat().st_size if wal.exists() else 0)
    assert max(sizes) <= WAL_LIMIT + 64 * 1024, sizes  # the limit plus one ADD's pages
    assert any(b < a for a, b in pairwise(sizes)), sizes  # emptied
    assert len(addresses) == 90
    store = open_store(f"sqlite://{db}", create=False)
    try:
        attachments, _ = store.range(keys.ATTACHMENTS)
    finally:
        store.close()
    assert len(attachments) == 90  # every ADD's record, read from the file


def test_a_long_lived_writer_reuses_its_wal_in_place(tmp_path: Path) -> None:
    """Only a short-lived store (the plugin's) empties its WAL: a long-lived writer's WAL
    starts over in place after SQLite's checkpoint, and emptying it would make every
    commit grow the file again (half the commit rate, measured). Past SQLite's
    checkpoint (1,000 pages) the file never shrinks."""
    store = SqliteStore(str(tmp_path / "s.db"))
    wal = tmp_path / "s.db-wal"
    sizes = []
    try:
        for n in range(400):  # ~4 pages each: the WAL starts over at least once
            store.txn([], [Put(f"k/{n}/{i}", b"x" * 200) for i in range(4)])
            sizes.append(wal.stat().st_size)
    finally:
        store.close()
    assert max(sizes) > WAL_LIMIT  # the bound did not apply
    assert sizes == sorted(sizes), "the long-lived writer's WAL was emptied"
