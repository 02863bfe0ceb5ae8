"""`ipward bench --scale`: how the costs grow up to Kubernetes' own limits (5,000 nodes,
150,000 pods), on one temporary etcd (`servers.etcd`) grown stage by stage
(`ScaleCluster`). At every stage, with real processes (`fleet`):

  * the probe: a real agent on a node holding AGENT_PODS records, its runtime the
    simulated one: its memory after its first reconcile pass, and its pass time (as
    its "reconciled" lines say);
  * a real controller (`sim://` cluster state: every pod and node), its passes on
    demand (SIGUSR1): its memory, its first pass, and the steady pass: the one after 1%
    of the pods got a new sandbox while it ran idle (its watch receiving the change);
  * real agents on the agent nodes under ADD+DEL churn through the installed plugin,
    in rounds with the controller running, then paused (SIGSTOP: no CPU, nothing sent
    to etcd), the ADDs' latency of each kind of round.
Plus the fill's own figures: time, etcd's database size per allocation, blocks per
node. Every figure is reported by stage (a table and a plot, `ipward_lab.report`) with
its target and a reference from the same run. Nothing here passes or fails on speed.

The measured processes are what the product runs: a faster store read (a per-node
index, a controller view kept from a watch) shows in the same figures unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ipward.agent.duties import NodeDuties
from ipward.agent.node_index import entry_held
from ipward.cluster.liveness import open_source
from ipward.core import keys
from ipward.core.policy import ADD_GRACE, DUTY_INTERVAL, KEEPALIVES_PER_TTL, NODE_TTL
from ipward.gc.clocks import OWN_CLOCK
from ipward.gc.rules import gather, judge
from ipward.ipam.check import check
from ipward.store import open_store
from ipward_lab.bench.common import (
    AGENT_READY_TIMEOUT,
    ETCD,
    PLUGIN_PYTHON,
    BenchError,
    Console,
    Results,
    count_label,
    machine,
    percentile_ms,
    plural,
    print_table,
    settled_memory,
    stop_process,
    verdict,
)
from ipward_lab.bench.plugin_exec import ExecError, exec_kinds, ipam_config
from ipward_lab.bench.scale_cluster import (
    AGENT_PODS,
    REGISTRATION_TTL,
    SCALE_POOL,
    ScaleCluster,
)
from ipward_lab.fleet import Agent, Controller, FleetError
from ipward_lab.servers.etcd import etcd_server

FULL_STAGES = (1_000, 1_500, 10_000, 50_000, 150_000)
QUICK_STAGES = (1_000, 1_500, 10_000)
REFERENCE_RECORDS = 1_500  # the controller's reference pass (else the first stage's)
CHECK_LIMIT = 10_000  # `ipward check` on the bulk state up to this many records
CONTROLLER_INTERVAL = 0.5  # seconds between its passes in the churn: back to back, nearly
RECONCILE_EVERY = 0.1  # seconds between the probe agent's passes (its option's least)
CONTROLLER_IDLE = 3600  # its own interval: passes come when the bench asks (SIGUSR1)
CONTROLLER_LEASE_TTL = 600  # a paused controller stays leader
PROCESS_TIMEOUT = 600.0  # for a pass of a real process at the largest stage
PLOT_SCALE = "scale-growth.png"

TARGET_ADD_P99_VS_PAUSED = 1.5
TARGET_AGENT_HWM_MIB = 60.0
TARGET_RECONCILE_SPREAD = 1.2
TARGET_CONTROLLER_HWM_MIB = 500.0
TARGET_PASS_VS_REFERENCE = 10.0


@dataclass(frozen=True)
class ScaleSizes:
    """How much of each: record counts by stage; agent nodes (AGENT_PODS records each;
    the churn runs on them); churn loops per agent; round pairs (controller running,
    then paused) of `round_seconds` each; reconcile passes timed; node duties timed (each
    of a keepalive and a look for marked blocks: fewer nodes, each more than once)."""

    stages: Sequence[int]
    agents: int = 2
    churn_threads: int = 2
    rounds: int = 3
    round_seconds: float = 8.0
    reconcile_passes: int = 100  # a pass is under a millisecond: many, for a steady median
    duty_samples: int = 500  # etcd's CPU is counted in 10 ms ticks: many, for a steady figure


FULL = ScaleSizes(FULL_STAGES)
QUICK = ScaleSizes(QUICK_STAGES, agents=1, churn_threads=2, rounds=2, round_seconds=3.0)


def scale_sizes(quick: bool, records: int | None) -> ScaleSizes:
    """The sizes of `--scale [--quick] [--records N]`: the standard stages below N, then N."""
    sizes = QUICK if quick else FULL
    if records is None:
        return sizes
    stages = (*(n for n in FULL_STAGES if n < records), records)
    return dataclasses.replace(sizes, stages=stages)


def _wait(what: str, done: Callable[[], bool], proc: Agent | Controller, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if not proc.running:
            raise BenchError(f"{proc.name} exited while waiting for {what}:\n{proc.output()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{proc.name}: no {what} after {timeout:.0f} s:\n{proc.output()}")
        time.sleep(0.05)


# -- the probe agent ------------------------------------------------------------------


RECONCILE_FAILURES = ("reconcile: store unreachable", "reconcile failed")


def _reconciles(agent: Agent, passes: int) -> bool:
    """Whether `passes` reconcile passes are logged; BenchError once three have failed
    (a pass that cannot read the store at this size will not, however long one waits)."""
    failures = [line for msg in RECONCILE_FAILURES for line in agent.logged(msg)]
    if len(failures) >= 3:
        raise BenchError(f"{agent.name}: reconcile passes fail: {failures[-1]}")
    return len(agent.logged("reconciled")) >= passes


def probe_agent(cluster: ScaleCluster, tmp: Path, passes: int) -> dict[str, float]:
    """A real agent on the first agent node, its runtime listing that node's sandboxes,
    reconciling every RECONCILE_EVERY seconds: VmRSS/VmHWM once its first pass is logged,
    then the time of `passes` more (as each "reconciled" line says: the pass measured by the agent,
    which a gap between lines blurs by a timestamp's millisecond and the wait's jitter).
    Each pass must find the node's AGENT_PODS records and free none."""
    node = cluster.agent_nodes[0]
    agent = Agent(
        node,
        cluster.url,
        tmp / "sockets" / f"probe-{cluster.records}.sock",
        tmp / "logs",
        extra=(
            "--liveness",
            f"sim://{cluster.runtime_state(node)}",
            "--reconcile-interval",
            str(RECONCILE_EVERY),
        ),
        metrics=False,
    )
    work: subprocess.Popen[str] | None = None
    try:
        agent.wait_started(AGENT_READY_TIMEOUT)
        _wait("reconcile pass", partial(_reconciles, agent, 1), agent, PROCESS_TIMEOUT)
        memory = settled_memory(agent.pid)
        timeout = PROCESS_TIMEOUT * passes
        work = _start_pass_work(cluster, node, passes)  # alongside the passes timed
        _wait(
            f"{passes + 1} reconcile passes",
            partial(_reconciles, agent, passes + 1),
            agent,
            timeout,
        )
        lines = agent.logged("reconciled")[: passes + 1]
        work_ms = _pass_work_result(work, timeout)
    except FleetError as e:
        raise BenchError(str(e)) from None
    finally:
        if work is not None and work.poll() is None:  # the probe failed: not left running
            work.kill()
            work.wait()
        stop_process(agent)
        cluster.register([node])  # its lease went with it
    wrong = [p for p in lines if p.get("records") != AGENT_PODS or p.get("freed")]
    if wrong:
        raise BenchError(f"probe agent on {node}: unexpected pass {wrong[0]}")
    times = [float(line["ms"]) for line in lines[1:]]
    figures = {
        "agent_rss_mib": memory["rss_mib"],
        "agent_hwm_mib": memory["hwm_mib"],
        "reconcile_ms": statistics.median(times),
        "reconcile_max_ms": max(times),
        "node_read_ms": _node_read_ms(cluster, node, passes),
    }
    figures["pass_work_ms"] = work_ms
    figures["reconcile_vs_work"] = figures["reconcile_ms"] / figures["pass_work_ms"]
    return figures


