"""The simulated cluster's model: nodes with their runtimes' sandboxes, pods, owners and
namespaces, under one lock, and what every other part reads and changes it with (see the
package docstring for the lifecycles). `ClusterModel` holds the whole state; the parts
(`workloads`, `kubelet`, `faults`, `publishing`) are mixins over it, put together by
`cluster.SimCluster`.
"""

from __future__ import annotations

import os
import random
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipward.cluster.liveness import TERMINAL_PHASES, Pod, Sandbox
from ipward_lab.simcluster.mirror import KubeMirror

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward_lab.servers.kube_admin import KubeAdmin

PENDING = "Pending"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

IFNAME = "eth0"
TICK = 0.05  # seconds between background ticks: deadlines are noticed at most this late
EXEC_FAILED = -1  # returncode logged when the plugin could not be run at all (or timed out)

CniExec = Callable[[str, str, dict[str, str], bytes], tuple[int, bytes, bytes]]
"""(node, command, env, stdin) -> (returncode, stdout, stderr): one plugin call."""

PodRef = Pod | str
"""A pod: as returned by `pods()` (found by UID), its UID, or "namespace/name"."""


@dataclass(frozen=True)
class CniCall:
    """One plugin call as the kubelet made it, for tests to assert on."""

    at: float  # clock time the call started
    node: str
    command: str  # ADD or DEL
    sandbox: str
    pod: str  # namespace/name
    uid: str
    why: str  # add, add-failed (DEL after a failed ADD), stop, remove, delayed
    returncode: int
    stdout: str
    stderr: str
    elapsed_ms: float


