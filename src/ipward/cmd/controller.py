"""`ipward controller`: the command that runs one controller instance (`ipward.controller`:
its passes; `ipward.controller.election`: who leads) on the daemons' scaffold
(`ipward.cmd.daemon`)."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import click

from ipward.cluster.liveness import open_source
from ipward.cmd import daemon
from ipward.cmd.daemon import Signals, add_grace_option, redact
from ipward.controller.election import Election
from ipward.controller.metrics import Metrics
from ipward.controller.passes import Controller, ControllerError
from ipward.controller.pool_objects import objects_client
from ipward.controller.view import DEFAULT_REREAD_EVERY
from ipward.core import log
from ipward.core.errors import InvalidConfig
from ipward.core.policy import ADD_GRACE
from ipward.store import open_backend

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

DEFAULT_METRICS = "127.0.0.1:9311"


def run_controller(
    store_url: str,
    ident: str,
    *,
    interval: float,
    lease_ttl: int,
    ready_delay: float,
    metrics_address: tuple[str, int] | None,
    liveness: str | None = None,
    add_grace: float = ADD_GRACE,
    gc_interval: float = 30.0,
    view_reread: float = DEFAULT_REREAD_EVERY,
) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    controllers: list[Controller] = []  # the one made below, for the signal handler

    def on_stop() -> None:
        for made in controllers:
            made.stop()

    with Signals(on_stop) as signals:
        # The schema is checked before the first pass; an unreachable store is waited for.
        pass_store = daemon.open_daemon_store(store_url, signals.stop, ControllerError)
        if pass_store is None:
            log.info("controller stopped while waiting for its store", id=ident)
            return 0
        try:
            election_store = open_backend(store_url)  # the same store, checked just now
        except BaseException:
            pass_store.close()
            raise
        election = Election(election_store, ident, lease_ttl)
        metrics = Metrics(ident, lambda: election.leading)
        controller = Controller(
            pass_store,
            election,
            metrics,
            interval=interval,
            ready_delay=ready_delay,
            liveness=open_source(liveness) if liveness else None,
            add_grace=add_grace,
            gc_interval=gc_interval,
            view_reread=view_reread,
            objects_client=objects_client(store_url),
        )
        controllers.append(controller)
        election.on_change = controller.on_leadership
        metrics.leader.set(0)
        settings = {
            "id": ident,
            "store": redact(store_url),
            "interval": interval,
            "lease_ttl": lease_ttl,
            "ready_delay": ready_delay,
            "liveness": liveness,
            "add_grace": add_grace,
            "gc_interval": gc_interval,
            "view_reread": view_reread,
            "pool_objects": controller.pool_objects is not None,
        }
        _serve(controller, metrics_address, signals.stop, settings)
    log.info("controller stopped", id=ident)
    return 0


def _serve(
    controller: Controller,
    metrics_address: tuple[str, int] | None,
    stop: threading.Event,
    settings: dict[str, object],
) -> None:
    """Serve metrics and health, campaign and run the passes until stopped; then let
    go of everything (resigning when leading: the successor need not wait for the
    lease)."""
    election, metrics = controller.election, controller.metrics
    http = None
    # SIGUSR1: a pass now rather than an interval later (an operator after fixing a
    # liveness source; the scale benchmark, to time one pass over a known change).
    previous = signal.signal(signal.SIGUSR1, lambda _signum, _frame: controller.pass_now())
    try:
        if metrics_address is not None:
            health = _health(election)
            http = daemon.start_http(metrics_address, metrics.registry, health, "ipward-controller")
        if stop.is_set():
            controller.stop()
        election.start()
        if controller.pool_objects is not None:
            controller.pool_objects.start()
        url = None if http is None else daemon.http_url(http)
        log.info("controller started", **settings, metrics=url, pid=os.getpid())
        controller.run()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        controller.stop()
        controller.view.close()
        election.stop()
        metrics.leader.set(0)
        daemon.stop_http(http)
        controller.store.close()
        election.store.close()
        if controller.liveness is not None:
            controller.liveness.close()
        if controller.pool_objects is not None:
            controller.pool_objects.close()


def _health(election: Election) -> Callable[[], tuple[bool, str]]:
    """`/healthz`: the store answered the election within two leases (or three polls)."""

    def health() -> tuple[bool, str]:
        if not election.store_ok_at:
            return False, "store not answered yet"
        age = time.monotonic() - election.store_ok_at
        if age > max(2 * election.ttl, 3 * election.poll):
            return False, f"store not answered for {age:.1f}s"
        return True, "ok: leader" if election.leading else "ok: standby"

    return health


@click.command("controller")
@daemon.store_option()
@click.option(
    "--id",
    "ident",
    default=lambda: f"{os.uname().nodename}-{os.getpid()}",
    show_default="HOSTNAME-PID",
    help="This instance's name in the leader key, logs and metrics.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.01),
    default=5.0,
    show_default=True,
    help="Seconds between passes.",
)
@click.option(
    "--lease-ttl",
    type=click.IntRange(1),
    default=10,
    show_default=True,
    help="Seconds of the leader lease: a successor takes over about this long after the"
    " leader dies (etcd raises TTLs below 2 to 2).",
)
@click.option(
    "--ready-delay",
    type=click.FloatRange(0),
    default=5.0,
    show_default=True,
    help="Seconds a block answered ready waits before it is deleted, so a node that"
    " answered and then needs it can still take it back.",
)
@daemon.metrics_option(DEFAULT_METRICS)
@daemon.log_file_option
@daemon.log_level_option
@click.option(
    "--liveness",
    help="Where the cluster's pods (and nodes' sandboxes) are listed, for garbage"
    " collection: k8s:// or k8s://?kubeconfig=PATH (the Kubernetes API), cri:///SOCKET"
    " (one node's runtime), or sim:///PATH (the labs' simulated cluster). Without it,"
    " nothing is garbage-collected.",
)
@add_grace_option
@click.option(
    "--gc-interval",
    type=click.FloatRange(0.01),
    default=30.0,
    show_default=True,
    help="Seconds between garbage-collection passes (a record is freed on its second"
    " pass as a candidate).",
)
@click.option(
    "--view-reread",
    type=click.FloatRange(1),
    default=DEFAULT_REREAD_EVERY,
    show_default=True,
    help="Seconds between whole reads of the store by the controller's view, a safety"
    " net under the watch that keeps it current (it also reads whole at the start, on a"
    " compaction and on a broken watch).",
)
@click.pass_context
def controller_command(
    ctx: click.Context,
    store_url: str | None,
    ident: str,
    interval: float,
    lease_ttl: int,
    ready_delay: float,
    metrics_address: str,
    log_file: str | None,
    log_level: str,
    liveness: str | None,
    add_grace: float,
    gc_interval: float,
    view_reread: float,
) -> None:
    """Run the cluster's controller: assign blocks to keep nodes warm, reclaim surplus
    blocks through the hand-back handshake. One instance leads; others wait to take over."""
    url = daemon.start(ctx, store_url, log_file, log_level, "ipward-controller")
    if not ident:
        raise InvalidConfig("--id must not be empty")
    status = run_controller(
        url,
        ident,
        interval=interval,
        lease_ttl=lease_ttl,
        ready_delay=ready_delay,
        metrics_address=daemon.parse_address(metrics_address),
        liveness=liveness,
        add_grace=add_grace,
        gc_interval=gc_interval,
        view_reread=view_reread,
    )
    ctx.exit(status)