def pass_work_ms(url: str, node: str, state: str, times: int) -> float:
    """The pass's own work, at the passes' cadence, by a process of its own that runs
    alongside the probe agent: the node's runtime read through the same source, and its
    copies (read once) judged against it. Nothing in it depends on the cluster's size:
    it measures how fast the machine runs Python meanwhile (which moves by tens of
    percent between stages here)."""
    with open_store(url) as store:
        entries = store.range(keys.node_ips_prefix(node))[0]
    seen = time.monotonic()
    held = [h for kv in entries if (h := entry_held(kv, node, seen)) is not None]
    source = open_source(f"sim://{state}", node)
    seconds = []
    try:
        for _ in range(times):
            time.sleep(RECONCILE_EVERY)
            began = time.perf_counter()
            evidence = gather(
                source, [node], grace=ADD_GRACE, ask_cluster=False, offsets={node: OWN_CLOCK}
            )
            for h in held:
                judge(h, evidence)
            seconds.append(time.perf_counter() - began)
    finally:
        source.close()
    return statistics.median(seconds) * 1000


def _start_pass_work(cluster: ScaleCluster, node: str, times: int) -> subprocess.Popen[str]:
    code = (
        "import sys; from ipward_lab.bench.scale import pass_work_ms;"
        " print(pass_work_ms(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))"
    )
    args = [cluster.url, node, cluster.runtime_state(node), str(times)]
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


def _pass_work_result(work: subprocess.Popen[str], timeout: float) -> float:
    try:
        out, _ = work.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        work.kill()
        work.wait()
        raise BenchError("the pass's work alongside the probe did not end in time") from None
    if work.returncode != 0:
        raise BenchError(f"the pass's work alongside the probe failed ({work.returncode})")
    return float(out)


def _node_read_ms(cluster: ScaleCluster, node: str, times: int) -> float:
    """The reference for the pass: the store's own time for the read its copy of the node
    index spares it (the node index's range, through the same client), median of `times`
    at the passes' cadence (a read right after another one is served from warmer caches,
    up to 2x faster here)."""
    prefix = keys.node_ips_prefix(node)
    seconds = []
    for _ in range(times):
        time.sleep(RECONCILE_EVERY)
        began = time.perf_counter()
        cluster.store.range(prefix)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds) * 1000


