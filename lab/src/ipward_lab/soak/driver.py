"""The soak's driver: the store, agents and controllers (real processes), the
simulated cluster (published to an API server with `--api`), the workload's random
actions and the faults at their seeded times, for the run's duration; then the end
(faults off, convergence, teardown), each checked by `checker.Checker`."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from ipward.cluster.liveness import Pod
from ipward.core import keys
from ipward.core.pool import PoolSpec
from ipward.core.startpath import write_launcher
from ipward.ipam.pools import create_pool
from ipward.kubeapi.client import ApiClient
from ipward.kubeapi.config import from_kubeconfig
from ipward.store import Store, StoreError, open_store
from ipward_lab import fleet
from ipward_lab.servers import kube_apiserver
from ipward_lab.servers.etcd import EtcdCluster, EtcdServer, first_start
from ipward_lab.servers.kube_admin import KubeAdmin
from ipward_lab.servers.kube_test_server import KubeApiServer, kube_api_server
from ipward_lab.simcluster import SimCluster
from ipward_lab.soak.checker import Checker
from ipward_lab.soak.kube_store import KILLED_FOR, PAUSED, RELIST_WAIT, KubeStoreSide
from ipward_lab.soak.result import (
    GC_REASONS,
    NETWORK,
    NS,
    POOL,
    Options,
    Result,
    Sample,
    SoakError,
    Violation,
    fault_unavailable,
)
from ipward_lab.soak.view import live_view

# The k8s:// sources' options. The test server has no watch cache to lag: stale after
# 4 s unheard (watches of 2 s; api-stall goes past it), as_of 1 s before an event or a
# watch's clean end. The real one gets the defaults, as in a real cluster.
K8S_OPTIONS = {"test": "&stale=4&margin=1", "real": ""}
API_DOWN = 4.0  # seconds an api-down lasts
STALL_NOTICED = 60.0  # longest api-stall before the controllers must have said it is stale
GC_BLIND = "garbage collection: no liveness source answered; nothing judged"
WHOLE_AGAIN = (": reading it whole again", ": reading the store whole")  # followers' logs


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
        self._checker: Checker | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix="ipw-sim-"))  # short socket paths
        self._exits = contextlib.ExitStack()  # the API server, when there is one
        self.kube_server: KubeApiServer | None = None  # --api test
        self.kube_lab: kube_apiserver.KubeLab | None = None  # --api real
        self.k8s_url = ""  # what agents (--cluster) and controllers (--liveness) read
        self.kube_admin: KubeAdmin | None = None  # the simulated cluster publishes with it
        self.kube_store: KubeStoreSide | None = None  # --store k8s: the store's API server
        self._stall_looked = 0.0  # when the controllers' logs were last read for api-stall

    @property
    def checker(self) -> Checker:
        assert self._checker is not None, "start() first"
        return self._checker

    # -- set-up ---------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_api()  # first: a server that cannot be had stops the run before anything
        self.url = self._start_store()
        self.store = open_store(self.url)
        bin_dir = self.workdir / "bin"
        write_launcher(bin_dir / "ipward")  # as `ipward install-cni` does
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
        create_pool(self.store, spec)
        self.sim = SimCluster(
            str(self.workdir / "cluster.json"),
            str(bin_dir / "ipward"),
            network=NETWORK,
            pool=POOL,
            grace=1.0,
            retry_delay=0.5,
            seed=self.o.seed,
            api=self.kube_admin,
        )
        self._checker = Checker(self.sim, self.store, self.result)
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
        if self.o.backend == "k8s":
            self.kube_store = KubeStoreSide(self.workdir, self._exits)
            return self.kube_store.url
        if self.o.backend == "etcd":
            server = EtcdServer(self.workdir / "etcd")
            first_start(server, server.choose_ports)
            self.etcd = server
            return server.url
        cluster = EtcdCluster(self.workdir / "etcd", members=3)
        cluster.start()
        self.etcd = cluster
        return cluster.url

    def _start_api(self) -> None:
        """With `--api`: the API server the simulated cluster is published to, and the
        `k8s://` URL agents and controllers read it with."""
        if self.o.api == "none":
            return
        where = self.workdir / "kube"
        where.mkdir(exist_ok=True)
        if self.o.api == "test":
            self.kube_server = self._exits.enter_context(kube_api_server(where))
            kubeconfig = self.kube_server.kubeconfig(where / "kubeconfig")
        else:
            executable = kube_apiserver.binary()
            if executable is None:
                raise SoakError("--api real needs KUBE_APISERVER naming a kube-apiserver binary")
            self.kube_lab = self._exits.enter_context(
                kube_apiserver.kube_apiserver(executable, where)
            )
            kubeconfig = self.kube_lab.kubeconfig
        self.k8s_url = f"k8s://?kubeconfig={kubeconfig}{K8S_OPTIONS[self.o.api]}"
        client = ApiClient(from_kubeconfig(str(kubeconfig)), timeout=5.0)
        self._exits.callback(client.close)
        self.kube_admin = KubeAdmin(client)

    def _start_agent(self, node: str) -> fleet.Agent:
        liveness = f"sim://{self.workdir / 'cluster.json'}"
        # The runtime is the node's own (the state file, as CRI would be); the pods, their
        # annotations and owners come from the API when there is one.
        cluster = self.k8s_url or liveness
        extra = (
            "--liveness",
            liveness,
            "--cluster",
            cluster,
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
            self.k8s_url or f"sim://{self.workdir / 'cluster.json'}",
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
        kinds = [
            k for k in self.o.faults if fault_unavailable(k, self.o.backend, self.o.api) is None
        ]
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
        if kind.startswith("api-"):
            return self._inject_api(kind, now)
        if kind.startswith("store-"):
            return self._inject_store(kind, now)
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

    def _inject_api(self, kind: str, now: float) -> str:
        """The API server's faults: made by the test server; the real one can only be
        stopped and started again (`api-down`)."""
        if kind == "api-down":
            if self.kube_lab is not None:
                self.kube_lab.stop()
            else:
                assert self.kube_server is not None
                self.kube_server.go_down()
            self._restarts.append((now + API_DOWN, "api", None))
            return f"API server down {API_DOWN:g}s"
        assert self.kube_server is not None
        if kind == "api-expire":
            self.kube_server.expire_history()
            return "watch history expired: 410 on every watch"
        if kind == "api-cut":
            self.kube_server.cut_streams()
            return "every watch stream cut"
        self.kube_server.stall()
        self._restarts.append((now, "unstall", (time.time(), now + STALL_NOTICED)))
        return "watches stalled (no events, no bookmarks) until GC finds the cluster stale"

    def _inject_store(self, kind: str, now: float) -> str:
        """The Kubernetes store's API server's faults (`kube_store`)."""
        side = self.kube_store
        assert side is not None
        if kind == "store-conflicts":
            side.storm()
            return "another ipward writer rewrites every ledger object for 5s (409s)"
        if kind == "store-relist":
            # An agent paused past its watch's end (SIGSTOP): the server ends the watch
            # meanwhile, the ledger is compacted past where it was, and resumed
            # (SIGCONT) it resumes the watch there and is answered 410.
            node = self.rng.choice(sorted(self.agents))
            agent = self.agents[node]
            os.kill(agent.pid, signal.SIGSTOP)
            since = time.time()
            with contextlib.suppress(Exception):  # the store's API server may be down
                side.compact()
            self._restarts.append((now + PAUSED, "resume", (agent, since)))
            return f"agent of {node} paused {PAUSED:g}s, the store compacted meanwhile (410)"
        side.kill()
        self._restarts.append((now + KILLED_FOR, "store-api", None))
        return f"store's API server SIGKILLed for {KILLED_FOR:g}s"

    def relisted(self, since: float) -> int:
        """How many times a follower (an agent's node index, a controller's view) read
        the ledger whole again because its watch's history was gone, since `since`."""
        return sum(
            1
            for p in [*self.agents.values(), *self.controllers, *self.dead]
            for entry in p.logs()
            if str(entry.get("msg", "")).endswith(WHOLE_AGAIN)
            and entry.get("reason") == "compacted"
            and entry.get("ts", 0) >= since
        )

    def _relist_check(self, since: float, deadline: float, final: bool) -> None:
        """A store-relist's follow-up: done once a follower read the ledger whole on a
        410 since `since`; looked at again in 1 s until `deadline` (then a violation)."""
        while not self.relisted(since) and time.monotonic() < deadline:
            if not final:
                self._restarts.append((time.monotonic() + 1.0, "relist", (since, deadline)))
                return
            time.sleep(1.0)  # the run's end: waited for here
        if self.relisted(since):
            return
        self.checker.record(
            [
                Violation(
                    time.time(),
                    "fault-missed",
                    "-",
                    f"an agent paused past its watch's end, the store compacted; no"
                    f" follower read the ledger whole on a 410 within {RELIST_WAIT:g}s",
                )
            ]
        )

    def _stale_noticed(self, since: float) -> bool:
        """Whether a controller's garbage collection found its k8s:// source stale (and
        so judged nothing) since `since`. Its logs are read at most twice a second."""
        if time.monotonic() < self._stall_looked + 0.5:
            return False
        self._stall_looked = time.monotonic()
        return any(
            entry.get("ts", 0) >= since and "nothing heard" in str(entry.get("cluster"))
            for ctl in self.controllers
            for entry in ctl.logged(GC_BLIND)
        )

    def _due_restarts(self, final: bool = False) -> None:
        now = time.monotonic()
        for item in [r for r in self._restarts if final or r[0] <= now]:
            _, what, arg = item
            if what == "unstall" and not final and not self._stale_noticed(arg[0]):
                if now < arg[1]:
                    continue  # stalled on: no controller found its source stale yet
                self.checker.record(
                    [
                        Violation(
                            time.time(),
                            "stale-answered",
                            "-",
                            f"watches stalled {STALL_NOTICED:g}s and no controller's k8s://"
                            " source answered unavailable",
                        )
                    ]
                )
            self._restarts.remove(item)
            if what == "unstall":
                assert self.kube_server is not None
                self.kube_server.unstall()
            elif what == "api":
                if self.kube_lab is not None:
                    self.kube_lab.start()  # not waited for: everyone retries until it answers
                else:
                    assert self.kube_server is not None
                    self.kube_server.come_back()
            elif what == "store-api":
                assert self.kube_store is not None
                self.kube_store.start()
            elif what == "resume":
                agent, since = arg
                with contextlib.suppress(ProcessLookupError):  # killed meanwhile
                    os.kill(agent.pid, signal.SIGCONT)
                self._relist_check(since, time.monotonic() + RELIST_WAIT, final)
            elif what == "relist":
                self._relist_check(arg[0], arg[1], final)
            elif what == "agent":
                self._start_agent(arg).wait_ready()
            elif what == "controller":
                self._start_controller()
            else:
                assert isinstance(self.etcd, EtcdCluster)
                self.etcd.restart(arg)

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
            records = len(self.store.range(keys.ips_prefix(POOL))[0])
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
                if entry.get("msg") not in ("freed", "detached"):
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
        checking = threading.Thread(target=self._check_loop, daemon=True)
        checking.start()
        view = Live(
            live_view(self.result, self.o),
            console=self.console,
            refresh_per_second=2,
            transient=True,
        )
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
                        view.update(live_view(self.result, self.o))
                time.sleep(0.02)
        self._stop.set()
        checking.join()

    def _check_loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.checker.record(self.checker.check_once())
            except Exception as e:  # the checker must not die silently
                self.checker.record([Violation(time.time(), "checker-error", "-", repr(e))])

    def _finish(self) -> None:
        """Faults off, everything back, then convergence, check, teardown, check."""
        assert self.sim is not None and self.store is not None
        self.sim.clear_faults()
        self.sim.drop_del_rate = 0.0
        self._due_restarts(final=True)
        started = time.monotonic()
        converged = self._wait(self.checker.converged, self.o.settle)
        if converged:
            self.result.converged_after = time.monotonic() - started
        else:
            self.checker.record(
                [Violation(time.time(), "not-converged", "-", self.checker.why_not())]
            )
        self.checker.record(self.checker.store_problems())
        for name in self.deployments:
            self.sim.delete_deployment(NS, name)
        for name in self.statefulsets:
            self.sim.delete_statefulset(NS, name)
        for pod in self.sim.pods(NS):
            with contextlib.suppress(KeyError):
                self.sim.delete_pod(pod)
        started = time.monotonic()
        if self._wait(self.checker.empty, self.o.settle):
            self.result.emptied_after = time.monotonic() - started
        else:
            left = [kv.key for kv in self.store.range(keys.ips_prefix(POOL))[0]]
            left += [kv.key for kv in self.store.range(keys.STICKY)[0]]
            self.checker.record(
                [Violation(time.time(), "leak", "-", f"left after teardown: {left[:20]}")]
            )
        self.checker.record(self.checker.store_problems())
        self.result.gc_frees = self.gc_frees()

    def _wait(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                if condition():
                    return True
            time.sleep(0.25)
        return False

    def close(self) -> None:
        self._stop.set()
        if self.sim is not None:
            self.sim.stop()
        for p in [*self.controllers, *self.agents.values()]:
            p.kill()
        self._exits.close()
        if self.store is not None:
            self.store.close()
        if self.etcd is not None:
            self.etcd.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
