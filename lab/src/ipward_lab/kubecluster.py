"""A real Kubernetes cluster on one machine, for the `kube` tests and `ipward cluster`.

A control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and a
second etcd with TLS for ipward's store, outside the cluster as users run one) in a
network namespace of its own, and N worker nodes, each in its own network namespace and
its own private mount namespace with its own containerd and kubelet. Every namespace is
joined to a bridge in a "fabric" namespace by a veth pair. The namespaces are files in
the state dir (`unshare --net=FILE`, `--mount=FILE`), never `ip netns` names in /run.

The pod network is one, as in a cluster: the network `pods` (`bridge` on each node's
`cni0`, the same gateway 10.244.0.1 on every node, pods on 10.244.0.0/16), with
`proxy_arp` on each `cni0`, so a pod reaches an address of the /16 on another node
through its own node, which routes it. Where an address lives is the routing layer's
business, which the lab plays as a cluster's network would:
- with host-local (`up`), each node hands out its own range (10.244.N.0/24): one static
  route per node's range, in the fabric and in the other nodes (a cloud's route
  controller, from the nodes' pod CIDRs);
- with ipward (`deploy`), one cluster-wide pool `pods` on 10.244.0.0/16, its blocks
  wherever ipward puts them and sticky addresses moving with their pods: a route per
  address, kept by the route syncer (`ipward_lab.podroutes`, a daemon of the lab) from
  ipward's node index, as Calico's or a cloud's route programming follows theirs.

In a node's mount namespace, the node's own directories are bind-mounted over `/run`,
`/var/lib`, `/var/log` and `/opt`, and `/etc` is an overlay of the machine's (the node's
CNI configs and static pods go in its upper dir): containerd, the kubelet and the pods'
hostPath volumes use the usual paths (`/run/containerd/containerd.sock`,
`/opt/cni/bin`, `/etc/cni/net.d`, `/run/ipward`) and nothing lands on the machine. The
kubelet's host sysctls (`protectKernelDefaults`) are files bind-mounted over their
`/proc/sys` entries there, holding the values it expects; the machine's stay. Each
kubelet has a cgroup root of its own (cgroups v1 here, made in every hierarchy).

No kube-proxy and no CoreDNS exist here: the API's service address (10.96.0.1:443) is a
DNAT rule in each node namespace, which is all pods and host-network pods need.

Everything the lab makes is written to the state dir's journal (`made.jsonl`) before it
is made, so `down` removes it also after the lab itself crashed: processes (and every
process found in the lab's namespaces or cgroups), namespaces, mounts, cgroups, files.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipward_lab import waiting
from ipward_lab.containerd.config import containerd_config
from ipward_lab.containerd.images import (
    PAUSE_IMAGE,
    SLEEP_IMAGE,
    build_test_images,
)
from ipward_lab.machine import (
    CGROUP_ROOT,
    SYSTEM_PATH,
    cgroup_hierarchies,
    mounts_under,
    which,
)
from ipward_lab.nsenter import in_netns
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.servers.pki import openssl, token_kubeconfig

if TYPE_CHECKING:
    from ipward.cluster.cri import CriSandboxStatus

CHECKOUT = Path(__file__).resolve().parents[3]  # lab/src/ipward_lab/ -> the checkout
DEFAULT_STATE = Path("/tmp/ipward-cluster")
FABRIC_NET = ipaddress.ip_network("10.250.0.0/24")
FABRIC_GATEWAY = "10.250.0.1"
CONTROL_PLANE_IP = "10.250.0.2"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service
API_PORT = 6443
IPWARD_ETCD_PORT = 2379  # on CONTROL_PLANE_IP
POD_NET = ipaddress.ip_network("10.244.0.0/16")
POD_GATEWAY = "10.244.0.1"  # on every node's cni0
NETWORK = "pods"  # the CNI network's name, the same on every node
POOL = "pods"  # ipward's cluster-wide pool on POD_NET, made by `deploy`
CNI_PLUGINS = Path("/usr/lib/cni")
AGENT_SOCKET = "/run/ipward/agent.sock"
BRIDGE = "cni0"
# The sysctls the kubelet wants (`protectKernelDefaults` checks them): files holding
# these values are bind-mounted over the /proc/sys entries in each node's mount namespace.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
NODE_MOUNTS = ("run", "var/lib", "var/log", "opt")  # bind-mounted from the node's dir
READY_TIMEOUT = 180.0
CALL_TIMEOUT = 60.0
KUBECTL_TIMEOUT = 120.0

WHERE_TO_GET = (
    "kubelet, kube-controller-manager and kube-scheduler 1.26 (one binary, `kube-node`) and"
    " kube-apiserver 1.26 are not in any package registry: put `kube-node` and"
    " `kube-apiserver` in the directories named by KUBE_BIN_DIR (separated by ':'), or"
    " beside the checkout in ../shared/kube/ and ../shared/kube-apiserver/ (their READMEs"
    " say how they were built)"
)
REQUIRED_TOOLS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "gcc": "gcc",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "ip": "iproute2",
    "iptables": "iptables",
    "openssl": "openssl",
    "etcd": "etcd-server",
}


class ClusterError(RuntimeError):
    """The cluster could not be made, reached or removed; the message says why."""


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


# The NetworkAttachmentDefinition CRD as Multus's own deployment declares it.
NAD_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "network-attachment-definitions.k8s.cni.cncf.io"},
    "spec": {
        "group": "k8s.cni.cncf.io",
        "scope": "Namespaced",
        "names": {
            "plural": "network-attachment-definitions",
            "singular": "network-attachment-definition",
            "kind": "NetworkAttachmentDefinition",
            "shortNames": ["net-attach-def"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "properties": {"config": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}
MULTUS_CONF = "/etc/cni/net.d/00-multus.conf"  # before the pod network's: the runtime's
MULTUS_KUBECONFIG = "/etc/cni/net.d/multus.d/multus.kubeconfig"
LAB_CONFLIST = "/etc/cni/net.d/10-lab.conflist"


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


def run(args: Sequence[str], timeout: float = CALL_TIMEOUT, **kw: Any) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(args)} timed out after {timeout:g}s") from e
    if proc.returncode != 0:
        out = proc.stderr.strip() or proc.stdout.strip()
        raise ClusterError(f"{' '.join(args)} exited {proc.returncode}: {out[-3000:]}")
    return proc.stdout


# The lab's waits: a ClusterError after the timeout; a poll failing to reach a daemon
# yet (an OSError, a refused call, half-written output) means "not yet".
wait_for = functools.partial(
    waiting.wait_for, failure=ClusterError, passing=(OSError, ValueError, ClusterError)
)


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a PID with another start
    time is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _ns_id(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class Journal:
    """What the lab made, one JSON line each, written (and synced) before it is made."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, kind: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):  # a line cut by a crash
                out.append(json.loads(line))
        return out


