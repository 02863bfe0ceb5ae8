"""What every story on the cluster lab checks, at samples and at its end (tests of
test_kube_stories.py):

- no two Running pods share an address, as the API says (`status.podIPs`, pods of nodes
  the API lists) and as every node's runtime says (its ready sandboxes);
- no two network namespaces held one address at the same time (`AddressWitness`, which
  reads the namespaces themselves, continuously);
- every Running pod's address is ipward's record of that pod's ready sandbox, and every
  address a namespace holds is ipward's record of that namespace's sandbox (an address
  freed while a namespace still holds it is one ipward may give again);
- `ipward check` is clean;
- the witness scanned every node all along and failed nowhere (`AddressWitness`);
- after a story's teardown, every pool back to its baseline: nothing recorded for the
  story's namespace, as many addresses used as before it;
- no fault, no garbage collection: every address freed by its own DEL (`assert_frees`):
  the controllers' `ipward_gc_freed` (but retirements, the end of a sticky address its
  DEL detached) and the agents' `ipward_agent_reconcile_freed` counted nothing more, and
  every free ipward's pods logged is a DEL's; a story that injects a fault names what
  garbage collection or reconciliation frees, and exactly that is freed.

Reads of the API, the runtimes and the store are not one snapshot: a pod's problem counts
only when fresh reads still show it for CONFIRM_SECONDS (a pod deleted between two reads
is not a lost record). What the witness saw needs no confirmation: its doubles are two
spans certain to overlap, and an address a namespace held all through the read of the
records was either recorded for its sandbox then or not.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ipward.gc.rules import REASONS
from ipward_lab import waiting
from ipward_lab.kubecluster.cluster import Cluster
from ipward_lab.kubecluster.common import ClusterError, wait_for
from ipward_lab.kubecluster.deploy import Tuning
from ipward_lab.kubecluster.layout import POD_NET
from ipward_lab.kubecluster.pod_logs import LogLine, PodLogs
from ipward_lab.kubecluster.witness import AddressWitness
from ipward_lab.kubecluster.workloads import is_running


def require_cluster_lab() -> None:
    """Skips the test when the Kubernetes binaries are not found (the reason says where
    to get them); found, what else the kube tests need and lack fails it, naming what:
    a run with the binaries must not pass with its kube tests skipped."""
    from ipward_lab.kubecluster.prerequisites import find_binaries, missing_for_tests

    try:
        find_binaries()
    except ClusterError as e:
        pytest.skip(str(e))
    missing = missing_for_tests()
    if missing:
        pytest.fail(f"the Kubernetes binaries are found, but: {missing}", pytrace=False)


CONFIRM_SECONDS = 3.0
ADD_GRACE = 10.0
# The kube tests' deployment: deploy/base (the k8s:// store) with these options (an
# overlay), so that what ipward does after its ADD grace or a release delay comes in seconds.
KUBE_TUNING = Tuning(
    agent_args=(f"--add-grace={ADD_GRACE:g}", "--reconcile-interval=3"),
    # The controller's source hears the API at least every 5 s (`stale=10`: its watches
    # end at half that), so its view is never older than that, less a 2 s margin, even
    # for kinds that seldom change (namespaces, StatefulSets): its verdicts come seconds,
    # not a minute, after the ADD grace.
    controller_args=(
        f"--add-grace={ADD_GRACE:g}",
        "--gc-interval=2",
        "--interval=1",
        "--liveness=k8s://?stale=10&margin=2",
    ),
    # Small blocks, handed back 5 s after they empty, freed addresses given again after
    # 2 s: what the stories do moves blocks and reuses addresses.
    pool={"blockSize": {"ipv4": 29}, "warm": 4, "releaseDelaySeconds": 5, "cooldownSeconds": 2},
)
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


@dataclass(frozen=True)
class RuntimeSandbox:
    node: str
    id: str
    uid: str
    namespace: str
    name: str
    ready: bool
    ips: tuple[str, ...]
    netns: str  # the file name of its network namespace ("" on the host network)
    net_closed: bool  # its network torn down (containerd's netNamespaceClosed)


@dataclass
class Reading:
    """One read of everything, in this order: the runtimes, the API, the store."""

    sandboxes: dict[str, list[RuntimeSandbox]]  # node -> its sandboxes (absent: unreachable)
    pods: list[dict[str, Any]]
    nodes: set[str]
    records: list[dict[str, Any]]
    records_read: tuple[float, float]  # monotonic, before and after
    by_ip: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_ip = {r["ip"]: r for r in self.records}


def pod_network(ip: str, networks: Iterable[Any]) -> bool:
    address = ipaddress.ip_address(ip)
    return any(address in n for n in networks)


def runtime_sandboxes(lab: Cluster, node_name: str) -> list[RuntimeSandbox]:
    from ipward.cluster.cri import SANDBOX_READY, CriClient

    node = lab.node(node_name)
    out = []
    with CriClient(node.containerd_socket, timeout=10) as cri:
        for s in cri.list_pod_sandboxes():
            try:
                status = cri.pod_sandbox_status(s.id, verbose=True)
            except Exception:  # removed meanwhile
                continue
            netns, closed = "", False
            try:
                info = json.loads(status.info.get("info", "{}"))
                closed = bool(info.get("netNamespaceClosed"))
                for ns in info.get("runtimeSpec", {}).get("linux", {}).get("namespaces", []):
                    if ns.get("type") == "network" and ns.get("path"):
                        netns = ns["path"].rsplit("/", 1)[-1]
            except ValueError:
                pass
            out.append(
                RuntimeSandbox(
                    node_name, s.id, s.uid, s.namespace, s.name,
                    s.state == SANDBOX_READY, status.ips, netns, closed,
                )
            )  # fmt: skip
    return out


def read_all(lab: Cluster) -> Reading:
    sandboxes = {}
    for node in lab.nodes:
        try:
            sandboxes[node.name] = runtime_sandboxes(lab, node.name)
        except Exception:  # its containerd is down (a node rebooting): not read
            continue
    pods = lab.api("/api/v1/pods")["items"]
    nodes = {n["metadata"]["name"] for n in lab.api("/api/v1/nodes")["items"]}
    start = time.monotonic()
    records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
    return Reading(sandboxes, pods, nodes, records, (start, time.monotonic()))


def running_pods(reading: Reading, networks: Iterable[Any] = (POD_NET,)) -> list[dict[str, Any]]:
    """Running pods on the pod network of nodes the API lists."""
    nets = list(networks)
    return [
        p
        for p in reading.pods
        if is_running(p)
        and not p["spec"].get("hostNetwork")
        and p["spec"].get("nodeName") in reading.nodes
        and any(pod_network(i["ip"], nets) for i in p["status"].get("podIPs", []))
    ]


def pod_uids(pod: dict[str, Any]) -> set[str]:
    """The UIDs a pod's sandboxes carry: its own, and a mirror pod's static pod's."""
    uids = {pod["metadata"]["uid"]}
    mirror = pod["metadata"].get("annotations", {}).get(MIRROR_ANNOTATION)
    if mirror:
        uids.add(mirror)
    return uids


