"""A real containerd for tests: Debian's containerd 1.6 with runc and its CRI plugin, in a
temp dir and a network namespace of its own, with a pause image built here.

`ContainerdLab` (a context manager):
  * compiles a pause program (`ipward_lab.containerd.images`: `gcc -static -Os`, `pause()` in a
    loop, reaps children on SIGCHLD, exits on SIGTERM/SIGINT) and packs it as a one-layer
    OCI image layout tarball, imported with `ctr images import` and named as the CRI
    `sandbox_image`: nothing is downloaded;
  * makes a CNI bin dir (Debian's `bridge` and `loopback`, and our `ipward` behind a
    wrapper that records each call) and a conf dir with one conflist, `bridge` with
    `"ipam"` as given (`write_network` rewrites it in place: containerd 1.6 ignores a
    file renamed into the conf dir);
  * runs containerd (`nsenter --net=`, same mount namespace) inside a network namespace
    made for it, so the bridge, the host ends of the veths and `ip_forward` live there;
    root, state, sockets, the runc root and the sandboxes' network namespaces
    (`netns_mounts_under_state_dir`) are under the temp dir;
  * tears down everything, also after a failure (containerd killed, sandboxes left):
    sandboxes, containerd, its shims and their containers, mounts under the temp dir,
    its network namespace, and what containerd 1.6 writes where it cannot be moved:
    shim sockets in `/run/containerd/s/`, libcni's cache in `/var/lib/cni/results`,
    and cgroups (each sandbox of `run_pod` under `cgroup_parent`, named after the lab;
    others under `/k8s.io/<id>`). Directories it created there are removed, so a
    machine without `/run/containerd` before has none after.

Missing binaries raise `LabError` with what to install: the caller fails, never skips.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc

from ipward.cluster.cri import CriClient, CriError
from ipward_lab.containerd.config import CONTAINERD_TOOLS, containerd_config
from ipward_lab.containerd.images import PAUSE_IMAGE, ImageError, build_pause, build_pause_image
from ipward_lab.machine import SYSTEM_PATH, cgroup_hierarchies, mounts_under, which

CNI_BIN_DIR = Path("/usr/lib/cni")
NETNS_DIR = Path("/var/run/netns")
CNI_CACHE_DIR = Path("/var/lib/cni")
RUN_CONTAINERD = Path("/run/containerd")
MACHINE_LOCK = Path("/run/ipward-containerd-lab.lock")


class MachineLock:
    """containerd 1.6 writes to machine-wide paths (above) that a lab cleans up when it
    stops: labs of parallel test workers or other checkouts take turns on a file lock.
    Within one process it is re-entrant: a test may start a second lab beside its
    module's (each removes only what it created)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: io.TextIOWrapper | None = None
        self._holders = 0

    def acquire(self) -> None:
        if self._holders == 0:
            self._file = open(self.path, "a")  # noqa: SIM115 (held until the last release)
            fcntl.flock(self._file, fcntl.LOCK_EX)
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._file is not None:
            self._file.close()  # closing releases the flock
            self._file = None


machine_lock = MachineLock(MACHINE_LOCK)
K8S_NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin
IMAGE_NAME = PAUSE_IMAGE
CNI_VERSION = "1.0.0"  # Debian's bridge 1.1.1 refuses 1.1.0

REQUIRED = {
    **CONTAINERD_TOOLS,
    "nsenter": "util-linux",
    "ip": "iproute2",
    "umount": "mount",
}

START_TIMEOUT = 30.0
CALL_TIMEOUT = 30.0


class LabError(RuntimeError):
    """The lab could not be set up (a missing binary, containerd did not start...)."""


def missing_requirements() -> list[str]:
    """What is missing to run a lab, each with the Debian package that provides it."""
    missing = [
        f"{binary} (Debian package {package})"
        for binary, package in REQUIRED.items()
        if which(binary) is None
    ]
    gcc = which("gcc")
    if gcc:
        libc = subprocess.run(
            [gcc, "-print-file-name=libc.a"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if not os.path.isabs(libc):  # gcc echoes the bare name when it has none
            missing.append("a static libc, libc.a (Debian package libc6-dev)")
    for plugin in ("bridge", "loopback"):
        if not os.access(CNI_BIN_DIR / plugin, os.X_OK):
            missing.append(f"{CNI_BIN_DIR / plugin} (Debian package containernetworking-plugins)")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _which(binary: str) -> str:
    found = which(binary)
    if found is None:
        raise LabError(f"{binary} not found")
    return found


def _run(args: list[str], timeout: float = CALL_TIMEOUT, **kw: Any) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        raise LabError(
            f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
        )
    return proc.stdout


# -- configs ------------------------------------------------------------------------------


def network_config(name: str, bridge: str, ipam: Mapping[str, Any]) -> dict[str, Any]:
    """The conflist: Debian's bridge, with ipam as given."""
    return {
        "cniVersion": CNI_VERSION,
        "name": name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": False,
                "ipam": dict(ipam),
            }
        ],
    }


