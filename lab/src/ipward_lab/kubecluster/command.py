"""`ipward cluster`: a real Kubernetes cluster on this machine (`cluster.Cluster`), and
ipward deployed on it from its own image and manifests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

from ipward_lab.containerd.images import ImageError, build_ipward_image
from ipward_lab.kubecluster.cluster import Cluster
from ipward_lab.kubecluster.common import ClusterError
from ipward_lab.kubecluster.layout import CHECKOUT, DEFAULT_STATE, STORES
from ipward_lab.kubecluster.prerequisites import (
    kubectl_binary,
    missing_for_tests,
    unavailable_reason,
)

EXIT_FAILED = 1
EXIT_CANNOT_RUN = 2

state_option = click.option(
    "--state",
    "state",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE,
    show_default=True,
    help="The cluster's state dir: namespaces, logs, certificates, kubeconfig, cluster.json.",
)


def _say(text: str) -> None:
    click.echo(text, err=True)


def _fail(e: ClusterError | ImageError, code: int = EXIT_FAILED) -> None:
    click.echo(f"ipward cluster: {e}", err=True)
    sys.exit(code)


@click.group("cluster")
def cluster_command() -> None:
    """A Kubernetes cluster on this machine (control plane and N nodes, each in
    namespaces of its own), and ipward deployed on it as users deploy it. Needs root,
    kube-node and kube-apiserver 1.26 (KUBE_BIN_DIR, or ../shared beside the checkout)."""


@cluster_command.command("up")
@click.option("--nodes", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option(
    "--without-python",
    type=click.IntRange(0, 20),
    default=0,
    show_default=True,
    help="How many of the nodes (the last ones) have no Python: a program that is not an"
    " interpreter bound over every python3* in their mount namespace.",
)
@state_option
def up_command(nodes: int, without_python: int, state: Path) -> None:
    """Bring up the control plane and NODES worker nodes (host-local as IPAM)."""
    reason = unavailable_reason()
    if reason:
        _fail(ClusterError(reason), EXIT_CANNOT_RUN)
    lab = Cluster(state)
    try:
        lab.up(nodes, _say, without_python)
    except BaseException as e:  # interrupted, or a failure of the lab itself: undo too
        _say("up failed; removing what was made (`ipward cluster down` does the same)")
        left = lab.down(_say)
        if left:
            _say("left behind: " + "; ".join(left))
        if not isinstance(e, ClusterError):
            raise
        _fail(e)
    click.echo(f"kubeconfig: {lab.kubeconfig}")


@cluster_command.command("check")
def check_command() -> None:
    """Say whether the `kube` tests can run on this machine: exit 2 naming what is
    missing (the Kubernetes binaries, Multus's plugin, kubectl, a tool, root, cgroups),
    else 0. CI runs it before them, once it has found the binaries."""
    reason = missing_for_tests()
    if reason:
        _fail(ClusterError(reason), EXIT_CANNOT_RUN)
    click.echo("a cluster can be made here, and the kube tests can run")


@cluster_command.command("deploy")
@click.option(
    "--store",
    type=click.Choice(STORES),
    default=STORES[0],
    show_default=True,
    help="Where ipward keeps its ledger: k8s (the API: `kubectl apply -k deploy/base` and"
    " an IPPool object) or etcd (an etcd of the lab's outside the cluster, the pool made"
    " with `ipward pool create`, deploy/overlays/etcd).",
)
@state_option
def deploy_command(store: str, state: Path) -> None:
    """Build the ipward image, load it on every node, install ipward as README's "Deploy
    on Kubernetes" says and switch every node's network to ipward."""
    try:
        Cluster.load(state).deploy(_say, store=store)
    except (ClusterError, ImageError) as e:
        _fail(e)


@cluster_command.command("image")
def image_command() -> None:
    """Build the ipward image from the checkout's Containerfile (what `deploy` loads),
    kept in the lab's cache and built again only when its inputs change; print its
    tarball's path. `deploy` builds it too: this is for doing it ahead (CI does)."""
    try:
        click.echo(build_ipward_image(CHECKOUT, _say))
    except ImageError as e:
        _fail(e)


@cluster_command.command("down")
@state_option
def down_command(state: Path) -> None:
    """Remove everything `up` made (also after a crash of the lab)."""
    left = Cluster(state).down(_say)
    if left:
        click.echo("left behind: " + "; ".join(left), err=True)
        sys.exit(EXIT_FAILED)


def _passthrough(argv: list[str]) -> None:
    try:
        proc = subprocess.run(argv)
    except OSError as e:
        _fail(ClusterError(str(e)))
    sys.exit(proc.returncode)


@cluster_command.command(
    "kubectl", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@state_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def kubectl_command(state: Path, args: tuple[str, ...]) -> None:
    """kubectl ARGS against the cluster, run where its API is reached."""
    try:
        lab = Cluster.load(state)
        argv = lab.in_cp([kubectl_binary(), f"--kubeconfig={lab.kubeconfig}", *args])
    except ClusterError as e:
        _fail(e, EXIT_CANNOT_RUN)
    _passthrough(argv)


@cluster_command.command(
    "ipward", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@state_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def ipward_command(state: Path, args: tuple[str, ...]) -> None:
    """The ipward CLI (ARGS, e.g. `check`) against the deployed store."""
    try:
        argv = Cluster.load(state).ipward_argv(args)
    except ClusterError as e:
        _fail(e, EXIT_CANNOT_RUN)
    os.environ.pop("IPWARD_STORE", None)
    _passthrough(argv)
