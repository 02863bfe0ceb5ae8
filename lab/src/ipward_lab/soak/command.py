"""The `ipward sim` command."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console

from ipward_lab.soak.driver import Soak, SoakError
from ipward_lab.soak.result import APIS, BACKENDS, FAULTS, K8S_GRACE, Options, fault_unavailable
from ipward_lab.soak.view import summary, write_report


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


def _faults(text: str, backend: str, api: str) -> tuple[str, ...]:
    """The faults asked for: `all` (those this run can make), `none`, or a list, each
    of which this run must be able to make."""
    if text == "all":
        return FAULTS
    if text == "none":
        return ()
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in chosen if t not in FAULTS]
    if unknown:
        raise click.BadParameter(
            f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}",
            param_hint="--faults",
        )
    for kind in chosen:
        why = fault_unavailable(kind, backend, api)
        if why is not None:
            raise click.BadParameter(f"fault {kind!r} {why}", param_hint="--faults")
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
    help="A fresh store: SQLite, one etcd, a three-member etcd on loopback, or the"
    " Kubernetes store (k8s://) on a kube-apiserver of its own (KUBE_APISERVER).",
)
@click.option(
    "--api",
    type=click.Choice(APIS),
    default="none",
    show_default=True,
    help="Publish the cluster to a Kubernetes API server, read through k8s:// by agents"
    " (--cluster) and controllers (--liveness): the loopback test server (with its faults),"
    " or the real kube-apiserver named by KUBE_APISERVER (api-down only). none: the state"
    " file (sim://) only.",
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
    api: str,
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
        faults=_faults(faults_text, backend, api),
        backend=backend,
        api=api,
        **({"grace": K8S_GRACE} if backend == "k8s" else {}),
    )
    console = Console(stderr=True)
    with _workdir(workdir, keep=False) as where:
        try:
            result = Soak(options, where, console).run(live=not no_live and console.is_terminal)
        except SoakError as e:
            raise click.UsageError(str(e)) from e
        out = Console()
        out.print(summary(result))
        for v in result.violations:
            out.print(f"[red]VIOLATION[/] {v.kind} {v.address}: {v.detail}")
            for line in v.history:
                out.print(f"    {line}")
        if report_dir:
            out.print(f"report: {write_report(result, Path(report_dir))}")
    sys.exit(0 if result.ok else 1)
