"""Garbage collection: which allocation records are leaked, and freeing them safely
(docs/design.md 5.4 for the controller and `ipward gc`, 5.5 for the agent's own node).

The rules, in the order they are applied to one record (its attachment = network,
sandbox ID, ifname; created_at = when its ADD committed):

1. Records are read first, with their revisions; liveness after. A record created
   after the read is not judged; one changed after it fails the compare-and-delete.
2. Evidence must be fresh: a view counts only when `view.as_of - added >= grace` (the
   ADD grace), `added` being the latest time on the judge's clock the ADD may have
   committed: `created_at` corrected by the writer's measured clock offset, or when
   the judge first saw the record, whichever is later (`ipward.gc.clocks`). That covers
   an ADD in flight (its sandbox is listed only once the runtime's RunPodSandbox
   returns), any source that lags (a view older than that says nothing about the
   record, so it is kept) and clocks that disagree or step.
3. The runtime of the record's node answered:
   - lists the sandbox ready: alive, kept, whatever else says;
   - does not list it at all: candidate, `sandbox-gone`;
   - lists it not ready (stopped; its DEL is the runtime's job): kept unless the pod
     is terminal (below).
4. Otherwise (or for a stopped sandbox), the cluster answered:
   - the record's node is not registered (its lease expired) and the cluster does not
     list it: candidate, `node-gone`;
   - in cluster mode (`Evidence.agents`: the controller; `ipward gc` when some node is
     registered), the record's node is listed but its agent is not registered, and its
     runtime did not answer: kept. A sandbox whose DEL its agent refused while down may
     still hold the address in its network namespace (the runtime stopped it and its
     teardown failed there; the kubelet retries no teardown of a deleted pod): its
     agent, once back, has the runtime finish it, and the DEL frees the address
     (`agent/reconcile.py`); until then the cluster's word frees nothing there;
   - no pod with the record's UID: candidate, `pod-gone` (a pod with the same name and
     another UID is another pod; a sticky reservation, when there is one, keeps it),
     except in cluster mode on a node whose registered agent judges its records by its
     runtime (`NodeRegistration.runtime`) when no runtime view was given here (the
     controller's `k8s://` has none): kept, left to that agent. A pod the API no longer
     lists may still run: force-deleted, its sandbox runs until its kubelet kills it (a
     whole grace period later), its address in its network namespace until the
     teardown's DEL, which frees it (or that agent, as `sandbox-gone`). A finished pod's
     time is known: `pod-terminal` below waits out its grace after it. A
     static pod's record holds its own UID, which the cluster lists only as the
     `kubernetes.io/config.mirror` annotation of its mirror pod: that pod is its pod
     (`ClusterView.pod`, and the live confirmation likewise);
   - the pod is Succeeded or Failed, and its termination grace has passed since it
     finished: candidate, `pod-terminal`;
   - otherwise alive, kept.
5. No source answered for the record's node: kept (docs/design.md invariant 8, fail closed). A
   runtime listing two ready sandboxes for one pod UID is not trusted at all: the
   whole node's view is dropped and logged loudly.
6. The controller frees a candidate only when it was a candidate at the same record
   revision on the previous pass too (`Confirmations`); the agent, whose runtime is
   local and authoritative, frees on one pass. Every free is a compare-and-delete on
   the record's revision (`Ledger.free_address`), logged and counted by reason.
7. Just before freeing on the cluster's word (`pod-gone`, `pod-terminal`, `node-gone`,
   a reservation's retirement), the source is asked once more, live
   (`confirmed_live`): a source answering from caches (`k8s://`) reads the pod, node or
   StatefulSet from the API itself, and anything but a clean confirmation keeps the
   record for the next pass. A runtime's `sandbox-gone` is its own live list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ipward.cluster.liveness import (
    ClusterView,
    Confirmation,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
)
from ipward.core import keys, log, testpoints
from ipward.core import records as rec
from ipward.core.errors import OwnerChanged
from ipward.core.names import node_name_problem
from ipward.core.records import AddressRecord, NodeRegistration, PodInfo, ReservationRecord
from ipward.gc.clocks import Clock, Offset, measure_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from ipward.ipam.ledger import Ledger
    from ipward.store.base import Compare, KeyValue, Store

# Candidate reasons (metrics labels; the README explains each).
SANDBOX_GONE = "sandbox-gone"
POD_GONE = "pod-gone"
POD_TERMINAL = "pod-terminal"
NODE_GONE = "node-gone"
REASONS = (SANDBOX_GONE, POD_GONE, POD_TERMINAL, NODE_GONE)
# Reasons a detached sticky reservation is retired.
SET_DELETED = "statefulset-deleted"
ORDINAL_OUT = "ordinal-out-of-range"
TTL_EXPIRED = "ttl-expired"
RETIRE_REASONS = (SET_DELETED, ORDINAL_OUT, TTL_EXPIRED)


@dataclass(frozen=True, slots=True)
class Held:
    """One allocation record as read, with the revision a free must compare, and when
    (monotonic) a judge following a watch first saw that revision (None: one read)."""

    pool: str
    ip: str
    mod_revision: int
    record: AddressRecord
    seen: float | None = field(default=None, compare=False)

    @property
    def ref(self) -> str:
        return rec.pool_ip(self.pool, self.ip)

    @property
    def node(self) -> str:
        return self.record.node

    @property
    def container(self) -> str:
        return self.record.container

    @property
    def created_at(self) -> float:
        """When its ADD committed (0 in a record that does not say: judged as old)."""
        return float(self.record.created_at or 0.0)

    @property
    def pod(self) -> PodInfo:
        return self.record.pod

    @property
    def attachment(self) -> str:
        return repr(self.record.attachment)


@dataclass(frozen=True)
class Verdict:
    held: Held
    reason: str | None  # a candidate's reason, None when kept
    evidence: str  # why, in words (logged, and shown by `ipward gc --dry-run`)
    # Kept, and stays kept however time passes while the record, its sandbox as its
    # runtime lists it, its pod, its node's listing and registration, and which sources
    # answer stay the same (the controller judges it again only when one of them
    # changes). False for a candidate and for a verdict that waits on time: a grace.
    settled: bool = False

    @property
    def key(self) -> str:
        return keys.ip_key(self.held.pool, self.held.ip)

    @property
    def revision(self) -> int:
        return self.held.mod_revision

    def to_dict(self) -> dict:
        pod = self.held.pod
        return {
            "address": self.held.ref,
            "attachment": self.held.attachment,
            "node": self.held.node,
            "pod": f"{pod.namespace}/{pod.name}",
            "uid": pod.uid,
            "created_at": self.held.created_at,
            "revision": self.held.mod_revision,
            "reason": self.reason,
            "evidence": self.evidence,
        }


def snapshot(store: Store) -> list[Held]:
    """Every allocation record, with its revision."""
    return held_records(store.range(keys.ADDRESSES)[0])


def held_records(kvs: Iterable[KeyValue]) -> list[Held]:
    """The allocation records `kvs` that hold a sandbox."""
    held = []
    for kv in kvs:
        pool, ip = keys.ip_parts(kv.key)
        try:
            record = AddressRecord.decode(kv.value)
        except ValueError:
            log.error("allocation record unreadable; not judged", key=kv.key)
            continue
        if record.is_detached:
            continue  # no sandbox to judge: its reservation is retired by identity
        held.append(Held(pool, ip, kv.mod_revision, record))
    return held


@dataclass(frozen=True)
class Registrations:
    """The nodes whose agent holds a live registration (`nodes/<node>` under a lease),
    those of them whose agent judges its records by its runtime
    (`NodeRegistration.runtime`), and the clock offset each shows (`clocks`)."""

    nodes: frozenset[str] = frozenset()
    runtimes: frozenset[str] = frozenset()
    offsets: Mapping[str, Offset] = field(default_factory=dict)


def registrations(store: Store) -> Registrations:
    """The store's registrations, read now."""
    kvs = store.range(keys.NODES)[0]
    read_at = time.time()
    nodes, runtimes = set(), set()
    for kv in kvs:
        name = keys.registered_node(kv.key)
        if name is None:
            continue
        nodes.add(name)
        try:
            if NodeRegistration.decode(kv.value).runtime:
                runtimes.add(name)
        except ValueError:
            pass  # judged by the cluster's word, as an agent that says nothing
    return Registrations(frozenset(nodes), frozenset(runtimes), measure_all(kvs, read_at))


