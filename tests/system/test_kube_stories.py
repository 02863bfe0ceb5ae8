"""The seeds' stories, replayed by real controllers and kubelets (issue 22, 3): on a cluster
of 3 nodes on this machine (`ipward_lab.kubecluster`), ipward deployed from its image and
deploy/ with one cluster-wide pool, its options tuned so that a story takes seconds
(`kube_checks.KUBE_TUNING`: the ADD grace, the passes, small blocks handed back soon).

Each story runs in a namespace of its own on the session's cluster (conftest
`kube_cluster`, shared with test_kube_cluster.py) and is checked at
samples during it and at its end (tests/system/kube_checks.py): no two Running pods and no two
network namespaces with one address, every address held recorded by ipward for the
sandbox that holds it, `ipward check` clean, after its teardown every pool back to its
baseline, and every address freed by its own DEL (a story that injects a fault names
what garbage collection or reconciliation frees: `Story.collected`). An AddressWitness
scans every node's namespaces all along, and shows first that it sees a double
(`witness_sees_a_planted_double`); a follower reads the logs of ipward's pods. A story
that breaks a node restores it. Marked `kube`: `pytest -m kube -n 0
tests/system/test_kube_stories.py`.

`IPWARD_KUBE_STATE=DIR` runs them on a cluster that is up already (`ipward cluster up`
and a deploy with KUBE_TUNING, e.g. from a Python shell), and leaves it up: for working
on a story.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ipward_lab import waiting
from ipward_lab.kubecluster.cluster import Cluster
from ipward_lab.kubecluster.common import ClusterError, run, wait_for
from ipward_lab.kubecluster.deploy import Tuning
from ipward_lab.kubecluster.layout import AGENT_SOCKET, BRIDGE, CHECKOUT, POD_GATEWAY, POD_NET, POOL
from ipward_lab.kubecluster.pod_logs import PodLogs
from ipward_lab.kubecluster.witness import AddressWitness
from ipward_lab.kubecluster.workloads import (
    addresses,
    bare_pod,
    container,
    deployment,
    is_running,
    manifest,
    pod_spec,
    pod_state,
    statefulset,
)
from kube_checks import (
    ADD_GRACE,
    KUBE_TUNING,
    StoryChecks,
    collected_by_pod,
    ipward_pods,
    runtime_sandboxes,
    say,
)

pytestmark = [pytest.mark.kube, pytest.mark.timeout(1800)]

RUNNING_TIMEOUT = 120.0
PARALLEL_ROUNDS = 5  # with ORDERED_ROUNDS beside them; the kube tests fit 22 minutes in CI
ORDERED_ROUNDS = 3  # ~12 s a round; ten: test_statefulset_ordered_ready_ten_rounds_... (slow)
FORCE_ROUNDS = 1
CHURN_ROUNDS = 1  # a round shows blocks going back and taken again; 22 minutes hold the rest
# How old a record must be for the controller to judge it at once: the ADD grace from
# when its source last heard the API, less the source's margin (KUBE_TUNING's).
JUDGED_AGE = ADD_GRACE + 2.0 + 1.0


@dataclass
class Stories:
    lab: Cluster
    witness: AddressWitness
    logs: PodLogs  # ipward's pods'
    times: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def stories(kube_cluster: Cluster) -> Iterator[Stories]:
    """The session's cluster (conftest `kube_cluster`, deployed with KUBE_TUNING), its
    namespaces watched by an AddressWitness all through the module (once it has shown
    that it sees a double), the logs of ipward's pods followed."""
    logs = PodLogs(kube_cluster, "ipward-system").start()
    witness = AddressWitness(kube_cluster).start()
    module = Stories(kube_cluster, witness, logs)
    try:
        witness_sees_a_planted_double(module)
        yield module
    finally:
        witness.stop()
        logs.stop()
        info = kube_cluster.info
        say(
            f"up {info.get('up_seconds')}s, deploy {info.get('deploy_seconds')}s; stories: "
            + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in module.times.items())
        )


# Planted in two pods' network namespaces, outside every pool: the witness's control.
PLANTED = {"10.243.0.7": "10.243.0.0/24", "fd00:7e57::7": "fd00:7e57::/64"}


def witness_sees_a_planted_double(stories: Stories) -> None:
    """The witness's control: one IPv4 and one IPv6 address added from the machine
    (`ip addr add` in their namespaces, entered by pid) to two running pods on two
    nodes; the checks every sample makes must fail on both, naming them. The plants are
    removed, and the pods with them, whatever happened."""
    lab = stories.lab
    ns = "witness-control"
    lab.make_namespace(ns)
    try:
        nodes = lab.nodes[:2]
        lab.kubectl(
            f"--namespace={ns}", "apply", "-f", "-",
            input=json.dumps(manifest(*(bare_pod(f"on-{n.name}", node=n.name) for n in nodes))),
        )  # fmt: skip

        def running() -> list[dict[str, Any]] | None:
            pods = lab.api(f"/api/v1/namespaces/{ns}/pods")["items"]
            return pods if len(pods) == len(nodes) and all(map(is_running, pods)) else None

        pods = wait_for(running, "the control's pods Running", RUNNING_TIMEOUT, 0.5)
        pids = [
            lab.sandbox_pid(lab.node(p["spec"]["nodeName"]), p["metadata"]["uid"]) for p in pods
        ]
        networks = tuple(ipaddress.ip_network(n) for n in PLANTED.values())
        checks = StoryChecks(lab, stories.witness, stories.logs, networks)

        def plant(verb: str) -> None:
            for pid in pids:
                for ip in PLANTED:
                    family, prefix = ("-6", 128) if ":" in ip else ("-4", 32)
                    run(
                        [
                            "nsenter", f"--net=/proc/{pid}/ns/net", "ip", family, "addr",
                            verb, f"{ip}/{prefix}", "dev", "eth0",
                            *(("nodad",) if verb == "add" and family == "-6" else ()),
                        ]
                    )  # fmt: skip

        plant("add")
        try:
            stories.witness.wait_scans(3)
            with pytest.raises(AssertionError) as caught:
                checks.sample("witness control")
        finally:
            plant("del")
        message = str(caught.value)
        assert "two namespaces held one address at once" in message, message
        assert all(message.count(f"{ip} on ") >= 2 for ip in PLANTED), message
        say(f"witness control: {message}")
    finally:
        lab.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", timeout=150)
    wait_for(
        lambda: not set(PLANTED) & set(stories.witness.held()),
        "the plants gone from the witness's view",
        30.0,
        0.2,
    )


