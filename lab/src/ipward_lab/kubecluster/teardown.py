"""The cluster lab removed: `down` reads the journal (`state.Journal`: everything was
recorded before it was made, so this works also after the lab itself crashed) and
removes it all: every process in the lab's namespaces or cgroups or of its journal,
mounts, namespaces, cgroups, the state dir. And what tests compare before and after: the
machine's state (`machine_snapshot`) and what is left of a cluster (`leftovers`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipward_lab.kubecluster.common import ClusterError, wait_for
from ipward_lab.kubecluster.nodes import KUBELET_SYSCTLS
from ipward_lab.kubecluster.processes import kill_until_gone, ns_id, pids_in, start_time, zombie
from ipward_lab.kubecluster.state import ClusterState
from ipward_lab.machine import cgroup_hierarchies, mounts_under


def down(lab: ClusterState, say: Callable[[str], None] = print) -> list[str]:
    """Remove everything the journal says was made, and every process in the lab's
    namespaces and cgroups; what could not be removed, as messages."""
    entries = lab.journal.entries()
    if not entries:
        if lab.state.exists() and not any(lab.state.iterdir()):
            lab.state.rmdir()
        return []
    left: list[str] = []
    ns_files = [
        e["path"] for e in entries if e["kind"] == "mount" and e["path"].endswith((".net", ".mnt"))
    ]
    cgroups = [Path(e["path"]) for e in entries if e["kind"] == "cgroup"]
    processes = [e for e in entries if e["kind"] == "process"]
    say("stopping processes")
    left += _kill_all(ns_files, cgroups, processes)
    say("removing mounts, namespaces and cgroups")
    for point in mounts_under(lab.state):
        proc = subprocess.run(
            ["umount", "--lazy", point], capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0:
            left.append(f"umount {point}: {proc.stderr.strip()}")
    for cgroup in cgroups:
        left += _remove_cgroup(cgroup)
    if not left:
        shutil.rmtree(lab.state, ignore_errors=True)
        if lab.state.exists():
            left.append(f"could not remove {lab.state}")
    return left


def _kill_all(
    ns_files: list[str], cgroups: list[Path], processes: list[dict[str, Any]]
) -> list[str]:
    ns_ids = {i for i in (ns_id(f) for f in ns_files) if i is not None}
    # Only nsfs inodes: a file whose namespace was already unmounted is a plain file.
    ns_ids = {i for i in ns_ids if i[0] == ns_id("/proc/self/ns/net")[0]}  # type: ignore[index]
    still = kill_until_gone(
        lambda: {
            pid
            for pid in pids_in(ns_ids, cgroups, processes)
            if start_time(pid) is not None and not zombie(pid)
        },
        60.0,
        0.2,
    )
    return [f"processes still running: {sorted(still)}"] if still else []


def _remove_cgroup(top: Path) -> list[str]:
    """`top` and every cgroup under it removed (deepest first, again while their last
    processes exit); what could not be, after 30 s."""
    if not top.is_dir():
        return []
    failed: list[str] = []

    def removed() -> bool:
        failed.clear()
        for d in sorted(
            (Path(dp) for dp, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True
        ):
            try:
                d.rmdir()
            except OSError as e:
                failed.append(f"cgroup {d}: {e}")
        return not failed

    with contextlib.suppress(ClusterError):
        wait_for(removed, f"{top} removed", 30.0, 0.2)
    return failed


# Where containerd, the kubelet and the agent DaemonSet would write on a machine: none of
# it may appear (every node has its own in its mount namespace).
FIXED_PATHS = (
    "/run/containerd", "/run/ipward", "/var/lib/containerd", "/var/lib/kubelet",
    "/var/lib/cni", "/var/log/pods", "/var/log/containers", "/opt/cni", "/etc/cni",
    "/etc/kubernetes",
)  # fmt: skip


def machine_snapshot() -> dict[str, Any]:
    """What a cluster must leave as it found on the machine: its network namespace's
    links and forwarding, the sysctls the kubelets want, which of the fixed paths exist."""
    from ipward_lab.netlab import root_namespace_state

    return {
        "network": root_namespace_state(),
        "sysctls": {k: Path(f"/proc/sys/{k}").read_text().strip() for k in KUBELET_SYSCTLS},
        "fixed_paths": {p: os.path.lexists(p) for p in FIXED_PATHS},
    }


def leftovers(state: Path, cluster_id: str, ns_ids: set[tuple[int, int]]) -> list[str]:
    """What is left on the machine of the cluster that was in `state` (id `cluster_id`,
    its namespaces' inodes `ns_ids`, read while it was up): processes in its namespaces
    or naming its state dir, mounts under the state dir, its cgroups, the dir itself."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me or zombie(int(entry)):
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        held = [k for k in ("net", "mnt") if ns_id(f"/proc/{entry}/ns/{k}") in ns_ids]
        if held or str(state) in cmdline:
            found.append(f"process {entry} ({cmdline.strip()[:120]}) {' '.join(held)}")
    found += [f"mount {point}" for point in mounts_under(state)]
    for hierarchy in cgroup_hierarchies():
        found += [f"cgroup {d}" for d in hierarchy.glob(f"ipward-cluster-{cluster_id}-*")]
    if state.exists():
        found.append(f"state dir {state}")
    return found


def namespace_ids(lab: ClusterState) -> set[tuple[int, int]]:
    """The inodes of the cluster's namespaces (while it is up)."""
    files = [lab.cp_netns, lab.fabric_netns, *(n.netns for n in lab.nodes)]
    files += [n.mntns for n in lab.nodes]
    return {i for i in (ns_id(f) for f in files) if i is not None}
