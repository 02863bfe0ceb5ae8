"""SQLite store: the embedded default. One file, many processes, durable on commit.

Every process opens the file in WAL mode with `synchronous=FULL` (the WAL is fsynced at
each commit) and takes the write lock at the start of a transaction (`BEGIN IMMEDIATE`),
so compares and writes of one `txn` see and change a single state. The store revision
lives in the file; every write transaction bumps it by one and records its changes in an
`events` table, which watches poll. Leases are rows with an expiry time; keys of an
expired lease are deleted by the next writer (or watcher) that notices, and reads skip
them before that.

On the CNI plugin's start path: standard library only. Over 600 lines, on purpose: one
backend whose parts (opening and judging a file, transactions, leases, the WAL bound,
watches polling the events table) share one connection and its lock; split, they would
each reach into the others' state, and the plugin would import more files per exec.
"""

from __future__ import annotations

import _thread
import posix
import time

from ipward.core.startpath import load_sqlite3
from ipward.store.base import (
    DELETE,
    PUT,
    Compacted,
    Compare,
    Delete,
    Event,
    KeyValue,
    Put,
    Store,
    StoreError,
    StoreIncompatible,
    StoreMissing,
    StoreUnreachable,
    TxnResult,
    Watch,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


load_sqlite3()  # `_sqlite3` without `functools` on the plugin's path (see there)
import _sqlite3  # noqa: E402  (loaded above)

# The tables, made in one transaction with the marks below when a file is new.
_TABLES = (
    """CREATE TABLE kv (
        key TEXT PRIMARY KEY,
        value BLOB NOT NULL,
        create_revision INTEGER NOT NULL,
        mod_revision INTEGER NOT NULL,
        version INTEGER NOT NULL,
        lease INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID""",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT INTO meta VALUES ('revision', 1), ('compacted', 0)",
    """CREATE TABLE events (
        revision INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value BLOB NOT NULL,
        create_revision INTEGER NOT NULL,
        version INTEGER NOT NULL,
        lease INTEGER NOT NULL,
        PRIMARY KEY (revision, seq)
    ) WITHOUT ROWID""",
    # AUTOINCREMENT: a lease id is never reused, or a holder whose lease expired could
    # keep alive or revoke the next holder's lease.
    """CREATE TABLE leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl INTEGER NOT NULL,
                            expires_at REAL NOT NULL)""",
)

# An ipward file is marked in its header: `application_id` says whose file it is (SQLite
# keeps the field for exactly this), `user_version` which table layout it has. A file
# without the mark that has tables is another program's and is never touched; a file
# with the mark is known by reading two header fields, without looking up its tables.
APPLICATION_ID = 0x49505744  # "IPWD"
LAYOUT = 1
# Files made before the mark existed (layout 0): exactly these tables, this kv table.
_UNMARKED_TABLES = frozenset(("kv", "meta", "events", "leases"))
_KV_COLUMNS = ["key", "value", "create_revision", "mod_revision", "version", "lease"]
# SQLite's answers for a file that is not a database, or not a sound one.
_NOT_A_DATABASE = (26, 11)  # SQLITE_NOTADB, SQLITE_CORRUPT

# A commit of a short-lived store that leaves the WAL larger than this checkpoints it
# and empties it (SQLite's own checkpoints never do in such a process: see _bound_wal).
WAL_LIMIT = 512 * 1024
# How long that checkpoint waits for other processes' transactions (the commit it
# follows is done: a busy store is checkpointed by a later commit).
_CHECKPOINT_WAIT_MS = 50

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


def _marks(conn: _sqlite3.Connection) -> tuple[int, int]:
    """(application_id, user_version) from the file's header. Two PRAGMAs: the one-query
    form (`pragma_application_id()` table functions) costs some 50 us more per open."""
    return (
        conn.execute("PRAGMA application_id").fetchone()[0],
        conn.execute("PRAGMA user_version").fetchone()[0],
    )


_S_IFMT, _S_IFDIR, _S_IFREG = 0o170000, 0o040000, 0o100000


def _mode(path: str) -> int | None:
    """The file type bits of `path` (followed), None if it cannot be stat'ed."""
    try:
        return posix.stat(path).st_mode & _S_IFMT
    except (OSError, ValueError):
        return None


def _row(row: tuple) -> KeyValue:
    return KeyValue(row[0], bytes(row[1]), row[2], row[3], row[4], row[5])


def _prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with `prefix` (for the
    empty prefix, one above every key: keys are text)."""
    if not prefix:
        return chr(0x10FFFF)
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class SqliteStore(Store):
    """`create`: a missing or empty file (and its directory) may be made into a store;
    without it such a file is StoreMissing and nothing is created. `short_lived`: the
    process commits a few times and exits without closing the store (each plugin
    exec), so its commits keep the WAL bounded themselves (`_bound_wal`)."""

    def __init__(
        self,
        path: str,
        busy_timeout: float = 5.0,
        *,
        create: bool = True,
        short_lived: bool = False,
    ) -> None:
        self.path = path
        self._short_lived = short_lived
        self._lock = _thread.RLock()
        self._busy_ms = int(busy_timeout * 1000)
        try:
            if not create and _mode(path) is None:
                raise StoreMissing(f"no store at sqlite://{path}")
            directory = path.rpartition("/")[0]
            if directory and create and _mode(directory) != _S_IFDIR:
                import os  # only to make the directory: `os` costs ~0.5 ms per plugin exec

                os.makedirs(directory, exist_ok=True)
            self._conn = self._open(path, busy_timeout, create)
        except (_sqlite3.Error, OSError) as e:
            if isinstance(e, _sqlite3.Error) and e.sqlite_errorcode in _NOT_A_DATABASE:
                raise StoreIncompatible(f"{path} is not an SQLite database: {e}") from e
            if _mode(path) == _S_IFDIR:
                raise StoreIncompatible(f"{path} is a directory, not a store file") from e
            raise StoreUnreachable(f"sqlite store {path}: {e}") from e
        # A txn reads its keys with one SQL variable each (see _read_keys).
        self.max_txn_keys = self._conn.getlimit(_sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)

    @classmethod
    def _open(cls, path: str, busy_timeout: float, create: bool) -> _sqlite3.Connection:
        """Connect, make sure the file is ipward's (or make it so), and set it up.
        Switching a new file to WAL does not wait on the busy timeout (SQLite answers
        "locked" at once while another process does the same), so the first use of a file
        by several processes at once retries here."""
        # A URI, so that a read-only open never creates the file.
        quoted = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
        uri = f"file://{quoted if quoted.startswith('/') else f'{posix.getcwd()}/{quoted}'}"
        uri += "?mode=rwc" if create else "?mode=rw"
        deadline = time.monotonic() + busy_timeout
        while True:
            conn = _sqlite3.connect(
                uri, timeout=busy_timeout, isolation_level=None, check_same_thread=False, uri=True
            )
            try:
                # Before anything else touches the file: WAL mode is written into it.
                if _marks(conn) != (APPLICATION_ID, LAYOUT):
                    cls._claim(conn, path, create)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                return conn
            except _sqlite3.OperationalError as e:
                conn.close()
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
            except BaseException:
                conn.close()
                raise

    @classmethod
    def _claim(cls, conn: _sqlite3.Connection, path: str, create: bool) -> None:
        """A file not (yet) marked as an ipward store of this layout: refuse it, or, if it
        is new or empty (and `create`), make the tables and mark it in one transaction;
        a file of ipward's made before the mark existed is marked on the way."""
        if cls._judge(conn, path) == "ours":
            return
        if not create:
            raise StoreMissing(f"no store at sqlite://{path} (the file is empty)")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Again under the write lock: another process may have been quicker.
            if cls._judge(conn, path) == "empty":
                for statement in _TABLES:
                    conn.execute(statement)
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version={LAYOUT}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _judge(conn: _sqlite3.Connection, path: str) -> str:
        """What the file is: `ours` (marked, or an ipward file from before the mark,
        which is marked now if the file may be written), `empty` (no tables: a new,
        0-byte or empty database file), or StoreIncompatible naming why it is not ours."""
        application_id, layout = _marks(conn)
        if application_id == APPLICATION_ID:
            if layout == LAYOUT:
                return "ours"
            raise StoreIncompatible(
                f"{path} is an ipward store of file layout {layout}; this ipward knows"
                f" layout {LAYOUT}" + (" (made by a newer ipward)" if layout > LAYOUT else "")
            )
        if application_id != 0:
            raise StoreIncompatible(
                f"{path} is another program's SQLite database (application_id"
                f" {application_id:#x}); not touching it"
            )
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            st = posix.stat(path)
            if st.st_mode & _S_IFMT != _S_IFREG:  # /dev/null, a fifo: SQLite would take them
                raise StoreIncompatible(f"{path} is not a regular file; not touching it")
            # SQLite reads a few bytes of anything as an empty database. (Never open the
            # file itself to look: closing any descriptor of it drops this process's
            # POSIX locks, and another process would then delete the WAL under us.)
            if st.st_size and not conn.execute("PRAGMA page_count").fetchone()[0]:
                raise StoreIncompatible(f"{path} is not an SQLite database")
            return "empty"
        columns = [r[1] for r in conn.execute("PRAGMA table_info(kv)")]
        if tables - {"sqlite_sequence"} != _UNMARKED_TABLES or columns != _KV_COLUMNS:
            raise StoreIncompatible(
                f"{path} is an SQLite database that is not ipward's (tables:"
                f" {', '.join(sorted(tables))}); not touching it"
            )
        if conn.in_transaction:
            return "ours"  # judged again inside _claim's transaction: marked next time
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={LAYOUT}")
            conn.execute("COMMIT")
        except _sqlite3.OperationalError as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if "readonly" not in str(e):  # a reader without write access uses it as is
                raise
        return "ours"

    @classmethod
    def from_url(cls, url: str, *, create: bool = True, short_lived: bool = False) -> SqliteStore:
        """`sqlite:///ABSOLUTE/PATH`; no options (a query or fragment is refused rather
        than taken as part of the file name)."""
        path = url[len("sqlite://") :]
        if not path.startswith("/"):
            raise StoreError(f"sqlite URL needs an absolute path (sqlite:///PATH): {url!r}")
        for char, part in (("?", "query"), ("#", "fragment")):
            if char in path:
                raise StoreError(
                    f"sqlite URL {url!r}: a {part} ({char}{path.partition(char)[2]}) is not"
                    " supported; sqlite URLs take no options"
                )
        if path.endswith("/") or "\0" in path:
            raise StoreError(f"sqlite URL {url!r}: the path must name a file")
        return cls(path, create=create, short_lived=short_lived)

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
            except _sqlite3.Error as e:
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
        return [_row(r) for r in rows[:-1]], int(rows[-1][3])

    def snapshot(self, prefixes: Sequence[str]) -> tuple[list[KeyValue], int]:
        # One read transaction: in WAL mode it sees one committed state throughout.
        sql = f"SELECT {_COLUMNS} FROM kv WHERE key >= ? AND key < ? AND {_LIVE} ORDER BY key"
        now = time.time()
        kvs: list[KeyValue] = []
        with self._lock:
            try:
                self._conn.execute("BEGIN")
                for prefix in prefixes:
                    rows = self._conn.execute(sql, (prefix, _prefix_end(prefix), now))
                    kvs.extend(_row(r) for r in rows)
                revision = self._current_revision()
                self._conn.execute("COMMIT")
            except _sqlite3.Error as e:
                self._rollback()
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
        return kvs, revision

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
            except _sqlite3.Error as e:
                self._rollback()
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
            except StoreError:
                self._rollback()
                raise
            if self._short_lived:
                self._bound_wal()
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
            except _sqlite3.Error as e:
                self._rollback()
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
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
            except _sqlite3.Error as e:
                self._rollback()
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
        return 0 if row is None else int(row[0])

    def lease_revoke(self, lease: int) -> None:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                # Expire it now; the sweep deletes its keys at a new revision.
                self._conn.execute("UPDATE leases SET expires_at = 0 WHERE id = ?", (lease,))
                self._expire_leases(time.time(), self._current_revision())
                self._conn.execute("COMMIT")
            except _sqlite3.Error as e:
                self._rollback()
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e

    def revision(self) -> int:
        with self._lock:
            row = self._query_one("SELECT value FROM meta WHERE name = 'revision'", ())
        assert row is not None
        return int(row[0])

    def integrity_problems(self) -> list[str]:
        # Not `quick_check`: it passes a key overwritten out of order, which hides the
        # row from every lookup of it (measured).
        with self._lock:
            try:
                rows = self._conn.execute("PRAGMA integrity_check").fetchall()
            except _sqlite3.Error as e:
                if e.sqlite_errorcode in _NOT_A_DATABASE:
                    return [f"SQLite: {e}"]
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
        return [f"SQLite: {row[0]}" for row in rows if row[0] != "ok"]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- inside the lock ---------------------------------------------------------------

    def _query_one(self, sql: str, params: tuple) -> tuple | None:
        try:
            row: tuple | None = self._conn.execute(sql, params).fetchone()
            return row
        except _sqlite3.Error as e:
            raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            # Not contextlib.suppress: its import costs ~3 ms per plugin exec.
            try:
                self._conn.execute("ROLLBACK")
            except _sqlite3.Error:
                pass  # already rolled back on SQLITE_BUSY

    def _bound_wal(self) -> None:
        """Checkpoint the WAL into the file and empty it once it outgrows WAL_LIMIT.
        SQLite's automatic checkpoint copies the WAL into the file but leaves it to the
        connection's next write to start the WAL over; a process that writes once and
        exits (each plugin exec) never does, and the next process, rebuilding the WAL
        index from the WAL alone, counts none of it as copied. Unbounded, the WAL grows
        by every plugin ADD (12 MB after 400), and every exec reads all of it and copies
        it all again. TRUNCATE, as RESTART would leave the old frames for the
        next process to find; it waits briefly for other processes' transactions (if
        it cannot finish, a later commit does it). Only for `short_lived` stores: a
        long-lived writer's WAL starts over in place, and emptying it would make every
        commit grow the file again (an fsync that writes metadata: half the commit
        rate, measured)."""
        try:
            if posix.stat(f"{self.path}-wal").st_size <= WAL_LIMIT:
                return
        except OSError:
            return
        conn = self._conn
        try:
            conn.execute(f"PRAGMA busy_timeout={_CHECKPOINT_WAIT_MS}")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except _sqlite3.Error:
            pass  # committed already; the next commit tries again
        finally:
            conn.execute(f"PRAGMA busy_timeout={self._busy_ms}")

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
                raise Compacted(f"revision {revision} has been compacted ({compacted[0]})")
            if self._has_expired_lease():
                self.txn((), ())  # the sweep runs inside any write transaction
            try:
                rows = self._conn.execute(
                    "SELECT kind, key, value, create_revision, revision, version, lease"
                    " FROM events WHERE revision >= ? AND key >= ? AND key < ?"
                    " ORDER BY revision, seq",
                    (revision, prefix, _prefix_end(prefix)),
                ).fetchall()
            except _sqlite3.Error as e:
                raise StoreUnreachable(f"sqlite store {self.path}: {e}") from e
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

    def batches(self) -> Iterator[list[Event]]:
        while not self._cancelled.is_set():
            # One statement: whole revisions.
            events = self._store._events_since(self._prefix, self._next)
            if events:
                yield events
            if self._cancelled.is_set():
                return
            if events:
                self._next = events[-1].kv.mod_revision + 1
            else:
                self._cancelled.wait(self.POLL_SECONDS)

    def cancel(self) -> None:
        self._cancelled.set()
