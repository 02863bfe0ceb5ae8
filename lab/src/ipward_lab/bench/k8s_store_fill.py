"""`ipward bench --k8s-store`, its second part: the Kubernetes store grown to a
cluster's size (150,000 addresses on 5,000 nodes: `ScaleCluster`, as `--scale` grows
etcd, each object written by a transaction of its own) in a namespace of its own, and
then its objects' count and sizes, a real agent's and a real controller's memory there
(`scale.probe_agent`, `scale.controller_figures`: as `--scale` measures them), and the
relist storm: every node's agent reading its node index whole again at once, as after
the API server ended every watch."""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from ipward.core import keys, shards
from ipward.ipam.check import check
from ipward.kubeapi.client import ApiClient
from ipward.kubeapi.config import from_kubeconfig
from ipward.store import open_store
from ipward.store.base import StoreError
from ipward.store.kube import KubeStore
from ipward.store.kube.objects import GROUP, PLURAL, VERSION
from ipward_lab.bench.common import BenchError, memory_mib, percentile_ms, stop_process
from ipward_lab.bench.scale import (
    CHECK_LIMIT,
    controller_figures,
    cpu_seconds,
    probe_agent,
    start_controller,
)
from ipward_lab.bench.scale_cluster import ScaleCluster
from ipward_lab.servers import kube_store
from ipward_lab.servers.kube_apiserver import KubeLab
from ipward_lab.waiting import wait_for

FILL_NAMESPACE = "bench-fill"
API_REQUEST_LIMIT = 3 << 19  # bytes: the largest request the API server takes (1.5 MiB)
LIST_PAGE = 500
MEMORY_SAMPLE_EVERY = 0.1  # seconds between reads of the API server's resident memory
WORKER_TIMEOUT = 900.0  # seconds a relist process may take, ready or done


def measure_fill(
    lab: KubeLab,
    tmp: Path,
    records: int,
    reconcile_passes: int,
    relist_clients: tuple[int, int],
    out: Callable[[str], object],
) -> dict[str, float]:
    """The store in FILL_NAMESPACE grown to `records` addresses, then every figure of
    this part (names without a prefix): the fill's, the objects', the probe agent's
    (`reconcile_passes` passes), the controller's and the relist storm's
    (`relist_clients`: processes, threads in each)."""
    kube_store.install(lab.kubeconfig, FILL_NAMESPACE)
    url = kube_store.store_url(lab.kubeconfig, FILL_NAMESPACE)
    store = open_store(url)  # as ipward makes a store: its schema key first
    try:
        cluster = ScaleCluster(url, store, tmp, 1, lab.etcd)
        out(f"  ... the fill: {records:,} addresses, one object per transaction")
        figures = {"records": float(records), **cluster.grow(records)}
        figures["nodes"] = float(len(cluster.nodes))
        figures.update(cluster.db_size())  # the API server's etcd: every object of the run
        figures.update(object_sizes(lab, FILL_NAMESPACE))
        if records <= CHECK_LIMIT:
            problems = check(store)[0]
            if problems:
                raise BenchError(f"ipward check on the filled store: {problems[:5]}")
        out(f"  ... {len(cluster.nodes):,} nodes; probe agent: memory, {reconcile_passes} passes")
        figures.update(probe_agent(cluster, tmp, reconcile_passes))
        out("  ... controller: first pass, 1% of the pods changed, steady pass, memory")
        controller = start_controller(cluster, tmp)
        try:
            figures.update(controller_figures(cluster, controller))
        finally:
            stop_process(controller)
        processes, threads = relist_clients
        out(
            f"  ... relist storm: {len(cluster.nodes):,} agents' node indexes read again,"
            f" {processes} processes x {threads} threads"
        )
        figures.update(relist_storm(lab, url, cluster.nodes, processes, threads))
    finally:
        store.close()
    return figures


