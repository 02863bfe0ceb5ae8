"""`ipward bench --kube`: pod start on a real cluster on this machine
(`ipward_lab.kubecluster`, 3 nodes), under host-local and under ipward in the same run.

The bench makes a cluster of its own in a temporary state dir, deploys ipward as a user
gets it (`deploy/base` and an IPPool: the k8s:// store, no tuning), and measures both on
the same nodes, switching the pod network's IPAM between them (host-local: each node on
its own range; the switch waits until every node's containerd has the new conflist
loaded): the pod start interleaved, RUNS runs of each (host-local, ipward, host-local,
ipward: one run's noise does not decide), then the StatefulSet rounds of each. The
cluster is removed at the end, also on failure or Ctrl-C. It holds the machine's
containerd lock all along (the `kube` tests and the containerd labs take turns on it).

For each IPAM, in a namespace of its own:
- pod start: one Deployment of N pods (default 100), applied at t0; the namespace's pods
  read every 0.25 s, each pod's time to Running (`workloads.is_running`) and when
  all were Running; the CNI ADD of each sandbox timed from its node's containerd log
  (at debug level it logs "begin cni setup" right before the ADD and "cni result" right
  after one that succeeded; a sandbox that began and has no result failed its ADD, and
  the kubelet made another). Then the Deployment's namespace is deleted and, under
  ipward, waited for until no address is recorded for it;
- StatefulSet rounds: 5 pods (Parallel), then each round scaled to 0 until none is left
  and to 5 until 5 are Running: the round's seconds, and whether every ordinal came back
  with the address it had first (ipward's sticky addresses; host-local hands out the
  next ones)."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ipward_lab.bench.common import BenchError, machine, percentile, print_table, version_of
from ipward_lab.containerd.lab import machine_lock
from ipward_lab.kubecluster.cluster import Cluster, cluster
from ipward_lab.kubecluster.common import ClusterError, wait_for
from ipward_lab.kubecluster.prerequisites import find_binaries, unavailable_reason
from ipward_lab.kubecluster.workloads import (
    addresses,
    deployment,
    is_running,
    manifest,
    pod_state,
    statefulset,
)

NODES = 3
STS_REPLICAS = 5
POLL_SECONDS = 0.25
START_TIMEOUT = 600.0
ROUND_TIMEOUT = 180.0
GONE_TIMEOUT = 300.0
IPAMS = ("host-local", "ipward")
RUNS = 2  # pod start runs of each IPAM, interleaved
START_APP = "start"
STS_APP = "sts"

# A logrus text line: key=value, the value quoted (Go escapes) when it has spaces.
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')
_SANDBOX_NAME = re.compile(r'generated id for sandbox name "(.*)"')
_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")


def log_fields(line: str) -> dict[str, str]:
    """The fields of one of containerd's log lines, values unquoted."""
    fields = {}
    for key, value in _FIELD.findall(line):
        if value.startswith('"'):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        fields[key] = value
    return fields


