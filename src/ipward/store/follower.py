"""A copy of the store's keys under some prefixes, kept current: the one way ipward
follows the store (the agent's node index, `agent/node_index.py`; the controller's view,
`controller/view.py`). The follower is the protocol; the copy (`Copy`) is its user's own
shape of state, which it hands whole reads and events to.

The protocol. Read the prefixes whole at one revision (`Store.range`, `Store.snapshot`
for several), then watch from the next revision, so no change between the two is lost.
Hand the copy each batch of events (whole revisions, `Watch.batches`: the copy only
ever holds a state the store had) and keep the revision it is at. When the watch ends
(`Compacted`: its history is gone; a broken stream; the store down), read whole again.
Several prefixes are followed by one watch on every key; the copy is handed only the
events under its prefixes, and the revision moves with all of them.

First seen (the clock-skew rule, `ipward.gc.clocks`): a put handed to the copy says when
the follower first saw that revision of the key, on its monotonic clock: an event, when
its batch was received; a whole read, the read's time, or None at the follower's first
read (nothing earlier to compare with). A copy keeps, across a whole read, what it held
for a key still at the revision it had: its first sighting is still the earlier one.

Changes since a mark (`SyncedFollower.changes`): once first taken, the copy notes
there each key an event changed, with what the key held before; a whole read, or more
changes than the bound, makes it "everything".

Two ways to run it, by who applies the events:
* `BackgroundFollower`: a thread of its own reads, receives and applies at once; when the
  watch ends it reads whole again after 1 s, doubling up to 30 s, and until then says
  why the copy is not followed (`not_followed`). For a small copy read by other threads
  under the copy's lock (the node index).
* `SyncedFollower`: a thread only receives, into a bounded inbox; the caller applies in
  `sync`, between its passes, up to at least the store's revision when it asks, so the
  copy changes only then; it reads whole in `sync` too, when the watch ended, did not
  catch up in time, or `reread_every` passed (a safety net). Its caller paces the
  retries of a read that failed (`sync` raises; the next pass tries again). For a large
  copy that passes read without locks (the controller's view).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from ipward.core import log
from ipward.store.base import Compacted, Event, KeyValue, Store

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.store.base import Watch

# Why a follower read whole (the metrics' labels).
START, COMPACTED, TIMER, BROKEN = READ_REASONS = ("start", "compacted", "timer", "broken")
_LAGGED = "lagged"  # a synced follower's watch stopped receiving: resume from its revision

RETRY_FIRST = 1.0  # a background follower's next whole read after its watch ended
RETRY_MOST = 30.0


def _ended_by(e: Exception) -> tuple[str, str]:
    """Why following ended, when `e` ended it: its history gone (`Compacted`), else a
    store error or a broken stream. Either way: read whole again."""
    if isinstance(e, Compacted):
        return COMPACTED, str(e)
    return BROKEN, f"{type(e).__name__}: {e}"


class Stamp(NamedTuple):
    """When the follower got something, on its clocks (wall, monotonic)."""

    wall: float
    mono: float


class Copy(Protocol):
    """What a follower keeps current: its user's state."""

    def load(self, kvs: list[KeyValue], stamp: Stamp, seen: float | None) -> None:
        """Hold what a whole read found instead of what it held: `kvs` (every key under
        the prefixes, read at one revision at `stamp`; the copy's to consume). A key new
        to it, or at another revision than it held, was first seen at `seen`."""

    def apply(self, events: list[Event], stamp: Stamp) -> None:
        """Apply a batch of events (whole revisions, keys under the prefixes) received at
        `stamp`: a put was first seen at `stamp.mono`."""


V = TypeVar("V")


class Changes(Generic[V]):
    """What a copy's events changed since the last `take`: `everything`, or `keys`
    (each key changed, with what it held before its first change since)."""

    __slots__ = ("everything", "keys")

    def __init__(self, everything: bool, keys: dict[str, V]) -> None:
        self.everything = everything
        self.keys = keys