@dataclass
class Node:
    name: str
    index: int
    ip: str  # on the fabric; the kubelet's --node-ip
    pod_cidr: str  # its range under host-local
    dir: str
    netns: str  # file of its network namespace
    mntns: str  # file of its mount namespace
    cgroup_root: str  # the kubelet's cgroupRoot, e.g. /ipward-cluster-1a2b3c-n1

    @property
    def containerd_socket(self) -> str:
        """containerd's socket as seen from the machine (its /run is the node's dir)."""
        return f"{self.dir}/run/containerd/containerd.sock"


def node_plan(state: Path, cluster_id: str, count: int) -> list[Node]:
    nodes = []
    for i in range(1, count + 1):
        name = f"n{i}"
        nodes.append(
            Node(
                name=name,
                index=i,
                ip=str(FABRIC_NET.network_address + 10 + i),
                pod_cidr=f"10.244.{i}.0/24",
                dir=str(state / "nodes" / name),
                netns=str(state / "ns" / f"{name}.net"),
                mntns=str(state / "ns" / f"{name}.mnt"),
                cgroup_root=f"/ipward-cluster-{cluster_id}-{name}",
            )
        )
    return nodes


def bridge_conflist(node: Node, ipam_type: str) -> dict[str, Any]:
    """The pod network on `node`: `bridge` (the node routes, pods' default route through
    it) with `ipam_type` as IPAM: host-local on the node's own range, or ipward on the
    cluster-wide pool (its `ipam` as README says to switch: the pool and the agent's
    socket). Both give pods the same gateway and prefix, so the bridge's address stays."""
    if ipam_type == "host-local":
        first = ipaddress.ip_network(node.pod_cidr).network_address
        ipam: dict[str, Any] = {
            "type": "host-local",
            "ranges": [
                [
                    {
                        "subnet": str(POD_NET),
                        "rangeStart": str(first + 1),
                        "rangeEnd": str(first + 254),
                        "gateway": POD_GATEWAY,
                    }
                ]
            ],
        }
    elif ipam_type == "ipward":
        ipam = {"type": "ipward", "pool": POOL, "agentSocket": AGENT_SOCKET}
    else:
        raise ClusterError(f"unknown IPAM {ipam_type!r}: host-local or ipward")
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": ipam,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


@dataclass(frozen=True)
class Tuning:
    """Options a deployment adds to deploy/base's, as an operator would in an overlay of
    their own (the lab's is written in the state dir): more arguments for the agent's
    and the controller's containers, and for `ipward pool create pods`. Empty: deploy/
    base as it is."""

    agent_args: tuple[str, ...] = ()
    controller_args: tuple[str, ...] = ()
    pool_args: tuple[str, ...] = ()

    def kustomization(self, where: Path) -> Path:
        """The directory to `kubectl apply -k`: deploy/base itself, or an overlay of it
        made in `where` that appends the arguments."""
        base = CHECKOUT / "deploy" / "base"
        if not (self.agent_args or self.controller_args):
            return base
        patches = []
        for kind, name, args in (
            ("DaemonSet", "ipward-agent", self.agent_args),
            ("Deployment", "ipward-controller", self.controller_args),
        ):
            ops = [
                {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": arg}
                for arg in args
            ]
            if ops:
                patches.append({"target": {"kind": kind, "name": name}, "patch": json.dumps(ops)})
        where.mkdir(parents=True, exist_ok=True)
        overlay = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(base, where)],
            "patches": patches,
        }
        (where / "kustomization.yaml").write_text(json.dumps(overlay, indent=2))  # JSON is YAML
        return where


