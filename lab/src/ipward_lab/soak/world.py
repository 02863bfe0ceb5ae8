"""Real processes behind a simulated cluster, for the scenario tests: one `ipward agent`
per simulated node, all on one store, so the simulated kubelets' plugin calls allocate
for real (`agents`); and a `World` of agents, controllers and the simulated cluster,
checked by the soak's checker (`ipward_lab.soak.checker`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ipward.core import keys
from ipward.core import records as rec
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.kube_admin import KubeApi
from ipward_lab.simcluster import SimCluster
from ipward_lab.soak.checker import Checker
from ipward_lab.soak.result import Options, Result
from ipward_lab.waiting import wait_for

if TYPE_CHECKING:
    from ipward_lab.servers.kube_test_server import KubeApiServer


@contextmanager
def agents(
    tmp: Path, store: str, nodes: list[str], extra: tuple[str, ...] = ()
) -> Iterator[dict[str, fleet.Agent]]:
    """An agent per node (started together, then waited for), stopped at the end."""
    # Sockets in a short directory: a pytest tmp path can pass AF_UNIX's 108 bytes.
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
    started = {
        node: fleet.Agent(node, store, run_dir / node / "agent.sock", tmp, extra) for node in nodes
    }
    try:
        for agent in started.values():
            agent.wait_ready()
        yield started
    finally:
        for agent in started.values():
            try:
                agent.stop()
            except Exception:
                agent.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


GRACE = 2.0  # the ADD grace of agents and controllers here
INTERVAL = 0.3  # GC and reconcile passes
NODE_TTL = 2
NS = "ns"
POOL = "p"
# The k8s:// sources' options here: stale after 4 s unheard (watches of 2 s) and as_of 1 s
# before what was heard, as the soak has them. With the defaults (watches of 60 s), a
# quiet cluster's source is heard again only at a watch's end: a GC that waits for its
# grace to pass in `as_of` (a completed job, a retired sticky address) waits up to a
# minute, which is right in a cluster and too slow for a test.
K8S_OPTIONS = "&stale=4&margin=1"
CONTROLLER_TOKEN = "controller-token"  # what the controllers read the test server with


class World:
    """One store, one simulated cluster, agents per node and controllers. With `kube`, the
    cluster is published to that API server and read through `k8s://`: the controller's
    `--liveness` and the agents' `--cluster`; the agents keep `--liveness sim://` for
    their node's runtime (the API lists no sandboxes)."""

    def __init__(
        self, tmp: Path, plugin: Path, url: str, grace: float = GRACE, kube: KubeApi | None = None
    ) -> None:
        self.grace = grace  # the ADD grace of its agents and controllers
        self.tmp = tmp
        self.url = url
        self.plugin = plugin
        self.state = tmp / "cluster.json"
        self.liveness = f"sim://{self.state}"  # the runtimes (and without `kube` the cluster)
        self.kube = kube
        self.cluster = self.liveness
        self.gc_liveness = self.liveness  # the controllers'
        if kube is not None:
            self.cluster = self.gc_liveness = f"k8s://?kubeconfig={kube.kubeconfig}{K8S_OPTIONS}"
        if kube is not None and kube.server is not None:
            # The controllers' own token: revoked, only they are refused (`fail_cluster`).
            kube.server.tokens[CONTROLLER_TOKEN] = ("controller", None)
            config = kube.server.kubeconfig(tmp / "controller.kubeconfig", token=CONTROLLER_TOKEN)
            self.gc_liveness = f"k8s://?kubeconfig={config}{K8S_OPTIONS}"
        self.sim = SimCluster(
            str(self.state),
            str(plugin),
            network="simnet",
            pool=POOL,
            grace=1.0,
            retry_delay=0.3,
            api=kube.admin if kube is not None else None,
        )
        # Sockets in a short directory: a pytest tmp path can pass AF_UNIX's 108 bytes.
        self.run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
        self.agents: dict[str, fleet.Agent] = {}
        self.controllers: list[fleet.Controller] = []
        self.store = open_store(url)
        self.checker = Checker(self.sim, self.store, Result(Options()), pool=POOL, namespace=NS)
        self.collectors: list[fleet.Process] = []  # those that free leaked addresses

    def pool(self, *options: str) -> None:
        run_cli("pool", "create", POOL, "--cooldown", "0", *options, store=self.url, check=True)

    def agent(
        self,
        node: str,
        liveness: bool = True,
        env: dict[str, str] | None = None,
        cluster: bool = False,
    ) -> fleet.Agent:
        extra = [
            "--duty-interval",
            "0.2",
            "--node-ttl",
            str(NODE_TTL),
            "--add-grace",
            str(self.grace),
            "--reconcile-interval",
            str(INTERVAL),
        ]
        if liveness:
            extra += ["--liveness", self.liveness]
        # Pod annotations and owners at ADD (sticky StatefulSets); through k8s:// also the
        # pods its reconciliation judges by (the state file has no cluster then).
        if cluster or (liveness and self.kube is not None):
            extra += ["--cluster", self.cluster]
        socket = self.run_dir / node / "agent.sock"
        agent = fleet.Agent(node, self.url, socket, self.tmp / "logs", tuple(extra), env)
        self.agents[node] = agent
        if liveness:
            self.collectors.append(agent)
        return agent.wait_ready()

    def node(self, name: str, liveness: bool = True, cluster: bool = False) -> fleet.Agent:
        agent = self.agent(name, liveness, cluster=cluster)
        self.sim.add_node(name, str(agent.socket))
        return agent

    def controller(
        self,
        ident: str,
        gc: bool = True,
        env: dict[str, str] | None = None,
        gc_interval: float = INTERVAL,
    ) -> fleet.Controller:
        extra = ["--interval", "0.2", "--lease-ttl", "2", "--ready-delay", "0.3"]
        if gc:
            extra += [
                "--liveness",
                self.gc_liveness,
                "--add-grace",
                str(self.grace),
                "--gc-interval",
                str(gc_interval),
            ]
        ctl = fleet.Controller(ident, self.url, self.tmp / "logs", tuple(extra), env)
        self.controllers.append(ctl)
        if gc:
            self.collectors.append(ctl)
        ctl.wait_started()
        return ctl

    # -- faults of the cluster source

    @property
    def faults_on_demand(self) -> bool:
        """Whether the cluster source can be failed (`fail_cluster`, `lag_cluster`): not
        through the real kube-apiserver, which cannot refuse one client on demand."""
        return self.kube is None or self.kube.server is not None

    def fail_cluster(self, msg: str) -> None:
        """The controllers' cluster source cannot answer: the state file's error, or
        through k8s:// their watches cut and their token refused (lists and watches get
        401), so it cannot list again. The agents' k8s:// source, which ADD needs (a pod
        it cannot read is code 11), and the simulated cluster's writes go on."""
        if self.kube is None:
            self.sim.fail_cluster(msg)
            return
        server = self._api_server()
        server.tokens.pop(CONTROLLER_TOKEN)
        server.cut_streams()

    def lag_cluster(self, seconds: float) -> None:
        """The cluster source answers with an old view: the state file's lag. A k8s://
        source has no old view to give on demand (it answers while heard within `stale`,
        else not at all): through k8s:// the controllers' source fails (`fail_cluster`)."""
        if self.kube is None:
            self.sim.lag_cluster(seconds)
        else:
            self.fail_cluster(f"lag {seconds:g}s")

    def clear_faults(self) -> None:
        self.sim.clear_faults()
        if self.kube is not None and self.kube.server is not None:
            self.kube.server.tokens[CONTROLLER_TOKEN] = ("controller", None)

    def _api_server(self) -> KubeApiServer:
        """The test server (faults on demand: `faults_on_demand`)."""
        if self.kube is None or self.kube.server is None:
            raise RuntimeError("no faults on demand here (see `faults_on_demand`)")
        return self.kube.server

    # -- observing

    def records(self) -> dict[str, tuple[dict, int]]:
        """ip -> (record, mod_revision)."""
        kvs, _ = self.store.range(keys.ADDRESSES)
        return {keys.ip_parts(kv.key)[1]: (rec.decode(kv.value), kv.mod_revision) for kv in kvs}

    def running(self, ref: str) -> str:
        """Wait until the pod runs with an address; its address."""
        return str(wait_for(lambda: self._running_address(ref), f"{ref} running with an address"))

    def _running_address(self, ref: str) -> str | None:
        try:
            pod = self.sim.pod(ref)
        except KeyError:
            return None
        return self.sim.address_of(ref) if pod.phase == "Running" else None

    def gone(self, ref: str) -> None:
        def absent() -> bool:
            try:
                self.sim.pod(ref)
            except KeyError:
                return True
            return False

        wait_for(absent, f"{ref} gone from the API")

    def freed_logs(self) -> list[dict]:
        """Every `freed` log line of every process, with who wrote it."""
        out = []
        for p in [*self.agents.values(), *self.controllers]:
            for entry in p.logged("freed"):
                out.append({**entry, "by": p.name})
        return out

    def frees_logged(self, ips: Iterable[str]) -> list[dict]:
        """The `freed` log lines naming any of `ips`, once each of them is named: a free
        is logged just after its commit, so a line can follow the store's state."""
        wanted = set(ips)

        def named(entry: dict) -> set[str]:
            return {ip.rsplit("/", 1)[1] for ip in entry.get("ips", [])}

        def found() -> list[dict] | None:
            entries = [e for e in self.freed_logs() if named(e) & wanted]
            return entries if wanted <= set().union(*map(named, entries)) else None

        return list(wait_for(found, f"the frees of {sorted(wanted)} logged"))

    def wait_past_grace(self, ips: Iterable[str]) -> None:
        """Until the records of `ips` are older than the ADD grace (by their
        `created_at`): from then on a collector judges them."""
        wanted, records = sorted(ips), self.records()
        last = max(records[ip][0]["created_at"] for ip in wanted)
        wait_for(lambda: time.time() > last + self.grace, f"the records of {wanted} past the grace")

    def wait_passes(self, passes: int = 3) -> None:
        """Until every collector running has ended `passes` more passes: each agent's
        reconciliation, and the controllers' garbage collection (the leader's: their
        sum). What a check that nothing was freed waits for."""
        running = [p for p in self.collectors if p.running]
        agents = [p.reconcile_passes for p in running if isinstance(p, fleet.Agent)]
        controllers = [p for p in running if isinstance(p, fleet.Controller)]
        gc = [lambda: sum(c.gc_passes() for c in controllers)] if controllers else []
        fleet.wait_passes([*agents, *gc], passes, "passes of every collector")

    def assert_invariants(self) -> None:
        """The soak's checks, now: no address on two ready pods, no ready pod's record
        lost, `ipward check` clean (`ipward_lab.soak.checker`)."""
        found = self.checker.check_once() + self.checker.store_problems()
        if found:
            raise AssertionError(f"invariants broken: {found}")

    def __enter__(self) -> World:
        self.sim.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sim.stop()
        for p in [*self.controllers, *self.agents.values()]:
            p.kill()
        self.store.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
