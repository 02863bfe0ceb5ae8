"""SQLite store: the embedded default. One file, many processes, durable on commit.

Every process opens the file in WAL mode with `synchronous=FULL` (the WAL is fsynced at
each commit) and takes the write lock at the start of a transaction (`BEGIN IMMEDIATE`),
so compares and writes of one `txn` see and change a single state. The store revision
lives in the file; every write transaction bumps it by one and records its changes in an
`events` table, which watches poll. Leases are rows with an expiry time; keys of an
expired lease are deleted by the next writer (or watcher) that notices, and reads skip
them before that.

On the CNI plugin's start path: standard library only.
"""

from __future__ import annotations

import _thread
import os
import sqlite3
import time

from ipward.store.base import (
    DELETE,
    PUT,
    Compare,
    Delete,
    Event,
    KeyValue,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    TxnResult,
    Watch,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    create_revision INTEGER NOT NULL,
    mod_revision INTEGER NOT NULL,
    version INTEGER NOT NULL,
    lease INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('revision', 1), ('compacted', 0);
CREATE TABLE IF NOT EXISTS events (
    revision INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    create_revision INTEGER NOT NULL,
    version INTEGER NOT NULL,
    lease INTEGER NOT NULL,
    PRIMARY KEY (revision, seq)
) WITHOUT ROWID;
-- AUTOINCREMENT: a lease id is never reused, or a holder whose lease expired could
-- keep alive or revoke the next holder's lease.
CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl INTEGER NOT NULL,
                                   expires_at REAL NOT NULL);
