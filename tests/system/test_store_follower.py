"""The store follower (`ipward.store.follower`) on real stores (SQLite and a real etcd),
with a copy of its own that holds each key as the store has it: it follows only its
prefixes, reads whole again when its watch breaks (the background one by itself, the
synced one at the next sync), says when it first saw each key's revision (none for its
first read's, kept across a whole read while the revision is the same), resumes a watch
that fell behind, and notes changes since a mark."""

from __future__ import annotations

import random
import threading

import pytest

from ipward.store import Store, open_backend
from ipward.store.base import DELETE, Delete, Event, KeyValue, Put
from ipward.store.follower import BackgroundFollower, ChangeLog, Stamp, SyncedFollower
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.waiting import wait_for
from support import ManualClock

pytestmark = pytest.mark.timeout(120)


class Keys:
    """A copy: key -> (value, revision, first seen), as the follower hands them; it
    notes its changes in `changes` when given one."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[bytes, int, float | None]] = {}
        self.lock = threading.Lock()
        self.changes: ChangeLog[object] | None = None

    def load(self, kvs: list[KeyValue], stamp: Stamp, seen: float | None) -> None:
        with self.lock:
            before, self.held = self.held, {}
            for kv in kvs:
                was = before.get(kv.key)
                first = was[2] if was is not None and was[1] == kv.mod_revision else seen
                self.held[kv.key] = (kv.value, kv.mod_revision, first)

    def apply(self, events: list[Event], stamp: Stamp) -> None:
        with self.lock:
            for event in events:
                key = event.kv.key
                if self.changes is not None:
                    self.changes.note(key, self.held.get(key))
                if event.kind == DELETE:
                    self.held.pop(key, None)
                else:
                    self.held[key] = (event.kv.value, event.kv.mod_revision, stamp.mono)

    def contents(self) -> dict[str, tuple[bytes, int]]:
        with self.lock:
            return {key: (value, revision) for key, (value, revision, _) in self.held.items()}

    def seen(self, key: str) -> float | None:
        with self.lock:
            return self.held[key][2]


def stored(store: Store, *prefixes: str) -> dict[str, tuple[bytes, int]]:
    kvs = [kv for p in prefixes for kv in store.range(p)[0]]
    return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}


def put(store: Store, *keys: str, value: bytes = b"v") -> None:
    store.txn([], [Put(key, value) for key in keys])


def random_writes(store: Store, rng: random.Random, count: int) -> None:
    """Puts and deletes of a few keys under `a/`, `b/` and `c/`, some in one transaction."""
    for _ in range(count):
        ops: dict[str, Put | Delete] = {}
        for _ in range(rng.choice((1, 1, 3))):
            key = f"{rng.choice('abc')}/{rng.randrange(6)}"
            ops[key] = Delete(key) if rng.random() < 0.3 else Put(key, f"{rng.random()}".encode())
        store.txn([], list(ops.values()))


# -- the background follower -------------------------------------------------------------


def test_a_background_follower_follows_its_prefix_and_reads_whole_when_its_watch_breaks(
    either_store: Store,
) -> None:
    put(either_store, "a/kept", "a/changed", "b/other")
    copy, reads = Keys(), []
    follower = BackgroundFollower(
        either_store, "a/", copy, name="test copy", counted=reads.append, log_fields={}
    )
    assert follower.not_followed == "not read yet"
    follower.start()
    try:
        assert follower.wait_read(30)
        assert copy.contents() == stored(either_store, "a/")
        assert copy.seen("a/kept") is None  # the first read: nothing earlier to compare with
        put(either_store, "a/new")
        put(either_store, "b/other2")
        wait_for(lambda: copy.contents() == stored(either_store, "a/"), "the copy to follow a put")
        assert copy.seen("a/new") is not None  # first seen when its event came
        assert follower._watch is not None
        follower._watch.cancel()  # the stream ends under it, as a lost connection would
        put(either_store, "a/changed", value=b"again")  # while nobody follows
        wait_for(lambda: reads == ["start", "broken"], "a whole read again")
        wait_for(lambda: copy.contents() == stored(either_store, "a/"), "the copy to hold it")
        assert follower.not_followed is None
        assert copy.seen("a/kept") is None  # the same revision: still the first read's
        assert copy.seen("a/changed") is not None  # first seen at that whole read
    finally:
        follower.stop()


# -- the synced follower -----------------------------------------------------------------


def synced(
    store: Store, copy: Keys, *, max_pending: int = 1000, monotonic: ManualClock | None = None
) -> tuple[SyncedFollower, list[str]]:
    """A synced follower of `a/` and `c/` on given clocks; the reasons of its whole reads."""
    reads: list[str] = []
    follower = SyncedFollower(
        store,
        ["a/", "c/"],
        copy,
        name="test copy",
        counted=reads.append,
        lagging=lambda revisions: None,
        reread_every=600.0,
        catch_up_timeout=30.0,
        max_pending=max_pending,
        clock=ManualClock(1_000.0),
        monotonic=monotonic or ManualClock(0.0),
    )
    return follower, reads


def test_a_synced_follower_holds_its_prefixes_at_the_stores_revision_after_each_sync(
    either_store: Store,
) -> None:
    copy = Keys()
    follower, reads = synced(either_store, copy)
    rng = random.Random(1)
    try:
        random_writes(either_store, rng, 10)
        follower.sync()
        before = copy.contents()
        for _ in range(6):
            random_writes(either_store, rng, rng.randrange(1, 20))
            assert follower.sync() >= either_store.revision()  # every revision, b/'s too
            assert copy.contents() == stored(either_store, "a/", "c/")
        assert copy.contents() != before
        put(either_store, "b/only")  # a revision with nothing of its own
        assert follower.sync() == either_store.revision()
        assert reads == ["start"]
    finally:
        follower.close()


def test_a_synced_follower_notes_first_sightings_on_its_clock(either_store: Store) -> None:
    copy, mono = Keys(), ManualClock(0.0)
    follower, reads = synced(either_store, copy, monotonic=mono)
    try:
        put(either_store, "a/first")
        follower.sync()
        assert copy.seen("a/first") is None
        mono.now = 50.0  # the watch thread stamps what it receives from now on
        put(either_store, "a/event")
        follower.sync()
        assert copy.seen("a/event") == 50.0
        assert follower._watch is not None
        follower._watch.cancel()  # broken: read whole at the next sync
        mono.now = 70.0
        put(either_store, "a/while-broken")
        follower.sync()
        assert reads == ["start", "broken"]
        assert copy.seen("a/while-broken") == 70.0  # new to it at that read
        assert (copy.seen("a/first"), copy.seen("a/event")) == (None, 50.0)  # kept
        mono.now = 670.0  # its timer
        follower.sync()
        assert reads == ["start", "broken", "timer"]
        assert copy.seen("a/while-broken") == 70.0
    finally:
        follower.close()


def fall_behind(store: Store, follower: SyncedFollower, rng: random.Random) -> None:
    """Read whole, then more writes than its inbox takes: the watch stops receiving."""
    follower.sync()
    random_writes(store, rng, 40)
    wait_for(lambda: not follower.receiving, "the watch to stop, too far ahead")


def test_a_synced_follower_resumes_a_watch_that_fell_behind(either_store: Store) -> None:
    copy = Keys()
    follower, reads = synced(either_store, copy, max_pending=5)
    try:
        fall_behind(either_store, follower, random.Random(2))
        follower.sync()  # resumed from its revision: the history is there
        assert copy.contents() == stored(either_store, "a/", "c/")
        assert reads == ["start"]
    finally:
        follower.close()


def test_changes_are_noted_once_taken_and_are_everything_after_a_whole_read_or_too_many(
    either_store: Store,
) -> None:
    copy, mono = Keys(), ManualClock(0.0)
    follower, _ = synced(either_store, copy, max_pending=3, monotonic=mono)
    copy.changes = follower.changes
    try:
        put(either_store, "a/1", "a/2")
        follower.sync()
        put(either_store, "a/1", value=b"two")
        follower.sync()
        assert follower.changes.take().everything  # the first take: everything
        put(either_store, "a/1", value=b"three")
        either_store.txn([], [Delete("a/2")])
        put(either_store, "a/1", value=b"four")
        put(either_store, "b/1")
        follower.sync()
        taken = follower.changes.take()
        assert not taken.everything
        assert set(taken.keys) == {"a/1", "a/2"}  # not b/1: none of its own
        assert taken.keys["a/1"][0] == b"two"  # before its first change
        assert taken.keys["a/2"][0] == b"v"  # held before its delete
        mono.now = 600.0  # its timer: a whole read
        follower.sync()
        assert follower.changes.take().everything
        put(either_store, "a/1", "a/2", "a/3", "a/4")  # more than its bound
        follower.sync()
        assert follower.changes.take().everything
        assert follower.changes.take().keys == {}
    finally:
        follower.close()


def test_a_compaction_under_a_lagging_watch_makes_a_synced_follower_read_whole(
    etcd: EtcdServer,
) -> None:
    with open_backend(etcd.url) as store:
        store.txn([], [Delete(kv.key) for kv in store.range("")[0]])
        copy = Keys()
        follower, reads = synced(store, copy, max_pending=5)
        try:
            fall_behind(store, follower, random.Random(3))
            random_writes(store, random.Random(4), 5)  # only the store's history has them
            etcd.etcdctl("compaction", str(store.revision()))
            follower.sync()
            assert reads == ["start", "compacted"]
            assert copy.contents() == stored(store, "a/", "c/")
        finally:
            follower.close()
