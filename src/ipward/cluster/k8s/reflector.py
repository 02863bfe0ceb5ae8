"""List + watch of one resource into a cache (a reflector), in a thread of its own.

The loop: a paged list (`limit`, `continue`; a 410 on a continue token starts the list
over) replaces the cache whole; then a watch from the list's resourceVersion with
bookmarks, asked to end within half of `stale_after` (`timeoutSeconds`). A watch that
ends cleanly is opened again from the last resourceVersion seen, unless the cache went
stale meanwhile: then it is listed again. Anything else ends in a new list: an ERROR
event (410 Expired or any other), a broken or stalled stream, an event older than the
last one (a gap), an event that cannot be decoded, a stream quiet for twice
`stale_after`. A relist replaces the cache, so deletions that happened while away are
found.

Heard (the cache is known current as of then): a completed list, an event, a bookmark,
and a watch the server ended cleanly at its `timeoutSeconds` (all of the response, its
last chunk included, no earlier than asked: the server had nothing newer for us at its
end). The real server sends no bookmark on a watch of a resource that did not change
after the watch opened, so for a quiet resource the clean ends are what is heard. Not
heard: a stream cut (a dropped connection, a truncated chunk: an error) or ended cleanly
before its time (a proxy, a server shutting down: events in flight may be lost).

Changes: every applied event notes its key with a running count of events (`mark`),
so `changed_since(mark)` names the keys changed since a snapshot taken after that mark
without comparing every item (the controller's garbage collection judges again only
their records). It answers None, "anything may have changed", for a mark from before
the last list (a relist replaces the cache whole) or older than the last CHANGES_KEPT
changed keys.

The cache answers (`snapshot`, `get`) only while it is trusted: after a list completed,
not during a relist, and while it was heard from less than `stale_after` seconds ago.
Otherwise `LivenessUnavailable`: "could not list" is never "empty".

`as_of` (wall clock) is the time the list's first request was sent (a consistent read:
no resourceVersion, so the list holds everything that existed then), later the time of
the last event, bookmark or clean end minus `margin` (what the server's watch may still
be behind).

Optional, for a resource whose user acts on each change (the controller's IPPool
objects): `on_change(key)` is called, from the reflector's thread and outside its lock,
after every ADDED, MODIFIED or DELETED event is applied; `relist_every` seconds after a
list, the watch is ended and the resource listed again, the cache staying trusted
meanwhile (a safety net under the watch, as the controller's view reads the store whole
on a timer).

After a failure the next list waits `retry_delay`: doubled from `BACKOFF_MIN` up to
`BACKOFF_MAX` while the server keeps failing, back to `BACKOFF_MIN` once a list completed
and the watch after it started (answered, and not refused in its first line by an ERROR
event: a server that lists but refuses every watch is not relisted in a tight loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ipward.cluster.liveness import LivenessUnavailable
from ipward.core import log
from ipward.kubeapi.client import (
    JSON,
    METADATA,
    METADATA_LIST,
    ApiClient,
    ApiError,
    ApiUnreachable,
    WatchStream,
)

V = TypeVar("V")

BACKOFF_MIN = 0.2
BACKOFF_MAX = 5.0
MIN_STALE_AFTER = 2.0  # twice the shortest watch (timeoutSeconds is in whole seconds)
LIST_RESTARTS = 5  # list attempts ended by an expired continue token before backing off
CHANGES_KEPT = 20_000  # changed keys noted for `changed_since` (older marks: None)


@dataclass(frozen=True)
class Resource(Generic[V]):
    name: str  # for logs and errors: "pods", "nodes", ...
    path: str  # /api/v1/pods
    parse: Callable[[dict], tuple[str, V]]
    metadata_only: bool = False
    field_selector: str = ""


class _Relist(Exception):
    """The watch cannot go on: list again (the message says why)."""


class Reflector(Generic[V]):
    def __init__(
        self,
        client: ApiClient,
        resource: Resource[V],
        *,
        page_size: int = 500,
        watch_timeout: int = 60,
        stale_after: float = 150.0,
        margin: float = 5.0,
        on_change: Callable[[str], None] | None = None,
        relist_every: float | None = None,
    ) -> None:
        self.client = client
        self.resource = resource
        self.page_size = page_size
        # A quiet watch is heard at its end: it must end well within the staleness bound.
        self.watch_timeout = max(1, min(watch_timeout, int(stale_after / 2)))
        self.stale_after = stale_after
        self.margin = margin
        self.on_change = on_change
        self.relist_every = relist_every
        self._listed_at = 0.0  # time.monotonic() of the last completed list
        self._lock = threading.Lock()
        self._items: dict[str, V] = {}
        self._synced = False
        self._why = "not listed yet"
        self._as_of = 0.0
        self._heard = 0.0  # time.monotonic() it was last heard (see the module's docstring)
        self._rv = ""
        self._events = 0  # events applied, and lists completed: a snapshot's mark
        self._changed: dict[str, int] = {}  # key -> `_events` at its last change, oldest first
        self._known_from = 0  # `changed_since` answers for marks from this one on
        self.lists = 0  # lists completed (tests wait for a relist by this)
        self.retry_delay = BACKOFF_MIN  # the wait before the list after a failure
        self._started = False  # since the last failure, a list and the watch after it started
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._thread = threading.Thread(target=self._run, name=f"k8s-{resource.name}", daemon=True)

    # -- answers -------------------------------------------------------------------------

    def _check(self) -> None:
        """Raise unless the cache is trusted now (call with the lock held)."""
        if not self._synced:
            raise LivenessUnavailable(f"Kubernetes {self.resource.name}: {self._why}")
        quiet = time.monotonic() - self._heard
        if quiet > self.stale_after:
            raise LivenessUnavailable(
                f"Kubernetes {self.resource.name}: nothing heard for {quiet:.0f}s"
                f" (stale after {self.stale_after:g}s)"
            )

    def snapshot(self) -> tuple[dict[str, V], float]:
        """(a copy of the cache, as_of); raises LivenessUnavailable."""
        with self._lock:
            self._check()
            return dict(self._items), self._as_of

    def mark(self) -> int:
        """Where the log of changes is now: taken just before a `snapshot`, it names
        that snapshot for `changed_since` (a change in between is named twice: harmless)."""
        with self._lock:
            return self._events

    def changed_since(self, mark: int) -> set[str] | None:
        """The keys changed after `mark`, or None when that is no longer known (see the
        module's docstring)."""
        with self._lock:
            if mark < self._known_from:
                return None
            changed = set()
            for key in reversed(self._changed):
                if self._changed[key] <= mark:
                    break
                changed.add(key)
            return changed

    def get(self, key: str) -> V | None:
        """The cached value of `key` (None: not in the cache); raises LivenessUnavailable."""
        with self._lock:
            self._check()
            return self._items.get(key)

    def find(self, match: Callable[[V], bool]) -> V | None:
        """A cached value `match` accepts (None: none), by a walk of the cache: for a
        small one (an agent's node's pods); raises LivenessUnavailable."""
        with self._lock:
            self._check()
            return next((v for v in self._items.values() if match(v)), None)

    def problem(self) -> str | None:
        """Why the cache is not trusted now (what `snapshot` would raise), or None."""
        with self._lock:
            try:
                self._check()
            except LivenessUnavailable as e:
                return str(e)
            return None

    @property
    def available(self) -> bool:
        return self.problem() is None

    # -- the loop ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        self._thread.join(timeout=10)

    def _unavailable(self, why: str) -> None:
        with self._lock:
            self._synced = False
            self._why = why

    def _run(self) -> None:
        while not self._stop.is_set():
            self._started = False
            try:
                self._list()
                self._watch()
            except _Relist as e:
                self._unavailable(f"relisting: {e}")
                log.info("k8s relist", resource=self.resource.name, reason=str(e))
            except (ApiError, ApiUnreachable) as e:
                self._unavailable(f"could not list: {e}")
                log.warning("k8s list failed", resource=self.resource.name, error=str(e))
            except Exception as e:  # never let the thread die: unavailable, then retry
                self._unavailable(f"failed: {type(e).__name__}: {e}")
                log.error("k8s reflector failed", resource=self.resource.name, error=repr(e))
            # A list and its watch that started: the server works again, the next failure
            # is retried soon; a server failing before that is asked less and less often.
            self.retry_delay = (
                BACKOFF_MIN if self._started else min(self.retry_delay * 2, BACKOFF_MAX)
            )
            self._stop.wait(self.retry_delay)

    def _query(self) -> dict[str, str]:
        selector = self.resource.field_selector
        return {"fieldSelector": selector} if selector else {}

    def _list(self) -> None:
        """List every page into a new cache; swap it in whole."""
        accept = METADATA_LIST if self.resource.metadata_only else JSON
        for _ in range(LIST_RESTARTS):
            items: dict[str, V] = {}
            sent = time.time()
            query = {**self._query(), "limit": str(self.page_size)}
            while True:
                try:
                    # A page of a big list can take the server a while: up to the
                    # staleness bound, rather than the short timeout of direct reads.
                    page = self.client.request(
                        "GET",
                        self.resource.path,
                        query,
                        accept=accept,
                        read_timeout=max(self.client.timeout, self.stale_after),
                    )
                except ApiError as e:
                    if e.expired and "continue" in query:
                        break  # the list's snapshot left the server's window: start over
                    raise
                try:
                    for obj in page.get("items") or []:
                        key, value = self.resource.parse(obj)
                        items[key] = value
                    meta = page["metadata"]
                    rv, more = str(meta["resourceVersion"]), meta.get("continue")
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise ApiUnreachable(f"list of {self.resource.name}: undecodable: {e!r}") from e
                if not more:
                    with self._lock:
                        self._items = items
                        self._rv = rv
                        self._events += 1
                        self._changed.clear()
                        self._known_from = self._events
                        self._as_of = sent
                        self._heard = time.monotonic()
                        self._synced = True
                        self.lists += 1
                    self._listed_at = time.monotonic()
                    return
                query["continue"] = str(more)
            log.info("k8s list expired mid-way; starting over", resource=self.resource.name)
        raise ApiUnreachable(f"list of {self.resource.name}: expired {LIST_RESTARTS} times")

    def _watch(self) -> None:
        """Follow events until the watch cannot go on (raises _Relist) or we stop."""
        accept = METADATA if self.resource.metadata_only else JSON
        starting = True  # the watch from the list's resourceVersion: has it started?
        while not self._stop.is_set():
            quiet = self._quiet()
            if quiet > self.stale_after:
                raise _Relist(f"nothing heard for {quiet:.0f}s: listing rather than watching on")
            if self._relist_due():
                return  # listed again by `_run`, the cache trusted meanwhile
            query = {
                **self._query(),
                "resourceVersion": self._rv,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(self.watch_timeout),
            }
            opened = time.monotonic()
            try:
                # Quiet for stale_after: the cache is not trusted (`_check`); quiet twice
                # as long: the stream is given up and the resource listed again.
                stream = self.client.watch(
                    self.resource.path, query, accept=accept, read_timeout=2 * self.stale_after
                )
            except (ApiError, ApiUnreachable) as e:
                raise _Relist(f"watch refused: {e}") from e
            self._stream = stream
            if self._stop.is_set():  # stop() came before the stream was there to close
                stream.close()
                return
            self._started = True
            try:
                for event in stream:
                    if starting and event.get("type") == "ERROR":
                        self._started = False  # refused in its first line: not started
                    starting = False
                    self._apply(event)
            except ApiUnreachable as e:
                raise _Relist(str(e)) from e
            finally:
                self._stream = None
                stream.close()
            starting = False
            # A clean end: heard if at the server's timeout (it had nothing newer then),
            # not if earlier. Watch again from the last resourceVersion.
            if time.monotonic() - opened >= self.watch_timeout:
                self._hear()
            else:
                log.info(
                    "k8s watch ended early; not counted as heard",
                    resource=self.resource.name,
                    after=round(time.monotonic() - opened, 3),
                    timeout=self.watch_timeout,
                )

    def _note(self, key: str) -> None:
        """`key` changed (call with the lock held)."""
        self._events += 1
        self._changed.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._changed[key] = self._events
        if len(self._changed) > CHANGES_KEPT:
            oldest = next(iter(self._changed))
            self._known_from = self._changed.pop(oldest)

    def _relist_due(self) -> bool:
        return (
            self.relist_every is not None
            and time.monotonic() - self._listed_at >= self.relist_every
        )

    def _quiet(self) -> float:
        with self._lock:
            return time.monotonic() - self._heard

    def _hear(self) -> None:
        """The cache is current as of now, give or take the watch's lag (`margin`)."""
        with self._lock:
            self._heard = time.monotonic()
            self._as_of = max(self._as_of, time.time() - self.margin)

    def _apply(self, event: dict) -> None:
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise _Relist(f"event without an object: {str(event)[:120]}")
        if kind == "ERROR":
            raise _Relist(
                f"ERROR event: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}"
            )
        try:
            rv = str(obj["metadata"]["resourceVersion"])
            parsed = None if kind == "BOOKMARK" else self.resource.parse(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise _Relist(f"undecodable {kind} event: {e!r}") from e
        if rv.isdigit() and self._rv.isdigit() and int(rv) < int(self._rv):
            raise _Relist(f"gap: event at resourceVersion {rv} after {self._rv}")
        with self._lock:
            if kind in ("ADDED", "MODIFIED") and parsed is not None:
                self._items[parsed[0]] = parsed[1]
            elif kind == "DELETED" and parsed is not None:
                self._items.pop(parsed[0], None)
            elif kind != "BOOKMARK":
                raise _Relist(f"unknown event type {kind!r}")
            if parsed is not None:
                self._note(parsed[0])
            self._rv = rv
        self._hear()
        if parsed is not None and self.on_change is not None:
            self.on_change(parsed[0])
