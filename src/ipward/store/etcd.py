"""etcd v3 backend: grpcio's synchronous API with the protobuf messages and stubs from aetcd.

Only `open_store` imports this module, for etcd URLs: grpc and aetcd cost 100+ ms to import
and must stay off the CNI plugin's path.

Failover: calls go to one endpoint at a time. When it cannot be reached the call moves on
to the next, each endpoint tried at most once per call, all within one `timeout`. A write
(txn) moves on only when it certainly never reached etcd; once sent, a lost answer leaves
its outcome unknown and it raises StoreUnreachable instead of being sent again, since a
resent compare-and-swap that had in fact been applied would report failure.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from ipward.store.base import (
    DELETE,
    PUT,
    Compacted,
    Compare,
    Delete,
    Event,
    KeyValue,
    Put,
    Store,
    StoreError,
    StoreUnreachable,
    TxnResult,
    TxnTooLarge,
    Watch,
)

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

DEFAULT_PORT = 2379
OPTIONS = ("ca", "cert", "key", "user", "password", "timeout")
# Keys per range request of a snapshot. etcd 3.4 walks the whole rest of the range on
# every page (to count it), so a read of n keys costs n * n / (2 * page): at 150,000
# keys, pages of 1,000 took 11 s where pages of 10,000 take 3.6 s (one unpaged range
# 3.1 s); a page is some 6 MB.
SNAPSHOT_PAGE = 10_000

# Makes a member cut off from its leader refuse at once ("no leader") instead of hanging
# until the deadline, and end watches it can no longer feed.
REQUIRE_LEADER: Metadata = (("hasleader", "true"),)

CHANNEL_OPTIONS = [
    # A large range answer must not fail on grpc's 4 MiB default.
    ("grpc.max_receive_message_length", -1),
    # A connection of its own per channel: grpc otherwise shares one among channels to the
    # same target, and with it the reconnect backoff that _failed drops a channel to escape.
    ("grpc.use_local_subchannel_pool", 1),
    # Notice a silently dead peer under a long-lived watch.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
UNAVAILABLE = (*RETRYABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
# etcd (3.4) answers a request whose deadline passes inside the server, as during a
# leader election, with UNKNOWN and Go's context error: that is a timeout too.
SERVER_TIMEOUTS = ("context deadline exceeded", "context canceled")


# How etcd refuses a transaction over its limits (the last one is grpc's own, past the
# request limit plus 512 KiB): permanent, never "unavailable".
TOO_LARGE = (
    "etcdserver: too many operations in txn request",
    "etcdserver: request is too large",
    "grpc: received message larger than max",
)


def _retryable(code: grpc.StatusCode, details: str | None) -> bool:
    return code in RETRYABLE or (
        code == grpc.StatusCode.UNKNOWN and any(t in (details or "") for t in SERVER_TIMEOUTS)
    )


COMPARE_RESULTS = {
    "==": rpc.Compare.EQUAL,
    "!=": rpc.Compare.NOT_EQUAL,
    "<": rpc.Compare.LESS,
    ">": rpc.Compare.GREATER,
}
# Our target names are also the names of the operand fields of etcd's Compare.
COMPARE_TARGETS = {
    "value": rpc.Compare.VALUE,
    "version": rpc.Compare.VERSION,
    "create_revision": rpc.Compare.CREATE,
    "mod_revision": rpc.Compare.MOD,
}


class Endpoint:
    """A channel to one etcd member and the stubs over it."""

    def __init__(
        self, index: int, target: str, credentials: grpc.ChannelCredentials | None
    ) -> None:
        self.index = index
        self.target = target
        if credentials is None:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.maintenance = rpc.MaintenanceStub(self.channel)


class EtcdStore(Store):
    # etcd's defaults (--max-txn-ops, --max-request-bytes): a server run with lower ones
    # refuses a larger transaction with TxnTooLarge.
    max_txn_ops = 128
    max_txn_bytes = 3 * 512 * 1024

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise StoreError("etcd: no endpoints")
        self._targets = list(endpoints)
        self._credentials = credentials
        self._user = user
        self._password = password or ""
        self._timeout = timeout
        self._lock = threading.Lock()
        self._current = 0
        self._endpoints: dict[int, Endpoint] = {}
        self._token: str | None = None

    @classmethod
    def from_url(cls, url: str) -> EtcdStore:
        """`etcd://host:port[,host:port...]` (`etcds://` for TLS) with query options
        ca, cert, key (PEM files), user, password and timeout (seconds, default 5). Each
        part is checked here, so a typo is an error naming it, not a connection to
        somewhere else."""
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as e:  # a bracketed host that is not IPv6
            raise StoreError(f"etcd URL {url!r}: {e}") from None
        if parts.scheme not in ("etcd", "etcds"):
            raise StoreError(f"not an etcd URL: {url!r}")
        if "@" in parts.netloc:
            raise StoreError("etcd URL: give credentials as ?user=NAME&password=SECRET")
        if parts.path not in ("", "/") or parts.fragment:
            raise StoreError(f"etcd URL must be etcd://HOST:PORT[,HOST:PORT...]: {url!r}")
        endpoints = [_endpoint(h) for h in parts.netloc.split(",")]
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        opts = dict(query)
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise StoreError(f"etcd URL: unknown option(s) {', '.join(unknown)}")
        names = [name for name, _ in query]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise StoreError(f"etcd URL: option(s) given twice: {', '.join(twice)}")
        try:
            timeout = float(opts.get("timeout", 5))
        except ValueError:
            raise StoreError(f"etcd URL: bad timeout {opts['timeout']!r}") from None
        if not 0 < timeout < math.inf:  # also refuses nan
            raise StoreError(f"etcd URL: timeout {opts['timeout']!r} must be a positive number")
        if ("user" in opts) != ("password" in opts):
            raise StoreError("etcd URL: give both user and password, or neither")
        credentials = None
        if parts.scheme == "etcds":
            if ("cert" in opts) != ("key" in opts):
                raise StoreError("etcd URL: give both cert and key, or neither")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(opts.get("ca")),
                private_key=_read(opts.get("key")),
                certificate_chain=_read(opts.get("cert")),
            )
        elif {"ca", "cert", "key"} & set(opts):
            raise StoreError("etcd URL: ca, cert and key need etcds:// (TLS)")
        return cls(
            endpoints,
            credentials=credentials,
            user=opts.get("user"),
            password=opts.get("password"),
            timeout=timeout,
        )

    # The calls. Each rpc function gets the endpoint, the metadata and a timeout.

    def get(self, key: str) -> KeyValue | None:
        req = rpc.RangeRequest(key=key.encode())
        resp = self._call(lambda ep, md, t: ep.kv.Range(req, timeout=t, metadata=md))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def range(self, prefix: str, limit: int = 0) -> tuple[list[KeyValue], int]:
        key = prefix.encode()
        # No sort_order: etcd already answers in ascending key order, and asking for a sort
        # makes it read the whole range before applying the limit.
        req = rpc.RangeRequest(key=key or b"\0", range_end=_prefix_end(key), limit=limit)
        resp = self._call(lambda ep, md, t: ep.kv.Range(req, timeout=t, metadata=md))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def snapshot(self, prefixes: Sequence[str]) -> tuple[list[KeyValue], int]:
        # Pages of SNAPSHOT_PAGE keys; the first answer's revision pins every later
        # request, so all pages of all prefixes are one revision (etcd's MVCC serves it
        # unless compacted meanwhile, which fails the call).
        kvs: list[KeyValue] = []
        revision = 0
        for prefix in prefixes:
            key = prefix.encode()
            start, end = key or b"\0", _prefix_end(key)
            while True:
                req = rpc.RangeRequest(
                    key=start, range_end=end, limit=SNAPSHOT_PAGE, revision=revision
                )
                resp = self._call(lambda ep, md, t: ep.kv.Range(req, timeout=t, metadata=md))  # noqa: B023
                revision = revision or resp.header.revision
                kvs.extend(_kv(kv) for kv in resp.kvs)
                if not resp.more:
                    break
                start = resp.kvs[-1].key + b"\0"
        return kvs, revision

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure: Sequence[Put | Delete] = (),
    ) -> TxnResult:
        req = rpc.TxnRequest(
            compare=[_compare(c) for c in compares],
            success=[_op(o) for o in success],
            failure=[_op(o) for o in failure],
        )
        resp = self._call(lambda ep, md, t: ep.kv.Txn(req, timeout=t, metadata=md), write=True)
        return TxnResult(resp.succeeded, resp.header.revision)

    def watch(self, prefix: str, start_revision: int) -> Watch:
        key = prefix.encode()
        create = rpc.WatchCreateRequest(
            key=key or b"\0", range_end=_prefix_end(key), start_revision=start_revision
        )
        # Authenticate (if configured) and pick an endpoint the usual way, then open the
        # stream on a channel (and connection) of its own, which cancel() can close.
        ep, metadata = self._call(lambda ep, md, t: (ep, md))
        own = Endpoint(ep.index, ep.target, self._credentials)
        return EtcdWatch(self, own, metadata, create)

    def lease_grant(self, ttl: int) -> int:
        # Safe to resend: a lease granted twice leaves one unused, which expires.
        req = rpc.LeaseGrantRequest(TTL=ttl)
        resp = self._call(lambda ep, md, t: ep.lease.LeaseGrant(req, timeout=t, metadata=md))
        if resp.error:
            raise StoreError(f"etcd: lease grant: {resp.error}")
        return int(resp.ID)

    def lease_keepalive(self, lease: int) -> int:
        def keepalive(ep: Endpoint, md: Metadata, timeout: float) -> int:
            # One request on the bidirectional stream; etcd answers, then sees the end of
            # our requests and closes it. An unknown or expired lease gets TTL 0.
            call = ep.lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=timeout, metadata=md
            )
            try:
                return int(next(call).TTL)
            except StopIteration:
                raise StoreUnreachable(f"etcd {ep.target}: keepalive got no answer") from None
            finally:
                call.cancel()

        return self._call(keepalive)

    def lease_revoke(self, lease: int) -> None:
        req = rpc.LeaseRevokeRequest(ID=lease)

        def revoke(ep: Endpoint, md: Metadata, timeout: float) -> None:
            try:
                ep.lease.LeaseRevoke(req, timeout=timeout, metadata=md)
            except grpc.RpcError as e:
                # Already expired or revoked (perhaps by a resent revoke): the goal is met.
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(revoke)

    def revision(self) -> int:
        req = rpc.RangeRequest(key=b"\0", count_only=True)
        resp = self._call(lambda ep, md, t: ep.kv.Range(req, timeout=t, metadata=md))
        return int(resp.header.revision)

    def integrity_problems(self) -> list[str]:
        # etcd checks its own data (hashes compared between members, each file's
        # checksums) and raises CORRUPT on a member that differs; NOSPACE is no damage
        # (it clears once space is freed), so not reported here.
        req = rpc.AlarmRequest(action=rpc.AlarmRequest.GET)
        resp = self._call(lambda ep, md, t: ep.maintenance.Alarm(req, timeout=t, metadata=md))
        return [
            f"etcd: member {alarm.memberID:x} raised alarm CORRUPT"
            for alarm in resp.alarms
            if alarm.alarm == rpc.CORRUPT
        ]

    def close(self) -> None:
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for ep in endpoints:
            ep.channel.close()

    # Failover and authentication.

    def _call(self, fn: Callable[[Endpoint, Metadata, float], T], *, write: bool = False) -> T:
        deadline = time.monotonic() + self._timeout
        failures: list[str] = []
        reauthenticated = False
        while True:
            index, ep = self._endpoint()
            # Leave time for the endpoints not tried yet, so one that hangs cannot use up
            # the whole timeout.
            left = len(self._targets) - len(failures)
            timeout = max(deadline - time.monotonic(), 0.001) / left
            sent = False
            try:
                metadata = self._metadata(ep, timeout)
                sent = True
                return fn(ep, metadata, timeout)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
                if _token_rejected(code, details) and self._user and not reauthenticated:
                    self._token = None
                    reauthenticated = True
                    continue
                if not _retryable(code, details):
                    raise _error(ep.target, code, details) from None
                self._failed(index)
                failures.append(f"{ep.target} ({code.name}: {details})")
                if write and sent and not _never_sent(details):
                    raise StoreUnreachable(
                        f"etcd {ep.target}: {details}; the write may or may not have been applied"
                    ) from None
                if left == 1 or time.monotonic() >= deadline:
                    raise StoreUnreachable(
                        f"etcd unavailable, tried {'; '.join(failures)}"
                    ) from None

    def _endpoint(self) -> tuple[int, Endpoint]:
        with self._lock:
            index = self._current
            ep = self._endpoints.get(index)
            if ep is None:
                ep = self._endpoints[index] = Endpoint(
                    index, self._targets[index], self._credentials
                )
            return index, ep

    def _failed(self, index: int) -> None:
        """Move on from an endpoint that failed, and drop its channel: a new channel
        connects at once, where the old one would wait out grpc's reconnect backoff
        (which grows to minutes) while the member may already be back. Not closed here:
        other threads may be about to call on it (a closed channel raises ValueError);
        grpc closes it when the last of them lets go."""
        with self._lock:
            self._endpoints.pop(index, None)
            if self._current == index:
                self._current = (index + 1) % len(self._targets)

    def _metadata(self, ep: Endpoint, timeout: float) -> Metadata:
        if self._user is None:
            return REQUIRE_LEADER
        token = self._token
        if token is None:
            req = rpc.AuthenticateRequest(name=self._user, password=self._password)
            token = self._token = ep.auth.Authenticate(
                req, timeout=timeout, metadata=REQUIRE_LEADER
            ).token
        return (*REQUIRE_LEADER, ("token", token))


class EtcdWatch(Watch):
    """A Watch stream on its own channel. Iterate in one thread; cancel from any."""

    def __init__(
        self,
        store: EtcdStore,
        endpoint: Endpoint,
        metadata: Metadata,
        create: Any,
    ) -> None:
        self._store = store
        self._endpoint = endpoint
        self._cancelled = threading.Event()
        self._call = endpoint.watch.Watch(self._requests(create), metadata=metadata)

    def _requests(self, create: Any) -> Iterator[Any]:
        yield rpc.WatchRequest(create_request=create)
        # Keep our side of the stream open until cancel: a finished request stream is not
        # a cancel to etcd, and grpc reads this iterator in a thread of its own.
        self._cancelled.wait()

    def batches(self) -> Iterator[list[Event]]:
        target = self._endpoint.target
        try:
            for resp in self._call:
                if resp.compact_revision:
                    raise Compacted(
                        f"etcd {target}: cannot watch from before revision"
                        f" {resp.compact_revision}: compacted"
                    )
                if resp.canceled:  # by etcd: we cancel by ending the stream
                    raise StoreError(f"etcd {target}: watch refused: {resp.cancel_reason}")
                # One answer holds whole revisions (no fragmenting is asked for).
                if resp.events:
                    yield [_event(ev) for ev in resp.events]
            if not self._cancelled.is_set():
                raise StoreUnreachable(f"etcd {target}: watch stream ended")
        except grpc.RpcError as e:
            if self._cancelled.is_set():
                return
            if _retryable(e.code(), e.details()):
                self._store._failed(self._endpoint.index)
            raise _error(target, e.code(), e.details()) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        self._cancelled.set()
        self._call.cancel()
        self._endpoint.channel.close()


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
_V6_CHARS = frozenset("0123456789abcdefABCDEF:.")


def _endpoint(text: str) -> str:
    """One `host[:port]` or `[v6][:port]` of an etcd URL, checked, as grpc's target."""
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        if not bracket or not address or not set(address) <= _V6_CHARS:
            raise StoreError(f"etcd URL: bad IPv6 host in {text!r} (write [ADDRESS]:PORT)")
        host, colon, port = f"[{address}]", rest[:1], rest[1:]
        if rest and colon != ":":
            raise StoreError(f"etcd URL: {rest!r} after the IPv6 host in {text!r}")
    else:
        host, colon, port = text.partition(":")
        if not host or not set(host) <= _HOST_CHARS:
            raise StoreError(f"etcd URL: empty or bad host in {text!r}")
    if not colon:
        port = str(DEFAULT_PORT)
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise StoreError(f"etcd URL: port {port!r} of {text!r} is not a number from 1 to 65535")
    return f"{host}:{int(port)}"


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise StoreError(f"etcd URL: cannot read {path}: {e.strerror}") from None