@dataclass
class Story:
    name: str
    lab: Cluster
    ns: str
    checks: StoryChecks
    started: float = field(default_factory=time.monotonic)
    # What garbage collection and reconciliation are expected to free (addresses, by
    # reason): a story that injects a fault says; nothing else may be freed but by a DEL.
    collected: Counter[str] = field(default_factory=Counter)

    def say(self, text: str) -> None:
        say(f"{self.name} +{time.monotonic() - self.started:.0f}s: {text}")

    def apply(self, *objects: dict[str, Any]) -> None:
        self.lab.kubectl(
            f"--namespace={self.ns}", "apply", "-f", "-", input=json.dumps(manifest(*objects))
        )

    def kubectl(self, *args: str, check: bool = True) -> Any:
        return self.lab.kubectl(f"--namespace={self.ns}", *args, check=check)

    def pods(self, app: str | None = None) -> list[dict[str, Any]]:
        query = f"?labelSelector=app%3D{app}" if app else ""
        items: list[dict[str, Any]] = self.lab.api(f"/api/v1/namespaces/{self.ns}/pods{query}")[
            "items"
        ]
        return items

    def running(self, app: str | None = None) -> dict[str, dict[str, Any]]:
        """Running pods (`is_running`), by name."""
        return {p["metadata"]["name"]: p for p in self.pods(app) if is_running(p)}

    def wait_running(
        self,
        app: str,
        count: int,
        timeout: float = RUNNING_TIMEOUT,
        not_uids: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> dict[str, dict[str, Any]]:
        """`count` pods of `app` Running (none of UIDs `not_uids`), and no other pod of
        it; by name."""

        def ready() -> dict[str, dict[str, Any]] | None:
            pods = self.pods(app)
            running = self.running(app)
            if len(pods) != count or len(running) != count:
                return None
            if any(p["metadata"]["uid"] in not_uids for p in running.values()):
                return None
            return running

        try:
            found: dict[str, dict[str, Any]] = wait_for(
                ready, f"{count} pods of {app} Running", timeout, 0.3
            )
        except ClusterError as e:
            states = {p["metadata"]["name"]: self.state_of(p) for p in self.pods(app)}
            raise AssertionError(f"{e}: {states}") from None
        return found

    def state_of(self, pod: dict[str, Any]) -> str:
        """Its phase, why its containers wait, its node, and the kubelet's last failure to
        make its sandbox."""
        state = pod_state(pod)
        failed = events(self, pod["metadata"]["name"], "FailedCreatePodSandBox")
        if failed:
            last = max(failed, key=lambda e: e.get("lastTimestamp") or "")
            state += f" ({last.get('count', 1)} failed sandboxes, the last: {last['message']})"
        return state

    def wait_gone(self, app: str, timeout: float = RUNNING_TIMEOUT) -> None:
        wait_for(lambda: not self.pods(app), f"no pod of {app}", timeout, 0.3)

    def scale(self, kind: str, name: str, replicas: int) -> None:
        self.kubectl("scale", kind, name, f"--replicas={replicas}")


@contextlib.contextmanager
def story(stories: Stories, name: str, networks: tuple[Any, ...] = ()) -> Iterator[Story]:
    """A story in namespace `story-NAME`: the pools' baseline and a first sample before,
    and after it (when it passed) its namespace deleted, every pool back to its
    baseline, a last sample, and what was freed but by a DEL what the story expected
    (`Story.collected`). Its time is recorded."""
    lab = stories.lab
    checks = StoryChecks(lab, stories.witness, stories.logs, networks)
    checks.sample(f"{name}: before")
    baseline = checks.used()
    ns = f"story-{name}"
    lab.make_namespace(ns)
    s = Story(name, lab, ns, checks)
    passed = False
    try:
        yield s
        passed = True
    finally:
        s.say("teardown")
        lab.kubectl(
            "delete", "namespace", ns, "--wait=true", "--timeout=180s", check=False, timeout=200
        )
        if passed:
            checks.wait_baseline(ns, baseline, 120.0)
            checks.sample(f"{name}: after teardown")
            checks.assert_frees(s.collected)
        else:  # the next story starts from the baseline all the same, when it can
            with contextlib.suppress(AssertionError):
                checks.wait_baseline(ns, baseline, 60.0)
        seconds = time.monotonic() - s.started
        stories.times[name] = seconds
        say(f"{name}: {seconds:.1f}s, {checks.samples} samples")


def sampling(s: Story, label: str, workers: list[threading.Thread], period: float = 5.0) -> None:
    """A sample every `period` seconds (or as soon as the last ends) while `workers` run,
    then they are joined."""
    n = 0
    while any(t.is_alive() for t in workers):
        n += 1
        s.checks.sample(f"{label} sample {n}")
        until = time.monotonic() + period
        for t in workers:
            t.join(timeout=max(0.0, until - time.monotonic()))


def in_thread(errors: list[BaseException], fn: Callable[[], None]) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the test
            errors.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


# -- stories --------------------------------------------------------------------------------


def test_statefulset_scaled_fast_and_force_deleted_keeps_every_address(
    stories: Stories,
) -> None:
    """5->0->5, five rounds Parallel (scaled up again as soon as its pods terminate) and
    three OrderedReady (once they are gone; ten in the slow story after this one), side
    by side, every round's pods made again (new UIDs); then pods that stop slowly,
    force-deleted: each new pod waits (answered 11) until the old sandbox is torn down,
    and every pod keeps its address throughout."""
    with story(stories, "sts") as s:
        s.apply(
            statefulset("par", 5, "Parallel"),
            statefulset("ord", 5, "OrderedReady"),
            statefulset("slow", 3, "Parallel", slow_stop=True, grace=1),
        )
        first = {
            app: addresses(s.wait_running(app, n))
            for app, n in (("par", 5), ("ord", 5), ("slow", 3))
        }
        assert len({ip for a in first.values() for ip in a.values()}) == 13
        s.say(f"first addresses {first}")

        errors: list[BaseException] = []
        workers = [
            in_thread(errors, lambda: scale_rounds(s, "par", PARALLEL_ROUNDS, first["par"])),
            in_thread(
                errors,
                lambda: scale_rounds(s, "ord", ORDERED_ROUNDS, first["ord"], wait_gone=True),
            ),
        ]
        sampling(s, "sts rounds", workers)
        if errors:
            raise errors[0]

        waits_before = sticky_waits(stories.logs, s.ns, "slow")
        for r in range(FORCE_ROUNDS):
            old = {p["metadata"]["uid"] for p in s.pods("slow")}
            s.kubectl("delete", "pod", "slow-0", "slow-1", "slow-2", "--force", "--grace-period=0")
            now = addresses(s.wait_running("slow", 3, not_uids=old))
            assert now == first["slow"], f"force-deleted, round {r + 1}: {now} != {first['slow']}"
            s.checks.sample(f"sts force delete {r + 1}")
        waits = sticky_waits(stories.logs, s.ns, "slow") - waits_before
        s.say(
            f"force-deleted {FORCE_ROUNDS} times; ADDs answered 11 waiting for a teardown: {waits}"
        )
        assert waits > 0, "no new sandbox waited for its predecessor's teardown"


def scale_rounds(
    s: Story, app: str, count: int, first: dict[str, str], wait_gone: bool = False
) -> None:
    """`count` rounds of StatefulSet `app` scaled to 0 and back (`wait_gone`: up again only
    once its pods are gone, else as soon as each is being deleted); every pod made again
    (none of the round's UIDs Running) with its `first` address."""
    for r in range(count):
        old = {p["metadata"]["uid"] for p in s.pods(app)}
        s.scale("statefulset", app, 0)
        if wait_gone:
            s.wait_gone(app)
        else:
            wait_for(
                lambda: all(p["metadata"].get("deletionTimestamp") for p in s.pods(app)),
                f"every pod of {app} terminating",
                RUNNING_TIMEOUT,
                0.2,
            )
        s.scale("statefulset", app, len(first))
        now = addresses(s.wait_running(app, len(first), not_uids=old))
        assert now == first, f"{app} round {r + 1}: {now} != {first}"
    s.say(f"{app}: {count} rounds, every address kept")


@pytest.mark.slow  # ~2.5 min: not in CI's 15 minutes of kube tests, which run 3 rounds
def test_statefulset_ordered_ready_ten_rounds_keeps_every_address(stories: Stories) -> None:
    """5->0->5 ten times, OrderedReady: pods made one after the other, each once its
    predecessor is Ready; every pod keeps its address."""
    with story(stories, "ordered") as s:
        s.apply(statefulset("ord", 5, "OrderedReady"))
        first = addresses(s.wait_running("ord", 5))
        errors: list[BaseException] = []
        worker = in_thread(errors, lambda: scale_rounds(s, "ord", 10, first, wait_gone=True))
        sampling(s, "ordered rounds", [worker])
        if errors:
            raise errors[0]


def test_force_deleted_pods_slow_to_stop_hold_their_addresses_until_their_sandboxes_go(
    stories: Stories,
) -> None:
    """Pods that take their whole grace period (30 s) to stop, force-deleted: the API
    forgets them at once, their sandboxes run on until the kubelet kills them. Their
    addresses stay theirs until their sandboxes are torn down: a plain pod's is not
    freed, a StatefulSet pod's moves to its successor (made on another node) only then,
    so no two namespaces hold it at once."""
    lab = stories.lab
    with story(stories, "slow-stop") as s:
        here, there = (n.name for n in lab.nodes[:2])
        far = statefulset("far", 1, node=here, slow_stop=True, grace=30)
        far["spec"]["updateStrategy"] = {"type": "OnDelete"}  # the next far-0 goes `there`
        s.apply(far, bare_pod("lingering", node=here, slow_stop=True, grace=30))
        first = addresses(s.wait_running("far", 1))
        lingering = s.wait_running("lingering", 1)["lingering"]
        old = {p["metadata"]["uid"] for p in s.pods()}
        wait_past_grace(s, ["far-0", "lingering"])
        held = {n: r["ip"] for n, r in records_of(lab, s.ns).items()}
        move = [
            {
                "op": "replace",
                "path": "/spec/template/spec/nodeSelector",
                "value": {"kubernetes.io/hostname": there},
            }
        ]
        s.kubectl("patch", "statefulset", "far", "--type=json", f"--patch={json.dumps(move)}")
        s.kubectl("delete", "pod", "far-0", "lingering", "--force", "--grace-period=0")
        s.say(f"far-0 and lingering force-deleted on {here}; far-0 made again on {there}")

        def torn_down() -> bool:
            return not set(held.values()) & {
                ip
                for ip, spans in stories.witness.held().items()
                if any(span.node == here for span in spans)
            }

        n = 0

        def sampled_until_torn_down() -> bool:
            nonlocal n
            if torn_down():
                return True
            n += 1
            s.checks.sample(f"slow-stop: old sandboxes stopping, sample {n}")
            return False

        try:
            # Not the lab's wait: a sample's failure to read is the story's, not "not yet".
            waiting.wait_for(sampled_until_torn_down, f"{held} no longer held on {here}", 90.0, 0.0)
        finally:  # the next story starts without them, whatever happened
            wait_for(torn_down, "the old sandboxes torn down", 90.0, 0.5)
        s.say(f"old sandboxes torn down after {n} samples")
        moved = s.wait_running("far", 1, not_uids=old)
        assert addresses(moved) == first
        assert moved["far-0"]["spec"]["nodeName"] == there
        wait_for(
            lambda: "lingering" not in records_of(lab, s.ns),
            "lingering's address freed",
            60.0,
            0.5,
        )
        assert lingering["status"]["podIP"] == held["lingering"]


def sticky_waits(logs: PodLogs, ns: str, app: str) -> int:
    """ADDs of `app`'s pods the agents answered 11 because the reservation was still
    bound to a sandbox not torn down yet (on the same node: its runtime lists it; on
    another: its DEL has not detached it)."""
    return sum(
        1
        for line in logs.since(0.0)
        if line.container == "agent"
        and line.fields.get("code") == 11
        and str(line.fields.get("msg", "")).startswith(f"sticky/pods/{ns}/{app}-")
        and any(why in line.fields["msg"] for why in ("teardown is over", "DEL detaches it"))
    )


# -- the cluster's own parts, for the stories ---------------------------------------------------


def quiet_node(lab: Cluster) -> str:
    """A node no ipward controller runs on (so breaking it leaves the leader alone),
    else the last."""
    busy = {p["spec"].get("nodeName") for p in ipward_pods(lab, "ipward-controller")}
    free = [n.name for n in lab.nodes if n.name not in busy]
    return free[0] if free else lab.nodes[-1].name


def leader_metrics(lab: Cluster) -> tuple[str, dict[str, float]]:
    """The leading controller's pod name and its metrics."""

    seen: dict[str, str] = {}  # what each controller pod said last, for the failure

    def leader() -> tuple[str, dict[str, float]] | None:
        for pod in ipward_pods(lab, "ipward-controller"):
            name, ip = pod["metadata"]["name"], pod["status"].get("podIP")
            seen[name] = f"{pod['status'].get('phase')} on {pod['spec'].get('nodeName')} at {ip}"
            if pod["status"].get("phase") != "Running" or not ip:
                continue
            try:
                samples = lab.metrics(ip, 9311)
            except OSError as e:
                seen[name] += f": {e}"
                continue
            seen[name] += f": leader {samples.get('ipward_controller_leader')}"
            if samples.get("ipward_controller_leader") == 1.0:
                return name, samples
        return None

    try:
        found: tuple[str, dict[str, float]] = wait_for(leader, "a leading controller", 60.0, 0.5)
    except ClusterError as e:
        raise AssertionError(f"{e}: {seen}") from None
    return found


def wait_gc_passes(lab: Cluster, passes: int, timeout: float = 60.0) -> None:
    """Until the leading controller has made `passes` more garbage-collection passes
    (counted from now; a new leader's from its start)."""
    name, samples = leader_metrics(lab)
    start = {name: samples.get("ipward_gc_pass_seconds_count", 0.0)}

    def done() -> bool:
        now, samples = leader_metrics(lab)
        return samples.get("ipward_gc_pass_seconds_count", 0.0) - start.get(now, 0.0) >= passes

    wait_for(done, f"{passes} garbage-collection passes", timeout, 0.5)


def registered(lab: Cluster) -> set[str]:
    """The nodes with a registered agent."""
    return set(json.loads(lab.ipward_run("status", "--json").stdout)["nodes"])


def records_of(lab: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    """ipward's records of the pods of namespace `ns`, by pod name (a detached sticky
    one too)."""
    records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
    return {r["pod"]["name"]: r for r in records if r["pod"].get("namespace") == ns}


def wait_past_grace(s: Story, names: list[str]) -> None:
    """Until the records of pods `names` are JUDGED_AGE old (by the clock that wrote
    them, this machine's): the controller judges them at the next change of their pods."""

    def old() -> bool:
        records = records_of(s.lab, s.ns)
        return all(
            n in records and time.time() - records[n]["created_at"] > JUDGED_AGE for n in names
        )

    wait_for(old, f"records of {names} past the ADD grace", 60.0, 0.5)


def agent_down(lab: Cluster, node: str) -> None:
    """The node's agent stopped and kept down as a failed agent stays down: its image
    removed from the node, its pod deleted (the DaemonSet's new pod cannot start);
    until its registration is gone."""
    from ipward_lab.containerd.images import IPWARD_IMAGE

    n = lab.node(node)
    run(["ctr", f"--address={n.containerd_socket}", "-n", "k8s.io", "images", "rm", IPWARD_IMAGE])
    for pod in ipward_pods(lab, "ipward-agent"):
        if pod["spec"].get("nodeName") == node:
            lab.kubectl("--namespace=ipward-system", "delete", "pod", pod["metadata"]["name"])
    wait_for(lambda: node not in registered(lab), f"{node}'s agent unregistered", 60.0, 0.5)


def agent_up(lab: Cluster, node: str) -> None:
    """The node's agent back (`agent_down` undone): its image loaded again, its pod
    made again; until it is ready."""
    from ipward_lab.containerd.images import build_ipward_image

    lab.import_images(lab.node(node), [build_ipward_image(CHECKOUT, lambda t: None)])
    for pod in ipward_pods(lab, "ipward-agent"):
        if pod["spec"].get("nodeName") == node:
            lab.kubectl(
                "--namespace=ipward-system",
                "delete",
                "pod",
                pod["metadata"]["name"],
                "--wait=false",
            )
    wait_agent_ready(lab, node)


def wait_agent_ready(lab: Cluster, node: str, timeout: float = 120.0) -> None:
    def ready() -> bool:
        for pod in ipward_pods(lab, "ipward-agent"):
            if pod["spec"].get("nodeName") == node and not pod["metadata"].get("deletionTimestamp"):
                conditions = pod["status"].get("conditions", [])
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    return node in registered(lab)
        return False

    wait_for(ready, f"{node}'s agent ready and registered", timeout, 0.5)


def events(s: Story, pod: str, reason: str) -> list[dict[str, Any]]:
    query = f"fieldSelector=involvedObject.name%3D{pod},reason%3D{reason}"
    items: list[dict[str, Any]] = s.lab.api(f"/api/v1/namespaces/{s.ns}/events?{query}")["items"]
    return items


def sandbox_failures(s: Story) -> list[str]:
    """What the kubelets said of every pod sandbox of the story they failed to make."""
    query = "fieldSelector=reason%3DFailedCreatePodSandBox"
    items = s.lab.api(f"/api/v1/namespaces/{s.ns}/events?{query}")["items"]
    return [f"{e['involvedObject']['name']}: {e['message']}" for e in items]


def failures(s: Story, pod: str) -> int:
    """How often the kubelet failed to make `pod`'s sandbox."""
    return sum(e.get("count", 1) for e in events(s, pod, "FailedCreatePodSandBox"))


def test_add_retried_after_bridge_failed_past_ipam_keeps_its_address(stories: Stories) -> None:
    """`bridge` fails after its IPAM answered (the node's cni0 holds another IPv4 address
    first: "already has an IP address different from"), so the kubelet retries the
    sandbox: a StatefulSet's pods keep the address their first ADD got, which no other
    pod gets meanwhile, and run with it once the bridge is repaired; a plain pod too
    runs in the end."""
    lab = stories.lab
    with story(stories, "retry") as s:
        node = quiet_node(lab)
        netns = lab.node(node).netns
        broken = "10.99.99.1/24"
        bridge_addr = f"{POD_GATEWAY}/{POD_NET.prefixlen}"
        # Another address first on the bridge, the gateway's kept (its pods stay up).
        run(
            [
                "nsenter", f"--net={netns}", "sh", "-ec",
                f"ip addr add {broken} dev {BRIDGE};"
                f" ip addr del {bridge_addr} dev {BRIDGE};"
                f" ip addr add {bridge_addr} dev {BRIDGE}",
            ]
        )  # fmt: skip
        try:
            s.apply(statefulset("db", 2, node=node), bare_pod("plain", node=node))
            wait_for(
                lambda: all(failures(s, p) >= 2 for p in ("db-0", "db-1", "plain")),
                "the kubelet retried each pod's sandbox",
                90.0,
                1.0,
            )
            message = events(s, "db-0", "FailedCreatePodSandBox")[0]["message"]
            assert "already has an IP address different from" in message, message
            reserved = {n: r["ip"] for n, r in records_of(lab, s.ns).items() if r["sticky"]}
            assert set(reserved) == {"db-0", "db-1"}, reserved
            s.say(f"{failures(s, 'db-0')} failed ADDs of db-0; reserved {reserved}")
            reading = s.checks.sample("retry: bridge failing")
            for name, ip in reserved.items():
                assert reading.by_ip[ip]["sticky"].endswith(f"/{s.ns}/{name}"), reading.by_ip[ip]
            assert not s.running()
        finally:
            run(
                [
                    "nsenter",
                    f"--net={netns}",
                    "ip",
                    "addr",
                    "del",
                    broken,
                    "dev",
                    BRIDGE,
                ]
            )
        running = s.wait_running("db", 2)
        s.wait_running("plain", 1)
        assert addresses(running) == reserved
        s.checks.sample("retry: running")


def test_pods_deleted_while_their_agent_is_down_are_freed_once_it_is_back(
    stories: Stories,
) -> None:
    """A node's agent down (its image gone, its pod deleted: unregistered), then pods of
    that node deleted: two force-deleted (the kubelet's DEL is refused and, the pods
    gone from the API, never retried), one gracefully (retried while it terminates).
    Their sandboxes stay, not ready (`bridge` 1.1 removed their links before it asked
    the IPAM). Their records stay through the controller's passes, the node listed and
    its agent unregistered: nothing of it is freed on the cluster's word alone. Once the
    agent is back, the addresses are freed and the sandboxes' networks torn down
    (containerd closes their namespaces; the stopped sandboxes stay listed until the
    kubelet's garbage collection), though no kubelet retries a deleted pod's DEL."""
    lab = stories.lab
    with story(stories, "agent-down") as s:
        node = quiet_node(lab)
        names = ["gone-0", "gone-1", "graceful"]
        s.apply(*(bare_pod(n, node=node) for n in names))
        pods = {n: s.wait_running(n, 1)[n] for n in names}
        uids = {p["metadata"]["uid"] for p in pods.values()}
        wait_past_grace(s, names)
        held = {n: r["ip"] for n, r in records_of(lab, s.ns).items()}
        s.checks.sample("agent-down: running")
        agent_down(lab, node)
        s.say(f"{node}'s agent down")

        def sandboxes() -> dict[str, tuple[bool, bool]]:
            """The deleted pods' sandboxes on the node, by id: (ready, network torn down)."""
            return {
                sb.id: (sb.ready, sb.net_closed)
                for sb in runtime_sandboxes(lab, node)
                if sb.uid in uids
            }

        try:
            s.kubectl("delete", "pod", "gone-0", "gone-1", "--force", "--grace-period=0")
            s.kubectl("delete", "pod", "graceful", "--wait=false")
            wait_for(lambda: len(s.pods()) == 1, "the force-deleted pods gone", 60.0, 0.5)
            wait_for(
                lambda: (
                    (found := sandboxes())
                    and len(found) == 3
                    and not any(ready or closed for ready, closed in found.values())
                ),
                "their sandboxes stopped, their DELs refused (networks not torn down)",
                60.0,
                0.5,
            )
            wait_gc_passes(lab, 3)
            s.checks.sample("agent-down: pods deleted, agent down")
            left = {n: r["ip"] for n, r in records_of(lab, s.ns).items()}
            assert left == held, (
                f"freed while {node}'s agent was down and their sandboxes not torn down:"
                f" {sorted(set(held) - set(left))}"
            )
        finally:
            agent_up(lab, node)
        s.say(f"{node}'s agent back")

        def done() -> bool:
            torn_down = all(closed for _, closed in sandboxes().values())
            return not records_of(lab, s.ns) and torn_down and not s.pods()

        try:
            wait_for(done, "the deleted pods' addresses freed, their networks torn down", 90.0, 1.0)
        except ClusterError as e:
            raise AssertionError(
                f"{e}: records {sorted(records_of(lab, s.ns))}, sandboxes {sandboxes()},"
                f" pods {[p['metadata']['name'] for p in s.pods()]}"
            ) from None
        s.checks.sample("agent-down: agent back")


def test_node_rebooted_runs_its_pods_again_and_frees_its_old_sandboxes_by_their_dels(
    stories: Stories,
) -> None:
    """A node rebooted as a machine is (`power_off`: every process killed, its /run, its
    sandboxes and its network state lost; `power_on`: booted) with pods of a Deployment
    and a StatefulSet on it, and a pod deleted while it is down. While it is down,
    nothing of it is freed (the node listed, its agent gone: the cluster's word alone
    frees nothing). Back, its runtime tears down the sandboxes it remembers (their DELs
    wait for the agent: the plugin's notes are on the node's disk), every pod runs again
    in a new sandbox, the StatefulSet's with its address, the deleted pod goes, and
    every address of the old sandboxes is freed by their DELs."""
    lab = stories.lab
    with story(stories, "reboot") as s:
        node = quiet_node(lab)
        n = lab.node(node)
        s.apply(
            deployment("keep", 2, node=node),
            statefulset("db", 1, node=node),
            bare_pod("left", node=node),
        )
        keep = s.wait_running("keep", 2)
        db = s.wait_running("db", 1)
        s.wait_running("left", 1)
        wait_past_grace(s, [*keep, "db-0", "left"])
        before = {name: (r["ip"], r["container"]) for name, r in records_of(lab, s.ns).items()}
        s.checks.sample("reboot: running")
        lab.power_off(n)
        s.say(f"{node} powered off")
        try:
            s.kubectl("delete", "pod", "left", "--wait=false")
            wait_gc_passes(lab, 3)
            s.checks.sample("reboot: node down")
            now = {name: (r["ip"], r["container"]) for name, r in records_of(lab, s.ns).items()}
            assert now == before, f"freed while {node} was down: {sorted(set(before) - set(now))}"
        finally:
            lab.power_on(n)
        s.say(f"{node} booted")
        wait_agent_ready(lab, node)
        s.wait_gone("left")
        assert s.wait_running("keep", 2).keys() == keep.keys()
        assert addresses(s.wait_running("db", 1)) == addresses(db)
        old = {container for _, container in before.values()}

        def old_sandboxes_freed() -> bool:
            return not old & {r["container"] for r in records_of(lab, s.ns).values()}

        wait_for(old_sandboxes_freed, "the old sandboxes' addresses freed", 90.0, 1.0)
        s.checks.sample("reboot: back")


def test_pods_churning_on_every_node_while_surplus_blocks_go_back(stories: Stories) -> None:
    """A Deployment spread over every node scaled 18 -> 3 -> 18, CHURN_ROUNDS times: each
    scale-down leaves blocks empty beyond the warm target, which the controller asks
    back after the release delay (5 s); the scale-up comes as soon as it has started
    asking (a node that needs the space takes the block back). Every pod starts within
    the kubelet's retries, no address doubles, no record is lost, and blocks did go
    back."""
    lab = stories.lab
    with story(stories, "churn") as s:

        def handshakes() -> dict[str, float]:
            _, samples = leader_metrics(lab)
            return {
                result: samples.get(f'ipward_controller_handshakes_total{{result="{result}"}}', 0.0)
                for result in ("started", "completed", "aborted")
            }

        before = handshakes()
        s.apply(deployment("churn", 18, spread="churn"))
        s.wait_running("churn", 18)
        for r in range(CHURN_ROUNDS):
            s.checks.sample(f"churn round {r + 1}: 18 running")
            asked = handshakes()["started"]
            s.scale("deployment", "churn", 3)
            s.wait_running("churn", 3)
            wait_for(
                lambda asked=asked: handshakes()["started"] > asked,  # type: ignore[misc]
                "the controller asking a block back",
                60.0,
                0.5,
            )
            s.scale("deployment", "churn", 18)
            s.wait_running("churn", 18)
        after = handshakes()
        s.say(f"handshakes {before} -> {after}")
        assert after["completed"] > before["completed"], "no block went back"
        s.checks.sample("churn: done")


def test_job_pods_hold_no_address_once_completed(stories: Stories) -> None:
    """A Job's pods run to completion (Succeeded, still listed): their addresses are
    freed, by the kubelet's DEL of their sandboxes or as pod-terminal."""
    lab = stories.lab
    with story(stories, "job") as s:
        spec = pod_spec()
        spec["restartPolicy"] = "Never"
        spec["containers"] = [container(args=["1"])]
        s.apply(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "once"},
                "spec": {
                    "completions": 6,
                    "parallelism": 6,
                    "template": {"metadata": {"labels": {"app": "once"}}, "spec": spec},
                },
            }
        )

        def completed() -> bool:
            pods = s.pods("once")
            return len(pods) == 6 and all(p["status"].get("phase") == "Succeeded" for p in pods)

        wait_for(completed, "the Job's 6 pods Succeeded", RUNNING_TIMEOUT, 0.5)
        wait_for(
            lambda: not records_of(lab, s.ns), "the completed pods' addresses freed", 60.0, 0.5
        )
        assert len(s.pods("once")) == 6, "the completed pods are still listed"
        s.checks.sample("job: completed")


