"""The loopback test API server answers the recorded exchanges of a real kube-apiserver
1.26 (`tests/k8s_wire/`) in the same shapes: status, the headers that matter, kinds,
fields, item order, event types; after loading the same objects and making the same
changes. (The source's parsers on the recorded objects: `tests/unit/test_k8s_objects.py`.)"""

from __future__ import annotations

import copy
import json
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import urllib3

from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.servers.kube_test_server import KubeApiServer, kube_api_server
from support import recorded

JSON = "application/json"


class Answer:
    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self.status = response.status
        self.headers = response.headers
        raw = response.data
        self.lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        self.body = self.lines[0] if len(self.lines) == 1 else None


class Replay:
    def __init__(self, server: KubeApiServer) -> None:
        self.server = server
        context = ssl.create_default_context(cafile=str(server.ca_file))
        self.pool = urllib3.HTTPSConnectionPool("127.0.0.1", server.port, ssl_context=context)

    def send(
        self, path: str, accept: str = "application/json", token: str = "admin-token"
    ) -> Answer:
        return Answer(self.open(path, accept, token))

    def open(
        self, path: str, accept: str = "application/json", token: str = "admin-token"
    ) -> urllib3.BaseHTTPResponse:
        """The answer with its body not read yet (a watch goes on while the test acts)."""
        headers = {"Accept": accept, "Authorization": f"Bearer {token}"}
        return self.pool.urlopen("GET", path, headers=headers, retries=False, preload_content=False)

    def write(self, method: str, path: str, body: dict) -> None:
        headers = {"Authorization": "Bearer admin-token", "Content-Type": "application/json"}
        answer = self.pool.request(method, path, body=json.dumps(body), headers=headers)
        assert answer.status < 300, answer.data


@pytest.fixture
def replay(tmp_path: Path, kube_certs: Path) -> Iterator[Replay]:
    """The test server holding the recording's objects (pods of pages 1 and 2, nodes,
    namespaces, the StatefulSet)."""
    with kube_api_server(tmp_path, certs=kube_certs) as server:
        pods = {
            item["metadata"]["uid"]: item
            for page in ("pods-list-page1", "pods-list-page2")
            for item in recorded(page)["body"]["items"]
        }
        server.store.load("pods", [copy.deepcopy(p) for p in pods.values()])
        for resource, name in (
            ("nodes", "nodes-list-metadata"),
            ("namespaces", "namespaces-list-metadata"),
            ("statefulsets", "statefulsets-list"),
        ):
            server.store.load(resource, copy.deepcopy(recorded(name)["body"]["items"]))
        yield Replay(server)


def same_headers(answer: Answer, record: dict) -> None:
    assert answer.status == record["status"]
    assert answer.headers["Content-Type"] == record["headers"]["Content-Type"]
    if "stream" in record:  # a watch is chunked; a plain answer may be either
        assert answer.headers.get("Transfer-Encoding") == "chunked"


def same_list(answer: Answer, record: dict) -> None:
    same_headers(answer, record)
    body, want = answer.body, record["body"]
    assert body is not None
    assert (body["kind"], body["apiVersion"]) == (want["kind"], want["apiVersion"])
    assert set(body["metadata"]) == set(want["metadata"])
    if "remainingItemCount" in want["metadata"]:
        assert body["metadata"]["remainingItemCount"] == want["metadata"]["remainingItemCount"]
    names = [i["metadata"]["name"] for i in body["items"]]
    assert names == [i["metadata"]["name"] for i in want["items"]]
    for got, expected in zip(body["items"], want["items"], strict=True):
        assert set(got) == set(expected)
        assert set(got["metadata"]) == set(expected["metadata"])


def query(record: dict) -> str:
    return str(record["request"]["path"])


@pytest.mark.parametrize(
    "name",
    ["pods-list-page1", "pods-list-node-n1", "statefulsets-list", "pods-list-expired"],
)
def test_lists_answer_in_the_recorded_shapes(replay: Replay, name: str) -> None:
    record = recorded(name)
    same_list(replay.send(query(record), record["request"]["accept"]), record)


@pytest.mark.parametrize("name", ["nodes-list-metadata", "namespaces-list-metadata"])
def test_metadata_lists_answer_in_the_recorded_shapes(replay: Replay, name: str) -> None:
    record = recorded(name)
    answer = replay.send(query(record), record["request"]["accept"])
    same_list(answer, record)
    assert answer.body is not None
    for item in answer.body["items"]:
        assert (item["kind"], item["apiVersion"]) == ("PartialObjectMetadata", "meta.k8s.io/v1")
        assert set(item) == {"kind", "apiVersion", "metadata"}  # no spec, no status


def test_second_page_continues_the_first(replay: Replay) -> None:
    first = replay.send("/api/v1/pods?limit=2")
    assert first.body is not None
    token = first.body["metadata"]["continue"]
    record = recorded("pods-list-page2")
    answer = replay.send(f"/api/v1/pods?limit=2&continue={token}")
    same_list(answer, record)
    assert answer.body is not None
    assert answer.body["metadata"]["resourceVersion"] == first.body["metadata"]["resourceVersion"]


