"""A loopback Kubernetes API server for tests: the protocol of a real kube-apiserver for
what ipward uses, over HTTPS with bearer tokens, so a client takes the same code path
against it as against the real thing (`tests/k8s_wire/` holds recorded real exchanges;
`tests/system/test_k8s_wire.py` checks this server answers them in the same shapes).

Served: pods, nodes, namespaces (core/v1) and StatefulSets (apps/v1), cluster-wide and
per namespace; GET of one object; lists paged with `limit`/`continue` (each paged list
reads one snapshot; a token older than the history window gets 410 with a fresh token);
`fieldSelector=spec.nodeName=X` for pods; metadata-only answers
(`Accept: ...;as=PartialObjectMetadataList` / `PartialObjectMetadata`); watches as
chunked streams, one JSON event per line, with BOOKMARK events when asked where the real
1.26 server sends them (only once the resource changed after the watch opened; every
`bookmark_interval`, standing for its minute, and 2 s before the end), an ERROR event
with a 410 Status when the requested resourceVersion is older than the history window
or than the server's (re)start, and a clean end at `timeoutSeconds`
(`tests/system/test_k8s_wire.py` runs one scenario on both servers and compares);
writes (POST, PUT of `/status`, merge PATCH, DELETE with `gracePeriodSeconds` and a UID
precondition: a pod's graceful delete only sets `deletionTimestamp`, as without a
kubelet; a mirror pod's `kubernetes.io/config.mirror` needs `spec.nodeName` and is never
added, changed or removed by an update: 422); Status bodies for 401, 403, 404, 409, 410,
422.

Faults, on demand: `expire_history` (every open watch and the next watch from before now
get 410, continue tokens too), `cut_streams` (open watches end without their last
chunk, or inside a chunk), `end_watches_after` (a proxy ending watches cleanly before
their timeout), `refuse_watches` (ERROR 410 at once, lists served), `inject` (a raw line
on every open watch), `go_down`/`come_back` (connections refused, then served again on
the same port, like a restarted server), `stall`/`unstall` (watches send nothing,
not even bookmarks), `slow` (every answer delayed).

Not served (ipward does not use it): label selectors, other field selectors,
resourceVersionMatch=Exact, protobuf, server-side apply.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import itertools
import json
import re
import socket
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ipward.cluster.liveness import MIRROR_ANNOTATION
from ipward_lab.servers.etcd import free_port
from ipward_lab.servers.pki import CLIENT_USER, client_pki, serving_cert, token_kubeconfig


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str
    namespaced: bool


KINDS = {
    "pods": Kind("Pod", "v1", True),
    "nodes": Kind("Node", "v1", False),
    "namespaces": Kind("Namespace", "v1", False),
    "statefulsets": Kind("StatefulSet", "apps/v1", True),
}
ROUTES = [
    (re.compile(r"^/api/v1/(pods|nodes|namespaces)$"), ("resource",)),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods)$"), ("namespace", "resource")),
    (
        re.compile(r"^/api/v1/namespaces/([^/]+)/(pods)/([^/]+)(/status)?$"),
        ("namespace", "resource", "name", "status"),
    ),
    (re.compile(r"^/api/v1/(nodes|namespaces)/([^/]+)$"), ("resource", "name")),
    (re.compile(r"^/apis/apps/v1/(statefulsets)$"), ("resource",)),
    (re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(statefulsets)$"), ("namespace", "resource")),
    (
        re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/(statefulsets)/([^/]+)$"),
        ("namespace", "resource", "name"),
    ),
]
METADATA_AS = re.compile(r"as=(PartialObjectMetadata(?:List)?)\b")
ADMIN_TOKEN = "admin-token"
BOOKMARK_LEAD = 2.0  # the real server's last bookmark is due this long before timeoutSeconds


def status(code: int, reason: str, message: str, **extra: Any) -> dict:
    """An API Status object, as the real server words it."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": extra.pop("metadata", {})}
    body.update(status="Failure", message=message, reason=reason)
    body.update(extra)
    body["code"] = code
    return body


def now_text(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if at is None else at))