def log_time(text: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 time with nanoseconds (Go's
    RFC3339Nano, trailing zeros trimmed): exact, as a float of seconds would not be."""
    match = _TIME.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    whole, fraction, zone = match.groups()
    at = datetime.datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return int(at.timestamp()) * 10**9 + int((fraction or "0").ljust(9, "0")[:9])


@dataclass(frozen=True)
class CniAdd:
    """One sandbox's CNI ADD as its node's containerd logged it; `ended` None: it
    failed (no result logged)."""

    sandbox: str
    pod: str
    began: int  # ns since the epoch
    ended: int | None

    @property
    def seconds(self) -> float:
        if self.ended is None:
            raise ValueError(f"the ADD of {self.sandbox} failed")
        return (self.ended - self.began) / 1e9


def cni_adds(lines: Iterable[str], namespace: str) -> list[CniAdd]:
    """The CNI ADDs of the sandboxes of pods of `namespace` in containerd's debug log:
    a sandbox's namespace from "generated id for sandbox name" (NAME_NAMESPACE_UID_
    ATTEMPT), its ADD from "begin cni setup" to "cni result". Failed ADDs are included
    (the kubelet gave up their sandbox: no result, ever)."""
    pods: dict[str, str] = {}
    began: dict[str, int] = {}
    ended: dict[str, int] = {}
    for line in lines:
        if "podsandboxid=" not in line:
            continue
        fields = log_fields(line)
        sandbox, msg = fields.get("podsandboxid", ""), fields.get("msg", "")
        if msg == "begin cni setup":
            began[sandbox] = log_time(fields["time"])
        elif msg.startswith("cni result: "):
            ended[sandbox] = log_time(fields["time"])
        elif named := _SANDBOX_NAME.fullmatch(msg):
            parts = named.group(1).rsplit("_", 3)  # pod and namespace names have no "_"
            if len(parts) == 4 and parts[1] == namespace:
                pods[sandbox] = parts[0]
    return sorted(
        (CniAdd(s, pods[s], t, ended.get(s)) for s, t in began.items() if s in pods),
        key=lambda add: add.began,
    )


@dataclass(frozen=True)
class PodStart:
    all_running: float  # seconds from t0 until the last was seen Running
    running: list[float]  # each pod's seconds from t0 until it was first seen Running


def pod_start(
    readings: Iterable[tuple[float, list[dict[str, Any]]]], count: int
) -> PodStart | None:
    """From the pods read over time (seconds since t0, the pods then), when `count` of
    them were first Running together, and when each of those was first seen Running;
    None when the readings end before."""
    first: dict[str, float] = {}
    for at, pods in readings:
        running = [p["metadata"]["uid"] for p in pods if is_running(p)]
        for uid in running:
            first.setdefault(uid, at)
        if len(running) >= count:
            return PodStart(at, sorted(first[uid] for uid in running))
    return None


@dataclass
class Round:
    seconds: float  # scaled to 0 until none was left, then to 5 until 5 were Running
    down_seconds: float
    kept: bool  # every ordinal with the address it had first


@dataclass
class IpamFigures:
    """What one IPAM measured: the pod start over its runs (all Running: their median;
    each pod's time and each ADD: pooled), the StatefulSet rounds."""

    pods: int
    runs: int
    all_running_s: float
    pod_running_p50_s: float
    pod_running_p99_s: float
    cni_adds: int  # succeeded, of the Deployment's pods
    cni_adds_failed: int
    cni_add_p50_ms: float
    cni_add_p99_ms: float
    rounds: list[Round] = field(default_factory=list)
    sts_cni_adds_failed: int = 0

    @property
    def kept(self) -> int:
        return sum(r.kept for r in self.rounds)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.rounds:
            seconds = [r.seconds for r in self.rounds]
            out["sts_round_p50_s"] = percentile(seconds, 50)
            out["sts_round_max_s"] = max(seconds)
            out["sts_addresses_kept"] = self.kept
        return out


def start_figures(starts: list[PodStart], adds: list[CniAdd]) -> IpamFigures:
    """The pod start part's figures from its runs' times and their ADDs."""
    done = [a.seconds for a in adds if a.ended is not None]
    if not done:
        raise BenchError("no CNI ADD of the Deployment's pods found in containerd's log")
    running = [t for start in starts for t in start.running]
    return IpamFigures(
        pods=len(starts[0].running),
        runs=len(starts),
        all_running_s=percentile([start.all_running for start in starts], 50),
        pod_running_p50_s=percentile(running, 50),
        pod_running_p99_s=percentile(running, 99),
        cni_adds=len(done),
        cni_adds_failed=sum(a.ended is None for a in adds),
        cni_add_p50_ms=percentile(done, 50) * 1000,
        cni_add_p99_ms=percentile(done, 99) * 1000,
    )


def _ratio(ipward: float, host_local: float) -> str:
    return f"{ipward / host_local:.2f}x" if host_local > 0 else "-"


def ratios(host_local: dict[str, Any], ipward: dict[str, Any]) -> dict[str, float]:
    """ipward/host-local of every time (`*_s`, `*_ms`) of their `to_json`s."""
    return {
        key: ipward[key] / value
        for key, value in host_local.items()
        if key.endswith(("_s", "_ms")) and isinstance(value, float) and value > 0
    }


def table(figures: dict[str, IpamFigures]) -> list[list[str]]:
    """figure | host-local | ipward | ipward/host-local."""
    hl, iw = figures["host-local"], figures["ipward"]
    rows = [["", "host-local", "ipward", "ipward/host-local"]]

    def row(label: str, a: float, b: float, fmt: str) -> None:
        rows.append([label, format(a, fmt), format(b, fmt), _ratio(b, a)])

    row(
        f"{hl.pods} pods at once, {hl.runs} runs: all Running p50 (s)",
        hl.all_running_s,
        iw.all_running_s,
        ".1f",
    )
    row("  pod to Running p50 (s)", hl.pod_running_p50_s, iw.pod_running_p50_s, ".1f")
    row("  pod to Running p99 (s)", hl.pod_running_p99_s, iw.pod_running_p99_s, ".1f")
    row("  CNI ADD p50 (ms)", hl.cni_add_p50_ms, iw.cni_add_p50_ms, ".0f")
    row("  CNI ADD p99 (ms)", hl.cni_add_p99_ms, iw.cni_add_p99_ms, ".0f")
    rows.append(
        ["  CNI ADDs failed (retried)", str(hl.cni_adds_failed), str(iw.cni_adds_failed), ""]
    )
    if hl.rounds and iw.rounds:
        n = len(hl.rounds)
        a, b = [[r.seconds for r in f.rounds] for f in (hl, iw)]
        row(
            f"StatefulSet {STS_REPLICAS}->0->{STS_REPLICAS}, {n} rounds: p50 (s)",
            percentile(a, 50),
            percentile(b, 50),
            ".1f",
        )
        row("  round max (s)", max(a), max(b), ".1f")
        rows.append(
            ["  addresses kept (rounds)", f"{hl.kept}/{n}", f"{iw.kept}/{len(iw.rounds)}", ""]
        )
        rows.append(
            [
                "  CNI ADDs failed (retried)",
                str(hl.sts_cni_adds_failed),
                str(iw.sts_cni_adds_failed),
                "",
            ]
        )
    return rows


# -- on the cluster ----------------------------------------------------------------------


class _Part:
    """One part of the bench in its own namespace of the cluster."""

    def __init__(self, lab: Cluster, namespace: str, say: Callable[[str], object]) -> None:
        self.lab = lab
        self.ns = namespace
        self.say = say

    def create(self) -> None:
        self.lab.make_namespace(self.ns)

    def kubectl(self, *args: str, check: bool = True, input: str = "") -> Any:
        return self.lab.kubectl(f"--namespace={self.ns}", *args, check=check, input=input)

    def apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "--filename=-", input=json.dumps(manifest(*objects)))

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.lab.api(f"/api/v1/namespaces/{self.ns}/pods")["items"]
        return items

    def readings(self, t0: float, timeout: float) -> Iterator[tuple[float, list[dict[str, Any]]]]:
        """The namespace's pods every POLL_SECONDS, with the seconds since `t0` at which
        they were read, until `timeout` seconds after t0."""
        while True:
            pods = self.pods()
            at = time.monotonic() - t0
            yield at, pods
            if at > timeout:
                return
            time.sleep(POLL_SECONDS)

    def wait_running(self, count: int, timeout: float) -> dict[str, dict[str, Any]]:
        """`count` pods Running and no other pod; by name."""

        def ready() -> dict[str, dict[str, Any]] | None:
            pods = self.pods()
            running = {p["metadata"]["name"]: p for p in pods if is_running(p)}
            return running if len(pods) == count and len(running) == count else None

        found: dict[str, dict[str, Any]] = self.wait(ready, f"{count} pods Running", timeout)
        return found

    def wait_none(self, timeout: float) -> None:
        self.wait(lambda: not self.pods(), "no pod left", timeout)

    def wait(self, condition: Callable[[], Any], what: str, timeout: float) -> Any:
        """`wait_for` the condition every POLL_SECONDS; BenchError naming the pods' states
        after `timeout`."""
        try:
            return wait_for(condition, f"{self.ns}: {what}", timeout, POLL_SECONDS)
        except ClusterError as e:
            raise BenchError(f"{e}: {self.states()}") from None

    def states(self) -> dict[str, str]:
        return {p["metadata"]["name"]: pod_state(p) for p in self.pods()}

    def adds(self) -> list[CniAdd]:
        found = []
        for node in self.lab.nodes:
            log = self.lab.state / "logs" / f"{node.name}-containerd.log"
            with open(log, errors="replace") as lines:
                found += cni_adds(lines, self.ns)
        return found

    def delete(self, ipward: bool) -> None:
        """The namespace deleted, its pods gone and, under ipward, no address recorded
        for it any more."""
        self.lab.kubectl(
            "delete", "namespace", self.ns, "--wait=true", f"--timeout={GONE_TIMEOUT:g}s",
            timeout=GONE_TIMEOUT + 30,
        )  # fmt: skip
        if ipward:

            def released() -> bool:
                records = json.loads(self.lab.ipward_run("alloc", "list", "--json").stdout)
                return not any(r["pod"].get("namespace") == self.ns for r in records)

            self.wait(released, "no address recorded for it", GONE_TIMEOUT)


