"""What the agent owes the cluster besides answering plugins: its node's registration
and its answers in the hand-back handshake."""

from __future__ import annotations

import os
import threading
import time

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.policy import KEEPALIVES_PER_TTL
from ipward.core.pool import PoolSpec
from ipward.core.records import MARKED, BlockRecord
from ipward.ipam import blocks
from ipward.store import Store, StoreError
from ipward.store.base import Put

RETRY = 1.0  # seconds to a failed keepalive's next try (at most its period)


class NodeDuties:
    """What the agent owes the cluster besides answering plugins: keep `nodes/<node>`
    alive under a lease (the controller serves registered nodes), renewed every TTL/3,
    and answer the hand-back handshake for this node's marked blocks (docs/design.md 5.3) every
    `interval`. Keepalives at TTL/3 rather than every `interval` are what a cluster of
    5,000 nodes asks of etcd: 1,500 a second, not 5,000."""

    def __init__(self, store: Store, node: str, interval: float, ttl: int) -> None:
        self.store = store
        self.node = node
        self.interval = interval
        self.ttl = ttl
        self.lease = 0
        self._keepalive_due = self._answer_due = 0.0  # monotonic seconds
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="duties", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=self.interval + 5)
        if self.lease:
            try:
                self.store.lease_revoke(self.lease)
            except StoreError as e:
                log.warning("could not deregister the node", node=self.node, error=str(e))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            wake = self.step(time.monotonic())
            self.stopping.wait(max(0.0, wake - time.monotonic()))

    def step(self, now: float) -> float:
        """Do what is due at `now` (monotonic seconds); when to wake next."""
        try:
            if now >= self._keepalive_due:
                self._keepalive_due = now + self.ttl / KEEPALIVES_PER_TTL
                self.register()
            if now >= self._answer_due:
                self._answer_due = now + self.interval
                self.answer_handshakes()
        except StoreError as e:
            log.warning("node duties: store unreachable", node=self.node, error=str(e))
            self._keepalive_due = min(self._keepalive_due, now + RETRY)
        return min(self._keepalive_due, self._answer_due)

    def register(self) -> None:
        if self.lease and self.store.lease_keepalive(self.lease) > 0:
            return
        self.lease = self.store.lease_grant(self.ttl)
        value = rec.NodeRegistration(self.node, os.getpid(), time.time()).encode()
        self.store.txn([], [Put(keys.node_key(self.node), value, lease=self.lease)])
        log.info("node registered", node=self.node, lease=self.lease, ttl=self.ttl)

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
