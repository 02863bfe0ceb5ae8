"""The `LedgerShard` objects of the Kubernetes store, through the API client: read one,
list a scope (`core/shards.py`), create, replace by compare-and-swap, watch. Every read
is a consistent one (no `resourceVersion`: the API server reads etcd), unless a
revision is asked for.

The resource (deploy/base/crds/ledgershards.yaml): namespaced, `ipward.io/v1alpha1`,
`spec.shard` (the shard's id) and `spec.data` (its content, `store/kube/content.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from ipward.core import shards
from ipward.kubeapi.client import ApiClient, ApiError, ApiUnreachable, WatchStream
from ipward.store.base import Compacted, StoreError, StoreUnreachable
from ipward.store.kube.content import Shard, ShardDecodeError, decode

GROUP = "ipward.io"
VERSION = "v1alpha1"
KIND = "LedgerShard"
PLURAL = "ledgershards"
PAGE = 500


class Conflict(Exception):
    """The object changed since it was read (409), or exists already (a create)."""


class ObjectDamaged(StoreError):
    """An object whose data does not decode as a shard: never served (`ipward check`)."""


class Objects:
    def __init__(self, client: ApiClient, namespace: str, where: str) -> None:
        self.client = client
        self.namespace = namespace
        self.where = where  # for messages: the store's URL
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        # Requests made, by method (GET a read, PUT and POST a write): `ipward bench`
        # counts the writes an ADD costs.
        self.requests: Counter[str] = Counter()
        self.seen = 0  # the highest revision of an object seen (`scope`'s floor)

    # -- requests ----------------------------------------------------------------------

    def _call(
        self, method: str, path: str, query: dict[str, str] | None = None, body: dict | None = None
    ) -> dict:
        self.requests[method] += 1
        try:
            answer = self.client.request(method, path, query, body=body)
        except ApiUnreachable as e:
            raise StoreUnreachable(f"Kubernetes store {self.where}: {e}") from e
        except ApiError as e:
            if e.status == 409:
                raise Conflict(e.message) from e
            if e.status == 410:
                raise Compacted(f"Kubernetes store {self.where}: {e.message}") from e
            if e.status in (429, 500, 502, 503, 504):
                raise StoreUnreachable(f"Kubernetes store {self.where}: {e}") from e
            raise StoreError(f"Kubernetes store {self.where}: {e}") from e
        objects = answer.get("items") if "items" in answer else [answer]
        self.saw(
            max((_rv(obj) for obj in objects or () if obj.get("kind", KIND) == KIND), default=0)
        )
        return answer

    def saw(self, revision: int) -> None:
        """A revision of a ledger object this process has seen: later reads from the
        watch cache are at least it. Not a list's revision: that is the API server's
        whole store's, which the cache of this resource may not reach for seconds."""
        if revision > self.seen:
            self.seen = revision

    def shard_of(self, obj: dict) -> Shard:
        """The shard an object holds; ObjectDamaged when its data does not decode."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        shard_id = spec.get("shard")
        try:
            rv = int(meta.get("resourceVersion", ""))
            if not isinstance(shard_id, str) or shards.object_name(shard_id) != meta.get("name"):
                raise ShardDecodeError(f"object {meta.get('name')!r} names shard {shard_id!r}")
            return decode(shard_id, rv, str(spec.get("data", "")))
        except (ValueError, ShardDecodeError) as e:
            raise ObjectDamaged(
                f"Kubernetes store {self.where}: {PLURAL}/{meta.get('name')} is damaged ({e})"
            ) from None

    def get(self, shard_id: str) -> Shard | None:
        """The shard as the API holds it now (a consistent read), None when no object."""
        try:
            obj = self._call("GET", f"{self.path}/{shards.object_name(shard_id)}")
        except StoreError as e:
            if isinstance(e.__cause__, ApiError) and e.__cause__.not_found:
                return None
            raise
        return self.shard_of(obj)

    def scope(
        self, scope: shards.Scope, revision: int = 0, damaged: list[str] | None = None
    ) -> tuple[list[Shard], int]:
        """Every shard of `scope` and the revision read at. One shard: a consistent GET.
        Several: one list at exactly `revision` when given (from etcd, in pages), else
        from the API server's watch cache, at a revision no older than any this process
        has seen (its own writes included): a consistent picture, current to within
        the cache's lag, which a selector can filter without the server reading every
        object from etcd (docs/measurements.md, "Kubernetes store: candidate layouts").
        A damaged object raises, or, with `damaged`, is named there and left out."""
        if len(scope.ids) == 1 and not revision:
            (shard_id,) = scope.ids
            at = self.revision()  # first: a change after it is read twice, never missed
            one = self.get(shard_id)
            return ([one] if one is not None else []), max(at, one.rv if one else 0)
        query = self._query(scope)
        if query is None:
            return [], self.revision()
        if not revision:
            query.update(resourceVersion=str(self.seen), resourceVersionMatch="NotOlderThan")
            body = self._call("GET", self.path, query)
            return self._shards(body, damaged, scope), _rv(body)
        found: list[Shard] = []
        query.update(resourceVersion=str(revision), resourceVersionMatch="Exact", limit=str(PAGE))
        while True:
            body = self._call("GET", self.path, query)
            found += self._shards(body, damaged, scope)
            cont = str((body.get("metadata") or {}).get("continue") or "")
            if not cont:
                return found, revision
            query["continue"] = cont

    def _shards(self, body: dict, damaged: list[str] | None, scope: shards.Scope) -> list[Shard]:
        found = []
        for obj in body.get("items") or []:
            try:
                found.append(self.shard_of(obj))
            except ObjectDamaged as e:
                if damaged is None:
                    raise
                damaged.append(str(e))
        if scope.ids:
            wanted = set(scope.ids)
            found = [s for s in found if s.id in wanted]
        return found

    def revision(self) -> int:
        """The store's revision now: a consistent list's, of one object at most."""
        return _rv(self._call("GET", self.path, {"limit": "1"}))

    def _query(self, scope: shards.Scope) -> dict[str, str] | None:
        """The selector of a scope's objects (several exact shards: every object, the
        caller keeping those it wants); None for a scope of none."""
        if len(scope.ids) == 1:
            return {"fieldSelector": f"metadata.name={shards.object_name(scope.ids[0])}"}
        if scope.ids:
            return {}
        if not scope.kinds:
            return None
        selector = [f"ipward.io/kind in ({','.join(scope.kinds)})"]
        selector += [f"{k}={v}" for k, v in sorted(scope.labels.items())]
        return {"labelSelector": ",".join(selector)}

    def write(self, shard: Shard, data: str) -> int:
        """Create the shard's object (rv 0) or replace it by compare-and-swap on the
        resourceVersion read; the new resourceVersion. Conflict when it moved."""
        name = shards.object_name(shard.id)
        body: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "labels": shards.labels_of(shard.id)},
            "spec": {"shard": shard.id, "data": data},
        }
        if shard.rv:
            body["metadata"]["resourceVersion"] = str(shard.rv)
            answer = self._call("PUT", f"{self.path}/{name}", body=body)
        else:
            answer = self._call("POST", self.path, body=body)
        return int(answer["metadata"]["resourceVersion"])

    def remove(self, shard: Shard) -> None:
        """Delete the object of an empty shard, if it is still as read."""
        name = shards.object_name(shard.id)
        body = {"preconditions": {"resourceVersion": str(shard.rv)}}
        try:
            self._call("DELETE", f"{self.path}/{name}", body=body)
        except StoreError as e:
            if not (isinstance(e.__cause__, ApiError) and e.__cause__.not_found):
                raise

    def watch(
        self, scope: shards.Scope, revision: int, read_timeout: float, timeout_seconds: int
    ) -> WatchStream:
        """Changes of the scope's objects after `revision` (exclusive), for at most
        `timeout_seconds` (the server then ends the stream). Several exact shards are
        watched as every shard (the caller keeps those it wants)."""
        query = dict(
            self._query(scope) or {},
            resourceVersion=str(revision),
            allowWatchBookmarks="true",
            timeoutSeconds=str(timeout_seconds),
        )
        try:
            return self.client.watch(
                self.path, query, accept="application/json", read_timeout=read_timeout
            )
        except ApiUnreachable as e:
            raise StoreUnreachable(f"Kubernetes store {self.where}: watch: {e}") from e
        except ApiError as e:
            if e.status == 410:
                raise Compacted(f"Kubernetes store {self.where}: {e.message}") from e
            raise StoreUnreachable(f"Kubernetes store {self.where}: watch: {e}") from e


def events(stream: WatchStream) -> Iterator[tuple[str, dict]]:
    """(type, object) of each event; an ERROR event raises (410: Compacted), a broken
    stream StoreUnreachable."""
    try:
        yield from _events(stream)
    except ApiUnreachable as e:
        raise StoreUnreachable(f"Kubernetes store watch: {e}") from e


def _events(stream: WatchStream) -> Iterator[tuple[str, dict]]:
    for event in stream:
        kind = str(event.get("type", ""))
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Compacted(str(obj.get("message", "")))
            raise StoreUnreachable(f"watch error: {obj.get('message', obj)}")
        yield kind, obj


def _rv(body: dict) -> int:
    """The resourceVersion of an object or a list."""
    try:
        return int((body.get("metadata") or {}).get("resourceVersion", "0") or 0)
    except (TypeError, ValueError):
        return 0
