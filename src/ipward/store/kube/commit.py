"""Transactions over `LedgerShard` objects (docs/design.md 5.15): one compare-and-swap
when a transaction writes one shard and compares nothing elsewhere; else locks on the
other shards, then the commit in the primary (its first written shard), the locks
resolved later in passing. What every reader and writer does with a lock it meets is
here too: a lock of a committed transaction is its writes, one of an aborted or expired
one is nothing, one in progress is waited for by a writer (a reader reads the state
before it).

Compatibility: read locks (keys only compared) share; a write lock excludes every
other lock on its keys. A transaction waiting for another's lock while it holds locks of
its own waits at most HELD_WAIT, then lets its locks go and starts over, so two never
wait for each other for long.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from ipward.core import shards, testpoints
from ipward.store.base import (
    Compare,
    Delete,
    KeyValue,
    Put,
    StoreError,
    StoreUnreachable,
    TxnResult,
    TxnTooLarge,
    at_revision,
)
from ipward.store.kube.content import THIS_UPDATE, Commit, Lock, Shard, Write, encode, size
from ipward.store.kube.objects import Conflict, Objects

LOCK_TTL = 5.0  # seconds from its placing a lock holds before others may abort it
ABORT_MARGIN = 2.0  # seconds past a lock's expiry, on the reader's clock, before aborting
HELD_WAIT = 1.0  # seconds a transaction holding locks waits for another's
RECORD_HORIZON = 300.0  # seconds commit records and abort marks are kept at least
MAX_OBJECT = 1 << 20  # bytes of data one object may hold (the API takes 1.5 MiB requests)
FATES_KEPT = 20_000
RESOLVE_DELAY = 0.5  # seconds a committed lock waits for an update to resolve it in passing
TURNS = 64  # locks a process's transactions take turns on, by the objects they write


class MustWait(Exception):
    """A lock of a transaction in progress holds a key this one needs."""

    def __init__(self, txn: str, primary: str) -> None:
        super().__init__(f"transaction {txn} (primary {primary}) in progress")
        self.txn = txn
        self.primary = primary


class Restart(Exception):
    """Let go of this attempt's locks and start the transaction over."""


class Fate:
    """A transaction's outcome as its primary says: committed at `rev`, or not."""

    __slots__ = ("committed", "rev")

    def __init__(self, committed: bool, rev: int = 0) -> None:
        self.committed = committed
        self.rev = rev


ABORTED = Fate(False)


class Leases:
    """The leases this process granted (alive until their TTL passes after the last
    keep-alive sent), and when it first saw each shard's current version, by which it
    judges the leases of others: expired once a shard holding their keys has not changed
    for their TTL on this process's monotonic clock (docs/design.md 5.15)."""

    def __init__(self, mono: Callable[[], float]) -> None:
        self.mono = mono
        self.granted: dict[int, int] = {}  # lease -> ttl
        self.renewed: dict[int, float] = {}  # lease -> when its last keep-alive was sent
        self.shards: dict[int, set[str]] = {}  # lease -> shards holding its keys
        self.seen: dict[str, tuple[int, float]] = {}  # shard -> (rv, first seen)

    def grant(self, lease: int, ttl: int) -> None:
        self.granted[lease] = ttl
        self.renewed[lease] = self.mono()

    def alive(self, lease: int) -> bool:
        ttl = self.granted.get(lease)
        return ttl is not None and self.mono() - self.renewed[lease] <= ttl

    def drop(self, lease: int) -> None:
        self.granted.pop(lease, None)
        self.renewed.pop(lease, None)

    def saw(self, shard: Shard) -> None:
        if not shard.leases:
            self.seen.pop(shard.id, None)
            return
        seen = self.seen.get(shard.id)
        if seen is None or seen[0] != shard.rv:
            self.seen[shard.id] = (shard.rv, self.mono())

    def expired(self, shard: Shard, lease: int) -> bool:
        """Whether keys of `lease` in `shard` have outlived it, as this process saw it."""
        if lease == 0:
            return False
        if lease in self.granted:
            return not self.alive(lease)
        state = shard.leases.get(lease)
        seen = self.seen.get(shard.id)
        if state is None:
            return True
        if seen is None or seen[0] != shard.rv:
            return False
        return self.mono() - seen[1] > state[0]