def object_sizes(lab: KubeLab, namespace: str) -> dict[str, float]:
    """Every object of the store in `namespace` as the API serves it (compact JSON):
    how many (in all and by kind of shard), their sizes (largest, median, total) and
    the largest next to the API's request limit."""
    client = ApiClient(from_kubeconfig(str(lab.kubeconfig)), timeout=120)
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    sizes: list[int] = []
    kinds: Counter[str] = Counter()
    query = {"limit": str(LIST_PAGE)}
    try:
        while True:
            page = client.request("GET", path, query)
            for item in page.get("items") or []:
                sizes.append(len(json.dumps(item, separators=(",", ":")).encode()))
                kinds[shards.kind_of(str(item["spec"]["shard"]))] += 1
            query["continue"] = str((page.get("metadata") or {}).get("continue") or "")
            if not query["continue"]:
                break
    finally:
        client.close()
    if not sizes:
        raise BenchError(f"no {PLURAL} in namespace {namespace}")
    figures = {
        "objects": float(len(sizes)),
        "object_bytes_max": float(max(sizes)),
        "object_bytes_p50": float(statistics.median(sizes)),
        "object_bytes_total": float(sum(sizes)),
        "object_max_vs_limit": max(sizes) / API_REQUEST_LIMIT,
    }
    figures.update({f"objects.{kind}": float(n) for kind, n in sorted(kinds.items())})
    return figures


# -- the relist storm ---------------------------------------------------------------------


def relist_worker() -> None:
    """One process of the relist storm (`relist_storm` runs it): its request from stdin
    (the store's URL, its nodes, its threads), a store client per thread (its own
    connection, as each agent has its own), "ready" on stdout; at the "go" line each
    thread relists nodes taken from the list, as an agent's node index does after its
    watch ended (`store/follower.py`): the whole read of the node's index, then a watch
    from the revision after it (which reads the shard as it was at that revision; its
    stream is not opened). Prints what it did as JSON."""
    request = json.loads(sys.stdin.readline())
    stores = [KubeStore(request["url"]) for _ in range(request["threads"])]
    print("ready", flush=True)
    sys.stdin.readline()
    nodes: Iterator[str] = iter(request["nodes"])
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    found = [0]

    def relist(store: KubeStore) -> None:
        while True:
            with lock:
                node = next(nodes, None)
            if node is None:
                return
            prefix = keys.node_ips_prefix(node)
            began = time.monotonic()
            try:
                kvs, revision = store.range(prefix)
                store.watch(prefix, revision + 1)
            except StoreError as e:
                errors.append(f"{node}: {e}")
                continue
            latencies.append(time.monotonic() - began)
            found[0] += len(kvs)

    began, cpu = time.monotonic(), time.process_time()
    workers = [threading.Thread(target=relist, args=(store,)) for store in stores]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    outcome = {
        "began": began,
        "ended": time.monotonic(),
        "cpu": time.process_time() - cpu,
        "latencies": latencies,
        "errors": errors,
        "keys": found[0],
    }
    print(json.dumps(outcome), flush=True)
    for store in stores:
        store.close()


RELIST_WORKER = "from ipward_lab.bench.k8s_store_fill import relist_worker; relist_worker()"


