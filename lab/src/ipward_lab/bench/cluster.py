"""`ipward bench --cluster`: N real `ipward agent` processes (`fleet.Agent`) on one
temporary etcd (`servers.etcd`), C client threads per agent looping ADD then DEL through the
plugin's own socket call, next to raw etcd CAS by as many threads in the same run (the
loads take turns in rounds); then plugin exec ADD through an agent."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ipward.store.base import Put, Store, at_revision
from ipward_lab.bench.common import (
    AGENT_READY_TIMEOUT,
    CNI_BIN_DIR,
    HOST_LOCAL,
    PLUGIN_PYTHON,
    BenchError,
    Results,
    machine,
    percentile_ms,
    plural,
    print_table,
    stop_process,
    verdict,
)
from ipward_lab.bench.plugin_exec import (
    exec_kinds,
    exec_rates,
    interleaved_adds,
    ipam_config,
    native_exec,
)
from ipward_lab.fleet import Agent, FleetError, run_cli
from ipward_lab.servers.etcd import ETCD, etcd_server

CLUSTER_POOL = "benchcluster"
CLUSTER_SUBNET = "10.64.0.0/14"
CLUSTER_BLOCK_V4 = 26
AGENT_MAX_WORKERS = 16  # the agent's default --max-workers, which the bench leaves as is
TARGET_CLUSTER_VS_CAS = 0.5  # aggregate ADDs/s >= 0.5 x raw CAS/s at the same concurrency
TARGET_AGENT_EXEC_OVER_PYTHON_MS = 5.0  # plugin ADD (through the agent) - bare interpreter
TARGET_NATIVE_VS_HOST_LOCAL = 1.0  # the native plugin's ADD median over host-local's (issue 29)
EXEC_RATE_CONCURRENCY = 32  # execs at once for the exec-bound rate of a node


# The bench's callers are threads of one process, which the agent lets have at most
# MAX_READING_PER_PROCESS requests being read at once (a plugin call is a process of its
# own): a call it answers "busy" (11, nothing done) is made again, as a runtime retries.
BUSY = b"ipward agent busy"
BUSY_RETRIES = 100


class AgentCaller:
    """One client thread of the cluster load: ADD then DEL of a new attachment, again and
    again, through `forward()` to its agent (what the plugin executable does)."""

    def __init__(self, index: int, socket_path: str) -> None:
        self.index = index
        self.socket = socket_path
        self.stdin = ipam_config(
            {"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL}
        )
        self.base_env = {
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/bench",
            "CNI_PATH": CNI_BIN_DIR,
        }
        self.seq = 0
        self.adds = 0  # successful ADDs measured
        self.dels = 0
        self.add_s: list[float] = []
        self.del_s: list[float] = []
        self.allocs = 0  # successful ADDs of the ADD-only phases
        self.alloc_s: list[float] = []
        self.held: list[str] = []
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}
        self.busy = 0  # calls made again after a "busy" answer (BUSY)

    def call(self, command: str, container: str) -> tuple[bool, float]:
        from ipward.cni.plugin import forward

        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        for _ in range(BUSY_RETRIES + 1):
            try:
                status, out = forward(self.socket, env, self.stdin)
            except Exception as e:  # what the plugin answers then: 11, try again later
                answer = {"code": 11, "msg": f"{type(e).__name__}: {e}"}
                status, out = 1, json.dumps(answer).encode()
            if status == 0 or BUSY not in out:
                break
            self.busy += 1
        elapsed = time.perf_counter() - start
        if status != 0:
            try:
                code = str(json.loads(out).get("code"))
            except (ValueError, AttributeError):
                code = "?"
            key = f"{command} code {code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            self.examples.setdefault(key, out.decode(errors="replace").strip()[:300])
        return status == 0, elapsed

    def loop(self, pairs: int | None, seconds: float | None, measured: bool) -> None:
        """ADD+DEL pairs until `pairs` are done or `seconds` have passed."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (pairs is None or done < pairs) and clock() < deadline:
            container = f"c{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            deleted, del_s = self.call("DEL", container)  # also after a failed ADD, as a runtime
            done += 1
            if measured:
                self.add_s.append(add_s)
                self.del_s.append(del_s)
                self.adds += added
                self.dels += deleted

    def allocate_only(self, ops: int | None, seconds: float | None) -> None:
        """ADDs of new attachments only, kept (the allocation rate): `ops` of them, or
        for `seconds`."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (ops is None or done < ops) and clock() < deadline:
            container = f"k{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            done += 1
            self.alloc_s.append(add_s)
            if added:
                self.allocs += 1
                self.held.append(container)

    def release_held(self, measured: bool = False) -> None:
        """DEL what allocate_only kept (`measured`: each DEL's time and success, as
        `loop` counts them)."""
        while self.held:
            deleted, del_s = self.call("DEL", self.held.pop())
            if measured:
                self.del_s.append(del_s)
                self.dels += deleted


class CasClient:
    """One thread of the reference: get + txn(compare mod_revision, put) on a key of its
    own, through a store client it shares with the other threads of its group."""

    def __init__(self, store: Store, key: str) -> None:
        self.store = store
        self.key = key
        self.count = 0
        self.cas_s: list[float] = []

    def loop(self, n: int | None, seconds: float | None, measured: bool) -> None:
        get, txn, key = self.store.get, self.store.txn, self.key
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (n is None or done < n) and clock() < deadline:
            start = clock()
            kv = get(key)
            result = txn([at_revision(key, kv.mod_revision if kv else 0)], [Put(key, b"%d" % done)])
            elapsed = clock() - start
            if not result.succeeded:
                raise BenchError(f"CAS on {key} failed: something else writes the bench key")
            done += 1
            if measured:
                self.cas_s.append(elapsed)
                self.count += 1


def parallel(work: Sequence[Callable[[], None]]) -> float:
    """Run each callable in a thread of its own, all released at once; returns the
    seconds from the release to the end of the last one. Re-raises the first failure."""
    barrier = threading.Barrier(len(work) + 1)
    failures: list[BaseException] = []

    def target(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as e:  # handed to the caller after every thread has ended
            failures.append(e)

    threads = [threading.Thread(target=target, args=(fn,), daemon=True) for fn in work]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return elapsed


def etcd_counters(client_url: str) -> dict[str, float] | None:
    """etcd's own counts (from its /metrics): Txn and Range calls served, WAL fsyncs;
    None when they cannot be read (the figures are diagnostics, not the measurement)."""
    counts = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
    try:
        with urllib.request.urlopen(client_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                if 'grpc_method="Txn"' in line:
                    counts["txn"] += float(line.rsplit(" ", 1)[1])
                elif 'grpc_method="Range"' in line:
                    counts["range"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_disk_wal_fsync_duration_seconds_count "):
                counts["fsync"] = float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return counts


class _Counted:
    """etcd's counts summed over the phases of one kind."""

    def __init__(self, client_url: str) -> None:
        self.client_url = client_url
        self.sums: dict[str, float] | None = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
        self.seconds = 0.0

    def measure(self, phase: Callable[[], float]) -> float:
        before = etcd_counters(self.client_url)
        elapsed = phase()
        after = etcd_counters(self.client_url)
        self.seconds += elapsed
        if before is None or after is None or self.sums is None:
            self.sums = None
        else:
            for k in self.sums:
                self.sums[k] += after[k] - before[k]
        return elapsed