def test_drained_node_moves_its_pods_and_a_statefulset_pod_keeps_its_address(
    stories: Stories,
) -> None:
    """`kubectl drain` of a node with pods of a StatefulSet and a Deployment: the pods
    are evicted and made again on the other nodes, the StatefulSet's with its address
    (a sticky address moving across nodes); the node is uncordoned after."""
    lab = stories.lab
    with story(stories, "drain") as s:
        s.apply(statefulset("db", 3, spread="db"), deployment("web", 3, spread="web"))
        db = s.wait_running("db", 3)
        s.wait_running("web", 3)
        node = db["db-1"]["spec"]["nodeName"]
        try:
            s.say(f"draining {node}")
            lab.kubectl(
                "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force",
                "--timeout=120s", timeout=180,
            )  # fmt: skip
            moved = s.wait_running("db", 3)
            web = s.wait_running("web", 3)
            assert addresses(moved) == addresses(db)
            assert all(p["spec"]["nodeName"] != node for p in [*moved.values(), *web.values()])
            s.checks.sample("drain: drained")
        finally:
            lab.kubectl("uncordon", node)


NODE_GONE = "node-gone"


def test_deleted_node_frees_its_addresses_as_node_gone(stories: Stories) -> None:
    """A node goes down for good (every process of it killed, what a reboot clears
    cleared) and is deleted from the cluster: its agent's registration expires, its pods
    are collected (kube-controller-manager's pod GC) and made again elsewhere, the
    StatefulSet's with its address once the node is gone, and its records freed as
    node-gone, each of them, by the controllers' count too (and nothing else but by a
    DEL). Then the node comes back and joins again."""
    lab = stories.lab
    with story(stories, "node-gone") as s:
        s.apply(statefulset("db", 3, spread="db"), deployment("web", 3, spread="web"))
        db = s.wait_running("db", 3)
        s.wait_running("web", 3)
        node = quiet_node(lab)
        on_node = [n for n, p in s.running().items() if p["spec"]["nodeName"] == node]
        wait_past_grace(s, on_node)
        counted_before = collected_by_pod(lab)
        records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
        s.collected[NODE_GONE] = len([r for r in records if r["node"] == node and r["container"]])
        n = lab.node(node)
        s.say(f"{node} down for good, with {on_node}")
        lab.power_off(n)
        try:
            lab.kubectl("delete", "node", node)
            wait_for(lambda: node not in registered(lab), f"{node}'s agent unregistered", 60.0, 0.5)
            moved = s.wait_running("db", 3, timeout=180.0)
            s.wait_running("web", 3, timeout=180.0)
            assert addresses(moved) == addresses(db)
            s.checks.sample("node-gone: pods elsewhere")

            def held() -> list[str]:
                records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
                return [
                    f"{r['ip']} of {r['pod'].get('namespace')}/{r['pod'].get('name')}"
                    for r in records
                    if r["node"] == node and r["container"]
                ]

            try:
                wait_for(lambda: not held(), f"{node}'s records freed", 60.0, 1.0)
            except ClusterError as e:
                raise AssertionError(f"{e}: {held()}") from None
            counted = collected_by_pod(lab)
            # The controllers (on other nodes) count what they freed.
            frees = sum(
                c[NODE_GONE] - counted_before.get(u, Counter())[NODE_GONE]
                for u, c in counted.items()
            )
            assert frees == s.collected[NODE_GONE], f"counted {frees} freed as node-gone"
        finally:
            lab.power_on(n)
            wait_for(
                lambda: any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in lab.api(f"/api/v1/nodes/{node}")
                    .get("status", {})
                    .get("conditions", [])
                ),
                f"{node} Ready again",
                120.0,
                1.0,
            )
            wait_agent_ready(lab, node)
        s.checks.sample("node-gone: node back")


