"""Candidate layouts of a store in the Kubernetes API, measured on a real kube-apiserver
1.26 (`ipward_lab.servers.kube_apiserver`, on a throwaway etcd 3.4) next to raw etcd in
the same run.

    .venv/bin/python -m ipward_lab.bench.kube_layouts [--quick] [--rounds N] [--json FILE]

Needs `KUBE_APISERVER` (shared/kube-apiserver/kube-apiserver). Prints figures, never
judges them (docs/measurements.md, "Kubernetes store: candidate layouts", has a run's).
A whole run takes about 20 minutes on the project's machine, `--quick` about 4.

What it measures, each measurement repeated in rounds (every round runs every cell
once, the cells of a part in reverse order in every other round, so two runs of a cell
are a round apart and drift is spread over both orders):

1. updates: W writers (1, 8, 32), each updating its own `LayoutProbe` with optimistic
   concurrency (PUT with the resourceVersion it last read or wrote; on 409 a GET and
   again), per content size (a small object of 5 records, a /26 block of 64, a node's
   ledger of 110 and of 250 pods) and encoding of `spec.data` (JSON text; zlib then
   base64): updates/s, latency, conflicts, and the CPU seconds per update of the API
   server, of etcd and of the clients (from /proc/PID/stat);
2. ADD shapes: L1 one object written per ADD (the node's ledger), L2 two in sequence (a
   block, then the ledger), by 1 writer, by 32 writers sharing the ledger and 4 blocks
   (each its own client, so they meet on the objects), and by 32 callers whose ADDs one
   combiner writes together, up to 24 an update;
3. reads: GET of one object; LIST (consistent, pages of 500; and from the watch cache)
   of 1,000 and 5,000 blocks in JSON and 5,000 in zlib; a label-selected LIST finding 1
   of 5,000; how long until an update reaches 1 and 10 watchers;
4. a tiny lease-like object (and a built-in Lease) updated by 1 and 32 writers;
5. the reference: raw etcd (the product's `EtcdStore`), a put compared on the key's
   mod_revision (a txn), of the same values by as many writers, each run right after
   the cell of the API it is compared with (the block and the 110-pod ledger in JSON,
   the tiny object);
and once: the stored size of each object (in etcd too), what `metadata.managedFields`
adds under PUT and under server-side apply, whether the server takes protobuf for a
custom resource, and the client's cost of encoding and decoding each content.

The writers and readers run in worker processes (spawned, several threads each, one
kept connection per thread) so that one Python process's GIL does not bound the load;
their CPU is reported beside the servers'. A measurement window starts when every
thread has read its objects; the updates completed inside it are counted. Each window
also reports the load the rest of the machine put on its cores meanwhile (the machine's
busy time less ours), as other work shares these cores.

Objects are updated with content that differs from what is stored (each writer has its
own variants), so no update is a no-op the API server would skip. etcd is compacted
after every writing cell, so its database does not grow through the run.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import functools
import json
import math
import multiprocessing
import os
import random
import ssl
import statistics
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from ipward.core.records import (
    AddressRecord,
    Attachment,
    AttachmentIndex,
    BlockRecord,
    PodInfo,
    pool_ip,
)
from ipward.kubeapi.client import JSON, ApiClient, ApiError, ApiUnreachable
from ipward.kubeapi.config import Connection
from ipward_lab.bench.common import BenchError, percentile
from ipward_lab.servers.etcd import run_etcdctl
from ipward_lab.servers.kube_apiserver import ADMIN_TOKEN, KubeLab, binary, kube_apiserver

GROUP = "ipward.io"
VERSION = "v1alpha1"
PLURAL = "layoutprobes"
KIND = "LayoutProbe"
CRD_NAME = f"{PLURAL}.{GROUP}"
LABEL = "probe-id"
WRITES_NS = "writes"
ADDS_NS = "adds"
WATCH_NS = "watch"
TINY_NS = "tiny"
REFS_NS = "refs"

WORKERS = 4
VARIANTS = 2  # per writer: content always differs from the last write
MAX_BATCH = 24  # the agent's combining bound
ADD_BLOCKS = 4  # the 32-way ADDs share one ledger and this many blocks
LIST_PAGE = 500
WATCH_INTERVAL = 0.05  # the watched object is updated 20 times a second
CLK_TCK = os.sysconf("SC_CLK_TCK")
LIST_TIMEOUT = 300.0
LIST_SECONDS = 3.0  # a LIST is repeated for this long (CPU ticks are 10 ms) ...
LIST_TIMES = 30  # ... or this many times
ENCODINGS = ("json", "zlib")
ETCD_SHAPES = ("block", "ledger110")  # measured on raw etcd too, beside the API cells

# The contents, by name: what an object holds and how many records.
#   small   a small object (a small pool, a block with a few records)
#   block   a /26: 64 address records, the block's record, a short free queue
#   ledger  a node's ledger: per pod its record, attachment index and node index entry,
#           and the node's free queue
SHAPES: dict[str, tuple[str, int, str]] = {
    "tiny": ("lease", 0, "a lease-like object (~100 B of data)"),
    "small": ("block", 5, "a small object: 5 records"),
    "block": ("block", 64, "a /26 block: 64 records"),
    "ledger110": ("ledger", 110, "a node's ledger: 110 pods"),
    "ledger250": ("ledger", 250, "a node's ledger: 250 pods"),
}
WRITE_SHAPES = ("small", "block", "ledger110", "ledger250")

NOW = 1_796_000_000.0  # a fixed clock: the contents are the same in every process
NAMESPACES = ("default", "team-payments", "search", "kube-system", "monitoring", "batch")
APPS = ("checkout-api", "frontend", "indexer", "worker", "redis", "prometheus", "fluentd")


# --- contents ---------------------------------------------------------------------------


def _record(rng: random.Random, node: str, block: str) -> AddressRecord:
    container = rng.randbytes(32).hex()
    pod = PodInfo(
        rng.choice(NAMESPACES),
        f"{rng.choice(APPS)}-{rng.randbytes(4).hex()[:7]}-{rng.randbytes(3).hex()[:5]}",
        str(uuid.UUID(bytes=rng.randbytes(16), version=4)),
    )
    at = NOW - rng.uniform(0, 86400)
    return AddressRecord.new(Attachment("ipward-net", container, "eth0"), pod, node, block, at, 1)


def _block_shard(rng: random.Random, records: int) -> dict:
    node = f"worker-{rng.randrange(1000):03d}"
    third = rng.randrange(256)
    cidr = f"10.42.{third}.0/26"
    shard: dict = {
        "pool": "default",
        "cidr": cidr,
        "block": BlockRecord.claimed(node, records, 1).to_dict(),
        "epoch": 7,
        "seq": 1,
        "records": {},
        "free": [
            {"ip": f"10.42.{third}.{records + i}", "freed_at": round(NOW - i * 13.7, 3)}
            for i in range(min(4, 64 - records))
        ],
    }
    for i in range(records):
        shard["records"][f"10.42.{third}.{i}"] = _record(rng, node, cidr).to_dict()
    return shard


def _ledger_shard(rng: random.Random, pods: int) -> dict:
    node = f"worker-{rng.randrange(1000):03d}"
    shard: dict = {
        "node": node,
        "epoch": 7,
        "seq": 1,
        "records": {},
        "attach": {},
        "nodeips": {},
        "free": [],
    }
    for i in range(pods):
        block_no = i // 64
        cidr = f"10.42.{block_no}.0/26"
        ref = pool_ip("default", f"10.42.{block_no}.{i % 64}")
        record = _record(rng, node, cidr)
        shard["records"][ref] = record.to_dict()
        shard["attach"][record.index_key] = json.loads(AttachmentIndex([ref]).encode())
        # The node index: what reconciliation judges an entry by, without the record.
        shard["nodeips"][ref] = {
            "uid": record.pod.uid,
            "block": cidr,
            "at": record.created_at,
        }
    for i in range(16):
        shard["free"].append(
            {"ip": pool_ip("default", f"10.42.9.{i}"), "freed_at": round(NOW - i * 9.1, 3)}
        )
    return shard


@functools.cache
def shard(shape: str) -> dict:
    """The content of a shape (the same in every process)."""
    kind, count, _ = SHAPES[shape]
    rng = random.Random(f"kube-layouts/{shape}")
    if kind == "block":
        return _block_shard(rng, count)
    if kind == "ledger":
        return _ledger_shard(rng, count)
    return {"holder": "worker-017", "epoch": 3, "ttl": 10, "renewed": NOW}


def encode(content: dict, encoding: str) -> str:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    if encoding == "json":
        return text
    return base64.b64encode(zlib.compress(text.encode(), 6)).decode()


def decode(data: str, encoding: str) -> dict:
    if encoding == "json":
        return dict(json.loads(data))
    return dict(json.loads(zlib.decompress(base64.b64decode(data))))


@functools.lru_cache(maxsize=128)
def payloads(shape: str, encoding: str, writer: str) -> tuple[str, ...]:
    """This writer's variants of the content: each differs from every other writer's and
    from its own previous one, so an update is never a no-op (a window's writers are
    named anew in each window: `Bench.window`)."""
    out = []
    for k in range(VARIANTS):
        content = dict(shard(shape))
        content["writer"] = writer
        content["seq"] = k
        out.append(encode(content, encoding))
    return tuple(out)


def probe_path(ns: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"
    return f"{base}/{name}" if name else base


def lease_path(ns: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    return f"{base}/{name}" if name else base


def _micro_time() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def body(path: str, data: str, rv: str = "") -> dict:
    """The whole object PUT (or POSTed) at `path` with `data`."""
    parts = path.split("/")
    ns, name = parts[5], parts[7]
    metadata: dict = {"name": name, "namespace": ns, "labels": {LABEL: name}}
    if rv:
        metadata["resourceVersion"] = rv
    if "/leases/" in path:
        spec = {"holderIdentity": name, "leaseDurationSeconds": 10, "renewTime": _micro_time()}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": {"data": data},
    }


# --- the worker processes ---------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    url: str
    ca_file: str
    token: str
    etcd: str  # host:port of the API server's etcd


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


class Worker:
    """One worker process: kept API clients (one per thread slot), an etcd client, and
    the loops the threads of a task run."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.clients: dict[int, ApiClient] = {}
        self.etcd: Any = None
        self.lock = threading.Lock()

    def client(self, slot: int) -> ApiClient:
        with self.lock:
            if slot not in self.clients:
                conn = Connection(
                    server=self.target.url, ca_file=self.target.ca_file, token=self.target.token
                )
                self.clients[slot] = ApiClient(conn, timeout=60.0)
            return self.clients[slot]

    def etcd_store(self) -> Any:
        with self.lock:
            if self.etcd is None:
                from ipward.store.etcd import EtcdStore  # grpc: only in the workers that use it

                self.etcd = EtcdStore.from_url(f"etcd://{self.target.etcd}?timeout=30")
            return self.etcd

    def run(self, task: dict) -> dict:
        start, end = task["start"], task["end"]
        outs: list[dict] = [{"ops": [], "conflicts": 0, "errors": []} for _ in task["threads"]]
        threads = [
            threading.Thread(target=self._thread, args=(spec, start, end, out), daemon=True)
            for spec, out in zip(task["threads"], outs, strict=True)
        ]
        for t in threads:
            t.start()
        _sleep_until(start)
        cpu0 = time.process_time()
        _sleep_until(end)
        cpu1 = time.process_time()
        for t in threads:
            t.join()
        return {"threads": outs, "cpu": cpu1 - cpu0}

    def _thread(self, spec: dict, start: float, end: float, out: dict) -> None:
        op: Callable[[dict, float, float, dict], None] = getattr(self, f"op_{spec['op']}")
        try:
            op(spec, start, end, out)
        except Exception as e:  # reported with the figures, never hidden
            out["errors"].append(f"{type(e).__name__}: {e}")

    # Updates through the API.

    def _update(
        self,
        client: ApiClient,
        path: str,
        data: str,
        rvs: dict,
        out: dict,
        start: float,
        end: float,
    ) -> None:
        """One optimistic update of `path`: PUT with the version last seen; on 409 GET
        and again. Other errors are counted and the update tried again."""
        while True:
            if path not in rvs:
                rvs[path] = client.request("GET", path)["metadata"]["resourceVersion"]
            try:
                answer = client.request("PUT", path, body=body(path, data, rvs[path]))
                rvs[path] = answer["metadata"]["resourceVersion"]
                return
            except (ApiError, ApiUnreachable) as e:
                del rvs[path]
                now = time.monotonic()
                if isinstance(e, ApiError) and e.status == 409:
                    if start <= now <= end:
                        out["conflicts"] += 1
                    continue
                out["errors"].append(f"PUT {e}")
                if now > end + 30:
                    raise
                time.sleep(0.05)

    def op_update(self, spec: dict, start: float, end: float, out: dict) -> None:
        """ADD-like operations: update each of `paths` in sequence, as one operation."""
        client = self.client(spec["slot"])
        paths: list[str] = spec["paths"]
        data = {
            p: payloads(s, spec["encoding"], spec["tag"])
            for p, s in zip(paths, spec["shapes"], strict=True)
        }
        rvs: dict[str, str] = {}
        for p in paths:
            rvs[p] = client.request("GET", p)["metadata"]["resourceVersion"]
        out["late"] = time.monotonic() > start
        _sleep_until(start)
        n = 0
        while time.monotonic() < end:
            t0 = time.monotonic()
            for p in paths:
                self._update(client, p, data[p][n % VARIANTS], rvs, out, start, end)
            n += 1
            t1 = time.monotonic()
            out["ops"].append((t1, t1 - t0))

    def op_combined(self, spec: dict, start: float, end: float, out: dict) -> None:
        """`callers` threads each ask for an ADD and wait for it; this thread writes the
        ADDs waiting (up to MAX_BATCH) in one update of each of `paths`, in sequence."""
        client = self.client(spec["slot"])
        paths: list[str] = spec["paths"]
        data = {
            p: payloads(s, spec["encoding"], spec["tag"])
            for p, s in zip(paths, spec["shapes"], strict=True)
        }
        rvs: dict[str, str] = {}
        for p in paths:
            rvs[p] = client.request("GET", p)["metadata"]["resourceVersion"]
        pending: collections.deque[tuple[float, threading.Event]] = collections.deque()
        cond = threading.Condition()

        def caller() -> None:
            _sleep_until(start)
            while time.monotonic() < end:
                done = threading.Event()
                with cond:
                    pending.append((time.monotonic(), done))
                    cond.notify()
                done.wait()

        callers = [threading.Thread(target=caller, daemon=True) for _ in range(spec["callers"])]
        for c in callers:
            c.start()
        out["late"] = time.monotonic() > start
        out["batches"] = []
        n = 0
        while True:
            with cond:
                while not pending and time.monotonic() < end:
                    cond.wait(0.05)
                if not pending:
                    break
                batch = [pending.popleft() for _ in range(min(MAX_BATCH, len(pending)))]
            for p in paths:
                self._update(client, p, data[p][n % VARIANTS], rvs, out, start, end)
            n += 1
            t1 = time.monotonic()
            for t0, done in batch:
                out["ops"].append((t1, t1 - t0))
                done.set()
            out["batches"].append((t1, len(batch)))
        for c in callers:
            c.join()

    def op_get(self, spec: dict, start: float, end: float, out: dict) -> None:
        client = self.client(spec["slot"])
        client.request("GET", spec["path"])
        out["late"] = time.monotonic() > start
        _sleep_until(start)
        while time.monotonic() < end:
            t0 = time.monotonic()
            client.request("GET", spec["path"])
            t1 = time.monotonic()
            out["ops"].append((t1, t1 - t0))

    def op_create(self, spec: dict, start: float, end: float, out: dict) -> None:
        client = self.client(spec["slot"])
        for name in spec["names"]:
            path = spec["collection"]
            data = payloads(spec["shape"], spec["encoding"], name)[0]
            try:
                client.request("POST", path, body=body(f"{path}/{name}", data))
            except ApiError as e:
                if e.status != 409:  # already there (a create retried)
                    raise
            out["ops"].append((time.monotonic(), 0.0))

    def op_watch(self, spec: dict, start: float, end: float, out: dict) -> None:
        """Watch one object from `rv`; note when each of its versions arrives."""
        client = self.client(spec["slot"])
        query = {
            "resourceVersion": spec["rv"],
            "fieldSelector": f"metadata.name={spec['name']}",
            "timeoutSeconds": str(math.ceil(end - time.monotonic()) + 2),
        }
        stream = client.watch(
            spec["collection"], query, accept=JSON, read_timeout=end - time.monotonic() + 30
        )
        out["late"] = time.monotonic() > start
        out["seen"] = []
        try:
            for event in stream:
                t = time.monotonic()
                if event.get("type") == "MODIFIED":
                    out["seen"].append((event["object"]["metadata"]["resourceVersion"], t))
                elif event.get("type") == "ERROR":
                    out["errors"].append(f"watch: {event.get('object', {}).get('message')}")
                if t > end + 2:
                    break
        except ApiUnreachable as e:
            out["errors"].append(f"watch: {e}")
        finally:
            stream.close()

    def op_paced(self, spec: dict, start: float, end: float, out: dict) -> None:
        """Update one object every `interval` seconds (its watchers time the updates)."""
        client = self.client(spec["slot"])
        path = spec["path"]
        variants = payloads(spec["shape"], spec["encoding"], spec["tag"])
        rv = client.request("GET", path)["metadata"]["resourceVersion"]
        out["late"] = time.monotonic() > start
        out["writes"] = []
        n = 0
        while True:
            at = start + n * spec["interval"]
            if at > end - 1.0:  # the last ones get a second to arrive
                break
            _sleep_until(at)
            t0 = time.monotonic()
            answer = client.request("PUT", path, body=body(path, variants[n % VARIANTS], rv))
            t1 = time.monotonic()
            rv = answer["metadata"]["resourceVersion"]
            out["writes"].append((rv, t0, t1))
            n += 1

    def op_etcd(self, spec: dict, start: float, end: float, out: dict) -> None:
        """The reference: get, then put compared on the mod_revision read (a txn); on a
        failed compare, get again."""
        from ipward.store.base import Put, at_revision

        store = self.etcd_store()
        key = spec["key"]
        variants = [v.encode() for v in payloads(spec["shape"], spec["encoding"], spec["tag"])]
        kv = store.get(key)
        rev = kv.mod_revision if kv else 0
        out["late"] = time.monotonic() > start
        _sleep_until(start)
        n = 0
        while time.monotonic() < end:
            t0 = time.monotonic()
            while True:
                result = store.txn([at_revision(key, rev)], [Put(key, variants[n % VARIANTS])])
                if result.succeeded:
                    rev = result.revision
                    break
                if start <= time.monotonic() <= end:
                    out["conflicts"] += 1
                kv = store.get(key)
                rev = kv.mod_revision if kv else 0
            n += 1
            t1 = time.monotonic()
            out["ops"].append((t1, t1 - t0))


