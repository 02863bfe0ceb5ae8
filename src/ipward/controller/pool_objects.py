"""IPPool objects reconciled into the ledger (docs/design.md 5.16): the pools of a store
on the Kubernetes API are objects people write (`kubectl apply -f pool.yaml`); the
ledger stays what allocation reads (`pools/<name>`), and the leading controller brings
it to the objects, in its passes, every ledger write fenced (docs/design.md 5.8).

Whose pools are objects (`objects_client`): a `k8s://` store in `ipward-system`, the
store's own namespace by default and where `deploy/base` puts it. An IPPool is
cluster-scoped, so one ledger of a cluster can own them; a store in another namespace (a
second ledger on one API server) keeps its pools in the ledger, made with the CLI, as on
etcd and SQLite.

The steps (`ObjectSteps`), each one write, shared with `ipward pool` (unfenced there, as
the CLI's writes are): hold an object with the finalizer `ipward.io/pool`; apply its
spec (a new pool through `ipam.pools.create_pool` and its overlap guard; a changed one
through `change_pool`, the way the ledger takes a network config's changed ranges;
refused, with the reason its status gives, when it is invalid, overlaps another pool or
names a network config's inline pool); delete its pool once the object is being deleted
(`ipam.pools.delete_when_free`: marked deleting at once, so ADDs get 103, removed once
no record holds an address of it), then release the object.

The loop (`PoolObjects`): the objects followed by a list and a watch
(`cluster/k8s/reflector.py`, listed again every RELIST_EVERY seconds); each pass of the
leader reconciles every object, from the pass's view of the store, and a change of an
object's spec or deletion asks for a pass at once (a status change does not). The
status (what `ipward pool list` shows, and the conditions Ready, Overlaps, Exhausted) is
computed from the view and written through the status subresource, only when it
changed, at most once every STATUS_INTERVAL seconds per pool: an ADD never writes it.
"""

from __future__ import annotations

import time
from itertools import islice
from typing import TYPE_CHECKING