STATIC_POD = "static-web"


def test_static_pod_on_the_pod_network_is_addressed_and_freed(stories: Stories) -> None:
    """A static pod (a manifest in a node's /etc/kubernetes/manifests) on the pod
    network: its ADD is served through its mirror pod, its address recorded for its own
    UID; its manifest removed, its address is freed."""
    lab = stories.lab
    with story(stories, "static") as s:
        node = quiet_node(lab)
        n = lab.node(node)
        manifest = bare_pod(STATIC_POD)
        manifest["metadata"]["namespace"] = s.ns
        path = f"/etc/kubernetes/manifests/{s.ns}-{STATIC_POD}.json"
        lab_run = lambda script, text="": run(  # noqa: E731
            lab.in_node(n, ["sh", "-ec", script]), input=text or None
        )
        lab_run(f"cat > {path}", json.dumps(manifest))
        try:
            mirror = s.wait_running(STATIC_POD, 1)[f"{STATIC_POD}-{node}"]
            uid = mirror["metadata"]["annotations"]["kubernetes.io/config.mirror"]
            record = records_of(lab, s.ns)[f"{STATIC_POD}-{node}"]
            assert record["pod"]["uid"] == uid != mirror["metadata"]["uid"]
            assert record["ip"] == mirror["status"]["podIP"]
            s.checks.sample("static: running")
        finally:
            lab_run(f"rm -f {path}")
        s.wait_gone(STATIC_POD)
        wait_for(lambda: not records_of(lab, s.ns), "the static pod's address freed", 60.0, 0.5)


