"""What one `LedgerShard` object holds (docs/design.md 5.15), decoded: its keys with
their revisions, the commit protocol's locks, commit records and abort marks, and its
leases. Pure: no I/O; `store/kube/objects.py` reads and writes the objects.

A key's revisions are numbers, but for the keys the object's last update wrote: those
are stored as 0 ("this update") and read as the object's resourceVersion, which is
known only once the update is made. Decoding resolves them; encoding writes 0 for what
this update changes (`Shard.touched`).

Encoded as one JSON document in the object's `spec.data` string:

    {"keys":    {key: [value, create, mod, version, lease]},
     "locks":   {txn: {"primary": shard, "expires": t, "writes": {key: [value|null,
                 lease]}, "reads": [key]}},
     "commits": {txn: [rev, [shard, ...], t]},
     "aborted": {txn: t},
     "leases":  {lease: [ttl, renewals]},
     "last":    txn}                      the transaction that made this version

A value is the key's bytes as text when they are UTF-8, else {"b64": ...}; a delete in a
lock's writes is null. A document of more than COMPRESS_OVER bytes is stored zlib-deflated
and base64-encoded, after "z:": a third of the size, which is what the API server's
CPU goes by (docs/measurements.md "Kubernetes store: candidate layouts": 0.3 to 0.8 of
the CPU per update at a block's and a node's size, for 1 to 3 ms of the writer's).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import Any

THIS_UPDATE = 0  # a revision stored before it is known: the object's next resourceVersion
FORMAT = 1
COMPRESS_OVER = 4096  # bytes of JSON past which the data is stored deflated
DEFLATED = "z:"


class ShardDecodeError(ValueError):
    """An object whose data is not a shard (damaged, or written by something else)."""


def _value_out(value: bytes) -> Any:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(value).decode("ascii")}


def _value_in(raw: Any) -> bytes:
    if isinstance(raw, str):
        return raw.encode("utf-8")
    if isinstance(raw, dict) and isinstance(raw.get("b64"), str):
        return base64.b64decode(raw["b64"], validate=True)
    raise ShardDecodeError(f"not a value: {raw!r:.80}")


class Entry:
    """A key as committed in its shard."""

    __slots__ = ("create", "lease", "mod", "value", "version")

    def __init__(self, value: bytes, create: int, mod: int, version: int, lease: int = 0) -> None:
        self.value = value
        self.create = create
        self.mod = mod
        self.version = version
        self.lease = lease

    def __repr__(self) -> str:
        return f"Entry(mod={self.mod}, version={self.version})"


class Write:
    """What a transaction writes to one key: a value (None: delete) and its lease; a
    replica made of its home's key keeps that key's revisions (`copy`: create, mod,
    version)."""

    __slots__ = ("copy", "lease", "value")

    def __init__(
        self, value: bytes | None, lease: int = 0, copy: tuple[int, int, int] | None = None
    ) -> None:
        self.value = value
        self.lease = lease
        self.copy = copy


class Lock:
    """A transaction's hold on keys of this shard until its primary says committed or
    aborted: what it will write here, and the keys it only compared (read-locked)."""

    __slots__ = ("expires", "primary", "reads", "writes")

    def __init__(
        self, primary: str, expires: float, writes: dict[str, Write], reads: list[str]
    ) -> None:
        self.primary = primary
        self.expires = expires
        self.writes = writes
        self.reads = reads

    def keys(self) -> set[str]:
        return {*self.writes, *self.reads}


class Commit:
    """A committed transaction's record in its primary: the revision it committed at, the
    other shards it holds locks in (kept until they are resolved), when."""

    __slots__ = ("at", "rev", "shards")

    def __init__(self, rev: int, shards: list[str], at: float) -> None:
        self.rev = rev
        self.shards = shards
        self.at = at


class Shard:
    """One shard as read (`rv`: its object's resourceVersion; 0 when it has no object
    yet). Changed in place by a writer, which then encodes it for the update."""

    __slots__ = (
        "aborted",
        "commits",
        "entries",
        "id",
        "last",
        "leases",
        "locks",
        "rv",
        "touched",
    )

    def __init__(self, shard_id: str, rv: int = 0) -> None:
        self.id = shard_id
        self.rv = rv
        self.entries: dict[str, Entry] = {}
        self.locks: dict[str, Lock] = {}
        self.commits: dict[str, Commit] = {}
        self.aborted: dict[str, float] = {}
        self.leases: dict[int, list[int]] = {}  # lease -> [ttl, renewals]
        self.touched: set[str] = set()  # keys this update writes (their revisions: 0)
        self.last = ""  # the transaction whose update made this version (lost answers)

    # -- reading ---------------------------------------------------------------------------

    def locker(self, key: str) -> str | None:
        """The transaction holding a lock on `key`, if any."""
        for txn, lock in self.locks.items():
            if key in lock.writes or key in lock.reads:
                return txn
        return None

    # -- writing ---------------------------------------------------------------------------

    def put(self, key: str, value: bytes, lease: int, rev: int = THIS_UPDATE) -> None:
        old = self.entries.get(key)
        create = old.create if old is not None else rev
        version = old.version + 1 if old is not None else 1
        self.entries[key] = Entry(value, create, rev, version, lease)
        if rev == THIS_UPDATE:
            self.touched.add(key)

    def delete(self, key: str) -> bool:
        return self.entries.pop(key, None) is not None

    def apply(self, writes: dict[str, Write], rev: int = THIS_UPDATE) -> None:
        """The writes of a transaction, committed at `rev` (this update's by default)."""
        for key, write in writes.items():
            if write.value is None:
                self.delete(key)
            elif write.copy is not None:
                create, mod, version = write.copy
                self.entries[key] = Entry(write.value, create, mod, version, write.lease)
            else:
                self.put(key, write.value, write.lease, rev)


def decode(shard_id: str, rv: int, data: str) -> Shard:
    """A shard from its object's data and resourceVersion."""
    shard = Shard(shard_id, rv)
    if not data:
        return shard
    try:
        if data.startswith(DEFLATED):
            deflated = base64.b64decode(data[len(DEFLATED) :], validate=True)
            data = zlib.decompress(deflated).decode("utf-8", "surrogatepass")
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ShardDecodeError(f"shard {shard_id}: unknown format")

        def rev(n: Any) -> int:
            if not isinstance(n, int) or n < 0:
                raise ShardDecodeError(f"shard {shard_id}: not a revision: {n!r:.40}")
            return rv if n == THIS_UPDATE else n

        for key, (value, create, mod, version, lease) in doc.get("keys", {}).items():
            shard.entries[key] = Entry(
                _value_in(value), rev(create), rev(mod), int(version), int(lease)
            )
        for txn, lock in doc.get("locks", {}).items():
            writes = {
                k: Write(
                    None if w[0] is None else _value_in(w[0]),
                    int(w[1]),
                    (int(w[2][0]), int(w[2][1]), int(w[2][2])) if len(w) > 2 else None,
                )
                for k, w in lock["writes"].items()
            }
            shard.locks[txn] = Lock(
                str(lock["primary"]),
                float(lock["expires"]),
                writes,
                [str(k) for k in lock["reads"]],
            )
        for txn, (commit_rev, shards, at) in doc.get("commits", {}).items():
            shard.commits[txn] = Commit(rev(commit_rev), [str(s) for s in shards], float(at))
        shard.aborted = {str(t): float(at) for t, at in doc.get("aborted", {}).items()}
        shard.last = str(doc.get("last", ""))
        shard.leases = {
            int(lease): [int(ttl), int(renewals)]
            for lease, (ttl, renewals) in doc.get("leases", {}).items()
        }
    except ShardDecodeError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, zlib.error, binascii.Error) as e:
        raise ShardDecodeError(f"shard {shard_id}: {type(e).__name__}: {e}") from None
    return shard