# -- the controller -------------------------------------------------------------------


def _scrape(controller: Controller) -> dict[str, float]:
    """Its metrics, each summed over its labels, once it answers: a controller busy
    decoding a large read may not within one scrape's timeout."""
    deadline = time.monotonic() + PROCESS_TIMEOUT
    while True:
        samples: dict[str, float] = {}
        for name, _, value in controller.metrics():
            samples[name] = samples.get(name, 0.0) + value
        if samples:
            return samples
        if not controller.running or time.monotonic() > deadline:
            raise BenchError(
                f"{controller.name}: its metrics do not answer:\n{controller.output()}"
            )


def _passes(controller: Controller) -> tuple[float, float]:
    """(passes completed, seconds spent in them)."""
    samples = _scrape(controller)
    count = samples.get("ipward_controller_pass_seconds_count")
    total = samples.get("ipward_controller_pass_seconds_sum")
    if count is None or total is None:
        raise BenchError(f"{controller.name}: no pass metrics among {sorted(samples)[:20]}")
    return count, total


def _next_pass(controller: Controller, after: float) -> tuple[float, float]:
    """Wait until more than `after` passes are done; (count, seconds) then."""
    seen = [(0.0, 0.0)]

    def done() -> bool:
        seen[0] = _passes(controller)
        return seen[0][0] > after

    _wait("controller pass", done, controller, PROCESS_TIMEOUT)
    return seen[0]


def _pass_now(controller: Controller) -> float:
    """One pass, asked for now (SIGUSR1); its seconds."""
    count, total = _passes(controller)
    os.kill(controller.pid, signal.SIGUSR1)
    now_count, now_total = _next_pass(controller, count)
    return (now_total - total) / (now_count - count)


