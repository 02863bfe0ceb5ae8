"""`ipward sim`: the chaos soak. The whole system under churn and faults, checked all
along, in numbers and pictures.

What runs, all real: a store (SQLite by default; one etcd; or a three-member etcd on
loopback), one `ipward agent` per simulated node and two `ipward controller`s (leader
election), the installed plugin executable, and the simulated cluster
(`ipward_lab.simcluster`) as the runtime and orchestrator both: Deployments scaling and
rolling, StatefulSets scaled down and up fast (sticky addresses), Jobs completing, pods
deleted and restarted, at `--rate` actions per second, for `--duration` seconds.

Faults, at random times (seeded), each enabled kind at least once: SIGKILL an agent (it
comes back after a few seconds), SIGKILL the leading controller (a new one starts),
SIGKILL an etcd member (three-member etcd only; restarted), stall a node's runtime,
drop a pod's DELs, delay a pod's DELs past the GC grace.

Checked all along, every 0.1 s: no address is held by two ready pods; no ready pod's
address record is gone or owned by another sandbox (what GC must never do), confirmed
by reading the cluster before and after the store. At the end: faults cleared and every
process back, then convergence (exactly the running pods' addresses recorded, every pod
running), `ipward check`, then everything deleted and the pool empty, `ipward check`
again. Any violation makes the exit status 1, with the history of the address (every
version of its record, with revisions).
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from ipward import records as rec
from ipward.check import check
from ipward.liveness import Pod
from ipward.pool import PoolSpec
from ipward.store import Store, StoreError, open_store
from ipward.store.base import Put, absent
from ipward_lab import fleet
from ipward_lab.etcdlab import EtcdCluster, EtcdServer
from ipward_lab.simcluster import SimCluster

FAULTS = ("kill-agent", "kill-leader", "kill-etcd", "stall-runtime", "drop-del", "delay-del")
BACKENDS = ("sqlite", "etcd", "etcd-cluster")
NS = "soak"
NETWORK = "soaknet"
POOL = "soak"
GC_REASONS = re.compile(
    r"(sandbox-gone|pod-gone|pod-terminal|node-gone|statefulset-deleted"
    r"|ordinal-out-of-range|ttl-expired)"
)


@dataclass
class Options:
    nodes: int = 3
    pods: int = 30
    rate: float = 4.0  # workload actions per second
    duration: float = 60.0
    seed: int = 1
    faults: tuple[str, ...] = FAULTS
    backend: str = "sqlite"
    grace: float = 3.0  # ADD grace of agents and controllers
    gc_interval: float = 0.5
    settle: float = 120.0  # longest wait for convergence at the end


@dataclass
class Violation:
    at: float
    kind: str  # shared-address, live-loss, not-converged, check, leak
    address: str
    detail: str
    history: list[str] = field(default_factory=list)


@dataclass
class Sample:
    """One second of the run, for the live view and the report."""

    at: float
    pods: int
    running: int
    records: int
    adds: int  # successful ADDs ended in this second
    add_ms: list[float]


@dataclass
class Result:
    options: Options
    started: float = 0.0
    violations: list[Violation] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, detail)
    gc_frees: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    checks: int = 0
    converged_after: float | None = None
    emptied_after: float | None = None
    add_calls: int = 0
    add_failures: Counter[str] = field(default_factory=Counter)  # by CNI error code

    @property
    def ok(self) -> bool:
        return not self.violations


class Soak:
    """One run. `run()` does it all; the steps are methods so tests can drive them."""

    def __init__(self, options: Options, workdir: Path, console: Console | None = None) -> None:
        self.o = options
        self.workdir = workdir
        self.console = console or Console(stderr=True)
        self.rng = random.Random(options.seed)
        self.result = Result(options)
        self.etcd: EtcdCluster | EtcdServer | None = None
        self.store: Store | None = None
        self.url = ""
        self.sim: SimCluster | None = None
        self.agents: dict[str, fleet.Agent] = {}
        self.controllers: list[fleet.Controller] = []
        self.dead: list[fleet.Process] = []  # killed by faults, for the logs
        self._stop = threading.Event()
        self._restarts: list[tuple[float, str, Any]] = []  # (due, what, arg)
        self._ctl_seq = 0
        self._seen_calls = 0
        self.run_dir = Path(tempfile.mkdtemp(prefix="ipw-sim-"))  # short socket paths

    # -- set-up ---------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.url = self._start_store()
        self.store = open_store(self.url)
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir(exist_ok=True)
        subprocess.run(
            [*fleet.IPWARD, "install-cni", "--bin-dir", str(bin_dir)],
            check=True,
            capture_output=True,
        )
        # Room for the churn (cooldowns, reservations, leaks until GC) in small blocks,
        # so every node gets some and none hoards a pool it cannot use.
        prefix = 32 - max(8, (8 * self.o.pods - 1).bit_length())
        spec = PoolSpec(
            POOL,
            [[{"subnet": f"10.128.0.0/{prefix}"}]],
            cooldown=1.0,
            block_prefix={4: 28},
            warm=4,
            release_delay=10.0,
            borrow=True,
        )
        self.store.txn(
            [absent(rec.pool_key(POOL))], [Put(rec.pool_key(POOL), rec.encode(spec.to_dict()))]
        )
        self.sim = SimCluster(
            str(self.workdir / "cluster.json"),
            str(bin_dir / "ipward"),
            network=NETWORK,
            pool=POOL,
            grace=1.0,
            retry_delay=0.5,
            seed=self.o.seed,
        )
        for i in range(1, self.o.nodes + 1):
            node = f"n{i}"
            agent = self._start_agent(node)
            self.sim.add_node(node, str(agent.socket))
        for _ in range(2):
            self._start_controller()
        for agent in self.agents.values():
            agent.wait_ready()
        self.sim.start()
        self.result.started = time.time()

    def _start_store(self) -> str:
        if self.o.backend == "sqlite":
            return f"sqlite://{self.workdir}/ipward.db"
        if self.o.backend == "etcd":
            server = EtcdServer(self.workdir / "etcd")
            server.start()
            server.wait_ready()
            self.etcd = server
            return server.url
        cluster = EtcdCluster(self.workdir / "etcd", members=3)
        cluster.start()
        self.etcd = cluster
        return cluster.url

    def _start_agent(self, node: str) -> fleet.Agent:
        liveness = f"sim://{self.workdir / 'cluster.json'}"
        extra = (
            "--liveness",
            liveness,
            "--cluster",
            liveness,
            "--add-grace",
            str(self.o.grace),
            "--reconcile-interval",
            str(self.o.gc_interval * 2),
            "--duty-interval",
            "0.3",
            "--node-ttl",
            "3",
        )
        agent = fleet.Agent(
            node, self.url, self.run_dir / node / "agent.sock", self.workdir / "logs", extra
        )
        self.agents[node] = agent
        return agent

    def _start_controller(self) -> fleet.Controller:
        self._ctl_seq += 1
        extra = (
            "--interval",
            "0.3",
            "--lease-ttl",
            "3",
            "--ready-delay",
            "1",
            "--liveness",
            f"sim://{self.workdir / 'cluster.json'}",
            "--add-grace",
            str(self.o.grace),
            "--gc-interval",
            str(self.o.gc_interval),
        )
        ctl = fleet.Controller(f"c{self._ctl_seq}", self.url, self.workdir / "logs", extra)
        self.controllers.append(ctl)
        return ctl

    # -- the workload ----------------------------------------------------------------

    def create_workload(self) -> None:
        """Owners sized so that about `pods` pods run: Deployments 40%, StatefulSets 40%,
        Jobs the rest (created and finished as the run goes)."""
        assert self.sim is not None
        share = max(1, self.o.pods * 2 // 10)
        self.deployments = {"web": share, "api": share}
        self.statefulsets = {"db": share, "cache": share}
        for name, n in self.deployments.items():
            self.sim.create_deployment(NS, name, n)
        for name, n in self.statefulsets.items():
            self.sim.create_statefulset(NS, name, n, ordered=False)
        self.jobs = 0

    def act(self) -> str:
        """One random workload action; its name."""
        assert self.sim is not None
        r = self.rng.random()
        share = max(1, self.o.pods * 2 // 10)
        if r < 0.25:
            name = self.rng.choice(sorted(self.deployments))
            self.deployments[name] = self.rng.randint(max(1, share // 2), share * 3 // 2)
            self.sim.scale(NS, name, self.deployments[name])
            return "scale-deployment"
        if r < 0.35:
            self.sim.rolling_restart(NS, self.rng.choice(sorted(self.deployments)))
            return "rolling-restart"
        if r < 0.55:
            name = self.rng.choice(sorted(self.statefulsets))
            low = self.rng.randint(0, max(0, share // 2))
            target = low if self.statefulsets[name] == share else share
            self.statefulsets[name] = target
            self.sim.scale(NS, name, target)
            return "scale-statefulset"
        if r < 0.7:
            live = sum(1 for p in self.sim.pods(NS) if p.owner_kind == "Job" and not p.terminal)
            if live < max(2, self.o.pods // 5):
                self.jobs += 1
                k = self.rng.randint(1, 3)
                self.sim.create_job(
                    NS, f"job{self.jobs}", k, k, self.rng.uniform(1, 4), ttl_after_finished=2.0
                )
                return "create-job"
            return "idle"
        pod = self._random_pod()
        if pod is None:
            return "idle"
        with contextlib.suppress(KeyError, ValueError):
            if r < 0.85:
                self.sim.delete_pod(pod)
                return "delete-pod"
            self.sim.restart_pod(pod)
            return "restart-pod"
        return "idle"

    def _random_pod(self) -> Pod | None:
        assert self.sim is not None
        pods = [
            p
            for p in self.sim.pods(NS)
            if p.phase == "Running" and p.deleted_at is None and p.owner_kind != "Job"
        ]
        return self.rng.choice(pods) if pods else None

    # -- faults ----------------------------------------------------------------------

    def fault_schedule(self) -> list[tuple[float, str]]:
        """(seconds into the run, kind): every enabled kind at least once, spread over
        10%..80% of the run, in a seeded order; more rounds when the run is long."""
        kinds = [k for k in self.o.faults if k != "kill-etcd" or self.o.backend == "etcd-cluster"]
        if not kinds:
            return []
        rounds = max(1, int(self.o.duration // 120))
        order = [k for _ in range(rounds) for k in self.rng.sample(kinds, len(kinds))]
        span = self.o.duration * 0.7
        return [(self.o.duration * 0.1 + span * i / len(order), k) for i, k in enumerate(order)]

    def inject(self, kind: str) -> str:
        """Inject one fault now; what was done."""
        assert self.sim is not None
        now = time.monotonic()
        if kind == "kill-agent":
            node = self.rng.choice(sorted(self.agents))
            agent = self.agents[node]
            agent.kill()
            self.dead.append(agent)
            self._restarts.append((now + self.rng.uniform(1, 3), "agent", node))
            return f"SIGKILL agent of {node}"
        if kind == "kill-leader":
            leader = next((c for c in self.controllers if c.running and c.leading), None)
            victim = leader or next((c for c in self.controllers if c.running), None)
            if victim is None:
                return "no controller running"
            victim.kill()
            self.controllers.remove(victim)
            self.dead.append(victim)
            self._restarts.append((now + 1.0, "controller", None))
            return f"SIGKILL controller {victim.ident}" + (" (leader)" if leader else "")
        if kind == "kill-etcd":
            assert isinstance(self.etcd, EtcdCluster)
            member = self.rng.choice(self.etcd.members)
            self.etcd.kill(member)
            self._restarts.append((now + 3.0, "etcd", member))
            return f"SIGKILL etcd member {member.name}"
        if kind == "stall-runtime":
            node = self.rng.choice(sorted(self.agents))
            self.sim.stall_runtime(node, 5.0)
            return f"runtime of {node} stalls 5s"
        pod = self._random_pod()
        if pod is None:
            return "no pod to fault"
        with contextlib.suppress(KeyError, ValueError):
            if kind == "drop-del":
                self.sim.drop_del(pod)
                self.sim.delete_pod(pod)
                return f"DELs of {pod.name} dropped"
            self.sim.delay_del(pod, self.o.grace + 3.0)
            self.sim.delete_pod(pod)
            return f"DELs of {pod.name} delayed {self.o.grace + 3.0:g}s"
        return f"{pod.name} went away first"

    def _due_restarts(self, final: bool = False) -> None:
        now = time.monotonic()
        for item in [r for r in self._restarts if final or r[0] <= now]:
            self._restarts.remove(item)
            _, what, arg = item
            if what == "agent":
                self._start_agent(arg).wait_ready()
            elif what == "controller":
                self._start_controller()
            else:
                assert isinstance(self.etcd, EtcdCluster)
                self.etcd.restart(arg)

    # -- checking --------------------------------------------------------------------

    def check_once(self) -> list[Violation]:
        """One look: cluster, store, cluster again. A ready pod's address must be
        recorded for its sandbox when the pod was ready both before and after the store
        was read; no two ready pods may share an address."""
        assert self.sim is not None and self.store is not None
        before = self._ready()
        try:
            kvs, _ = self.store.range(f"ips/{POOL}/")
        except StoreError:
            return []  # the store is down (a fault): nothing to compare against
        after = self._ready()
        records = {kv.key.rsplit("/", 1)[1]: rec.decode(kv.value) for kv in kvs}
        found = []
        now = time.time()
        for ip, holders in after.items():
            if len(holders) > 1:
                found.append(Violation(now, "shared-address", ip, f"ready pods {sorted(holders)}"))
                continue
            ((sandbox, name),) = holders.items()
            if before.get(ip, {}).get(sandbox) != name:
                continue  # not ready all along: no claim on the store's state
            record = records.get(ip)
            if record is None or record.get("container") != sandbox:
                owner = "nothing" if record is None else f"sandbox {record.get('container')!r}"
                found.append(
                    Violation(
                        now, "live-loss", ip, f"{name} ({sandbox[:12]}) ready, record of {owner}"
                    )
                )
        self.result.checks += 1
        return found

    def _ready(self) -> dict[str, dict[str, str]]:
        """address -> {sandbox: pod name} of the pods ready now."""
        assert self.sim is not None
        out: dict[str, dict[str, str]] = {}
        for ip, pods in self.sim.ready_addresses().items():
            for pod in pods:
                sandboxes = self.sim.sandboxes_of(pod)
                if sandboxes:
                    out.setdefault(ip, {})[sandboxes[-1]] = pod.name
        return out

    def history(self, ip: str, wait: float = 3.0) -> list[str]:
        """Every version of the address's record, with its revision."""
        assert self.store is not None
        key = rec.ip_key(POOL, ip)
        end = self.store.revision()
        watch = self.store.watch(key, 1)
        timer = threading.Timer(wait, watch.cancel)
        timer.start()
        lines = []
        try:
            for event in watch:
                if event.kv.key == key:
                    value = event.kv.value.decode(errors="replace") or "(deleted)"
                    lines.append(f"rev {event.kv.mod_revision} {event.kind}: {value}")
                if event.kv.mod_revision >= end:
                    break
        except StoreError as e:
            lines.append(f"(history cut short: {e})")
        finally:
            timer.cancel()
            watch.cancel()
        return lines

    def _record(self, found: list[Violation]) -> None:
        known = {(v.kind, v.address) for v in self.result.violations}
        for v in found:
            if (v.kind, v.address) not in known:
                v.history = self.history(v.address)
                self.result.violations.append(v)
                known.add((v.kind, v.address))

    # -- sampling --------------------------------------------------------------------

    def sample(self) -> Sample:
        assert self.sim is not None and self.store is not None
        pods = self.sim.pods(NS)
        calls = self.sim.calls
        fresh = calls[self._seen_calls :]
        self._seen_calls = len(calls)
        adds = [c for c in fresh if c.command == "ADD"]
        self.result.add_calls += len(adds)
        for c in adds:
            if c.returncode != 0:
                code = re.search(r'"code":\s*(\d+)', c.stdout)
                self.result.add_failures[code.group(1) if code else "no answer"] += 1
        ok = [c for c in adds if c.returncode == 0]
        try:
            records = len(self.store.range(f"ips/{POOL}/")[0])
        except StoreError:
            records = self.result.samples[-1].records if self.result.samples else 0
        s = Sample(
            time.time() - self.result.started,
            len(pods),
            sum(1 for p in pods if p.phase == "Running"),
            records,
            len(ok),
            [c.elapsed_ms for c in ok],
        )
        self.result.samples.append(s)
        return s

    def gc_frees(self) -> Counter[str]:
        """Frees by garbage collection (controllers, agents' reconciliation), by reason,
        from every process's log (killed ones too: their logs stay)."""
        tally: Counter[str] = Counter()
        for p in [*self.agents.values(), *self.controllers, *self.dead]:
            for entry in p.logs():
                if entry.get("msg") not in ("released", "detached"):
                    continue
                reason = str(entry.get("reason", ""))
                m = GC_REASONS.search(reason)
                if m and ("gc" in reason or "reconcile" in reason):
                    n = len(entry.get("ips", [])) or 1
                    tally[f"{m.group(1)} ({entry['msg']})"] += n
        return tally

    # -- the run ---------------------------------------------------------------------

    def run(self, live: bool = True) -> Result:
        try:
            self.start()
            self.create_workload()
            self._soak(live)
            self._finish()
        finally:
            self.close()
        return self.result

    def _soak(self, live: bool) -> None:
        schedule = deque(self.fault_schedule())
        began = time.monotonic()
        next_action = began
        next_sample = began + 1.0
        checker = threading.Thread(target=self._check_loop, daemon=True)
        checker.start()
        view = Live(self._view(), console=self.console, refresh_per_second=2, transient=True)
        with view if live else contextlib.nullcontext():
            while (elapsed := time.monotonic() - began) < self.o.duration:
                if schedule and elapsed >= schedule[0][0]:
                    _, kind = schedule.popleft()
                    detail = self.inject(kind)
                    self.result.faults.append((time.time() - self.result.started, kind, detail))
                self._due_restarts()
                if time.monotonic() >= next_action:
                    self.result.actions[self.act()] += 1
                    next_action += 1.0 / self.o.rate
                if time.monotonic() >= next_sample:
                    self.sample()
                    next_sample += 1.0
                    if live:
                        view.update(self._view())
                time.sleep(0.02)
        self._stop.set()
        checker.join()

    def _check_loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._record(self.check_once())
            except Exception as e:  # the checker must not die silently
                self._record([Violation(time.time(), "checker-error", "-", repr(e))])

    def _finish(self) -> None:
        """Faults off, everything back, then convergence, check, teardown, check."""
        assert self.sim is not None and self.store is not None
        self.sim.clear_faults()
        self.sim.drop_del_rate = 0.0
        self._due_restarts(final=True)
        started = time.monotonic()
        converged = self._wait(self._converged, self.o.settle)
        if converged:
            self.result.converged_after = time.monotonic() - started
        else:
            self._record([Violation(time.time(), "not-converged", "-", self._why_not())])
        self._record(self._store_problems())
        for name in self.deployments:
            self.sim.delete_deployment(NS, name)
        for name in self.statefulsets:
            self.sim.delete_statefulset(NS, name)
        for pod in self.sim.pods(NS):
            with contextlib.suppress(KeyError):
                self.sim.delete_pod(pod)
        started = time.monotonic()
        if self._wait(self._empty, self.o.settle):
            self.result.emptied_after = time.monotonic() - started
        else:
            left = [kv.key for kv in self.store.range(f"ips/{POOL}/")[0]]
            left += [kv.key for kv in self.store.range("sticky/")[0]]
            self._record([Violation(time.time(), "leak", "-", f"left after teardown: {left[:20]}")])
        self._record(self._store_problems())
        self.result.gc_frees = self.gc_frees()

    def _wait(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                if condition():
                    return True
            time.sleep(0.25)
        return False

    def _converged(self) -> bool:
        waiting, held, bound = self._state()
        return not waiting and held == bound

    def _why_not(self) -> str:
        waiting, held, bound = self._state()
        return (
            f"pods not running: {waiting[:10]}; recorded, no pod: {sorted(bound - held)[:10]};"
            f" pods without record: {sorted(held - bound)[:10]}"
        )

    def _state(self) -> tuple[list[str], set[str], set[str]]:
        """(pods not running, addresses the pods hold, addresses recorded for a sandbox:
        detached sticky records aside)."""
        assert self.sim is not None and self.store is not None
        pods = self.sim.pods(NS)
        waiting = [f"{p.name}:{p.phase}" for p in pods if p.phase != "Running" and not p.terminal]
        held = {a for p in pods if (a := self.sim.address_of(p)) is not None}
        bound = {
            kv.key.rsplit("/", 1)[1]
            for kv in self.store.range(f"ips/{POOL}/")[0]
            if not rec.is_detached(rec.decode(kv.value))
        }
        return waiting, held, bound

    def _empty(self) -> bool:
        assert self.sim is not None and self.store is not None
        return (
            not self.sim.pods(NS)
            and not self.store.range(f"ips/{POOL}/")[0]
            and not self.store.range("sticky/")[0]
        )

    def _store_problems(self) -> list[Violation]:
        assert self.store is not None
        problems, _ = check(self.store)
        self.result.checks += 1
        return [Violation(time.time(), "check", p.key, f"{p.kind}: {p.detail}") for p in problems]

    def close(self) -> None:
        self._stop.set()
        if self.sim is not None:
            self.sim.stop()
        for p in [*self.controllers, *self.agents.values()]:
            p.kill()
        if self.store is not None:
            self.store.close()
        if self.etcd is not None:
            self.etcd.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- the view --------------------------------------------------------------------

    def _view(self) -> Group:
        r = self.result
        last = r.samples[-1] if r.samples else None
        window = r.samples[-5:]
        latencies = [ms for s in window for ms in s.add_ms]
        table = Table(title=f"ipward sim ({self.o.backend}, seed {self.o.seed})", show_header=False)
        table.add_row("elapsed", f"{last.at:.0f}s of {self.o.duration:g}s" if last else "-")
        table.add_row("pods", f"{last.running} running of {last.pods}" if last else "-")
        table.add_row("records", str(last.records) if last else "-")
        rate = sum(s.adds for s in window) / max(1, len(window))
        table.add_row("allocations/s", f"{rate:.1f}")
        if latencies:
            table.add_row(
                "ADD p50 / p99", f"{_pct(latencies, 50):.0f} / {_pct(latencies, 99):.0f} ms"
            )
        table.add_row("faults", f"{len(r.faults)}: {r.faults[-1][2] if r.faults else '-'}")
        table.add_row("violations", str(len(r.violations)))
        return Group(table)


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary_rows(result: Result) -> list[tuple[str, str]]:
    o = result.options
    faults = Counter(f[1] for f in result.faults)
    failed = ", ".join(f"code {k}: {v}" for k, v in sorted(result.add_failures.items()))
    rows = [
        ("store", o.backend),
        (
            "nodes / pods / rate / duration",
            f"{o.nodes} / {o.pods} / {o.rate:g}/s / {o.duration:g}s",
        ),
        ("actions", ", ".join(f"{k} {v}" for k, v in sorted(result.actions.items()))),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(faults.items()))),
        ("ADD calls", f"{result.add_calls}; failed and retried: {failed or 'none'}"),
    ]
    latencies = [ms for s in result.samples for ms in s.add_ms]
    if latencies:
        p50, p99 = statistics.median(latencies), _pct(latencies, 99)
        rows.append(("ADD latency p50 / p99", f"{p50:.1f} / {p99:.1f} ms"))
    frees = ", ".join(f"{k} {v}" for k, v in sorted(result.gc_frees.items()))
    rows += [
        ("GC frees", frees or "-"),
        ("invariant checks", str(result.checks)),
        ("converged after", _secs(result.converged_after)),
        ("pool empty after teardown", _secs(result.emptied_after)),
        ("violations", str(len(result.violations))),
    ]
    return rows