def worker_main(pipe: Pipe, target: Target) -> None:
    """A worker process: runs each task it is sent, answers with its outcome."""
    worker = Worker(target)
    while True:
        task = pipe.recv()
        if task is None:
            break
        try:
            pipe.send(worker.run(task))
        except Exception as e:
            pipe.send({"error": f"{type(e).__name__}: {e}"})
    for client in worker.clients.values():
        client.close()
    if worker.etcd is not None:
        worker.etcd.close()


# --- the coordinator --------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _compact_size(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def find_etcd_pid(endpoint: str) -> int:
    """The etcd serving `host:port` (the API server's), from /proc."""
    wanted = f"--listen-client-urls=http://{endpoint}"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"etcd") and wanted.encode() in argv:
            return int(entry)
    raise BenchError(f"no etcd process serving {endpoint}")


@dataclass
class Sample:
    at: float
    api: float
    etcd: float
    busy: float


@dataclass
class Figures:
    """One run of one cell."""

    ops: int = 0
    seconds: float = 0.0
    p50: float = 0.0  # ms
    p99: float = 0.0
    conflicts: int = 0
    errors: list[str] = field(default_factory=list)
    api_cpu: float = 0.0  # seconds in the window
    etcd_cpu: float = 0.0
    client_cpu: float = 0.0
    others: float = 0.0  # cores the rest of the machine used
    load: float = 0.0
    late: int = 0  # threads not ready at the window's start
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def per_op(self, cpu: float) -> float:
        """ms of CPU per operation."""
        return cpu * 1000 / self.ops if self.ops else 0.0


