"""What a store URL and a SQLite file must be for a store to open: URLs checked part by
part (a typo is an error naming the part, never a connection elsewhere), and SQLite
opening only its own files, making one only of an absent or empty file when asked, and
changing nothing it refuses. (The stores' behaviour once open, on SQLite and a real
etcd: `tests/system/test_store_conformance.py`.)"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from ipward.store import open_backend, sqlite
from ipward.store.base import (
    Put,
    StoreError,
    StoreIncompatible,
    StoreMissing,
    StoreUnreachable,
)


@pytest.mark.parametrize(
    "url",
    [
        "etcd://",
        "etcd://h:1?pasword=x",
        "etcd://h:1?user=u",
        "etcd://h:1?timeout=soon",
        "etcd://h:1?timeout=0",
        "etcd://h:1?ca=/etc/hostname",
        "etcds://h:1?cert=/etc/hostname",
        "etcds://h:1?ca=/nonexistent",
        "etcd://u:p@h:1",
    ],
)
def test_etcd_bad_urls(url: str) -> None:
    with pytest.raises(StoreError) as e:
        open_backend(url)
    assert not isinstance(e.value, StoreUnreachable)


# What ipward wrote before files were marked (main at d83b346): the same tables, no mark.
UNMARKED_LAYOUT = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL,
    create_revision INTEGER NOT NULL, mod_revision INTEGER NOT NULL,
    version INTEGER NOT NULL, lease INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('revision', 1), ('compacted', 0);
CREATE TABLE IF NOT EXISTS events (revision INTEGER NOT NULL, seq INTEGER NOT NULL,
    kind TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    create_revision INTEGER NOT NULL, version INTEGER NOT NULL, lease INTEGER NOT NULL,
    PRIMARY KEY (revision, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl INTEGER NOT NULL,
    expires_at REAL NOT NULL);
"""


def other_programs_database(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO users (name) VALUES ('alice')")
    sqlite3.connect(path).close()


def marked_by_another_program(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA application_id = 1234")


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.write_text("not a database, just text\n" * 40), "not an SQLite database"),
        (lambda p: p.write_bytes(b"x"), "not an SQLite database"),  # SQLite reads it as empty
        (lambda p: p.write_bytes(b"SQLite format 3\0" + b"\xff" * 200), "not an SQLite database"),
        (other_programs_database, "not ipward's (tables: users)"),
        (marked_by_another_program, "another program's SQLite database"),
        (lambda p: p.mkdir(), "is a directory"),
    ],
    ids=["text", "one-byte", "bad-header", "other-program", "other-application-id", "directory"],
)
@pytest.mark.parametrize("create", [True, False])
def test_sqlite_refuses_what_is_not_an_ipward_store_and_changes_nothing(
    tmp_path: Path, make: Callable[[Path], None], needle: str, create: bool
) -> None:
    path = tmp_path / "store.db"
    make(path)
    before = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in tmp_path.iterdir())
    with pytest.raises(StoreIncompatible, match=re.escape(needle)):
        open_backend(f"sqlite://{path}", create=create)
    after = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in tmp_path.iterdir())
    assert after == before  # not a byte written, no -wal or -shm file made


def test_sqlite_refuses_a_device() -> None:
    with pytest.raises(StoreIncompatible, match="not a regular file"):
        open_backend("sqlite:///dev/null")


def test_sqlite_makes_a_store_only_of_an_absent_or_empty_file_and_only_if_asked(
    tmp_path: Path,
) -> None:
    absent_path = tmp_path / "new" / "dir" / "store.db"
    empty_path = tmp_path / "empty.db"
    empty_path.touch()
    for path in (absent_path, empty_path):
        with pytest.raises(StoreMissing, match="no store at"):
            open_backend(f"sqlite://{path}", create=False)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]
    assert empty_path.stat().st_size == 0
    for path in (absent_path, empty_path):
        with open_backend(f"sqlite://{path}") as store:
            store.txn([], [Put("k", b"v")])
        with sqlite3.connect(path) as db:
            marks = db.execute("SELECT * FROM pragma_application_id(), pragma_user_version()")
            assert marks.fetchone() == (sqlite.APPLICATION_ID, sqlite.LAYOUT)
        with open_backend(f"sqlite://{path}", create=False) as store:
            kv = store.get("k")
            assert kv is not None and kv.value == b"v"


def test_sqlite_store_from_before_the_mark_is_recognised_and_marked(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(UNMARKED_LAYOUT)
        db.execute("INSERT INTO kv VALUES ('pools/p', x'7b7d', 2, 2, 1, 0)")
        db.execute("UPDATE meta SET value = 2 WHERE name = 'revision'")
    with open_backend(f"sqlite://{path}", create=False) as store:
        assert store.range("pools/")[0][0].value == b"{}"
        assert store.revision() == 2
    with sqlite3.connect(path) as db:
        marks = db.execute("SELECT * FROM pragma_application_id(), pragma_user_version()")
        assert marks.fetchone() == (sqlite.APPLICATION_ID, sqlite.LAYOUT)


def test_sqlite_refuses_a_newer_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    open_backend(f"sqlite://{path}").close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {sqlite.LAYOUT + 1}")
    with pytest.raises(
        StoreIncompatible, match=f"layout {sqlite.LAYOUT + 1}.*layout {sqlite.LAYOUT}"
    ):
        open_backend(f"sqlite://{path}")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("etcd://127.0.0.1:99999", "port '99999'"),
        ("etcd://127.0.0.1:0", "port '0'"),
        ("etcd://127.0.0.1:x", "port 'x'"),
        ("etcd://127.0.0.1:", "port ''"),
        ("etcd://:2379", "host"),
        ("etcd://h:1,", "host"),
        ("etcd://h:1,:2", "host"),
        ("etcd://a b:1", "host"),
        ("etcd://[::1:1", "IPv6"),
        ("etcd://[::1]:70000", "port '70000'"),
        ("etcd://h:1?timeout=nan", "timeout 'nan'"),
        ("etcd://h:1?timeout=inf", "timeout 'inf'"),
        ("etcd://h:1?timeout=-1", "timeout '-1'"),
        ("etcd://h:1?timeout=1&timeout=2", "twice: timeout"),
        ("etcd://h:1#x", "etcd://HOST:PORT"),
        ("sqlite:///tmp/x.db?mode=ro", "query (?mode=ro)"),
        ("sqlite:///tmp/x.db#frag", "fragment (#frag)"),
        ("sqlite:///tmp/", "must name a file"),
        ("sqlite://tmp/x.db", "absolute path"),
    ],
)
def test_store_urls_are_checked_part_by_part(url: str, needle: str) -> None:
    with pytest.raises(StoreError) as e:
        open_backend(url)
    assert not isinstance(e.value, StoreUnreachable)
    assert needle in str(e.value)


def test_etcd_url_accepts_what_it_documents() -> None:
    from ipward.store.etcd import EtcdStore

    for url, targets in [
        ("etcd://h", ["h:2379"]),
        ("etcd://h:1,10.0.0.2:2379", ["h:1", "10.0.0.2:2379"]),
        ("etcd://[::1]:2379,[fd00::2]", ["[::1]:2379", "[fd00::2]:2379"]),
    ]:
        assert EtcdStore.from_url(url + "?timeout=0.5")._targets == targets
