"""Network-namespace lab: real CNI plugins run against throwaway network namespaces.

A :class:`NetLab` makes one "host" network namespace and any number of "pod" namespaces
with ``ip netns add``. Every CNI call runs Debian's ``bridge`` plugin *inside the host
namespace* (``ip netns exec HOST env -i CNI_...=... /usr/lib/cni/bridge``), so the bridge
device, its gateway address, the host ends of the veth pairs and the ``ip_forward`` sysctl
all live there. The namespace this process runs in is never configured: the lab only creates
and deletes namespace files under ``/var/run/netns``.

``ip netns exec`` enters the namespace *and* a private mount namespace with ``/sys``
remounted, so ``/proc/sys/net`` and ``/sys/class/net`` seen by the plugin (and by
:meth:`NetLab.host_exec`) are the host namespace's, not the machine's.

A fresh network namespace has no iptables/nftables rules (every policy ACCEPT), so pods
talk to each other across the bridge even though ``br_netfilter`` is active (its
``bridge-nf-call-iptables`` is per namespace and defaults to 1). Were a ``FORWARD`` policy of
DROP set in the host namespace, bridged pod-to-pod traffic would be dropped.

Standard library only; it needs root, ``ip`` from iproute2, ``ping`` from iputils and the
CNI plugins (``containernetworking-plugins``).

Usage::

    with NetLab() as lab:
        a, b = lab.add_pod("a"), lab.add_pod("b")
        conf = bridge_network_config("demo", lab.bridge, {"type": "ipward", ...})
        out = lab.cni("ADD", a, "eth0", conf, cni_path=[our_bin_dir, CNI_BIN_DIR])
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BRIDGE_PLUGIN",
    "CNI_BIN_DIR",
    "NETNS_DIR",
    "CniFailed",
    "CniOutcome",
    "NetLab",
    "NetLabError",
    "Pod",
    "bridge_network_config",
    "host_local_ipam",
    "root_namespace_state",
    "skip_reason",
]

CNI_BIN_DIR = "/usr/lib/cni"
BRIDGE_PLUGIN = f"{CNI_BIN_DIR}/bridge"
NETNS_DIR = "/var/run/netns"
CNI_VERSION = "1.0.0"  # Debian's bridge 1.1.1 refuses 1.1.0 with code 1

IFNAMSIZ = 15  # longest Linux interface name
_POD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_IP_TIMEOUT = 30.0
_CNI_TIMEOUT = 60.0


class NetLabError(RuntimeError):
    """A namespace operation (``ip ...``) failed or timed out."""


class CniFailed(NetLabError):
    """Raised by :meth:`CniOutcome.raise_for_status` for a non-zero plugin exit."""

    def __init__(self, outcome: CniOutcome) -> None:
        super().__init__(outcome.describe())
        self.outcome = outcome


@dataclass(frozen=True)
class Pod:
    """One pod sandbox: a network namespace plus the identity a runtime would pass to CNI."""

    name: str  # network namespace name (unique, as in ``ip netns list``)
    netns: str  # path given as CNI_NETNS, /var/run/netns/<name>
    container_id: str  # CNI_CONTAINERID: 64 hex characters, like a containerd sandbox ID
    k8s_namespace: str
    k8s_name: str
    k8s_uid: str

    def cni_args(self) -> str:
        """The ``CNI_ARGS`` a Kubernetes runtime (containerd) passes for this sandbox."""
        return (
            f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.k8s_namespace};"
            f"K8S_POD_NAME={self.k8s_name};K8S_POD_UID={self.k8s_uid};"
            f"K8S_POD_INFRA_CONTAINER_ID={self.container_id}"
        )


@dataclass(frozen=True)
class CniOutcome:
    """What one plugin execution produced."""

    command: str
    returncode: int
    result: dict[str, Any] | None  # stdout parsed as a JSON object; None if empty/not JSON
    stdout: str
    stderr: str
    env: dict[str, str] = field(default_factory=dict)  # the CNI_* environment it ran with

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def error(self) -> dict[str, Any] | None:
        """The CNI error object (``code``, ``msg``, ``details``) of a failed call."""
        if self.ok or self.result is None:
            return None
        return self.result

    @property
    def ips(self) -> list[str]:
        """``ips[].address`` of a successful ADD/CHECK result, e.g. ``["10.9.0.2/24"]``."""
        if not self.ok or self.result is None:
            return []
        return [str(ip["address"]) for ip in self.result.get("ips", []) if "address" in ip]

    def raise_for_status(self) -> CniOutcome:
        if not self.ok:
            raise CniFailed(self)
        return self

    def describe(self) -> str:
        return (
            f"CNI {self.command} exited {self.returncode}\n"
            f"  env: {' '.join(f'{k}={v}' for k, v in self.env.items())}\n"
            f"  stdout: {self.stdout.strip()}\n"
            f"  stderr: {self.stderr.strip()}"
        )


def bridge_network_config(
    name: str,
    bridge: str,
    ipam: Mapping[str, Any],
    *,
    cni_version: str = CNI_VERSION,
    is_gateway: bool = True,
    ip_masq: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A single (conflist-less) network config for the ``bridge`` plugin.

    ``extra`` keys are added verbatim (e.g. ``mtu=1400``, ``runtimeConfig={...}``).
    """
    if not 0 < len(bridge) <= IFNAMSIZ:
        raise ValueError(f"bridge name {bridge!r} must be 1..{IFNAMSIZ} characters")
    conf: dict[str, Any] = {
        "cniVersion": cni_version,
        "name": name,
        "type": "bridge",
        "bridge": bridge,
        "isGateway": is_gateway,
        "ipMasq": ip_masq,
        "ipam": copy.deepcopy(dict(ipam)),
    }
    conf.update(copy.deepcopy(extra))
    return conf