def summary(result: Result) -> Table:
    table = Table(title="ipward sim: summary")
    table.add_column("")
    table.add_column("")
    for name, value in summary_rows(result):
        table.add_row(name, value)
    return table


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}s"


def write_report(result: Result, directory: Path) -> Path:
    """The self-contained HTML report: pool use over time, ADD latency percentiles over
    time with fault markers, GC frees by reason, the summary, the violations."""
    from ipward_lab.report import Page, line_plot

    directory.mkdir(parents=True, exist_ok=True)
    markers = [(t, kind) for t, kind, _ in result.faults]
    samples = result.samples
    page = Page(f"ipward sim: {result.options.backend}, seed {result.options.seed}")
    page.heading("Summary")
    page.table(["", ""], [list(row) for row in summary_rows(result)])
    page.figure(
        line_plot(
            {
                "records": [(s.at, s.records) for s in samples],
                "pods running": [(s.at, s.running) for s in samples],
            },
            "seconds",
            "count",
            "Pool use over time",
            markers=markers,
        ),
        "Allocation records and running pods; vertical lines are faults.",
    )
    windows = [(s.at, s.add_ms) for s in samples if s.add_ms]
    page.figure(
        line_plot(
            {
                "p50": [(t, _pct(ms, 50)) for t, ms in windows],
                "p99": [(t, _pct(ms, 99)) for t, ms in windows],
            },
            "seconds",
            "ms",
            "ADD latency (plugin exec through the agent), per second",
            markers=markers,
        ),
        "ADD latency percentiles per second; vertical lines are faults.",
    )
    page.heading("Garbage collection frees by reason")
    page.table(["reason", "addresses"], [[k, str(v)] for k, v in sorted(result.gc_frees.items())])
    page.heading("Faults")
    page.table(["at", "fault", "what"], [[f"{t:.1f}s", k, d] for t, k, d in result.faults])
    page.heading("Violations")
    if result.violations:
        for v in result.violations:
            page.paragraph(f"{v.kind} {v.address}: {v.detail}")
            if v.history:
                page.table(["history"], [[line] for line in v.history])
    else:
        page.paragraph("None.")
    path = directory / "report.html"
    page.write(path)
    return path


