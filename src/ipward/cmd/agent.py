"""`ipward agent`: the command that runs a node's agent (`ipward.agent`: what it does,
its socket, its caps, its stop) on the daemons' scaffold (`ipward.cmd.daemon`)."""

from __future__ import annotations

import os
import resource
import time

import click

from ipward.agent.continuity import UnknownToStore, check_store_knows_node
from ipward.agent.directory import cluster_directory, runtime_sandboxes
from ipward.agent.duties import NodeDuties
from ipward.agent.listener import DEFAULT_SOCKET, HANDOVER_WAIT, AgentError, Stopped
from ipward.agent.reconcile import Reconciler
from ipward.agent.server import DEFAULT_MAX_CONNECTIONS, Agent
from ipward.cluster.liveness import open_source
from ipward.cluster.pods import PodDirectory
from ipward.cmd import daemon
from ipward.cmd.daemon import HealthProbe, Signals, add_grace_option, redact
from ipward.cni.wire import CALL_TIMEOUT
from ipward.core import log
from ipward.core.errors import InvalidConfig
from ipward.core.names import check_node_name
from ipward.core.policy import ADD_GRACE, DUTY_INTERVAL, NODE_TTL, REGISTRATION_REFRESH
from ipward.store import Store, StoreError

DEFAULT_METRICS = "127.0.0.1:9310"
FD_MARGIN = 256  # descriptors kept for the store, the log, metrics and the workers