def test_expired_continue_token_answers_410_with_a_fresh_token(replay: Replay) -> None:
    first = replay.send("/api/v1/pods?limit=2")
    assert first.body is not None
    replay.server.expire_history()
    record = recorded("pods-list-continue-expired")
    answer = replay.send(f"/api/v1/pods?limit=2&continue={first.body['metadata']['continue']}")
    same_headers(answer, record)
    assert answer.body is not None
    want = record["body"]
    assert {k: v for k, v in answer.body.items() if k != "metadata"} == {
        k: v for k, v in want.items() if k != "metadata"
    }
    assert set(answer.body["metadata"]) == {"continue"}


@pytest.mark.parametrize(
    ("name", "token"),
    [
        ("pod-get-notfound", "admin-token"),
        ("pods-list-unauthorized", "wrong-token"),
        ("pods-list-forbidden", "nobody-token"),
    ],
)
def test_status_bodies_are_the_recorded_ones(replay: Replay, name: str, token: str) -> None:
    record = recorded(name)
    answer = replay.send(query(record), record["request"]["accept"], token)
    same_headers(answer, record)
    assert answer.body == record["body"]


def test_get_answers_in_the_recorded_shape(replay: Replay) -> None:
    record = recorded("pod-get")
    answer = replay.send(query(record))
    same_headers(answer, record)
    assert answer.body is not None
    assert set(answer.body) == set(record["body"])
    assert answer.body["metadata"] == record["body"]["metadata"] | {
        "resourceVersion": answer.body["metadata"]["resourceVersion"]
    }


def make_recorded_history(replay: Replay) -> None:
    """The changes the recorded watch shows, made through the API as a kubelet and a
    user would make them."""
    pod = copy.deepcopy(
        next(
            e["event"]["object"]
            for e in recorded("pods-watch-bookmarks")["stream"]
            if e["event"]["type"] == "ADDED"
        )
    )
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
        pod["metadata"].pop(key)
    pod.pop("status")
    replay.write("POST", "/api/v1/namespaces/shop/pods", pod)
    status_path = "/api/v1/namespaces/shop/pods/web-5d2aa-q9z8m/status"
    replay.write("PATCH", status_path, {"status": {"phase": "Running"}})
    replay.write(
        "DELETE", "/api/v1/namespaces/shop/pods/web-5d2aa-x7k2p", {"gracePeriodSeconds": 30}
    )
    replay.write("DELETE", "/api/v1/namespaces/shop/pods/db-1", {"gracePeriodSeconds": 0})
    replay.write("PATCH", status_path, {"status": {"phase": "Failed"}})


def events(answer: Answer) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"].get("name", "")) for e in answer.lines]


def recorded_events(record: dict) -> list[tuple[str, str]]:
    return [
        (e["event"]["type"], e["event"]["object"]["metadata"].get("name", ""))
        for e in record["stream"]
    ]


@pytest.mark.parametrize(
    ("name", "selector"),
    [("pods-watch-bookmarks", ""), ("pods-watch-node-n2", "&fieldSelector=spec.nodeName%3Dn2")],
)
def test_watch_answers_the_recorded_events(replay: Replay, name: str, selector: str) -> None:
    record = recorded(name)
    listed = replay.send("/api/v1/pods")
    assert listed.body is not None
    rv = listed.body["metadata"]["resourceVersion"]
    bookmarks = "&allowWatchBookmarks=true" if "allowWatchBookmarks" in query(record) else ""
    watch = replay.open(
        f"/api/v1/pods?watch=1&resourceVersion={rv}{bookmarks}{selector}&timeoutSeconds=3"
    )
    make_recorded_history(replay)  # while the watch is open, as recorded
    answer = Answer(watch)
    same_headers(answer, record)
    got = events(answer)
    want = recorded_events(record)
    assert [e for e in got if e[0] != "BOOKMARK"] == [e for e in want if e[0] != "BOOKMARK"]
    for line, expected in zip(answer.lines, (e["event"] for e in record["stream"]), strict=False):
        if expected["type"] == "BOOKMARK":
            break
        assert (line["object"]["kind"], line["object"]["apiVersion"]) == ("Pod", "v1")
        assert set(line["object"]["metadata"]) == set(expected["object"]["metadata"])
    if bookmarks:
        marks = [e for e in answer.lines if e["type"] == "BOOKMARK"]
        assert marks, "bookmarks asked for, none sent"
        last = [e for e in answer.lines if e["type"] != "BOOKMARK"][-1]["object"]["metadata"]
        for mark in marks:
            assert mark["object"]["kind"] == "Pod"
            assert mark["object"]["metadata"] == {
                "resourceVersion": last["resourceVersion"],  # the last event's, as recorded
                "creationTimestamp": None,
            }


def test_watch_of_a_deleted_node(replay: Replay) -> None:
    record = recorded("nodes-watch")
    listed = replay.send("/api/v1/nodes")
    assert listed.body is not None
    replay.write("DELETE", "/api/v1/nodes/n3", {})
    rv = listed.body["metadata"]["resourceVersion"]
    answer = replay.send(f"/api/v1/nodes?watch=1&resourceVersion={rv}&timeoutSeconds=1")
    same_headers(answer, record)
    assert events(answer) == recorded_events(record)