@dataclass
class Event:
    rv: int
    resource: str
    type: str
    obj: dict


class ApiError(Exception):
    def __init__(self, body: dict) -> None:
        super().__init__(body["message"])
        self.body = body


class KubeStore:
    """Objects by resource and key ("ns/name" or "name"), a resourceVersion counter, and
    the event history watches are served from (bounded by `window`)."""

    def __init__(self, window: int = 10_000) -> None:
        self.objects: dict[str, dict[str, dict]] = {r: {} for r in KINDS}
        self.rv = 100
        self.window = window
        self.history: list[Event] = []
        self.history_rvs: list[int] = []
        self.compacted = self.rv  # a watch or continue from before this gets 410
        self.cond = threading.Condition()
        self.snapshots: dict[tuple[str, int], list[tuple[str, dict]]] = {}
        self.last_event: dict[str, int] = {}  # resource -> resourceVersion of its last event

    # -- writes ----------------------------------------------------------------------------

    def _record(self, resource: str, kind: str, obj: dict) -> None:
        self.history.append(Event(self.rv, resource, kind, obj))
        self.history_rvs.append(self.rv)
        self.last_event[resource] = self.rv
        if len(self.history) > 2 * self.window:
            cut = len(self.history) - self.window
            self.compacted = self.history_rvs[cut - 1]
            del self.history[:cut], self.history_rvs[:cut]
        self.cond.notify_all()

    def create(self, resource: str, obj: dict, namespace: str = "") -> dict:
        kind = KINDS[resource]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        key = self.key(resource, meta.get("namespace", ""), str(meta.get("name", "")))
        with self.cond:
            if not meta.get("name"):
                raise ApiError(status(422, "Invalid", f"{resource}: metadata.name: Required"))
            if resource == "pods":
                _check_mirror_create(obj)
            if key in self.objects[resource]:
                raise ApiError(
                    status(
                        409,
                        "AlreadyExists",
                        f'{resource} "{meta["name"]}" already exists',
                        details={"name": meta["name"], "kind": resource},
                    )
                )
            self.rv += 1
            meta.update(uid=meta.get("uid") or str(uuid.uuid4()), resourceVersion=str(self.rv))
            meta.setdefault("creationTimestamp", now_text())
            obj.update(kind=kind.kind, apiVersion=kind.api_version)
            meta["managedFields"] = [_managed_entry(obj, "Update")]
            if resource == "pods":
                obj.setdefault("spec", {}).setdefault("terminationGracePeriodSeconds", 30)
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            self.objects[resource][key] = obj
            self._record(resource, "ADDED", obj)
            return obj

    def load(self, resource: str, objects: list[dict]) -> None:
        """Bulk load (labs filling the server): no history, one resourceVersion."""
        with self.cond:
            self.rv += 1
            kind = KINDS[resource]
            for obj in objects:
                obj.update(kind=kind.kind, apiVersion=kind.api_version)
                meta = obj["metadata"]
                meta["resourceVersion"] = str(self.rv)
                self.objects[resource][
                    self.key(resource, meta.get("namespace", ""), meta["name"])
                ] = obj
            self.compacted = self.rv  # watches start from a list after this

    def get(self, resource: str, namespace: str, name: str) -> dict:
        obj = self.objects[resource].get(self.key(resource, namespace, name))
        if obj is None:
            raise ApiError(
                status(
                    404,
                    "NotFound",
                    f'{resource} "{name}" not found',
                    details={"name": name, "kind": resource},
                )
            )
        return obj

    def update(self, resource: str, namespace: str, name: str, change: dict) -> dict:
        """Merge `change` into the object (a merge patch: dicts merge, None deletes)."""
        with self.cond:
            before = self.get(resource, namespace, name)
            obj = copy.deepcopy(before)
            _merge(obj, change)
            if resource == "pods":
                _check_mirror_update(before, obj)
            obj["metadata"]["managedFields"] = [
                *obj["metadata"].get("managedFields", [])[:1],
                _managed_entry(change, "Update"),
            ]
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[resource][self.key(resource, namespace, name)] = obj
            self._record(resource, "MODIFIED", obj)
            return obj

    def delete(
        self, resource: str, namespace: str, name: str, grace: int | None = None, uid: str = ""
    ) -> dict:
        """As the real server: a pod's delete first sets its deletionTimestamp (now +
        grace; grace 0 for a pod not on a node or already terminal), a MODIFIED event;
        with grace 0 the pod is then removed (DELETED, carrying that last state). With a
        grace > 0 it stays terminating: no kubelet here finishes the job. `uid`: the
        precondition of DeleteOptions (409 Conflict when the object is another one)."""
        with self.cond:
            obj = self.get(resource, namespace, name)
            if uid and obj["metadata"]["uid"] != uid:
                raise ApiError(
                    status(
                        409,
                        "Conflict",
                        f"Precondition failed: UID in precondition: {uid}, UID in object"
                        f" meta: {obj['metadata']['uid']}",
                        details={"name": name, "kind": resource},
                    )
                )
            if resource == "pods":
                spec, state = obj.get("spec") or {}, obj.get("status") or {}
                if grace is None:
                    grace = int(spec.get("terminationGracePeriodSeconds") or 0)
                if not spec.get("nodeName") or state.get("phase") in ("Succeeded", "Failed"):
                    grace = 0
                current = obj["metadata"].get("deletionGracePeriodSeconds")
                if current is None or grace < current:
                    marks = {
                        "deletionTimestamp": now_text(time.time() + grace),
                        "deletionGracePeriodSeconds": grace,
                    }
                    obj = self.update(resource, namespace, name, {"metadata": marks})
                if grace > 0:
                    return obj
            self.rv += 1
            gone = copy.deepcopy(obj)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            del self.objects[resource][self.key(resource, namespace, name)]
            self._record(resource, "DELETED", gone)
            return gone

    @staticmethod
    def key(resource: str, namespace: str, name: str) -> str:
        return f"{namespace}/{name}" if KINDS[resource].namespaced else name

    # -- reads -----------------------------------------------------------------------------

    def page(
        self,
        resource: str,
        namespace: str,
        node: str | None,
        limit: int,
        token: str,
    ) -> tuple[list[dict], int, str, int | None]:
        """(items, resourceVersion, next continue token, remaining count) of a list."""
        with self.cond:
            if token:
                try:
                    state = json.loads(base64.urlsafe_b64decode(token + "=="))
                    list_rv, start = int(state["rv"]), str(state["start"])
                except (ValueError, KeyError, TypeError) as e:
                    raise ApiError(status(400, "BadRequest", f"invalid continue token: {e}")) from e
                snapshot = self.snapshots.get((resource, list_rv))
                if snapshot is None or list_rv < self.compacted:
                    fresh = _token(-1, start)
                    raise ApiError(
                        status(
                            410,
                            "Expired",
                            "The provided continue parameter is too old to display a"
                            " consistent list result. You can start a new list without the"
                            " continue parameter, or use the continue token in this response"
                            " to retrieve the remainder of the results. Continuing with the"
                            " provided token results in an inconsistent list - objects that"
                            " were created, modified, or deleted between the time the first"
                            " chunk was returned and now may show up in the list.",
                            metadata={"continue": fresh},
                        )
                    )
            else:
                list_rv, start = self.rv, ""
                snapshot = sorted(self.objects[resource].items())
                if limit:
                    self.snapshots[(resource, list_rv)] = snapshot
                    while len(self.snapshots) > 8:
                        del self.snapshots[next(iter(self.snapshots))]
        first = bisect.bisect_left(snapshot, (start,)) if start else 0
        matching = (kv for kv in snapshot[first:] if _matches(kv[1], namespace, node))
        if not limit:
            return [obj for _, obj in matching], list_rv, "", None
        chosen = list(itertools.islice(matching, limit))
        rest = sum(1 for _ in matching)
        if not rest:
            return [obj for _, obj in chosen], list_rv, "", None
        return (
            [obj for _, obj in chosen],
            list_rv,
            _token(list_rv, chosen[-1][0] + "\x00"),
            None if node is not None else rest,  # the real server does not count a selection
        )

    def events_after(self, rv: int) -> list[Event]:
        return self.history[bisect.bisect_right(self.history_rvs, rv) :]