class Committer:
    def __init__(
        self,
        objects: Objects,
        timeout: float,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.objects = objects
        self.timeout = timeout
        self.clock = clock
        self.mono = mono
        self.leases = Leases(mono)
        self._lock = threading.Lock()
        self._cache: dict[str, Shard] = {}
        self._fates: dict[str, Fate] = {}
        # Own committed transactions: the shards still holding their locks, and the
        # commit records that may go once none does (by primary).
        self._unresolved: dict[str, set[str]] = {}
        self._prunable: dict[str, set[str]] = {}
        self._resolver = Resolver(self)
        self._turns = [threading.Lock() for _ in range(TURNS)]

    def close(self) -> None:
        self._resolver.stop()

    # -- shards, as read and written -----------------------------------------------------

    def read(self, shard_id: str) -> Shard:
        """The shard as the API holds it now (an empty one when it has no object)."""
        found = self.objects.get(shard_id)
        shard = found if found is not None else Shard(shard_id)
        self._noted(shard)
        return shard

    def known(self, shard_id: str) -> Shard | None:
        """The shard as last read or written here, if it was."""
        with self._lock:
            return self._cache.get(shard_id)

    def cached(self, shard_id: str) -> Shard:
        with self._lock:
            shard = self._cache.get(shard_id)
        return _copy(shard) if shard is not None else self.read(shard_id)

    def _noted(self, shard: Shard) -> None:
        with self._lock:
            old = self._cache.get(shard.id)
            if old is None or old.rv <= shard.rv:
                self._cache[shard.id] = _copy(shard)
        self.leases.saw(shard)

    def forget(self, shard_id: str) -> None:
        with self._lock:
            self._cache.pop(shard_id, None)

    def _write(self, shard: Shard, txn: str, committing: set[str] = frozenset()) -> int:  # type: ignore[assignment]
        """Write the shard's next version (`txn` made it); its new revision. Conflict when
        it moved. A lost answer is read back: applied if the object says `txn` made it,
        or, for a commit, holds its commit record (another update may have followed it:
        then the commit's revision is the record's)."""
        written = self._piggyback(shard)
        shard.last = txn
        data = encode(shard, committing)
        if size(data) > MAX_OBJECT:
            raise TxnTooLarge(
                f"Kubernetes store {self.objects.where}: shard {shard.id} would hold"
                f" {size(data)} bytes (at most {MAX_OBJECT})"
            )
        try:
            rv = self.objects.write(shard, data)
        except StoreUnreachable:
            now = self.objects.get(shard.id)
            committed = [now.commits[t].rev for t in committing if now and t in now.commits]
            if now is None or (now.last != txn and not committed):
                raise
            self._noted(now)
            written()
            return committed[0] if committed else now.rv
        except Conflict:
            self.forget(shard.id)
            raise
        from ipward.store.kube.content import decode

        self._noted(decode(shard.id, rv, data))
        written()
        return rv

    def resolve(self, txn: str, shard_id: str) -> None:
        """Replace this process's committed `txn`'s lock in `shard_id` by its writes,
        unless an update did already."""
        for _ in range(5):
            with self._lock:
                if shard_id not in self._unresolved.get(txn, ()):
                    return
            shard = self.cached(shard_id)
            if txn not in shard.locks:
                with self._lock:
                    self._unresolved.get(txn, set()).discard(shard_id)
                return
            try:
                self._write(shard, _txn_id())  # the update applies it in passing
                return
            except Conflict:
                continue

    def write_as_is(self, shard: Shard) -> int:
        """Write a shard changed outside a transaction (a lease's keep-alive, revoke)."""
        return self._write(shard, _txn_id())

    # -- fates -----------------------------------------------------------------------------

    def fate(self, txn: str, primary: str) -> Fate | None:
        """The outcome of `txn` as its primary says now: committed (at its revision) or
        aborted; None while it says neither (in progress, or a writer that died: only
        a writer past the lock's expiry decides that, by marking it aborted, `abort`).
        A reader treats None as not committed: a later commit has a later revision."""
        with self._lock:
            known = self._fates.get(txn)
        if known is not None:
            return known
        found = _fate_in(self.read(primary), txn)
        if found is not None:
            self._learned(txn, found)
        return found

    def outcome(self, txn: str, lock: Lock) -> Fate | None:
        """The fate of a lock's transaction, settled if need be: one its primary says
        nothing of, past the lock's expiry, is marked aborted there (`abort`)."""
        fate = self.fate(txn, lock.primary)
        if fate is None and self.clock() > lock.expires + ABORT_MARGIN:
            fate = self.abort(txn, lock.primary)
        return fate

    def _learned(self, txn: str, fate: Fate) -> None:
        with self._lock:
            if len(self._fates) >= FATES_KEPT:
                for old in list(self._fates)[: FATES_KEPT // 4]:
                    del self._fates[old]
            self._fates[txn] = fate

    def visible(
        self, shard: Shard, at: int | None, batch: dict[str, Shard] | None = None
    ) -> dict[str, KeyValue]:
        """The keys of `shard` as committed at revision `at` (None: now): a lock of a
        transaction committed by then counts as its writes, any other as nothing. The
        primaries come from `batch` when there (one consistent read, or a watch's
        shards as of `at`), else are read."""
        result = {
            key: KeyValue(key, e.value, e.create, e.mod, e.version, e.lease)
            for key, e in shard.entries.items()
            if not shards.internal(key) and not self.leases.expired(shard, e.lease)
        }
        for txn, lock in shard.locks.items():
            if not lock.writes:
                continue
            primary = batch.get(lock.primary) if batch is not None else None
            fate = _fate_in(primary, txn) if primary is not None else None
            if fate is None:
                if primary is not None and self.clock() <= lock.expires + ABORT_MARGIN:
                    # Not committed as of the batch: a commit record outlives its locks,
                    # so one made by then would be there. Reading the primary now (a
                    # watcher did at every lock it met) could only tell of a later one.
                    continue
                fate = self.outcome(txn, lock)
            if fate is None or not fate.committed or (at is not None and fate.rev > at):
                continue
            for key, write in lock.writes.items():
                if shards.internal(key):
                    continue
                old = result.get(key)
                if write.value is None:
                    result.pop(key, None)
                else:
                    result[key] = KeyValue(
                        key,
                        write.value,
                        old.create_revision if old is not None else fate.rev,
                        fate.rev,
                        old.version + 1 if old is not None else 1,
                        write.lease,
                    )
        return result

    # -- settling the locks a writer meets --------------------------------------------

    def settle(
        self, shard: Shard, writes: Iterable[str], reads: Iterable[str], own: str = ""
    ) -> None:
        """Make `shard` ready for a writer of `writes` and a reader of `reads`: a lock on
        those keys of a committed transaction applied (rolled forward), of an aborted or
        expired one dropped (rolled back, after marking it aborted in its primary), of
        one in progress MustWait. Other locks are settled only when their fate is
        already known here (no read for them). Keys whose lease ran out go."""
        wanted_writes, wanted_reads = set(writes), set(reads)
        for txn, lock in list(shard.locks.items()):
            if txn == own:
                continue
            conflicts = bool(lock.writes.keys() & (wanted_writes | wanted_reads)) or bool(
                set(lock.reads) & wanted_writes
            )
            if conflicts:
                fate = self.outcome(txn, lock)
                if fate is None:
                    raise MustWait(txn, lock.primary)
            else:
                with self._lock:
                    fate = self._fates.get(txn)
                if fate is None:
                    continue
            if fate.committed:
                shard.apply(lock.writes, fate.rev)
            del shard.locks[txn]
        for key, entry in list(shard.entries.items()):
            if entry.lease and self.leases.expired(shard, entry.lease):
                del shard.entries[key]  # its lease ran out: gone for every writer from here
        for lease in [lease for lease in shard.leases if lease not in _leases_of(shard)]:
            del shard.leases[lease]

    def abort(self, txn: str, primary: str) -> Fate:
        """Mark `txn` aborted in its primary (compare-and-swap: only if it has no commit
        record there); its fate either way."""
        for _ in range(20):
            shard = self.read(primary)
            found = _fate_in(shard, txn)
            if found is not None:
                self._learned(txn, found)
                return found
            shard.aborted[txn] = self.clock()
            try:
                self._write(shard, f"abort-{txn}")
            except Conflict:
                continue
            self._learned(txn, ABORTED)
            testpoints.pause("kube-aborted")
            return ABORTED
        raise StoreUnreachable(f"Kubernetes store {self.objects.where}: cannot settle {txn}")

    def _piggyback(self, shard: Shard) -> Callable[[], None]:
        """What an update of `shard` does in passing: apply or drop locks whose fate this
        process knows, drop commit records and abort marks no one needs any more. What
        it returns notes that, to be called once the update is made: a commit record
        may go only once no stored object holds its lock (an update that failed applied
        nothing, and a record pruned on its word would leave the lock to be judged
        aborted, its writes lost)."""
        applied: list[tuple[str, str]] = []  # (txn, its primary) of the locks let go
        for txn, lock in list(shard.locks.items()):
            with self._lock:
                fate = self._fates.get(txn)
            if fate is None:
                continue
            if fate.committed:
                shard.apply(lock.writes, fate.rev)
            del shard.locks[txn]
            applied.append((txn, lock.primary))
        with self._lock:
            done = set(self._prunable.get(shard.id, ()))
        for txn in done:
            shard.commits.pop(txn, None)
        horizon = self.clock() - RECORD_HORIZON
        for txn, at in list(shard.aborted.items()):
            if at < horizon:
                del shard.aborted[txn]
        for txn, commit in list(shard.commits.items()):
            if commit.at < horizon and self._resolved_everywhere(txn, commit):
                del shard.commits[txn]

        def written() -> None:
            with self._lock:
                for txn, primary in applied:
                    waiting = self._unresolved.get(txn)
                    if waiting is not None:
                        waiting.discard(shard.id)
                        if not waiting:
                            del self._unresolved[txn]
                            self._prunable.setdefault(primary, set()).add(txn)
                pruned = self._prunable.get(shard.id)
                if pruned is not None:
                    pruned -= done
                    if not pruned:
                        del self._prunable[shard.id]

        return written

    def _resolved_everywhere(self, txn: str, commit: Commit) -> bool:
        """An old commit record may go once no shard it names holds its lock."""
        return all(txn not in self.read(shard_id).locks for shard_id in commit.shards)

    # -- transactions --------------------------------------------------------------------

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete],
        leases_alive: Callable[[int], bool],
    ) -> TxnResult:
        deadline = self.mono() + self.timeout
        attempt = 0
        with self._turn({shards.shard_of(op.key) for op in (*success, *failure)}, deadline):
            while True:
                attempt += 1
                try:
                    return self._attempt(compares, success, failure, leases_alive, deadline)
                except (Conflict, Restart, MustWait) as e:
                    if self.mono() > deadline:
                        raise StoreUnreachable(
                            f"Kubernetes store {self.objects.where}: transaction not done in"
                            f" {self.timeout:.0f} s ({e})"
                        ) from None
                    if isinstance(e, MustWait):
                        time.sleep(min(0.2, 0.005 * attempt) * (0.5 + random.random()))
                    elif attempt > 1:
                        time.sleep(min(0.05, 0.002 * attempt) * random.random())

    @contextlib.contextmanager
    def _turn(self, shard_ids: set[str], deadline: float) -> Iterator[None]:
        """This process's turn on the objects a transaction may write: its transactions
        on one object wait for each other here rather than race for it in the API server,
        where all but one of them conflict (409), read it again and retry (16 DELs at
        once on one node: over 100 conflicts racing, none taking turns;
        tests/system/test_kube_store_turns.py). The turns are taken in one order, so
        two transactions never hold each other's; an object's turn may be shared with
        others' (TURNS locks in all)."""
        held: list[threading.Lock] = []
        try:
            for turn in sorted({hash(sid) % TURNS for sid in shard_ids}):
                if not self._turns[turn].acquire(timeout=max(deadline - self.mono(), 0.0)):
                    raise StoreUnreachable(
                        f"Kubernetes store {self.objects.where}: this process's other"
                        f" transactions on the same objects took {self.timeout:.0f} s"
                    )
                held.append(self._turns[turn])
            yield
        finally:
            for lock in reversed(held):
                lock.release()

    def _attempt(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete],
        leases_alive: Callable[[int], bool],
        deadline: float,
    ) -> TxnResult:
        read_keys: dict[str, set[str]] = {}
        for c in compares:
            read_keys.setdefault(shards.shard_of(c.key), set()).add(c.key)
        branch_keys = {op.key for op in (*success, *failure)}
        involved = set(read_keys) | {shards.shard_of(k) for k in branch_keys}
        state = {sid: self.cached(sid) for sid in involved}
        for sid, shard in state.items():
            own_writes = {k for k in branch_keys if shards.shard_of(k) == sid}
            self.settle(shard, own_writes, read_keys.get(sid, ()))
        truths = [c.holds(_kv(state[shards.shard_of(c.key)], c.key)) for c in compares]
        holds = all(truths)
        ops = success if holds else failure
        for op in ops:
            if isinstance(op, Put) and op.lease and not leases_alive(op.lease):
                raise StoreError(
                    f"Kubernetes store {self.objects.where}: lease {op.lease} is not alive"
                )
        writes: dict[str, dict[str, Write]] = {}
        for op in ops:
            sid = shards.shard_of(op.key)
            writes.setdefault(sid, {})[op.key] = Write(
                op.value if isinstance(op, Put) else None, op.lease if isinstance(op, Put) else 0
            )
        # Deletes of keys that are not there change nothing.
        dropped = set()
        for sid in list(writes):
            current = state[sid].entries
            for key in [k for k, w in writes[sid].items() if w.value is None and k not in current]:
                del writes[sid][key]
            if not writes[sid]:
                del writes[sid]
                dropped.add(sid)
        if not writes:
            self._current(dropped | set(read_keys), state)
            return TxnResult(holds, max((s.rv for s in state.values()), default=0))
        compares, truths = self._replicate(state, list(compares), truths, writes)
        read_keys = {}
        for c in compares:
            read_keys.setdefault(shards.shard_of(c.key), set()).add(c.key)
        self._current(dropped - set(writes) - set(read_keys), state)
        compared_elsewhere = set(read_keys) - set(writes)
        if len(writes) == 1 and not compared_elsewhere:
            (sid,) = writes
            return TxnResult(holds, self._single(state[sid], writes[sid]))
        checks = Checks(compares, truths)
        return TxnResult(holds, self._two_phase(state, writes, read_keys, checks))

    def _current(self, shard_ids: set[str], state: dict[str, Shard]) -> None:
        """The cached copies the transaction goes by where nothing will check them by
        compare-and-swap (a shard whose only writes were deletes of keys it did not hold,
        or any shard of a transaction that writes nothing) are read again: Restart when
        one moved since. (A delete dropped on a stale copy's word left the key behind:
        a free queue entry outliving its free record, found by the chaos soak.)"""
        for sid in sorted(shard_ids):
            if self.read(sid).rv != state[sid].rv:
                raise Restart(f"shard {sid} changed since it was cached here")

    def _replicate(
        self,
        state: dict[str, Shard],
        compares: list[Compare],
        truths: list[bool],
        writes: dict[str, dict[str, Write]],
    ) -> tuple[list[Compare], list[bool]]:
        """Pool specs are replicated into the node shards that compare them (docs/design.md
        5.15): a compare of one is made on the replica in the transaction's node shard
        (its primary), made there first if need be (a copy of the home's, the node named
        among the holders); a write of one writes every replica too."""
        node = min((sid for sid in writes if shards.kind_of(sid) == shards.NODE), default=None)
        replicated = {c.key for c in compares if shards.replicated(c.key)}
        replicated |= {k for sid in writes for k in writes[sid] if shards.replicated(k)}
        if not replicated:
            return compares, truths
        new_compares: list[Compare] = []
        new_truths: list[bool] = []
        for c, truth in zip(compares, truths, strict=True):
            home = shards.shard_of(c.key)
            written_here = c.key in writes.get(home, {})
            if node is None or not shards.replicated(c.key) or written_here:
                new_compares.append(c)
                new_truths.append(truth)
                continue
            replica = shards.replica_key(c.key, node)
            if replica in state[node].entries:
                moved = Compare(replica, c.target, c.op, c.operand)
                if moved.holds(_kv(state[node], replica)) != truth:
                    # The home and the replica, as cached here, disagree: one of them
                    # is stale, and only the replica is locked from here on. Both read
                    # again.
                    self.forget(home)
                    self.forget(node)
                    raise Restart(f"{replica} and its home {home} disagree")
                new_compares.append(moved)
                new_truths.append(truth)
                continue
            # No replica in this node shard yet: compare at home (read-locked) and copy it.
            new_compares.append(c)
            new_truths.append(truth)
            entry = state[home].entries.get(c.key)
            if entry is not None:
                writes.setdefault(node, {})[replica] = Write(
                    entry.value, 0, (entry.create, entry.mod, entry.version)
                )
                self._hold(state, writes, new_compares, new_truths, c.key, add=node)
        for key in sorted(replicated):
            home = shards.shard_of(key)
            write = writes.get(home, {}).get(key)
            if write is None:
                continue
            holders = self._hold(state, writes, new_compares, new_truths, key)
            if write.value is None and holders:
                writes[home][shards.holders_key(key)] = Write(None)
            for holder in holders:
                replica = shards.replica_key(key, holder)
                if holder not in state:
                    state[holder] = self.cached(holder)
                    self.settle(state[holder], {replica}, ())
                writes.setdefault(holder, {})[replica] = Write(write.value)
        return new_compares, new_truths

    def _hold(
        self,
        state: dict[str, Shard],
        writes: dict[str, dict[str, Write]],
        compares: list[Compare],
        truths: list[bool],
        key: str,
        add: str = "",
    ) -> list[str]:
        """The holders of `key`'s replicas as its home says, the list pinned by a compare
        (and extended by `add`, written in the same transaction)."""
        home = shards.shard_of(key)
        holders_key = shards.holders_key(key)
        entry = state[home].entries.get(holders_key)
        holders: list[str] = json.loads(entry.value) if entry is not None else []
        pin = at_revision(holders_key, entry.mod if entry is not None else 0)
        if all(c.key != holders_key for c in compares):
            compares.append(pin)
            truths.append(True)
        if add and add not in holders:
            holders = [*holders, add]
            writes.setdefault(home, {})[holders_key] = Write(json.dumps(holders).encode())
        return holders

    def _single(self, shard: Shard, writes: dict[str, Write]) -> int:
        """One compare-and-swap: the compares were evaluated on this version of the
        shard; a conflict reads it again and the whole transaction is evaluated again."""
        txn = _txn_id()
        self._bind_leases(shard, writes)
        shard.apply(writes)
        return self._write(shard, txn)

    def _bind_leases(self, shard: Shard, writes: dict[str, Write]) -> None:
        for write in writes.values():
            if write.lease and write.lease not in shard.leases:
                shard.leases[write.lease] = [self.leases.granted[write.lease], 0]
            if write.lease:
                self.leases.shards.setdefault(write.lease, set()).add(shard.id)

    def _two_phase(
        self,
        state: dict[str, Shard],
        writes: dict[str, dict[str, Write]],
        read_keys: dict[str, set[str]],
        checks: Checks,
    ) -> int:
        txn = _txn_id()
        primary = min(writes, key=_rank)
        others = sorted((set(writes) | set(read_keys)) - {primary}, key=_rank)
        expires = self.clock() + max(LOCK_TTL, 0.05 * len(others))
        locked: list[str] = []
        try:
            for sid in others:
                self._lock_shard(
                    txn,
                    primary,
                    expires,
                    sid,
                    writes.get(sid, {}),
                    read_keys.get(sid, set()),
                    checks,
                )
                locked.append(sid)
                testpoints.pause("kube-locking")
            testpoints.pause("kube-locked")
            if self.clock() > expires:
                raise Restart(f"transaction {txn} outlived its locks")
        except BaseException:
            self._let_go(txn, locked)
            raise
        try:
            rev = self._commit(
                txn, state[primary], writes[primary], read_keys.get(primary, set()), checks, locked
            )
        except StoreUnreachable:
            # The commit may have been made, or be on its way still (a request whose
            # answer was lost can land later): its fate is settled in the primary first,
            # by its record or an abort mark that a late commit cannot pass (its
            # resourceVersion is gone). Unsettled (the API still away), the locks stay,
            # for whoever meets them to judge by the primary: letting them go here as
            # aborted would drop half a committed transaction.
            fate = self.abort(txn, primary)
            if not fate.committed:
                self._let_go(txn, locked)
                raise
            rev = fate.rev
        except BaseException:
            self._let_go(txn, locked)
            raise
        self._learned(txn, Fate(True, rev))
        testpoints.pause("kube-committed")
        written = [sid for sid in locked if sid in writes]
        if written:
            with self._lock:
                self._unresolved[txn] = set(written)
            for sid in written:
                if shards.kind_of(sid) not in shards.WATCHED_WITH_EVERYTHING:
                    self._resolver.due(txn, sid)
        return rev

    def _lock_shard(
        self,
        txn: str,
        primary: str,
        expires: float,
        sid: str,
        writes: dict[str, Write],
        reads: set[str],
        checks: Checks,
    ) -> None:
        for _ in range(50):
            shard = self.cached(sid)
            try:
                self.settle(shard, writes, reads, own=txn)
            except MustWait as e:
                raise Restart(str(e)) from None  # holding locks: let them go
            checks.still(shard)
            self._bind_leases(shard, writes)
            shard.locks[txn] = Lock(primary, expires, writes, sorted(reads))
            try:
                self._write(shard, txn)
                return
            except Conflict:
                continue
        raise Restart(f"shard {sid} kept changing")

    def _commit(
        self,
        txn: str,
        shard: Shard,
        writes: dict[str, Write],
        reads: set[str],
        checks: Checks,
        locked: list[str],
    ) -> int:
        primary = shard.id
        for attempt in range(50):
            if attempt:
                shard = self.cached(primary)
            if txn in shard.aborted:
                raise Restart(f"transaction {txn} was aborted by another")
            try:
                self.settle(shard, writes, reads, own=txn)
            except MustWait as e:
                raise Restart(str(e)) from None
            checks.still(shard)
            self._bind_leases(shard, writes)
            shard.apply(writes)
            shard.commits[txn] = Commit(THIS_UPDATE, list(locked), self.clock())
            try:
                return self._write(shard, txn, committing={txn})
            except Conflict:
                continue
        raise Restart(f"primary {primary} kept changing")

    def _let_go(self, txn: str, locked: list[str]) -> None:
        """Remove this attempt's locks (best effort: one left behind expires)."""
        self._learned(txn, ABORTED)
        for sid in locked:
            for _ in range(5):
                shard = self.cached(sid)
                if txn not in shard.locks:
                    break
                del shard.locks[txn]
                try:
                    self._write(shard, f"undo-{txn}")
                    break
                except Conflict:
                    continue
                except StoreError:
                    break