def problems(reading: Reading, networks: Iterable[Any] = (POD_NET,)) -> dict[tuple[str, ...], str]:
    """What this reading shows broken of the pods' invariants, each under a key that stays
    the same while the same thing stays broken."""
    nets = list(networks)
    found: dict[tuple[str, ...], str] = {}
    # Two Running pods, one address (the API).
    owners: dict[str, list[str]] = {}
    for pod in running_pods(reading, nets):
        for entry in pod["status"].get("podIPs", []):
            owners.setdefault(entry["ip"], []).append(
                f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                f" ({pod['metadata']['uid'][:8]} on {pod['spec']['nodeName']})"
            )
    for ip, pods in owners.items():
        if len(pods) > 1:
            found[("api-double", ip, *sorted(pods))] = f"API: {ip} on {', '.join(pods)}"
    # Two ready sandboxes, one address (the runtimes).
    ready: dict[str, list[RuntimeSandbox]] = {}
    for sandboxes in reading.sandboxes.values():
        for s in sandboxes:
            for ip in s.ips:
                if s.ready and pod_network(ip, nets):
                    ready.setdefault(ip, []).append(s)
    for ip, holders in ready.items():
        if len(holders) > 1:
            ids = sorted(s.id[:12] for s in holders)
            found[("cri-double", ip, *ids)] = f"runtimes: {ip} in ready sandboxes " + ", ".join(
                f"{s.namespace}/{s.name} {s.id[:12]} on {s.node}" for s in holders
            )
    # Every Running pod's address is its ready sandbox's record.
    ready_of: dict[tuple[str, str], RuntimeSandbox] = {
        (s.node, s.uid): s for ss in reading.sandboxes.values() for s in ss if s.ready
    }
    for pod in running_pods(reading, nets):
        name = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        node = pod["spec"]["nodeName"]
        uids = pod_uids(pod)
        sandbox = next((ready_of[(node, u)] for u in uids if (node, u) in ready_of), None)
        for entry in pod["status"].get("podIPs", []):
            ip = entry["ip"]
            if not pod_network(ip, nets):
                continue
            record = reading.by_ip.get(ip)
            why = ""
            if record is None:
                why = "no record"
            elif record["pod"].get("uid") not in uids:
                other = record["pod"]
                why = (
                    f"recorded for pod {other.get('namespace')}/{other.get('name')}"
                    f" {other.get('uid', '')[:8]}"
                )
            elif sandbox is not None and record["container"] != sandbox.id:
                why = (
                    f"recorded for sandbox {record['container'][:12] or '(detached)'}, its ready"
                    f" sandbox is {sandbox.id[:12]}"
                )
            if why:
                found[("unrecorded-pod", pod["metadata"]["uid"], ip)] = (
                    f"{name} on {node} runs with {ip}: {why}"
                )
    return found