def _prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, range_end) every key starting with prefix."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # etcd: every key from `key` on
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease
    )


def _event(ev: Any) -> Event:
    if ev.type == rpc.Event.PUT:
        return Event(PUT, _kv(ev.kv))
    return Event(DELETE, KeyValue(ev.kv.key.decode(), b"", 0, ev.kv.mod_revision, 0))


def _compare(c: Compare) -> Any:
    return rpc.Compare(
        key=c.key.encode(),
        target=COMPARE_TARGETS[c.target],
        result=COMPARE_RESULTS[c.op],
        **{c.target: c.operand},
    )


def _op(op: Put | Delete) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(
            request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease)
        )
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key.encode()))


def _never_sent(details: str | None) -> bool:
    """The failure certainly happened before the request reached etcd: grpc could not
    connect, or the member refused it for want of a leader (asked for by REQUIRE_LEADER)."""
    return (details or "").startswith("failed to connect") or details == "etcdserver: no leader"


def _token_rejected(code: grpc.StatusCode, details: str | None) -> bool:
    # Expired token, or one issued before a change to users or roles.
    return code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.INVALID_ARGUMENT and "auth store is old" in (details or "")
    )


def _error(target: str, code: grpc.StatusCode, details: str | None) -> StoreError:
    if (details or "").startswith(TOO_LARGE):
        return TxnTooLarge(f"etcd {target}: {code.name}: {details}")
    cls = StoreUnreachable if code in UNAVAILABLE or _retryable(code, details) else StoreError
    return cls(f"etcd {target}: {code.name}: {details}")
