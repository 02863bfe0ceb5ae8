"""The cluster lab's worker nodes, each a machine of its own on this one: its network and
mount namespaces, its cgroups (the kubelet's cgroup root, made in every hierarchy), its
containerd and kubelet; what its runtime says of its pods; its power off and on.

In a node's mount namespace, the node's own directories are bind-mounted over `/run`,
`/var/lib`, `/var/log` and `/opt`, and `/etc` is an overlay of the machine's (the node's
CNI configs and static pods go in its upper dir): containerd, the kubelet and the pods'
hostPath volumes use the usual paths (`/run/containerd/containerd.sock`,
`/opt/cni/bin`, `/etc/cni/net.d`, `/run/ipward`) and nothing lands on the machine. The
kubelet's host sysctls (`protectKernelDefaults`) are files bind-mounted over their
`/proc/sys` entries there, holding the values it expects; the machine's stay. A node
planned without Python (`Node.python`) has a program that is not an interpreter bound
over every `python3*` of `/usr/bin` and `/usr/local/bin` there, as on a node of an OS
that ships none (Flatcar, Talos, Bottlerocket): what runs there must not need one."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipward_lab.containerd.config import containerd_config
from ipward_lab.containerd.images import PAUSE_IMAGE
from ipward_lab.kubecluster.clients import Clients
from ipward_lab.kubecluster.common import READY_TIMEOUT, ClusterError, run, wait_for
from ipward_lab.kubecluster.layout import CNI_PLUGINS, NETWORK, Node
from ipward_lab.kubecluster.network import Network
from ipward_lab.kubecluster.pki import client_kubeconfig
from ipward_lab.kubecluster.prerequisites import Binaries
from ipward_lab.kubecluster.processes import (
    Daemons,
    kill_until_gone,
    ns_id,
    observer,
    pids_in,
    zombie,
)
from ipward_lab.kubecluster.state import ClusterState
from ipward_lab.machine import SYSTEM_PATH, cgroup_hierarchies, which

if TYPE_CHECKING:
    from ipward.cluster.cri import CriSandboxStatus

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
NOT_AN_INTERPRETER = "/usr/bin/false"  # bound over python3* on a node without Python


def python_programs() -> list[str]:
    """The machine's python3* programs (their names; a bind over a symlink lands on its
    target, which is in the list too)."""
    found = [*Path("/usr/bin").glob("python3*"), *Path("/usr/local/bin").glob("python3*")]
    return sorted(str(p) for p in found if p.is_file())


class Workers:
    """The worker nodes (`lab.nodes`): made and started (`start`), their runtimes read,
    powered off and on."""

    def __init__(
        self, lab: ClusterState, daemons: Daemons, clients: Clients, network: Network
    ) -> None:
        self.lab = lab
        self.daemons = daemons
        self.clients = clients
        self.network = network

    def start(self, node: Node, binaries: Binaries, images: list[Path], token: str) -> None:
        """The node made and started: its cgroups, its mounts, its network on
        host-local, its containerd (with `images`), its kubelet (as its user, `token`)."""
        self._cgroups(node)
        self._node_mounts(node)
        self.network.write_conflist(node, "host-local")
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
        self.daemons.launch(
            f"{node.name}-containerd",
            self.lab.in_node(node, [*containerd, "--log-level", "debug"]),
            env=env,
        )
        self.wait_containerd(node)
        self.import_images(node, images)
        kubeconfig = client_kubeconfig(
            self.lab, base / "kubelet.kubeconfig", f"system:node:{node.name}", token
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
        self.daemons.launch(
            f"{node.name}-kubelet",
            self.lab.in_node(
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

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the API lists every node Ready (their kubelets still running)."""

        def ready() -> bool:
            for node in self.lab.nodes:
                self.daemons.alive(f"{node.name}-kubelet")
            listed = self.clients.api("/api/v1/nodes")
            ready = {
                item["metadata"]["name"]
                for item in listed.get("items", [])
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in item.get("status", {}).get("conditions", [])
                )
            }
            return ready >= {n.name for n in self.lab.nodes}

        wait_for(ready, "every node Ready", timeout, 1.0)

    def _cgroups(self, node: Node) -> None:
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / node.cgroup_root.strip("/")
            self.lab.journal.record("cgroup", path=str(path))
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
        if not node.python:
            script += [f"mount --bind {NOT_AN_INTERPRETER} {p}" for p in python_programs()]
        script += [
            "mkdir -p /opt/cni/bin /etc/cni/net.d /etc/kubernetes/manifests /var/lib/kubelet"
            " /var/log/pods",
            *(
                f"ln -sf {CNI_PLUGINS / p} /opt/cni/bin/{p}"
                for p in ("bridge", "loopback", "host-local", "portmap")
            ),
        ]
        run(["nsenter", f"--mount={node.mntns}", "sh", "-ec", "\n".join(script)])

    # -- pods, as the nodes' runtimes see them ------------------------------------------

    def sandboxes(self, node: Node) -> list[CriSandboxStatus]:
        """The node's ready pod sandboxes, with their addresses, from its containerd."""
        from ipward.cluster.cri import SANDBOX_READY, CriClient

        with CriClient(node.containerd_socket, timeout=10) as cri:
            return [
                cri.pod_sandbox_status(s.id, verbose=True)
                for s in cri.list_pod_sandboxes(state=SANDBOX_READY)
            ]

    def loaded_network(self, node: Node) -> dict[str, Any] | None:
        """The pod network's conflist as the node's containerd has it loaded (its CRI
        status says; it reloads its conf dir on a change, when it can read the file
        whole), None when it has none or does not answer."""
        from ipward.cluster.cri import CriClient, CriError

        try:
            with CriClient(node.containerd_socket, timeout=10) as cri:
                info = cri.status(verbose=True).info
        except CriError:
            return None
        for network in json.loads(info.get("cniconfig") or "{}").get("Networks") or []:
            if network["Config"]["Name"] == NETWORK:
                loaded: dict[str, Any] = json.loads(network["Config"]["Source"])
                return loaded
        return None

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

    # -- a node's power -------------------------------------------------------------------

    def node_pids(self, node: Node) -> set[int]:
        """Every process of the node: in its network or mount namespace (containerd, the
        kubelet, the shims, host-network pods) or in its cgroups (every pod)."""
        ns_ids = {i for i in (ns_id(node.netns), ns_id(node.mntns)) if i is not None}
        cgroups = [h / node.cgroup_root.strip("/") for h in cgroup_hierarchies()]
        return pids_in(ns_ids, cgroups, [])

    def power_off(self, node: Node, timeout: float = 60.0) -> None:
        """The node goes down as a machine does: every process of it killed (SIGKILL),
        what its memory held lost: in its mount namespace the mounts under /run (the
        sandboxes' network namespaces, the containers' root file systems) and the pods'
        volumes under /var/lib/kubelet (tmpfs), then /run's content; its network state
        (`Network.power_off`: every link, address, route and rule, and its port on the
        fabric). Its disk (/var/lib, /etc) stays; `power_on` boots it."""
        left = kill_until_gone(
            lambda: {p for p in self.node_pids(node) if not zombie(p) and not observer(p)},
            timeout,
            0.05,
        )
        if left:
            raise ClusterError(f"{node.name}: processes still running: {sorted(left)}")
        script = (
            'for m in $(awk \'$5 ~ "^/run/." || $5 ~ "^/var/lib/kubelet/pods/"'
            ' {print $5}\' /proc/self/mountinfo | sort -r); do umount -l "$m"; done;'
            " find /run -mindepth 1 -delete"
        )
        run(["nsenter", f"--mount={node.mntns}", "sh", "-c", script])
        self.network.power_off(node)

    def power_on(self, node: Node) -> None:
        """The node boots after `power_off`: its network as its boot configures it
        (`Network.power_on`), then its containerd and kubelet with their command lines of
        `up`."""
        self.network.power_on(node)
        containerd = f"{node.name}-containerd"
        for name in (containerd, f"{node.name}-kubelet"):
            entry = self.lab.info["processes"][name]
            self.daemons.launch(name, entry["argv"], env=entry.get("env"))
            if name == containerd:
                self.wait_containerd(node)
        self.lab.write_info()

    def wait_containerd(self, node: Node) -> None:
        """Until the node's containerd answers on its socket (a socket file left by one
        that was killed refuses connections: the kubelet would exit on it)."""
        from ipward.cluster.cri import CriClient, CriError

        def answers() -> bool:
            self.daemons.alive(f"{node.name}-containerd")
            if not Path(node.containerd_socket).exists():
                return False
            with CriClient(node.containerd_socket, timeout=2) as cri:
                try:
                    cri.version()
                except CriError:
                    return False
            return True

        wait_for(answers, f"{node.name}: containerd answering", READY_TIMEOUT, 0.1)
