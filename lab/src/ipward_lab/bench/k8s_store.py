"""`ipward bench --k8s-store`: ipward on the Kubernetes store (`k8s://`, docs/design.md
5.15) next to the references any design on the API shares, in one run on this
machine: a kube-apiserver of its own (`servers.kube_apiserver`, on a throwaway etcd)
and a temporary etcd beside it (`servers.etcd`).

1. The load, in rounds (each load runs for `load_seconds` in every round, every other
   round in reverse order), on both stores alike:
   - the reference: raw updates of objects by 1 writer and by 32, each writer its own
     object (on the API: a PUT with the resourceVersion it last wrote, of an object
     like an agent's node object half way through a round; on etcd: get + txn compared
     on mod_revision, `cluster.CasClient`): the ceiling of any design on that store;
   - ADDs through real agents (`ipward agent` processes, called as the plugin calls
     them, `cluster.AgentCaller`) by 1 caller through one agent, 32 through one agent
     and 32 across 3 agents, until each node holds NODE_HELD (a node's pods stay under
     Kubernetes' 110), then their DELs: each phase timed and counted apart.
   A controller runs on each store. Every write the API server took in a phase is
   counted from its /metrics (`apiserver_request_total`, every verb that writes, every
   resource: the agents' and the controller's leases and passes included), etcd's Txn
   calls from its own; and the CPU of the servers, the agents, the controller and this
   process's callers (/proc). An idle window first counts the writes no load makes.
2. The fill (`k8s_store_fill`): the store grown to `records` addresses on 30 a node,
   its objects' count and sizes, the agent's and the controller's memory there, and
   every agent's relist at once.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ipward.core import shards
from ipward.kubeapi.client import ApiClient, ApiError, ApiUnreachable
from ipward.kubeapi.config import from_kubeconfig
from ipward.store.kube.objects import GROUP, PLURAL, VERSION
from ipward_lab.bench.cluster import (
    TARGET_NATIVE_VS_HOST_LOCAL,
    AgentCaller,
    CasClient,
    agent_exec_latency,
    etcd_clients,
    etcd_counters,
    parallel,
    start_agents,
)
from ipward_lab.bench.common import (
    BenchError,
    Results,
    machine,
    percentile_ms,
    print_table,
    stop_process,
    verdict,
)
from ipward_lab.bench.k8s_store_fill import fill_rows, measure_fill
from ipward_lab.bench.scale import cpu_seconds
from ipward_lab.fleet import Agent, Controller, FleetError
from ipward_lab.servers import kube_store
from ipward_lab.servers.etcd import ETCD, etcd_server
from ipward_lab.servers.kube_apiserver import KubeLab, binary, kube_apiserver

LEDGER_NAMESPACE = "ipward-system"
RAW_NAMESPACE = "bench-raw"  # the raw writers' objects: no store reads them
CALLERS = 32
AGENTS = 3
NODE_HELD = 96  # ADDs a node holds before their DELs: under Kubernetes' 110 pods a node
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"})
REQUESTS_METRIC = "apiserver_request_total{"
_LABEL = re.compile(r'(\w+)="([^"]*)"')
CONTROLLER_READY_TIMEOUT = 60.0

TARGET_ADD_32_VS_RAW = 0.5  # ADDs/s at 32-way >= 0.5 x the raw update rate at 32 writers
TARGET_WRITES_PER_ADD_ALONE = 2.0  # API writes per ADD by one caller


@dataclass(frozen=True)
class K8sStoreSizes:
    """How much of each: rounds of the load and the timed seconds of each load in a
    round; the idle window's seconds; the fill's addresses (NODE_PODS a node); the probe
    agent's reconcile passes; the relist storm's client processes and threads in each."""

    rounds: int = 3
    load_seconds: float = 4.0
    idle_seconds: float = 5.0
    records: int = 150_000
    reconcile_passes: int = 20
    relist_processes: int = 4
    relist_threads: int = 25
    exec_runs: int = 200


FULL = K8sStoreSizes()
QUICK = K8sStoreSizes(
    rounds=1,
    load_seconds=1.5,
    idle_seconds=2.0,
    records=3_000,
    reconcile_passes=5,
    relist_processes=2,
    relist_threads=10,
    exec_runs=40,
)


@dataclass(frozen=True)
class Load:
    """One load of a round: `callers` raw writers, or callers of `agents` agents (ADDs,
    then their DELs under `del_name`)."""

    name: str
    label: str
    callers: int
    agents: int = 0

    @property
    def raw(self) -> bool:
        return self.agents == 0

    @property
    def del_name(self) -> str:
        return self.name.replace("add_", "del_")

    @property
    def reference(self) -> str:
        """The raw load at the same concurrency."""
        return f"raw_{self.callers}"


LOADS = (
    Load("raw_1", "1 writer, own object", 1),
    Load("add_1", "1 caller, one agent", 1, 1),
    Load("raw_32", "32 writers, each its own object", CALLERS),
    Load("add_32", "32 callers, one agent", CALLERS, 1),
    Load("add_32x3", "32 callers across 3 agents", CALLERS, AGENTS),
)


@dataclass
class Tally:
    """What one load's phases did over all rounds: operations done, their seconds and
    latencies, the requests their server served (by kind), CPU seconds by process."""

    ops: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)


# A phase of a load: run, it says how many operations it did, in how many seconds, and
# each one's latency.
Phase = Callable[[], tuple[int, float, list[float]]]


class RawUpdater:
    """One raw writer on the API: PUTs of its own object, each with the resourceVersion
    it last wrote (the API's compare-and-swap), through a client of its own (one
    connection, as an agent has); every other PUT changes `spec.shard`, so none is a
    no-op. Counts as `cluster.CasClient` does."""

    def __init__(self, client: ApiClient, path: str, body: dict) -> None:
        self.client = client
        self.path = path
        self.body = body
        self.count = 0
        self.cas_s: list[float] = []

    def loop(self, n: int | None, seconds: float | None, measured: bool) -> None:
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else float("inf")
        done = 0
        shard = self.body["spec"]["shard"]
        while (n is None or done < n) and clock() < deadline:
            self.body["spec"]["shard"] = f"{shard}-{done % 2}"
            start = clock()
            try:
                answer = self.client.request("PUT", self.path, body=self.body)
            except (ApiError, ApiUnreachable) as e:
                raise BenchError(f"raw update of {self.path}: {e}") from None
            elapsed = clock() - start
            self.body["metadata"]["resourceVersion"] = answer["metadata"]["resourceVersion"]
            done += 1
            if measured:
                self.cas_s.append(elapsed)
                self.count += 1


class Side:
    """One store under the loads: its agents, its raw writers, its callers per load, and
    where its counts come from (the requests its server served; its processes' CPU)."""

    def __init__(
        self,
        name: str,
        agents: list[Agent],
        raw: Sequence[RawUpdater | CasClient],
        requests: Callable[[], Counter[str]],
        pids: dict[str, list[int]],
    ) -> None:
        self.name = name
        self.agents = agents
        self.raw = raw
        self.requests = requests
        self.pids = pids
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.callers = {
            load.name: [
                AgentCaller(i, str(agents[i % load.agents].socket)) for i in range(load.callers)
            ]
            for load in LOADS
            if not load.raw
        }

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each kind of process (`callers`: this one's threads)."""
        seconds = {kind: sum(cpu_seconds(pid) for pid in pids) for kind, pids in self.pids.items()}
        return seconds | {"callers": time.process_time()}

    def metered(self, name: str, phase: Phase) -> float:
        """Run `phase` (its operations, seconds and latencies) and add it to the tally
        `name` with the requests and CPU meanwhile; its seconds."""
        requests, cpu = self.requests(), self.cpu()
        ops, seconds, latencies = phase()
        cpu_after, requests_after = self.cpu(), self.requests()
        tally = self.tallies[name]
        tally.ops += ops
        tally.seconds += seconds
        tally.latencies += latencies
        tally.requests.update(requests_after - requests)
        for kind, seconds_before in cpu.items():
            tally.cpu[kind] = tally.cpu.get(kind, 0.0) + cpu_after[kind] - seconds_before
        return seconds

    def run(self, load: Load, seconds: float) -> None:
        """One round of `load`: raw updates for `seconds`; or ADD phases, each followed by
        the DELs of what it added, until the ADD phases took `seconds`."""
        if load.raw:
            self.metered(load.name, self._raw_phase(load, seconds))
            return
        timed = 0.0
        while timed < seconds:
            add_phase, del_phase = self._agent_phases(load, seconds - timed)
            timed += self.metered(load.name, add_phase)
            self.metered(load.del_name, del_phase)

    def warm(self, load: Load) -> None:
        """`load` once, untimed: a few raw updates, or one ADD phase and its DELs."""
        if load.raw:
            for writer in self.raw[: load.callers]:
                writer.loop(3, None, False)
            return
        for phase in self._agent_phases(load, None):
            phase()

    def _raw_phase(self, load: Load, seconds: float) -> Phase:
        writers = self.raw[: load.callers]
        work = [partial(w.loop, None, seconds, True) for w in writers]
        return partial(_timed, writers, "count", "cas_s", work)

    def _agent_phases(self, load: Load, seconds: float | None) -> tuple[Phase, Phase]:
        """An ADD phase of `load` (each caller adds its share of NODE_HELD on its node,
        for at most `seconds`) and the phase of their DELs."""
        callers = self.callers[load.name]
        per_node = Counter(i % load.agents for i in range(load.callers))
        shares = [NODE_HELD // per_node[i % load.agents] for i in range(load.callers)]
        adds = [partial(c.allocate_only, n, seconds) for c, n in zip(callers, shares, strict=True)]
        dels = [partial(c.release_held, True) for c in callers]
        return (
            partial(_timed, callers, "allocs", "alloc_s", adds),
            partial(_timed, callers, "dels", "del_s", dels),
        )

    def errors(self) -> dict[str, str]:
        """The calls that failed, by kind: how many, and the first one's answer."""
        counts: Counter[str] = Counter()
        examples: dict[str, str] = {}
        for callers in self.callers.values():
            for caller in callers:
                counts.update(caller.errors)
                for kind, text in caller.examples.items():
                    examples.setdefault(kind, text)
        return {kind: f"{n} (first: {examples[kind]})" for kind, n in counts.items()}

    def busy(self) -> int:
        """Calls made again after the agent answered "busy" (`cluster.BUSY`)."""
        return sum(c.busy for callers in self.callers.values() for c in callers)


def _timed(
    workers: Sequence[Any], counted: str, samples: str, work: Sequence[Callable[[], None]]
) -> tuple[int, float, list[float]]:
    """Run `work` (a callable a worker) all at once: what the workers' `counted` grew by,
    the wall seconds, the latencies added to their `samples`."""
    before = [(getattr(w, counted), len(getattr(w, samples))) for w in workers]
    wall = parallel(work)
    ops = sum(getattr(w, counted) - n for w, (n, _) in zip(workers, before, strict=True))
    latencies = [
        x for w, (_, k) in zip(workers, before, strict=True) for x in getattr(w, samples)[k:]
    ]
    return ops, wall, latencies


# -- what the servers count ----------------------------------------------------------------


def request_counts(metrics: str) -> Counter[str]:
    """The API server's requests served, from its /metrics text: counts by "VERB
    resource code" (`apiserver_request_total`, summed over its other labels; watches
    left out: one is counted when it ends)."""
    counts: Counter[str] = Counter()
    for line in metrics.splitlines():
        if not line.startswith(REQUESTS_METRIC):
            continue
        labels_text, _, value = line.rpartition(" ")
        labels = dict(_LABEL.findall(labels_text))
        if labels.get("verb") not in ("WATCH", "CONNECT"):
            resource = "/".join(filter(None, (labels.get("resource"), labels.get("subresource"))))
            key = f"{labels.get('verb')} {resource} {labels.get('code')}"
            counts[key] += int(float(value))
    return counts


def request_outcomes(requests: Counter[str]) -> dict[str, int]:
    """Requests (`request_counts`) by what they did: writes done (2xx; of them, of the
    ledger's objects), writes refused as conflicts (409) or otherwise, and reads."""
    outcomes = dict.fromkeys(("writes", "ledger_writes", "conflicts", "refused", "reads"), 0)
    for key, n in requests.items():
        verb, resource, code = key.split(" ")
        if verb not in WRITE_VERBS:
            outcomes["reads"] += n
        elif code.startswith("2"):
            outcomes["writes"] += n
            outcomes["ledger_writes"] += n if resource == PLURAL else 0
        elif code == "409":
            outcomes["conflicts"] += n
        else:
            outcomes["refused"] += n
    return outcomes


def writes_by_resource(requests: Counter[str]) -> dict[str, int]:
    """The writes done (2xx; `request_counts`) by resource ("ippools/status": a
    subresource)."""
    written: Counter[str] = Counter()
    for key, n in requests.items():
        verb, resource, code = key.split(" ")
        if verb in WRITE_VERBS and code.startswith("2"):
            written[resource] += n
    return dict(written)


def _api_requests(lab: KubeLab) -> Counter[str]:
    return request_counts(lab.fetch("/metrics").decode())


def _etcd_requests(client_url: str) -> Counter[str]:
    counts = etcd_counters(client_url)
    if counts is None:
        return Counter()
    return Counter({"txn": int(counts["txn"]), "range": int(counts["range"])})


# -- setting up ------------------------------------------------------------------------


def _start_controller(stack: contextlib.ExitStack, tmp: Path, url: str) -> Controller:
    """A controller on the store at `url` with its defaults (no liveness: it collects
    no garbage, it keeps the nodes' blocks warm and takes surplus ones back), stopped by
    `stack`."""
    controller = Controller("bench", url, tmp / "controller-logs")
    stack.callback(stop_process, controller)
    try:
        controller.wait_started(CONTROLLER_READY_TIMEOUT)
    except FleetError as e:
        raise BenchError(str(e)) from None
    return controller


def _raw_updaters(
    stack: contextlib.ExitStack, lab: KubeLab, node_object: dict, count: int
) -> list[RawUpdater]:
    """`count` objects in RAW_NAMESPACE, each a copy of `node_object` (an agent's node
    object as the API served it), and a writer of each with a client of its own (closed
    by `stack`)."""
    kube_store.install(lab.kubeconfig, RAW_NAMESPACE)
    collection = f"/apis/{GROUP}/{VERSION}/namespaces/{RAW_NAMESPACE}/{PLURAL}"
    updaters = []
    for i in range(count):
        body = copy.deepcopy(node_object)
        body["metadata"] = {
            "name": f"raw-{i}",
            "namespace": RAW_NAMESPACE,
            "labels": node_object["metadata"].get("labels", {}),
        }
        client = ApiClient(from_kubeconfig(str(lab.kubeconfig)))
        stack.callback(client.close)
        created = client.request("POST", collection, body=body)
        body["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
        updaters.append(RawUpdater(client, f"{collection}/raw-{i}", body))
    return updaters


def _node_object(lab: KubeLab, node: str) -> dict:
    """The ledger object of `node` as the API serves it now."""
    name = shards.object_name(shards.shard(shards.NODE, node))
    client = ApiClient(from_kubeconfig(str(lab.kubeconfig)))
    try:
        return client.request(
            "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{LEDGER_NAMESPACE}/{PLURAL}/{name}"
        )
    finally:
        client.close()


def k8s_side(
    stack: contextlib.ExitStack, lab: KubeLab, tmp: Path, out: Callable[[str], object]
) -> Side:
    """The Kubernetes store's side: the store's resources, AGENTS agents and a controller
    on it; the raw writers' objects, copies of agent 0's node object holding half of
    NODE_HELD (as half way through a round)."""
    kube_store.install(lab.kubeconfig, LEDGER_NAMESPACE)
    url = kube_store.store_url(lab.kubeconfig, LEDGER_NAMESPACE)
    out("  ... kube-apiserver up: the Kubernetes store")
    agents = start_agents(stack, tmp / "k8s", url, AGENTS, out)
    controller = _start_controller(stack, tmp / "k8s", url)
    half = [AgentCaller(i, str(agents[0].socket)) for i in range(CALLERS // 2)]
    parallel([partial(c.allocate_only, NODE_HELD // CALLERS, None) for c in half])
    node_object = _node_object(lab, agents[0].node)
    parallel([c.release_held for c in half])
    raw = _raw_updaters(stack, lab, node_object, CALLERS)
    assert lab.proc is not None and lab.etcd.proc is not None
    pids = {
        "api": [lab.proc.pid],
        "api_etcd": [lab.etcd.proc.pid],
        "agents": [a.pid for a in agents],
        "controller": [controller.pid],
    }
    return Side("k8s", agents, raw, partial(_api_requests, lab), pids)


def etcd_side(stack: contextlib.ExitStack, tmp: Path, out: Callable[[str], object]) -> Side:
    """etcd's side: a temporary etcd, AGENTS agents and a controller on it, and raw CAS
    threads (one store client per CALLERS threads, like an agent)."""
    server = stack.enter_context(etcd_server(tmp / "etcd-ref" / "etcd"))
    out("  ... etcd up: the reference")
    agents = start_agents(stack, tmp / "etcd-ref", server.url, AGENTS, out)
    controller = _start_controller(stack, tmp / "etcd-ref", server.url)
    (client,) = etcd_clients(stack, server.url, 1)
    raw = [CasClient(client, f"bench/cas/{i}") for i in range(CALLERS)]
    assert server.proc is not None
    pids = {
        "etcd": [server.proc.pid],
        "agents": [a.pid for a in agents],
        "controller": [controller.pid],
    }
    return Side("etcd", agents, raw, partial(_etcd_requests, f"http://{server.endpoint}"), pids)


# -- the run -------------------------------------------------------------------------------


def measure_load(sides: list[Side], sizes: K8sStoreSizes, out: Callable[[str], object]) -> None:
    """An idle window on each side, a warm-up round, then the measured rounds."""
    out(f"  ... idle: {sizes.idle_seconds:.0f} s of the writes no load makes")
    for side in sides:
        side.metered("idle", lambda: (0, _sleep(sizes.idle_seconds), []))
    out("  ... warm-up: every load once, untimed")
    for load in LOADS:
        for side in sides:
            side.warm(load)
    steps = [(load, side) for load in LOADS for side in sides]
    for i in range(sizes.rounds):
        out(
            f"  ... round {i + 1} of {sizes.rounds}: every load {sizes.load_seconds:g} s"
            f" on each store (load average {os.getloadavg()[0]:.1f})"
        )
        for load, side in steps if i % 2 == 0 else steps[::-1]:
            side.run(load, sizes.load_seconds)


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def load_figures(sides: list[Side], r: Results) -> None:
    """Each side's tallies as figures (`k8s_store.SIDE.LOAD.*`), the ratios to the raw
    rate at the same concurrency, and the targets."""
    f = r.figures
    for side in sides:
        for name, tally in side.tallies.items():
            key = f"k8s_store.{side.name}.{name}"
            counts = _per_request_kind(side, tally)
            if name == "idle":
                f[f"{key}.writes_per_s"] = counts["writes"] / tally.seconds
                continue
            if not tally.ops:
                raise BenchError(f"{side.name}: no {name} succeeded: {side.errors()}")
            f[f"{key}.ops"] = float(tally.ops)
            f[f"{key}.per_s"] = tally.ops / tally.seconds
            f[f"{key}.p50_ms"] = percentile_ms(tally.latencies, 50)
            f[f"{key}.p99_ms"] = percentile_ms(tally.latencies, 99)
            for kind, seconds in tally.cpu.items():
                f[f"{key}.{kind}_cpu_ms_per_op"] = seconds * 1000 / tally.ops
            for kind, n in counts.items():
                f[f"{key}.{kind}_per_op"] = n / tally.ops
            if side.name == "k8s":
                for resource, n in writes_by_resource(tally.requests).items():
                    f[f"{key}.writes.{resource}_per_op"] = n / tally.ops
        for load in LOADS:
            if load.raw:
                continue
            raw = f[f"k8s_store.{side.name}.{load.reference}.per_s"]
            for name in (load.name, load.del_name):
                f[f"k8s_store.{side.name}.{name}.vs_raw"] = (
                    f[f"k8s_store.{side.name}.{name}.per_s"] / raw
                )
    ratio = f["k8s_store.k8s.add_32.vs_raw"]
    r.targets["k8s_store.k8s.add_32.vs_raw"] = {
        "value": ratio,
        "target": f">= {TARGET_ADD_32_VS_RAW}",
        "met": ratio >= TARGET_ADD_32_VS_RAW,
    }
    # An ADD's writes: every write in its phase (the controller's status updates in),
    # less what the store writes idle in as long (the leases' keep-alives).
    tally = sides[0].tallies["add_1"]
    idle = f["k8s_store.k8s.idle.writes_per_s"] * tally.seconds
    per_add = f["k8s_store.k8s.add_1.writes_per_op"] - idle / tally.ops
    f["k8s_store.k8s.add_1.writes_less_idle_per_op"] = per_add
    r.targets["k8s_store.k8s.add_1.writes_less_idle_per_op"] = {
        "value": per_add,
        "target": f"<= {TARGET_WRITES_PER_ADD_ALONE}",
        "met": per_add <= TARGET_WRITES_PER_ADD_ALONE,
    }


def _per_request_kind(side: Side, tally: Tally) -> dict[str, int]:
    """What a tally's server did, by kind: on the API server by outcome
    (`request_outcomes`), on etcd its Txn (`writes`) and Range calls."""
    if side.name == "k8s":
        return request_outcomes(tally.requests)
    return {"writes": tally.requests["txn"], "reads": tally.requests["range"]}


def load_rows(f: dict[str, float]) -> list[list[str]]:
    """The console table of the load: each store's rate, latency, writes per operation
    and ratio to its raw rate at the same concurrency."""
    rows = [
        [
            "1. load (ops/s)",
            "k8s://",
            "p50 ms",
            "p99 ms",
            "API writes/op",
            "vs raw",
            "etcd",
            "p50 ms",
            "p99 ms",
            "Txn/op",
            "vs raw",
        ]
    ]
    for load in LOADS:
        names = [(load.name, "raw updates" if load.raw else "ADD")]
        if not load.raw:
            names.append((load.del_name, "DEL"))
        for name, what in names:
            k8s, etcd = f"k8s_store.k8s.{name}", f"k8s_store.etcd.{name}"
            rows.append(
                [
                    f"{what}, {load.label}",
                    f"{f[f'{k8s}.per_s']:,.0f}",
                    f"{f[f'{k8s}.p50_ms']:.1f}",
                    f"{f[f'{k8s}.p99_ms']:.1f}",
                    f"{f[f'{k8s}.writes_per_op']:.2f}",
                    "1.00x" if load.raw else f"{f[f'{k8s}.vs_raw']:.2f}x",
                    f"{f[f'{etcd}.per_s']:,.0f}",
                    f"{f[f'{etcd}.p50_ms']:.1f}",
                    f"{f[f'{etcd}.p99_ms']:.1f}",
                    f"{f[f'{etcd}.writes_per_op']:.2f}",
                    "1.00x" if load.raw else f"{f[f'{etcd}.vs_raw']:.2f}x",
                ]
            )
    return rows


def cost_rows(f: dict[str, float]) -> list[list[str]]:
    """The console table of what each operation cost on the Kubernetes side: writes by
    outcome and CPU by process, per operation."""
    rows = [
        [
            "2. k8s:// per op",
            "ledger writes",
            "conflicts",
            "refused",
            "reads",
            "API server ms",
            "its etcd ms",
            "agents ms",
            "controller ms",
            "callers ms",
        ]
    ]
    for load in LOADS:
        names = [load.name] if load.raw else [load.name, load.del_name]
        for name in names:
            key = f"k8s_store.k8s.{name}"
            rows.append(
                [
                    f"{name}",
                    *(
                        f"{f[f'{key}.{kind}_per_op']:.2f}"
                        for kind in ("ledger_writes", "conflicts", "refused", "reads")
                    ),
                    *(
                        f"{f[f'{key}.{kind}_cpu_ms_per_op']:.2f}"
                        for kind in ("api", "api_etcd", "agents", "controller", "callers")
                    ),
                ]
            )
    return rows


def run_k8s_store(sizes: K8sStoreSizes = FULL, out: Callable[[str], object] = print) -> dict:
    """Both parts (module docstring) in one run; prints the tables with `out`; returns
    {"machine", "figures", "targets", "errors", "notes", "tables"} like `run`."""
    executable = binary()
    if executable is None:
        raise BenchError("KUBE_APISERVER must name a kube-apiserver binary: --k8s-store needs it")
    if not os.access(ETCD, os.X_OK):
        raise BenchError(f"{ETCD} is missing (Debian package etcd-server): --k8s-store needs it")
    began = time.perf_counter()
    r = Results()
    info = machine()
    r.notes["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    r.notes["load_average_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out(
        f"ipward bench --k8s-store: {info['nproc']} CPUs ({info['platform']}); etcd"
        f" {info['etcd']}; load average {r.notes['load_average_at_start']}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="ipward-bench-k8s-store-") as tmp_name,
        kube_apiserver(executable, Path(tmp_name)) as lab,
    ):
        tmp = Path(tmp_name)
        with contextlib.ExitStack() as stack:
            sides = [k8s_side(stack, lab, tmp, out), etcd_side(stack, tmp, out)]
            measure_load(sides, sizes, out)
            measure_exec(sides, tmp, sizes.exec_runs, r, out)
            errors = {f"{side.name}: {k}": e for side in sides for k, e in side.errors().items()}
            for side in sides:
                r.figures[f"k8s_store.{side.name}.busy_retried"] = float(side.busy())
            out("  ... stopping the load's agents, controllers and etcd")
        load_figures(sides, r)
        fill = measure_fill(
            lab,
            tmp,
            sizes.records,
            sizes.reconcile_passes,
            (sizes.relist_processes, sizes.relist_threads),
            out,
        )
        r.figures.update({f"k8s_store.fill.{name}": value for name, value in fill.items()})
    elapsed = time.perf_counter() - began
    r.notes["load_average_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    r.notes["elapsed_s"] = f"{elapsed:.1f}"
    r.tables.update(
        load=load_rows(r.figures),
        cost=cost_rows(r.figures),
        exec=exec_rows(r.figures, sizes.exec_runs),
        fill=fill_rows(fill),
    )
    for rows in r.tables.values():
        out("")
        print_table(rows, out)
    _print_targets(r, errors, out)
    for line in NOTES:
        out(line)
    out(f"  whole run: {elapsed:.0f} s; load average at the end {r.notes['load_average_at_end']}")
    return r.with_errors(info, errors)


def measure_exec(
    sides: list[Side], tmp: Path, runs: int, r: Results, out: Callable[[str], object]
) -> None:
    """The node's plugin (native, as `install-cni --standalone` installs it) exec'd for
    ADD through an agent of each store, interleaved run by run with host-local's exec
    (and the Python plugin's, and a bare interpreter's): figures and, where host-local
    is installed, the native plugin's median over host-local's; on etcd with its target
    (on k8s:// an ADD is two API updates: reported beside it)."""
    out(
        f"  ... plugin exec through an agent of each store: {runs} ADDs each of the native"
        " plugin, the Python plugin, host-local and a bare interpreter, interleaved"
    )
    for side in sides:
        exec_dir = tmp / f"exec-{side.name}"
        exec_dir.mkdir()
        figures = agent_exec_latency(exec_dir, str(side.agents[0].socket), runs)
        for key, value in figures.items():
            r.figures[f"k8s_store.{side.name}.exec.{key}"] = float(value)
        host_local = figures.get("host_local.median_ms")
        if host_local:
            ratio = figures["ipward_native.median_ms"] / host_local
            r.figures[f"k8s_store.{side.name}.exec.native_vs_host_local"] = ratio
            if side.name == "etcd":
                r.targets["k8s_store.etcd.exec.native_vs_host_local"] = {
                    "value": ratio,
                    "target": f"<= {TARGET_NATIVE_VS_HOST_LOCAL:.2f}x host-local",
                    "met": ratio <= TARGET_NATIVE_VS_HOST_LOCAL,
                }


def exec_rows(f: dict[str, float], runs: int) -> list[list[str]]:
    rows = [[f"plugin exec, ADD ({runs} runs)", "median ms", "p99 ms", "over host-local"]]
    for side in ("k8s", "etcd"):
        host_local = f.get(f"k8s_store.{side}.exec.host_local.median_ms")
        for kind, label in (
            ("ipward_native", f"native ipward, through an agent on {side}"),
            ("ipward", f"Python ipward, through an agent on {side}"),
        ):
            median = f.get(f"k8s_store.{side}.exec.{kind}.median_ms")
            if median is None:
                continue
            ratio = f"{median / host_local:.2f}x" if host_local else "no host-local"
            p99 = f[f"k8s_store.{side}.exec.{kind}.p99_ms"]
            rows.append([label, f"{median:.2f}", f"{p99:.2f}", ratio])
        if host_local is not None:
            p99 = f[f"k8s_store.{side}.exec.host_local.p99_ms"]
            rows.append([f"host-local (beside {side}'s)", f"{host_local:.2f}", f"{p99:.2f}", ""])
    return rows


def _print_targets(r: Results, errors: dict[str, str], out: Callable[[str], object]) -> None:
    f = r.figures
    out("")
    add = r.targets["k8s_store.k8s.add_32.vs_raw"]
    out(
        f"  ADDs/s at 32-way through one agent, over the raw update rate of 32 writers:"
        f" {add['value']:.2f}x (target {add['target']}: {verdict(add['met'])})"
    )
    writes = r.targets["k8s_store.k8s.add_1.writes_less_idle_per_op"]
    out(
        f"  API writes per ADD alone: {writes['value']:.2f} (every write of the phase,"
        f" {f['k8s_store.k8s.add_1.writes_per_op']:.2f} an ADD, less the idle store's"
        f" {f['k8s_store.k8s.idle.writes_per_s']:.1f} writes/s; target {writes['target']}:"
        f" {verdict(writes['met'])})"
    )
    out(
        f"  API writes per ADD at 32-way: {f['k8s_store.k8s.add_32.writes_per_op']:.2f}"
        f" through one agent, {f['k8s_store.k8s.add_32x3.writes_per_op']:.2f} across"
        f" {AGENTS} agents"
    )
    native = r.targets.get("k8s_store.etcd.exec.native_vs_host_local")
    if native is not None:
        out(
            f"  native plugin's ADD exec through an agent on etcd, over host-local's:"
            f" {native['value']:.2f}x (target {native['target']}: {verdict(native['met'])});"
            f" on k8s:// {f['k8s_store.k8s.exec.native_vs_host_local']:.2f}x (two API updates)"
        )
    busy = {side: f[f"k8s_store.{side}.busy_retried"] for side in ("k8s", "etcd")}
    out(
        "  calls made again after a 'busy' answer (the callers share one process): "
        + ", ".join(f"{side} {n:.0f}" for side, n in busy.items())
    )
    if errors:
        for key, what in sorted(errors.items()):
            out(f"  ERRORS: {key}: {what}")
    else:
        out("  errors: none")


NOTES = [
    "",
    "  1: ops/s = operations done over the wall time of their phases; an ADD phase adds",
    f"     until each node holds {NODE_HELD}, its DEL phase deletes them; raw = each writer",
    "     its own object (API: PUT with its resourceVersion; etcd: get + txn on",
    "     mod_revision); vs raw = over the raw rate at the same concurrency.",
    "  2: API writes = every write request the API server answered in the phase (every",
    "     resource: leases and the controller's too); per op of the phase.",
    "  3: the fill in a namespace of its own; the agent and controller as --scale runs",
    "     them; relist = the node index's whole read and the read a watch starts from.",
]