@contextlib.contextmanager
def _passes_every(controller: Controller, seconds: float) -> Iterator[None]:
    """Passes asked for every `seconds` while inside (one pending while it is paused)."""
    stop = threading.Event()

    def ask() -> None:
        while not stop.wait(seconds):
            with contextlib.suppress(ProcessLookupError):
                os.kill(controller.pid, signal.SIGUSR1)

    thread = threading.Thread(target=ask, name="passes", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def duties_load(cluster: ScaleCluster, samples: int) -> dict[str, float]:
    """etcd's CPU for what each node's agent asks of it besides its ADDs (`NodeDuties`):
    a keepalive of its registration's lease, and a look for its marked blocks (a range of
    the pool specs, one of its affinity, a get per block). Each is made `samples` times
    for this stage's nodes, on leases of the bench's own, and timed by etcd's CPU
    (/proc) while they run. Then the cores the stage's nodes would keep etcd busy with:
    at the agent's defaults (a keepalive every TTL/3, a look every --duty-interval) and
    at the former ones (both every second)."""
    nodes = [n for n in cluster.nodes if n not in cluster.agent_nodes] or cluster.nodes
    sample = [nodes[i % len(nodes)] for i in range(samples)]
    assert cluster.etcd.proc is not None
    pid = cluster.etcd.proc.pid
    store = cluster.store
    leases = [store.lease_grant(REGISTRATION_TTL) for _ in sample]
    try:
        began = cpu_seconds(pid)
        for lease in leases:
            if store.lease_keepalive(lease) <= 0:
                raise BenchError(f"lease {lease} expired during the duties' timing")
        keepalive = (cpu_seconds(pid) - began) / len(leases)
        began = cpu_seconds(pid)
        for node in sample:
            NodeDuties(store, node, DUTY_INTERVAL, NODE_TTL).answer_handshakes()
        look = (cpu_seconds(pid) - began) / len(sample)
    finally:
        for lease in leases:
            store.lease_revoke(lease)
    per_node_now = keepalive * KEEPALIVES_PER_TTL / NODE_TTL + look / DUTY_INTERVAL
    return {
        "duties_keepalive_etcd_ms": keepalive * 1000,
        "duties_look_etcd_ms": look * 1000,
        "duties_etcd_cores": len(cluster.nodes) * per_node_now,
        "duties_etcd_cores_every_second": len(cluster.nodes) * (keepalive + look),
    }


def _pause(controller: Controller, paused: bool) -> None:
    os.kill(controller.pid, signal.SIGSTOP if paused else signal.SIGCONT)


def start_controller(cluster: ScaleCluster, tmp: Path) -> Controller:
    """A real controller on the cluster, GC every pass, a pass only when asked for
    (SIGUSR1; its own interval an hour); returned once its first pass is done."""
    controller = Controller(
        f"scale-{cluster.records}",
        cluster.url,
        tmp / "logs",
        extra=(
            "--interval",
            str(CONTROLLER_IDLE),
            "--gc-interval",
            str(CONTROLLER_INTERVAL),
            "--lease-ttl",
            str(CONTROLLER_LEASE_TTL),
            "--liveness",
            f"sim://{cluster.cluster_state}",
        ),
    )
    try:
        controller.wait_started(AGENT_READY_TIMEOUT)
        _next_pass(controller, 0)
    except BaseException:
        controller.kill()
        raise
    return controller


def controller_figures(cluster: ScaleCluster, controller: Controller) -> dict[str, float]:
    """Its first pass; then, while it runs idle (no pass, its watch receiving), 1% of
    the pods get a new sandbox, and the pass asked for after that is the steady pass;
    then its memory. Nothing may be freed, and its first pass assigns no block (the
    fill left what its passes would have)."""
    count, total = _passes(controller)
    first_pass = total / count
    assigned = _scrape(controller).get("ipward_controller_blocks_assigned_total", 0.0)
    changed = cluster.change(max(cluster.records // 100, 1))
    steady = _pass_now(controller)
    memory = settled_memory(controller.pid, seconds=1.0)
    samples = _scrape(controller)
    freed = samples.get("ipward_gc_freed_total", 0.0)
    errors = samples.get("ipward_controller_pass_errors_total", 0.0)
    # Its view's whole reads so far: 1 (the start) unless the steady pass read whole too.
    rereads = samples.get("ipward_controller_view_rereads_total", 0.0)
    if freed:
        raise BenchError(f"the controller freed {freed:.0f} records of live pods")
    return {
        "controller_first_pass_ms": first_pass * 1000,
        "controller_steady_pass_ms": steady * 1000,
        "controller_rss_mib": memory["rss_mib"],
        "controller_hwm_mib": memory["hwm_mib"],
        "controller_assigned_first": assigned,
        "controller_pass_errors": errors,
        "controller_view_rereads": rereads,
        "changed_pods": float(changed),
    }


def liveness_only_memory(cluster: ScaleCluster) -> float:
    """Peak MiB of a process that only reads the controller's liveness source (the same
    `sim://` state, parsed as the controller's source does): the share of the
    controller's memory that is the lab's simulated cluster, not ipward."""
    code = (
        "import sys; from ipward_lab.simcluster import SimFileSource;"
        " SimFileSource(sys.argv[1]).cluster_view();"
        " print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, cluster.cluster_state],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
    )
    if done.returncode != 0:
        raise BenchError(f"reading {cluster.cluster_state}: {done.stderr[-2000:]}")
    return int(done.stdout.strip()) / 1024


# -- the churn ------------------------------------------------------------------------


def _reconciled(agent: Agent) -> bool:
    return (agent.metric("ipward_agent_reconcile_passes_total") or 0) >= 1


class _Phases:
    """Which round the churn is in: an ADD counts for a round only when it started and
    ended in it."""

    def __init__(self) -> None:
        self.current = 0
        self.kinds = ["warm-up"]

    def next(self, kind: str) -> None:
        self.kinds.append(kind)
        self.current = len(self.kinds) - 1


class _Churner:
    """ADD then DEL of a new attachment, again and again, through the installed plugin
    (exec'd with a CNI environment) and an agent; the ADDs timed, by round."""

    def __init__(self, tmp: Path, socket_path: Path, index: int) -> None:
        config = ipam_config(
            {"type": "ipward", "agentSocket": str(socket_path), "pool": SCALE_POOL}
        )
        work = tmp / f"churn-{index}"
        work.mkdir(parents=True, exist_ok=True)
        self.plugin = exec_kinds(work, {"ipward": config}, references=False)["ipward"]
        self.index = index
        self.samples: dict[int, list[float]] = {}
        self.errors = 0
        self.example = ""

    def run(self, phases: _Phases, stop: threading.Event) -> None:
        seq = 0
        while not stop.is_set():
            container = f"churn-{self.index}-{seq}"
            seq += 1
            phase = phases.current
            try:
                seconds = self.plugin.run("ADD", container)
                if phases.current == phase:
                    self.samples.setdefault(phase, []).append(seconds)
            except ExecError as e:
                self.errors += 1
                self.example = self.example or str(e)[:300]
            try:
                self.plugin.run("DEL", container)  # also after a failed ADD, as a runtime
            except ExecError as e:
                self.errors += 1
                self.example = self.example or str(e)[:300]


def churn_figures(
    cluster: ScaleCluster, controller: Controller, tmp: Path, sizes: ScaleSizes
) -> dict[str, float]:
    """Real agents on the agent nodes (their first reconcile pass done), `churn_threads`
    churners each; rounds with the controller running, then paused. ADD p50/p99 of each
    kind of round, and the controller's CPU seconds per second of the running rounds."""
    stack = contextlib.ExitStack()
    with stack:
        agents = []
        for node in cluster.agent_nodes:
            agent = Agent(
                node,
                cluster.url,
                tmp / "sockets" / f"churn-{node}-{cluster.records}.sock",
                tmp / "logs",
                extra=(
                    "--liveness",
                    f"sim://{cluster.runtime_state(node)}",
                    "--reconcile-interval",
                    "3600",
                ),
                log_level="info",  # no line per request: the agents are measured
            )
            stack.callback(cluster.register, [node])  # its lease goes when it stops
            stack.callback(stop_process, agent)
            agents.append(agent)
        try:
            for agent in agents:
                agent.wait_ready(AGENT_READY_TIMEOUT)
                _wait("first reconcile pass", partial(_reconciled, agent), agent, PROCESS_TIMEOUT)
        except FleetError as e:
            raise BenchError(str(e)) from None
        churners = [
            _Churner(tmp / f"churn-{cluster.records}-{n}", agent.socket, n)
            for n, agent in enumerate(agent for agent in agents for _ in range(sizes.churn_threads))
        ]
        phases = _Phases()
        stop = threading.Event()
        threads = [
            threading.Thread(target=c.run, args=(phases, stop), daemon=True) for c in churners
        ]
        for t in threads:
            t.start()
        cpu = wall = 0.0
        try:
            stack.enter_context(_passes_every(controller, CONTROLLER_INTERVAL))
            time.sleep(1.0)  # warm-up: the first execs of each loop are not counted
            for _ in range(sizes.rounds):
                before = cpu_seconds(controller.pid)
                began = time.monotonic()
                phases.next("running")
                time.sleep(sizes.round_seconds)  # a round lasts this long
                cpu += cpu_seconds(controller.pid) - before
                wall += time.monotonic() - began
                _pause(controller, True)
                phases.next("paused")
                time.sleep(sizes.round_seconds)
                _pause(controller, False)
        finally:
            _pause(controller, False)
            stop.set()
            for t in threads:
                t.join(timeout=60)
    samples: dict[str, list[float]] = {"running": [], "paused": []}
    for c in churners:
        for phase, values in c.samples.items():
            kind = phases.kinds[phase]
            if kind in samples:
                samples[kind] += values
    if not samples["running"] or not samples["paused"]:
        example = next((c.example for c in churners if c.example), "")
        raise BenchError(f"no ADD measured in some rounds: {example}")
    out = {
        f"add_{kind}_p{q}_ms": percentile_ms(values, q)
        for kind, values in samples.items()
        for q in (50, 99)
    }
    out["adds_running"] = float(len(samples["running"]))
    out["adds_paused"] = float(len(samples["paused"]))
    out["add_p99_vs_paused"] = out["add_running_p99_ms"] / out["add_paused_p99_ms"]
    out["controller_cpu"] = cpu / wall
    out["churn_errors"] = float(sum(c.errors for c in churners))
    return out


# -- the run --------------------------------------------------------------------------


PROBE_KEYS = (
    "agent_rss_mib",
    "agent_hwm_mib",
    "reconcile_ms",
    "reconcile_max_ms",
    "node_read_ms",
    "pass_work_ms",
    "reconcile_vs_work",
)
CONTROLLER_KEYS = (
    "controller_first_pass_ms",
    "controller_steady_pass_ms",
    "controller_rss_mib",
    "controller_hwm_mib",
    "controller_assigned_first",
    "controller_pass_errors",
    "controller_view_rereads",
    "changed_pods",
)
DUTIES_KEYS = (
    "duties_keepalive_etcd_ms",
    "duties_look_etcd_ms",
    "duties_etcd_cores",
    "duties_etcd_cores_every_second",
)
CHURN_KEYS = (
    "add_running_p50_ms",
    "add_running_p99_ms",
    "add_paused_p50_ms",
    "add_paused_p99_ms",
    "adds_running",
    "adds_paused",
    "add_p99_vs_paused",
    "controller_cpu",
    "churn_errors",
)


def _raise(error: BenchError) -> dict[str, float]:
    raise error


def _part(
    row: dict[str, float],
    failed: dict[str, str],
    name: str,
    keys: Sequence[str],
    measure: Callable[[], dict[str, float]],
    out: Callable[[str], object],
) -> None:
    """The figures of one part of a stage into `row`; when it fails (a process that
    cannot do its work at this size is a finding, not the end of the run), NaN for
    each and the reason in `failed`."""
    try:
        row.update(measure())
    except BenchError as e:
        failed[f"failed.{name}"] = str(e)[:3000]
        out(f"      {name} FAILED: {str(e)[:500]}")
        row.update(dict.fromkeys(keys, math.nan))


def measure_stage(
    cluster: ScaleCluster,
    tmp: Path,
    sizes: ScaleSizes,
    records: int,
    out: Callable[[str], object],
    failed: dict[str, str],
) -> dict[str, float]:
    """Grow the cluster to `records`, then every figure of the stage (a part that
    failed: NaN, and why in `failed`)."""
    before = cluster.records
    out(f"  ... {records:,} records: registering nodes, filling (bulk)")
    row: dict[str, float] = {"records": float(records)}
    row.update(cluster.grow(records))
    row["nodes"] = float(len(cluster.nodes))
    row["fill_records_per_s"] = (records - before) / row["fill_s"]
    row.update(cluster.db_size())
    row["db_bytes_per_record"] = row["db_bytes"] / records
    row["blocks_per_node"] = cluster.blocks() / len(cluster.nodes)
    if records <= CHECK_LIMIT:
        problems = check(cluster.store)[0]
        if problems:
            raise BenchError(f"ipward check on the bulk state: {problems[:5]}")
    out(f"      {len(cluster.nodes):,} nodes; probe agent: memory, {sizes.reconcile_passes} passes")
    _part(
        row,
        failed,
        "probe",
        PROBE_KEYS,
        lambda: probe_agent(cluster, tmp, sizes.reconcile_passes),
        out,
    )
    out("      controller: first pass, 1% changed, steady pass; then the churn")
    try:
        controller = start_controller(cluster, tmp)
    except BenchError as e:
        _part(row, failed, "controller", CONTROLLER_KEYS + CHURN_KEYS, partial(_raise, e), out)
    else:
        try:
            _part(
                row,
                failed,
                "controller",
                CONTROLLER_KEYS,
                lambda: controller_figures(cluster, controller),
                out,
            )
            # Read before the churn: a pass paused past the store's deadline there fails
            # because of the pause, not of the size.
            errors = controller.logged("pass failed; retrying next interval")
            if errors:  # a finding: what made a pass fail at this size
                failed["controller_pass_error"] = str(errors[0].get("error", errors[0]))
            _part(
                row,
                failed,
                "churn",
                CHURN_KEYS,
                lambda: churn_figures(cluster, controller, tmp, sizes),
                out,
            )
        finally:
            _pause(controller, False)
            try:
                controller.stop(30)
            except (subprocess.TimeoutExpired, FleetError):
                controller.kill()
    row["liveness_hwm_mib"] = liveness_only_memory(cluster)
    out(f"      node duties: {sizes.duty_samples} keepalives and looks for marked blocks")
    _part(row, failed, "duties", DUTIES_KEYS, lambda: duties_load(cluster, sizes.duty_samples), out)
    return row


def run_scale(
    sizes: ScaleSizes = FULL,
    out: Callable[[str], object] = print,
    report_dir: str | Path | None = None,
) -> dict:
    """Every stage of `sizes` on one temporary etcd; prints a table by stage with `out`;
    with `report_dir`, also writes scale.html, scale.json and the plot there. Returns
    {"machine", "figures", "targets", "notes", "tables", "series"} like `run`."""
    if not os.access(ETCD, os.X_OK):
        raise BenchError(f"{ETCD} is missing (Debian package etcd-server): --scale needs it")
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin's interpreter")
    if list(sizes.stages) != sorted(set(sizes.stages)):
        raise BenchError(f"stages must grow: {list(sizes.stages)}")
    began = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    say = Console(out)

    info = machine()
    say(
        f"ipward bench --scale: {', '.join(count_label(n) for n in sizes.stages)} records"
        f" ({AGENT_PODS} on each of {plural(sizes.agents, 'agent node')}); {info['nproc']}"
        f" CPUs ({info['platform']}); etcd {info['etcd']}"
    )
    rows: list[dict[str, float]] = []
    r = Results()
    with (
        tempfile.TemporaryDirectory(prefix="ipward-bench-scale-") as tmp_name,
        etcd_server(Path(tmp_name) / "etcd") as server,
    ):
        tmp = Path(tmp_name)
        store = open_store(server.url)  # as ipward makes a store: its schema key first
        try:
            cluster = ScaleCluster(server.url, store, tmp, sizes.agents, server)
            for records in sizes.stages:
                stage_began = time.perf_counter()
                failed: dict[str, str] = {}
                row = measure_stage(cluster, tmp, sizes, records, say, failed)
                for part, why in failed.items():
                    r.notes[f"{count_label(records)}.{part}"] = why
                row["stage_s"] = time.perf_counter() - stage_began
                rows.append(row)
                say(f"      stage done in {row['stage_s']:.0f} s")
        finally:
            store.close()
    for row in rows:
        label = count_label(int(row["records"]))
        for key, value in row.items():
            r.figures[f"scale.{label}.{key}"] = value
    _targets(rows, r)
    table = scale_table(rows, r)
    elapsed = time.perf_counter() - began
    say("")
    print_table(table, say)
    for line in SCALE_NOTES:
        say(line)
    say(f"  whole run: {elapsed:.0f} s")
    r.notes.update({"elapsed_s": f"{elapsed:.1f}", "started": started, "agents": str(sizes.agents)})
    result = {
        "machine": info,
        "figures": r.figures,
        "targets": r.targets,
        "notes": r.notes,
        "tables": {"scale": table},
        "series": {"scale": rows},
    }
    if report_dir is not None:
        for path in write_scale_report(result, report_dir, say.lines):
            out(f"    {path}")
    return result


def _spread(values: list[float]) -> float:
    return max(values) / min(values) if all(map(math.isfinite, values)) else math.nan


def _targets(rows: list[dict[str, float]], r: Results) -> None:
    last = rows[-1]
    reference = next((x for x in rows if x["records"] == REFERENCE_RECORDS), rows[0])
    r.figures["scale.reconcile_spread"] = _spread([x["reconcile_ms"] for x in rows])
    r.figures["scale.node_read_spread"] = _spread([x["node_read_ms"] for x in rows])
    r.figures["scale.pass_work_spread"] = _spread([x["pass_work_ms"] for x in rows])
    r.figures["scale.reconcile_vs_work_spread"] = _spread([x["reconcile_vs_work"] for x in rows])
    # A pass over as many records as 1% of 150k: the reference stage's first pass reads
    # and judges all of them (its own steady pass judges 1% of it, 15 changes).
    r.figures["scale.steady_pass_vs_reference"] = (
        last["controller_steady_pass_ms"] / reference["controller_first_pass_ms"]
    )
    label = count_label(int(last["records"]))
    checks = [
        (
            f"scale.{label}.add_p99_vs_paused",
            f"<= {TARGET_ADD_P99_VS_PAUSED}x",
            TARGET_ADD_P99_VS_PAUSED,
        ),
        (
            f"scale.{label}.agent_hwm_mib",
            f"<= {TARGET_AGENT_HWM_MIB:.0f} MiB",
            TARGET_AGENT_HWM_MIB,
        ),
        ("scale.reconcile_spread", f"<= {TARGET_RECONCILE_SPREAD}x", TARGET_RECONCILE_SPREAD),
        (
            f"scale.{label}.controller_hwm_mib",
            f"<= {TARGET_CONTROLLER_HWM_MIB:.0f} MiB",
            TARGET_CONTROLLER_HWM_MIB,
        ),
        (
            "scale.steady_pass_vs_reference",
            f"<= {TARGET_PASS_VS_REFERENCE:.0f}x the {count_label(int(reference['records']))}"
            " first pass",
            TARGET_PASS_VS_REFERENCE,
        ),
    ]
    for name, text, limit in checks:
        value = r.figures[name]
        r.targets[name] = {"value": value, "target": text, "met": value <= limit}


# (label, key, format, target name or ""): the table's rows, one column per stage.
TABLE_ROWS = [
    ("nodes registered", "nodes", "{:,.0f}", ""),
    ("register s (leases, keys)", "register_s", "{:.1f}", ""),
    ("fill s (bulk)", "fill_s", "{:.1f}", ""),
    ("fill records/s", "fill_records_per_s", "{:,.0f}", ""),
    ("etcd db MiB (dbSize)", "db_bytes", "{:.1f}", ""),
    ("etcd db bytes per record", "db_bytes_per_record", "{:,.0f}", ""),
    ("blocks per node", "blocks_per_node", "{:.2f}", ""),
    ("agent VmHWM MiB (110 on its node)", "agent_hwm_mib", "{:.1f}", "agent_hwm_mib"),
    ("agent VmRSS MiB", "agent_rss_mib", "{:.1f}", ""),
    ("agent reconcile ms (median)", "reconcile_ms", "{:.2f}", "reconcile_spread"),
    ("  etcd's range of its node index ms (spared)", "node_read_ms", "{:.1f}", ""),
    ("  its work, by a process alongside ms", "pass_work_ms", "{:.2f}", ""),
    ("  the pass / that work", "reconcile_vs_work", "{:.2f}x", ""),
    ("controller first pass ms", "controller_first_pass_ms", "{:,.0f}", ""),
    ("controller pass ms, 1% changed", "controller_steady_pass_ms", "{:,.0f}", "steady_pass"),
    ("controller passes failed", "controller_pass_errors", "{:.0f}", ""),
    ("controller view whole reads", "controller_view_rereads", "{:.0f}", ""),
    ("controller VmHWM MiB", "controller_hwm_mib", "{:.1f}", "controller_hwm_mib"),
    ("  its liveness source alone MiB", "liveness_hwm_mib", "{:.1f}", ""),
    ("ADD p50 ms, controller running", "add_running_p50_ms", "{:.1f}", ""),
    ("ADD p50 ms, controller paused", "add_paused_p50_ms", "{:.1f}", ""),
    ("ADD p99 ms, controller running", "add_running_p99_ms", "{:.1f}", ""),
    ("ADD p99 ms, controller paused", "add_paused_p99_ms", "{:.1f}", ""),
    ("ADD p99 running / paused", "add_p99_vs_paused", "{:.2f}x", "add_p99_vs_paused"),
    ("controller CPU in running rounds (cores)", "controller_cpu", "{:.2f}", ""),
    ("ADDs measured (running/paused)", "adds_running", "{:.0f}", ""),
    ("node duties: etcd CPU ms per keepalive", "duties_keepalive_etcd_ms", "{:.2f}", ""),
    ("  per look for marked blocks (3 reads)", "duties_look_etcd_ms", "{:.2f}", ""),
    ("  etcd cores for every node's, defaults", "duties_etcd_cores", "{:.2f}", ""),
    ("  the same, both every second (before)", "duties_etcd_cores_every_second", "{:.2f}", ""),
    ("stage s", "stage_s", "{:.0f}", ""),
]


def scale_table(rows: list[dict[str, float]], r: Results) -> list[list[str]]:
    """One row per figure, one column per stage, then the target and its verdict."""
    table = [["by records in the store", *(count_label(int(x["records"])) for x in rows), "target"]]
    by_suffix = {name.rsplit(".", 1)[-1]: t for name, t in r.targets.items()}
    by_suffix["steady_pass"] = r.targets["scale.steady_pass_vs_reference"]
    for label, key, fmt, target in TABLE_ROWS:
        cells = [fmt.format(x[key]) if math.isfinite(x[key]) else "failed" for x in rows]
        if key == "db_bytes":
            cells = [fmt.format(x[key] / 2**20) for x in rows]
        if key == "adds_running":
            cells = [f"{x['adds_running']:.0f}/{x['adds_paused']:.0f}" for x in rows]
        t = by_suffix.get(target)
        verdict_text = f"{t['target']} {verdict(t['met'])} ({t['value']:.2f})" if t else ""
        table.append([label, *cells, verdict_text])
    return table


SCALE_NOTES = [
    "  Every stage on the same etcd, grown in bulk (what ledgers and the controller write),",
    "  30 pods a node; the agent nodes hold 110 each. Probe agent: a real agent of an agent",
    "  node, runtime = its sandboxes (sim://), reconciling every 0.1 s; memory after its",
    "  first pass, pass time = what its 'reconciled' lines say (perf_counter), on its",
    "  watch-kept copy of the node index; next to it, etcd's range of that index at the",
    "  same cadence (the read the copy spares a pass), and the pass's own work (the same",
    "  source read, the copies judged) by a process of its own during the passes: the",
    "  machine's speed meanwhile. Controller:",
    "  a real one, GC every pass, liveness = every pod and node (sim://, no runtime: a",
    "  controller cannot reach the nodes'), a pass when asked (SIGUSR1); steady pass = the",
    "  one asked for after 1% of the pods got a new sandbox while it ran idle, its watch",
    "  receiving; target: within 10x a pass over 1,500 records (the 1,500 stage's first",
    "  pass, which reads and judges them all: 1% of 150k is 1,500 changed). ADDs: the",
    "  installed plugin exec'd against real agents on the agent nodes (ADD then DEL, loops",
    "  at once), rounds with the controller's passes asked for every 0.5 s, then paused",
    "  (SIGSTOP; a pass paused past the store's 5 s deadline fails on resuming: 'passes",
    "  failed' counts those before the churn). Node duties: keepalives on leases of the",
    "  bench's own and looks for marked blocks by NodeDuties itself, for the stage's nodes;",
    "  etcd's CPU while they run (/proc, 10 ms ticks); cores = nodes x (keepalive x 3 /",
    "  TTL + look / --duty-interval) at the agent's defaults (10 s, 5 s), and nodes x",
    "  (keepalive + look) for both every second.",
]


def scale_plot(rows: list[dict[str, float]]) -> bytes:
    """How the figures grow with the records: pass times, memory, ADD latency, etcd."""
    from ipward_lab.report import Panel, line_plots

    ticks = [(x["records"], count_label(int(x["records"]))) for x in rows]

    def series(key: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(x["records"], x[key] * scale) for x in rows]

    panels = [
        Panel(
            {
                "agent reconcile pass": series("reconcile_ms"),
                "etcd's range of its node index (spared)": series("node_read_ms"),
                "controller pass, 1% changed": series("controller_steady_pass_ms"),
                "controller first pass": series("controller_first_pass_ms"),
            },
            "allocation records",
            "ms",
            "Pass time",
            logx=True,
            logy=True,
            ymin=None,
            xticks=ticks,
            styles={"controller first pass": ":", "etcd's range of its node index (spared)": ":"},
        ),
        Panel(
            {
                "agent VmHWM (110 on its node)": series("agent_hwm_mib"),
                "controller VmHWM": series("controller_hwm_mib"),
                "liveness source alone (reference)": series("liveness_hwm_mib"),
            },
            "allocation records",
            "MiB",
            "Peak memory",
            logx=True,
            xticks=ticks,
            styles={"liveness source alone (reference)": ":"},
        ),
        Panel(
            {
                "p99, controller running": series("add_running_p99_ms"),
                "p99, controller paused": series("add_paused_p99_ms"),
                "p50, controller running": series("add_running_p50_ms"),
                "p50, controller paused": series("add_paused_p50_ms"),
            },
            "allocation records",
            "ms",
            "Plugin ADD through an agent",
            logx=True,
            xticks=ticks,
            styles={"p99, controller paused": ":", "p50, controller paused": ":"},
        ),
        Panel(
            {"etcd db bytes per record": series("db_bytes_per_record")},
            "allocation records",
            "bytes",
            "etcd database size per allocation",
            logx=True,
            xticks=ticks,
        ),
    ]
    return line_plots(panels, title="ipward bench --scale", columns=2)


def write_scale_report(result: dict, directory: str | Path, console: Sequence[str]) -> list[Path]:
    """DIR/scale.html (the tables, the plot, the console), the plot as PNG and
    DIR/scale.json. Returns the files written."""
    import json

    from ipward_lab.report import Page, save_png

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    png = scale_plot(result["series"]["scale"])
    save_png(png, root / PLOT_SCALE)
    info = result["machine"]
    page = Page("ipward bench --scale")
    page.paragraph(
        f"{info['nproc']} CPUs ({info['platform']}); Python {info['python']}; etcd"
        f" {info['etcd']}. Run {result['notes']['started']}, {result['notes']['elapsed_s']} s."
    )
    page.heading("Targets")
    page.table(
        ["figure", "value", "target", "met"],
        [
            [name, f"{t['value']:.2f}", str(t["target"]), "yes" if t["met"] else "NO"]
            for name, t in sorted(result["targets"].items())
        ],
    )
    table = result["tables"]["scale"]
    page.heading("By stage")
    page.table(table[0], table[1:])
    page.figure(png, "How each figure grows with the records in the store.", alt=PLOT_SCALE)
    page.heading("Console output")
    page.preformatted("\n".join(console))
    page.write(root / "scale.html")
    with open(root / "scale.json", "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    return [root / PLOT_SCALE, root / "scale.html", root / "scale.json"]