class Resolver:
    """Resolves locks of this process's committed transactions that no update took in
    passing within RESOLVE_DELAY: a watcher of their object that does not watch the
    primary sees the commit only then (docs/design.md 5.15, Watches). Block shards are
    left to passing updates: their one watcher, the controller, watches every shard."""

    def __init__(self, committer: Committer) -> None:
        self.committer = committer
        self._queue: list[tuple[float, str, str]] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def due(self, txn: str, shard_id: str) -> None:
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kube-store-resolver", daemon=True
                )
                self._thread.start()
            self._queue.append((self.committer.mono() + RESOLVE_DELAY, txn, shard_id))
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (
                    not self._queue or self._queue[0][0] > self.committer.mono()
                ):
                    wait = self._queue[0][0] - self.committer.mono() if self._queue else None
                    self._wake.wait(wait)
                if self._stopped:
                    return
                _, txn, shard_id = self._queue.pop(0)
            try:
                self.committer.resolve(txn, shard_id)
            except StoreError:
                pass  # left to passing updates and readers


class Checks:
    """The compares and what each said when the branch was chosen: at each shard's lock
    (and at the commit) its compares must say the same, else the transaction is
    evaluated again."""

    __slots__ = ("compares", "truths")

    def __init__(self, compares: Sequence[Compare], truths: list[bool]) -> None:
        self.compares = compares
        self.truths = truths

    def still(self, shard: Shard) -> None:
        for c, truth in zip(self.compares, self.truths, strict=True):
            if shards.shard_of(c.key) == shard.id and c.holds(_kv(shard, c.key)) != truth:
                raise Restart(f"{c.key} changed")