@dataclass
class Evidence:
    """What the sources said in one pass: a view, or why there is none."""

    grace: float
    nodes: dict[str, NodeView | str] = field(default_factory=dict)
    cluster: ClusterView | str = "not asked"
    registered: frozenset[str] = frozenset()  # nodes holding a live lease
    runtimes: frozenset[str] = frozenset()  # of those, nodes whose agent judges by its runtime
    clock: Clock | None = None  # the judge's clocks after the reads (None: `created_at` as is)
    agents: bool = False  # cluster mode: a listed node without a live agent waits (rule 4)

    def added_at(self, held: Held) -> tuple[float, str]:
        """When the record's ADD may have committed at the latest, on the judge's wall
        clock, and a note when that is not its `created_at` (`clocks.Clock.added_at`)."""
        if self.clock is None:
            return held.created_at, ""
        return self.clock.added_at(held.node, held.created_at, held.seen)


def gather(
    source: LivenessSource | None,
    nodes: Iterable[str],
    *,
    grace: float,
    registered: frozenset[str] = frozenset(),
    runtimes: frozenset[str] = frozenset(),
    agents: bool = False,
    ask_cluster: bool = True,
    offsets: Mapping[str, Offset] | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Evidence:
    """Read liveness for `nodes` (after the records were read). A node whose runtime
    lists two ready sandboxes for one pod UID gets no view: that runtime is not
    trusted (docs/design.md 5.5). `offsets`: the writers' clocks, measured (`clocks`); the
    judge's own (`clock`, `monotonic`) are read after liveness. `agents`: cluster mode;
    `runtimes`: the nodes left to their agents (rule 4)."""
    evidence = Evidence(grace=grace, registered=registered, runtimes=runtimes, agents=agents)
    if source is None:
        evidence.cluster = "no liveness source configured"
        for node in nodes:
            evidence.nodes[node] = "no liveness source configured"
        return evidence
    for node, view in source.node_views(nodes).items():
        duplicates = view.duplicate_pods() if isinstance(view, NodeView) else None
        if duplicates:
            log.error(
                "runtime lists two ready sandboxes for one pod: nothing on this node is"
                " reclaimed until it is resolved",
                node=node,
                duplicates=duplicates,
            )
            view = f"runtime untrusted: one pod, two ready sandboxes {duplicates}"
        evidence.nodes[node] = view
    if ask_cluster:
        try:
            evidence.cluster = source.cluster_view()
        except LivenessUnavailable as e:
            evidence.cluster = str(e)
    evidence.clock = Clock(clock(), monotonic(), offsets or {})
    return evidence


def judge(held: Held, evidence: Evidence) -> Verdict:
    """The rules of this module's docstring for one record."""
    grace = evidence.grace
    added, clock_note = evidence.added_at(held)
    clock_note = f"; {clock_note}" if clock_note else ""
    sandbox_id = held.container
    runtime = evidence.nodes.get(held.node, "not asked")
    stopped = False
    if isinstance(runtime, NodeView):
        age = runtime.as_of - added
        if age < grace:
            return Verdict(
                held,
                None,
                f"runtime view of {held.node} only {age:.1f}s after the ADD (grace"
                f" {grace:g}s{clock_note})",
            )
        sandbox = runtime.sandboxes.get(sandbox_id)
        if sandbox is None:
            return Verdict(
                held,
                SANDBOX_GONE,
                f"runtime of {held.node} lists no sandbox {sandbox_id[:12]} (read"
                f" {age:.0f}s after the ADD{clock_note})",
            )
        if sandbox.ready:
            return Verdict(held, None, f"sandbox {sandbox_id[:12]} ready on {held.node}", True)
        stopped = True
    cluster = evidence.cluster
    if not isinstance(cluster, ClusterView):
        why = runtime if isinstance(runtime, str) else "sandbox stopped"
        return Verdict(held, None, f"no evidence: runtime: {why}; cluster: {cluster}", True)
    age = cluster.as_of - added
    if age < grace:
        return Verdict(
            held,
            None,
            f"cluster view only {age:.1f}s after the ADD (grace {grace:g}s{clock_note})",
        )
    if (
        not stopped
        and held.node not in evidence.registered
        and held.node not in cluster.nodes
        and node_name_problem(held.node) is None  # a name no node can have proves nothing
    ):
        return Verdict(
            held,
            NODE_GONE,
            f"node {held.node}: lease expired and the cluster no longer lists it",
        )
    if evidence.agents and not stopped and held.node not in evidence.registered:
        return Verdict(
            held,
            None,
            f"node {held.node}'s agent is down: its sandboxes' teardowns wait for it (it"
            " frees what its runtime shows gone once back; node-gone once the cluster"
            " no longer lists the node)",
            True,
        )
    pod_info = held.pod
    uid = pod_info.uid
    if not uid:
        return Verdict(held, None, "no pod UID on the record and no runtime answer", True)
    pod = cluster.pod(uid)
    if pod is None:
        if stopped:
            return Verdict(held, None, "sandbox stopped, pod gone: the runtime will DEL it", True)
        if held.node in evidence.runtimes:  # (no runtime view here: it would have answered)
            return Verdict(
                held,
                None,
                f"pod gone, but node {held.node}'s agent judges its sandboxes by its runtime"
                " (a pod gone from the API may still run): its teardown's DEL, or that"
                " agent, frees it",
                True,
            )
        return Verdict(
            held,
            POD_GONE,
            f"cluster has no pod with UID {uid} ({pod_info.namespace}/"
            f"{pod_info.name}; read {age:.0f}s after the ADD{clock_note})",
        )
    if pod.terminal and pod.finished_at is not None:
        since = cluster.as_of - pod.finished_at
        if since >= pod.grace:
            return Verdict(
                held,
                POD_TERMINAL,
                f"pod {pod.namespace}/{pod.name} {pod.phase} {since:.1f}s ago"
                f" (grace {pod.grace:g}s)",
            )
        return Verdict(held, None, f"pod {pod.phase} only {since:.1f}s ago (grace {pod.grace:g}s)")
    if stopped:
        return Verdict(
            held, None, f"sandbox stopped, pod {pod.phase}: the runtime will DEL it", True
        )
    return Verdict(held, None, f"pod {pod.namespace}/{pod.name} {pod.phase}", True)


class _Judged(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def revision(self) -> int: ...

    @property
    def reason(self) -> str | None: ...


J = TypeVar("J", bound=_Judged)


class Confirmations:
    """Candidates of the previous pass, by key and revision: the controller acts only
    on what two passes in a row found at one revision (a new instance starts over,
    which only delays)."""

    def __init__(self) -> None:
        self.previous: dict[str, int] = {}

    def confirm(self, judged: Sequence[J]) -> list[J]:
        current = {j.key: j.revision for j in judged if j.reason}
        confirmed = [j for j in judged if j.reason and self.previous.get(j.key) == j.revision]
        self.previous = current
        return confirmed


def confirmed_live(source: LivenessSource, judged: Verdict | Retirement) -> bool:
    """Rule 7: the source's live word on a candidate the previous passes found; logged
    with its evidence when it does not confirm."""
    if isinstance(judged, Retirement):
        r = judged.reservation
        owner = r.record.owner_name if r.record.owner_kind == "StatefulSet" else ""
        answer = source.confirm_identity_retired(r.namespace, r.name, owner)
        subject = {"sticky": r.key}
    else:
        answer = live_word(source, judged)
        subject = {"address": judged.held.ref, "attachment": judged.held.attachment}
    if not answer.confirmed:
        log.info(
            "not freed: a live read does not confirm the cached view",
            **subject,
            reason=judged.reason,
            evidence=answer.evidence,
        )
    return answer.confirmed


def live_word(source: LivenessSource, verdict: Verdict) -> Confirmation:
    """Rule 7's live read for a record's candidate (`ipward release --liveness` shows it)."""
    pod = verdict.held.pod
    if verdict.reason == POD_GONE:
        return source.confirm_pod_gone(pod.namespace, pod.name, pod.uid)
    if verdict.reason == POD_TERMINAL:
        return source.confirm_pod_terminal(pod.namespace, pod.name, pod.uid)
    if verdict.reason == NODE_GONE:
        return source.confirm_node_gone(verdict.held.node)
    return Confirmation(True, "the runtime's list was the live read")  # sandbox-gone


def free(ledger: Ledger, verdict: Verdict, who: str, fence: Sequence[Compare] = ()) -> bool:
    """Compare-and-delete the record at the revision judged. False when it changed
    (a DEL, a new owner): nothing is touched then."""
    held = verdict.held
    log.debug("freeing", address=held.ref, attachment=held.attachment, reason=verdict.reason)
    testpoints.pause("gc-free")
    try:
        ledger.free_address(
            held.pool,
            held.ip,
            held.mod_revision,
            f"{who}: {verdict.reason}: {verdict.evidence}",
            fence,
        )
    except OwnerChanged:
        log.info(
            "not freed: the record changed since it was judged",
            address=held.ref,
            attachment=held.attachment,
            reason=verdict.reason,
        )
        return False
    return True


@dataclass
class Look:
    """One look at the cluster: what was read, in the order it was read (records and
    reservations, registrations, then liveness), and every record judged."""

    held: list[Held]
    reserved: list[Reservation]
    nodes: list[str]  # the nodes of the records
    evidence: Evidence
    verdicts: list[Verdict]
    retirements: list[Retirement]


def look(store: Store, source: LivenessSource | None, grace: float) -> Look:
    held, reserved = snapshot(store), reservations(store)
    return look_at(held, reserved, registrations(store), source, grace)


def look_at(
    held: list[Held],
    reserved: list[Reservation],
    registered: Registrations,
    source: LivenessSource | None,
    grace: float,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    agents: bool | None = None,
) -> Look:
    """`look` on records, reservations and registrations (with the clock offsets they
    show) already read (rule 1: all of them before liveness, which is read here). A
    store where some node is registered is in cluster mode (rule 4); with none (single-
    node mode, or every agent down), the cluster's word is taken as is. `agents`: cluster
    mode or not, as the judge knows it (a controller always is)."""
    nodes = sorted({h.node for h in held})
    evidence = gather(
        source,
        nodes,
        grace=grace,
        registered=registered.nodes,
        runtimes=registered.runtimes,
        agents=bool(registered.nodes) if agents is None else agents,
        offsets=registered.offsets,
        clock=clock,
        monotonic=monotonic,
    )
    return Look(
        held,
        reserved,
        nodes,
        evidence,
        [judge(h, evidence) for h in held],
        [judge_reservation(r, evidence.cluster, grace) for r in reserved],
    )


def collect_once(
    ledger: Ledger,
    source: LivenessSource | None,
    *,
    grace: float,
    confirm_after: float,
    who: str,
    sleep: Callable[[float], None],
) -> tuple[list[Verdict], list[Verdict]]:
    """`ipward gc`: two looks `confirm_after` apart (the two passes of rule 6), then
    free what both found. Returns (the second look's verdicts, the records freed)."""
    confirmations = Confirmations()
    confirmations.confirm(look(ledger.store, source, grace).verdicts)
    sleep(confirm_after)
    verdicts = look(ledger.store, source, grace).verdicts
    freed = [
        v
        for v in confirmations.confirm(verdicts)
        if source is not None and confirmed_live(source, v) and free(ledger, v, who)
    ]
    return verdicts, freed


# -- sticky reservations -----------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """A sticky reservation as read (`sticky/<network>/<namespace>/<name>`)."""

    key: str
    mod_revision: int
    record: ReservationRecord

    @property
    def namespace(self) -> str:
        return keys.sticky_parts(self.key)[1]

    @property
    def name(self) -> str:
        return keys.sticky_parts(self.key)[2]


@dataclass(frozen=True)
class Retirement:
    reservation: Reservation
    reason: str | None  # why it is retired, None when kept
    evidence: str

    @property
    def key(self) -> str:
        return self.reservation.key

    @property
    def revision(self) -> int:
        return self.reservation.mod_revision

    def to_dict(self) -> dict:
        r = self.reservation
        return {
            "sticky": r.key,
            "ips": r.record.ips,
            "revision": r.mod_revision,
            "reason": self.reason,
            "evidence": self.evidence,
        }


def reservations(store: Store) -> list[Reservation]:
    out = []
    for kv in store.range(keys.STICKY)[0]:
        try:
            out.append(Reservation(kv.key, kv.mod_revision, ReservationRecord.decode(kv.value)))
        except ValueError:
            log.error("sticky reservation unreadable; not judged", key=kv.key)
    return out


def judge_reservation(r: Reservation, cluster: ClusterView | str, grace: float) -> Retirement:
    """Is the identity retired? Never while a sandbox holds the reservation, never while
    the cluster lists any pod of that namespace/name (pending, starting, restarting,
    failed before a restart), and only on a cluster view read at least `grace` after the
    detach. Then: its StatefulSet is gone, or its ordinal is out of range; any other
    identity, its TTL has passed since the detach."""
    held = r.record
    if held.bound:
        return Retirement(r, None, f"bound to {held.attachment}")
    if not isinstance(cluster, ClusterView):
        return Retirement(r, None, f"no evidence: cluster: {cluster}")
    detached = float(held.detached_at or 0.0)
    age = cluster.as_of - detached
    if age < grace:
        return Retirement(r, None, f"cluster view only {age:.1f}s after the detach")
    pods = cluster.pods_named(r.namespace, r.name)
    if pods:
        return Retirement(r, None, f"pod {r.namespace}/{r.name} is {pods[0].phase}")
    kind, owner = held.owner_kind, held.owner_name
    if kind == "StatefulSet":
        replicas = cluster.statefulsets.get(f"{r.namespace}/{owner}")
        if replicas is None:
            return Retirement(r, SET_DELETED, f"StatefulSet {r.namespace}/{owner} is gone")
        ordinal_text = r.name[len(owner) + 1 :] if r.name.startswith(f"{owner}-") else ""
        if ordinal_text.isdigit() and int(ordinal_text) >= replicas:
            return Retirement(
                r, ORDINAL_OUT, f"ordinal {ordinal_text} >= {replicas} replicas of {owner}"
            )
        return Retirement(r, None, f"ordinal {ordinal_text} of {replicas} replicas: comes back")
    ttl = held.ttl
    if ttl is not None and age >= ttl:
        return Retirement(r, TTL_EXPIRED, f"detached {age:.0f}s ago, TTL {ttl:g}s, no pod")
    return Retirement(r, None, f"detached {age:.0f}s ago, TTL {ttl}")


def retire(ledger: Ledger, retirement: Retirement, who: str, fence: Sequence[Compare] = ()) -> bool:
    """Free a retired reservation at the revision judged; False when it moved."""
    try:
        ledger.free_sticky(
            retirement.key,
            retirement.revision,
            f"{who}: {retirement.reason}: {retirement.evidence}",
            fence,
        )
    except OwnerChanged as e:
        log.info(
            "reservation not retired: it changed since it was judged",
            sticky=retirement.key,
            why=e.msg,
        )
        return False
    return True