def _fields(value: object) -> dict:
    """A FieldsV1 tree of the keys written, as the real server records in managedFields."""
    if not isinstance(value, dict):
        return {}
    return {f"f:{k}": _fields(v) for k, v in value.items() if k != "managedFields"}


def _managed_entry(written: dict, operation: str) -> dict:
    fields = {k: v for k, v in written.items() if k not in ("kind", "apiVersion")}
    return {
        "manager": "unknown",
        "operation": operation,
        "apiVersion": "v1",
        "time": now_text(),
        "fieldsType": "FieldsV1",
        "fieldsV1": _fields(fields),
    }


def _invalid_mirror(pod: dict, reason: str, detail: str) -> ApiError:
    """The real server's 422 for a pod's mirror annotation (`field` is the annotation)."""
    field = f"metadata.annotations[{MIRROR_ANNOTATION}]"
    name = pod["metadata"].get("name", "")
    return ApiError(
        status(
            422,
            "Invalid",
            f'Pod "{name}" is invalid: {field}: {detail}',
            details={
                "name": name,
                "kind": "Pod",
                "causes": [{"reason": reason, "message": detail, "field": field}],
            },
        )
    )


def _check_mirror_create(pod: dict) -> None:
    """As the real server: a mirror pod (a kubelet's copy of a static pod) names its node."""
    mirror = (pod["metadata"].get("annotations") or {}).get(MIRROR_ANNOTATION)
    if mirror and not (pod.get("spec") or {}).get("nodeName"):
        raise _invalid_mirror(
            pod,
            "FieldValueInvalid",
            f'Invalid value: "{mirror}": must set spec.nodeName if mirror pod annotation is set',
        )


