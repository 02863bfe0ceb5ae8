"""The Kubernetes store (`k8s://`, docs/design.md 5.15): the store contract of
`store/base.py` kept on `LedgerShard` custom resources. Keys are grouped into shards
(`core/shards.py`), one object each; a transaction over several is made atomic by the
commit protocol of `store/kube/commit.py`; reads resolve the locks they meet as of their
revision; watches turn objects' changes into keys' (`store/kube/watching.py`).

URLs: `k8s://` (in a pod: its service account) or `k8s://?kubeconfig=PATH[&context=NAME]`,
with `&namespace=NS` (default `ipward-system`) and `&timeout=SECONDS` (default 10: how
long one call, a transaction's retries included, may take).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from urllib.parse import parse_qsl, urlsplit

from ipward.core import shards
from ipward.core.errors import InvalidConfig
from ipward.kubeapi.client import ApiClient, ApiError
from ipward.kubeapi.config import from_kubeconfig, in_cluster
from ipward.store.base import (
    Compare,
    Delete,
    KeyValue,
    Put,
    Store,
    StoreError,
    StoreIncompatible,
    StoreUnreachable,
    TxnResult,
    Watch,
)
from ipward.store.kube.commit import MAX_OBJECT, Committer, MustWait
from ipward.store.kube.objects import PLURAL, Conflict, ObjectDamaged, Objects

DEFAULT_NAMESPACE = "ipward-system"
OPTIONS = ("kubeconfig", "context", "namespace", "timeout")


def parse_url(url: str) -> dict[str, str]:
    """The options of a `k8s://` store URL, each checked by name."""
    parts = urlsplit(url)
    if parts.scheme != "k8s" or parts.netloc or parts.path not in ("", "/"):
        raise InvalidConfig(f"store {url!r}: expected k8s:// or k8s://?kubeconfig=PATH")
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in OPTIONS:
            raise InvalidConfig(
                f"store {url!r}: unknown option {name!r} (known: {', '.join(OPTIONS)})"
            )
        if name in options:
            raise InvalidConfig(f"store {url!r}: option {name!r} given twice")
        options[name] = value
    if "context" in options and "kubeconfig" not in options:
        raise InvalidConfig(f"store {url!r}: context= needs kubeconfig=")
    namespace = options.get("namespace", DEFAULT_NAMESPACE)
    if not namespace or len(namespace) > 63 or not all(c.isalnum() or c == "-" for c in namespace):
        raise InvalidConfig(f"store {url!r}: namespace {namespace!r} is not a namespace name")
    try:
        timeout = float(options.get("timeout", "10"))
    except ValueError:
        raise InvalidConfig(f"store {url!r}: timeout must be a number of seconds") from None
    if not 1 <= timeout <= 300:
        raise InvalidConfig(f"store {url!r}: timeout must be 1 to 300 seconds")
    return options


class KubeStore(Store):
    max_txn_bytes = MAX_OBJECT

    def __init__(self, url: str, *, create: bool = True) -> None:
        options = parse_url(url)
        conn = (
            from_kubeconfig(options["kubeconfig"], options.get("context", ""))
            if "kubeconfig" in options
            else in_cluster()
        )
        self.url = url
        self.namespace = options.get("namespace", DEFAULT_NAMESPACE)
        timeout = float(options.get("timeout", "10"))
        self.client = ApiClient(conn, timeout=timeout)
        self.objects = Objects(self.client, self.namespace, url)
        self.committer = Committer(self.objects, timeout)
        self._closed = threading.Event()
        self._instance = f"{random.getrandbits(64):016x}"  # names this process's probe
        try:
            self.objects.revision()
        except StoreError as e:
            cause = e.__cause__
            if isinstance(cause, ApiError) and cause.status == 404:
                self.client.close()
                raise StoreIncompatible(
                    f"Kubernetes store {url}: no {PLURAL}.ipward.io resource in namespace"
                    f" {self.namespace} (install ipward's resources: kubectl apply -k"
                    " deploy/base)"
                ) from None
            self.client.close()
            raise

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        shard = self.committer.read(shards.shard_of(key))
        return self.committer.visible(shard, None).get(key)

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        found, revision = self._read(shards.scope_of(prefix), prefix)
        found.sort(key=lambda kv: kv.key)
        return (found[:limit] if limit else found), revision

    def snapshot(self, prefixes: Sequence[str]) -> tuple[list[KeyValue], int]:
        everything, revision = self._read(shards.EVERYTHING, "")
        everything.sort(key=lambda kv: kv.key)
        return [kv for p in prefixes for kv in everything if kv.key.startswith(p)], revision

    def _read(self, scope: shards.Scope, prefix: str) -> tuple[list[KeyValue], int]:
        batch, revision = self.objects.scope(scope)
        by_id = {s.id: s for s in batch}
        found: list[KeyValue] = []
        for shard in batch:
            self.committer.leases.saw(shard)
            found += [
                kv
                for key, kv in self.committer.visible(shard, revision, by_id).items()
                if key.startswith(prefix)
            ]
        return found, revision

    def revision(self) -> int:
        return self.objects.revision()

    def sync_point(self) -> int:
        """A write of this store's probe object (a shard of its own, no data): a watch of
        the whole store reports its revision, so a follower that waits for it has seen
        everything before it (the API server's revisions also move on with writes of
        other objects, which no ledger watch sees)."""
        probe = shards.shard(shards.PROBE, self._instance)
        while True:
            shard = self.committer.cached(probe)
            try:
                return self.committer.write_as_is(shard)
            except Conflict:
                continue

    # -- writes ----------------------------------------------------------------------------

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        problem = self.txn_problem(compares, success, failure)
        if problem:
            from ipward.store.base import TxnTooLarge

            raise TxnTooLarge(f"Kubernetes store {self.url}: {problem}")
        return self.committer.txn(compares, success, failure, self.committer.leases.alive)

    # -- watches ---------------------------------------------------------------------------

    def watch(self, prefix: str, start_revision: int) -> Watch:
        from ipward.store.kube.watching import KubeWatch

        return KubeWatch(self.committer, prefix, start_revision)

    # -- leases ----------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        lease = random.getrandbits(62) + 1
        self.committer.leases.grant(lease, max(2, int(ttl)))
        return lease

    def lease_keepalive(self, lease: int) -> int:
        leases = self.committer.leases
        ttl = leases.granted.get(lease)
        if ttl is None or not leases.alive(lease):
            leases.drop(lease)
            return 0
        sent = time.monotonic()
        for shard_id in list(leases.shards.get(lease, ())):
            if not self._renew(shard_id, lease):
                leases.drop(lease)
                return 0
        leases.renewed[lease] = sent
        return ttl

    def _renew(self, shard_id: str, lease: int) -> bool:
        """One keep-alive: a new version of the lease's object. False when the object
        holds no key of the lease any more (another judged it expired and removed it)."""
        deadline = time.monotonic() + self.committer.timeout
        while True:
            shard = self.committer.cached(shard_id)
            state = shard.leases.get(lease)
            if state is None or not any(e.lease == lease for e in shard.entries.values()):
                return False
            state[1] += 1
            try:
                self.committer.write_as_is(shard)
                return True
            except Conflict:
                if time.monotonic() > deadline:
                    raise StoreUnreachable(
                        f"Kubernetes store {self.url}: keep-alive kept conflicting"
                    ) from None

    def lease_revoke(self, lease: int) -> None:
        self.committer.leases.drop(lease)
        held = self.committer.leases.shards.pop(lease, set())
        if not held:  # another process's lease: where its keys are, read
            found, _ = self.objects.scope(shards.Scope(kinds=(shards.LEASE,)))
            held = {s.id for s in found if lease in s.leases}
        for shard_id in held:
            deadline = time.monotonic() + self.committer.timeout
            while True:
                shard = self.committer.cached(shard_id)
                gone = [k for k, e in shard.entries.items() if e.lease == lease]
                try:
                    self.committer.settle(shard, gone, ())
                except MustWait:
                    if time.monotonic() > deadline:
                        raise StoreUnreachable(
                            f"Kubernetes store {self.url}: revoke waited too long"
                        ) from None
                    time.sleep(0.05)
                    continue
                for key in gone:
                    shard.delete(key)
                shard.leases.pop(lease, None)
                try:
                    self.committer.write_as_is(shard)
                    break
                except Conflict:
                    continue

    # -- the rest --------------------------------------------------------------------------

    def integrity_problems(self) -> list[str]:
        damaged: list[str] = []
        self.objects.scope(shards.EVERYTHING, damaged=damaged)
        return damaged

    def close(self) -> None:
        self._closed.set()
        self.committer.close()
        probe = self.committer.known(shards.shard(shards.PROBE, self._instance))
        if probe is not None:
            try:
                self.objects.remove(probe)
            except StoreError:
                pass  # an object of no data left behind: it names no live process
        self.client.close()


__all__ = ["KubeStore", "ObjectDamaged", "parse_url"]