"""

# Watch history kept in the file: a watcher further behind than this gets StoreError,
# as with a compacted etcd revision.
HISTORY_REVISIONS = 50_000
_COMPACT_EVERY = 1_000
_LIVE = "(lease = 0 OR lease IN (SELECT id FROM leases WHERE expires_at > ?))"
_COLUMNS = "key, value, create_revision, mod_revision, version, lease"
_HEADER = (
    "SELECT value, EXISTS (SELECT 1 FROM leases WHERE expires_at <= ?)"
    " FROM meta WHERE name = 'revision'"
)


def _row(row: tuple) -> KeyValue:
    return KeyValue(row[0], bytes(row[1]), row[2], row[3], row[4], row[5])


def _prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with `prefix` (for the
    empty prefix, one above every key: keys are text)."""
    if not prefix:
        return chr(0x10FFFF)
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class SqliteStore(Store):
    def __init__(self, path: str, busy_timeout: float = 5.0) -> None:
        self.path = path
        self._lock = _thread.RLock()
        try:
            directory = os.path.dirname(path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._conn = self._open(path, busy_timeout)
        except (sqlite3.Error, OSError) as e:
            raise StoreUnavailable(f"sqlite store {path}: {e}") from e
        # A txn reads its keys with one SQL variable each (see _read_keys).
        self.max_txn_keys = self._conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)

    @staticmethod
    def _open(path: str, busy_timeout: float) -> sqlite3.Connection:
        """Connect and set the file up. Switching a new file to WAL does not wait on the
        busy timeout (SQLite answers "locked" at once while another process does the
        same), so the first use of a file by several processes at once retries here."""
        deadline = time.monotonic() + busy_timeout
        while True:
            conn = sqlite3.connect(
                path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                # Creating the schema is idempotent but takes the write lock; skip it when
                # the file is already set up, which is every plugin exec after the first.
                if (
                    conn.execute("SELECT 1 FROM sqlite_master WHERE name='leases'").fetchone()
                    is None
                ):
                    conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
                return conn
            except sqlite3.OperationalError as e:
                conn.close()
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)

    @classmethod
    def from_url(cls, url: str) -> SqliteStore:
        path = url[len("sqlite://") :]
        if not path.startswith("/"):
            raise StoreError(f"sqlite URL needs an absolute path (sqlite:///PATH): {url!r}")
        return cls(path)

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            row = self._query_one(
                f"SELECT {_COLUMNS} FROM kv WHERE key = ? AND {_LIVE}", (key, time.time())
            )
        return None if row is None else _row(row)

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        # One statement, so one snapshot: the rows, then a last row carrying the revision.
        sql = (
            f"SELECT * FROM (SELECT {_COLUMNS} FROM kv WHERE key >= ? AND key < ? AND {_LIVE}"
            f" ORDER BY key{' LIMIT ?' if limit else ''})"
            " UNION ALL SELECT NULL, NULL, NULL, value, NULL, NULL FROM meta"
            " WHERE name = 'revision'"
        )
        params: tuple = (prefix, _prefix_end(prefix), time.time())
        if limit:
            params += (limit,)
        with self._lock:
            try:
                rows = self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as e:
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e
        return [_row(r) for r in rows[:-1]], int(rows[-1][3])

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        # A fixed handful of statements whatever the number of keys: a transaction of
        # the ledger costs about what a single-key one does (the fsync dominates).
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                now = time.time()
                revision, expired = self._conn.execute(_HEADER, (now,)).fetchone()
                if expired:
                    revision = self._expire_leases(now, revision)
                keys = {c.key for c in compares}
                keys.update(op.key for op in success)
                keys.update(op.key for op in failure)
                current = self._read_keys(keys)
                ok = all(c.holds(current.get(c.key)) for c in compares)
                ops = success if ok else failure
                if ops and self._apply(ops, revision + 1, current, now):
                    revision += 1
                    self._set_revision(revision)
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e
            except StoreError:
                self._rollback()
                raise
        return TxnResult(ok, revision)

    def watch(self, prefix: str, start_revision: int) -> Watch:
        return _SqliteWatch(self, prefix, start_revision)

    def lease_grant(self, ttl: int) -> int:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                cur = self._conn.execute(
                    "INSERT INTO leases (ttl, expires_at) VALUES (?, ?)", (ttl, time.time() + ttl)
                )
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e
        assert cur.lastrowid is not None
        return cur.lastrowid

    def lease_keepalive(self, lease: int) -> int:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                now = time.time()
                self._expire_leases(now, self._current_revision())
                cur = self._conn.execute(
                    "UPDATE leases SET expires_at = ? + ttl WHERE id = ? RETURNING ttl",
                    (now, lease),
                )
                row = cur.fetchone()
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e
        return 0 if row is None else int(row[0])

    def lease_revoke(self, lease: int) -> None:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                # Expire it now; the sweep deletes its keys at a new revision.
                self._conn.execute("UPDATE leases SET expires_at = 0 WHERE id = ?", (lease,))
                self._expire_leases(time.time(), self._current_revision())
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e

    def revision(self) -> int:
        with self._lock:
            row = self._query_one("SELECT value FROM meta WHERE name = 'revision'", ())
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- inside the lock ---------------------------------------------------------------

    def _query_one(self, sql: str, params: tuple) -> tuple | None:
        try:
            row: tuple | None = self._conn.execute(sql, params).fetchone()
            return row
        except sqlite3.Error as e:
            raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            # Not contextlib.suppress: its import costs ~3 ms per plugin exec.
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # already rolled back on SQLITE_BUSY

    def _current_revision(self) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        return int(row[0])

    def _set_revision(self, revision: int) -> None:
        self._conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (revision,))
        if revision % _COMPACT_EVERY == 0:
            floor = revision - HISTORY_REVISIONS
            self._conn.execute("DELETE FROM events WHERE revision <= ?", (floor,))
            self._conn.execute(
                "UPDATE meta SET value = max(value, ?) WHERE name = 'compacted'", (floor,)
            )

    def _read_keys(self, keys: set[str]) -> dict[str, KeyValue]:
        """Current state of `keys`, inside a write transaction (expired leases already
        swept, so no lease filter is needed)."""
        if not keys:
            return {}
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM kv WHERE key IN ({','.join('?' * len(keys))})", tuple(keys)
        ).fetchall()
        return {row[0]: _row(row) for row in rows}

    def _apply(
        self,
        ops: Sequence[Put | Delete],
        revision: int,
        current: dict[str, KeyValue],
        now: float,
    ) -> bool:
        """Write `ops` at `revision`; False if nothing changed (as etcd, no new revision)."""
        leases = {op.lease for op in ops if isinstance(op, Put) and op.lease}
        if leases:
            live = {
                r[0]
                for r in self._conn.execute(
                    f"SELECT id FROM leases WHERE expires_at > ? AND id IN"
                    f" ({','.join('?' * len(leases))})",
                    (now, *leases),
                )
            }
            if leases - live:
                raise StoreError(f"requested lease not found: {min(leases - live)}")
        upserts, deletes, events = [], [], []
        for seq, op in enumerate(ops):
            old = current.get(op.key)
            if isinstance(op, Put):
                create = old.create_revision if old else revision
                version = old.version + 1 if old else 1
                upserts.append((op.key, op.value, create, revision, version, op.lease))
                events.append((revision, seq, PUT, op.key, op.value, create, version, op.lease))
                current[op.key] = KeyValue(op.key, op.value, create, revision, version, op.lease)
            elif old is not None:
                deletes.append((op.key,))
                events.append((revision, seq, DELETE, op.key, b"", 0, 0, 0))
                del current[op.key]
        execute_many = self._conn.executemany
        if upserts:
            execute_many("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?, ?, ?)", upserts)
        if deletes:
            execute_many("DELETE FROM kv WHERE key = ?", deletes)
        if events:
            execute_many("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)", events)
        return bool(events)

    def _expire_leases(self, now: float, revision: int) -> int:
        """Delete keys of expired leases, at one new revision (stored) if there are any;
        returns the revision after it."""
        expired = [
            r[0] for r in self._conn.execute("SELECT id FROM leases WHERE expires_at <= ?", (now,))
        ]
        if not expired:
            return revision
        marks = ",".join("?" * len(expired))
        keys = [
            r[0]
            for r in self._conn.execute(f"SELECT key FROM kv WHERE lease IN ({marks})", expired)
        ]
        self._conn.execute(f"DELETE FROM leases WHERE id IN ({marks})", expired)
        if not keys:
            return revision
        revision += 1
        for seq, key in enumerate(keys):
            self._conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            self._conn.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, 0, 0, 0)",
                (revision, seq, DELETE, key, b""),
            )
        self._set_revision(revision)
        return revision

    def _has_expired_lease(self) -> bool:
        return (
            self._query_one("SELECT 1 FROM leases WHERE expires_at <= ? LIMIT 1", (time.time(),))
            is not None
        )

    def _events_since(self, prefix: str, revision: int) -> list[Event]:
        with self._lock:
            compacted = self._query_one("SELECT value FROM meta WHERE name = 'compacted'", ())
            if compacted is not None and revision <= compacted[0]:
                raise StoreError(f"revision {revision} has been compacted ({compacted[0]})")
            if self._has_expired_lease():
                self.txn((), ())  # the sweep runs inside any write transaction
            try:
                rows = self._conn.execute(
                    "SELECT kind, key, value, create_revision, revision, version, lease"
                    " FROM events WHERE revision >= ? AND key >= ? AND key < ?"
                    " ORDER BY revision, seq",
                    (revision, prefix, _prefix_end(prefix)),
                ).fetchall()
            except sqlite3.Error as e:
                raise StoreUnavailable(f"sqlite store {self.path}: {e}") from e
        return [Event(r[0], KeyValue(r[1], bytes(r[2]), r[3], r[4], r[5], r[6])) for r in rows]


class _SqliteWatch(Watch):
    """Polls the events table; other processes' commits show up within one interval."""

    POLL_SECONDS = 0.05

    def __init__(self, store: SqliteStore, prefix: str, start_revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._next = start_revision if start_revision > 0 else store.revision() + 1
        import threading  # only watchers pay for it, not the plugin

        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[Event]:
        while not self._cancelled.is_set():
            events = self._store._events_since(self._prefix, self._next)
            for event in events:
                if self._cancelled.is_set():
                    return
                yield event
            if events:
                self._next = events[-1].kv.mod_revision + 1
            else:
                self._cancelled.wait(self.POLL_SECONDS)

    def cancel(self) -> None:
        self._cancelled.set()
