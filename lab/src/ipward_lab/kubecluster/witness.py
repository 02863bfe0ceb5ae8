"""What holds which address in a cluster lab, seen from below: every network namespace
the nodes' runtimes made, read continuously.

An address is held where it is configured on an interface, not where an API or a ledger
says: a sandbox whose teardown has not finished (stopped, or its pod force-deleted) still
holds its address in its network namespace, on its node's bridge. `NetnsScanner` reads
the IPv4 addresses of every namespace one node's containerd made (its netns directory,
`netns_mounts_under_state_dir`), from a small process in the node's mount namespace
that answers one scan per request in a millisecond or two. `AddressWitness` scans every
node in a thread, every few tens of milliseconds, and keeps for each (node, namespace,
address) the spans it was certainly held; two namespaces whose spans for one address
overlap held it at the same time.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipward_lab.kubecluster.processes import OBSERVER_MARK

if TYPE_CHECKING:
    from ipward_lab.kubecluster.layout import Node
    from ipward_lab.kubecluster.state import ClusterState

NETNS_DIR = "/run/containerd/io.containerd.grpc.v1.cri/netns"  # in a node's mount namespace

# Run by the node's /usr/bin/python3 in its mount namespace: for each line read, one
# JSON line {netns file: {ifname: IPv4}} of every namespace in NETNS_DIR (a file that is
# no longer a namespace, unmounted by the runtime meanwhile, is skipped).
SCAN_SCRIPT = r"""
import ctypes, fcntl, json, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
SIOCGIFADDR = 0x8915
NETNS_DIR = sys.argv[1]
home = os.open("/proc/self/ns/net", os.O_RDONLY)

def addresses():
    found = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            if name == "lo":
                continue
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(answer[20:24])
    finally:
        s.close()
    return found

for _ in sys.stdin:
    scan = {}
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        names = []
    for name in names:
        try:
            fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            if libc.setns(fd, CLONE_NEWNET) == 0:
                scan[name] = addresses()
        finally:
            os.close(fd)
            libc.setns(home, CLONE_NEWNET)
    sys.stdout.write(json.dumps(scan) + "\n")
    sys.stdout.flush()
"""


class NetnsScanner:
    """The addresses of every network namespace of one node's runtime, on request. Its
    process carries OBSERVER_MARK: a node's power off spares it."""

    def __init__(self, lab: ClusterState, node: Node) -> None:
        self.lab = lab
        self.node = node
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        self.proc = subprocess.Popen(
            [
                "nsenter", f"--mount={self.node.mntns}",
                "/usr/bin/python3", "-I", "-S", "-c", SCAN_SCRIPT, NETNS_DIR, OBSERVER_MARK,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        return self.proc

    def scan(self) -> dict[str, dict[str, str]]:
        """{namespace file name: {interface: IPv4}}; a scanner that died (a node powered
        off kills every process of its mount namespace) is started again."""
        for _ in range(2):
            proc = self.proc if self.proc and self.proc.poll() is None else self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if line:
                scan: dict[str, dict[str, str]] = json.loads(line)
                return scan
            self.close()
        raise RuntimeError(f"{self.node.name}: the namespace scanner does not answer")

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@dataclass
class Span:
    """One namespace's interface holding one address: seen from `first` to `last`
    (monotonic), held for certain from `held_from` (the first scan's end) to `held_to`
    (the last scan's start)."""

    node: str
    netns: str
    ifname: str
    ip: str
    held_from: float
    held_to: float
    scans: int = 1

    def overlaps(self, other: Span) -> bool:
        return (
            self.scans > 1
            and other.scans > 1
            and self.held_from <= other.held_to
            and other.held_from <= self.held_to
        )

    def __str__(self) -> str:
        return (
            f"{self.ip} on {self.node}'s {self.netns} {self.ifname}"
            f" ({self.held_to - self.held_from:.3f}s, {self.scans} scans)"
        )


class AddressWitness:
    """Every node's namespaces scanned in a thread until `stop()`; `doubles()` lists the
    addresses two namespaces held at the same time, `held()` what the last scans saw."""

    def __init__(self, lab: ClusterState, interval: float = 0.02) -> None:
        self.lab = lab
        self.interval = interval
        self.scanners = [NetnsScanner(lab, n) for n in lab.nodes]
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.open: dict[tuple[str, str, str, str], Span] = {}  # still held at the last scan
        self.scans = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="address-witness", daemon=True)

    def start(self) -> AddressWitness:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)
        for scanner in self.scanners:
            scanner.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for scanner in self.scanners:
                started = time.monotonic()
                try:
                    scan = scanner.scan()
                except (RuntimeError, OSError, ValueError) as e:
                    self.errors.append(str(e))
                    continue
                self._record(scanner.node.name, scan, started, time.monotonic())
            self._stop.wait(self.interval)

    def _record(
        self, node: str, scan: dict[str, dict[str, str]], started: float, ended: float
    ) -> None:
        seen = {
            (node, netns, ifname, ip)
            for netns, interfaces in scan.items()
            for ifname, ip in interfaces.items()
        }
        with self.lock:
            self.scans += 1
            for key in [k for k in self.open if k[0] == node and k not in seen]:
                del self.open[key]
            for key in seen:
                span = self.open.get(key)
                if span is None:
                    span = Span(*key, held_from=ended, held_to=started)
                    self.open[key] = span
                    self.spans.append(span)
                else:
                    span.held_to = started
                    span.scans += 1

    def held(self) -> dict[str, list[Span]]:
        """The addresses the latest scan of each node saw, with the namespaces holding
        them."""
        with self.lock:
            out: dict[str, list[Span]] = {}
            for span in self.open.values():
                out.setdefault(span.ip, []).append(span)
            return out

    def held_during(self, start: float, end: float) -> dict[str, list[Span]]:
        """The addresses held for certain from `start` to `end` (monotonic), with the
        namespaces holding them: scans before `start` and after `end` saw them."""
        with self.lock:
            out: dict[str, list[Span]] = {}
            for span in self.spans:
                if span.held_from <= start and span.held_to >= end:
                    out.setdefault(span.ip, []).append(span)
            return out

    def doubles(self) -> list[tuple[Span, Span]]:
        """Pairs of namespaces that held one address at the same time."""
        with self.lock:
            by_ip: dict[str, list[Span]] = {}
            for span in self.spans:
                by_ip.setdefault(span.ip, []).append(span)
        found = []
        for spans in by_ip.values():
            for i, a in enumerate(spans):
                for b in spans[i + 1 :]:
                    if (a.node, a.netns) != (b.node, b.netns) and a.overlaps(b):
                        found.append((a, b))
        return found

    def wait_scans(self, count: int = 2, timeout: float = 30.0) -> None:
        """Until `count` more rounds of scans are done (what changed before is seen)."""
        target = self.scans + count * len(self.scanners)
        deadline = time.monotonic() + timeout
        while self.scans < target:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the address witness is stuck: {self.errors[-3:]}")
            time.sleep(self.interval)