def rolled(lab: Cluster) -> str | None:
    """ "rolled" once every node runs an updated, available agent and every controller
    is updated and available; why not, when a pod of either cannot be scheduled (the
    roll is stuck); None meanwhile."""
    for pod in [*ipward_pods(lab, "ipward-agent"), *ipward_pods(lab, "ipward-controller")]:
        for c in pod["status"].get("conditions", []):
            if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message"):
                return f"{pod['metadata']['name']} cannot be scheduled: {c['message']}"
    ds = lab.kubectl_json("--namespace=ipward-system", "get", "daemonset", "ipward-agent")
    status, want = ds["status"], ds["status"].get("desiredNumberScheduled", -1)
    agents = (
        status.get("observedGeneration") == ds["metadata"]["generation"]
        and status.get("updatedNumberScheduled") == want
        and status.get("numberAvailable") == want
        and status.get("numberUnavailable", 0) == 0
        and status.get("currentNumberScheduled") == want
    )
    deploy = lab.kubectl_json("--namespace=ipward-system", "get", "deployment", "ipward-controller")
    status, want = deploy["status"], deploy["spec"]["replicas"]
    controllers = (
        status.get("observedGeneration") == deploy["metadata"]["generation"]
        and status.get("updatedReplicas") == want
        and status.get("availableReplicas") == want
        and status.get("replicas") == want  # no old one left
    )
    return "rolled" if agents and controllers else None