def measure_start(
    lab: Cluster, ipam: str, run: int, pods: int, say: Callable[[str], object]
) -> tuple[PodStart, list[CniAdd]]:
    """Run `run` of `pods` pods of one Deployment at once, the pod network on `ipam`:
    until all are Running, each pod's time, their CNI ADDs (each pod's address
    checked to be `ipam`'s); then its namespace deleted."""
    lab.use_ipam(ipam)
    part = _Part(lab, f"bench-{ipam}-start-{run}", say)
    part.create()
    say(f"{ipam}, run {run}: {pods} pods at once")
    t0 = time.monotonic()
    part.apply(deployment(START_APP, pods, spread=START_APP))
    start = pod_start(part.readings(t0, START_TIMEOUT), pods)
    if start is None:
        raise BenchError(
            f"{part.ns}: not {pods} pods Running after {START_TIMEOUT:g}s: {part.states()}"
        )
    adds = part.adds()
    records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
    recorded = sum(r["pod"].get("namespace") == part.ns for r in records)
    if recorded != (pods if ipam == "ipward" else 0):
        raise BenchError(f"{part.ns}: {recorded} of its {pods} pods addressed by ipward")
    say(
        f"{ipam}, run {run}: all {pods} Running after {start.all_running:.1f}s;"
        f" {sum(a.ended is not None for a in adds)} ADDs,"
        f" {sum(a.ended is None for a in adds)} failed; deleting them"
    )
    part.delete(ipward=ipam == "ipward")
    return start, adds