def _kv(shard: Shard, key: str) -> KeyValue | None:
    """A key of a settled shard (its locks on the key resolved)."""
    e = shard.entries.get(key)
    return None if e is None else KeyValue(key, e.value, e.create, e.mod, e.version, e.lease)


def _fate_in(shard: Shard, txn: str) -> Fate | None:
    commit = shard.commits.get(txn)
    if commit is not None:
        return Fate(True, commit.rev)
    if txn in shard.aborted:
        return ABORTED
    return None


def _leases_of(shard: Shard) -> set[int]:
    used = {e.lease for e in shard.entries.values() if e.lease}
    for lock in shard.locks.values():
        used.update(w.lease for w in lock.writes.values() if w.lease)
    return used


def _rank(shard_id: str) -> tuple[int, str]:
    return shards.KINDS.index(shards.kind_of(shard_id)), shard_id


def _txn_id() -> str:
    return f"{random.getrandbits(64):016x}"


def _copy(shard: Shard) -> Shard:
    from ipward.store.kube.content import Entry

    copy = Shard(shard.id, shard.rv)
    copy.entries = {
        k: Entry(e.value, e.create, e.mod, e.version, e.lease) for k, e in shard.entries.items()
    }
    copy.locks = dict(shard.locks)
    copy.commits = dict(shard.commits)
    copy.aborted = dict(shard.aborted)
    copy.leases = {k: list(v) for k, v in shard.leases.items()}
    copy.last = shard.last
    return copy
