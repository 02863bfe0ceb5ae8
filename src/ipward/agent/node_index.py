"""The agent's copy of its node's index (`nodeips/<node>/`): read whole once, then kept
current from a watch on that prefix in a thread of its own. A reconciliation pass reads
the copy, not the store, so its cost follows the node's records and never the cluster's
(etcd's read of the same 110 keys grows by half from 1k to 150k records).

A copy that is behind frees nothing wrongly: an entry it lacks yet is judged at a later
pass, and an entry it still holds after its record changed or went is confirmed against
the record itself before anything is freed (`reconcile.confirmed`).

Following the prefix is `ipward.store.follower`'s (`BackgroundFollower`): when the
watch ends (a compacted history, a broken stream, the store down), the copy is read
whole again and followed from there, the next try after 1 s, doubling up to 30 s. Until
it is read, a pass is refused (`StoreUnreachable`, as a failed read was), never served
from a copy nobody follows. What is here is the copy's own shape: its node's records
that hold a sandbox, under a lock.

Each entry carries when the copy first saw its revision (`Held.seen`, the follower's
rule: monotonic; None for what the first read found, which has no earlier look to
compare with), kept across whole reads while the revision is the same: the ADD grace
holds across a step of the node's clock (`ipward.gc.clocks`)."""

from __future__ import annotations

import threading

from ipward.core import keys, log
from ipward.core.records import AddressRecord
from ipward.gc.rules import Held
from ipward.store import Store, StoreUnreachable
from ipward.store.base import DELETE, Event, KeyValue
from ipward.store.follower import BackgroundFollower, Stamp

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.agent.metrics import Metrics


class NodeIndex:
    """See the module docstring. `held()` may be called from any thread."""

    def __init__(self, store: Store, node: str, metrics: Metrics) -> None:
        self.node = node
        self._held: dict[str, Held] = {}  # index key -> the record it copies, with a sandbox
        self._lock = threading.Lock()
        self.follower = BackgroundFollower(
            store,
            keys.node_ips_prefix(node),
            self,
            name="node index",
            counted=lambda reason: metrics.node_index_reads.labels(reason=reason).inc(),
            log_fields={"node": node},
        )

    @property
    def revision(self) -> int:
        """The store revision the copy is at (0: not read yet)."""
        return self.follower.revision

    def start(self) -> None:
        self.follower.start()

    def stop(self) -> None:
        self.follower.stop()

    def wait_read(self, timeout: float) -> bool:
        """Wait up to `timeout` for the first whole read; whether it was made."""
        return self.follower.wait_read(timeout)

    def held(self) -> list[Held]:
        """The node's records that hold a sandbox, as the copy has them; each carries its
        entry's revision."""
        with self._lock:
            why_not = self.follower.not_followed
            if why_not is not None:
                raise StoreUnreachable(f"node index of {self.node}: {why_not}")
            return list(self._held.values())

    # -- what the follower hands it

    def load(self, kvs: list[KeyValue], stamp: Stamp, seen: float | None) -> None:
        with self._lock:
            before, self._held = self._held, {}
            for kv in kvs:
                was = before.get(kv.key)
                self._put(kv, was.seen if was and was.mod_revision == kv.mod_revision else seen)

    def apply(self, events: list[Event], stamp: Stamp) -> None:
        with self._lock:
            for event in events:
                if event.kind == DELETE:
                    self._held.pop(event.kv.key, None)
                else:
                    self._put(event.kv, stamp.mono)

    def _put(self, kv: KeyValue, seen: float | None) -> None:
        held = entry_held(kv, self.node, seen)
        if held is None:
            self._held.pop(kv.key, None)
        else:
            self._held[kv.key] = held


def entry_held(kv: KeyValue, node: str, seen: float | None) -> Held | None:
    """The record a `nodeips/<node>/` entry copies, as reconciliation judges it (with the
    entry's revision, first seen at monotonic `seen`); None when it holds no sandbox of
    `node` or does not decode."""
    _, pool, ip = keys.node_ip_parts(kv.key)
    try:
        record = AddressRecord.decode(kv.value)
    except ValueError:
        log.error("node index entry unreadable; not judged", key=kv.key)
        return None
    if record.is_detached or record.node != node:
        return None
    return Held(pool, ip, kv.mod_revision, record, seen)