def namespace_problems(
    reading: Reading, witness: AddressWitness, networks: Iterable[Any]
) -> dict[tuple[str, ...], str]:
    """Addresses a namespace held all through the read of the records that are not
    that namespace's sandbox's record. Certain (no confirmation needed): a sandbox's
    record is committed before its address is configured (the IPAM answers `bridge`
    first), and freed, detached or taken over only once its link is gone (`bridge`
    1.1 deletes it before it calls the IPAM's DEL)."""
    nets = list(networks)
    found: dict[tuple[str, ...], str] = {}
    by_netns = {(s.node, s.netns): s for ss in reading.sandboxes.values() for s in ss if s.netns}
    for ip, spans in witness.held_during(*reading.records_read).items():
        if not pod_network(ip, nets):
            continue
        for span in spans:
            # None too when its runtime is not read (down): then only "no record" counts.
            sandbox = by_netns.get((span.node, span.netns))
            record = reading.by_ip.get(ip)
            why = ""
            if record is None:
                why = "no record"
            elif sandbox is not None and record["container"] != sandbox.id:
                why = f"recorded for {record['container'][:12] or '(detached)'}"
            if why:
                what = (
                    f"sandbox {sandbox.id[:12]} of {sandbox.namespace}/{sandbox.name}"
                    f" ({'ready' if sandbox.ready else 'not ready'})"
                    if sandbox
                    else "no sandbox its runtime lists"
                    if span.node in reading.sandboxes
                    else "its runtime is down"
                )
                found[("unrecorded-netns", span.node, span.netns, ip)] = (
                    f"{span.node}'s namespace {span.netns} ({what}) holds {ip}: {why}"
                )
    return found


def ipward_pods(lab: Cluster, name: str) -> list[dict[str, Any]]:
    """The pods of ipward's `ipward-agent` or `ipward-controller`."""
    query = f"labelSelector=app.kubernetes.io%2Fname%3D{name}"
    items: list[dict[str, Any]] = lab.api(f"/api/v1/namespaces/ipward-system/pods?{query}")["items"]
    return items


# The metrics of what freed records other than a DEL (prometheus_client's names), and
# their ports: the controllers' garbage collection (a retirement, RETIRE_REASONS, is how
# a sticky address its DEL detached ends: not counted) and the agents' reconciliation.
COLLECTED = "ipward_gc_freed_total"
RECONCILED = "ipward_agent_reconcile_freed_total"
METRICS_PORTS = {"ipward-controller": 9311, "ipward-agent": 9310}


def collected_by_pod(lab: Cluster) -> dict[str, Counter[str]]:
    """What each of ipward's running pods (by UID) counts freed by garbage collection or
    reconciliation, by reason; a pod that does not answer is left out."""
    out = {}
    for name, port in METRICS_PORTS.items():
        for pod in ipward_pods(lab, name):
            ip = pod["status"].get("podIP")
            if pod["status"].get("phase") != "Running" or not ip:
                continue
            try:
                samples = lab.metrics(ip, port)
            except (OSError, ClusterError):
                continue
            out[pod["metadata"]["uid"]] = Counter(
                {
                    reason: sum(
                        int(samples.get(f'{metric}{{reason="{reason}"}}', 0))
                        for metric in (COLLECTED, RECONCILED)
                    )
                    for reason in REASONS
                }
            )
    return out


def collected_in(lines: Iterable[LogLine]) -> Counter[str]:
    """Addresses the log lines say were freed or detached by anything but a DEL, by
    reason (a garbage-collection reason, when the line's reason names one)."""
    out: Counter[str] = Counter()
    for line in lines:
        fields = line.fields
        # A retirement names its reservation (`sticky`), not an attachment.
        if fields.get("msg") not in ("freed", "detached") or "attachment" not in fields:
            continue
        reason = str(fields.get("reason", ""))
        if reason.startswith("CNI DEL"):
            continue
        named = [r for r in REASONS if f": {r}: " in reason]
        out[named[0] if named else reason] += len(fields.get("ips") or [None])
    return out


def frees_not_by_del(line: LogLine) -> bool:
    return bool(collected_in([line]))