@dataclass
class SimPod:
    uid: str
    namespace: str
    name: str
    seq: int  # creation order (clocks can stand still)
    grace: float
    owner_kind: str = ""
    owner_name: str = ""
    fixed_node: str = ""
    node: str = ""  # "" until scheduled
    phase: str = PENDING
    deleted_at: float | None = None
    finished_at: float | None = None
    generation: int = 0  # a Deployment's template generation
    ordinal: int = -1  # a StatefulSet's ordinal
    duration: float | None = None  # a Job's pod: seconds Running before Succeeded
    running_since: float | None = None
    sandbox: str | None = None  # the current sandbox's id
    address: str | None = None
    retry_at: float = 0.0
    drop_del: bool = False
    del_delay: float | None = None
    annotations: dict[str, str] = field(default_factory=dict)  # replaced, never mutated
    failed_until: float | None = None  # a restart's Failed phase ends then (then Pending)
    in_api: bool = True  # with an API server: created there (its kubelet may run it)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        """Finished for good (a Job's Succeeded pod). The Failed phase of a restart has
        no `finished_at` and is not terminal: the pod will run again."""
        return self.phase in TERMINAL_PHASES and self.finished_at is not None

    def public(self) -> Pod:
        return Pod(
            uid=self.uid,
            namespace=self.namespace,
            name=self.name,
            phase=self.phase,
            node=self.node,
            deleted_at=self.deleted_at,
            grace=self.grace,
            finished_at=self.finished_at,
            owner_kind=self.owner_kind,
            owner_name=self.owner_name,
            annotations=dict(self.annotations),
        )


@dataclass
class SimSandbox:
    id: str
    pod_uid: str
    namespace: str
    name: str
    created_at: float
    listed: bool = False  # the runtime lists it (its ADD succeeded)
    ready: bool = False
    stopped: bool = False  # StopPodSandbox done
    busy: bool = False  # a kubelet task holds it
    retry_at: float = 0.0  # the kubelet acts on it again not before (a retry, a slow stop)
    drop_del: bool = False  # its teardown sends no DEL
    del_delay: float | None = None  # its teardown sends the DELs this much later
    del_mode: str = ""  # chosen when its teardown starts: "del", "drop" or "delay"

    def public(self) -> Sandbox:
        return Sandbox(
            id=self.id,
            ready=self.ready,
            namespace=self.namespace,
            name=self.name,
            uid=self.pod_uid,
            created_at=self.created_at,
        )


class SimNode:
    def __init__(self, name: str, agent_socket: str, workers: int) -> None:
        self.name = name
        self.agent_socket = agent_socket
        self.up = True
        self.sandboxes: dict[str, SimSandbox] = {}
        self.kubelet = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kubelet-{name}")


@dataclass
class Deployment:
    namespace: str
    name: str
    replicas: int
    node: str
    grace: float
    generation: int = 0
    annotations: dict[str, str] = field(default_factory=dict)  # the pod template's


@dataclass
class StatefulSet:
    namespace: str
    name: str
    replicas: int
    ordered: bool
    node: str
    grace: float
    annotations: dict[str, str] = field(default_factory=dict)  # the pod template's


@dataclass
class Job:
    namespace: str
    name: str
    completions: int
    parallelism: int
    duration: float
    ttl_after_finished: float | None
    node: str
    grace: float
    succeeded: int = 0
    finished_at: float | None = None
    annotations: dict[str, str] = field(default_factory=dict)  # the pod template's


Owner = Deployment | StatefulSet | Job
OWNER_KINDS: dict[type, str] = {
    Deployment: "Deployment",
    StatefulSet: "StatefulSet",
    Job: "Job",
}


@dataclass
class Snapshot:
    as_of: float
    cluster: dict[str, Any]
    runtimes: dict[str, dict[str, Any]]  # nodes that are up


@dataclass
class DelayedDel:
    due: float
    node: str
    sandbox: SimSandbox


class ClusterModel:
    """The state of the simulated cluster and the operations on its nodes, namespaces
    and pods. Thread-safe; abstract: `cluster.SimCluster` adds the other parts."""

    def __init__(
        self,
        state_path: str,
        plugin_path: str | None = None,
        network: str = "simnet",
        pool: str = "sim",
        *,
        clock: Callable[[], float] = time.time,
        cni_exec: CniExec | None = None,
        grace: float = 30.0,
        exit_after: float | None = 0.0,
        retry_delay: float = 1.0,
        drop_del_rate: float = 0.0,
        kubelet_workers: int = 4,
        publish_interval: float = 0.2,
        history_seconds: float = 60.0,
        cni_timeout: float = 60.0,
        seed: int | None = None,
        log_limit: int = 100_000,
        api: KubeAdmin | None = None,
    ) -> None:
        """`plugin_path`: the installed plugin, exec'd unless `cni_exec` replaces the
        exec. `grace`: default termination grace of pods. `exit_after`: seconds after a
        deletion the containers exit by themselves (None: they run out the whole grace).
        `drop_del_rate`: probability that a sandbox's teardown sends no DEL at all (also
        settable later as an attribute). `history_seconds`: how far back (clock time)
        snapshots are kept for lag faults. `seed`: for uids, sandbox ids, names and drops.
        `api`: a Kubernetes API server to keep in step with the model (`mirror`); the
        state file then carries the runtimes only.
        """
        if plugin_path is None and cni_exec is None:
            raise ValueError("SimCluster needs plugin_path or cni_exec")
        self.state_path = state_path
        self.plugin_path = plugin_path
        self.network = network
        self.pool = pool
        self.clock = clock
        self.grace = grace
        self.exit_after = exit_after
        self.retry_delay = retry_delay
        self.drop_del_rate = drop_del_rate
        self.list_delay = 0.0  # seconds from a successful ADD to the sandbox being listed
        self.kubelet_workers = kubelet_workers
        self.publish_interval = publish_interval
        self.history_seconds = history_seconds
        self.cni_timeout = cni_timeout
        self._cni_exec: CniExec | None = cni_exec  # None: the kubelet execs the plugin
        self._cni_path = os.path.dirname(plugin_path) if plugin_path else ""
        self._rng = random.Random(seed)
        # One reentrant lock for the whole model, so `wait_until` predicates may call
        # `pods()` and friends while holding it.
        self._cond = threading.Condition(threading.RLock())
        self._publish_lock = threading.Lock()  # order: _publish_lock, then _cond
        self._nodes: dict[str, SimNode] = {}
        self._pods: dict[str, SimPod] = {}
        self._owners: dict[str, Owner] = {}  # by "namespace/name"
        self._namespaces: dict[str, dict[str, str]] = {}  # annotations, by name
        self._delayed: list[DelayedDel] = []
        self._seq = 0
        self._version = 0  # bumped by every change of the model
        self._ticks = 0  # ended (`SimCluster.wait_ticks`)
        self._history: deque[Snapshot] = deque()
        self._snapshot_version = -1
        self._published_version = -1
        self._interned: dict[str, Pod | Sandbox] = {}  # the last snapshot's, by uid or id
        self._cluster_fail: str | None = None
        self._cluster_lag = 0.0
        self._runtime_fail: dict[str, str] = {}
        self._runtime_stall: dict[str, float] = {}
        self._runtime_lag: dict[str, float] = {}
        self._events: deque[tuple[float, str, str]] = deque(maxlen=log_limit)
        self._calls: deque[CniCall] = deque(maxlen=log_limit)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_publish = 0.0
        self._mirror = KubeMirror(api) if api is not None else None
        self._mirror_wake = threading.Event()
        self._mirror_thread: threading.Thread | None = None
        self._mirrored_version = -1  # the model's version the API server last caught up with
        self.mirror_failure = ""  # why the last round of API requests stopped, "" if none
        self._aliases: dict[str, str] = {}  # a pod's UID before the API server gave it one
        self._publish(None)  # readers find a state from the start

    # -- nodes -----------------------------------------------------------------------

    def add_node(self, name: str, agent_socket: str) -> None:
        """A node whose plugin calls go to the agent at `agent_socket` (name it as the
        agent's `--node`: records carry the agent's node name)."""
        with self._mutate():
            if name in self._nodes:
                raise ValueError(f"node {name} exists")
            self._nodes[name] = SimNode(name, agent_socket, self.kubelet_workers)
            self._event("node", f"added {name}")

    def node_down(self, name: str) -> None:
        """The node becomes unreachable: its runtime is no longer published (readers get
        LivenessUnavailable), its kubelet does nothing (calls already running finish),
        its pods stay in the API as they are, as with a real unreachable node."""
        with self._mutate():
            self._node(name).up = False
            self._event("node", f"down {name}")

    def node_up(self, name: str) -> None:
        """The node is back: its runtime answers and its kubelet catches up (sandboxes of
        pods deleted meanwhile are torn down, with their DELs)."""
        with self._mutate():
            self._node(name).up = True
            self._event("node", f"up {name}")

    def delete_node(self, name: str) -> None:
        """The node leaves the cluster: its pods are force-deleted from the API (their
        owners recreate them elsewhere), its runtime is gone, and nobody sends the DELs
        for its sandboxes (their records are for garbage collection to find)."""
        with self._mutate():
            node = self._node(name)
            del self._nodes[name]
            node.kubelet.shutdown(wait=False, cancel_futures=True)
            for pod in [p for p in self._pods.values() if p.node == name]:
                self._forget(pod, "force-deleted with its node")
            self._delayed = [d for d in self._delayed if d.node != name]
            self._runtime_fail.pop(name, None)
            self._runtime_stall.pop(name, None)
            self._runtime_lag.pop(name, None)
            self._event("node", f"deleted {name} ({len(node.sandboxes)} sandboxes left behind)")

    # -- namespaces ------------------------------------------------------------------

    def set_namespace(self, name: str, annotations: dict[str, str]) -> None:
        """Create the namespace `name`, or replace its annotations (a copy is kept).
        Published in the cluster part as "namespaces": {name: annotations}
        (`ClusterView.namespaces`), every namespace given here, even with no annotations;
        namespaces that only have pods are not published. Pods need no namespace set."""
        copied = checked_annotations(annotations)
        with self._mutate():
            self._namespaces[name] = copied
            self._event("namespace", f"set {name} {copied}")

    # -- pods ------------------------------------------------------------------------

    def create_pod(
        self,
        namespace: str,
        name: str,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> Pod:
        """A pod with no owner, on `node` or the least-loaded live node, with a copy of
        `annotations` (published as `Pod.annotations`)."""
        copied = checked_annotations(annotations)
        with self._mutate():
            if self._named(namespace, name) is not None:
                raise ValueError(f"pod {namespace}/{name} exists")
            pod = self._new_pod(namespace, name, node or "", grace, annotations=copied)
            return pod.public()

    def annotate_pod(self, ref: PodRef, annotations: dict[str, str]) -> None:
        """Replace the pod's annotations with a copy of `annotations` (the whole set, not a
        merge: pass `{**sim.pod(ref).annotations, key: value}` to add one). Any pod in the
        API may be annotated, terminating or finished ones too; its owner's template is
        unchanged (pods created later get the template's)."""
        copied = checked_annotations(annotations)
        with self._mutate():
            pod = self._resolve(ref)
            pod.annotations = copied
            self._event("pod", f"annotated {pod.key} {pod.uid} {copied}")

    def delete_pod(self, ref: PodRef, grace: float | None = None, force: bool = False) -> None:
        """Delete a pod: `deleted_at` is set and the kubelet terminates it (see the
        module docstring); `grace` overrides the pod's. `force` removes it from the API
        at once, as `kubectl delete --force` does: the kubelet then finds an orphan
        sandbox and tears it down (with both DELs) when it can; with `grace`, its
        containers ignore SIGTERM and take that long to be killed, so the sandbox runs
        on, ready, until then (a real kubelet still waits the pod's grace period)."""
        with self._mutate():
            pod = self._resolve(ref)
            if force:
                sandbox = self._sandbox_of(pod)
                if grace is not None and sandbox is not None:
                    sandbox.retry_at = max(sandbox.retry_at, self.clock() + grace)
                self._forget(pod, "force-deleted")
            else:
                self._delete(pod, self.clock(), grace)

    def restart_pod(self, ref: PodRef, failed_for: float = 0.0, pending_for: float = 0.0) -> None:
        """The pod's sandbox dies: it is listed not ready; the kubelet stops it (DEL),
        starts a new sandbox for the same pod (same UID and name, ADD) once the old one is
        stopped, and removes the old one (DEL again). `address_of` is None from now until
        the new sandbox's ADD succeeds.

        Phases (clock time from now; the old sandbox's DELs go on meanwhile):
          * `failed_for` > 0: the pod is published "Failed" for that long, with
            `finished_at` None (it is not finished: it will restart; its Job does not
            replace it, and it runs its whole `duration` again); no sandbox is started;
          * then, `pending_for` > 0: "Pending" for that long, no sandbox started;
          * then the kubelet starts the new sandbox. While its ADD is in flight the pod
            is published Pending if `failed_for` or `pending_for` was > 0 (it stays
            Pending until the ADD succeeds), otherwise still Running, as before the
            restart. Either way it is Running, with its new address, once the ADD
            succeeded (a failed ADD is retried as for any pod, still Pending/Running).
        With both 0 the pod stays Running throughout. A restart does not cut short a wait
        already running (a failed ADD's `retry_delay`, an earlier restart's phases)."""
        if failed_for < 0 or pending_for < 0:
            raise ValueError("failed_for and pending_for must be >= 0")
        with self._mutate():
            pod = self._resolve(ref)
            if pod.terminal or pod.deleted_at is not None:
                raise ValueError(f"pod {pod.key} is finished or being deleted")
            now = self.clock()
            sandbox = self._sandbox_of(pod)
            if sandbox is not None:
                sandbox.ready = False
            pod.sandbox = None
            pod.address = None
            pod.retry_at = max(pod.retry_at, now + failed_for + pending_for)
            if failed_for > 0:
                pod.phase = FAILED
                pod.failed_until = now + failed_for
            elif pending_for > 0 or pod.phase == FAILED:
                pod.phase = PENDING
                pod.failed_until = None
            phases = f" (Failed {failed_for:g}s, then Pending {pending_for:g}s)"
            self._event("pod", f"sandbox died {pod.key} {pod.uid}{phases}")

    # -- observation -----------------------------------------------------------------

    def pods(self, namespace: str | None = None) -> list[Pod]:
        """The pods in the API now (in creation order). With an API server, the model's:
        the server follows (`wait_mirrored`)."""
        with self._cond:
            found = sorted(self._pods.values(), key=lambda p: p.seq)
            return [p.public() for p in found if namespace in (None, p.namespace)]

    def pod(self, ref: PodRef) -> Pod:
        """One pod of the API now; KeyError if it is not there."""
        with self._cond:
            return self._resolve(ref).public()

    def address_of(self, ref: PodRef) -> str | None:
        """The address the pod's current sandbox got (kept by a completed pod); None
        while it has none."""
        with self._cond:
            return self._resolve(ref).address

    def ready_addresses(self) -> dict[str, list[Pod]]:
        """address -> the Running pods whose ready sandbox holds it. More than one pod
        for an address is a duplicate."""
        out: dict[str, list[Pod]] = {}
        with self._cond:
            for pod in self._pods.values():
                sandbox = self._sandbox_of(pod)
                if pod.phase == RUNNING and pod.address and sandbox and sandbox.ready:
                    out.setdefault(pod.address, []).append(pod.public())
        return out

    @property
    def events(self) -> list[tuple[float, str, str]]:
        """(clock time, kind, detail); kinds: node, namespace, pod, owner, ADD, DEL, fault,
        error."""
        with self._cond:
            return list(self._events)

    @property
    def calls(self) -> list[CniCall]:
        """Every plugin call, in the order they ended."""
        with self._cond:
            return list(self._calls)

    def calls_for(self, sandbox: str) -> list[CniCall]:
        """The plugin calls for one sandbox (container ID)."""
        with self._cond:
            return [c for c in self._calls if c.sandbox == sandbox]

    def sandboxes_of(self, ref: PodRef) -> list[str]:
        """Ids of the pod's sandboxes, oldest first, from the log of calls (so a sandbox
        shows once its first call has ended); the pod may have left the API."""
        with self._cond:
            if isinstance(ref, Pod):
                uid = ref.uid
            elif "/" in ref:
                uid = self._resolve(ref).uid
            else:
                uid = self._aliases.get(ref, ref)
            return list(dict.fromkeys(c.sandbox for c in self._calls if c.uid == uid))

    # -- the model (under the lock) ----------------------------------------------------

    @contextmanager
    def _mutate(self) -> Iterator[None]:
        """A change of the model: under the lock, then published and waiters woken."""
        with self._cond:
            yield
            version = self._bump()
        self._publish(version)

    def _bump(self) -> int:
        """Record a change: waiters and the background thread wake up."""
        self._version += 1
        self._cond.notify_all()
        self._wake.set()
        self._mirror_wake.set()
        return self._version

    def _event(self, kind: str, detail: str) -> None:
        self._events.append((self.clock(), kind, detail))

    def _node(self, name: str) -> SimNode:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no node {name}") from None

    def _grace(self, grace: float | None) -> float:
        return self.grace if grace is None else grace

    def _named(self, namespace: str, name: str) -> SimPod | None:
        for pod in self._pods.values():
            if pod.namespace == namespace and pod.name == name:
                return pod
        return None

    def _resolve(self, ref: PodRef) -> SimPod:
        if isinstance(ref, Pod):
            ref = ref.uid
        if "/" in ref:
            namespace, _, name = ref.partition("/")
            found = self._named(namespace, name)
        else:
            found = self._pods.get(self._aliases.get(ref, ref))
        if found is None:
            raise KeyError(f"no pod {ref} in the API")
        return found

    def _sandbox_of(self, pod: SimPod) -> SimSandbox | None:
        node = self._nodes.get(pod.node)
        if node is None or pod.sandbox is None:
            return None
        return node.sandboxes.get(pod.sandbox)

    def _sandboxes_of(self, pod: SimPod) -> list[SimSandbox]:
        """The pod's sandboxes whose teardown has not started."""
        node = self._nodes.get(pod.node)
        if node is None:
            return []
        return [s for s in node.sandboxes.values() if s.pod_uid == pod.uid and not s.del_mode]

    def _ready(self, pod: SimPod) -> bool:
        sandbox = self._sandbox_of(pod)
        return pod.phase == RUNNING and sandbox is not None and sandbox.ready

    def _new_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        grace: float | None,
        owner: Owner | None = None,
        **fields: Any,
    ) -> SimPod:
        self._seq += 1
        pod = SimPod(
            uid=str(uuid.UUID(int=self._rng.getrandbits(128), version=4)),
            namespace=namespace,
            name=name,
            seq=self._seq,
            grace=self._grace(grace),
            owner_kind=OWNER_KINDS[type(owner)] if owner else "",
            owner_name=owner.name if owner else "",
            fixed_node=node,
            **fields,
        )
        if owner is not None:
            pod.annotations = dict(owner.annotations)
        pod.in_api = self._mirror is None
        self._pods[pod.uid] = pod
        self._event("pod", f"created {pod.key} {pod.uid}")
        return pod

    def _random_name(self, namespace: str, prefix: str) -> str:
        while True:
            name = f"{prefix}-{''.join(self._rng.choices(string.ascii_lowercase, k=5))}"
            if self._named(namespace, name) is None:
                return name

    def _delete(self, pod: SimPod, now: float, grace: float | None = None) -> None:
        if pod.deleted_at is not None:
            return
        pod.deleted_at = now
        if grace is not None:
            pod.grace = grace
        self._event("pod", f"deleted {pod.key} {pod.uid}")

    def _forget(self, pod: SimPod, why: str) -> None:
        """The pod leaves the API."""
        del self._pods[pod.uid]
        self._event("pod", f"gone {pod.key} {pod.uid} ({why})")

    def _termination_due(self, pod: SimPod, now: float) -> bool:
        assert pod.deleted_at is not None
        if pod.terminal or pod.sandbox is None:
            wait = 0.0  # no container left to stop
        elif self.exit_after is None:
            wait = pod.grace
        else:
            wait = min(pod.grace, self.exit_after)
        return now >= pod.deleted_at + wait

    def _remove_sandbox(self, node: SimNode, sandbox: SimSandbox) -> None:
        node.sandboxes.pop(sandbox.id, None)
        pod = self._pods.get(sandbox.pod_uid)
        if pod is not None and pod.sandbox == sandbox.id:
            pod.sandbox = None
            pod.address = None

    def _publish(self, version: int | None) -> None:
        """Publish the state (`publishing.Publishing`) unless one since `version` did."""
        raise NotImplementedError


def checked_annotations(annotations: dict[str, str] | None) -> dict[str, str]:
    """A copy of `annotations`, checked: the published format has strings only."""
    copied = dict(annotations or {})
    for key, value in copied.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"annotation {key!r}: {value!r}: keys and values must be str")
    return copied
