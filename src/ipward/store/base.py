"""The store contract: a revisioned key-value store with transactions, watches and leases.

Vocabulary is etcd v3's: every write bumps the store's revision; a key carries the
revision that created it (`create_revision`), the revision of its last write
(`mod_revision`) and how many times it was written since creation (`version`).
A transaction applies its puts and deletes atomically, at one new revision, only when
all of its compares hold.

This module is on the CNI plugin's start path: standard library only, and nothing
that is costly to import (no typing, dataclasses, enum).
"""

from __future__ import annotations

import abc

from ipward.core.errors import TryAgainLater

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


class StoreError(Exception):
    """The store could not do what was asked."""


class StoreUnreachable(StoreError, TryAgainLater):
    """The store cannot be reached or is too busy, or a write's outcome is unknown: the
    caller may try again later. One class for the store layer and the CNI answer (code
    11), so nothing between them translates it. Each raise says which store and why."""


class StoreMissing(StoreError):
    """There is no store at this URL, and the caller may not create one (a read-only
    command): no file, an empty file, or an etcd without ipward's schema key."""


class StoreIncompatible(StoreError):
    """The store is there but this code must not use it: not ipward's (a garbage file,
    another program's database, a directory), a newer layout or schema, an older schema
    not yet migrated, an import in progress. Permanent: trying again cannot help."""


class StoreDamaged(StoreIncompatible):
    """The store reports damage to its data (SQLite's integrity check, etcd's CORRUPT
    alarm): what it reads back is not to be trusted (a key it holds may read as absent,
    and its address be handed out again), so no daemon serves from it and no repair
    writes to it. Permanent: the ledger must move to a sound store."""


class Compacted(StoreError):
    """A watch asked for revisions whose history the store no longer keeps (etcd's
    compaction, SQLite's bounded events table): read the keys whole again."""


class TxnTooLarge(StoreError):
    """The store refused a transaction as over its limits (see `Store.txn_problem`):
    trying again cannot help."""


class KeyValue:
    __slots__ = ("create_revision", "key", "lease", "mod_revision", "value", "version")

    def __init__(
        self,
        key: str,
        value: bytes,
        create_revision: int,
        mod_revision: int,
        version: int,
        lease: int = 0,
    ) -> None:
        self.key = key
        self.value = value
        self.create_revision = create_revision
        self.mod_revision = mod_revision
        self.version = version
        self.lease = lease

    def __repr__(self) -> str:
        return f"KeyValue({self.key!r}, mod_revision={self.mod_revision})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyValue) and all(
            getattr(self, s) == getattr(other, s) for s in self.__slots__
        )


# Compare targets and operators, as etcd names them.
VALUE = "value"
VERSION = "version"
CREATE = "create_revision"
MOD = "mod_revision"
TARGETS = (VALUE, VERSION, CREATE, MOD)
OPERATORS = ("==", "!=", "<", ">")


class Compare:
    """One condition of a transaction, on one key. A missing key has version,
    create_revision and mod_revision 0 and no value (a value compare fails)."""

    __slots__ = ("key", "op", "operand", "target")

    def __init__(self, key: str, target: str, op: str, operand: int | bytes) -> None:
        if target not in TARGETS or op not in OPERATORS:
            raise ValueError(f"bad compare: {target} {op}")
        self.key = key
        self.target = target
        self.op = op
        self.operand = operand

    def holds(self, kv: KeyValue | None) -> bool:
        """Evaluate against the key's current state (used by backends without native
        compares)."""
        if self.target == VALUE:
            if kv is None:
                return False
            actual: int | bytes = kv.value
        elif kv is None:
            actual = 0
        else:
            actual = getattr(kv, self.target)
        operand = self.operand
        if self.op == "==":
            return actual == operand
        if self.op == "!=":
            return actual != operand
        if self.op == "<":
            return actual < operand  # type: ignore[operator]
        return actual > operand  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"Compare({self.key!r} {self.target} {self.op} {self.operand!r})"


def absent(key: str) -> Compare:
    return Compare(key, VERSION, "==", 0)


def at_revision(key: str, mod_revision: int) -> Compare:
    """The key is exactly as read: present with this mod_revision, or absent if 0."""
    return Compare(key, MOD, "==", mod_revision)


class Put:
    __slots__ = ("key", "lease", "value")

    def __init__(self, key: str, value: bytes, lease: int = 0) -> None:
        self.key = key
        self.value = value
        self.lease = lease

    def __repr__(self) -> str:
        return f"Put({self.key!r})"


class Delete:
    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Delete({self.key!r})"


class TxnResult:
    __slots__ = ("revision", "succeeded")

    def __init__(self, succeeded: bool, revision: int) -> None:
        self.succeeded = succeeded
        self.revision = revision


PUT = "put"
DELETE = "delete"


class Event:
    """One change seen by a watch. `kv` is the key after a put; for a delete it carries
    the key and the deleting revision as mod_revision, with an empty value."""

    __slots__ = ("kind", "kv")

    def __init__(self, kind: str, kv: KeyValue) -> None:
        self.kind = kind
        self.kv = kv

    def __repr__(self) -> str:
        return f"Event({self.kind}, {self.kv.key!r}@{self.kv.mod_revision})"