class StoryChecks:
    """The checks of one story (see the module doc), with the witness and the log
    follower of ipward's pods running."""

    def __init__(
        self, lab: Cluster, witness: AddressWitness, logs: PodLogs, networks: Iterable[Any] = ()
    ) -> None:
        self.lab = lab
        self.witness = witness
        self.logs = logs
        self.networks = [POD_NET, *networks]
        self.samples = 0
        self.started = time.monotonic()
        self.started_at = time.time()  # the logs' clock
        self.collected_before = collected_by_pod(lab)

    def sample(self, label: str) -> Reading:
        """Every invariant, now; AssertionError naming what is broken. The reading."""
        self.samples += 1
        failures = self.witness.failures_since(self.started)
        assert not failures, f"{label}: the address witness failed: " + "; ".join(
            str(f) for f in failures[:5]
        )
        doubles = self.witness.doubles(since=self.started)
        doubles = [d for d in doubles if pod_network(d[0].ip, self.networks)]
        assert not doubles, f"{label}: two namespaces held one address at once: " + "; ".join(
            f"{a} and {b}" for a, b in doubles
        )
        reading = read_all(self.lab)
        self.witness.wait_scans(1)
        certain = namespace_problems(reading, self.witness, self.networks)
        assert not certain, f"{label}: " + "; ".join(certain.values())
        found = problems(reading, self.networks)

        def cleared() -> bool:
            """Everything read again: what this read no longer shows is dropped (a problem
            counts only when it lasts CONFIRM_SECONDS)."""
            nonlocal reading, found
            reading = read_all(self.lab)
            again = problems(reading, self.networks)
            found = {k: again[k] for k in found if k in again}
            assert not found, f"{label}: " + "; ".join(found.values())
            return True

        if found:
            waiting.wait_for(
                cleared,
                f"{label}: the problems gone",
                CONFIRM_SECONDS,
                0.0,
                passing=(AssertionError,),
            )
        check = self.lab.ipward_run("check", check=False)
        assert check.returncode == 0, f"{label}: ipward check: {check.stdout}{check.stderr}"
        return reading

    def assert_frees(self, expected: Counter[str]) -> None:
        """Since the story began, garbage collection and reconciliation freed exactly
        `expected` (addresses by reason; empty: every address freed by its own DEL), by
        ipward's logs and by its metrics (those of a pod gone meanwhile are lost with
        it: then they count no more than the logs)."""
        now = collected_by_pod(self.lab)
        lines = self.logs.since(self.started_at, frees_not_by_del)
        logged = collected_in(lines)
        assert logged == expected, (
            f"freed by garbage collection or reconciliation: {dict(logged)}, expected"
            f" {dict(expected)}: " + "; ".join(f"{line.pod}: {line.fields}" for line in lines[:8])
        )
        counted: Counter[str] = Counter()
        for uid, counts in now.items():
            counted += counts - self.collected_before.get(uid, Counter())
        if set(self.collected_before) <= set(now):
            assert counted == logged, f"metrics count {dict(counted)}, the logs {dict(logged)}"
        else:
            assert counted <= logged, f"metrics count {dict(counted)}, the logs {dict(logged)}"

    def used(self) -> dict[str, int]:
        pools = json.loads(self.lab.ipward_run("pool", "list", "--json").stdout)
        return {p["name"]: p["used"] for p in pools}

    def wait_baseline(self, namespace: str, baseline: dict[str, int], timeout: float) -> None:
        """Every pool back to `baseline` (addresses used) and nothing recorded for
        `namespace`: its pods' addresses freed, its reservations retired."""

        def back() -> bool:
            records = json.loads(self.lab.ipward_run("alloc", "list", "--json").stdout)
            left = [r for r in records if r["pod"].get("namespace") == namespace]
            used = self.used()
            new = {pool: n for pool, n in used.items() if pool not in baseline}
            return (
                not left
                and {p: used.get(p) for p in baseline} == baseline
                and not any(new.values())
            )

        try:
            wait_for(back, f"every pool back to {baseline}, nothing of {namespace}", timeout, 1.0)
        except ClusterError:
            records = json.loads(self.lab.ipward_run("alloc", "list", "--json").stdout)
            left = [
                f"{r['ip']} {r['pod'].get('name')} {r['container'][:12] or 'detached'}"
                f" {r.get('sticky_state', '')}"
                for r in records
                if r["pod"].get("namespace") == namespace
            ]
            raise AssertionError(
                f"pools {self.used()}, baseline {baseline}; left of {namespace}: {left}"
            ) from None


def say(text: str) -> None:
    print(f"[story] {text}", file=sys.stderr, flush=True)