def host_local_ipam(subnet: str, data_dir: str | os.PathLike[str], **extra: Any) -> dict[str, Any]:
    """An ``ipam`` section for Debian's ``host-local`` with its state in ``data_dir``."""
    ipam: dict[str, Any] = {
        "type": "host-local",
        "ranges": [[{"subnet": subnet}]],
        "dataDir": os.fspath(data_dir),
    }
    ipam.update(extra)
    return ipam


def skip_reason(bridge_plugin: str = BRIDGE_PLUGIN) -> str | None:
    """Why a NetLab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    for tool in ("ip", "ping"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found in PATH (install iproute2 / iputils-ping)"
    if not os.access(bridge_plugin, os.X_OK):
        return f"CNI bridge plugin not found at {bridge_plugin} (containernetworking-plugins)"
    return None


def _run(args: Sequence[str], timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetLabError(f"timed out after {timeout}s: {' '.join(args)}") from exc


def _check(args: Sequence[str], timeout: float = _IP_TIMEOUT) -> str:
    proc = _run(args, timeout)
    if proc.returncode != 0:
        raise NetLabError(
            f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
        )
    return proc.stdout


def _links(prefix: Sequence[str]) -> list[dict[str, Any]]:
    out = _check([*prefix, "ip", "-j", "addr", "show"])
    data: list[dict[str, Any]] = json.loads(out) if out.strip() else []
    return data


def _summarize_links(links: list[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    summary = []
    for link in links:
        addrs = tuple(sorted(f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])))
        summary.append((str(link["ifname"]), addrs))
    return sorted(summary)


def root_namespace_state() -> dict[str, Any]:
    """A snapshot of the calling process's own network namespace, to compare before/after.

    Interfaces with their addresses, and the IPv4/IPv6 forwarding sysctls.
    """
    return {
        "links": _summarize_links(_links([])),
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "ipv6_forwarding": Path("/proc/sys/net/ipv6/conf/all/forwarding").read_text().strip()
        if Path("/proc/sys/net/ipv6/conf/all/forwarding").exists()
        else None,
    }


def _netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


class NetLab:
    """A throwaway host network namespace plus pod namespaces, torn down by :meth:`close`.

    The namespaces are created in the constructor; use it as a context manager (or call
    :meth:`close` from a finalizer). ``close`` deletes every namespace this lab made, is
    safe to call after any failure and more than once; it is also registered with
    :mod:`atexit` as a last resort.
    """

    def __init__(
        self,
        *,
        prefix: str = "ipw",
        bridge_plugin: str = BRIDGE_PLUGIN,
        cni_timeout: float = _CNI_TIMEOUT,
    ) -> None:
        self.suffix = secrets.token_hex(3)
        self.prefix = prefix
        self.host = f"{prefix}-host-{self.suffix}"
        self.host_netns = os.path.join(NETNS_DIR, self.host)
        self.bridge = f"{prefix}br{self.suffix}"[-IFNAMSIZ:]
        self.bridge_plugin = bridge_plugin
        self.cni_timeout = cni_timeout
        self.pods: list[Pod] = []
        self._owned: list[str] = []  # namespace names still to delete, in creation order
        self._lock = threading.Lock()
        self._counter = 0
        self._closed = False
        atexit.register(self._atexit)
        try:
            self._add_netns(self.host)
            self.host_exec("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetLab(host={self.host!r}, bridge={self.bridge!r}, pods={len(self.pods)})"

    def close(self) -> None:
        """Delete every namespace this lab created (pods first, then the host).

        Idempotent. Raises :class:`NetLabError` if a namespace could not be deleted (a
        later call retries only what is left).
        """
        with self._lock:
            self._closed = True
            failures = []
            for name in reversed(list(self._owned)):
                if _netns_exists(name):
                    try:
                        err = _run(["ip", "netns", "del", name]).stderr.strip()
                    except NetLabError as exc:  # timed out: keep going with the rest
                        err = str(exc)
                    if _netns_exists(name):
                        failures.append(f"{name}: {err}")
                        continue
                self._owned.remove(name)
            if not failures:
                atexit.unregister(self._atexit)
        if failures:
            raise NetLabError("could not delete namespaces: " + "; ".join(failures))

    def _atexit(self) -> None:
        with contextlib.suppress(NetLabError):
            self.close()

    def _add_netns(self, name: str) -> None:
        with self._lock:
            if self._closed:
                raise NetLabError("NetLab is closed")
            _check(["ip", "netns", "add", name])
            self._owned.append(name)

    # -- pods --------------------------------------------------------------------------

    def add_pod(
        self,
        name: str,
        *,
        k8s_namespace: str = "default",
        k8s_uid: str | None = None,
        container_id: str | None = None,
    ) -> Pod:
        """Create a pod network namespace and the sandbox identity that goes with it.

        ``name`` is the Kubernetes pod name; it may be reused (a new sandbox of the same
        StatefulSet pod gets a new namespace, container ID and, unless given, UID).
        """
        if not _POD_NAME.match(name):
            raise ValueError(f"pod name {name!r} must match {_POD_NAME.pattern}")
        with self._lock:
            index = self._counter
            self._counter += 1
        netns_name = f"{self.prefix}-{self.suffix}-{index}-{name}"
        self._add_netns(netns_name)
        pod = Pod(
            name=netns_name,
            netns=os.path.join(NETNS_DIR, netns_name),
            container_id=container_id or secrets.token_hex(32),
            k8s_namespace=k8s_namespace,
            k8s_name=name,
            k8s_uid=k8s_uid or str(uuid.uuid4()),
        )
        with self._lock:
            self.pods.append(pod)
        return pod

    def remove_pod(self, pod: Pod) -> None:
        """Delete a pod's namespace without any CNI call (a sandbox that vanished)."""
        with self._lock:
            if pod.name not in self._owned:
                return
            if _netns_exists(pod.name):
                _check(["ip", "netns", "del", pod.name])
            self._owned.remove(pod.name)

    # -- CNI ---------------------------------------------------------------------------

    def cni(
        self,
        command: str,
        pod: Pod,
        ifname: str,
        network_config: Mapping[str, Any],
        cni_args: str | None = None,
        cni_path: Sequence[str] | None = None,
        *,
        container_id: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> CniOutcome:
        """Run the bridge plugin in the host namespace for ``pod`` and return what it did.

        ``cni_args`` defaults to :meth:`Pod.cni_args`; ``cni_path`` (the directories the
        bridge plugin searches for ``ipam.type``) to ``[CNI_BIN_DIR]``. The environment is
        exactly the CNI_* variables plus ``extra_env`` (``env -i``: no PATH, no HOME).
        A non-zero exit is returned, not raised; see :meth:`CniOutcome.raise_for_status`.
        """
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id or pod.container_id,
            "CNI_NETNS": pod.netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": ":".join(cni_path if cni_path is not None else [CNI_BIN_DIR]),
            "CNI_ARGS": pod.cni_args() if cni_args is None else cni_args,
        }
        if "IPWARD_CNI_NOTES" in os.environ:  # where an agent's plugin keeps its notes
            env["IPWARD_CNI_NOTES"] = os.environ["IPWARD_CNI_NOTES"]
        env.update(extra_env or {})
        args = [
            "ip", "netns", "exec", self.host, "env", "-i",
            *(f"{k}={v}" for k, v in env.items()),
            self.bridge_plugin,
        ]  # fmt: skip
        limit = self.cni_timeout if timeout is None else timeout
        try:
            proc = subprocess.run(
                args,
                input=json.dumps(network_config),
                capture_output=True,
                text=True,
                timeout=limit,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise NetLabError(f"CNI {command} for {pod.name} timed out after {limit}s") from exc
        result: dict[str, Any] | None = None
        if proc.stdout.strip():
            try:
                parsed = json.loads(proc.stdout)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                result = parsed
        return CniOutcome(command, proc.returncode, result, proc.stdout, proc.stderr, env)

    # -- inspection --------------------------------------------------------------------

    def host_exec(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside the host namespace."""
        return self._ns_exec(self.host, args, check)

    def pod_exec(
        self, pod: Pod, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside a pod's namespace."""
        return self._ns_exec(pod.name, args, check)

    def _ns_exec(
        self, ns: str, args: Sequence[str], check: bool
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", ns, *args]
        proc = _run(cmd)
        if check and proc.returncode != 0:
            raise NetLabError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def addresses(
        self, pod: Pod, ifname: str = "eth0", *, include_link_local: bool = False
    ) -> list[str]:
        """Addresses on ``ifname`` in the pod, as ``"10.9.0.2/24"``.

        IPv6 link-local addresses are left out unless asked for. A missing interface gives
        ``[]`` (e.g. after DEL); a missing namespace raises :class:`NetLabError`.
        """
        proc = self.pod_exec(pod, "ip", "-j", "addr", "show", "dev", ifname, check=False)
        if proc.returncode != 0:
            if "does not exist" in proc.stderr:
                return []
            raise NetLabError(f"ip addr in {pod.name} failed: {proc.stderr.strip()}")
        out: list[str] = []
        for link in json.loads(proc.stdout or "[]"):
            for a in link.get("addr_info", []):
                if a.get("scope") == "link" and not include_link_local:
                    continue
                out.append(f"{a['local']}/{a['prefixlen']}")
        return out

    def links(self, pod: Pod | None = None) -> list[str]:
        """Interface names in a pod's namespace, or in the host namespace when None."""
        ns = self.host if pod is None else pod.name
        proc = self._ns_exec(ns, ["ip", "-j", "link", "show"], True)
        return [str(link["ifname"]) for link in json.loads(proc.stdout or "[]")]

    def host_sysctl(self, key: str) -> str:
        """A sysctl as the host namespace sees it, e.g. ``host_sysctl("net/ipv4/ip_forward")``."""
        path = key if "/" in key else key.replace(".", "/")
        return self.host_exec("cat", f"/proc/sys/{path}").stdout.strip()

    def ping(self, from_pod: Pod, address: str, *, count: int = 1, wait: int = 2) -> bool:
        """True when ``address`` (a prefix length is ignored) answers a ping from the pod."""
        target = address.split("/", 1)[0]
        proc = self.pod_exec(
            from_pod, "ping", "-c", str(count), "-W", str(wait), target, check=False
        )
        return proc.returncode == 0
