"""What the agent owes the cluster besides answering plugins: its node's registration
and its answers in the hand-back handshake."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from ipward.core import keys, log
from ipward.core.policy import CLOCK_STEP, REGISTRATION_REFRESH
from ipward.core.pool import PoolSpec
from ipward.core.records import MARKED, BlockRecord, NodeRegistration
from ipward.ipam import blocks
from ipward.store import Store, StoreError
from ipward.store.base import KeyValue, Put, absent, at_revision
from ipward.store.session import LeaseSession


class NodeDuties:
    """What the agent owes the cluster besides answering plugins: hold `nodes/<node>`
    under a lease (the controller serves registered nodes), renewed every TTL/3
    (`store/session.py`: a failed renewal tried again within a second), put
    again with the agent's wall clock every `refresh` seconds and at once when that
    clock steps (judges measure the node's clock offset from it: `ipward.gc.clocks`);
    and answer the hand-back handshake for this node's marked blocks (docs/design.md 5.3) every
    `interval`. Keepalives at TTL/3 rather than every `interval` are what a cluster of
    5,000 nodes asks of etcd: 1,500 a second, not 5,000.

    One agent holds a node: the registration is put only where the key is absent, ours
    (under our lease), or without a lease (no agent's), each by a compare on what was
    read. A second agent for the node (a DaemonSet's surge, a node name given twice)
    waits, saying who holds it, and registers once that registration is gone; so its
    stop, which revokes its own lease, never deletes the first one's. An agent whose
    registration is gone (its lease expired over a store outage, the key deleted) puts
    it back: at the next keepalive for a lease, at the next refresh for a key."""

    def __init__(
        self,
        store: Store,
        node: str,
        interval: float,
        ttl: int,
        refresh: float = REGISTRATION_REFRESH,
        clock: Callable[[], float] = time.time,
        runtime: bool = False,
    ) -> None:
        self.store = store
        self.node = node
        self.runtime = runtime  # published: this agent judges its node by its runtime
        self.interval = interval
        self.ttl = ttl
        self.refresh = refresh
        self.clock = clock  # wall: what the registration publishes
        self.since = clock()
        # Our lease, once granted; the registration is under it while we hold it. Its
        # keepalive is also when the registration is looked at (`keep`).
        self.session = LeaseSession(store, ttl)
        self.holder_lease = 0  # another agent's registration's, while we wait for it
        self._answer_due = self._refresh_due = 0.0  # monotonic seconds
        self._put_base: float | None = None  # wall minus monotonic at our last put
        self._holding = False  # whether our last look found the registration ours
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="duties", daemon=True)

    @property
    def lease(self) -> int:
        """Ours (0: none yet, or let go)."""
        return self.session.lease

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=self.interval + 5)
        try:
            self.session.revoke()  # deletes only a registration of ours
        except StoreError as e:
            log.warning("could not deregister the node", node=self.node, error=str(e))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            wake = self.step(time.monotonic())
            self.stopping.wait(max(0.0, wake - time.monotonic()))

    def step(self, now: float) -> float:
        """Do what is due at `now` (monotonic seconds); when to wake next."""
        try:
            if now >= self.session.due:
                self.keep(now)
            elif self._holding and (now >= self._refresh_due or self._clock_stepped(now)):
                self.hold(now)
            if now >= self._answer_due:
                self._answer_due = now + self.interval
                self.answer_handshakes()
        except StoreError as e:
            log.warning("node duties: store unreachable", node=self.node, error=str(e))
            self.session.retry(now)
        wake = min(self.session.due, self._answer_due)
        return min(wake, self._refresh_due) if self._holding else wake

    def keep(self, now: float) -> None:
        """Renew our lease; where it is gone, or the registration is not ours, or it is
        due again (refresh, a clock step), look at it and put it (`hold`)."""
        lease = self.session.lease
        if not self.session.keep(now) and lease:
            log.warning(
                "node registration lapsed (its lease expired); registering again",
                node=self.node,
                lease=lease,
            )
            self._holding = False
        if not self._holding or now >= self._refresh_due or self._clock_stepped(now):
            self.hold(now)

    def hold(self, now: float) -> bool:
        """Put the registration, with the agent's wall clock, unless another agent holds
        the node; whether it is ours now. Compared on what was read: a registration
        made meanwhile by another agent is never overwritten."""
        key = keys.node_key(self.node)
        kv = self.store.get(key)
        if kv is not None and kv.lease and kv.lease != self.lease:
            self._wait_for(kv)
            return False
        if kv is None and self._holding:
            log.warning("node registration found deleted; registering again", node=self.node)
        if not self.session.lease:
            self.session.grant(now)
        wall = self.clock()
        value = NodeRegistration(
            self.node, os.getpid(), self.since, wall, self.refresh, self.runtime
        )
        compare = absent(key) if kv is None else at_revision(key, kv.mod_revision)
        if not self.store.txn([compare], [Put(key, value.encode(), lease=self.lease)]).succeeded:
            return False  # changed since read: looked at again at the next keepalive
        if not self._holding:
            log.info("node registered", node=self.node, lease=self.lease, ttl=self.ttl)
        self._holding = True
        self.holder_lease = 0
        self._refresh_due = now + self.refresh
        self._put_base = wall - now
        return True

    def _wait_for(self, kv: KeyValue) -> None:
        """Another agent's registration holds the node: wait for it to go (logged once
        per holder). A lease of ours has nothing to hold: let it go."""
        if kv.lease != self.holder_lease:
            who: dict[str, object]
            try:
                holder = NodeRegistration.decode(kv.value)
                who = {"holder_pid": holder.pid, "holder_since": holder.since}
            except ValueError as e:
                who = {"holder_value": f"unreadable: {e}"}
            log.warning(
                "node held by another agent; waiting for its registration to go",
                node=self.node,
                holder_lease=kv.lease,
                **who,
                pid=os.getpid(),
            )
        self.holder_lease = kv.lease
        self._holding = False
        self.session.revoke()

    def _clock_stepped(self, now: float) -> bool:
        """Whether the wall clock moved against the monotonic one since our last put
        (a step, set by hand or by a time sync): the registration says so at once."""
        base = self._put_base
        return base is not None and abs(self.clock() - now - base) > CLOCK_STEP

    def answer_handshakes(self) -> list[tuple[str, str]]:
        """Answer every marked block of this node; returns (block, answer) pairs."""
        answered = []
        for pool_kv in self.store.range(keys.POOLS)[0]:
            spec = PoolSpec.decode(pool_kv.value)
            owned, _ = self.store.range(keys.affinity_prefix(spec.name, self.node))
            for entry in owned:
                kv = self.store.get(keys.block_key(spec.name, keys.cidr_of(entry.key)))
                if kv is None or BlockRecord.decode(kv.value).state != MARKED:
                    continue
                result = blocks.answer(self.store, spec, kv, time.time())
                if result is not None:
                    answered.append((keys.cidr_of(kv.key), result))
        return answered