# -- what the machine looks like, to restore it ------------------------------------------


def _listdir(path: Path) -> set[str]:
    try:
        return set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _pids_referring_to(marker: str) -> list[int]:
    """Live processes whose command line mentions `marker` or whose root directory is
    under it (shims carry `-address <socket>`; a pause process's root is its rootfs)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            root = os.readlink(f"/proc/{entry}/root")
        except OSError:
            continue  # gone, or a zombie
        if marker in cmdline or root.startswith(marker):
            pids.append(int(entry))
    return pids


def machine_state() -> dict[str, Any]:
    """What a lab must leave as it found: the machine's interfaces and forwarding, and
    what a lab could create outside its dir (network namespaces, the fixed paths
    containerd 1.6 writes to, cgroups); other tests' namespaces and cgroups are left out."""

    def walk(path: Path) -> list[str]:
        return sorted(str(Path(dp) / n) for dp, dns, fns in os.walk(path) for n in [*dns, *fns])

    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30
    ).stdout
    return {
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "links": sorted(line.split(":")[1].strip() for line in links.splitlines()),
        "netns": sorted(n for n in _listdir(NETNS_DIR) if n.startswith(("ipw-ctrd-", "cni-"))),
        "run_containerd": RUN_CONTAINERD.exists() and walk(RUN_CONTAINERD),
        "cni_cache": CNI_CACHE_DIR.exists() and walk(CNI_CACHE_DIR),
        "cgroups": sorted(
            str(d)
            for h in cgroup_hierarchies()
            for d in h.iterdir()
            if d.is_dir() and (d.name.startswith("ipward-lab-") or d.name == K8S_NAMESPACE)
        ),
    }