def agents_running(lab: Cluster) -> dict[str, set[str]]:
    """The agent pods whose container runs, by node."""
    out: dict[str, set[str]] = {}
    for pod in ipward_pods(lab, "ipward-agent"):
        states = [c.get("state", {}) for c in pod["status"].get("containerStatuses", [])]
        if states and all("running" in state for state in states):
            out.setdefault(pod["spec"]["nodeName"], set()).add(pod["metadata"]["uid"])
    return out


def roll(s: Story, tuning: Tuning, label: str) -> None:
    """ipward's manifests applied as `tuning` makes them (the store's own, deploy/base
    on k8s://, when it adds nothing), and sampled until the agents and the
    controllers have rolled: every node ran its old and its new agent at once."""
    lab = s.lab
    together: dict[str, int] = {}  # the most agents seen running at once, by node
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for node, pods in agents_running(lab).items():
                together[node] = max(together.get(node, 0), len(pods))
            done.wait(0.3)

    errors: list[BaseException] = []
    outcome: list[str] = []
    watcher = in_thread(errors, watch)
    try:
        lab.kubectl("apply", "-k", str(tuning.kustomization(lab)))
        rolling = in_thread(
            errors,
            lambda: outcome.append(wait_for(lambda: rolled(lab), f"{label} done", 300.0, 1.0)),
        )
        sampling(s, label, [rolling])
    finally:
        done.set()
        watcher.join(timeout=30)
    if errors:
        raise errors[0]
    assert outcome == ["rolled"], f"{label}: {outcome}"
    alone = sorted(n.name for n in lab.nodes if together.get(n.name, 0) < 2)
    assert not alone, f"{label}: no old and new agent running at once on {alone}"
    s.say(f"{label}: rolled, agents at once by node {together}")


