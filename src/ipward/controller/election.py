"""Leader election for the controller: one instance acts at a time, and every write it
makes is fenced by the leader key (`Election.fence()`: compares that hold only while it
leads), so a deposed leader's late write fails instead of landing (docs/design.md 5.8).

The leader key (`controller/leader`) holds the instance's id and when it took over,
under a lease the election thread keeps (`store/session.py`); a standby looks at the key
every `poll` seconds and campaigns when it is gone."""

from __future__ import annotations

import threading
import time

from ipward.core import log
from ipward.core import records as rec
from ipward.core.keys import LEADER_KEY
from ipward.store import Store, StoreError, StoreUnreachable
from ipward.store.base import VALUE, Compare, Delete, Put, absent
from ipward.store.session import LeaseSession

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

MAX_POLL = 1.0  # a waiting instance looks at the leader key at least this often


class Election:
    """Campaign for `controller/leader`, hold it with a lease, and say at every moment
    whether this instance may act (`fence()`). Runs in a thread of its own, on a store
    connection of its own, so a slow pass never delays a keepalive."""

    def __init__(
        self,
        store: Store,
        ident: str,
        ttl: int,
        on_change: Callable[[bool], None] = lambda leading: None,
    ) -> None:
        self.store = store
        self.ident = ident
        self.ttl = ttl
        self.poll = max(0.05, min(MAX_POLL, ttl / 4))
        self.on_change = on_change
        self.term = 0  # bumped at every acquisition: the pass starts its memory over
        self.store_ok_at = 0.0  # monotonic time the store last answered this thread
        self.session = LeaseSession(store, ttl)  # the leader key's lease, while leading
        self._lock = threading.Lock()
        self._value: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the pass asks

    def value(self) -> bytes | None:
        with self._lock:
            return self._value

    def fence(self) -> list[Compare] | None:
        """The compares every leader write carries, or None when this instance must not
        act: not leader, stopping, or past the moment its lease could have expired."""
        with self._lock:
            if (
                self._value is None
                or self._stop.is_set()
                or time.monotonic() >= self.session.valid_until
            ):
                return None
            return [Compare(LEADER_KEY, VALUE, "==", self._value)]

    @property
    def leading(self) -> bool:
        return self.fence() is not None

    # -- the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; if leading, resign so a successor need not wait for the
        lease to expire."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl + 5)
        self.resign()

    def _run(self) -> None:
        while not self._stop.is_set():
            leading = self.value() is not None
            try:
                if leading:
                    self.keep()
                else:
                    self.campaign()
            except Exception as e:  # never let the election thread die
                log.error("election step failed; retrying", error=f"{type(e).__name__}: {e}")
                if self.value() is not None and self._failing_for_a_ttl():
                    self.step_down(f"election steps failing for {self.ttl}s: {e}")
            wait = self.session.due - time.monotonic() if leading else self.poll
            self._stop.wait(max(0.0, wait))

    def campaign(self) -> None:
        """One try: create the leader key, with a new lease, if it is absent."""
        kv = self.store.get(LEADER_KEY)
        self.store_ok_at = time.monotonic()
        if kv is not None or self._stop.is_set():
            return
        lease = self.session.grant(time.monotonic())
        value = rec.LeaderRecord(self.ident, time.time()).encode()
        try:
            won = self.store.txn([absent(LEADER_KEY)], [Put(LEADER_KEY, value, lease=lease)])
            ok = won.succeeded
        except StoreUnreachable:
            # Applied or not, nobody can tell: the key says.
            kv = self.store.get(LEADER_KEY)
            ok = kv is not None and kv.value == value
        if not ok:
            self._revoke()
            return
        with self._lock:
            self._value = value
            self.term += 1
        log.info("leadership acquired", id=self.ident, lease=lease, ttl=self.ttl)
        self.on_change(True)

    def keep(self) -> None:
        """One keepalive, and a look at the key: still ours, or step down."""
        value = self.value()
        if value is None:
            return
        try:
            left = self.session.keep(time.monotonic())
            kv = self.store.get(LEADER_KEY) if left > 0 else None
        except StoreError as e:
            if self._failing_for_a_ttl():
                self.step_down(f"keepalives failing for {self.ttl}s: {e}")
            else:
                log.warning("lease keepalive failed; retrying", error=str(e))
            return
        self.store_ok_at = time.monotonic()
        if left <= 0:
            self.step_down("lease expired")
        elif kv is None or kv.value != value:
            self.step_down("the leader key is no longer ours")

    def step_down(self, reason: str) -> None:
        """Stop acting at once; then wait as a candidate again. The lease is not revoked:
        it has expired, no longer holds the key, or the store does not answer; whatever
        it still holds goes when it expires."""
        with self._lock:  # let go with the value: a campaign after this grants anew
            value, self._value = self._value, None
            if value is not None:
                self.session.release()
        if value is not None:
            log.warning("leadership lost", id=self.ident, reason=reason)
            self.on_change(False)

    def resign(self) -> None:
        """Step down on purpose (shutting down): delete the key if it is still ours, by
        compare-and-delete, and only then revoke the lease, which is then certainly ours
        and alive. The successor need not wait for the lease to expire."""
        with self._lock:
            value, self._value = self._value, None
        if value is None:
            return
        try:
            ours = self.store.txn([Compare(LEADER_KEY, VALUE, "==", value)], [Delete(LEADER_KEY)])
        except StoreError as e:
            log.warning("leader key not deleted; it goes with its lease", error=str(e))
            ours = None
        if ours is not None and ours.succeeded:
            self._revoke()
        else:
            self.session.release()
        log.info("leadership released", id=self.ident, reason="shutting down")
        self.on_change(False)

    def _failing_for_a_ttl(self) -> bool:
        """No keepalive answered for a whole TTL: the lease may be gone."""
        return time.monotonic() - self.session.answered_at >= self.ttl

    def _revoke(self) -> None:
        lease = self.session.lease
        try:
            self.session.revoke()
        except StoreError as e:  # it expires by itself
            log.warning("lease revoke failed; it will expire", lease=lease, error=str(e))
