"""What the agent owes the cluster besides answering plugins: its node's registration
and its answers in the hand-back handshake."""

from __future__ import annotations

import os
import threading
import time

from ipward.core import keys, log
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.core.records import MARKED, BlockRecord
from ipward.ipam import blocks
from ipward.store import Store, StoreError
from ipward.store.base import Put


class NodeDuties:
    """What the agent owes the cluster besides answering plugins, every `interval`:
    keep `nodes/<node>` alive under a lease (the controller serves registered nodes),
    and answer the hand-back handshake for this node's marked blocks (DESIGN 5.3)."""

    def __init__(self, store: Store, node: str, interval: float, ttl: int) -> None:
        self.store = store
        self.node = node
        self.interval = interval
        self.ttl = ttl
        self.lease = 0
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
            try:
                self.register()
                self.answer_handshakes()
            except StoreError as e:
                log.warning("node duties: store unreachable", node=self.node, error=str(e))
            self.stopping.wait(self.interval)

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