class Cluster:
    """A cluster lab in `state` (see the module doc). `up` makes it, `down` removes all
    it made; `Cluster.load(state)` reads one that is up (cluster.json)."""

    def __init__(self, state: Path) -> None:
        self.state = Path(state).resolve()
        self.journal = Journal(self.state / "made.jsonl")
        self.info: dict[str, Any] = {}
        self.nodes: list[Node] = []

    # -- paths ----------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def cp_netns(self) -> str:
        return str(self.state / "ns" / "cp.net")

    @property
    def fabric_netns(self) -> str:
        return str(self.state / "ns" / "fabric.net")

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def api_url(self) -> str:
        return f"https://{CONTROL_PLANE_IP}:{API_PORT}"

    @property
    def ipward_store_url(self) -> str:
        p = self.pki
        return (
            f"etcds://{CONTROL_PLANE_IP}:{IPWARD_ETCD_PORT}"
            f"?ca={p}/ipward-etcd-ca.crt&cert={p}/ipward-client.crt&key={p}/ipward-client.key"
        )

    @classmethod
    def load(cls, state: Path) -> Cluster:
        cluster = cls(state)
        path = cluster.state / "cluster.json"
        try:
            cluster.info = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster in {cluster.state} (no cluster.json)") from None
        cluster.nodes = [Node(**n) for n in cluster.info["nodes"]]
        return cluster

    def write_info(self, **more: Any) -> None:
        self.info.update(more)
        self.info["nodes"] = [asdict(n) for n in self.nodes]
        tmp = self.state / "cluster.json.tmp"
        tmp.write_text(json.dumps(self.info, indent=2))
        tmp.rename(self.state / "cluster.json")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterError(f"no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    # -- running things -------------------------------------------------------------------

    def in_cp(self, args: Sequence[str], **kw: Any) -> list[str]:
        return ["nsenter", f"--net={self.cp_netns}", *args]

    def in_node(self, node: Node, args: Sequence[str]) -> list[str]:
        """`args` run in the node's network and mount namespaces."""
        return ["nsenter", f"--net={node.netns}", f"--mount={node.mntns}", *args]

    def launch(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Start a daemon of the lab (a session of its own, output to logs/NAME.log)."""
        log = self.state / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.journal.record("process", name=name, pid=proc.pid, start=_start_time(proc.pid))
        self.info.setdefault("processes", {})[name] = {
            "pid": proc.pid,
            "argv": list(argv),
            "env": env,
        }
        return proc.pid

    def kill(self, name: str, timeout: float = 30.0) -> None:
        """SIGKILL the lab's daemon `name` (e.g. `n1-kubelet`, `n2-containerd`,
        `kube-apiserver`) and wait until it is gone; its pods and their shims live on."""
        pid = self.info["processes"][name]["pid"]
        started = _start_time(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        wait_for(lambda: _start_time(pid) != started or _zombie(pid), f"{name} gone", timeout, 0.05)

    def restart(self, name: str) -> int:
        """Kill the daemon `name` and start it again with the same command line (a
        node's kubelet or containerd after a crash); its new pid."""
        self.kill(name)
        entry = self.info["processes"][name]
        pid = self.launch(name, entry["argv"], env=entry.get("env"))
        self.write_info()
        return pid

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.state / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def api(self, path: str, timeout: float = 10.0) -> Any:
        """GET `path` of the API as the admin (from the control plane's namespace)."""

        def get() -> Any:
            context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
            request = urllib.request.Request(
                f"{self.api_url}{path}",
                headers={"Authorization": f"Bearer {self.info['admin_token']}"},
            )
            with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
                body = answer.read()
            try:
                return json.loads(body)
            except ValueError:
                return body.decode(errors="replace")

        return in_netns(self.cp_netns, get)

    def kubectl(
        self, *args: str, timeout: float = KUBECTL_TIMEOUT, check: bool = True, input: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """kubectl with the admin kubeconfig, run where the API is reached."""
        argv = self.in_cp([kubectl_binary(), f"--kubeconfig={self.kubeconfig}", *args])
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, input=input or None
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def make_namespace(self, name: str) -> None:
        """Namespace `name`, once its default ServiceAccount exists (a pod made before
        it is refused)."""
        self.kubectl("create", "namespace", name)
        wait_for(
            lambda: (
                self.kubectl(
                    f"--namespace={name}", "get", "serviceaccount", "default", check=False
                ).returncode
                == 0
            ),
            f"{name}'s default ServiceAccount",
            60.0,
            0.5,
        )

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def ipward_argv(self, args: Sequence[str]) -> list[str]:
        """The ipward CLI against the deployed store, where the store is reached."""
        ipward = str(Path(sys.executable).parent / "ipward")
        return self.in_cp([ipward, "--store", self.ipward_store_url, *args])

    def ipward_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The ipward CLI against the deployed store; ClusterError on a non-zero exit
        with `check`."""
        env = {k: v for k, v in os.environ.items() if k != "IPWARD_STORE"}
        proc = subprocess.run(
            self.ipward_argv(args), capture_output=True, text=True, timeout=CALL_TIMEOUT, env=env
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"ipward {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    # -- up -------------------------------------------------------------------------------

    def up(self, count: int, say: Callable[[str], None] = print) -> None:
        """Make the cluster: control plane, `count` nodes Ready with host-local as IPAM."""
        if count < 1:
            raise ClusterError("--nodes must be at least 1")
        binaries = find_binaries()
        missing = missing_tools()
        if missing:
            raise ClusterError(
                f"the cluster lab needs: {', '.join(missing)} (scripts/setup.sh installs"
                " the packages)"
            )
        if (self.state / "made.jsonl").exists():
            raise ClusterError(
                f"{self.state} holds a cluster already: `ipward cluster down --state"
                f" {self.state}` first"
            )
        self.state.mkdir(parents=True, exist_ok=True)
        if len(f"{self.state}/nodes/n{count}/run/containerd/containerd.sock.ttrpc") > 100:
            raise ClusterError(f"state dir path too long for the nodes' sockets: {self.state}")
        cluster_id = secrets.token_hex(3)
        self.journal.record("state", path=str(self.state))
        for sub in ("ns", "logs", "pki", "nodes", "images"):
            (self.state / sub).mkdir(exist_ok=True)
        self.nodes = node_plan(self.state, cluster_id, count)
        self.info = {
            "id": cluster_id,
            "kubeconfig": str(self.kubeconfig),
            "api": self.api_url,
            "control_plane": {"ip": CONTROL_PLANE_IP, "netns": self.cp_netns},
            "fabric": {"netns": self.fabric_netns, "gateway": FABRIC_GATEWAY},
            "service_ip": SERVICE_IP,
            "pause_image": PAUSE_IMAGE,
            "test_image": SLEEP_IMAGE,
            "admin_token": secrets.token_hex(16),
            "ipward_store": self.ipward_store_url,
            "cni": "host-local",
        }
        self.write_info()
        started = time.monotonic()
        say(f"making namespaces and the fabric for {count} node(s)")
        self._namespaces()
        self._fabric()
        self.node_range_routes(present=True)
        say("certificates, etcd, kube-apiserver, controller-manager, scheduler")
        self._pki()
        self._control_plane(binaries)
        images = build_test_images(self.state / "images")
        say(f"nodes: {', '.join(n.name for n in self.nodes)}")
        for node in self.nodes:
            self._node(node, binaries, images)
        self.write_kubeconfig()
        self.wait_nodes_ready()
        wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            "the default ServiceAccount",
            READY_TIMEOUT,
            0.5,
        )
        self.write_info(up_seconds=round(time.monotonic() - started, 1))
        say(f"up in {time.monotonic() - started:.1f}s: kubeconfig {self.kubeconfig}")

    def _namespaces(self) -> None:
        ns_dir = self.state / "ns"
        # A mount namespace can be kept in a file only on a mount of private propagation.
        self.journal.record("mount", path=str(ns_dir))
        run(["mount", "--bind", str(ns_dir), str(ns_dir)])
        run(["mount", "--make-private", str(ns_dir)])
        for path in (self.fabric_netns, self.cp_netns, *(n.netns for n in self.nodes)):
            Path(path).touch()
            self.journal.record("mount", path=path)
            run(["unshare", f"--net={path}", "true"])
        for node in self.nodes:
            Path(node.mntns).touch()
            self.journal.record("mount", path=node.mntns)
            run(["unshare", f"--mount={node.mntns}", "--propagation=private", "true"])

    def _ip(self, netns: str, *args: str) -> None:
        run(["nsenter", f"--net={netns}", "ip", *args])

    def _sysctl(self, netns: str, key: str, value: str) -> None:
        run(["nsenter", f"--net={netns}", "sysctl", "-qw", f"{key}={value}"])

    def _fabric(self) -> None:
        fabric = self.fabric_netns
        self._ip(fabric, "link", "set", "lo", "up")
        self._ip(fabric, "link", "add", "fabric0", "type", "bridge")
        self._ip(
            fabric, "addr", "add", f"{FABRIC_GATEWAY}/{FABRIC_NET.prefixlen}", "dev", "fabric0"
        )
        self._ip(fabric, "link", "set", "fabric0", "up")
        self._sysctl(fabric, "net.ipv4.ip_forward", "1")
        members = [("cp", self.cp_netns, CONTROL_PLANE_IP)]
        members += [(n.name, n.netns, n.ip) for n in self.nodes]
        for name, netns, ip in members:
            self._ip(netns, "link", "set", "lo", "up")
            self._ip(
                netns, "link", "add", "eth0", "type", "veth", "peer", "name", name, "netns", fabric
            )
            self._ip(fabric, "link", "set", name, "master", "fabric0", "up")
            self._ip(netns, "addr", "add", f"{ip}/{FABRIC_NET.prefixlen}", "dev", "eth0")
            self._ip(netns, "link", "set", "eth0", "up")
            self._ip(netns, "route", "add", "default", "via", FABRIC_GATEWAY)
            self._sysctl(netns, "net.ipv4.ip_forward", "1")
        for node in self.nodes:
            # The pods' bridge, made before `bridge` finds it so that it answers ARP for
            # the addresses of the /16 that live elsewhere (routed out of eth0).
            self._ip(node.netns, "link", "add", BRIDGE, "type", "bridge")
            self._ip(node.netns, "link", "set", BRIDGE, "up")
            self._sysctl(node.netns, f"net.ipv4.conf.{BRIDGE}.proxy_arp", "1")
            # The API's Service address, as kube-proxy would make it (none exists here).
            for chain in ("OUTPUT", "PREROUTING"):
                run(
                    [
                        "nsenter", f"--net={node.netns}", "iptables", "-w", "-t", "nat",
                        "-A", chain, "-d", SERVICE_IP, "-p", "tcp", "--dport", "443",
                        "-j", "DNAT", "--to-destination", f"{CONTROL_PLANE_IP}:{API_PORT}",
                    ]
                )  # fmt: skip

    def node_range_routes(self, present: bool) -> None:
        """The routes of host-local's node ranges (each node's range through that node),
        in the fabric and in the other nodes (straight to the node, not through the
        fabric): made (`present`) or removed (also when they are not there)."""
        for node in self.nodes:
            for netns, via in [(self.fabric_netns, node.ip)] + [
                (other.netns, node.ip) for other in self.nodes if other is not node
            ]:
                if present:
                    self._ip(netns, "route", "replace", node.pod_cidr, "via", via)
                else:
                    self._ip(netns, "route", "flush", "exact", node.pod_cidr)

    def _pki(self) -> None:
        p = self.pki

        def ca(name: str, cn: str) -> None:
            openssl(
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
                "-subj", f"/CN={cn}", "-keyout", str(p / f"{name}.key"),
                "-out", str(p / f"{name}.crt"),
            )  # fmt: skip

        def signed(name: str, ca_name: str, subject: str, ext: str) -> None:
            openssl(
                "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                "-keyout", str(p / f"{name}.key"), "-out", str(p / f"{name}.csr"),
            )  # fmt: skip
            (p / f"{name}.ext").write_text(ext)
            openssl(
                "x509", "-req", "-in", str(p / f"{name}.csr"), "-CA", str(p / f"{ca_name}.crt"),
                "-CAkey", str(p / f"{ca_name}.key"), "-CAcreateserial", "-days", "30",
                "-extfile", str(p / f"{name}.ext"), "-out", str(p / f"{name}.crt"),
            )  # fmt: skip

        ca("ca", "ipward-cluster-ca")
        api_sans = ",".join(
            [
                f"IP:{CONTROL_PLANE_IP}", f"IP:{SERVICE_IP}", "IP:127.0.0.1", "DNS:localhost",
                "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
            ]
        )  # fmt: skip
        signed(
            "apiserver", "ca", "/CN=kube-apiserver",
            f"subjectAltName={api_sans}\nextendedKeyUsage=serverAuth\n",
        )  # fmt: skip
        openssl("genrsa", "-out", str(p / "sa.key"), "2048")
        openssl("rsa", "-in", str(p / "sa.key"), "-pubout", "-out", str(p / "sa.pub"))
        # ipward's etcd: its own CA, a server certificate for its address, a client one.
        ca("ipward-etcd-ca", "ipward-etcd-ca")
        signed(
            "ipward-etcd-server", "ipward-etcd-ca", "/CN=ipward-etcd",
            f"subjectAltName=IP:{CONTROL_PLANE_IP},IP:127.0.0.1\n"
            "extendedKeyUsage=serverAuth,clientAuth\n",
        )  # fmt: skip
        signed("ipward-client", "ipward-etcd-ca", "/CN=ipward", "extendedKeyUsage=clientAuth\n")
        tokens = {
            self.info["admin_token"]: ("admin", "system:masters"),
            secrets.token_hex(16): ("system:kube-controller-manager", "system:masters"),
            secrets.token_hex(16): ("system:kube-scheduler", "system:masters"),
        }
        for node in self.nodes:
            tokens[secrets.token_hex(16)] = (
                f"system:node:{node.name}",
                "system:nodes,system:masters",
            )
        (p / "tokens.csv").write_text(
            "".join(f'{t},{user},{user},"{groups}"\n' for t, (user, groups) in tokens.items())
        )
        self._tokens = {user: t for t, (user, _) in tokens.items()}

    def _client_kubeconfig(self, path: Path, user: str, token: str, server: str) -> Path:
        return token_kubeconfig(path, server, self.pki / "ca.crt", token, user)

    def write_kubeconfig(self) -> None:
        self._client_kubeconfig(self.kubeconfig, "admin", self.info["admin_token"], self.api_url)

    def _etcd(self, name: str, host: str, scheme: str, extra: Sequence[str]) -> EtcdServer:
        server = EtcdServer(
            self.state / name,
            name=name,
            extra_args=extra,
            client_scheme=scheme,
            host=host,
            command_prefix=["nsenter", f"--net={self.cp_netns}"],
            detach=True,
        )
        server.client_port, server.peer_port, server.metrics_port = 2379, 2380, 2381
        server.initial_cluster = f"{name}={server.peer_url}"
        server.start()
        assert server.proc is not None
        pid = server.proc.pid
        self.journal.record("process", name=name, pid=pid, start=_start_time(pid))
        self.info.setdefault("processes", {})[name] = {"pid": pid, "argv": server.args}
        in_netns(self.cp_netns, server.wait_ready)
        return server

    def _control_plane(self, binaries: Binaries) -> None:
        p = self.pki
        kube_etcd = self._etcd("etcd", "127.0.0.1", "http", [])
        p_ = str(p)
        self._etcd(
            "ipward-etcd",
            CONTROL_PLANE_IP,
            "https",
            [
                "--client-cert-auth",
                f"--trusted-ca-file={p_}/ipward-etcd-ca.crt",
                f"--cert-file={p_}/ipward-etcd-server.crt",
                f"--key-file={p_}/ipward-etcd-server.key",
            ],
        )
        apiserver = [
            binaries.kube_apiserver,
            f"--etcd-servers=http://{kube_etcd.endpoint}",
            f"--secure-port={API_PORT}",
            "--bind-address=0.0.0.0",
            f"--advertise-address={CONTROL_PLANE_IP}",
            f"--tls-cert-file={p_}/apiserver.crt",
            f"--tls-private-key-file={p_}/apiserver.key",
            f"--client-ca-file={p_}/ca.crt",
            f"--token-auth-file={p_}/tokens.csv",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            f"--service-account-key-file={p_}/sa.pub",
            f"--service-account-signing-key-file={p_}/sa.key",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-admission-plugins=NodeRestriction",
            "--kubelet-preferred-address-types=InternalIP",
        ]
        self.launch("kube-apiserver", self.in_cp(apiserver))
        wait_for(
            lambda: self._alive("kube-apiserver") and self.api("/readyz", timeout=3) == "ok",
            "kube-apiserver ready",
            READY_TIMEOUT,
            0.5,
        )
        kcm_config = self._client_kubeconfig(
            p / "controller-manager.kubeconfig",
            "system:kube-controller-manager",
            self._tokens["system:kube-controller-manager"],
            self.api_url,
        )
        self.launch(
            "kube-controller-manager",
            self.in_cp(
                [
                    binaries.kube_node, "kube-controller-manager",
                    f"--kubeconfig={kcm_config}",
                    "--controllers=*",
                    f"--service-account-private-key-file={p_}/sa.key",
                    f"--root-ca-file={p_}/ca.crt",
                    f"--cluster-signing-cert-file={p_}/ca.crt",
                    f"--cluster-signing-key-file={p_}/ca.key",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--leader-elect=false",
                    "--use-service-account-credentials=false",
                    "--bind-address=127.0.0.1",
                ]
            ),
        )  # fmt: skip
        scheduler_config = self._client_kubeconfig(
            p / "scheduler.kubeconfig",
            "system:kube-scheduler",
            self._tokens["system:kube-scheduler"],
            self.api_url,
        )
        self.launch(
            "kube-scheduler",
            self.in_cp(
                [
                    binaries.kube_node, "kube-scheduler",
                    f"--kubeconfig={scheduler_config}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                ]
            ),
        )  # fmt: skip

    def _alive(self, name: str) -> bool:
        pid = self.info.get("processes", {}).get(name, {}).get("pid")
        if pid is None or _start_time(pid) is None:
            raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
        return True

    def _cgroups(self, node: Node) -> None:
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / node.cgroup_root.strip("/")
            self.journal.record("cgroup", path=str(path))
            path.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":  # a new cpuset group starts empty
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((hierarchy / knob).read_text())

    def _node_mounts(self, node: Node) -> None:
        """The node's own /run, /var/lib, /var/log, /opt, an overlay /etc and the
        kubelet's sysctls, in its mount namespace."""
        base = Path(node.dir)
        script = []
        for target in NODE_MOUNTS:
            source = base / target.replace("/", "-")
            source.mkdir(parents=True, exist_ok=True)
            script.append(f"mount --bind {source} /{target}")
        for d in ("etc-upper", "etc-work"):
            (base / d).mkdir(exist_ok=True)
        script.append(
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={base}/etc-upper,"
            f"workdir={base}/etc-work /etc"
        )
        sysctl_dir = base / "sysctl"
        sysctl_dir.mkdir(exist_ok=True)
        for key, value in KUBELET_SYSCTLS.items():
            held = sysctl_dir / key.replace("/", ".")
            held.write_text(value + "\n")
            script.append(f"mount --bind {held} /proc/sys/{key}")
        script += [
            "mkdir -p /opt/cni/bin /etc/cni/net.d /etc/kubernetes/manifests /var/lib/kubelet"
            " /var/log/pods",
            *(
                f"ln -sf {CNI_PLUGINS / p} /opt/cni/bin/{p}"
                for p in ("bridge", "loopback", "host-local", "portmap")
            ),
        ]
        run(["nsenter", f"--mount={node.mntns}", "sh", "-ec", "\n".join(script)])

    def install_multus(self) -> None:
        """Multus as its thin plugin is installed: the NetworkAttachmentDefinition CRD, a
        ServiceAccount `multus` in kube-system allowed to read pods and attachments and
        to write pods' status, and on every node the `multus` binary, a kubeconfig with
        that account's token and a conf naming the pod network as `clusterNetwork`,
        first in the conf dir, so the runtime calls Multus, which calls `bridge` and
        the networks pods ask for (`k8s.v1.cni.cncf.io/networks`)."""
        multus = find_multus()
        rbac = [
            NAD_CRD,
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "multus", "namespace": "kube-system"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "multus"},
             "rules": [
                 {"apiGroups": ["k8s.cni.cncf.io"], "resources": ["*"], "verbs": ["*"]},
                 {"apiGroups": [""], "resources": ["pods", "pods/status"],
                  "verbs": ["get", "list", "update", "watch"]},
                 {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
                  "verbs": ["create", "patch", "update"]},
             ]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "multus"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "multus"},
             "subjects": [{"kind": "ServiceAccount", "name": "multus",
                           "namespace": "kube-system"}]},
        ]  # fmt: skip
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}),
        )
        wait_for(
            lambda: (
                self.kubectl("get", "network-attachment-definitions", "-A", check=False).returncode
                == 0
            ),
            "the NetworkAttachmentDefinition CRD served",
            60.0,
            0.5,
        )
        token = self.kubectl(
            "--namespace=kube-system", "create", "token", "multus", "--duration=24h"
        ).stdout.strip()
        kubeconfig = self._client_kubeconfig(
            self.state / "multus.kubeconfig", "multus", token, self.api_url
        ).read_text()
        conf = {
            "cniVersion": "0.3.1",
            "name": "multus-cni-network",
            "type": "multus",
            "kubeconfig": MULTUS_KUBECONFIG,
            "clusterNetwork": LAB_CONFLIST,
            "cniDir": "/var/lib/cni/multus",
            "binDir": "/opt/cni/bin",
        }
        for node in self.nodes:
            shutil.copy(multus, f"{node.dir}/opt/cni/bin/multus")
            run(
                self.in_node(
                    node,
                    [
                        "sh",
                        "-ec",
                        f"mkdir -p {Path(MULTUS_KUBECONFIG).parent}; cat > {MULTUS_KUBECONFIG}",
                    ],
                ),
                input=kubeconfig,
            )
            run(self.in_node(node, ["sh", "-ec", f"cat > {MULTUS_CONF}"]), input=json.dumps(conf))

    def remove_multus(self) -> None:
        """Every node's runtime back on the pod network's conf alone."""
        for node in self.nodes:
            run(self.in_node(node, ["rm", "-f", MULTUS_CONF]))

    def write_network(self, node: Node, ipam_type: str) -> None:
        """Write the node's conflist in place (containerd 1.6 does not see a file renamed
        into its conf dir)."""
        text = json.dumps(bridge_conflist(node, ipam_type), indent=2)
        run(
            self.in_node(node, ["sh", "-ec", f"cat > {LAB_CONFLIST}"]),
            input=text,
        )

    def _node(self, node: Node, binaries: Binaries, images: list[Path]) -> None:
        self._cgroups(node)
        self._node_mounts(node)
        self.write_network(node, "host-local")
        base = Path(node.dir)
        config = base / "containerd.toml"
        config.write_text(
            containerd_config(
                root=Path("/var/lib/containerd"),
                state=Path("/run/containerd"),
                address=Path("/run/containerd/containerd.sock"),
                runc_root=Path("/run/containerd/runc"),
                opt_dir=Path("/opt/containerd"),
                cni_bin=Path("/opt/cni/bin"),
                cni_conf=Path("/etc/cni/net.d"),
                runc=which("runc") or "runc",
            )
        )
        env = {"PATH": SYSTEM_PATH, "HOME": "/root"}
        # At debug level its log brackets each sandbox's CNI ADD ("begin cni setup",
        # "cni result"): `ipward bench --kube` times the ADDs from it.
        containerd = [which("containerd") or "containerd", "--config", str(config)]
        self.launch(
            f"{node.name}-containerd",
            self.in_node(node, [*containerd, "--log-level", "debug"]),
            env=env,
        )
        self.wait_containerd(node)
        self.import_images(node, images)
        token = self._tokens[f"system:node:{node.name}"]
        kubeconfig = self._client_kubeconfig(
            base / "kubelet.kubeconfig", f"system:node:{node.name}", token, self.api_url
        )
        kubelet_config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.ip,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": node.cgroup_root,
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": ["pods"],
            "failSwapOn": False,
            "protectKernelDefaults": True,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "staticPodPath": "/etc/kubernetes/manifests",
            "serializeImagePulls": False,
            "resolvConf": "/etc/resolv.conf",
            "healthzBindAddress": "127.0.0.1",
            "clusterDomain": "cluster.local",
            "fileCheckFrequency": "5s",
            "nodeStatusReportFrequency": "10s",
        }
        kubelet_yaml = base / "kubelet.yaml"
        kubelet_yaml.write_text(json.dumps(kubelet_config, indent=2))
        self.launch(
            f"{node.name}-kubelet",
            self.in_node(
                node,
                [
                    binaries.kube_node, "kubelet",
                    f"--config={kubelet_yaml}",
                    f"--kubeconfig={kubeconfig}",
                    "--container-runtime-endpoint=unix:///run/containerd/containerd.sock",
                    f"--hostname-override={node.name}",
                    f"--node-ip={node.ip}",
                    f"--pod-infra-container-image={PAUSE_IMAGE}",
                ],
            ),
            env=env,
        )  # fmt: skip

    def import_images(self, node: Node, images: Sequence[Path]) -> None:
        for image in images:
            run(
                [
                    "ctr",
                    f"--address={node.containerd_socket}",
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    str(image),
                ],
                timeout=600,
            )

    def wait_nodes_ready(self, timeout: float = READY_TIMEOUT) -> None:
        def ready() -> bool:
            for node in self.nodes:
                self._alive(f"{node.name}-kubelet")
            listed = self.api("/api/v1/nodes")
            ready = {
                item["metadata"]["name"]
                for item in listed.get("items", [])
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in item.get("status", {}).get("conditions", [])
                )
            }
            return ready >= {n.name for n in self.nodes}

        wait_for(ready, "every node Ready", timeout, 1.0)

    # -- pods, as the nodes' runtimes see them ------------------------------------------

    def sandboxes(self, node: Node) -> list[CriSandboxStatus]:
        """The node's ready pod sandboxes, with their addresses, from its containerd."""
        from ipward.cluster.cri import SANDBOX_READY, CriClient

        with CriClient(node.containerd_socket, timeout=10) as cri:
            return [
                cri.pod_sandbox_status(s.id, verbose=True)
                for s in cri.list_pod_sandboxes(state=SANDBOX_READY)
            ]

    def sandbox_pid(self, node: Node, pod_uid: str) -> int:
        """The pid of the ready sandbox of pod `pod_uid` on `node` (its pause process)."""
        for sandbox in self.sandboxes(node):
            if sandbox.uid == pod_uid:
                return int(json.loads(sandbox.info["info"])["pid"])
        raise ClusterError(f"no ready sandbox of pod {pod_uid} on {node.name}")

    def in_pod_netns(
        self, node: Node, pod_uid: str, *args: str, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """A machine binary (`ping`, `ip`) run in the network namespace of a pod."""
        pid = self.sandbox_pid(node, pod_uid)
        return subprocess.run(
            ["nsenter", f"--target={pid}", "--net", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def metrics(self, address: str, port: int) -> dict[str, float]:
        """The Prometheus samples at http://ADDRESS:PORT/metrics (an agent on its node's
        address, 9310; a controller on its pod's, 9311), read from the control plane's
        namespace: {`name{labels}`: value}."""

        def get() -> str:
            url = f"http://{address}:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as answer:
                return str(answer.read().decode())

        samples = {}
        for line in in_netns(self.cp_netns, get).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    # -- a node's power -------------------------------------------------------------------

    def node_pids(self, node: Node) -> set[int]:
        """Every process of the node: in its network or mount namespace (containerd, the
        kubelet, the shims, host-network pods) or in its cgroups (every pod)."""
        ns_ids = {i for i in (_ns_id(node.netns), _ns_id(node.mntns)) if i is not None}
        cgroups = [h / node.cgroup_root.strip("/") for h in cgroup_hierarchies()]
        return self._our_pids(ns_ids, cgroups, [])

    def power_off(self, node: Node, timeout: float = 60.0) -> None:
        """The node goes down as a machine does: every process of it killed (SIGKILL),
        and what a reboot clears cleared in its mount namespace: the mounts under /run
        (the sandboxes' network namespaces, the containers' root file systems) and
        the pods' volumes under /var/lib/kubelet (tmpfs), then /run's content. Its
        disk (/var/lib, /etc) stays; `power_on` starts its containerd and kubelet."""
        deadline = time.monotonic() + timeout
        while pids := {p for p in self.node_pids(node) if not _zombie(p) and not _observer(p)}:
            if time.monotonic() > deadline:
                raise ClusterError(f"{node.name}: processes still running: {sorted(pids)}")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in pids:  # the daemons are our children: reap them
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        script = (
            'for m in $(awk \'$5 ~ "^/run/." || $5 ~ "^/var/lib/kubelet/pods/"'
            ' {print $5}\' /proc/self/mountinfo | sort -r); do umount -l "$m"; done;'
            " find /run -mindepth 1 -delete"
        )
        run(["nsenter", f"--mount={node.mntns}", "sh", "-c", script])

    def power_on(self, node: Node) -> None:
        """Start the node's containerd and kubelet again (after `power_off`, or after
        they were killed), with their command lines of `up`."""
        containerd = f"{node.name}-containerd"
        for name in (containerd, f"{node.name}-kubelet"):
            entry = self.info["processes"][name]
            with contextlib.suppress(ClusterError):
                self.kill(name, timeout=5.0)
            self.launch(name, entry["argv"], env=entry.get("env"))
            if name == containerd:
                self.wait_containerd(node)
        self.write_info()

    def wait_containerd(self, node: Node) -> None:
        """Until the node's containerd answers on its socket (a socket file left by one
        that was killed refuses connections: the kubelet would exit on it)."""
        from ipward.cluster.cri import CriClient, CriError

        def answers() -> bool:
            self._alive(f"{node.name}-containerd")
            if not Path(node.containerd_socket).exists():
                return False
            with CriClient(node.containerd_socket, timeout=2) as cri:
                try:
                    cri.version()
                except CriError:
                    return False
            return True

        wait_for(answers, f"{node.name}: containerd answering", READY_TIMEOUT, 0.1)

    # -- deploy ---------------------------------------------------------------------------

    def deploy(self, say: Callable[[str], None] = print, tuning: Tuning | None = None) -> None:
        """ipward installed as its README says: its image (built here) on every node, the
        store with the pool `pods` (`ipward pool create`), the Secret naming its etcd,
        `kubectl apply -k deploy/base` (through an overlay of the lab's when `tuning`
        adds options); every node's network switched from host-local to ipward (its
        `ipam`), and the routes from the node ranges' to the route syncer's.

        Its etcd is outside the cluster (the base's Secret), not the `with-etcd` overlay:
        the overlay's image comes from a registry this machine cannot reach, its members
        find each other by names only a cluster DNS resolves (none here), and its pods
        would be on the pod network whose IPAM is ipward, which needs that etcd to give
        them addresses (they start only if they start before the switch)."""
        from ipward_lab.containerd.images import build_ipward_image

        tuning = tuning or Tuning()
        started = time.monotonic()
        image = build_ipward_image(CHECKOUT, say)
        say(f"loading {image.name} into every node's containerd")
        for node in self.nodes:
            self.import_images(node, [image])
        say(f"making the store and the pool {POOL} ({POD_NET}), and the Secret ipward-etcd")
        self.make_store(tuning.pool_args)
        p = self.pki
        # As README says, made with `kubectl create`; applied, so a second deploy works.
        for made in (
            ["create", "namespace", "ipward-system"],
            [
                "--namespace=ipward-system", "create", "secret", "generic", "ipward-etcd",
                f"--from-literal=endpoints={CONTROL_PLANE_IP}:{IPWARD_ETCD_PORT}",
                f"--from-file=ca.crt={p}/ipward-etcd-ca.crt",
                f"--from-file=tls.crt={p}/ipward-client.crt",
                f"--from-file=tls.key={p}/ipward-client.key",
            ],
        ):  # fmt: skip
            manifest = self.kubectl(*made, "--dry-run=client", "--output=yaml").stdout
            self.kubectl("apply", "--filename=-", input=manifest)
        # Nothing runs on the pod network yet: switching now is README's "drain each
        # node before switching it". The controllers' pods then get their addresses
        # from ipward: their first sandboxes fail (no `ipward` plugin until the
        # DaemonSet's init container installs it, then code 11 until the agent serves)
        # and the kubelet retries them.
        say(f"switching every node's network to ipward (pool {POOL}) and its routes")
        self.use_ipam("ipward")
        kustomization = tuning.kustomization(self.state / "deploy")
        say(f"kubectl apply -k {kustomization}")
        self.kubectl("apply", "-k", str(kustomization))
        self.wait_deployed()
        self.write_info(deploy_seconds=round(time.monotonic() - started, 1))
        say(f"deployed in {time.monotonic() - started:.1f}s")

    def use_ipam(self, ipam_type: str) -> None:
        """Every node's network on `ipam_type` (`host-local` or `ipward`), and the routes
        that go with it: the node ranges' for host-local, the route syncer for ipward.
        Switch a cluster with nothing on the pod network (README: drain each node
        before switching it)."""
        for node in self.nodes:
            self.write_network(node, ipam_type)
        syncing = "route-syncer" in self.info.get("processes", {})
        if ipam_type == "ipward":
            self.node_range_routes(present=False)
            if syncing:
                self.restart("route-syncer")
            else:
                self.launch(
                    "route-syncer",
                    self.in_cp([sys.executable, "-m", "ipward_lab.podroutes", str(self.state)]),
                )
        else:
            if syncing:
                self.kill("route-syncer")
                del self.info["processes"]["route-syncer"]
            self.node_range_routes(present=True)
        self.write_info(cni=ipam_type)

    def wait_routes(self, timeout: float = 30.0) -> None:
        """Every address ipward has given a sandbox routed in the fabric through the node
        of its record (the route syncer caught up with the records read now)."""
        from ipward_lab.podroutes import ROUTE_PROTO

        records = json.loads(self.ipward_run("alloc", "list", "--json").stdout)
        node_ip = {n.name: n.ip for n in self.nodes}
        want = {r["ip"]: node_ip[r["node"]] for r in records if r["container"]}

        def caught_up() -> bool:
            self._alive("route-syncer")
            out = run(
                [
                    "nsenter", f"--net={self.fabric_netns}",
                    "ip", "-j", "-4", "route", "show", "proto", ROUTE_PROTO,
                ]
            )  # fmt: skip
            have = {r["dst"]: r.get("gateway") for r in json.loads(out or "[]")}
            return want.items() <= have.items()

        wait_for(caught_up, "the route syncer's routes for every address", timeout, 0.1)

    def make_store(self, pool_args: Sequence[str] = ()) -> None:
        """The store with the pool `pods` (POD_NET, gateway POD_GATEWAY), as README's
        deploy makes it with `ipward pool create`; kept when an earlier deploy made it."""
        if self.ipward_run("pool", "list", check=False).returncode == 0:
            return
        run(
            self.ipward_argv(
                [
                    "pool", "create", POOL,
                    "--range", f"{POD_NET},gateway={POD_GATEWAY}",
                    *pool_args,
                ]
            )
        )  # fmt: skip

    def wait_deployed(self, timeout: float = 600.0) -> None:
        """The agent on every node serving its socket, the plugin installed, both
        controllers available."""

        def ready() -> bool:
            ds = self.kubectl_json("--namespace=ipward-system", "get", "daemonset", "ipward-agent")
            status = ds.get("status", {})
            if status.get("numberReady", 0) < len(self.nodes):
                return False
            for node in self.nodes:
                for path in (f"{node.dir}/run/ipward/agent.sock", f"{node.dir}/opt/cni/bin/ipward"):
                    if not os.path.exists(path):
                        return False
            deployment = self.kubectl_json(
                "--namespace=ipward-system", "get", "deployment", "ipward-controller"
            )
            return bool(deployment.get("status", {}).get("availableReplicas", 0) >= 2)

        wait_for(ready, "ipward deployed (agents ready, controllers available)", timeout, 2.0)

    # -- down -----------------------------------------------------------------------------

    def down(self, say: Callable[[str], None] = print) -> list[str]:
        """Remove everything the journal says was made, and every process in the lab's
        namespaces and cgroups; what could not be removed, as messages."""
        entries = self.journal.entries()
        if not entries:
            if self.state.exists() and not any(self.state.iterdir()):
                self.state.rmdir()
            return []
        left: list[str] = []
        ns_files = [
            e["path"]
            for e in entries
            if e["kind"] == "mount" and e["path"].endswith((".net", ".mnt"))
        ]
        cgroups = [Path(e["path"]) for e in entries if e["kind"] == "cgroup"]
        processes = [e for e in entries if e["kind"] == "process"]
        say("stopping processes")
        self._kill_all(ns_files, cgroups, processes, left)
        say("removing mounts, namespaces and cgroups")
        for point in mounts_under(self.state):
            proc = subprocess.run(
                ["umount", "--lazy", point], capture_output=True, text=True, timeout=30
            )
            if proc.returncode != 0:
                left.append(f"umount {point}: {proc.stderr.strip()}")
        for cgroup in cgroups:
            self._remove_cgroup(cgroup, left)
        if not left:
            shutil.rmtree(self.state, ignore_errors=True)
            if self.state.exists():
                left.append(f"could not remove {self.state}")
        return left

    def _our_pids(
        self, ns_ids: set[tuple[int, int]], cgroups: list[Path], processes: list[dict[str, Any]]
    ) -> set[int]:
        pids: set[int] = set()
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            for kind in ("net", "mnt"):
                if _ns_id(f"/proc/{entry}/ns/{kind}") in ns_ids:
                    pids.add(int(entry))
        for cgroup in cgroups:
            if cgroup.is_dir():
                for dirpath, _, files in os.walk(cgroup):
                    if "cgroup.procs" in files:
                        with contextlib.suppress(OSError):
                            for line in Path(dirpath, "cgroup.procs").read_text().split():
                                pids.add(int(line))
        for p in processes:
            if p.get("start") and _start_time(p["pid"]) == p["start"]:
                pids.add(p["pid"])
        pids.discard(me)
        return pids

    def _kill_all(
        self,
        ns_files: list[str],
        cgroups: list[Path],
        processes: list[dict[str, Any]],
        left: list[str],
    ) -> None:
        ns_ids = {i for i in (_ns_id(f) for f in ns_files) if i is not None}
        # Only nsfs inodes: a file whose namespace was already unmounted is a plain file.
        ns_ids = {i for i in ns_ids if i[0] == _ns_id("/proc/self/ns/net")[0]}  # type: ignore[index]
        deadline = time.monotonic() + 60
        while True:
            pids = self._our_pids(ns_ids, cgroups, processes)
            alive = [pid for pid in pids if _start_time(pid) is not None and not _zombie(pid)]
            if not alive:
                return
            if time.monotonic() > deadline:
                left.append(f"processes still running: {sorted(alive)}")
                return
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in alive:  # our own children: reap them
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)

    def _remove_cgroup(self, top: Path, left: list[str]) -> None:
        if not top.is_dir():
            return
        deadline = time.monotonic() + 30
        while True:
            failed = []
            for d in sorted(
                (Path(dp) for dp, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True
            ):
                try:
                    d.rmdir()
                except OSError as e:
                    failed.append(f"cgroup {d}: {e}")
            if not failed or time.monotonic() > deadline:
                left.extend(failed)
                return
            time.sleep(0.2)


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
        if not entry.isdigit() or int(entry) == me or _zombie(int(entry)):
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        held = [k for k in ("net", "mnt") if _ns_id(f"/proc/{entry}/ns/{k}") in ns_ids]
        if held or str(state) in cmdline:
            found.append(f"process {entry} ({cmdline.strip()[:120]}) {' '.join(held)}")
    found += [f"mount {point}" for point in mounts_under(state)]
    for hierarchy in cgroup_hierarchies():
        found += [f"cgroup {d}" for d in hierarchy.glob(f"ipward-cluster-{cluster_id}-*")]
    if state.exists():
        found.append(f"state dir {state}")
    return found


def namespace_ids(lab: Cluster) -> set[tuple[int, int]]:
    """The inodes of the cluster's namespaces (while it is up)."""
    files = [lab.cp_netns, lab.fabric_netns, *(n.netns for n in lab.nodes)]
    files += [n.mntns for n in lab.nodes]
    return {i for i in (_ns_id(f) for f in files) if i is not None}


# In the argv of the lab's own observers that live in a node's namespaces (the address
# witness's scanners): not the node's, so a power off spares them (`down` does not).
OBSERVER_MARK = "ipward-lab-observer"


def _observer(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return OBSERVER_MARK.encode() in argv


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@contextlib.contextmanager
def cluster(state: Path, nodes: int, say: Callable[[str], None] = print) -> Iterator[Cluster]:
    """A cluster that is up for the block, removed after it (also on failure)."""
    lab = Cluster(state)
    try:
        lab.up(nodes, say)
        yield lab
    finally:
        left = lab.down(say)
        if left:
            raise ClusterError("cluster down left: " + "; ".join(left))