class Watch(abc.ABC):
    """An open watch: iterate for events in revision order (or for `batches` of them);
    cancel to stop."""

    @abc.abstractmethod
    def batches(self) -> Iterator[list[Event]]:
        """The events in groups as the store delivers them, each group whole revisions
        (never part of one transaction's changes): a reader applying group by group
        sees only states the store had."""

    def __iter__(self) -> Iterator[Event]:
        for batch in self.batches():
            yield from batch

    @abc.abstractmethod
    def cancel(self) -> None: ...


# Upper bounds of the protobuf bytes etcd encodes around keys, values and operands: the
# field tags, lengths and numbers of a Compare (< 24) or a RequestOp (< 32), and of the
# TxnRequest inside etcd's raft request, with its header and user name (< 1024).
# tests/system/test_agent.py measures them against the real encoding.
TXN_BYTES_PER_COMPARE = 32
TXN_BYTES_PER_OP = 40
TXN_BYTES_BASE = 1024


def txn_bytes(
    compares: Sequence[Compare], success: Sequence[Put | Delete], failure: Sequence[Put | Delete]
) -> int:
    """An upper bound of a transaction's size as etcd counts it against its request
    limit (the request as encoded in its raft log)."""
    size = TXN_BYTES_BASE
    for c in compares:
        operand = len(c.operand) if isinstance(c.operand, bytes) else 0
        size += TXN_BYTES_PER_COMPARE + _utf8_length(c.key) + operand
    for op in (*success, *failure):
        value = len(op.value) if isinstance(op, Put) else 0
        size += TXN_BYTES_PER_OP + _utf8_length(op.key) + value
    return size


def _utf8_length(key: str) -> int:
    return len(key) if key.isascii() else len(key.encode("utf-8", "surrogatepass"))


class Store(abc.ABC):
    """What ipward needs of a store. Every method may raise StoreUnreachable.

    A `txn` that raises StoreUnreachable may or may not have been applied (the answer
    was lost, not necessarily the write): callers make their writes idempotent and
    re-read rather than assume either. A `txn` that changes nothing (only deletes of
    missing keys) makes no new revision. A Put with an unknown or expired lease fails
    the whole `txn` with StoreError. Revoking a lease that is gone is not an error.
    A watch reports a broken stream by raising StoreUnreachable from iteration; watch
    again from the last revision seen plus one. A watch from a revision whose history
    is gone raises Compacted. etcd raises lease TTLs below 2 s to 2 s.

    A transaction must respect the store's limits, None where it has none of that kind:
    `max_txn_ops`, compares and the writes of each branch, each counted apart (as etcd
    counts them: `--max-txn-ops`, 128 by default); `max_txn_keys`, distinct keys in all
    (SQLite reads them with one SQL variable each); `max_txn_bytes`, the encoded request
    as `txn_bytes` bounds it (etcd's `--max-request-bytes`, 1.5 MiB by default).
    `txn_problem` says whether a transaction does; one that does not may be refused with
    TxnTooLarge (or, when the server's limits are lower than these, still be).
    """

    max_txn_ops: int | None = None
    max_txn_keys: int | None = None
    max_txn_bytes: int | None = None

    def txn_problem(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> str | None:
        """What in this transaction is over the store's limits, or None."""
        if self.max_txn_ops is not None:
            ops = max(len(compares), len(success), len(failure))
            if ops > self.max_txn_ops:
                return f"{ops} operations (the store takes {self.max_txn_ops})"
        if self.max_txn_keys is not None:
            keys = {c.key for c in compares}
            keys.update(op.key for op in success)
            keys.update(op.key for op in failure)
            if len(keys) > self.max_txn_keys:
                return f"{len(keys)} keys (the store takes {self.max_txn_keys})"
        if self.max_txn_bytes is not None:
            size = txn_bytes(compares, success, failure)
            if size > self.max_txn_bytes:
                return f"about {size} bytes (the store takes {self.max_txn_bytes})"
        return None

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Keys starting with `prefix`, in key order, at most `limit` (0: all), and the
        store revision they were read at."""

    @abc.abstractmethod
    def snapshot(self, prefixes: Sequence[str]) -> tuple[list[KeyValue], int]:
        """Every key under each of `prefixes` (prefix by prefix, each in key order), all
        read at one revision, and that revision: a consistent picture of several
        prefixes, for export."""

    @abc.abstractmethod
    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        """Apply `success` if every compare holds, else `failure`, atomically. A key may
        be written at most once per branch."""

    @abc.abstractmethod
    def watch(self, prefix: str, start_revision: int) -> Watch:
        """Events for keys under `prefix` from `start_revision` (inclusive) on."""

    @abc.abstractmethod
    def lease_grant(self, ttl: int) -> int:
        """A new lease id; keys put with it are deleted when it expires or is revoked."""

    @abc.abstractmethod
    def lease_keepalive(self, lease: int) -> int:
        """Refresh the lease; returns its remaining TTL, 0 or less if it has expired."""

    @abc.abstractmethod
    def lease_revoke(self, lease: int) -> None: ...

    @abc.abstractmethod
    def revision(self) -> int:
        """The store's current revision."""

    def sync_point(self) -> int:
        """A revision a follower of the whole store waits for to have seen every write
        committed before this call: its watch delivers an event at it (of a key outside
        every data prefix where the store must make one: the Kubernetes store's
        revisions are the API server's, which its other writes move on)."""
        return self.revision()

    @abc.abstractmethod
    def integrity_problems(self) -> list[str]:
        """What the store itself reports as damage to its data, one line each; empty
        when it reports none. Reads the whole store on SQLite: for `ipward check` and a
        daemon's start, never a plugin call."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