def agent_exec_latency(tmp: Path, socket_path: str, runs: int, warmup: int = 5) -> dict[str, float]:
    """ADD exec latency of the installed plugin (Python) and of the native plugin, each
    forwarding to the agent at `socket_path` (`agentSocket` in its config), of a bare
    interpreter and of host-local, interleaved run by run; DEL of every ADD afterwards
    (not timed)."""
    kinds = exec_kinds(tmp, {"ipward": _agent_config(socket_path)})
    kinds["ipward_native"] = native_exec(tmp, _agent_config(socket_path))
    return interleaved_adds(kinds, runs, warmup)


def _agent_config(socket_path: str) -> bytes:
    return ipam_config({"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL})


def agent_exec_rate(
    tmp: Path, socket_path: str, concurrency: int, seconds: float, rounds: int
) -> dict[str, float]:
    """The exec-bound rate of a node: plugin ADDs per second through the agent at
    `socket_path` with `concurrency` execs at once, next to bare interpreter starts per
    second at the same concurrency, taking turns (`exec_rates`)."""
    kinds = exec_kinds(tmp, {"ipward": _agent_config(socket_path)})
    kinds.pop("host_local", None)
    return exec_rates(kinds, concurrency, seconds, rounds)


def run_cluster(
    agents: int = 3,
    concurrency: int = 8,
    duration: float | None = None,
    quick: bool = False,
    out: Callable[[str], object] = print,
    operations: int | None = None,
    chunks: int | None = None,
) -> dict:
    """`agents` real agent processes on one temporary etcd, `concurrency` client threads
    per agent looping ADD then DEL through `forward()`, next to raw etcd CAS by as many
    threads (one store client per `concurrency` threads, like the agents), the two loads
    taking turns in `chunks`; then plugin exec ADD through an agent next to a bare
    interpreter and host-local. Each load runs `duration` seconds in all (20, --quick 4)
    or, with `operations`, that many ADD+DEL pairs (and raw CAS) per thread in all.
    Prints a report with `out`; returns {"machine", "figures", "targets", "errors",
    "notes"} like `run`."""
    if agents < 1 or concurrency < 1:
        raise BenchError("--agents and --concurrency must be at least 1")
    if not os.access(ETCD, os.X_OK):
        raise BenchError(f"{ETCD} is missing (Debian package etcd-server): --cluster needs it")
    began = time.perf_counter()
    chunks = chunks or (2 if quick else 4)
    if duration is None:
        duration = 4.0 if quick else 20.0
    rounds = _Rounds(
        chunks,
        None if operations is None else max(operations // chunks, 1),
        None if operations is not None else duration / chunks,
        3 if quick else 10,
    )
    exec_runs = 40 if quick else 200
    rate_seconds = 2.0 if quick else 10.0
    r = Results()
    info = machine()
    out(
        f"ipward bench --cluster{' --quick' if quick else ''}: {plural(agents, 'agent')} x"
        f" {concurrency} concurrent ADDs on one etcd; {info['nproc']} CPUs ({info['platform']})"
    )
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="ipward-bench-cluster-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        server = stack.enter_context(etcd_server(tmp / "etcd"))
        out("  ... etcd up")
        procs = start_agents(stack, tmp, server.url, agents, out)
        stores = etcd_clients(stack, server.url, agents)
        threads = agents * concurrency
        clients = [AgentCaller(i, str(procs[i // concurrency].socket)) for i in range(threads)]
        cas = [CasClient(stores[i // concurrency], f"bench/cas/{i}") for i in range(threads)]
        counted = _measure(clients, cas, f"http://{server.endpoint}", rounds, out)
        errors, examples = _load_figures(clients, cas, counted, r)
        _agent_exec(tmp, str(procs[0].socket), exec_runs, rate_seconds, out, r)
        out(f"  ... stopping {plural(agents, 'agent')} and etcd")
    # (agents and etcd are stopped here, also when anything above failed)

    rows = _load_rows(r, agents, concurrency)
    exec_rows = _exec_rows(r, exec_runs)
    elapsed = time.perf_counter() - began
    _print_tables(rows, exec_rows, errors, examples, clients, r.figures, out)
    for line in CLUSTER_NOTES:
        out(line)
    if concurrency > AGENT_MAX_WORKERS:
        out(
            f"     An agent serves {AGENT_MAX_WORKERS} calls at a time (its default"
            " --max-workers); the other callers wait in its listen backlog."
        )
    out(f"  whole run: {elapsed:.1f} s")
    r.notes["elapsed_s"] = f"{elapsed:.1f}"
    r.notes["agents"] = str(agents)
    r.notes["concurrency"] = str(concurrency)
    r.tables.update(cluster=rows, exec=exec_rows)
    return r.with_errors(info, errors)


CLUSTER_NOTES = [
    "",
    "  1: client threads call their agent through forward() (the plugin's own socket",
    "     call); per s = successful calls over the wall time of the rounds. Each round:",
    "     ADD+DEL loop, raw CAS (get + txn(compare mod_revision, put) on a key per thread),",
    "     then ADD only (the allocation rate; what it allocated is deleted after, untimed).",
]


def _print_tables(
    rows: list[list[str]],
    exec_rows: list[list[str]],
    errors: dict[str, int],
    examples: dict[str, str],
    clients: list[AgentCaller],
    f: dict[str, float],
    out: Callable[[str], object],
) -> None:
    out("")
    print_table(rows, out)
    if errors:
        for key, count in sorted(errors.items()):
            out(f"  ERRORS: {key}: {count} (first: {examples[key]})")
    else:
        out(f"  errors: none in {sum(len(c.add_s) for c in clients)} measured ADD+DEL pairs")
    if "cluster.etcd_txn_per_pair" in f:
        out(
            f"  etcd served {f['cluster.etcd_txn_per_pair']:.2f} Txn and"
            f" {f['cluster.etcd_range_per_pair']:.2f} Range calls per ADD+DEL pair"
            f" (raw CAS: {f['cluster.cas_etcd_txn_per_cas']:.2f} Txn per CAS);"
            f" WAL fsyncs/s {f['cluster.etcd_fsync_per_s']:.0f}"
            f" (raw CAS: {f['cluster.cas_etcd_fsync_per_s']:.0f})"
        )
    out("")
    print_table(exec_rows, out)


@dataclass(frozen=True)
class _Rounds:
    """How the loads take turns: `chunks` rounds of `ops` per thread or `seconds` each,
    after `warm_pairs` ADD+DEL pairs (and raw CAS) per thread."""

    chunks: int
    ops: int | None
    seconds: float | None
    warm_pairs: int


def start_agents(
    stack: contextlib.ExitStack, tmp: Path, url: str, agents: int, out: Callable[[str], object]
) -> list[Agent]:
    """The pool on the store at `url`, made as a user makes it (`ipward pool create`: on
    the Kubernetes store an IPPool object, which the controller then keeps the status
    of), and `agents` agents on it (fleet.Agent, answering; sockets and logs in `tmp`),
    each stopped by `stack`."""
    made = run_cli(
        "pool",
        "create",
        CLUSTER_POOL,
        "--range",
        CLUSTER_SUBNET,
        "--cooldown",
        "0",
        "--block-v4",
        str(CLUSTER_BLOCK_V4),
        store=url,
    )
    if made.returncode != 0:
        raise BenchError(f"ipward pool create {CLUSTER_POOL}: {made.stderr.strip()[-500:]}")
    out(
        f"  ... pool {CLUSTER_POOL} {CLUSTER_SUBNET} (/{CLUSTER_BLOCK_V4} blocks, cooldown 0);"
        f" starting {plural(agents, 'agent')}"
    )
    procs: list[Agent] = []
    for i in range(agents):
        agent = Agent(
            f"bench-node-{i}",
            url,
            tmp / "sockets" / f"agent-{i}.sock",
            tmp / "agent-logs",
            metrics=False,
            log_level="info",  # no line per request: the agents are measured
        )
        stack.callback(stop_process, agent)  # stopped before the store (the stack unwinds)
        procs.append(agent)
    deadline = time.monotonic() + AGENT_READY_TIMEOUT
    try:
        for agent in procs:
            agent.wait_ready(max(deadline - time.monotonic(), 0.0))
    except FleetError as e:
        raise BenchError(str(e)) from None
    return procs


def etcd_clients(stack: contextlib.ExitStack, url: str, count: int) -> list[Store]:
    """`count` store clients of the etcd at `url` for raw CAS threads, closed by `stack`."""
    from ipward.store.etcd import EtcdStore  # grpc: only when etcd is measured

    stores: list[Store] = []
    for _ in range(count):
        store = EtcdStore.from_url(url)
        stack.callback(store.close)
        stores.append(store)
    return stores


def _measure(
    clients: list[AgentCaller],
    cas: list[CasClient],
    client_url: str,
    rounds: _Rounds,
    out: Callable[[str], object],
) -> dict[str, _Counted]:
    """Warm up, then the rounds: ADD+DEL through the agents, raw CAS, ADD only (released
    after, untimed); etcd's counts of each kind of phase."""
    warm = rounds.warm_pairs
    out(f"  ... warm-up: {warm} ADD+DEL pairs and {warm} raw CAS per thread")
    parallel([partial(c.loop, warm, None, False) for c in clients])
    parallel([partial(c.loop, warm, None, False) for c in cas])
    ops, seconds = rounds.ops, rounds.seconds
    size = f"{ops} per thread" if ops else f"{seconds:.1f} s"
    out(
        f"  ... {rounds.chunks} rounds of {size} each: {len(clients)} threads of ADD+DEL"
        " through the agents, then of raw CAS, then of ADD only (deleted after, untimed)"
    )
    counted = {kind: _Counted(client_url) for kind in ("cluster", "cas", "alloc")}
    cluster_load = [partial(c.loop, ops, seconds, True) for c in clients]
    cas_load = [partial(c.loop, ops, seconds, True) for c in cas]
    alloc_load = [partial(c.allocate_only, ops, seconds) for c in clients]
    for _ in range(rounds.chunks):
        counted["cluster"].measure(partial(parallel, cluster_load))
        counted["cas"].measure(partial(parallel, cas_load))
        counted["alloc"].measure(partial(parallel, alloc_load))
        parallel([c.release_held for c in clients])
    return counted


def _load_figures(
    clients: list[AgentCaller], cas: list[CasClient], counted: dict[str, _Counted], r: Results
) -> tuple[dict[str, int], dict[str, str]]:
    """The load's figures and target into `r`; the errors by kind and an example of each."""
    adds = sum(c.adds for c in clients)
    dels = sum(c.dels for c in clients)
    pairs = sum(len(c.add_s) for c in clients)
    add_s = [x for c in clients for x in c.add_s]
    del_s = [x for c in clients for x in c.del_s]
    cas_s = [x for c in cas for x in c.cas_s]
    n_cas = sum(c.count for c in cas)
    if not adds or not n_cas:
        raise BenchError("no ADD succeeded: see the errors" if n_cas else "no CAS measured")
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for c in clients:
        for key, count in c.errors.items():
            errors[key] = errors.get(key, 0) + count
        for key, text in c.examples.items():
            examples.setdefault(key, text)
    figures = r.figures
    cluster_s, cas_wall = counted["cluster"].seconds, counted["cas"].seconds
    figures["cluster.add_per_s"] = adds / cluster_s
    figures["cluster.del_per_s"] = dels / cluster_s
    figures["cluster.alloc_per_s"] = sum(c.allocs for c in clients) / counted["alloc"].seconds
    figures["cluster.raw_cas_per_s"] = n_cas / cas_wall
    alloc_s = [x for c in clients for x in c.alloc_s]
    for name, samples in (("add", add_s), ("del", del_s), ("cas", cas_s), ("alloc", alloc_s)):
        for q in (50, 90, 99):
            figures[f"cluster.{name}_p{q}_ms"] = percentile_ms(samples, q)
    # The target is on allocations per second: the ADD-only phases.
    ratio = figures["cluster.alloc_per_s"] / figures["cluster.raw_cas_per_s"]
    figures["cluster.vs_cas"] = ratio
    figures["cluster.pairs_vs_cas"] = (
        figures["cluster.add_per_s"] / figures["cluster.raw_cas_per_s"]
    )
    figures["cluster.pairs"] = float(pairs)
    figures["cluster.cas"] = float(n_cas)
    r.targets["cluster.vs_cas"] = {
        "value": ratio,
        "target": f">= {TARGET_CLUSTER_VS_CAS}",
        "met": ratio >= TARGET_CLUSTER_VS_CAS,
    }
    cluster_sums, cas_sums = counted["cluster"].sums, counted["cas"].sums
    if cluster_sums is not None and cas_sums is not None:
        figures["cluster.etcd_txn_per_pair"] = cluster_sums["txn"] / pairs
        figures["cluster.etcd_range_per_pair"] = cluster_sums["range"] / pairs
        figures["cluster.etcd_fsync_per_s"] = cluster_sums["fsync"] / cluster_s
        figures["cluster.cas_etcd_txn_per_cas"] = cas_sums["txn"] / n_cas
        figures["cluster.cas_etcd_fsync_per_s"] = cas_sums["fsync"] / cas_wall
    return errors, examples


def _agent_exec(
    tmp: Path,
    socket_path: str,
    exec_runs: int,
    rate_seconds: float,
    out: Callable[[str], object],
    r: Results,
) -> None:
    """Plugin exec through the agent at `socket_path`, ADD latency (target) and the
    exec-bound rate: figures and target into `r`."""
    out(
        f"  ... plugin exec: {exec_runs} ADDs each of python, ipward (through agent 0),"
        " host-local and the native ipward (through agent 0), interleaved"
    )
    exec_dir = tmp / "exec"
    exec_dir.mkdir()
    ex = agent_exec_latency(exec_dir, socket_path, exec_runs)
    for key, value in ex.items():
        r.figures[f"exec.{key}"] = float(value)
    diff = r.figures["exec.ipward.median_ms"] - r.figures["exec.python.median_ms"]
    r.figures["exec.ipward_minus_python_ms"] = diff
    r.targets["exec.ipward_minus_python_ms"] = {
        "value": diff,
        "target": f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS} ms",
        "met": diff <= TARGET_AGENT_EXEC_OVER_PYTHON_MS,
    }
    if "exec.host_local.median_ms" in r.figures:
        host_local = r.figures["exec.host_local.median_ms"]
        for kind in ("ipward", "ipward_native"):
            r.figures[f"exec.{kind}_vs_host_local"] = (
                r.figures[f"exec.{kind}.median_ms"] / host_local
            )
        ratio = r.figures["exec.ipward_native_vs_host_local"]
        r.targets["exec.ipward_native_vs_host_local"] = {
            "value": ratio,
            "target": f"<= {TARGET_NATIVE_VS_HOST_LOCAL:.2f}x host-local",
            "met": ratio <= TARGET_NATIVE_VS_HOST_LOCAL,
        }
    out(
        f"  ... exec-bound rate: {EXEC_RATE_CONCURRENCY} ADD execs at once through agent 0,"
        f" then {EXEC_RATE_CONCURRENCY} bare interpreter starts at once, taking turns"
    )
    rate_dir = tmp / "exec-rate"
    rate_dir.mkdir()
    rates = agent_exec_rate(rate_dir, socket_path, EXEC_RATE_CONCURRENCY, rate_seconds, 2)
    r.figures["exec.ipward_add_per_s"] = rates["ipward"]
    r.figures["exec.python_starts_per_s"] = rates["python"]
    r.figures["exec.add_vs_python_starts"] = rates["ipward"] / rates["python"]


def _load_rows(r: Results, agents: int, concurrency: int) -> list[list[str]]:
    """The console table of the load (figure 1 of --cluster)."""
    f = r.figures
    met = r.targets["cluster.vs_cas"]["met"]
    heading = (
        f"1. {plural(agents, 'agent')} x {concurrency}, one etcd ({agents * concurrency} threads)"
    )
    rows = [[heading, "per s", "p50 ms", "p90 ms", "p99 ms", "vs CAS", "target"]]
    lines = [
        (
            f"raw etcd CAS, {plural(agents, 'client')} x {concurrency} threads",
            "raw_cas",
            "cas",
            "1.00x",
            "",
        ),
        (
            "ADD only (allocations)",
            "alloc",
            "alloc",
            f"{f['cluster.vs_cas']:.2f}x",
            f">= {TARGET_CLUSTER_VS_CAS}x {verdict(met)}",
        ),
        ("ADD in an ADD+DEL loop", "add", "add", f"{f['cluster.pairs_vs_cas']:.2f}x", ""),
        ("DEL through the agents", "del", "del", "", ""),
    ]
    for label, rate, latency, vs_cas, target in lines:
        rows.append(
            [
                label,
                f"{f[f'cluster.{rate}_per_s']:.0f}",
                *(f"{f[f'cluster.{latency}_p{q}_ms']:.2f}" for q in (50, 90, 99)),
                vs_cas,
                target,
            ]
        )
    return rows


def _exec_rows(r: Results, exec_runs: int) -> list[list[str]]:
    """The console table of plugin exec through the agent (figure 2 of --cluster)."""
    f = r.figures
    exec_rows = [[f"2. exec latency ({exec_runs} runs)", "median ms", "p99 ms", ""]]
    labels = {
        "python": f"{PLUGIN_PYTHON} -I -S -c pass",
        "host_local": "host-local ADD",
        "ipward": "ipward ADD (through the agent)",
        "ipward_native": "native ipward ADD (through the agent)",
    }
    for kind, label in labels.items():
        if f"exec.{kind}.median_ms" in f:
            exec_rows.append(
                [label, f"{f[f'exec.{kind}.median_ms']:.2f}", f"{f[f'exec.{kind}.p99_ms']:.2f}", ""]
            )
        else:
            exec_rows.append([label, "skipped", f"({HOST_LOCAL} is missing)", ""])
    met = r.targets["exec.ipward_minus_python_ms"]["met"]
    exec_rows.append(
        [
            "ipward - python (median)",
            f"{f['exec.ipward_minus_python_ms']:+.2f}",
            "",
            f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS:.0f} ms {verdict(met)}",
        ]
    )
    if "exec.ipward_native_vs_host_local" in f:
        met = r.targets["exec.ipward_native_vs_host_local"]["met"]
        exec_rows.append(
            [
                "native ipward / host-local (median)",
                f"{f['exec.ipward_native_vs_host_local']:.2f}x",
                "",
                f"<= {TARGET_NATIVE_VS_HOST_LOCAL:.2f}x {verdict(met)}",
            ]
        )
        exec_rows.append(
            [
                "ipward (Python) / host-local (median)",
                f"{f['exec.ipward_vs_host_local']:.2f}x",
                "",
                "",
            ]
        )
    exec_rows.append([f"exec-bound rate, {EXEC_RATE_CONCURRENCY} at once", "per s", "", ""])
    exec_rows.append(
        [f"{PLUGIN_PYTHON} -I -S starts", f"{f['exec.python_starts_per_s']:.0f}", "", ""]
    )
    exec_rows.append(
        [
            "ipward ADDs through the agent",
            f"{f['exec.ipward_add_per_s']:.0f}",
            "",
            f"{f['exec.add_vs_python_starts']:.2f}x the starts (the node's ceiling)",
        ]
    )
    return exec_rows