def measure_rounds(
    lab: Cluster, ipam: str, rounds: int, say: Callable[[str], object], clean: bool
) -> tuple[list[Round], int]:
    """A StatefulSet of 5 (Parallel) Running, then `rounds` times scaled to 0 until none
    is left and to 5 until 5 are Running. The rounds and the failed ADDs of its pods;
    its namespace deleted after when `clean`."""
    lab.use_ipam(ipam)
    part = _Part(lab, f"bench-{ipam}-sts", say)
    part.create()
    part.apply(statefulset(STS_APP, STS_REPLICAS, "Parallel"))
    first = addresses(part.wait_running(STS_REPLICAS, ROUND_TIMEOUT))
    done = []
    for n in range(1, rounds + 1):
        began = time.monotonic()
        part.kubectl("scale", "statefulset", STS_APP, "--replicas=0")
        part.wait_none(ROUND_TIMEOUT)
        down = time.monotonic() - began
        part.kubectl("scale", "statefulset", STS_APP, f"--replicas={STS_REPLICAS}")
        now = addresses(part.wait_running(STS_REPLICAS, ROUND_TIMEOUT))
        done.append(Round(time.monotonic() - began, down, now == first))
        say(f"{ipam}: StatefulSet round {n}: {done[-1].seconds:.1f}s, kept {done[-1].kept}")
    failed = sum(a.ended is None for a in part.adds())
    if clean:
        part.delete(ipward=ipam == "ipward")
    return done, failed


