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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


class StoreError(Exception):
    """The store could not do what was asked."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or is too busy; the caller may try again later."""


class StoreMissing(StoreError):
    """There is no store at this URL, and the caller may not create one (a read-only
    command): no file, an empty file, or an etcd without ipward's schema key."""


class StoreIncompatible(StoreError):
    """The store is there but this code must not use it: not ipward's (a garbage file,
    another program's database, a directory), a newer layout or schema, an older schema
    not yet migrated, an import in progress. Permanent: trying again cannot help."""


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
    """An open watch: iterate for events in revision order; cancel to stop."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Event]: ...

    @abc.abstractmethod
    def cancel(self) -> None: ...


class Store(abc.ABC):
    """What ipward needs of a store. Every method may raise StoreUnavailable.

    A `txn` that raises StoreUnavailable may or may not have been applied (the answer
    was lost, not necessarily the write): callers make their writes idempotent and
    re-read rather than assume either. A `txn` that changes nothing (only deletes of
    missing keys) makes no new revision. A Put with an unknown or expired lease fails
    the whole `txn` with StoreError. Revoking a lease that is gone is not an error.
    A watch reports a broken stream by raising StoreUnavailable from iteration; watch
    again from the last revision seen plus one. etcd raises lease TTLs below 2 s to 2 s.
    """

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

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