class ContainerdLab:
    """One containerd in `workdir`, serving CRI on `self.address` (see the module doc).

    `ipam` is the `ipam` section of the network's bridge plugin, e.g.
    `{"type": "ipward", "store": "sqlite:///...", "ranges": [[{"subnet": "10.77.0.0/24"}]]}`
    or `{"type": "ipward", "agentSocket": "/run/...sock", "pool": "pods"}`.
    `ipward_plugin` is the installed plugin executable (what `ipward install-cni` wrote);
    the lab calls it through a wrapper that records every call (`cni_calls`).

    Teardown removes only what is this lab's (found by its socket path, its work dir and
    its sandbox IDs), so two labs may run side by side.
    """

    def __init__(
        self,
        workdir: Path,
        ipward_plugin: Path,
        ipam: Mapping[str, Any],
        network: str = "ipward-cri",
    ) -> None:
        self.workdir = Path(workdir)
        self.ipward_plugin = Path(ipward_plugin)
        self.ipam = dict(ipam)
        self.network = network
        self.tag = uuid.uuid4().hex[:8]
        self.netns_name = f"ipw-ctrd-{self.tag}"
        self.netns_path = NETNS_DIR / self.netns_name
        self.bridge = f"ipwc{self.tag}"
        self.cgroup_parent = f"/ipward-lab-{self.tag}"
        self.address = self.workdir / "containerd.sock"
        self.root = self.workdir / "root"
        self.state = self.workdir / "state"
        self.runc_root = self.workdir / "runc"
        self.cni_bin = self.workdir / "cni-bin"
        self.cni_conf = self.workdir / "cni-conf"
        self.conflist = self.cni_conf / "10-ipward.conflist"
        self.calls_log = self.workdir / "cni-calls.log"
        self.log_path = self.workdir / "containerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: CriClient | None = None
        self.sandbox_ids: set[str] = set()  # every sandbox seen, for teardown
        self.leftovers: list[str] = []  # what teardown could not undo
        self._made_netns = False
        self._existed: dict[Path, bool] = {}
        self._holds_lock = False

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> ContainerdLab:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        missing = missing_requirements()
        if missing:
            raise LabError(
                "a containerd lab needs: " + ", ".join(missing) + " (scripts/setup.sh installs"
                " the packages)"
            )
        machine_lock.acquire()
        self._holds_lock = True
        if not os.access(self.ipward_plugin, os.X_OK):
            raise LabError(f"the ipward plugin {self.ipward_plugin} is not executable")
        if len(f"{self.address}.ttrpc") > 100:
            raise LabError(f"socket path too long for a Unix socket: {self.address}")
        for path in (
            RUN_CONTAINERD / "s",
            RUN_CONTAINERD,
            CNI_CACHE_DIR / "results",
            CNI_CACHE_DIR,
            *(h / K8S_NAMESPACE for h in cgroup_hierarchies()),
        ):
            self._existed[path] = path.exists()

        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            image = build_pause_image(build_pause(self.workdir), self.workdir / "pause-oci.tar")
        except ImageError as e:
            raise LabError(str(e)) from e

        self.cni_bin.mkdir()
        for plugin in ("bridge", "loopback"):
            (self.cni_bin / plugin).symlink_to(CNI_BIN_DIR / plugin)
        wrapper = self.cni_bin / "ipward"
        wrapper.write_text(
            "#!/bin/sh\n"
            "# records the call, then runs the real plugin\n"
            'printf \'%s\\t%s\\t%s\\t%s\\n\' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_IFNAME" '
            f'"$CNI_ARGS" >> {shlex.quote(str(self.calls_log))}\n'
            f'exec {shlex.quote(str(self.ipward_plugin))} "$@"\n'
        )
        wrapper.chmod(0o755)
        self.cni_conf.mkdir()
        self.write_network(self.ipam, wait=False)

        config = self.workdir / "containerd.toml"
        config.write_text(
            containerd_config(
                root=self.root,
                state=self.state,
                address=self.address,
                runc_root=self.runc_root,
                opt_dir=self.workdir / "opt",
                cni_bin=self.cni_bin,
                cni_conf=self.cni_conf,
                runc=_which("runc"),
            )
        )

        _run([_which("ip"), "netns", "add", self.netns_name])
        self._made_netns = True
        _run([_which("ip"), "-n", self.netns_name, "link", "set", "lo", "up"])

        env = {k: v for k, v in os.environ.items() if not k.startswith(("IPWARD_", "CNI_"))}
        env["PATH"] = SYSTEM_PATH
        env["IPWARD_CNI_NOTES"] = str(self.workdir / "cni-notes")  # plugins' notes: design 5.14
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    _which("nsenter"),
                    f"--net={self.netns_path}",
                    _which("containerd"),
                    "--config",
                    str(config),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.client = CriClient(str(self.address), timeout=CALL_TIMEOUT)
        self._wait_ready()
        _run(
            [
                _which("ctr"),
                "--address",
                str(self.address),
                "-n",
                K8S_NAMESPACE,
                "images",
                "import",
                str(image),
            ],
            timeout=60,
        )

    def _wait_ready(self) -> None:
        assert self.client is not None and self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LabError(f"containerd exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status = self.client.status()
                if status.ready("RuntimeReady") and status.ready("NetworkReady"):
                    return
                last = LabError(f"not ready: {status.conditions}")
            except CriError as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED:  # the CRI plugin did not load
                    raise LabError(f"containerd serves no CRI: {e}\n{self.log_tail()}") from e
                last = e
            time.sleep(0.05)
        raise LabError(f"containerd not ready in {START_TIMEOUT:g}s: {last}\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- use ------------------------------------------------------------------------------

    def cri(self) -> CriClient:
        assert self.client is not None, "lab not started"
        return self.client

    def write_network(
        self, ipam: Mapping[str, Any], bridge: str | None = None, wait: bool = True
    ) -> None:
        """Write the conflist in place with this `ipam` (and bridge device: bridge puts
        one gateway address per family on it and refuses a second); with `wait`, until
        containerd has loaded it (its verbose Status shows the file's text)."""
        if bridge is not None:
            if len(bridge) > 15:
                raise ValueError(f"bridge name longer than 15 characters: {bridge}")
            self.bridge = bridge
        self.ipam = dict(ipam)
        conf = network_config(self.network, self.bridge, self.ipam)
        with open(self.conflist, "w") as f:  # in place: a file renamed in is not seen
            f.write(json.dumps(conf, indent=2))
        if not wait:
            return
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.loaded_network() == conf:
                return
            time.sleep(0.05)
        raise LabError(f"containerd did not load the new CNI config:\n{self.log_tail()}")

    def loaded_network(self) -> dict[str, Any] | None:
        """The conflist containerd has loaded for our network, as JSON."""
        loaded = json.loads(self.cri().status(verbose=True).info.get("cniconfig", "{}"))
        for net in loaded.get("Networks") or []:
            source = (net.get("Config") or {}).get("Source", "")
            if source:
                conf = json.loads(source)
                if conf.get("name") == self.network:
                    return dict(conf)
        return None

    def run_pod(
        self, name: str, namespace: str = "default", uid: str | None = None, **kw: Any
    ) -> str:
        """RunPodSandbox with the lab's cgroup parent and a log dir; the sandbox ID."""
        uid = uid or str(uuid.uuid4())
        kw.setdefault("cgroup_parent", self.cgroup_parent)
        kw.setdefault("log_directory", str(self.workdir / "pods" / f"{namespace}_{name}_{uid}"))
        kw.setdefault("timeout", CALL_TIMEOUT)
        sandbox_id = self.cri().run_pod_sandbox(name=name, namespace=namespace, uid=uid, **kw)
        self.sandbox_ids.add(sandbox_id)
        return sandbox_id

    def remove_pod(self, sandbox_id: str) -> None:
        """StopPodSandbox then RemovePodSandbox, as the kubelet does."""
        self.cri().stop_pod_sandbox(sandbox_id, timeout=CALL_TIMEOUT)
        self.cri().remove_pod_sandbox(sandbox_id, timeout=CALL_TIMEOUT)

    def sandbox_info(self, sandbox_id: str) -> dict[str, Any]:
        """containerd's verbose status "info" of a sandbox: pid, runtimeSpec, ..."""
        info = self.cri().pod_sandbox_status(sandbox_id, verbose=True).info
        return dict(json.loads(info["info"]))

    def sandbox_netns(self, sandbox_id: str) -> str:
        """The path of the sandbox's network namespace (under the state dir)."""
        for ns in self.sandbox_info(sandbox_id)["runtimeSpec"]["linux"]["namespaces"]:
            if ns["type"] == "network":
                return str(ns["path"])
        raise LabError(f"sandbox {sandbox_id} has no network namespace path")

    def in_sandbox(
        self, sandbox_id: str, *args: str, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a host binary in the sandbox's network namespace."""
        return subprocess.run(
            [_which("nsenter"), f"--net={self.sandbox_netns(sandbox_id)}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def in_host(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a host binary in containerd's network namespace (the bridge's)."""
        return subprocess.run(
            [_which("nsenter"), f"--net={self.netns_path}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def cni_calls(self, container: str | None = None) -> list[dict[str, str]]:
        """Every call of the ipward plugin so far, in order: command, container, ifname,
        args (CNI_ARGS); only `container`'s if given."""
        try:
            lines = self.calls_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        calls = [
            dict(zip(("command", "container", "ifname", "args"), line.split("\t"), strict=True))
            for line in lines
        ]
        return [c for c in calls if container is None or c["container"] == container]

    # -- teardown ------------------------------------------------------------------------

    def stop(self) -> None:
        """Undo everything; never raises. What could not be undone is in `leftovers`."""
        self.leftovers = []
        steps = (
            self._remove_sandboxes,
            self._stop_containerd,
            self._kill_containers_and_shims,
            self._unmount_all,
            self._delete_netns,
            self._remove_shim_sockets,
            self._remove_cni_results,
            self._remove_cgroups,
        )
        for step in steps:
            try:
                step()
            except Exception as e:  # one failed step must not stop the others
                self.leftovers.append(f"{step.__name__}: {e!r}")
        if self._holds_lock:
            self._holds_lock = False
            machine_lock.release()

    def _known_sandbox_ids(self) -> set[str]:
        ids = set(self.sandbox_ids)
        for d in (
            self.root / "io.containerd.grpc.v1.cri" / "sandboxes",
            self.state / "io.containerd.grpc.v1.cri" / "sandboxes",
            self.state / "io.containerd.runtime.v2.task" / K8S_NAMESPACE,
            self.runc_root / K8S_NAMESPACE,
        ):
            ids |= _listdir(d)
        return ids

    def _remove_sandboxes(self) -> None:
        if self.client is None:
            return
        if self.proc is not None and self.proc.poll() is None:
            try:
                sandboxes = self.client.list_pod_sandboxes()
            except CriError as e:
                sandboxes = []
                self.leftovers.append(f"listing sandboxes: {e}")
            for sandbox in sandboxes:
                self.sandbox_ids.add(sandbox.id)
                try:
                    self.remove_pod(sandbox.id)
                except CriError as e:
                    self.leftovers.append(f"sandbox {sandbox.id}: {e}")
        self.client.close()
        self.client = None

    def _stop_containerd(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def _kill_containers_and_shims(self) -> None:
        runc_root = self.runc_root / K8S_NAMESPACE
        runc = which("runc")
        if runc:
            for cid in _listdir(runc_root):
                for args in (["kill", "--all", cid, "KILL"], ["delete", "--force", cid]):
                    with contextlib.suppress(subprocess.SubprocessError, OSError):
                        subprocess.run(
                            [runc, "--root", str(runc_root), *args],
                            capture_output=True,
                            timeout=30,
                        )
        marker = f"{self.workdir}/"
        for _ in range(50):
            pids = _pids_referring_to(marker)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.leftovers.append(f"processes still running: {_pids_referring_to(marker)}")

    def _unmount_all(self) -> None:
        """Rootfs overlays, sandbox shm, and the sandboxes' network namespaces (mounted
        under the state dir: `netns_mounts_under_state_dir`)."""
        for point in mounts_under(self.workdir):
            proc = subprocess.run(
                ["umount", "--lazy", point], capture_output=True, text=True, timeout=30
            )
            if proc.returncode != 0:
                self.leftovers.append(f"umount {point}: {proc.stderr.strip()}")

    def _delete_netns(self) -> None:
        if not self._made_netns:
            return
        proc = subprocess.run(
            ["ip", "netns", "delete", self.netns_name], capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0 and self.netns_path.exists():
            self.leftovers.append(f"ip netns delete {self.netns_name}: {proc.stderr.strip()}")
        self._made_netns = False

    def _remove_if_made(self, *dirs: Path) -> None:
        """rmdir each dir (children first) that did not exist before and is now empty."""
        for d in dirs:
            if not self._existed.get(d, True):
                with contextlib.suppress(OSError):
                    d.rmdir()

    def _remove_shim_sockets(self) -> None:
        """containerd 1.6 puts shim sockets in /run/containerd/s, whatever its state dir:
        sha256 of "<containerd address>/<namespace>/<id>"."""
        for sandbox_id in self._known_sandbox_ids():
            key = f"{self.address}/{K8S_NAMESPACE}/{sandbox_id}".encode()
            with contextlib.suppress(FileNotFoundError):
                (RUN_CONTAINERD / "s" / hashlib.sha256(key).hexdigest()).unlink()
        self._remove_if_made(RUN_CONTAINERD / "s", RUN_CONTAINERD)

    def _remove_cni_results(self) -> None:
        """libcni's cache, /var/lib/cni/results/<network>-<sandbox id>-<ifname>."""
        ids = self._known_sandbox_ids()
        results = CNI_CACHE_DIR / "results"
        for name in _listdir(results):
            if any(f"-{sandbox_id}-" in name for sandbox_id in ids):
                with contextlib.suppress(FileNotFoundError):
                    (results / name).unlink()
        self._remove_if_made(results, CNI_CACHE_DIR)

    def _remove_cgroups(self) -> None:
        """The lab's cgroup parent, and sandboxes' cgroups made under the runtime's
        default parent (/k8s.io/<id>) by a RunPodSandbox without one."""
        ids = self._known_sandbox_ids()
        for hierarchy in cgroup_hierarchies():
            tops = [hierarchy / self.cgroup_parent.strip("/")]
            tops += [hierarchy / K8S_NAMESPACE / i for i in ids]
            for top in tops:
                if not top.is_dir():
                    continue
                # cgroup directories go with rmdir, children first
                for d in sorted(
                    (Path(dp) for dp, _, _ in os.walk(top)),
                    key=lambda p: len(p.parts),
                    reverse=True,
                ):
                    try:
                        d.rmdir()
                    except OSError as e:
                        self.leftovers.append(f"cgroup {d}: {e}")
            self._remove_if_made(hierarchy / K8S_NAMESPACE)


@contextlib.contextmanager
def containerd_lab(
    workdir: Path, ipward_plugin: Path, ipam: Mapping[str, Any], network: str = "ipward-cri"
) -> Iterator[ContainerdLab]:
    with ContainerdLab(workdir, ipward_plugin, ipam, network) as lab:
        yield lab
