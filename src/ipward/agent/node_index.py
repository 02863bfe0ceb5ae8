"""The agent's copy of its node's index (`nodeips/<node>/`): read whole once, then kept
current from a watch on that prefix in a thread of its own. A reconciliation pass reads
the copy, not the store, so its cost follows the node's records and never the cluster's
(etcd's read of the same 110 keys grows by half from 1k to 150k records).

A copy that is behind frees nothing wrongly: an entry it lacks yet is judged at a later
pass, and an entry it still holds after its record changed or went is confirmed against
the record itself before anything is freed (`reconcile.confirmed`).

When the watch ends (a compacted history, a broken stream, the store down), the copy is
read whole again and followed from there, the next try after 1 s, doubling up to 30 s.
Until it is read, a pass is refused (`StoreUnreachable`, as a failed read was), never
served from a copy nobody follows.

Each entry carries when the copy first saw its revision (`Held.seen`, monotonic; None
for what the first read found, which has no earlier look to compare with), kept across
whole reads while the revision is the same: the ADD grace holds across a step of the
node's clock (`ipward.gc.clocks`)."""

from __future__ import annotations

import threading
import time

from ipward.core import keys, log
from ipward.core.records import AddressRecord
from ipward.gc.rules import Held
from ipward.store import Store, StoreUnreachable
from ipward.store.base import DELETE, Compacted, Event, KeyValue, Watch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.agent.metrics import Metrics

RETRY_FIRST = 1.0
RETRY_MOST = 30.0

# Why the copy was read whole (metrics labels).
START, COMPACTED, BROKEN = "start", "compacted", "broken"


class NodeIndex:
    """See the module docstring. `held()` may be called from any thread."""

    def __init__(self, store: Store, node: str, metrics: Metrics) -> None:
        self.store = store
        self.node = node
        self.metrics = metrics
        self.prefix = keys.node_ips_prefix(node)
        self.revision = 0  # the store revision the copy is at (0: not read yet)
        self._held: dict[str, Held] = {}  # index key -> the record it copies, with a sandbox
        self._why_not: str | None = "not read yet"  # why there is no copy to serve
        self._lock = threading.Lock()
        self._read = threading.Event()  # set at the first whole read
        self._stopping = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._follow, name="node-index", daemon=True)

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
        return self._read.wait(timeout)

    def held(self) -> list[Held]:
        """The node's records that hold a sandbox, as the copy has them; each carries its
        entry's revision."""
        with self._lock:
            if self._why_not is not None:
                raise StoreUnreachable(f"node index of {self.node}: {self._why_not}")
            return list(self._held.values())

    def _follow(self) -> None:
        reason, wait = START, RETRY_FIRST
        while not self._stopping.is_set():
            try:
                watch = self._read_whole(reason)
                if watch is None:
                    return  # stopped meanwhile
                wait = RETRY_FIRST
                for batch in watch.batches():
                    self._apply(batch)
                reason, detail = BROKEN, "the watch stream ended"
            except Compacted as e:
                reason, detail = COMPACTED, str(e)
            except Exception as e:  # a store error or a broken stream: read whole again
                reason, detail = BROKEN, f"{type(e).__name__}: {e}"
            if self._stopping.is_set():
                return
            with self._lock:
                self._why_not = detail
            log.warning(
                "node index: reading it whole again", node=self.node, reason=reason, detail=detail
            )
            self._stopping.wait(wait)
            wait = min(wait * 2, RETRY_MOST)

    def _read_whole(self, reason: str) -> Watch | None:
        """Read the copy whole and start following it; None when stopped meanwhile."""
        kvs, revision = self.store.range(self.prefix)
        self.metrics.node_index_reads.labels(reason=reason).inc()
        watch = self.store.watch(self.prefix, revision + 1)  # no event between the two lost
        with self._lock:
            if self._stopping.is_set():
                watch.cancel()
                return None
            self._watch = watch
            before, self._held = self._held, {}
            seen = time.monotonic() if self._read.is_set() else None
            for kv in kvs:
                was = before.get(kv.key)
                self._put(kv, was.seen if was and was.mod_revision == kv.mod_revision else seen)
            self.revision = revision
            self._why_not = None
        self._read.set()
        return watch

    def _apply(self, batch: list[Event]) -> None:
        seen = time.monotonic()
        with self._lock:
            for event in batch:
                if event.kind == DELETE:
                    self._held.pop(event.kv.key, None)
                else:
                    self._put(event.kv, seen)
            self.revision = batch[-1].kv.mod_revision

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