def container_args(lab: Cluster, kind: str, name: str) -> list[str]:
    workload = lab.kubectl_json("--namespace=ipward-system", "get", kind, name)
    args: list[str] = workload["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_agents_rolled_to_ipwards_defaults_and_back_under_churn(stories: Stories) -> None:
    """ipward's manifests applied as deploy/base has them (the lab's tuning
    dropped: the agents' and the controllers' own defaults, ADD grace 120 s among them),
    then with the tuning again, while pods come and go on every node. Each apply rolls
    the agent DaemonSet with `maxSurge: 1` (each node's new agent serves beside the old
    one, which drains) and the controllers: each roll completes, every node's old and
    new agents ran at once, and no pod's sandbox failed. On those defaults, a StatefulSet
    is scaled to 0 and back, its pods made again with their addresses. No address
    doubles, no record is lost, every address is freed by its DEL. (The tuning is
    applied again whatever happened.)"""
    lab = stories.lab
    with story(stories, "roll") as s:
        s.apply(deployment("churn", 9, spread="churn"), statefulset("db", 3, spread="db"))
        s.wait_running("churn", 9)
        db = addresses(s.wait_running("db", 3))
        stop = threading.Event()

        def churn() -> None:
            while not stop.is_set():
                pods = sorted(s.running("churn"))
                if pods:
                    s.kubectl("delete", "pod", pods[0], "--wait=false")
                s.wait_running("churn", 9, timeout=180.0)

        errors: list[BaseException] = []
        worker = in_thread(errors, churn)
        try:
            roll(s, Tuning(), "the roll to the manifests' defaults")
            for kind, name in (("daemonset", "ipward-agent"), ("deployment", "ipward-controller")):
                args = container_args(lab, kind, name)
                tuned = set(args) & {*KUBE_TUNING.agent_args, *KUBE_TUNING.controller_args}
                assert not tuned, f"{name} runs with {sorted(tuned)}"
            scale_rounds(s, "db", 1, db)
            roll(s, KUBE_TUNING, "the roll back to the tuning")
        finally:
            stop.set()
            worker.join(timeout=200)
            if rolled(lab) != "rolled" or not set(KUBE_TUNING.agent_args) <= set(
                container_args(lab, "daemonset", "ipward-agent")
            ):
                lab.kubectl("apply", "-k", str(KUBE_TUNING.kustomization(lab)))
                wait_for(lambda: rolled(lab), "the tuning deployed again", 300.0, 1.0)
        if errors:
            raise errors[0]
        failed = sandbox_failures(s)
        assert not failed, f"sandboxes failed: {failed}"
        s.wait_running("churn", 9)


SECOND_NET = ipaddress.ip_network("10.245.0.0/24")
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
NETWORK_STATUS_ANNOTATION = "k8s.v1.cni.cncf.io/network-status"


def held_by(lab: Cluster, ns: str) -> dict[str, str]:
    """The ledger's addresses of namespace `ns`'s pods, by pod name."""
    return {r["pod"]["name"]: r["ip"] for r in records_of(lab, ns).values()}


def test_ledger_moved_to_an_etcd_and_back_under_running_pods(stories: Stories) -> None:
    """`--store etcd`'s story: the ledger moved from the API to an etcd of the lab's, as
    README's upgrade says (controllers scaled to 0, the agent DaemonSet deleted, `ipward
    export`, `ipward import`, deploy/overlays/etcd applied), under running pods, which
    keep their addresses and records; on etcd a StatefulSet round keeps its addresses
    and new pods get new ones; then moved back to `k8s://` (deploy/base) the same way,
    and a round there. No address doubles, nothing is freed but by a DEL. (Back on
    k8s:// whatever happened, for the stories after it.)"""
    lab = stories.lab
    assert lab.store == "k8s"
    with story(stories, "move") as s:
        s.apply(statefulset("db", 3, spread="db"), deployment("web", 3, spread="web"))
        db = addresses(s.wait_running("db", 3))
        s.wait_running("web", 3)
        held = held_by(lab, s.ns)
        try:
            for store, web in (("etcd", 6), ("k8s", 3)):
                lab.move_store(store, s.say, KUBE_TUNING)
                assert lab.store == store
                assert held_by(lab, s.ns) == held, f"moved to {store}: the ledger differs"
                s.checks.sample(f"moved to {store}")
                scale_rounds(s, "db", 1, db)
                s.scale("deployment", "web", web)
                s.wait_running("web", web)
                s.checks.sample(f"on {store}")
                held = held_by(lab, s.ns)
        finally:
            if lab.store != "k8s":
                lab.move_store("k8s", s.say, KUBE_TUNING)
        failed = sandbox_failures(s)
        assert not failed, f"sandboxes failed: {failed}"


def bridge_network(name: str, bridge: str, ipam: dict[str, Any]) -> dict[str, Any]:
    """A NetworkAttachmentDefinition `name`: `bridge` on each node's `bridge` (no
    gateway, not routed) with `ipam`."""
    config = {"cniVersion": "0.3.1", "name": name, "type": "bridge", "bridge": bridge}
    return {
        "apiVersion": "k8s.cni.cncf.io/v1",
        "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": name},
        "spec": {"config": json.dumps({**config, "ipam": ipam})},
    }


def second_network(ipam_type: str) -> dict[str, Any]:
    """The network `second` on each node's `cni1`, its `ipam` on SECOND_NET; host-local
    or ipward by `type` alone (ipward names the same range an inline pool, named after
    the network; host-local ignores `agentSocket`)."""
    ipam = {
        "type": ipam_type,
        "ranges": [[{"subnet": str(SECOND_NET)}]],
        "agentSocket": AGENT_SOCKET,
    }
    return bridge_network("second", "cni1", ipam)


def interfaces(pod: dict[str, Any]) -> dict[str, str]:
    """The pod's interfaces and their first addresses, as Multus wrote them."""
    status = json.loads(pod["metadata"].get("annotations", {}).get(NETWORK_STATUS_ANNOTATION, "[]"))
    return {s["interface"]: s["ips"][0] for s in status if s.get("interface") and s.get("ips")}