def _check_mirror_update(before: dict, after: dict) -> None:
    """As the real server: a pod's mirror annotation is never added, changed or removed."""
    old = (before["metadata"].get("annotations") or {}).get(MIRROR_ANNOTATION)
    new = (after["metadata"].get("annotations") or {}).get(MIRROR_ANNOTATION)
    if old != new:
        what = "may not add" if old is None else "may not remove or update"
        raise _invalid_mirror(
            after, "FieldValueForbidden", f"Forbidden: {what} mirror pod annotation"
        )


def _token(rv: int, start: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _matches(obj: dict, namespace: str, node: str | None) -> bool:
    if namespace and obj["metadata"].get("namespace") != namespace:
        return False
    return node is None or (obj.get("spec") or {}).get("nodeName", "") == node


def _merge(target: dict, change: dict) -> None:
    for key, value in change.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def as_metadata(obj: dict) -> dict:
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _generation = 0  # the lab's cut generation when the current request came

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read the client's logs

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise ApiError(status(400, "BadRequest", f"body: {e}")) from e
        return value if isinstance(value, dict) else {}

    def _route(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        parts = urlsplit(self.path)
        for pattern, names in ROUTES:
            match = pattern.match(parts.path)
            if match:
                found = {n: v for n, v in zip(names, match.groups(), strict=True) if v}
                return found, parse_qs(parts.query)
        raise ApiError(
            status(404, "NotFound", "the server could not find the requested resource", details={})
        )

    def _user(self) -> tuple[str, frozenset[str] | None]:
        peer = self.connection.getpeercert()  # type: ignore[attr-defined]
        if peer and dict(x[0] for x in peer["subject"]).get("commonName") == CLIENT_USER:
            return CLIENT_USER, None  # the client CA signed it (verified in the handshake)
        header = self.headers.get("Authorization", "")
        token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        user = self.server.lab.tokens.get(token)
        if user is None:
            raise ApiError(status(401, "Unauthorized", "Unauthorized"))
        return user

    @staticmethod
    def _permit(user: tuple[str, frozenset[str] | None], verb: str, resource: str) -> None:
        name, allowed = user
        if allowed is not None and resource not in allowed:
            group = "apps" if resource == "statefulsets" else ""
            raise ApiError(
                status(
                    403,
                    "Forbidden",
                    f'{resource} is forbidden: User "{name}" cannot {verb} resource'
                    f' "{resource}" in API group "{group}" at the cluster scope',
                    details={"kind": resource},
                )
            )

    def _serve(self, method: str) -> None:
        lab = self.server.lab
        self._generation = lab.generation  # a cut from now on ends this request's stream
        lab.requests.append((method, self.path, self.headers.get("Accept", "")))
        if lab.delay:
            time.sleep(lab.delay)
        try:
            user = self._user()
            if urlsplit(self.path).path == "/readyz":
                data = b"ok"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            route, query = self._route()
            verb = {"GET": "get" if "name" in route else "list"}.get(method, method.lower())
            if "watch" in query:
                verb = "watch"
            self._permit(user, verb, route["resource"])
            self._dispatch(method, route, query)
        except ApiError as e:
            self._send(int(e.body["code"]), e.body)

    def _dispatch(self, method: str, route: dict[str, str], query: dict[str, list[str]]) -> None:
        store = self.server.lab.store
        resource, namespace, name = route["resource"], route.get("namespace", ""), route.get("name")
        accept = self.headers.get("Accept", "")
        metadata = METADATA_AS.search(accept)
        if method == "GET" and name:
            obj = store.get(resource, namespace, name)
            self._send(200, as_metadata(obj) if metadata else obj)
        elif method == "GET" and query.get("watch", [""])[0] in ("1", "true"):
            self._watch(resource, namespace, query, bool(metadata))
        elif method == "GET":
            self._list(resource, namespace, query, bool(metadata))
        elif method == "POST" and not name:
            self._send(201, store.create(resource, self._body(), namespace))
        elif method == "PUT" and name and route.get("status"):
            self._send(
                200, store.update(resource, namespace, name, {"status": self._body().get("status")})
            )
        elif method == "PATCH" and name:
            self._send(200, store.update(resource, namespace, name, self._body()))
        elif method == "DELETE" and name:
            options = self._body()
            grace = options.get("gracePeriodSeconds", query.get("gracePeriodSeconds", [None])[0])
            uid = str((options.get("preconditions") or {}).get("uid") or "")
            self._send(
                200,
                store.delete(
                    resource, namespace, name, None if grace is None else int(grace), uid=uid
                ),
            )
        else:
            raise ApiError(status(405, "MethodNotAllowed", f"{method} is not supported here"))

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    @staticmethod
    def _node_selector(query: dict[str, list[str]]) -> str | None:
        selector = query.get("fieldSelector", [""])[0]
        if not selector:
            return None
        field, _, value = selector.partition("=")
        if field != "spec.nodeName":
            raise ApiError(status(400, "BadRequest", f'field label not supported: "{field}"'))
        return value

    def _list(
        self, resource: str, namespace: str, query: dict[str, list[str]], metadata: bool
    ) -> None:
        node = self._node_selector(query) if resource == "pods" else None
        limit = int(query.get("limit", ["0"])[0] or 0)
        token = query.get("continue", [""])[0]
        items, rv, more, remaining = self.server.lab.store.page(
            resource, namespace, node, limit, token
        )
        kind = KINDS[resource]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if more:
            meta["continue"] = more
        if remaining is not None:
            meta["remainingItemCount"] = remaining
        if metadata:
            body = {
                "kind": "PartialObjectMetadataList",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": meta,
                "items": [as_metadata(o) for o in items],
            }
        else:
            body = {
                "kind": f"{kind.kind}List",
                "apiVersion": kind.api_version,
                "metadata": meta,
                "items": [
                    {k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items
                ],
            }
        self._send(200, body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _event(self, kind: str, obj: dict) -> None:
        self._chunk(
            json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"
        )

    def _watch(
        self, resource: str, namespace: str, query: dict[str, list[str]], metadata: bool
    ) -> None:
        """A watch as kube-apiserver 1.26 serves one from its watch cache (measured:
        docs/measurements.md, "Kubernetes source"): the events after `resourceVersion`,
        ERROR 410 for a version older than the history or than the server's start, a
        clean end at `timeoutSeconds`; BOOKMARKs (when asked for) only once an event of
        the resource (any object, whatever the selector) came after the watch opened,
        due every `bookmark_interval` (the real server's minute) and `BOOKMARK_LEAD`
        seconds before the end, carrying the resource's last event's resourceVersion."""
        lab = self.server.lab
        store = lab.store
        node = self._node_selector(query) if resource == "pods" else None
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        bookmarks = query.get("allowWatchBookmarks", [""])[0] == "true"
        opened = time.monotonic()
        deadline = opened + float(query.get("timeoutSeconds", ["1800"])[0])
        end = min(deadline, opened + lab.proxy_end) if lab.proxy_end is not None else deadline
        kind = KINDS[resource]
        generation = self._generation
        position = since
        with store.cond:  # before the answer: an event once the client has it is newer
            seen = max(since, store.last_event.get(resource, 0))  # a bookmark needs newer
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        next_bookmark = self._next_bookmark(opened, deadline) if bookmarks else None
        while True:
            with store.cond:
                while True:
                    if lab.generation != generation:
                        if lab.cut_inside_chunk:  # a chunk announced, half of it sent
                            self.wfile.write(b'100\r\n{"type":"MODIFIED","obj')
                        raise _Cut()
                    if lab.stalled:
                        store.cond.wait(0.1)
                        continue
                    oldest = max(store.compacted, lab.started_rv)
                    if position < oldest or lab.refusing_watches:
                        events, expired = [], max(oldest, position + 1)
                        break
                    events, expired = store.events_after(position), 0
                    now = time.monotonic()
                    if events or now >= end or (next_bookmark is not None and now >= next_bookmark):
                        break
                    store.cond.wait(min(end, next_bookmark or end) - now)
                last = store.last_event.get(resource, 0)
            if expired:
                self._event(
                    "ERROR",
                    status(410, "Expired", f"too old resource version: {position} ({expired})"),
                )
                break
            for event in events:
                position = event.rv
                if event.type == "RAW":  # injected by the lab, to every stream as it is
                    self._chunk(event.obj["raw"] + b"\n")
                    continue
                if event.resource != resource or not _matches(event.obj, namespace, node):
                    continue
                self._event(event.type, as_metadata(event.obj) if metadata else event.obj)
            if events:
                continue
            if time.monotonic() >= end:
                break
            if last <= lab.started_rv:  # no event since the server started: the real one
                next_bookmark = None  # drops the watch from its bookmark schedule
                continue
            if last > seen:
                self._event(
                    "BOOKMARK",
                    {
                        "kind": "PartialObjectMetadata" if metadata else kind.kind,
                        "apiVersion": "meta.k8s.io/v1" if metadata else kind.api_version,
                        "metadata": {"resourceVersion": str(last), "creationTimestamp": None},
                    },
                )
            next_bookmark = self._next_bookmark(time.monotonic(), deadline)
        self._chunk(b"")  # the last chunk: a clean end

    def _next_bookmark(self, now: float, deadline: float) -> float | None:
        """When the next bookmark is due: a `bookmark_interval` on, or `BOOKMARK_LEAD`
        before the deadline if that is sooner; None once that moment has passed."""
        due = min(now + self.server.lab.bookmark_interval, deadline - BOOKMARK_LEAD)
        return due if due > now else None


class _Cut(Exception):
    """The lab cut this stream: drop the connection without its last chunk."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, lab: KubeApiServer, port: int) -> None:
        self.lab = lab
        super().__init__(("127.0.0.1", port), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        lab = self.lab
        try:
            conn = lab.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return
        with lab.lock:
            lab.connections.add(conn)
        try:
            _Handler(conn, client_address, self)
        except (_Cut, OSError, ssl.SSLError):
            pass
        finally:
            with lab.lock:
                lab.connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class KubeApiServer:
    """The test API server (use `kube_api_server()`): `url`, `ca_file`, `tokens`, `client_pki`."""

    def __init__(
        self,
        root: Path,
        *,
        bookmark_interval: float = 1.0,
        window: int = 10_000,
        certs: Path | None = None,
    ) -> None:
        """`certs`: a directory of certificates to reuse (made there when missing)."""
        self.root = root
        self.store = KubeStore(window)
        self.bookmark_interval = bookmark_interval
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        certs = certs or root
        self.ca_file = certs / "apiserver.crt"
        self.key_file = certs / "apiserver.key"
        # token -> (user, resources it may use, None: all)
        self.tokens: dict[str, tuple[str, frozenset[str] | None]] = {
            ADMIN_TOKEN: ("admin", None),
            "spare-token": ("spare", None),
            "nobody-token": ("nobody", frozenset()),
        }
        self.delay = 0.0
        self.requests: deque[tuple[str, str, str]] = deque(maxlen=10_000)  # method, path, Accept
        self.stalled = False
        self.generation = 0  # bumped to cut every open stream
        self.cut_inside_chunk = False  # a cut sends half a chunk first
        self.proxy_end: float | None = None  # seconds after which a watch ends cleanly
        self.refusing_watches = False  # every watch answered with ERROR 410 at once
        self.started_rv = self.store.rv  # a watch from before the server started gets 410
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        if not self.key_file.exists():
            serving_cert(self.ca_file, self.key_file)
        self.client_pki = client_pki(certs)
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(str(self.ca_file), str(self.key_file))
        self.tls.verify_mode = ssl.CERT_OPTIONAL  # a client certificate, or a token
        self.tls.load_verify_locations(str(self.client_pki.ca))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def kubeconfig(self, path: Path, token: str = ADMIN_TOKEN) -> Path:
        return token_kubeconfig(path, self.url, self.ca_file, token)

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        """Serve (again, after `go_down`: like a restarted kube-apiserver, a watch from a
        resourceVersion older than now gets 410 and bookmarks wait for a new event)."""
        with self.store.cond:
            self.started_rv = self.store.rv
        self._server = _Server(self, self.port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.cut_streams()
        with self.lock:
            open_now = list(self.connections)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # -- faults ----------------------------------------------------------------------------

    def go_down(self) -> None:
        """Refuse connections (the port closed) and drop every open one."""
        self.stop()

    def come_back(self) -> None:
        self.start()

    def cut_streams(self, inside_a_chunk: bool = False) -> None:
        """Drop every open watch's connection without its last chunk (at a chunk boundary,
        or after half a chunk): a dropped TCP connection, a proxy's idle cut."""
        with self.store.cond:
            self.cut_inside_chunk = inside_a_chunk
            self.generation += 1
            self.store.cond.notify_all()

    def refuse_watches(self, refusing: bool = True) -> None:
        """Answer every watch with ERROR 410 in its first line (lists are served), as a
        server answers a watch from before its history or its restart."""
        with self.store.cond:
            self.refusing_watches = refusing
            self.store.cond.notify_all()

    def end_watches_after(self, seconds: float | None) -> None:
        """A proxy in front: every watch opened from now on ends cleanly (its last chunk
        sent) after `seconds`, before the server's `timeoutSeconds` (None: no proxy)."""
        self.proxy_end = seconds

    def expire_history(self) -> None:
        """Forget the history up to now: open watches and later watches from an older
        resourceVersion get an ERROR 410, older continue tokens a 410."""
        with self.store.cond:
            self.store.rv += 1  # a list from now on is after the forgotten history
            self.store.compacted = self.store.rv
            self.store.history.clear()
            self.store.history_rvs.clear()
            self.store.snapshots.clear()
            self.store.cond.notify_all()

    def inject(self, line: bytes) -> None:
        """Send `line` as it is on every open watch (and on watches from before now):
        garbage, an event out of order, an unknown event type."""
        with self.store.cond:
            self.store.rv += 1
            self.store._record("*", "RAW", {"raw": line})

    def stall(self) -> None:
        with self.store.cond:
            self.stalled = True

    def unstall(self) -> None:
        with self.store.cond:
            self.stalled = False
            self.store.cond.notify_all()

    def slow(self, seconds: float) -> None:
        self.delay = seconds


@contextlib.contextmanager
def kube_api_server(root: Path, **kwargs: Any) -> Iterator[KubeApiServer]:
    server = KubeApiServer(root, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.unstall()
        server.stop()