def run_kube(
    pods: int = 100,
    rounds: int = 10,
    out: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Make a cluster of 3 nodes, deploy ipward, measure pod start (RUNS runs of each
    IPAM, interleaved) and StatefulSet rounds under host-local and under ipward, remove
    the cluster. Prints the table
    with `out`; returns {"machine", "cluster", "host-local", "ipward", "ratios", "table",
    "elapsed_s"}."""
    if pods < 1 or rounds < 1:
        raise BenchError("--pods and --rounds must be at least 1")
    reason = unavailable_reason()
    if reason:
        raise BenchError(reason)
    binaries = find_binaries()
    began = time.perf_counter()
    info = machine()
    info["containerd"] = version_of(["containerd", "--version"])
    info["kubelet"] = version_of([binaries.kube_node, "kubelet", "--version"])
    out(
        f"ipward bench --kube: {pods} pods at once, {rounds} StatefulSet rounds, {NODES} nodes;"
        f" {info['nproc']} CPUs ({info['platform']})"
    )
    out(f"  {info['kubelet']}; {info['containerd']}")
    out("  taking the machine's containerd lock (the kube tests and containerd labs hold it)")
    figures: dict[str, IpamFigures] = {}
    cluster_info: dict[str, Any] = {}

    def say(line: str) -> None:
        out(f"  {line}")

    machine_lock.acquire()
    try:
        state = Path(tempfile.mkdtemp(prefix="ipwb-", dir="/tmp"))  # short: socket paths
        with cluster(state, NODES, say) as lab:
            lab.deploy(say)
            starts: dict[str, list[PodStart]] = {ipam: [] for ipam in IPAMS}
            adds: dict[str, list[CniAdd]] = {ipam: [] for ipam in IPAMS}
            for run in range(1, RUNS + 1):
                for ipam in IPAMS:
                    start, added = measure_start(lab, ipam, run, pods, say)
                    starts[ipam].append(start)
                    adds[ipam] += added
            for ipam in IPAMS:
                figures[ipam] = start_figures(starts[ipam], adds[ipam])
                done, failed = measure_rounds(lab, ipam, rounds, say, clean=ipam == "host-local")
                figures[ipam].rounds = done
                figures[ipam].sts_cni_adds_failed = failed
            cluster_info = {
                "nodes": NODES,
                "up_s": lab.info.get("up_seconds"),
                "deploy_s": lab.info.get("deploy_seconds"),
            }
            out(f"  removing the cluster ({state})")
    except ClusterError as e:
        raise BenchError(str(e)) from None
    finally:
        machine_lock.release()
    rows = table(figures)
    out("")
    print_table(rows, out)
    out("")
    out("  Pods: one Deployment (the `sleep` image, spread over the nodes) applied at t0, its")
    out("  pods read every 0.25 s; Running: every container running. CNI ADD: from")
    out("  containerd's 'begin cni setup' to its 'cni result' per sandbox (the whole conflist:")
    out(f"  bridge, its IPAM, portmap); {RUNS} runs of each IPAM, interleaved (host-local,")
    out("  ipward, ...): all Running is their median, the rest pooled. StatefulSet")
    out("  (Parallel): scaled to 0 until none is left, to 5 until 5 are Running. ipward:")
    out("  deploy/base and an IPPool (the k8s:// store), its defaults, on the same cluster.")
    elapsed = time.perf_counter() - began
    out(
        f"  whole run: {elapsed:.0f} s (cluster up in {cluster_info.get('up_s')} s, ipward"
        f" deployed in {cluster_info.get('deploy_s')} s)"
    )
    hl, iw = figures["host-local"].to_json(), figures["ipward"].to_json()
    return {
        "machine": info,
        "cluster": cluster_info,
        "host-local": hl,
        "ipward": iw,
        "ratios": ratios(hl, iw),
        "table": rows,
        "elapsed_s": round(elapsed, 1),
    }