def encode(shard: Shard, committing: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """The data of the shard's next object version: what this update writes (`touched`
    keys, `committing` commit records) at revision 0."""
    doc: dict[str, Any] = {"format": FORMAT, "last": shard.last}
    doc["keys"] = {
        key: [
            _value_out(e.value),
            THIS_UPDATE if key in shard.touched and e.version == 1 else e.create,
            THIS_UPDATE if key in shard.touched else e.mod,
            e.version,
            e.lease,
        ]
        for key, e in shard.entries.items()
    }
    if shard.locks:
        doc["locks"] = {
            txn: {
                "primary": lock.primary,
                "expires": lock.expires,
                "writes": {
                    k: [None if w.value is None else _value_out(w.value), w.lease]
                    + ([list(w.copy)] if w.copy is not None else [])
                    for k, w in lock.writes.items()
                },
                "reads": lock.reads,
            }
            for txn, lock in shard.locks.items()
        }
    if shard.commits:
        doc["commits"] = {
            txn: [THIS_UPDATE if txn in committing else c.rev, c.shards, c.at]
            for txn, c in shard.commits.items()
        }
    if shard.aborted:
        doc["aborted"] = shard.aborted
    if shard.leases:
        doc["leases"] = {str(lease): state for lease, state in shard.leases.items()}
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if len(text) <= COMPRESS_OVER:
        return text
    deflated = zlib.compress(text.encode("utf-8", "surrogatepass"), 1)
    return DEFLATED + base64.b64encode(deflated).decode("ascii")


def size(data: str) -> int:
    return len(data.encode("utf-8", "surrogatepass"))
