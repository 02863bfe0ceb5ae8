"""The Kubernetes store's commit protocol (`store/kube/commit.py`) on objects kept in
memory: what it reads and writes, not what the API server does with it (that, on the
real kube-apiserver: `tests/system/test_store_conformance.py`,
`test_kube_store_windows.py`)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ipward.store.base import Put
from ipward.store.kube.commit import Committer
from ipward.store.kube.content import Commit, Lock, Shard, Write, decode, encode
from ipward.store.kube.objects import Conflict

NOW = 1_800_000_000.0


class MemoryObjects:
    """The objects of a store, in memory: a write compares the version it read (a stale
    one is a Conflict, as the API's 409), and takes `write_seconds`; the reads and the
    writes in flight at once are counted."""

    where = "memory"

    def __init__(self, write_seconds: float = 0.0) -> None:
        self.data: dict[str, tuple[int, str]] = {}
        self.reads: list[str] = []
        self.write_seconds = write_seconds
        self.revision = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.conflicts = 0
        self._lock = threading.Lock()

    def get(self, shard_id: str) -> Shard | None:
        self.reads.append(shard_id)
        with self._lock:
            found = self.data.get(shard_id)
        return None if found is None else decode(shard_id, *found)

    def write(self, shard: Shard, data: str) -> int:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.write_seconds)
        with self._lock:
            self.in_flight -= 1
            if self.data.get(shard.id, (0, ""))[0] != shard.rv:
                self.conflicts += 1
                raise Conflict(shard.id)
            self.revision += 1
            self.data[shard.id] = (self.revision, data)
            return self.revision


def _committer(objects: MemoryObjects) -> Committer:
    objects_as_any: Any = objects
    return Committer(objects_as_any, timeout=10.0, clock=lambda: NOW)


def _locked(primary: str, expires: float) -> Shard:
    """A block's shard holding the lock of transaction "t1" (primary `primary`), which
    writes one address record there."""
    shard = Shard("addr:p:10.0.0.0", 5)
    shard.locks["t1"] = Lock(primary, expires, {"ips/p/10.0.0.7": Write(b"record")}, [])
    return shard


def test_a_lock_in_progress_as_of_a_batch_holding_its_primary_is_nothing_and_reads_nothing() -> (
    None
):
    """A watcher of every object sees a lock before its commit: the primary as of the
    same revision says nothing of it, so it is not committed then; no read of the primary
    (one per ADD the controller watched)."""
    objects = MemoryObjects()
    committer = _committer(objects)
    primary = Shard("node:n1", 4)
    seen = committer.visible(_locked("node:n1", NOW + 5), 5, {"node:n1": primary})
    assert "ips/p/10.0.0.7" not in seen
    assert objects.reads == []
    primary.commits["t1"] = Commit(6, ["addr:p:10.0.0.0"], NOW)
    seen = committer.visible(_locked("node:n1", NOW + 5), 6, {"node:n1": primary})
    assert seen["ips/p/10.0.0.7"].mod_revision == 6
    assert objects.reads == []


def test_an_expired_lock_is_looked_up_in_its_primary_even_when_a_batch_holds_it() -> None:
    """Past its expiry a lock's transaction may have died: its fate is read from its
    primary (and settled there by a writer), as before."""
    objects = MemoryObjects()
    committer = _committer(objects)
    now = Shard("node:n1")
    now.commits["t1"] = Commit(7, ["addr:p:10.0.0.0"], NOW)
    objects.data["node:n1"] = (9, encode(now))
    seen = committer.visible(_locked("node:n1", NOW - 60), 5, {"node:n1": Shard("node:n1", 4)})
    assert objects.reads == ["node:n1"]
    assert "ips/p/10.0.0.7" not in seen  # committed, but at revision 7, after 5


def test_transactions_of_one_process_on_one_object_take_turns() -> None:
    """Threads of one process writing the same object: one update at a time, none of
    them conflicting (racing, all but one would, and read the object again)."""
    objects = MemoryObjects(write_seconds=0.01)
    committer = _committer(objects)
    done: list[bool] = []

    def writer(i: int) -> None:
        for n in range(4):
            result = committer.txn([], [Put(f"bench/one/{i}-{n}", b"v")], [], lambda _: True)
            done.append(result.succeeded)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert done == [True] * 24
    assert objects.most_in_flight == 1
    assert objects.conflicts == 0
