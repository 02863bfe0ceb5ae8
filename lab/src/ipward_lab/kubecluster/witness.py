"""What holds which address in a cluster lab, seen from below: every network namespace
the nodes' runtimes made, read continuously.

An address is held where it is configured on an interface, not where an API or a ledger
says: a sandbox whose teardown has not finished (stopped, or its pod force-deleted) still
holds its address in its network namespace, on its node's bridge. `NetnsScanner` reads
the addresses (IPv4 and IPv6, of global scope) of every namespace one node's containerd
made, from this process and nothing of the node's but its kernel: a holder (the lab's
static `pause`, carrying OBSERVER_MARK) sits in the node's mount namespace, where the
namespaces are mounted (`NETNS_DIR`); the scan lists them in the holder's mount table,
opens each through the holder's root (`/proc/PID/root`), and joins only its network
namespace (`setns` of the scanning thread) to read its addresses by rtnetlink. No
program of the node runs, so it works on a node without Python or a shell.

`AddressWitness` scans every node in a thread, every few tens of milliseconds, and keeps
for each (node, namespace, interface, address) the spans it was certainly held; two
namespaces whose spans for one address overlap held it at the same time. It counts each
node's scans and keeps every failure (a namespace going away mid-scan is none), so that
a story can require every node seen all through it (`wait_scans`, `failures_since`).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipward_lab.kubecluster.netns import enter
from ipward_lab.kubecluster.processes import OBSERVER_MARK

if TYPE_CHECKING:
    from ipward_lab.kubecluster.layout import Node
    from ipward_lab.kubecluster.state import ClusterState

NETNS_DIR = "/run/containerd/io.containerd.grpc.v1.cri/netns"  # in a node's mount namespace

# rtnetlink (linux/netlink.h, linux/rtnetlink.h, linux/if_addr.h)
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port
IFADDRMSG = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
RTATTR = struct.Struct("=HH")  # length, type
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWADDR, RTM_GETADDR = 20, 22
IFA_ADDRESS, IFA_LOCAL = 1, 2
RT_SCOPE_UNIVERSE = 0  # not link (fe80::) nor host (loopback) scope


def _align(n: int) -> int:
    return (n + 3) & ~3


def interface_addresses() -> set[tuple[str, str]]:
    """(interface, address) of every address of global scope but the loopback's, in the
    network namespace of the calling thread (its netlink socket is made there)."""
    request = NLMSG_HEADER.pack(
        NLMSG_HEADER.size + IFADDRMSG.size, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
    ) + IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
    found: list[tuple[int, str]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.send(request)
        done = False
        while not done:
            data = s.recv(1 << 16)
            offset = 0
            while offset + NLMSG_HEADER.size <= len(data):
                length, kind = NLMSG_HEADER.unpack_from(data, offset)[:2]
                body = offset + NLMSG_HEADER.size
                if kind == NLMSG_DONE:
                    done = True
                    break
                if kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, body)
                    raise OSError(-code, f"rtnetlink address dump: {os.strerror(-code)}")
                if kind == RTM_NEWADDR:
                    found += _address(data, body, offset + length)
                offset += _align(length)
    out = set()
    for index, address in found:
        try:
            name = socket.if_indextoname(index)
        except OSError:
            continue  # the interface went away meanwhile
        if name != "lo":
            out.add((name, address))
    return out


def _address(data: bytes, start: int, end: int) -> list[tuple[int, str]]:
    """The (interface index, address) of one RTM_NEWADDR message, when of global scope."""
    family, _, _, scope, index = IFADDRMSG.unpack_from(data, start)
    if scope != RT_SCOPE_UNIVERSE or family not in (socket.AF_INET, socket.AF_INET6):
        return []
    attrs: dict[int, bytes] = {}
    at = start + IFADDRMSG.size
    while at + RTATTR.size <= end:
        length, kind = RTATTR.unpack_from(data, at)
        if length < RTATTR.size:
            break
        attrs[kind] = data[at + RTATTR.size : at + length]
        at += _align(length)
    # IFA_LOCAL is an IPv4 interface's own address (IFA_ADDRESS its peer's, on a
    # point-to-point link); IPv6 has IFA_ADDRESS only.
    raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
    return [(index, socket.inet_ntop(family, raw))] if raw else []


def netns_mounts(mountinfo: str) -> Iterator[str]:
    """The mount points of network namespaces (nsfs) in NETNS_DIR, in a mount table."""
    for line in mountinfo.splitlines():
        fields = line.split()
        separator = fields.index("-")
        point = fields[4].replace("\\040", " ")
        if fields[separator + 1] == "nsfs" and point.startswith(f"{NETNS_DIR}/"):
            yield point


class ScanError(RuntimeError):
    """A node's namespaces could not be read (not: one went away mid-scan); the
    message does not name the node (`Failure` does)."""


class NetnsScanner:
    """The addresses of every network namespace of one node's runtime, on request, read
    through a holder in the node's mount namespace (the lab's static `pause`: no program
    of the node). The holder carries OBSERVER_MARK: a node's power off spares it."""

    def __init__(self, lab: ClusterState, node: Node) -> None:
        self.lab = lab
        self.node = node
        self.holder: subprocess.Popen[bytes] | None = None

    def _holder_pid(self) -> int:
        if self.holder is None or self.holder.poll() is not None:
            if self.holder is not None:
                self.holder = None
                raise ScanError("the holder in its mount namespace exited")
            self.holder = subprocess.Popen(
                [
                    "nsenter", f"--mount={self.node.mntns}",
                    str(self.lab.test_images / "pause"), OBSERVER_MARK,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return self.holder.pid

    def scan(self, home: int) -> set[tuple[str, str, str]]:
        """(namespace file name, interface, address) of every namespace of the node's
        runtime; the calling thread back in the namespace of `home` (an open file) after
        each. A namespace unmounted meanwhile is skipped; any other failure is a
        ScanError."""
        pid = self._holder_pid()
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                mountinfo = f.read()
        except OSError as e:
            raise ScanError(f"its mount table: {e}") from e
        if not mountinfo:  # the holder exited as it was read
            raise ScanError("its mount table read empty")
        found = set()
        for point in netns_mounts(mountinfo):
            try:
                fd = os.open(f"/proc/{pid}/root{point}", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # unmounted and removed since the table was read
            except OSError as e:
                raise ScanError(f"{point}: {e}") from e
            try:
                try:
                    enter(fd, point)
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        continue  # unmounted since: the file is no namespace any more
                    raise ScanError(str(e)) from e
                try:
                    addresses = interface_addresses()
                except OSError as e:
                    raise ScanError(f"{point}: {e}") from e
                finally:
                    enter(home, "the witness's own namespace")  # must not fail: raises
            finally:
                os.close(fd)
            name = point.rsplit("/", 1)[1]
            found |= {(name, ifname, ip) for ifname, ip in addresses}
        return found

    def close(self) -> None:
        if self.holder is not None:
            self.holder.terminate()
            try:
                self.holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
            self.holder = None


@dataclass
class Span:
    """One namespace's interface holding one address: held for certain from `held_from`
    (the end of the first scan that saw it) to `held_to` (the start of the last),
    monotonic."""

    node: str
    netns: str
    ifname: str
    ip: str
    held_from: float
    held_to: float
    scans: int = 1

    def overlap(self, other: Span) -> tuple[float, float] | None:
        """When both held the address for certain (each seen by two scans at least)."""
        start, end = max(self.held_from, other.held_from), min(self.held_to, other.held_to)
        if self.scans > 1 and other.scans > 1 and start <= end:
            return start, end
        return None

    def __str__(self) -> str:
        return (
            f"{self.ip} on {self.node}'s {self.netns} {self.ifname}"
            f" ({self.held_to - self.held_from:.3f}s, {self.scans} scans)"
        )


@dataclass(frozen=True)
class Failure:
    at: float  # monotonic
    node: str
    text: str

    def __str__(self) -> str:
        return f"{self.node}: {self.text}"


class AddressWitness:
    """Every node's namespaces scanned in a thread until `stop()`: `doubles()` lists the
    addresses two namespaces held at the same time, `held()` what the last scans saw;
    `scans` counts each node's scans, `failures` what went wrong."""

    def __init__(self, lab: ClusterState, interval: float = 0.02) -> None:
        self.lab = lab
        self.interval = interval
        self.scanners = [NetnsScanner(lab, n) for n in lab.nodes]
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.open: dict[tuple[str, str, str, str], Span] = {}  # still held at the last scan
        self.scans = {n.name: 0 for n in lab.nodes}
        self.failures: list[Failure] = []
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

    def _fail(self, node: str, text: str) -> None:
        with self.lock:
            self.failures.append(Failure(time.monotonic(), node, text))

    def _run(self) -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            while not self._stop.is_set():
                for scanner in self.scanners:
                    started = time.monotonic()
                    try:
                        scan = scanner.scan(home)
                    except ScanError as e:
                        self._fail(scanner.node.name, str(e))
                        continue
                    self._record(scanner.node.name, scan, started, time.monotonic())
                self._stop.wait(self.interval)
        except Exception as e:  # the thread ends; every wait on it says why
            self._fail("witness", f"stopped: {type(e).__name__}: {e}")
        finally:
            os.close(home)

    def _record(
        self, node: str, scan: set[tuple[str, str, str]], started: float, ended: float
    ) -> None:
        seen = {(node, *entry) for entry in scan}
        with self.lock:
            self.scans[node] += 1
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

    def doubles(self, since: float = 0.0) -> list[tuple[Span, Span]]:
        """Pairs of namespaces that held one address at the same time, at `since`
        (monotonic) or after."""
        with self.lock:
            by_ip: dict[str, list[Span]] = {}
            for span in self.spans:
                if span.held_to >= since:
                    by_ip.setdefault(span.ip, []).append(span)
        found = []
        for spans in by_ip.values():
            for i, a in enumerate(spans):
                for b in spans[i + 1 :]:
                    both = a.overlap(b)
                    if (a.node, a.netns) != (b.node, b.netns) and both and both[1] >= since:
                        found.append((a, b))
        return found

    def failures_since(self, since: float) -> list[Failure]:
        with self.lock:
            return [f for f in self.failures if f.at >= since]

    def wait_scans(self, count: int = 2, timeout: float = 30.0) -> None:
        """Until every node's scans have counted `count` more (what changed before is
        seen on every node); AssertionError naming the nodes whose scans did not, with
        the witness's last failures."""
        with self.lock:
            target = {node: n + count for node, n in self.scans.items()}
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                behind = sorted(node for node, n in target.items() if self.scans[node] < n)
            if not behind:
                return
            if time.monotonic() > deadline or not self.thread.is_alive():
                with self.lock:
                    last = [str(f) for f in self.failures[-3:]]
                raise AssertionError(f"the address witness no longer scans {behind}: {last}")
            time.sleep(self.interval)