class Raw:
    """Plain HTTPS requests, for what the product's client does not show: bytes on the
    wire, content types other than JSON."""

    def __init__(self, lab: KubeLab) -> None:
        context = ssl.create_default_context(cafile=str(lab.ca_file))
        self.pool = urllib3.connection_from_url(lab.url, ssl_context=context, maxsize=2)

    def call(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        *,
        data: bytes | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> tuple[int, str, bytes]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Accept": accept}
        if data is not None:
            headers["Content-Type"] = content_type
        url = f"{path}?{urlencode(query)}" if query else path
        answer = self.pool.urlopen(
            method,
            url,
            body=data,
            headers=headers,
            retries=False,
            timeout=urllib3.Timeout(connect=10, read=LIST_TIMEOUT),
        )
        return answer.status, answer.headers.get("Content-Type", ""), answer.data

    def json(self, method: str, path: str, obj: dict | None = None, **kw: Any) -> dict:
        status, _, raw = self.call(
            method, path, data=None if obj is None else json.dumps(obj).encode(), **kw
        )
        if status >= 300:
            raise BenchError(f"{method} {path}: HTTP {status}: {raw[:300]!r}")
        return dict(json.loads(raw))


class Bench:
    def __init__(
        self,
        lab: KubeLab,
        etcd: str,
        quick: bool,
        rounds: int,
        duration: float,
        out: Callable[[str], object],
    ) -> None:
        self.lab = lab
        self.etcd = etcd
        self.etcd_pid = find_etcd_pid(etcd)
        assert lab.proc is not None
        self.api_pid = lab.proc.pid
        self.quick = quick
        self.rounds = rounds
        self.duration = duration
        self.out = out
        self.raw = Raw(lab)
        self.pipes: list[Pipe] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.results: dict[str, dict[str, list[Figures]]] = collections.defaultdict(
            lambda: collections.defaultdict(list)
        )
        self.facts: dict[str, Any] = {}
        self.windows = 0

    # Workers.

    @contextlib.contextmanager
    def workers(self, count: int) -> Iterator[None]:
        ctx = multiprocessing.get_context("spawn")
        target = Target(self.lab.url, str(self.lab.ca_file), ADMIN_TOKEN, self.etcd)
        try:
            for _ in range(count):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(theirs, target), daemon=True)
                proc.start()
                self.pipes.append(mine)
                self.procs.append(proc)
            yield
        finally:
            for pipe in self.pipes:
                with contextlib.suppress(OSError):
                    pipe.send(None)
            for worker in self.procs:
                worker.join(10)
                if worker.is_alive():
                    worker.terminate()
                    worker.join(5)

    def sample(self) -> Sample:
        return Sample(
            time.monotonic(), proc_cpu(self.api_pid), proc_cpu(self.etcd_pid), machine_busy()
        )

    def window(
        self, threads: list[dict], duration: float, lead: float = 2.0, wait: float = LIST_TIMEOUT
    ) -> tuple[Figures, list[dict], float, float]:
        """Run `threads` (specs, spread over the workers) for `duration` seconds after
        `lead`; the figures, each thread's outcome, the window's start and end."""
        start = time.monotonic() + lead
        end = start + duration
        groups: list[list[dict]] = [[] for _ in self.pipes]
        self.windows += 1
        for i, spec in enumerate(threads):
            slot_spec = dict(spec)
            slot_spec.setdefault("slot", i // len(self.pipes))
            if "tag" in slot_spec:  # content no earlier window wrote
                slot_spec["tag"] = f"{slot_spec['tag']}/{self.windows}"
            groups[i % len(self.pipes)].append(slot_spec)
        busy_pipes = []
        for pipe, group in zip(self.pipes, groups, strict=True):
            if group:
                pipe.send({"threads": group, "start": start, "end": end})
                busy_pipes.append(pipe)
        _sleep_until(start)
        s0 = self.sample()
        _sleep_until(end)
        s1 = self.sample()
        load = load1()
        outcomes: list[dict] = []
        client_cpu = 0.0
        for pipe in busy_pipes:
            if not pipe.poll(wait + duration * 4):
                raise BenchError("a worker did not answer")
            answer = pipe.recv()
            if "error" in answer:
                raise BenchError(f"worker: {answer['error']}")
            outcomes.extend(answer["threads"])
            client_cpu += answer["cpu"]
        latencies = [lat for o in outcomes for t, lat in o["ops"] if start <= t <= end]
        ours = (s1.api - s0.api) + (s1.etcd - s0.etcd) + client_cpu
        figures = Figures(
            ops=len(latencies),
            seconds=s1.at - s0.at,
            p50=percentile(latencies, 50) * 1000 if latencies else 0.0,
            p99=percentile(latencies, 99) * 1000 if latencies else 0.0,
            conflicts=sum(o["conflicts"] for o in outcomes),
            errors=[e for o in outcomes for e in o["errors"]],
            api_cpu=s1.api - s0.api,
            etcd_cpu=s1.etcd - s0.etcd,
            client_cpu=client_cpu,
            others=max(0.0, (s1.busy - s0.busy - ours) / (s1.at - s0.at)),
            load=load,
            late=sum(1 for o in outcomes if o.get("late")),
        )
        return figures, outcomes, start, end

    def keep(self, part: str, cell: str, figures: Figures) -> None:
        self.results[part][cell].append(figures)
        extra = " ".join(f"{k}={v:.1f}" for k, v in figures.extra.items())
        self.out(
            f"  {part:8} {cell:34} {figures.rate:8.1f}/s"
            f" p50 {figures.p50:7.1f} p99 {figures.p99:7.1f} ms"
            f"  conflicts {figures.conflicts:5}  api {figures.per_op(figures.api_cpu):5.2f}"
            f" etcd {figures.per_op(figures.etcd_cpu):5.2f}"
            f" client {figures.per_op(figures.client_cpu):5.2f} ms/op"
            f"  others {figures.others:4.2f} load {figures.load:5.2f} {extra}"
            + (f"  ERRORS {len(figures.errors)}: {figures.errors[:2]}" if figures.errors else "")
            + (f"  late {figures.late}" if figures.late else "")
        )

    def compact(self) -> None:
        """Compact etcd to its current revision (waiting for it): its database does not
        grow with the history of the run's updates."""
        status = json.loads(run_etcdctl([self.etcd], "endpoint", "status", "-w", "json"))
        revision = status[0]["Status"]["header"]["revision"]
        run_etcdctl([self.etcd], "compact", str(revision), "--physical")

    # Setup.

    def setup(self) -> None:
        self.raw.json(
            "POST",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": CRD_NAME},
                "spec": {
                    "group": GROUP,
                    "scope": "Namespaced",
                    "names": {
                        "plural": PLURAL,
                        "singular": "layoutprobe",
                        "kind": KIND,
                        "listKind": f"{KIND}List",
                    },
                    "versions": [
                        {
                            "name": VERSION,
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "spec": {
                                            "type": "object",
                                            "properties": {"data": {"type": "string"}},
                                        }
                                    },
                                }
                            },
                        }
                    ],
                },
            },
        )
        deadline = time.monotonic() + 60
        while True:
            status, _, _ = self.raw.call("GET", probe_path("default"))
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the CRD's resource is not served (HTTP {status})")
            time.sleep(0.2)
        for ns in (WRITES_NS, ADDS_NS, WATCH_NS, TINY_NS, REFS_NS, *self.list_sets()):
            self.raw.json(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
        writers = max(self.writer_counts())
        for shape in WRITE_SHAPES:
            for encoding in ENCODINGS:
                self.create(
                    WRITES_NS,
                    [f"w-{shape}-{encoding}-{i}" for i in range(writers)],
                    shape,
                    encoding,
                )
        for encoding in ENCODINGS:
            self.create(ADDS_NS, [f"node-{encoding}"], "ledger110", encoding)
            self.create(
                ADDS_NS, [f"block-{encoding}-{i}" for i in range(ADD_BLOCKS)], "block", encoding
            )
        self.create(WATCH_NS, ["watched"], "block", "json")
        self.create(TINY_NS, [f"t-{i}" for i in range(writers)], "tiny", "json")
        for i in range(writers):
            self.raw.json(
                "POST", lease_path(TINY_NS), body(lease_path(TINY_NS, f"l-{i}"), "holder")
            )
        for ns, (count, shape, encoding) in self.list_sets().items():
            self.out(f"  creating {count} objects of {shape} ({encoding}) in {ns}")
            self.create(ns, [f"o-{i:05d}" for i in range(count)], shape, encoding)
        self.compact()

    def create(self, ns: str, names: list[str], shape: str, encoding: str) -> None:
        threads = min(8, len(names))
        specs = [
            {
                "op": "create",
                "collection": probe_path(ns),
                "names": names[i::threads],
                "shape": shape,
                "encoding": encoding,
            }
            for i in range(threads)
        ]
        figures, _, _, _ = self.window(specs, 0.0, lead=0.2, wait=1800.0)
        if figures.errors:
            raise BenchError(f"creating objects in {ns}: {figures.errors[:3]}")

    def writer_counts(self) -> tuple[int, ...]:
        return (1, 8, 32)

    def list_sets(self) -> dict[str, tuple[int, str, str]]:
        small, large = (200, 1000) if self.quick else (1000, 5000)
        return {
            f"list-{small}": (small, "block", "json"),
            f"list-{large}": (large, "block", "json"),
            f"list-{large}-zlib": (large, "block", "zlib"),
        }

    # The parts.

    def part_updates(self, order: int) -> None:
        """Each API cell; after a JSON one of a shape in ETCD_SHAPES, the same shape and
        writers on raw etcd, so each ratio compares neighbours in time."""
        cells = [(s, e, w) for s in WRITE_SHAPES for e in ENCODINGS for w in self.writer_counts()]
        if self.quick:
            cells = [c for c in cells if c[0] in ("small", "ledger110")]
        for shape, encoding, writers in cells[::order]:
            specs = [
                {
                    "op": "update",
                    "paths": [probe_path(WRITES_NS, f"w-{shape}-{encoding}-{i}")],
                    "shapes": [shape],
                    "encoding": encoding,
                    "tag": f"w{i}",
                }
                for i in range(writers)
            ]
            figures, _, _, _ = self.window(specs, self.duration)
            self.keep("updates", f"{shape} {encoding} {writers}", figures)
            self.compact()
            if encoding == "json" and shape in ETCD_SHAPES:
                self.etcd_cell(shape, writers)

    def etcd_cell(self, shape: str, writers: int) -> None:
        specs = [
            {
                "op": "etcd",
                "key": f"/bench/layouts/{shape}/{i}",
                "shape": shape,
                "encoding": "json",
                "tag": f"e{i}",
            }
            for i in range(writers)
        ]
        figures, _, _, _ = self.window(specs, self.duration)
        self.keep("etcd", f"{shape} json {writers}", figures)
        self.compact()

    def part_tiny(self, order: int) -> None:
        cells = [(kind, w) for w in (1, 32) for kind in ("cr", "lease", "etcd")]
        for kind, writers in cells[::order]:
            if kind == "etcd":
                self.etcd_cell("tiny", writers)
                continue
            specs = [
                {
                    "op": "update",
                    "paths": [
                        probe_path(TINY_NS, f"t-{i}")
                        if kind == "cr"
                        else lease_path(TINY_NS, f"l-{i}")
                    ],
                    "shapes": ["tiny"],
                    "encoding": "json",
                    "tag": f"t{i}",
                }
                for i in range(writers)
            ]
            figures, _, _, _ = self.window(specs, self.duration)
            self.keep("tiny", f"{kind} {writers}", figures)
            self.compact()

    def part_adds(self, order: int) -> None:
        cells = [
            (layout, mode, e)
            for layout in ("L1", "L2")
            for mode in ("1", "32", "32 combined")
            for e in ENCODINGS
        ]
        for layout, mode, encoding in cells[::order]:
            node = probe_path(ADDS_NS, f"node-{encoding}")

            def objects(
                i: int, layout: str = layout, node: str = node, encoding: str = encoding
            ) -> tuple[list[str], list[str]]:
                if layout == "L1":
                    return [node], ["ledger110"]
                block = probe_path(ADDS_NS, f"block-{encoding}-{i % ADD_BLOCKS}")
                return [block, node], ["block", "ledger110"]

            specs: list[dict[str, Any]]
            if mode == "32 combined":
                paths, shapes = objects(0)
                specs = [
                    {
                        "op": "combined",
                        "paths": paths,
                        "shapes": shapes,
                        "encoding": encoding,
                        "tag": "c",
                        "callers": 32,
                    }
                ]
            else:
                specs = []
                for i in range(int(mode)):
                    paths, shapes = objects(i)
                    specs.append(
                        {
                            "op": "update",
                            "paths": paths,
                            "shapes": shapes,
                            "encoding": encoding,
                            "tag": f"a{i}",
                        }
                    )
            figures, outcomes, start, end = self.window(specs, self.duration)
            batches = [n for o in outcomes for t, n in o.get("batches", []) if start <= t <= end]
            updates = (
                len(batches) * len(specs[0]["paths"])
                if batches
                else figures.ops * len(specs[0]["paths"])
            )
            figures.extra["updates/s"] = updates / figures.seconds
            if batches:
                figures.extra["batch"] = statistics.mean(batches)
            self.keep("adds", f"{layout} {encoding} {mode}", figures)
            self.compact()

    def part_gets(self, order: int) -> None:
        cells = [(s, e) for s in ("block", "ledger110") for e in ENCODINGS]
        for shape, encoding in cells[::order]:
            spec = {"op": "get", "path": probe_path(WRITES_NS, f"w-{shape}-{encoding}-0")}
            figures, _, _, _ = self.window([spec], self.duration)
            self.keep("gets", f"{shape} {encoding}", figures)

    def part_lists(self, order: int) -> None:
        cells = []
        for ns, (count, _, _) in self.list_sets().items():
            cells.append((ns, "consistent", {"limit": str(LIST_PAGE)}))
            cells.append((ns, "cache", {"resourceVersion": "0"}))
            if count == max(c for c, _, _ in self.list_sets().values()):
                target = f"o-{count // 2:05d}"
                cells.append(
                    (
                        ns,
                        "1 by label, consistent",
                        {"limit": str(LIST_PAGE), "labelSelector": f"{LABEL}={target}"},
                    )
                )
                cells.append(
                    (
                        ns,
                        "1 by label, cache",
                        {"resourceVersion": "0", "labelSelector": f"{LABEL}={target}"},
                    )
                )
        for ns, how, query in cells[::order]:
            figures = self.list_once(probe_path(ns), query)
            self.keep("lists", f"{ns} {how}", figures)

    def list_once(self, path: str, query: dict[str, str]) -> Figures:
        """LIST (all pages) again and again, for LIST_SECONDS at least (and at most
        LIST_TIMES times): each LIST's seconds, and the CPU per LIST over all of them."""
        s0 = self.sample()
        c0 = time.process_time()
        times: list[float] = []
        items = pages = size = 0
        while not times or (sum(times) < LIST_SECONDS and len(times) < LIST_TIMES):
            t0 = time.monotonic()
            items = pages = size = 0
            page_query = dict(query)
            while True:
                status, _, raw = self.raw.call("GET", path, page_query)
                if status != 200:
                    raise BenchError(f"LIST {path} {page_query}: HTTP {status}: {raw[:200]!r}")
                answer = json.loads(raw)
                items += len(answer["items"])
                pages += 1
                size += len(raw)
                token = answer["metadata"].get("continue")
                if not token:
                    break
                page_query = {**query, "continue": token}
            times.append(time.monotonic() - t0)
        s1 = self.sample()
        client = time.process_time() - c0
        seconds = s1.at - s0.at
        ours = (s1.api - s0.api) + (s1.etcd - s0.etcd) + client
        figures = Figures(
            ops=len(times),
            seconds=seconds,
            p50=statistics.median(times) * 1000,
            p99=max(times) * 1000,
            api_cpu=s1.api - s0.api,
            etcd_cpu=s1.etcd - s0.etcd,
            client_cpu=client,
            others=max(0.0, (s1.busy - s0.busy - ours) / seconds),
            load=load1(),
        )
        figures.extra = {"items": items, "pages": pages, "MB": size / 1e6}
        return figures

    def part_watches(self, order: int) -> None:
        for watchers in (1, 10)[::order]:
            path = probe_path(WATCH_NS, "watched")
            # The collection's version now (a consistent LIST's): never older than what
            # the watch cache holds, as the object's own version may be.
            listed = self.raw.json("GET", probe_path(WATCH_NS))
            rv = listed["metadata"]["resourceVersion"]
            specs = [
                {
                    "op": "paced",
                    "path": path,
                    "shape": "block",
                    "encoding": "json",
                    "tag": "p",
                    "interval": WATCH_INTERVAL,
                }
            ]
            specs += [
                {"op": "watch", "collection": probe_path(WATCH_NS), "name": "watched", "rv": rv}
                for _ in range(watchers)
            ]
            # Spread: the writer alone in worker 0's first slot, the watchers after it.
            figures, outcomes, _, _ = self.window(specs, self.duration, lead=3.0)
            writes = {rv: (t0, t1) for o in outcomes for rv, t0, t1 in o.get("writes", [])}
            from_ack, from_send, missing = [], [], 0
            for o in outcomes:
                if "seen" not in o:
                    continue
                seen = dict(o["seen"])
                for n, (rv_written, (t0, t1)) in enumerate(writes.items()):
                    if rv_written not in seen:
                        missing += 1
                        figures.errors.append(f"update {n + 1} of {len(writes)} not seen")
                        continue
                    from_ack.append(seen[rv_written] - t1)
                    from_send.append(seen[rv_written] - t0)
            figures.ops = len(from_send)
            if from_send:
                figures.p50 = percentile(from_send, 50) * 1000
                figures.p99 = percentile(from_send, 99) * 1000
                figures.extra = {
                    "updates": len(writes),
                    "from_answer_p50": percentile(from_ack, 50) * 1000,
                    "from_answer_p99": percentile(from_ack, 99) * 1000,
                    "missing": missing,
                }
            self.keep("watches", f"{watchers} watcher{'s' if watchers > 1 else ''}", figures)

    # Once.

    def facts_once(self) -> None:
        """Stored sizes, managedFields, protobuf, the client's encoding cost."""
        from ipward.store.etcd import EtcdStore

        sizes = {}
        store = EtcdStore.from_url(f"etcd://{self.etcd}")
        try:
            for shape in (*WRITE_SHAPES, "tiny"):
                for encoding in ENCODINGS if shape != "tiny" else ("json",):
                    ns, name = (
                        (TINY_NS, "t-0")
                        if shape == "tiny"
                        else (WRITES_NS, f"w-{shape}-{encoding}-0")
                    )
                    _, _, raw = self.raw.call("GET", probe_path(ns, name))
                    kv = store.get(f"/registry/{GROUP}/{PLURAL}/{ns}/{name}")
                    sizes[f"{shape} {encoding}"] = {
                        "data": len(payloads(shape, encoding, "w0")[0]),
                        "object": len(raw),
                        "etcd": len(kv.value) if kv else 0,
                        "managed_fields": _compact_size(
                            json.loads(raw)["metadata"].get("managedFields", [])
                        ),
                    }
            _, _, raw = self.raw.call("GET", lease_path(TINY_NS, "l-0"))
            kv = store.get(f"/registry/leases/{TINY_NS}/l-0")
            sizes["lease (built-in)"] = {
                "data": 0,
                "object": len(raw),
                "etcd": len(kv.value) if kv else 0,
                "managed_fields": _compact_size(
                    json.loads(raw)["metadata"].get("managedFields", [])
                ),
            }
        finally:
            store.close()
        self.facts["sizes"] = sizes
        self.facts["managed_fields"] = self.managed_fields()
        self.facts["protobuf"] = self.protobuf()
        self.facts["codec"] = self.codec()

    def managed_fields(self) -> dict[str, dict[str, int]]:
        """The same block object written by PUT and by server-side apply."""
        out = {}
        data = payloads("block", "json", "mf")[0]
        for how in ("PUT", "apply"):
            path = probe_path(REFS_NS, f"mf-{how.lower()}")
            obj = body(path, data)
            if how == "PUT":
                self.raw.json("POST", probe_path(REFS_NS), obj)
                current = self.raw.json("GET", path)
                obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                obj["spec"]["data"] = payloads("block", "json", "mf")[1]
                self.raw.json("PUT", path, obj)
            else:
                for variant in payloads("block", "json", "mf"):
                    obj["spec"]["data"] = variant
                    status, _, raw = self.raw.call(
                        "PATCH",
                        path,
                        {"fieldManager": "ipward", "force": "true"},
                        data=json.dumps(obj).encode(),
                        content_type="application/apply-patch+yaml",
                    )
                    if status >= 300:
                        raise BenchError(f"apply: HTTP {status}: {raw[:200]!r}")
            _, _, raw = self.raw.call("GET", path)
            managed = json.loads(raw)["metadata"].get("managedFields", [])
            out[how] = {
                "object": len(raw),
                "managed_fields": _compact_size(managed),
                "entries": len(managed),
            }
        return out

    def protobuf(self) -> dict[str, str]:
        """What the server answers to protobuf, each request on a new connection."""
        pb = "application/vnd.kubernetes.protobuf"
        path = probe_path(WRITES_NS, "w-block-json-0")
        # A PUT of protobuf: the magic prefix and an Unknown of the object's JSON.
        current = self.raw.json("GET", path)
        envelope = json.dumps(current).encode()
        data = b"k8s\x00" + b"\x12" + _varint(len(envelope)) + envelope
        requests: list[tuple[str, str, str, str, bytes | None]] = [
            ("GET custom resource, Accept protobuf", "GET", path, pb, None),
            ("GET custom resource, Accept protobuf, json", "GET", path, f"{pb}, {JSON}", None),
            ("PUT custom resource, Content-Type protobuf", "PUT", path, JSON, data),
            ("GET Lease (built-in), Accept protobuf", "GET", lease_path(TINY_NS, "l-0"), pb, None),
        ]
        out = {}
        for name, method, url, accept, body_bytes in requests:
            raw_client = Raw(self.lab)
            try:
                status, ctype, raw = raw_client.call(
                    method, url, data=body_bytes, content_type=pb, accept=accept
                )
            except urllib3.exceptions.HTTPError as e:
                out[name] = f"no answer: {e}"
                continue
            finally:
                raw_client.pool.close()
            message = ""
            if raw.startswith(b"{") and status >= 300:
                message = str(json.loads(raw).get("message", ""))[:120]
            out[name] = f"HTTP {status} {ctype} {len(raw):,} B {message}".strip()
        panics = self.lab.log_path.read_text(errors="replace").count("Observed a panic")
        out["panics in the API server's log"] = str(panics)
        return out

    def codec(self) -> dict[str, dict[str, float]]:
        """The client's CPU per content: encode (to the string) and decode, median ms."""
        out = {}
        for shape in WRITE_SHAPES:
            content = shard(shape)
            for encoding in ENCODINGS:
                data = encode(content, encoding)
                enc, dec = [], []
                for _ in range(15 if self.quick else 40):
                    t0 = time.process_time()
                    encode(content, encoding)
                    t1 = time.process_time()
                    decode(data, encoding)
                    t2 = time.process_time()
                    enc.append(t1 - t0)
                    dec.append(t2 - t1)
                out[f"{shape} {encoding}"] = {
                    "encode_ms": statistics.median(enc) * 1000,
                    "decode_ms": statistics.median(dec) * 1000,
                    "bytes": len(data),
                }
        return out

    def run(self) -> None:
        self.out(f"setting up (load {load1():.2f})")
        self.setup()
        parts = [
            self.part_updates,
            self.part_tiny,
            self.part_adds,
            self.part_gets,
            self.part_lists,
            self.part_watches,
        ]
        for round_no in range(1, self.rounds + 1):
            self.out(f"round {round_no} (load {load1():.2f})")
            order = 1 if round_no % 2 else -1
            for part in parts:
                part(order)
        self.facts_once()


# --- reporting --------------------------------------------------------------------------


def _both(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def tables(bench: Bench) -> list[str]:
    r = bench.results
    lines: list[str] = []

    blocks: list[tuple[str, list[str]]] = []

    def table(title: str, header: list[str], rows: list[list[str]], figures: bool = True) -> None:
        block = ["", f"### {title}", "", "| " + " | ".join(header) + " |"]
        align = "---:" if figures else "---"  # figures right-aligned, text not
        block.append("| " + " | ".join(["---"] + [align] * (len(header) - 1)) + " |")
        block.extend("| " + " | ".join(row) + " |" for row in rows)
        # The numbered tables in their measurement's order, then the rest as made.
        blocks.append((title.split(".")[0] if title[0].isdigit() else "9", block))

    sizes = bench.facts.get("sizes", {})
    etcd_rate = {cell: statistics.mean(f.rate for f in runs) for cell, runs in r["etcd"].items()}

    rows = []
    for cell, runs in r["updates"].items():
        shape, encoding, writers = cell.split()
        ref = etcd_rate.get(f"{shape} json {writers}")
        rows.append(
            [
                f"{SHAPES[shape][2]}, {encoding}",
                f"{sizes.get(f'{shape} {encoding}', {}).get('object', 0):,}",
                writers,
                _both([f.rate for f in runs]),
                _both([f.p50 for f in runs], "{:.1f}"),
                _both([f.p99 for f in runs], "{:.0f}"),
                _both([f.per_op(f.api_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.etcd_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.client_cpu) for f in runs], "{:.2f}"),
                _both([f.client_cpu / f.seconds for f in runs], "{:.2f}"),
                _both([f.others for f in runs], "{:.2f}"),
                _both([f.rate / ref for f in runs], "{:.2f}") if ref else "",
            ]
        )
    table(
        "1. Updates: each writer its own object (round 1 / round 2)",
        [
            "content, encoding",
            "object bytes",
            "writers",
            "updates/s",
            "p50 ms",
            "p99 ms",
            "API server CPU ms/update",
            "etcd CPU ms/update",
            "client CPU ms/update",
            "client cores",
            "others' cores",
            "/ raw etcd, same content",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["etcd"].items():
        shape, _, writers = cell.split()
        rows.append(
            [
                f"raw etcd txn, {SHAPES[shape][2]}",
                f"{len(payloads(shape, 'json', 'e0')[0]):,}",
                writers,
                _both([f.rate for f in runs]),
                _both([f.p50 for f in runs], "{:.1f}"),
                _both([f.p99 for f in runs], "{:.0f}"),
                _both([f.per_op(f.etcd_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.client_cpu) for f in runs], "{:.2f}"),
                _both([f.others for f in runs], "{:.2f}"),
            ]
        )
    table(
        "5. Reference: raw etcd, put compared on mod_revision (round 1 / round 2)",
        [
            "value",
            "value bytes",
            "writers",
            "puts/s",
            "p50 ms",
            "p99 ms",
            "etcd CPU ms/put",
            "client CPU ms/put",
            "others' cores",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["tiny"].items():
        kind, writers = cell.split()
        ref = etcd_rate.get(f"tiny json {writers}")
        name = "custom resource, ~100 B data" if kind == "cr" else "built-in Lease"
        size_key = "tiny json" if kind == "cr" else "lease (built-in)"
        rows.append(
            [
                name,
                f"{sizes.get(size_key, {}).get('object', 0):,}",
                writers,
                _both([f.rate for f in runs]),
                _both([f.p50 for f in runs], "{:.1f}"),
                _both([f.p99 for f in runs], "{:.0f}"),
                _both([f.per_op(f.api_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.etcd_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.client_cpu) for f in runs], "{:.2f}"),
                _both([f.others for f in runs], "{:.2f}"),
                _both([f.rate / ref for f in runs], "{:.2f}") if ref else "",
            ]
        )
    table(
        "4. Tiny objects: each writer its own (round 1 / round 2)",
        [
            "object",
            "object bytes",
            "writers",
            "updates/s",
            "p50 ms",
            "p99 ms",
            "API server CPU ms/update",
            "etcd CPU ms/update",
            "client CPU ms/update",
            "others' cores",
            "/ raw etcd tiny",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["adds"].items():
        layout, encoding, *mode = cell.split()
        rows.append(
            [
                f"{layout} {encoding}",
                " ".join(mode),
                _both([f.rate for f in runs]),
                _both([f.extra.get("updates/s", 0) for f in runs]),
                _both([f.extra.get("batch", 1) for f in runs], "{:.1f}"),
                _both([f.p50 for f in runs], "{:.1f}"),
                _both([f.p99 for f in runs], "{:.0f}"),
                _both([f.conflicts / f.seconds for f in runs]),
                _both([f.per_op(f.api_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.client_cpu) for f in runs], "{:.2f}"),
                _both([f.others for f in runs], "{:.2f}"),
            ]
        )
    table(
        "2. ADD shapes: L1 = the ledger (110 pods) per ADD; L2 = a block, then the ledger"
        " (round 1 / round 2)",
        [
            "layout, encoding",
            "writers",
            "ADDs/s",
            "updates/s",
            "ADDs per update",
            "ADD p50 ms",
            "ADD p99 ms",
            "conflicts/s",
            "API server CPU ms/ADD",
            "client CPU ms/ADD",
            "others' cores",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["gets"].items():
        shape, encoding = cell.split()
        rows.append(
            [
                f"GET {SHAPES[shape][2]}, {encoding}",
                _both([f.rate for f in runs]),
                _both([f.p50 for f in runs], "{:.2f}"),
                _both([f.p99 for f in runs], "{:.1f}"),
                _both([f.per_op(f.api_cpu) for f in runs], "{:.2f}"),
                _both([f.per_op(f.etcd_cpu) for f in runs], "{:.2f}"),
                _both([f.others for f in runs], "{:.2f}"),
            ]
        )
    table(
        "3a. GET of one object, one reader (round 1 / round 2)",
        [
            "read",
            "GETs/s",
            "p50 ms",
            "p99 ms",
            "API server CPU ms/GET",
            "etcd CPU ms/GET",
            "others' cores",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["lists"].items():
        ns, how = cell.split(" ", 1)
        rows.append(
            [
                f"{ns}: {how}",
                f"{runs[0].extra['items']:,.0f}",
                f"{runs[0].extra['pages']:.0f}",
                f"{runs[0].extra['MB']:.1f}",
                _both([f.ops for f in runs]),
                _both([f.p50 / 1000 for f in runs], "{:.3f}"),
                _both([f.p99 / 1000 for f in runs], "{:.3f}"),
                _both([f.per_op(f.api_cpu) / 1000 for f in runs], "{:.3f}"),
                _both([f.per_op(f.etcd_cpu) / 1000 for f in runs], "{:.3f}"),
                _both([f.per_op(f.client_cpu) / 1000 for f in runs], "{:.3f}"),
                _both([f.others for f in runs], "{:.2f}"),
            ]
        )
    table(
        "3b. LIST, one client, repeated for 3 s (round 1 / round 2)",
        [
            "objects, how",
            "items",
            "pages",
            "MB",
            "LISTs",
            "seconds p50",
            "max",
            "API server CPU s/LIST",
            "etcd CPU s/LIST",
            "client CPU s/LIST",
            "others' cores",
        ],
        rows,
    )

    rows = []
    for cell, runs in r["watches"].items():
        rows.append(
            [
                cell,
                _both([f.extra.get("updates", 0) for f in runs]),
                _both([f.p50 for f in runs], "{:.1f}"),
                _both([f.p99 for f in runs], "{:.1f}"),
                _both([f.extra.get("from_answer_p50", 0) for f in runs], "{:.1f}"),
                _both([f.extra.get("from_answer_p99", 0) for f in runs], "{:.1f}"),
                _both([f.extra.get("missing", 0) for f in runs]),
                _both([f.others for f in runs], "{:.2f}"),
            ]
        )
    table(
        "3c. Watch: a block object updated 20 times a second; when each watcher saw each update"
        " (round 1 / round 2)",
        [
            "watchers",
            "updates",
            "from the PUT sent: p50 ms",
            "p99 ms",
            "from the PUT's answer: p50 ms",
            "p99 ms",
            "missed",
            "others' cores",
        ],
        rows,
    )

    rows = [
        [name, f"{s['data']:,}", f"{s['object']:,}", f"{s['etcd']:,}", f"{s['managed_fields']:,}"]
        for name, s in sizes.items()
    ]
    table(
        "Sizes: data, the object as GET returns it, its value in etcd",
        [
            "content",
            "spec.data bytes",
            "object bytes (JSON)",
            "etcd value bytes",
            "managedFields bytes",
        ],
        rows,
    )
    rows = [
        [k, f"{v['object']:,}", f"{v['managed_fields']:,}", str(v["entries"])]
        for k, v in bench.facts.get("managed_fields", {}).items()
    ]
    table(
        "managedFields: the block object written twice by PUT, and by server-side apply",
        ["written by", "object bytes", "managedFields bytes", "entries"],
        rows,
    )
    rows = [
        [k, f"{v['bytes']:,}", f"{v['encode_ms']:.2f}", f"{v['decode_ms']:.2f}"]
        for k, v in bench.facts.get("codec", {}).items()
    ]
    table(
        "The client's encoding: content to spec.data and back (median CPU ms)",
        ["content, encoding", "spec.data bytes", "encode ms", "decode ms"],
        rows,
    )
    rows = [[k, v.replace("|", "/")] for k, v in bench.facts.get("protobuf", {}).items()]
    table("Protobuf", ["request", "answer"], rows, figures=False)
    for _, block in sorted(blocks, key=lambda b: b[0]):
        lines.extend(block)
    return lines


def to_json(bench: Bench) -> dict:
    return {
        "results": {
            part: {cell: [vars(f) | {"rate": f.rate} for f in runs] for cell, runs in cells.items()}
            for part, cells in bench.results.items()
        },
        "facts": bench.facts,
    }


def etcd_endpoint(lab: KubeLab) -> str:
    for arg in lab.args:
        if arg.startswith("--etcd-servers="):
            return arg.split("://", 1)[1]
    raise BenchError("the API server has no --etcd-servers")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ipward_lab.bench.kube_layouts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer cells, short windows, one round"
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds of every measurement (default 2; --quick 1)"
    )
    parser.add_argument(
        "--duration", type=float, help="seconds of each window (default 5; --quick 1.5)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    executable = binary()
    if executable is None:
        print("KUBE_APISERVER must name the kube-apiserver binary", file=sys.stderr)
        return 2
    rounds = args.rounds or (1 if args.quick else 2)
    duration = args.duration or (1.5 if args.quick else 5.0)
    began = time.monotonic()
    print(f"kube layouts: rounds {rounds}, windows of {duration} s, load {os.getloadavg()}")
    with (
        tempfile.TemporaryDirectory(prefix="kube-layouts-") as tmp,
        kube_apiserver(executable, Path(tmp)) as lab,
    ):
        bench = Bench(lab, etcd_endpoint(lab), args.quick, rounds, duration, print)
        with bench.workers(WORKERS):
            bench.run()
    for line in tables(bench):
        print(line)
    print(f"\n{time.monotonic() - began:.0f} s in all; load at the end {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(to_json(bench), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
