"""What the cluster lab needs of the machine, and where it finds it: the Kubernetes
binaries (`kube-node`, `kube-apiserver`; Multus's thin plugin for the stories that use
it) in the directories of KUBE_BIN_DIR or beside the checkout, kubectl, Debian's tools
and CNI plugins, root, cgroups. `unavailable_reason` is what `ipward cluster up` refuses
with; `missing_for_tests` what the `kube` tests need beyond the binaries (Multus too),
which fails them rather than skipping them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ipward_lab.containerd.config import CONTAINERD_TOOLS
from ipward_lab.kubecluster.common import ClusterError
from ipward_lab.kubecluster.layout import CHECKOUT, CNI_PLUGINS
from ipward_lab.machine import CGROUP_ROOT, which

WHERE_TO_GET = (
    "kubelet, kube-controller-manager and kube-scheduler 1.26 (one binary, `kube-node`) and"
    " kube-apiserver 1.26 are not in any package registry: put `kube-node` and"
    " `kube-apiserver` in the directories named by KUBE_BIN_DIR (separated by ':'), or"
    " beside the checkout in ../shared/kube/ and ../shared/kube-apiserver/ (their READMEs"
    " say how they were built)"
)
REQUIRED_TOOLS = {
    **CONTAINERD_TOOLS,
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "ip": "iproute2",
    "iptables": "iptables",
    "openssl": "openssl",
    "etcd": "etcd-server",
}


def kubectl_binary() -> str:
    found = (
        "/usr/local/bin/kubectl" if os.access("/usr/local/bin/kubectl", os.X_OK) else None
    ) or which("kubectl")
    if found is None:
        raise ClusterError(
            "kubectl not found (/usr/local/bin/kubectl or PATH): install it from Kubernetes'"
            " release packages (`kubectl` 1.25 to 1.27 speak to this 1.26 API)"
        )
    return found


@dataclass(frozen=True)
class Binaries:
    kube_node: str  # kubelet, kube-controller-manager, kube-scheduler: `kube-node NAME`
    kube_apiserver: str


def _search_dirs() -> list[Path]:
    """Where the Kubernetes binaries are looked for: the directories of KUBE_BIN_DIR
    (separated by ':', as PATH), else ../shared/kube and ../shared/kube-apiserver beside
    the checkout."""
    bin_dirs = os.environ.get("KUBE_BIN_DIR")
    if bin_dirs:
        return [Path(d) for d in bin_dirs.split(os.pathsep) if d]
    shared = CHECKOUT.parent / "shared"
    return [shared / "kube", shared / "kube-apiserver"]


def _find(name: str) -> Path | None:
    for place in _search_dirs():
        if os.access(place / name, os.X_OK):
            return place / name
    return None


def find_binaries() -> Binaries:
    """The Kubernetes binaries (`_search_dirs`); ClusterError saying where to get them."""
    found = {name: _find(name) for name in ("kube-node", "kube-apiserver")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        places = ", ".join(str(d) for d in _search_dirs())
        raise ClusterError(f"not found: {', '.join(missing)} (in {places}). {WHERE_TO_GET}")
    return Binaries(str(found["kube-node"]), str(found["kube-apiserver"]))


def find_multus() -> str:
    """The Multus thin plugin (4.0), `multus` (`_search_dirs`); ClusterError saying where
    to get it."""
    path = _find("multus")
    if path is None:
        raise ClusterError(
            f"not found: multus (in {', '.join(str(d) for d in _search_dirs())}). Multus"
            " CNI 4.0's thin plugin (`cmd/multus` of k8snetworkplumbingwg/multus-cni"
            " v4.0.2, built with Go): put `multus` in a directory of KUBE_BIN_DIR or in"
            " ../shared/kube/"
        )
    return str(path)


def missing_tools() -> list[str]:
    missing = [
        f"{tool} (Debian package {package})"
        for tool, package in REQUIRED_TOOLS.items()
        if which(tool) is None
    ]
    missing += [
        f"{CNI_PLUGINS / p} (Debian package containernetworking-plugins)"
        for p in ("bridge", "loopback", "host-local")
        if not os.access(CNI_PLUGINS / p, os.X_OK)
    ]
    if os.geteuid() != 0:
        missing.append("root")
    if (
        not (CGROUP_ROOT / "cpuset" / "cgroup.procs").exists()
        and not (CGROUP_ROOT / "cgroup.procs").exists()
    ):
        missing.append(f"cgroups mounted at {CGROUP_ROOT}")
    return missing


def unavailable_reason() -> str | None:
    """Why no cluster can be made here (for a test's skip), or None."""
    try:
        find_binaries()
        kubectl_binary()
    except ClusterError as e:
        return str(e)
    missing = missing_tools()
    return f"the cluster lab needs: {', '.join(missing)}" if missing else None


def missing_for_tests() -> str | None:
    """What the `kube` tests need that is missing, the Kubernetes binaries found (every
    prerequisite of a cluster, and Multus's thin plugin for its stories), or None."""
    reason = unavailable_reason()
    if reason:
        return reason
    try:
        find_multus()
    except ClusterError as e:
        return str(e)
    return None
