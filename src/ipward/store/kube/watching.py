"""A watch of the Kubernetes store (docs/design.md 5.15): a watch of the shards a prefix
can be in, from the state they had at the revision before the first asked for (one
list at exactly that revision), each object's change turned into its keys' changes.

A locked key changes when its transaction commits, at the commit's revision: when the
primary is watched too, in the batch of the primary's change; when it is not, the
primary is read before each later event, so a commit is reported before anything that
came after it. Batches are whole revisions, in order.

The API server ends the watch every WATCH_SECONDS (asked); between two, expired leases
of the watched shards are removed (a lease has no server to expire it: its observers
do, docs/design.md 5.15), which the next watch then reports as deletes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ipward.core import shards
from ipward.kubeapi.client import WatchStream
from ipward.store.base import DELETE, PUT, Event, KeyValue, StoreError, StoreUnreachable, Watch
from ipward.store.kube.commit import Committer, MustWait
from ipward.store.kube.content import Shard
from ipward.store.kube.objects import Conflict, events

WATCH_SECONDS = 10
READ_TIMEOUT = 3 * WATCH_SECONDS


class KubeWatch(Watch):
    def __init__(self, committer: Committer, prefix: str, start_revision: int) -> None:
        self.committer = committer
        self.objects = committer.objects
        self.prefix = prefix
        self.scope = shards.scope_of(prefix)
        self.last = max(start_revision - 1, 0)
        self._cancelled = threading.Event()
        self._stream_lock = threading.Lock()
        self._stream: WatchStream | None = None
        self.states: dict[str, Shard] = {}
        self.shown: dict[str, dict[str, KeyValue]] = {}
        if self.last:
            found, _ = self.objects.scope(self.scope, revision=self.last)
        else:
            found = []
        for shard in found:
            self.states[shard.id] = shard
        for shard in found:
            self.shown[shard.id] = self._view(shard, self.last)

    def _view(self, shard: Shard, at: int) -> dict[str, KeyValue]:
        return {
            k: kv
            for k, kv in self.committer.visible(shard, at, self.states).items()
            if k.startswith(self.prefix)
        }

    def _diff(self, shard_id: str, view: dict[str, KeyValue], revision: int) -> list[Event]:
        old = self.shown.get(shard_id, {})
        changed = [
            Event(PUT, kv)
            for key, kv in sorted(view.items())
            if key not in old
            or (old[key].mod_revision, old[key].value) != (kv.mod_revision, kv.value)
        ]
        changed += [
            Event(DELETE, KeyValue(key, b"", 0, revision, 0))
            for key in sorted(old)
            if key not in view
        ]
        if view:
            self.shown[shard_id] = view
        else:
            self.shown.pop(shard_id, None)
        return changed

    def batches(self) -> Iterator[list[Event]]:
        while not self._cancelled.is_set():
            stream = self.objects.watch(
                self.scope, self.last, READ_TIMEOUT, timeout_seconds=WATCH_SECONDS
            )
            with self._stream_lock:
                self._stream = stream
                if self._cancelled.is_set():  # cancelled while the stream was opening
                    stream.close()
                    return
            try:
                for kind, obj in events(stream):
                    if self._cancelled.is_set():
                        return
                    rv = int((obj.get("metadata") or {}).get("resourceVersion", "0") or 0)
                    if kind == "BOOKMARK":
                        self.last = max(self.last, rv)
                        continue
                    if rv <= self.last:
                        continue
                    yield from self._commits_before(rv)
                    batch = self._changed(kind, obj, rv)
                    self.last = rv
                    if batch:
                        yield batch
            except StoreError:
                if self._cancelled.is_set():
                    return
                raise
            finally:
                stream.close()
            if self._cancelled.is_set():
                return
            self._reap()

    def _changed(self, kind: str, obj: dict, rv: int) -> list[Event]:
        if kind == "DELETED":
            shard_id = str((obj.get("spec") or {}).get("shard", ""))
            if shard_id not in self.states and shard_id not in self.shown:
                return []
            self.states.pop(shard_id, None)
            return self._diff(shard_id, {}, rv)
        shard = self.objects.shard_of(obj)
        if self.scope.ids and shard.id not in self.scope.ids:
            return []
        if shards.kind_of(shard.id) == shards.PROBE:
            # A sync point: no data, only how far this watch is (KubeStore.sync_point).
            mark = KeyValue(shards.PROBE_KEY + shard.id, b"", rv, rv, 1)
            return [Event(PUT, mark)]
        self.committer.leases.saw(shard)
        self.states[shard.id] = shard
        batch = self._diff(shard.id, self._view(shard, rv), rv)
        # A commit recorded here makes its locks in the other watched shards count.
        for other_id, other in self.states.items():
            if other_id != shard.id and any(
                lock.primary == shard.id and txn in shard.commits
                for txn, lock in other.locks.items()
            ):
                batch += self._diff(other_id, self._view(other, rv), rv)
        return batch

    def _commits_before(self, rv: int) -> Iterator[list[Event]]:
        """Commits of transactions whose primary is not watched, made before `rv`, with
        locks in watched shards: reported at their commit's revision, before `rv`."""
        found: dict[int, set[str]] = {}
        for shard_id, shard in self.states.items():
            for txn, lock in shard.locks.items():
                if lock.primary in self.states or not lock.writes:
                    continue
                fate = self.committer.fate(txn, lock.primary)
                if fate is not None and fate.committed and self.last < fate.rev < rv:
                    found.setdefault(fate.rev, set()).add(shard_id)
        for revision in sorted(found):
            batch: list[Event] = []
            for shard_id in sorted(found[revision]):
                batch += self._diff(shard_id, self._view(self.states[shard_id], revision), revision)
            self.last = revision
            if batch:
                yield batch

    def _reap(self) -> None:
        """Remove the keys of the watched lease shards whose lease expired."""
        for shard in list(self.states.values()):
            if shards.kind_of(shard.id) != shards.LEASE:
                continue
            expired = [
                k
                for k, e in shard.entries.items()
                if e.lease and self.committer.leases.expired(shard, e.lease)
            ]
            if not expired:
                continue
            current = self.committer.cached(shard.id)
            try:
                self.committer.settle(current, expired, ())
                self.committer.write_as_is(current)
            except (Conflict, MustWait, StoreUnreachable):
                continue  # another observer did, or will at the next end of the watch

    def cancel(self) -> None:
        with self._stream_lock:
            self._cancelled.set()
            if self._stream is not None:
                self._stream.close()