from ipward.cluster.k8s.reflector import Reflector, Resource
from ipward.cluster.liveness import LivenessUnavailable
from ipward.core import ippool, keys, log, testpoints
from ipward.core import records as rec
from ipward.core.errors import (
    InvalidConfig,
    IpwardError,
    PoolExists,
    PoolsOverlap,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.ippool import PoolObject, Verdict
from ipward.core.pool import IPPOOL, PoolSpec
from ipward.core.records import AddressRecord
from ipward.ipam import pools
from ipward.kubeapi.client import ApiClient, ApiError, ApiUnreachable
from ipward.kubeapi.config import connection
from ipward.store.base import StoreError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.controller.executor import Executor
    from ipward.controller.metrics import Metrics
    from ipward.controller.view import StoreView
    from ipward.store import Store
    from ipward.store.base import Compare, KeyValue

STATUS_INTERVAL = 5.0  # seconds between two status writes of one pool, at least
RELIST_EVERY = 300.0  # seconds between lists of the objects, under the watch
RESOURCE = Resource("ippools", ippool.PATH, ippool.parse)


def objects_client(store_url: str) -> ApiClient | None:
    """An API client for the IPPool objects of the store at `store_url`, when its pools
    are objects (see the module's docstring); None when they are not."""
    if not store_url.startswith("k8s://"):
        return None
    from ipward.store.kube import DEFAULT_NAMESPACE, parse_url

    options = parse_url(store_url)
    if options.get("namespace", DEFAULT_NAMESPACE) != DEFAULT_NAMESPACE:
        return None
    conn = connection(options.get("kubeconfig", ""), options.get("context", ""))
    return ApiClient(conn, timeout=float(options.get("timeout", "10")))


def source_of(kv: KeyValue) -> str:
    """Who made the stored pool (its spec's `source`), read without the rest of it."""
    return str(rec.decode(kv.value).get("source", ""))


class ObjectSteps:
    """One object's steps, each one write (see the module's docstring). `fence` gives
    the compares every ledger write carries (the controller's, or none); called before an
    object's write too, so a controller that no longer leads writes nothing."""

    def __init__(
        self, store: Store, client: ApiClient, fence: Callable[[], Sequence[Compare]]
    ) -> None:
        self.store = store
        self.client = client
        self.fence = fence

    def hold(self, obj: PoolObject) -> PoolObject | None:
        """The finalizer put on; the object as it is then (None: it changed or went since
        it was read; the next pass reads it again)."""
        self.fence()
        finalizers = [*obj.finalizers, ippool.FINALIZER]
        answer = self._patch(obj, {"finalizers": finalizers})
        if answer is None:
            return None
        log.info("pool object held", pool=obj.name, finalizer=ippool.FINALIZER)
        return ippool.parse(answer)[1]

    def release(self, obj: PoolObject, why: str) -> bool:
        """The finalizer taken off (the object then goes); False when it changed since
        it was read."""
        self.fence()
        finalizers = [f for f in obj.finalizers if f != ippool.FINALIZER]
        if self._patch(obj, {"finalizers": finalizers}) is None:
            return False
        log.info("pool object released", pool=obj.name, reason=why)
        return True

    def _patch(self, obj: PoolObject, metadata: dict) -> dict | None:
        """A merge patch of the object's metadata, on the resourceVersion read."""
        body = {"metadata": {**metadata, "resourceVersion": obj.resource_version}}
        try:
            return self.client.request("PATCH", ippool.path(obj.name), body=body)
        except ApiError as e:
            if e.status == 409 or e.not_found:
                return None
            raise

    def apply(self, obj: PoolObject, stored: KeyValue | None) -> tuple[Verdict, PoolSpec | None]:
        """Bring the ledger's pool to the object's spec; `stored`: the ledger's pool of
        that name as last read. The verdict, and the pool the ledger holds for the object
        now (None: none of its). A `stored` older than the ledger (another wrote the pool
        meanwhile) is TryAgainLater: the next pass reads again."""
        name = obj.name
        current = PoolSpec.decode(stored.value) if stored is not None else None
        ours = current if current is not None and current.source == IPPOOL else None
        try:
            desired = ippool.declared(obj)
        except InvalidConfig as e:
            return Verdict(ippool.INVALID, e.msg), ours
        applied = Verdict(
            ippool.APPLIED,
            f"the ledger holds generation {obj.generation}'s spec; ADDs allocate from it",
        )
        try:
            if current is None:
                pools.create_pool(self.store, desired, self.fence())
                return applied, desired
            if current.inline:
                why = (
                    f"pool {name} is a network config's inline pool (its ranges are in a"
                    " CNI config): an IPPool cannot take its name; rename one of them"
                )
                return Verdict(ippool.REFUSED, why), None
            if current.deleting:
                why = f"pool {name} is being deleted in the ledger ('ipward pool delete')"
                return Verdict(ippool.REFUSED, why), ours
            if current.declaration() != desired.declaration():
                pools.change_pool(self.store, desired, self.fence())
            return applied, desired
        except PoolsOverlap as e:
            return Verdict(ippool.OVERLAPS, e.msg), ours
        except (PoolExists, UnknownPool) as e:
            raise TryAgainLater(
                f"pool {name}: the ledger changed since it was read ({e.msg})"
            ) from None

    def delete(self, obj: PoolObject) -> list[KeyValue] | None:
        """The finalizer's work on an object being deleted: its pool deleted from the
        ledger (one made for an object: never another's of that name), then the object
        released. The records that still hold an address of the pool while it waits for
        them; [] once the object is released; None when the object changed since it was
        read (nothing released: read it again)."""
        why = "no pool of its is in the ledger"
        kv = self.store.get(keys.pool_key(obj.name))
        if kv is not None and source_of(kv) == IPPOOL:
            held = pools.delete_when_free(self.store, obj.name, self.fence())
            if held:
                return held
            why = "its pool is deleted from the ledger"
            testpoints.pause("pool-object-release")
        return [] if self.release(obj, why) else None

    def write_status(self, obj: PoolObject, status: dict) -> bool:
        """The status put through the status subresource, on the resourceVersion read;
        False when the object changed or went since."""
        self.fence()
        body = {
            "apiVersion": ippool.API_VERSION,
            "kind": ippool.KIND,
            "metadata": {"name": obj.name, "resourceVersion": obj.resource_version},
            "spec": obj.spec,
            "status": status,
        }
        try:
            self.client.request("PUT", ippool.path(obj.name) + "/status", body=body)
        except ApiError as e:
            if e.status == 409 or e.not_found:
                return False
            raise
        return True


def deletion_verdict(count: int, holders: Sequence[str]) -> Verdict:
    if not count:
        return Verdict(ippool.DELETING, "being deleted")
    shown = "; ".join(holders) + (", ..." if count > len(holders) else "")
    return Verdict(
        ippool.DELETING,
        f"being deleted: {count} address{'' if count == 1 else 'es'} still allocated ({shown});"
        f" ADDs of the pool get 103, and the finalizer {ippool.FINALIZER} holds the object"
        " until their DEL frees them",
    )


class PoolObjects:
    """The leader's reconciliation of every IPPool object (see the module's docstring):
    `reconcile` in each pass, the objects followed in a thread of their own."""

    def __init__(
        self,
        client: ApiClient,
        store: Store,
        executor: Executor,
        metrics: Metrics,
        wake: Callable[[], None],
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.executor = executor
        self.metrics = metrics
        self.wake = wake
        self.clock = clock
        self.monotonic = monotonic
        self.steps = ObjectSteps(store, client, executor.fence)
        self.reflector = Reflector(
            client, RESOURCE, on_change=self._changed, relist_every=RELIST_EVERY
        )
        self._started = False
        self._written: dict[str, float] = {}  # pool -> monotonic time of its last status write
        # pool -> what of it asks for a pass when it changes (the reflector's thread only)
        self._shapes: dict[str, tuple] = {}

    def start(self) -> None:
        self.reflector.start()
        self._started = True

    def close(self) -> None:
        if self._started:
            self.reflector.stop()
        self.client.close()

    def new_term(self) -> None:
        """A new leader's first status of each pool is written at once."""
        self._written.clear()

    def _changed(self, name: str) -> None:
        """An event about the object `name`: a pass now when its spec, deletion or
        finalizers changed (not for a status, which is the pass's own write)."""
        try:
            obj = self.reflector.get(name)
        except LivenessUnavailable:
            return
        if obj is None:  # deleted
            self._shapes.pop(name, None)
            self.wake()
            return
        shape = (obj.uid, obj.generation, obj.deleting, obj.finalizers)
        if self._shapes.get(name) != shape:
            self._shapes[name] = shape
            self.wake()

    def reconcile(self, view: StoreView) -> None:
        """Every object once, from the pass's view. An object the API refuses a write of
        is tried again next pass; a ledger write that lost its compare asks whether we
        still lead (`Executor.after_failed_write`)."""
        try:
            objects, _ = self.reflector.snapshot()
        except LivenessUnavailable as e:
            log.debug("pool objects not reconciled: not listed", reason=str(e))
            return
        for name, obj in sorted(objects.items()):
            try:
                self._reconcile(obj, view)
            except StoreError:
                raise  # the store: the whole pass stops here
            except (ApiError, ApiUnreachable) as e:
                log.warning("pool object not reconciled; next pass", pool=name, error=str(e))
            except TryAgainLater as e:
                self.executor.after_failed_write()
                log.info("pool object not reconciled; next pass", pool=name, reason=e.msg)
            except (IpwardError, ValueError) as e:  # one pool's bad data: not the others
                log.error("pool object not reconciled", pool=name, error=f"{type(e).__name__}: {e}")
        self._written = {n: t for n, t in self._written.items() if n in objects}

    def _reconcile(self, obj: PoolObject, view: StoreView) -> None:
        stored = view.pools.get(obj.name)
        if obj.deleting:
            if obj.held:
                self._delete(obj, view, stored)
            return
        if not obj.held:
            held = self.steps.hold(obj)
            if held is None:
                return
            obj = held
        verdict, served = self.steps.apply(obj, stored)
        if self._due(obj.name):
            self._write_status(obj, verdict, served, view, None)

    def _delete(self, obj: PoolObject, view: StoreView, stored: KeyValue | None) -> None:
        """The finalizer's step, skipped while the view shows the pool marked and its
        records there (the store is read only when they may be gone)."""
        spec = _decoded(stored)
        ours = spec if spec is not None and spec.source == IPPOOL else None
        keys_of = view.pool(obj.name)
        count = sum(keys_of.records.values())
        if ours is not None and ours.deleting and count:
            if not self._due(obj.name):
                return
            found = (h for h in view.records.values() if h.pool == obj.name)
            holders = [ippool.holder(h.ip, h.record) for h in islice(found, ippool.HOLDERS_SHOWN)]
        else:
            held = self.steps.delete(obj)
            if not held:
                return
            count = len(held)
            holders = [
                ippool.holder(keys.last(kv.key), AddressRecord.decode(kv.value))
                for kv in held[: ippool.HOLDERS_SHOWN]
            ]
            if not self._due(obj.name):
                return
        self._write_status(obj, deletion_verdict(count, holders), ours, view, (count, holders))

    def _due(self, name: str) -> bool:
        last = self._written.get(name)
        return last is None or self.monotonic() - last >= STATUS_INTERVAL

    def _write_status(
        self,
        obj: PoolObject,
        verdict: Verdict,
        served: PoolSpec | None,
        view: StoreView,
        held: tuple[int, Sequence[str]] | None,
    ) -> None:
        use = {}
        if served is not None:
            keys_of = view.pool(obj.name)
            use = ippool.usage(served, keys_of.records, keys_of.blocks)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        status = ippool.status(obj, verdict, served, use, held, now)
        if status == obj.status:
            return
        if self.steps.write_status(obj, status):
            self._written[obj.name] = self.monotonic()
            self.metrics.pool_status_writes.inc()
            log.info(
                "pool object status written",
                pool=obj.name,
                generation=obj.generation,
                ready=verdict.reason,
                used=status.get("used"),
            )


def _decoded(kv: KeyValue | None) -> PoolSpec | None:
    if kv is None:
        return None
    try:
        return PoolSpec.decode(kv.value)
    except (IpwardError, ValueError):
        return None  # `ipward check` reports it; nothing here acts on it


__all__ = [
    "RELIST_EVERY",
    "STATUS_INTERVAL",
    "ObjectSteps",
    "PoolObjects",
    "objects_client",
]
