"""The `ipward bench` command."""

from __future__ import annotations

import dataclasses
import json

import click

from ipward_lab.bench.cluster import run_cluster
from ipward_lab.bench.common import (
    BenchError,
)
from ipward_lab.bench.report import run_report
from ipward_lab.bench.run import run
from ipward_lab.bench.scale import run_scale, scale_sizes

K8S_MIN_PODS = 110  # the agent's scope holds one node's 110 pods


@click.command("bench")
@click.option(
    "--quick", is_flag=True, help="Fewer runs, a /20 instead of a /16 (~10 s instead of ~30 s)."
)
@click.option("--no-etcd", "no_etcd", is_flag=True, help="Skip the etcd measurements.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the figures as JSON (the report goes to stderr)."
)
@click.option(
    "--cluster",
    is_flag=True,
    help="Instead: agents on one temporary etcd under concurrent ADD/DEL, next to raw etcd"
    " CAS at the same concurrency, and plugin exec through an agent.",
)
@click.option(
    "--agents",
    type=click.IntRange(1, 64),
    help="--cluster: agent processes (default 3).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    help="--cluster: concurrent ADD/DEL client threads per agent (default 8).",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.1),
    help="--cluster: seconds of each load in all (default 20, --quick 4).",
)
@click.option(
    "--scale",
    is_flag=True,
    help="Instead: grow one temporary etcd to Kubernetes' limits (5,000 nodes, 150,000"
    " allocations) and measure at each stage real agents and a real controller: memory,"
    " pass times, ADD latency with the controller's passes running and paused, etcd's"
    " size (~15 min; --quick: up to 10,000 records, ~2 min). With --report DIR, writes"
    " DIR/scale.html, DIR/scale.json and the plot.",
)
@click.option(
    "--k8s-store",
    "k8s_store",
    is_flag=True,
    help="Instead: ipward on the Kubernetes store (k8s://) on a kube-apiserver of its own"
    " (KUBE_APISERVER), next to a temporary etcd: ADDs and DELs through real agents (1"
    " caller, 32 through one agent, 32 across 3) against each store's raw update rate,"
    " the API writes each costs with a controller running; then the store filled with"
    " --records addresses on 30 a node: its objects' sizes, an agent's and the"
    " controller's memory, every agent relisting at once (~15 min; --quick: 3,000"
    " addresses, ~3 min).",
)
@click.option(
    "--records",
    type=click.IntRange(1000),
    help="--scale: the largest stage (default 150,000; --quick 10,000); the standard"
    " stages below it come first. --k8s-store: the addresses of the fill (default"
    " 150,000; --quick 3,000).",
)
@click.option(
    "--k8s",
    is_flag=True,
    help="Instead: the Kubernetes source's memory, each scope in a fresh process on a"
    " loopback test API server: the controller's with --pods pods cached (default"
    " 100,000), an agent's with 110 pods on its node; next to their targets (~1 min per"
    " 100,000 pods).",
)
@click.option(
    "--kube",
    is_flag=True,
    help="Instead: pod start on a real cluster of 3 nodes made on this machine (`ipward"
    " cluster`), host-local and then ipward in the same run: --pods pods at once (time"
    " until all Running, each pod's, the CNI ADD's p50/p99 from containerd's log) and"
    " --rounds rounds of a StatefulSet scaled 5->0->5 (seconds, addresses kept); needs"
    " what `ipward cluster` needs (~6 min; --quick: 30 pods, 3 rounds, ~2.5 min).",
)
@click.option(
    "--pods",
    type=click.IntRange(1),
    help="--k8s: the cluster's pods (default 100,000; --quick 10,000; at least 110);"
    " --kube: pods started at once (default 100; --quick 30).",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    help="--kube: StatefulSet rounds 5->0->5 (default 10; --quick 3).",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False),
    help="Also measure how cost grows (ADD vs pool size and fill, GC pass and agent memory"
    " vs records) and run the cluster part (unless --no-etcd); write DIR/report.html,"
    " DIR/report.json and the plots as PNG in DIR (~2 min with --quick, ~5 min without).",
)
def bench_command(
    quick: bool,
    no_etcd: bool,
    as_json: bool,
    cluster: bool,
    agents: int | None,
    concurrency: int | None,
    duration: float | None,
    scale: bool,
    k8s_store: bool,
    records: int | None,
    k8s: bool,
    kube: bool,
    pods: int | None,
    rounds: int | None,
    report_dir: str | None,
) -> None:
    """Measure allocation throughput and latency against references from the same run."""

    def report(line: str) -> None:
        click.echo(line, err=as_json)

    if not cluster and (agents, concurrency, duration) != (None, None, None):
        raise click.UsageError("--agents, --concurrency and --duration go with --cluster")
    if cluster and no_etcd:
        raise click.UsageError("--cluster measures agents on etcd: it does not go with --no-etcd")
    if records is not None and not (scale or k8s_store):
        raise click.UsageError("--records goes with --scale or --k8s-store")
    if k8s_store and (scale or cluster or k8s or kube or report_dir or no_etcd):
        raise click.UsageError(
            "--k8s-store is a run of its own: drop --scale, --cluster, --k8s, --kube,"
            " --report and --no-etcd"
        )
    if pods is not None and not (k8s or kube):
        raise click.UsageError("--pods goes with --k8s or --kube")
    if k8s and pods is not None and pods < K8S_MIN_PODS:
        raise click.UsageError(f"--pods: --k8s needs at least {K8S_MIN_PODS} (one node's pods)")
    if rounds is not None and not kube:
        raise click.UsageError("--rounds goes with --kube")
    if k8s and (scale or cluster or report_dir):
        raise click.UsageError("--k8s is a run of its own: drop --scale, --cluster and --report")
    if kube and (k8s or scale or cluster or report_dir or no_etcd):
        raise click.UsageError(
            "--kube is a run of its own: drop --k8s, --scale, --cluster, --report and --no-etcd"
        )
    if scale and (cluster or no_etcd):
        raise click.UsageError("--scale is a run of its own on etcd: drop --cluster and --no-etcd")
    if cluster and report_dir:
        raise click.UsageError(
            "--report runs the cluster part itself (unless --no-etcd): drop --cluster"
        )
    try:
        if k8s_store:
            from ipward_lab.bench.k8s_store import FULL, QUICK, run_k8s_store

            sizes = QUICK if quick else FULL
            if records is not None:
                sizes = dataclasses.replace(sizes, records=records)
            result = run_k8s_store(sizes, out=report)
        elif kube:
            from ipward_lab.bench.kube import run_kube

            result = run_kube(
                pods or (30 if quick else 100),
                rounds or (3 if quick else 10),
                out=report,
            )
        elif k8s:
            from ipward_lab.bench.k8s_memory import measure, report_lines

            result = measure(pods or (10_000 if quick else 100_000))
            for line in report_lines(result):
                report(line)
        elif scale:
            result = run_scale(scale_sizes(quick, records), out=report, report_dir=report_dir)
        elif report_dir:
            result = run_report(report_dir, quick=quick, etcd=not no_etcd, out=report)
        elif cluster:
            result = run_cluster(
                agents=3 if agents is None else agents,
                concurrency=8 if concurrency is None else concurrency,
                duration=duration,
                quick=quick,
                out=report,
            )
        else:
            result = run(quick=quick, etcd=not no_etcd, out=report)
    except BenchError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