def test_watch_from_an_expired_version_is_one_error_event(replay: Replay) -> None:
    record = recorded("pods-watch-expired")
    listed = replay.send("/api/v1/pods")
    assert listed.body is not None
    replay.server.expire_history()
    rv = listed.body["metadata"]["resourceVersion"]
    answer = replay.send(
        f"/api/v1/pods?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=5"
    )
    same_headers(answer, record)
    assert len(answer.lines) == 1
    got, want = answer.lines[0], record["stream"][0]["event"]
    assert got["type"] == want["type"] == "ERROR"
    status = {k: v for k, v in got["object"].items() if k != "message"}
    assert status == {k: v for k, v in want["object"].items() if k != "message"}
    assert got["object"]["message"].startswith("too old resource version: ")


# -- the parsers on the recorded objects -------------------------------------------------


# -- one scenario on both servers: where bookmarks come, how a watch ends ---------------


def watch_shape(
    kube: KubeApi,
    path: str,
    timeout: int,
    during: Callable[[], str] | None = None,
    selector: str = "",
) -> list[tuple[str, str]]:
    """Watch `path` from now, bookmarks asked for, `timeoutSeconds=timeout`; once the
    server answered, `during` makes an object (its path returned); read to the end. The
    events as (type, name); a BOOKMARK as ("BOOKMARK", the name of the object whose
    resourceVersion it carries, else "older"), one or two in a row alike (the real
    server's timer works in whole seconds). The watch must end cleanly (its last chunk
    sent, else ApiUnreachable), and not before its timeout."""
    query = {"fieldSelector": selector} if selector else {}
    rv = kube.client.request("GET", path, query)["metadata"]["resourceVersion"]
    query.update(resourceVersion=rv, allowWatchBookmarks="true", timeoutSeconds=str(timeout))
    opened = time.monotonic()
    stream = kube.client.watch(path, query, accept=JSON, read_timeout=60)
    made = kube.client.request("GET", during()) if during else None
    events = list(stream)
    assert time.monotonic() - opened >= timeout
    names = {
        e["object"]["metadata"]["resourceVersion"]: e["object"]["metadata"]["name"]
        for e in [*events, *([{"type": "", "object": made}] if made else [])]
        if e["type"] != "BOOKMARK"
    }
    shape: list[tuple[str, str]] = []
    for e in events:
        meta = e["object"]["metadata"]
        if e["type"] == "BOOKMARK":
            step = ("BOOKMARK", names.get(meta["resourceVersion"], "older"))
            if shape and shape[-1] == step:
                continue
        else:
            step = (e["type"], meta["name"])
        shape.append(step)
    return shape


def test_bookmarks_come_where_the_real_server_sends_them(kube: KubeApi) -> None:
    """Measured on kube-apiserver 1.26 (docs/architecture.md, "Kubernetes source"): no
    bookmark on a watch of a resource that did not change after the watch opened (a
    quiet resource); once it did, one or two before the end carrying the resource's last
    event's version, whatever the watch's selector; none on a watch of 2 s (the last is
    due 2 s before the end). Every watch ends cleanly at its timeout. The k8s:// source
    is tested on the test server: it must do the same."""
    ns, a, b, c = kube.name("marks"), kube.name("a"), kube.name("b"), kube.name("c")
    kube.admin.namespace(ns)
    kube.admin.node(a)  # the nodes changed before the watches: quiet for them

    def node(name: str) -> Callable[[], str]:
        return lambda: kube.admin.node(name) or f"/api/v1/nodes/{name}"

    def pod_elsewhere() -> str:
        kube.admin.pod(ns, "p", a)
        return f"/api/v1/namespaces/{ns}/pods/p"

    nodes = "/api/v1/nodes"
    assert watch_shape(kube, nodes, 3) == []
    assert watch_shape(kube, nodes, 4, node(b)) == [("ADDED", b), ("BOOKMARK", b)]
    assert watch_shape(kube, nodes, 2, node(c)) == [("ADDED", c)]
    nobody = f"spec.nodeName={kube.name('nobody')}"
    assert watch_shape(kube, "/api/v1/pods", 4, pod_elsewhere, nobody) == [("BOOKMARK", "p")]


def test_a_watch_from_before_a_restart_is_expired(kube_server: KubeApi) -> None:
    """Measured on the real server: restarted, it answers a watch from a resourceVersion
    older than its start with one ERROR 410 ("too old resource version"), not events."""
    kube_server.admin.node("n1")
    rv = kube_server.client.request("GET", "/api/v1/nodes")["metadata"]["resourceVersion"]
    kube_server.admin.node("n2")
    kube_server.server.go_down()
    kube_server.server.come_back()
    query = {"resourceVersion": rv, "timeoutSeconds": "5"}
    stream = kube_server.client.watch("/api/v1/nodes", query, accept=JSON, read_timeout=60)
    (event,) = list(stream)
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    assert event["object"]["message"].startswith("too old resource version")
