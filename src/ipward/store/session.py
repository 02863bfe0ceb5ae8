"""A lease session: the one way ipward holds keys under a lease (the controller's leader
key, `controller/election.py`; an agent's node registration, `agent/duties.py`).

A lease is granted when its holder asks, kept alive every TTL/`KEEPALIVES_PER_TTL`
(`core/policy.py`), a failed keepalive tried again within `RETRY`, and its loss noticed:
a keepalive answering it expired. The holder calls `keep` when it is `due`, from a
thread of its own (a slow caller must not delay it), on the monotonic times it passes.

`valid_until`: before this monotonic time the lease cannot have expired, whatever the
store says meanwhile (the send time of the last answered keepalive, or of the grant,
plus what was left of it). A holder that acts only before it never acts on a lease that
may be gone, whatever pause it wakes from (docs/design.md 5.8)."""

from __future__ import annotations

from ipward.core.policy import KEEPALIVES_PER_TTL
from ipward.store.base import Store, StoreError

RETRY = 1.0  # seconds to a failed keepalive's next try (at most its period)


class LeaseSession:
    """One lease at a time (`lease`, 0: none), of `ttl` seconds, on `store`."""

    def __init__(self, store: Store, ttl: int) -> None:
        self.store = store
        self.ttl = ttl
        self.period = ttl / KEEPALIVES_PER_TTL
        self.lease = 0
        self.due = 0.0  # the next keepalive (monotonic seconds)
        self.valid_until = 0.0
        self.answered_at = 0.0  # when the last answered keepalive (or the grant) was sent

    def grant(self, now: float) -> int:
        """A new lease, asked for at `now`, held from then on (a lease held before is
        let go: it expires by itself)."""
        lease = self.store.lease_grant(self.ttl)
        self.lease = lease
        self.answered_at = now
        self.valid_until = now + self.ttl
        self.due = now + self.period
        return lease

    def keep(self, now: float) -> int:
        """One keepalive of the lease held, sent at `now`: the seconds left of it; 0 when
        it has expired (the session then holds none, its loss) or none is held. The next
        is due a period on; within `RETRY` when this raises StoreError."""
        self.due = now + self.period
        lease = self.lease
        if not lease:
            return 0
        try:
            left = self.store.lease_keepalive(lease)
        except StoreError:
            self.retry(now)
            raise
        if left <= 0:
            self.lease = 0
            return 0
        self.answered_at = now
        self.valid_until = now + min(left, self.ttl)
        return left

    def retry(self, now: float) -> None:
        """The store failed the holder at `now`: the next keepalive within `RETRY`."""
        self.due = min(self.due, now + RETRY)

    def release(self) -> int:
        """Let go of the lease without revoking it (it has expired, holds nothing, or
        the store does not answer: what it still holds goes when it expires); its id."""
        lease, self.lease = self.lease, 0
        self.valid_until = 0.0
        return lease

    def revoke(self) -> None:
        """Let go of the lease and revoke it: the keys under it go now. StoreError when
        the store does not answer (the lease then expires by itself)."""
        lease = self.release()
        if lease:
            self.store.lease_revoke(lease)