class _PeakMemory:
    """The highest resident memory of a process, read every MEMORY_SAMPLE_EVERY seconds
    while inside."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mib = memory_mib(pid)["rss_mib"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_EVERY):
            self.peak_mib = max(self.peak_mib, memory_mib(self.pid)["rss_mib"])

    def __enter__(self) -> _PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, memory_mib(self.pid)["rss_mib"])


def relist_storm(
    lab: KubeLab, url: str, nodes: list[str], processes: int, threads: int
) -> dict[str, float]:
    """Every node's relist at once, by `processes` worker processes of `threads` threads
    each (`relist_worker`; the nodes dealt out among them), started together once every
    client is connected: the wall time until the last is done, each relist's time, the
    CPU seconds of the API server and its etcd meanwhile, the API server's resident
    memory before and at its highest."""
    assert lab.proc is not None and lab.etcd.proc is not None
    api, etcd = lab.proc.pid, lab.etcd.proc.pid
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", RELIST_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for i, worker in enumerate(workers):
            assert worker.stdin is not None
            request = {"url": url, "nodes": nodes[i::processes], "threads": threads}
            worker.stdin.write(json.dumps(request) + "\n")
            worker.stdin.flush()
        for worker in workers:
            _expect_line(worker, "ready")
        before = memory_mib(api)["rss_mib"]
        cpu = (cpu_seconds(api), cpu_seconds(etcd))
        with _PeakMemory(api) as memory:
            go = time.monotonic()
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
            outcomes = [json.loads(_expect_line(worker)) for worker in workers]
        api_cpu, etcd_cpu = cpu_seconds(api) - cpu[0], cpu_seconds(etcd) - cpu[1]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
    latencies = [x for o in outcomes for x in o["latencies"]]
    errors = [e for o in outcomes for e in o["errors"]]
    if not latencies:
        raise BenchError(f"no relist succeeded: {errors[:3]}")
    wall = max(o["ended"] for o in outcomes) - go
    return {
        "relist.agents": float(len(nodes)),
        "relist.concurrency": float(processes * threads),
        "relist.done": float(len(latencies)),
        "relist.errors": float(len(errors)),
        "relist.keys": float(sum(o["keys"] for o in outcomes)),
        "relist.wall_s": wall,
        "relist.per_s": len(latencies) / wall,
        "relist.p50_ms": percentile_ms(latencies, 50),
        "relist.p99_ms": percentile_ms(latencies, 99),
        "relist.api_cpu_s": api_cpu,
        "relist.etcd_cpu_s": etcd_cpu,
        "relist.clients_cpu_s": sum(o["cpu"] for o in outcomes),
        "relist.api_rss_before_mib": before,
        "relist.api_rss_peak_mib": memory.peak_mib,
    }


def _expect_line(worker: subprocess.Popen[str], expected: str = "") -> str:
    """The next line a relist worker prints (`expected`, when given), within
    WORKER_TIMEOUT; BenchError when it ends or says something else first."""
    stdout = worker.stdout
    assert stdout is not None
    wait_for(
        lambda: select.select([stdout], [], [], 0)[0],
        "a relist process's next line",
        WORKER_TIMEOUT,
        failure=BenchError,
    )
    line = stdout.readline().strip()
    if not line or (expected and line != expected):
        worker.kill()
        wanted = expected or "its outcome"
        raise BenchError(f"a relist process said {line[:200]!r}, not {wanted} ({worker.wait()})")
    return line


def fill_rows(figures: dict[str, float]) -> list[list[str]]:
    """The console table of this part (`measure_fill`'s figures): the objects, the
    processes' memory, the relist storm, each next to its reference."""

    def v(name: str) -> float:
        return figures[name]

    kinds = sorted(name.split(".", 1)[1] for name in figures if name.startswith("objects."))
    mib = 1 << 20
    return [
        [f"3. {v('records'):,.0f} addresses on {v('nodes'):,.0f} nodes", "value", "reference"],
        ["fill (one transaction per object)", f"{v('fill_s'):.0f} s", ""],
        [
            "objects",
            f"{v('objects'):,.0f}",
            ", ".join(f"{k} {v(f'objects.{k}'):,.0f}" for k in kinds),
        ],
        [
            "object bytes: largest / median",
            f"{v('object_bytes_max'):,.0f} / {v('object_bytes_p50'):,.0f}",
            f"API request limit {API_REQUEST_LIMIT:,}: {v('object_max_vs_limit'):.3f}x",
        ],
        [
            "objects in all, as served",
            f"{v('object_bytes_total') / mib:.1f} MiB",
            f"etcd db {v('db_bytes') / mib:.1f} MiB (every object of the run)",
        ],
        [
            "agent peak memory, 110 pods on its node",
            f"{v('agent_hwm_mib'):.1f} MiB",
            f"its reconcile pass {v('reconcile_ms'):.2f} ms",
        ],
        [
            "controller first / steady pass",
            f"{v('controller_first_pass_ms'):,.0f} / {v('controller_steady_pass_ms'):,.0f} ms",
            f"{v('changed_pods'):,.0f} pods changed before the steady one",
        ],
        ["controller peak memory", f"{v('controller_hwm_mib'):.0f} MiB", ""],
        [
            f"relist storm: {v('relist.agents'):,.0f} agents,"
            f" {v('relist.concurrency'):.0f} at a time",
            f"{v('relist.wall_s'):.1f} s",
            f"{v('relist.per_s'):,.0f} relists/s; p50 {v('relist.p50_ms'):.0f} ms,"
            f" p99 {v('relist.p99_ms'):.0f} ms; {v('relist.errors'):.0f} errors",
        ],
        [
            "  API server CPU / its etcd's",
            f"{v('relist.api_cpu_s'):.1f} / {v('relist.etcd_cpu_s'):.1f} s",
            f"the clients' {v('relist.clients_cpu_s'):.1f} s",
        ],
        [
            "  API server memory, before / highest",
            f"{v('relist.api_rss_before_mib'):.0f} / {v('relist.api_rss_peak_mib'):.0f} MiB",
            "",
        ],
    ]