def run_agent(
    node: str,
    store_url: str,
    socket_path: str,
    *,
    metrics_address: tuple[str, int] | None,
    allow_gid: int | None,
    max_workers: int,
    drain_seconds: float,
    handover_seconds: float = HANDOVER_WAIT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    stuck_seconds: float = CALL_TIMEOUT,
    duty_interval: float = DUTY_INTERVAL,
    node_ttl: int = NODE_TTL,
    registration_refresh: float = REGISTRATION_REFRESH,
    liveness: str | None = None,
    add_grace: float = ADD_GRACE,
    reconcile_interval: float = 60.0,
    cluster: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    with Signals() as signals:
        source = open_source(liveness, node=node) if liveness else None
        directory = cluster_directory(cluster, node) if cluster else None
        # The schema is checked before serving: while the store cannot be reached, the
        # plugin finds no agent and answers 11, as it would for an unreachable store.
        store = daemon.open_daemon_store(store_url, signals.stop, AgentError)
        if store is None:
            log.info("agent stopped while waiting for its store", node=node)
            return 0
        try:
            check_store_knows_node(store, redact(store_url), node, source)
        except UnknownToStore as e:
            raise AgentError(str(e)) from None
        try:
            store_revision: int | str = store.revision()
        except StoreError as e:  # serve anyway: calls answer 11 until the store is back
            store_revision = f"unreachable ({e})"
            log.warning("store unreachable at start; serving anyway", error=str(e))
        max_connections = _descriptors_for(max_connections)
        agent = _open_agent(
            store,
            node,
            socket_path,
            allow_gid=allow_gid,
            max_workers=max_workers,
            max_connections=max_connections,
            stuck_seconds=stuck_seconds,
            directory=directory,
            sandboxes=runtime_sandboxes(source, node) if source is not None else None,
            standby_until=signals.stop,
        )
        if agent is None:
            log.info("agent stopped while standing by for the socket", node=node)
            return 0
        http = _start_http(agent, metrics_address, directory, drain_seconds)
        agent.start()
        duties = NodeDuties(
            store,
            node,
            duty_interval,
            node_ttl,
            registration_refresh,
            runtime=source is not None and source.covers_runtimes,
        )
        duties.start()
        reconciler = None
        if source is not None:
            reconciler = Reconciler(agent, source, grace=add_grace, interval=reconcile_interval)
            reconciler.start()
        log.info(
            "agent started",
            node=node,
            store=redact(store_url),
            store_revision=store_revision,
            socket=agent.socket.path,
            metrics=None if http is None else daemon.http_url(http),
            pid=os.getpid(),
            uid=agent.uid,
            allow_gid=allow_gid,
            max_workers=max_workers,
            max_connections=max_connections,
            stuck_seconds=stuck_seconds,
            liveness=liveness,
            cluster=cluster,
            add_grace=add_grace,
            reconcile_interval=reconcile_interval,
        )
        while not signals.stop.wait(1.0):
            pass
        left = _stop(agent, reconciler, duties, http, (handover_seconds, drain_seconds), signals)
    log.info("agent stopped", node=node)
    if left:
        os._exit(0)  # workers still running must not hold the interpreter's exit
    return 0


def _stop(
    agent: Agent,
    reconciler: Reconciler | None,
    duties: NodeDuties,
    http: daemon.ThreadingHTTPServer | None,
    seconds: tuple[float, float],
    signals: Signals,
) -> int:
    """Hand the socket over (`seconds`: at most the first, serving meanwhile), stop the
    background work, drain (within the second, counted from the stop: the pod's grace
    period is sized for the drain); how many calls were abandoned."""
    handover, drain = seconds
    log.info("agent stopping: handing the socket over", signal_count=signals.count)
    started = time.monotonic()
    taken = agent.begin_stop(handover, signals.cut_short)
    log.info("socket taken over by the next agent" if taken else "socket removed; draining")
    if reconciler is not None:
        reconciler.stop()
    duties.stop()
    left = _drain(agent, max(0.0, drain - (time.monotonic() - started)), signals)
    daemon.stop_http(http)
    agent.close(wait=not left)
    return left


def _drain(agent: Agent, seconds: float, signals: Signals) -> int:
    """Let the calls in flight finish (a second signal cuts it short); how many were
    abandoned."""
    started = time.monotonic()
    left = agent.drain(seconds, signals.cut_short)
    fields = {"seconds": round(time.monotonic() - started, 3), "abandoned": left}
    if left:
        log.warning("drain incomplete: calls still running are abandoned", **fields)
    else:
        log.info("drained", **fields)
    return left


def _open_agent(store: Store, node: str, socket_path: str, **options: object) -> Agent | None:
    """The agent on its socket (after standing by while another agent serves it); None
    when stopped meanwhile. The store is closed when no agent is made."""
    try:
        return Agent(store, node, socket_path, **options)  # type: ignore[arg-type]
    except Stopped:
        store.close()
        return None
    except OSError as e:  # the socket's directory, file, lock or owner
        store.close()
        raise AgentError(f"socket {socket_path}: {e}") from e
    except BaseException:
        store.close()
        raise


def _start_http(
    agent: Agent,
    address: tuple[str, int] | None,
    directory: PodDirectory | None,
    drain_seconds: float,
) -> daemon.ThreadingHTTPServer | None:
    """/metrics and /healthz: unhealthy when the agent is stopping or stuck, its store
    does not answer (`HealthProbe`), or its cluster source (`--cluster`) cannot be read
    as it should (`PodDirectory.unavailable`). The address may still be the agent's
    before this one, draining after it let the socket go: tried again for as long as a
    drain lasts. The agent is closed when the address cannot be served."""
    if address is None:
        return None
    probe = HealthProbe(agent.store)

    def health() -> tuple[bool, str]:
        ok, reason = agent.health()
        if not ok:
            return ok, reason
        ok, reason = probe.check()
        if not ok:
            return ok, reason
        cluster = directory.unavailable() if directory is not None else None
        return (False, f"cluster source: {cluster}") if cluster else (True, "ok")

    try:
        return daemon.start_http(
            address, agent.metrics.registry, health, "ipward-agent", in_use_for=drain_seconds + 5
        )
    except BaseException:
        agent.close(wait=True)
        raise


def _descriptors_for(max_connections: int) -> int:
    """Raise the open-files limit (up to its hard limit) so that `max_connections` fit
    beside what the agent needs otherwise; the number of connections that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "open-files limit too low for --max-connections; serving fewer",
            max_connections=max(soft - FD_MARGIN, 1),
            limit=soft,
        )
        return max(soft - FD_MARGIN, 1)
    return max_connections


def _parse_gid(text: str | None) -> int | None:
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    import grp

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise InvalidConfig(f"--allow-gid {text!r}: no such group") from None


@click.command("agent")
@click.option(
    "--node",
    default=lambda: os.uname().nodename,
    show_default="this host's name",
    help="The node this agent serves (its records name it; the CNI config's 'node' is ignored).",
)
@daemon.store_option(" The CNI config's 'store' is ignored.")
@click.option(
    "--socket",
    "socket_path",
    default=DEFAULT_SOCKET,
    show_default=True,
    help="Unix socket the plugin connects to ('agentSocket' in its config).",
)
@daemon.metrics_option(DEFAULT_METRICS)
@click.option("--allow-gid", help="Also serve callers whose group is this (name or number).")
@daemon.log_file_option
@daemon.log_level_option
@click.option("--max-workers", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    help="Connections open at once; more are answered 11 at once, without being read.",
)
@click.option(
    "--stuck-seconds",
    type=click.FloatRange(1),
    default=CALL_TIMEOUT,
    show_default=True,
    help="/healthz reports the agent stuck when a request waits this long for a worker"
    " or its answer (the plugin gives up after 60 s).",
)
@click.option(
    "--drain-seconds",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, how long calls in flight may take to finish.",
)
@click.option(
    "--handover-seconds",
    type=click.FloatRange(0),
    default=HANDOVER_WAIT,
    show_default=True,
    help="On SIGTERM/SIGINT, how long to serve on until the next agent (a rollout's)"
    " has put its socket over the path; then the socket is removed.",
)
@click.option(
    "--duty-interval",
    type=click.FloatRange(0.05),
    default=DUTY_INTERVAL,
    show_default=True,
    help="Seconds between answers to block handshakes (the node's registration is renewed"
    " every --node-ttl/3).",
)
@click.option(
    "--node-ttl",
    type=click.IntRange(1),
    default=NODE_TTL,
    show_default=True,
    help="Lease TTL of the node's registration (etcd raises it to at least 2).",
)
@click.option(
    "--registration-refresh",
    type=click.FloatRange(1),
    default=REGISTRATION_REFRESH,
    show_default=True,
    help="Seconds between puts of the node's registration with this agent's clock (judges"
    " measure the node's clock offset from it; a registration found deleted is put back).",
)
@click.option(
    "--liveness",
    help="Where the runtime lists this node's sandboxes, for reconciliation:"
    " cri:///run/containerd/containerd.sock, or sim:///PATH (the labs' simulated"
    " cluster); not k8s:// (the API lists no sandboxes). Without it, nothing is"
    " reconciled.",
)
@click.option(
    "--cluster",
    help="Where pods' annotations and owners are read for ADD (pool selection, sticky"
    " StatefulSet addresses): k8s:// or k8s://?kubeconfig=PATH (the Kubernetes API), or"
    " sim:///PATH (the labs' simulated cluster). Without it, the CNI config alone"
    " decides.",
)
@add_grace_option
@click.option(
    "--reconcile-interval",
    type=click.FloatRange(0.1),
    default=60.0,
    show_default=True,
    help="Seconds between reconciliation passes.",
)
@click.pass_context
def agent_command(
    ctx: click.Context,
    node: str,
    store_url: str | None,
    socket_path: str,
    metrics_address: str,
    allow_gid: str | None,
    log_file: str | None,
    log_level: str,
    max_workers: int,
    max_connections: int,
    stuck_seconds: float,
    drain_seconds: float,
    handover_seconds: float,
    duty_interval: float,
    node_ttl: int,
    registration_refresh: float,
    liveness: str | None,
    cluster: str | None,
    add_grace: float,
    reconcile_interval: float,
) -> None:
    """Serve the CNI plugin of this node over a Unix socket (one agent per node)."""
    url = daemon.start(ctx, store_url, log_file, log_level, "ipward-agent")
    check_node_name(node, "--node")
    status = run_agent(
        node,
        url,
        socket_path,
        metrics_address=daemon.parse_address(metrics_address),
        allow_gid=_parse_gid(allow_gid),
        max_workers=max_workers,
        max_connections=max_connections,
        stuck_seconds=stuck_seconds,
        drain_seconds=drain_seconds,
        handover_seconds=handover_seconds,
        duty_interval=duty_interval,
        node_ttl=node_ttl,
        registration_refresh=registration_refresh,
        liveness=liveness,
        add_grace=add_grace,
        reconcile_interval=reconcile_interval,
        cluster=cluster,
    )
    ctx.exit(status)