def test_multus_secondary_network_switched_from_host_local_to_ipward(stories: Stories) -> None:
    """Multus (its thin plugin) in front of the pod network, and a second network (a
    NetworkAttachmentDefinition, `bridge` on `cni1`) asked for by pods: on host-local,
    then switched to ipward by its `type` alone. Pods get two interfaces, both
    addressed by ipward (the pod network's pool and the second network's inline pool,
    one range for every node), and both addresses are freed with the pods."""
    lab = stories.lab
    lab.install_multus()
    try:
        with story(stories, "multus") as s:
            s.apply(second_network("host-local"))
            pod = deployment("multi", 1, node=lab.nodes[0].name)
            pod["spec"]["template"]["metadata"]["annotations"] = {NETWORKS_ANNOTATION: "second"}
            s.apply(pod)
            try:
                first = next(iter(s.wait_running("multi", 1, timeout=60.0).values()))
            except AssertionError:
                lab.remove_multus()  # so that the pods' DELs pass and the teardown ends
                raise
            assert set(interfaces(first)) == {"eth0", "net1"}, interfaces(first)
            assert ipaddress.ip_address(interfaces(first)["net1"]) in SECOND_NET
            s.checks.sample("multus: host-local")

            s.scale("deployment", "multi", 0)
            s.wait_gone("multi")
            s.apply(second_network("ipward"))
            s.checks.networks.append(SECOND_NET)  # ipward's to account for from now on
            pod["spec"]["replicas"] = 6
            pod["spec"]["template"]["spec"] = pod_spec(spread="multi", strict=True)
            s.apply(pod)  # on every node now
            pods = s.wait_running("multi", 6)
            records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
            mine = {
                (r["pod"]["uid"], r["ifname"]): r
                for r in records
                if r["pod"].get("namespace") == s.ns
            }
            for p in pods.values():
                found = interfaces(p)
                assert set(found) == {"eth0", "net1"}, found
                for ifname, pool in (("eth0", POOL), ("net1", "second")):
                    record = mine.get((p["metadata"]["uid"], ifname))
                    assert record is not None, f"{p['metadata']['name']} {ifname}: no record"
                    assert (record["pool"], record["ip"]) == (pool, found[ifname])
            assert len({p["spec"]["nodeName"] for p in pods.values()}) == len(lab.nodes)
            s.checks.sample("multus: ipward")
            s.scale("deployment", "multi", 0)
            s.wait_gone("multi")
            wait_for(
                lambda: not records_of(lab, s.ns), "both interfaces' addresses freed", 60.0, 0.5
            )
    finally:
        lab.remove_multus()


TINY_NET = ipaddress.ip_network("10.247.0.0/28")  # 13 addresses: not one default block (/26)


def tiny_network() -> dict[str, Any]:
    """The network `tiny` on each node's `cni3`, on the IPPool `tiny`."""
    ipam = {"type": "ipward", "pool": "tiny", "agentSocket": AGENT_SOCKET}
    return bridge_network("tiny", "cni3", ipam)


def test_pool_smaller_than_a_block_per_node_serves_every_node(stories: Stories) -> None:
    """A pool made as users make one, with ipward's defaults (an IPPool of a /28: 13
    addresses, less than one default block of /26, let alone one per node), on a Multus
    secondary network: 9 pods spread over the 3 nodes all start, each with an address
    of the pool, none twice (one node holds the pool's only block, the others borrow
    from it); the pool says no node is left out (NodesLimited False); the addresses are
    freed with the pods, and the pool deleted once they are."""
    lab = stories.lab
    lab.install_multus()
    pool = {
        "apiVersion": "ipward.io/v1alpha1",
        "kind": "IPPool",
        "metadata": {"name": "tiny"},
        "spec": {"ranges": [{"subnet": str(TINY_NET)}]},
    }
    try:
        with story(stories, "tiny", networks=(TINY_NET,)) as s:
            lab.kubectl("apply", "--filename=-", input=json.dumps(pool))
            lab.kubectl("wait", "--for=condition=Ready", "--timeout=60s", "ippool.ipward.io/tiny")
            s.apply(tiny_network())
            pods = deployment("small", 9, spread="small", strict=True)
            pods["spec"]["template"]["metadata"]["annotations"] = {NETWORKS_ANNOTATION: "tiny"}
            s.apply(pods)
            running = s.wait_running("small", 9)
            assert len({p["spec"]["nodeName"] for p in running.values()}) == len(lab.nodes)
            net1 = [interfaces(p).get("net1") for p in running.values()]
            assert all(ip and ipaddress.ip_address(ip) in TINY_NET for ip in net1), net1
            assert len(set(net1)) == 9, f"an address twice: {sorted(map(str, net1))}"
            records = json.loads(lab.ipward_run("alloc", "list", "--json").stdout)
            held = {r["ip"] for r in records if r["pool"] == "tiny"}
            assert held == set(net1), f"the ledger's {sorted(held)}, the pods' {sorted(net1)}"
            obj = lab.kubectl_json("get", "ippool.ipward.io", "tiny")
            limited = [c for c in obj["status"]["conditions"] if c["type"] == "NodesLimited"]
            assert limited and limited[0]["status"] == "False", obj["status"]
            s.checks.sample("tiny: 9 pods on 3 nodes")
            s.scale("deployment", "small", 0)
            s.wait_gone("small")
            wait_for(lambda: not records_of(lab, s.ns), "the pool's addresses freed", 60.0, 0.5)
            lab.kubectl("delete", "ippool.ipward.io", "tiny", "--wait=true", "--timeout=60s")
    finally:
        lab.kubectl("delete", "ippool.ipward.io", "tiny", "--ignore-not-found", check=False)
        lab.remove_multus()


# NetworkAttachmentDefinitions whose ipward config is invalid: what is wrong in each
# `ipam`, and the field its error names.
BAD_NETWORKS: dict[str, tuple[dict[str, Any], str]] = {
    "bad-grace": ({"gcGrace": "soon"}, "gcGrace"),
    "bad-pool": ({"pool": 123}, "pool"),
    "bad-socket": ({"agentSocket": "run/ipward/agent.sock"}, "agentSocket"),
}


def bad_network(name: str) -> dict[str, Any]:
    """BAD_NETWORKS' `name`: `bridge` on each node's `cni2`, its ipward `ipam` wrong."""
    wrong, _ = BAD_NETWORKS[name]
    ipam = {
        "type": "ipward",
        "ranges": [[{"subnet": "10.246.0.0/24"}]],
        "agentSocket": AGENT_SOCKET,
    }
    return bridge_network(name, "cni2", {**ipam, **wrong})


def test_pods_of_a_bad_network_never_start_and_go_once_deleted(stories: Stories) -> None:
    """Pods asking (through Multus) for a network whose ipward config is invalid
    (BAD_NETWORKS: a `gcGrace` that is no number, a `pool` that is no name, a relative
    `agentSocket`): each sandbox fails with an error naming the field, and the pods never
    start. Deleted, they go: every DEL of such a config succeeds, as no ADD of it held
    an address (none Terminating for good); their pod network addresses were freed by
    their DELs."""
    lab = stories.lab
    lab.install_multus()
    try:
        with story(stories, "bad-network") as s:
            pods = []
            for name in BAD_NETWORKS:
                pod = bare_pod(name)
                pod["metadata"]["annotations"] = {NETWORKS_ANNOTATION: name}
                pods.append(pod)
            s.apply(*(bad_network(name) for name in BAD_NETWORKS), *pods)

            def refused() -> bool:
                return all(
                    any(field in e["message"] for e in events(s, name, "FailedCreatePodSandBox"))
                    for name, (_, field) in BAD_NETWORKS.items()
                )

            try:
                wait_for(refused, "every pod's sandbox refused, naming its field", 90.0, 1.0)
            except ClusterError as e:
                raise AssertionError(f"{e}: {sandbox_failures(s)}") from None
            assert not s.running()
            s.checks.sample("bad-network: refused")
            s.kubectl("delete", "pod", *BAD_NETWORKS, "--wait=false")
            try:
                wait_for(lambda: not s.pods(), "the deleted pods gone", 90.0, 0.5)
            except ClusterError as e:
                states = {p["metadata"]["name"]: s.state_of(p) for p in s.pods()}
                raise AssertionError(f"{e}: {states}") from None
    finally:
        lab.remove_multus()