class ChangeLog(Generic[V]):
    """Changes since a mark (see the module docstring): notes nothing until first
    taken, then at most `bound` keys before it says everything."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._tracking = False
        self.start_over(everything=True)

    def start_over(self, everything: bool) -> None:
        self._everything = everything
        self._keys: dict[str, V] = {}

    @property
    def noting(self) -> bool:
        """Whether a change would be noted (taken before, not everything already)."""
        return self._tracking and not self._everything

    def note(self, key: str, before: V) -> None:
        """`key` changes; it held `before` (its first change since the mark counts)."""
        if not self.noting or key in self._keys:
            return
        if len(self._keys) >= self.bound:
            self.start_over(everything=True)  # bounded: past this many, all again
            return
        self._keys[key] = before

    def take(self) -> Changes[V]:
        """What changed since the last call (the first: everything), and start over."""
        taken = Changes(self._everything, self._keys)
        self._tracking = True
        self.start_over(everything=False)
        return taken


class _Batch(NamedTuple):
    """One batch of a watch's events as received: when, those under the prefixes, and
    the revision it ends at."""

    stamp: Stamp
    events: list[Event]
    revision: int


class Follower:
    """What both ways of running share: the whole read, the watch and how it ended,
    the clocks and first sightings, the revision the copy is at (0: not read yet)."""

    def __init__(
        self,
        store: Store,
        prefixes: Sequence[str],
        copy: Copy,
        *,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self.store = store
        self.prefixes = tuple(prefixes)
        self.copy = copy
        self.clock = clock
        self.monotonic = monotonic
        self.revision = 0
        self._looked = False  # read whole before (since the start, or `forget`)
        self._watch: Watch | None = None

    def _read(self) -> tuple[list[KeyValue], int]:
        """Every key under the prefixes, at one revision, and that revision."""
        if len(self.prefixes) == 1:
            return self.store.range(self.prefixes[0])
        return self.store.snapshot(self.prefixes)

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        """Hand a whole read to the copy; the follower is at its revision."""
        stamp = self._stamp()
        self.copy.load(kvs, stamp, stamp.mono if self._looked else None)
        self._looked = True
        self.revision = revision

    def _watch_from(self, revision: int) -> Watch:
        """A watch of every key under the prefixes from `revision` on."""
        prefix = self.prefixes[0] if len(self.prefixes) == 1 else ""
        return self.store.watch(prefix, revision)

    def _receive(self, watch: Watch, deliver: Callable[[_Batch], str | None]) -> tuple[str, str]:
        """Hand each batch `watch` delivers to `deliver` until it says why to stop, or the
        watch ends; why it ended (a reason, and in words)."""
        try:
            for events in watch.batches():
                revision = events[-1].kv.mod_revision
                # Only the prefixes' keys are data: another's event marks how far it is.
                events = [e for e in events if e.kv.key.startswith(self.prefixes)]
                stopped = deliver(_Batch(self._stamp(), events, revision))
                if stopped is not None:
                    return stopped, ""
        except Exception as e:
            return _ended_by(e)
        return BROKEN, "the watch stream ended"

    def _stamp(self) -> Stamp:
        return Stamp(self.clock(), self.monotonic())


class BackgroundFollower(Follower):
    """Reads, receives and applies in a thread of its own (see the module docstring);
    `counted(reason)` at each whole read; `log_fields` name the copy in its logs."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        copy: Copy,
        *,
        name: str,
        counted: Callable[[str], None],
        log_fields: dict[str, object],
    ) -> None:
        super().__init__(store, [prefix], copy, clock=time.time, monotonic=time.monotonic)
        self.name = name
        self.counted = counted
        self.log_fields = log_fields
        self.not_followed: str | None = "not read yet"  # why the copy is not followed
        self._lock = threading.Lock()  # the watch, between the thread and `stop`
        self._read_once = threading.Event()
        self._stopping = threading.Event()
        thread = name.replace(" ", "-")
        self._thread = threading.Thread(target=self._follow, name=thread, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._watch is not None:
                self._watch.cancel()
        self._thread.join(timeout=10)  # a read ends within the store's own timeout

    def wait_read(self, timeout: float) -> bool:
        """Wait up to `timeout` for the first whole read; whether it was made."""
        return self._read_once.wait(timeout)

    def _follow(self) -> None:
        reason, wait = START, RETRY_FIRST
        while not self._stopping.is_set():
            try:
                watch = self._read_whole(reason)
                if watch is None:
                    return  # stopped meanwhile
                wait = RETRY_FIRST
                reason, detail = self._receive(watch, self._apply)
            except Exception as e:  # the read failed: again
                reason, detail = _ended_by(e)
            if self._stopping.is_set():
                return
            self.not_followed = detail
            log.warning(
                f"{self.name}: reading it whole again",
                **self.log_fields,
                reason=reason,
                detail=detail,
            )
            self._stopping.wait(wait)
            wait = min(wait * 2, RETRY_MOST)

    def _read_whole(self, reason: str) -> Watch | None:
        """Read the copy whole and start following it; None when stopped meanwhile."""
        kvs, revision = self._read()
        self.counted(reason)
        watch = self._watch_from(revision + 1)  # no event between the two lost
        with self._lock:
            if self._stopping.is_set():
                watch.cancel()
                return None
            self._watch = watch
        self._load(kvs, revision)
        self.not_followed = None
        self._read_once.set()
        return watch

    def _apply(self, batch: _Batch) -> None:
        self.copy.apply(batch.events, batch.stamp)
        self.revision = batch.revision


class _Ended(NamedTuple):
    """A synced follower's watch thread's last item: why it stopped."""

    reason: str
    detail: str


class _Inbox:
    """What one watch delivered and the passes have not applied yet: its batches, then
    why it ended. One per watch, so a replaced watch's thread cannot reach the next."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._items: queue.SimpleQueue[_Batch | _Ended] = queue.SimpleQueue()
        self._pending = 0  # events queued and not taken yet
        self._lock = threading.Lock()

    def put(self, batch: _Batch) -> bool:
        """Queue a batch; True when too many events are waiting (stop receiving)."""
        self._items.put(batch)
        with self._lock:
            self._pending += len(batch.events)
            return self._pending > self.max_pending

    def end(self, ended: _Ended) -> None:
        self._items.put(ended)

    def take(self, timeout: float) -> _Batch | _Ended:
        """The next item, waiting at most `timeout` (queue.Empty after that)."""
        item = self._items.get(timeout=timeout)
        if isinstance(item, _Batch):
            with self._lock:
                self._pending -= len(item.events)
        return item


class SyncedFollower(Follower):
    """Applies in `sync`, in its caller's thread (see the module docstring); only `sync`,
    `forget` and `close` change the copy. `counted(reason)` at each whole read,
    `lagging(revisions)` at each sync: how far behind the store it was. At most
    `max_pending` events wait in memory (more wait in the store's history) and as many
    changes are noted."""

    def __init__(
        self,
        store: Store,
        prefixes: Sequence[str],
        copy: Copy,
        *,
        name: str,
        counted: Callable[[str], None],
        lagging: Callable[[int], None],
        reread_every: float,
        catch_up_timeout: float,
        max_pending: int,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        super().__init__(store, prefixes, copy, clock=clock, monotonic=monotonic)
        # What the copy's events changed since its user last took them: the copy notes,
        # in `apply`; a whole read makes it everything.
        self.changes: ChangeLog[object] = ChangeLog(max_pending)
        self.name = name
        self.counted = counted
        self.lagging = lagging
        self.reread_every = reread_every
        self.catch_up_timeout = catch_up_timeout
        self.max_pending = max_pending
        self._reread_due = 0.0
        self._pending_read: tuple[str, str] | None = (START, "")
        self._receiver: threading.Thread | None = None
        self._inbox = _Inbox(max_pending)

    def sync(self) -> int:
        """Bring the copy to at least the store's current revision; returns it."""
        if self._pending_read is None and self.monotonic() >= self._reread_due:
            self._pending_read = (TIMER, f"every {self.reread_every:g}s")
        if self._pending_read is not None:
            self._read_whole(*self._pending_read)
        else:
            self._catch_up()
        return self.revision

    @property
    def receiving(self) -> bool:
        """Whether the watch thread is taking events (it stops on an error, or when too
        far ahead of the passes, until the next sync)."""
        return self._receiver is not None and self._receiver.is_alive()

    def close(self) -> None:
        self._stop_watching()

    def forget(self, clear: Callable[[], None]) -> None:
        """Stop following, `clear` the copy; the next sync reads whole as at the start
        (its records have no first sighting)."""
        if self.revision or self._watch is not None:
            self._stop_watching()
            clear()
            self.revision = 0
            self._looked = False
            self.changes.start_over(everything=True)
            self._inbox = _Inbox(self.max_pending)
            self._pending_read = (START, "")

    def _catch_up(self) -> None:
        target = self.store.sync_point()
        self.lagging(max(0, target - self.revision))
        deadline = self.monotonic() + self.catch_up_timeout
        # Up to the target only: what comes after waits for the next pass (a busy store
        # could otherwise keep a pass applying).
        while self.revision < target:
            try:
                item = self._inbox.take(max(0.0, deadline - self.monotonic()))
            except queue.Empty:
                late = f"the watch did not reach revision {target} in time (at {self.revision})"
                self._read_whole(BROKEN, late)
                return
            if isinstance(item, _Ended):
                if item.reason == _LAGGED:
                    self._follow()
                    continue
                self._read_whole(item.reason, item.detail)
                return
            if item.events:
                self.copy.apply(item.events, item.stamp)
            self.revision = max(self.revision, item.revision)

    def _read_whole(self, reason: str, detail: str) -> None:
        self._stop_watching()
        self._pending_read = (reason, detail)  # again next sync, should this read fail
        self.counted(reason)
        log.info(f"{self.name}: reading the store whole", reason=reason, detail=detail)
        kvs, revision = self._read()
        self.changes.start_over(everything=True)
        self._load(kvs, revision)
        self._pending_read = None
        self._reread_due = self.monotonic() + self.reread_every
        self.lagging(0)
        self._follow()

    def _follow(self) -> None:
        """Watch from the copy's revision on, in a thread of its own."""
        self._stop_watching()
        self._inbox = _Inbox(self.max_pending)
        watch = self._watch_from(self.revision + 1)
        self._watch = watch
        self._receiver = threading.Thread(
            target=self._receive_into,
            args=(watch, self._inbox),
            name=f"{self.name.replace(' ', '-')}-watch",
            daemon=True,
        )
        self._receiver.start()

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._receiver = None  # ends on its own: its watch is cancelled

    def _receive_into(self, watch: Watch, inbox: _Inbox) -> None:
        """The watch thread: queue each batch; end with why it stopped."""

        def deliver(batch: _Batch) -> str | None:
            if self._watch is not watch:
                return "replaced"  # its inbox is no one's any more
            if inbox.put(batch):
                watch.cancel()
                return _LAGGED
            return None

        reason, detail = self._receive(watch, deliver)
        if reason == _LAGGED:
            detail = f"over {inbox.max_pending} events ahead of the passes"
        if self._watch is watch:
            inbox.end(_Ended(reason, detail))