@contextlib.contextmanager
def _workdir(path: str | None, keep: bool) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    tmp = Path(tempfile.mkdtemp(prefix="ipward-sim-"))
    try:
        yield tmp
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _faults(text: str) -> tuple[str, ...]:
    if text == "all":
        return FAULTS
    if text == "none":
        return ()
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in chosen if t not in FAULTS]
    if unknown:
        raise click.BadParameter(f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}")
    return chosen


@click.command("sim")
@click.option("--nodes", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--pods", type=click.IntRange(4, 2000), default=30, show_default=True)
@click.option(
    "--rate",
    type=click.FloatRange(0.1, 100),
    default=4.0,
    show_default=True,
    help="Workload actions per second (scale, roll, restart, delete, new Job).",
)
@click.option(
    "--duration",
    type=click.FloatRange(5),
    default=60.0,
    show_default=True,
    help="Seconds of churn.",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--faults",
    "faults_text",
    default="all",
    show_default=True,
    help=f"all, none, or a comma list of: {', '.join(FAULTS)}.",
)
@click.option(
    "--store",
    "backend",
    type=click.Choice(BACKENDS),
    default="sqlite",
    show_default=True,
    help="A fresh store: SQLite, one etcd, or a three-member etcd on loopback.",
)
@click.option(
    "--report", "report_dir", type=click.Path(file_okay=False), help="Write report.html here."
)
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep logs and state here.")
@click.option("--no-live", is_flag=True, help="No live view (for logs and CI).")
def sim_command(
    nodes: int,
    pods: int,
    rate: float,
    duration: float,
    seed: int,
    faults_text: str,
    backend: str,
    report_dir: str | None,
    workdir: str | None,
    no_live: bool,
) -> None:
    """Chaos soak: real agents, controllers and plugin on a real store, driven by the
    simulated cluster with faults; exit status 1 on any violation."""
    options = Options(
        nodes=nodes,
        pods=pods,
        rate=rate,
        duration=duration,
        seed=seed,
        faults=_faults(faults_text),
        backend=backend,
    )
    console = Console(stderr=True)
    with _workdir(workdir, keep=False) as where:
        result = Soak(options, where, console).run(live=not no_live and console.is_terminal)
        out = Console()
        out.print(summary(result))
        for v in result.violations:
            out.print(f"[red]VIOLATION[/] {v.kind} {v.address}: {v.detail}")
            for line in v.history:
                out.print(f"    {line}")
        if report_dir:
            out.print(f"report: {write_report(result, Path(report_dir))}")
    sys.exit(0 if result.ok else 1)
