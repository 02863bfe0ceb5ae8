"""A simulated Kubernetes-like cluster that drives the real ipward plugin.

Why it exists: garbage collection is only as good as the lifecycles it is tested against,
and the ones that make IPAMs leak or hand out an address twice are the kubelet's and the
runtime's, not a test's idea of them: DEL sent twice (stop, then remove), a DEL that never
comes, a Job's pod that completes and keeps its sandbox (and address) until the pod is
deleted, a StatefulSet pod coming back under the same name with a new UID, an unreachable
node whose pods stay in the API, a liveness source that lags or fails. This module plays
those lifecycles with real plugin processes talking to real agents, and publishes what a
runtime and the orchestrator would answer, for `ipward.liveness.SimFileSource` readers
(agents and controllers in other processes).

Model
  * Nodes, each with a runtime (its pod sandboxes) and a kubelet (a small thread pool that
    execs the plugin; never under the model's lock while a subprocess runs).
  * Pods: Pending until a sandbox's ADD succeeds, then Running; Job pods become Succeeded
    after their duration; a restarted pod (`restart_pod`) may be Failed, then Pending,
    before its new sandbox runs. A sandbox is listed by the runtime only once its ADD
    succeeded; a failed ADD is followed by a DEL of that sandbox and, `retry_delay` later,
    a new sandbox. Deletion: after the grace (or at once when the containers exit, see
    `exit_after`), StopPodSandbox (listed not ready, CNI DEL), RemovePodSandbox (CNI DEL
    again, then not listed), then the pod leaves the API. A CNI DEL that fails is retried
    after `retry_delay`, as the kubelet retries the stop or remove.
  * Owners: Deployments (surge: new pods first, old ones deleted as new ones get ready),
    StatefulSets (OrderedReady or Parallel), Jobs (completions, parallelism, TTL).
  * Scheduling: the least-loaded node that is up, or the owner's fixed node.
  * Annotations: a pod's own (`create_pod`, `annotate_pod`) or its owner's template's
    (every pod of the owner gets a copy); a namespace's (`set_namespace`).

Time: every decision of the model compares against `clock()` (default `time.time`), so a
test can hold or move time. The driver itself runs in real time: the background thread
ticks every `TICK` seconds and whenever something changed, and CNI calls are real
subprocesses. Without `start()`, call `tick()` (or `wait_until`, which ticks).

Publishing: after every change and at least every `publish_interval` seconds while the
background thread runs, `publish()` writes the state in `SimFileSource`'s format:
`as_of` is the clock time of the state; nodes that are down have no runtime entry. The
cluster part holds the pods (with their annotations), the nodes, the StatefulSets'
replicas and the annotations of the namespaces given to `set_namespace`; all of it is one
snapshot, so `lag_cluster` lags namespaces and annotations as it lags pods.

Faults, each a method: `lag_cluster`, `lag_runtime` (a part published from the history of
snapshots), `fail_cluster`, `fail_runtime`, `stall_runtime`, `clear_faults`; they change
what is published, never the model. The file has one `as_of`, so with a lagging part it
carries the oldest `as_of` of the parts shown (a newer part under an older `as_of` is a
conservative claim: readers stay correct). `drop_del`, `delay_del` and `drop_del_rate`
change what the kubelet sends: a sandbox removed with no DEL, or with both DELs late.

Not modelled: eviction of the pods of an unreachable node (delete them, or the node);
the kubelet's exponential backoff (a fixed `retry_delay`); terminally Failed pods (Failed
is only a restart's passing phase); more than one interface per pod. A deleted node's
calls already running still end and are logged.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipward.liveness import TERMINAL_PHASES, Pod, Sandbox, write_sim_state

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
class _SimPod:
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
class _SimSandbox:
    id: str
    pod_uid: str
    namespace: str
    name: str
    created_at: float
    listed: bool = False  # the runtime lists it (its ADD succeeded)
    ready: bool = False
    stopped: bool = False  # StopPodSandbox done
    busy: bool = False  # a kubelet task holds it
    retry_at: float = 0.0
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


class _SimNode:
    def __init__(self, name: str, agent_socket: str, workers: int) -> None:
        self.name = name
        self.agent_socket = agent_socket
        self.up = True
        self.sandboxes: dict[str, _SimSandbox] = {}
        self.kubelet = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kubelet-{name}")


@dataclass
class _Deployment:
    namespace: str
    name: str
    replicas: int
    node: str
    grace: float
    generation: int = 0
    annotations: dict[str, str] = field(default_factory=dict)  # the pod template's


@dataclass
class _StatefulSet:
    namespace: str
    name: str
    replicas: int
    ordered: bool
    node: str
    grace: float
    annotations: dict[str, str] = field(default_factory=dict)  # the pod template's


@dataclass
class _Job:
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


_Owner = _Deployment | _StatefulSet | _Job
_OWNER_KINDS: dict[type, str] = {
    _Deployment: "Deployment",
    _StatefulSet: "StatefulSet",
    _Job: "Job",
}


@dataclass
class _Snapshot:
    as_of: float
    cluster: dict[str, Any]
    runtimes: dict[str, dict[str, Any]]  # nodes that are up


@dataclass
class _DelayedDel:
    due: float
    node: str
    sandbox: _SimSandbox


class SimCluster:
    """The simulated cluster; see the module docstring. Thread-safe."""

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
    ) -> None:
        """`plugin_path`: the installed plugin, exec'd unless `cni_exec` replaces the
        exec. `grace`: default termination grace of pods. `exit_after`: seconds after a
        deletion the containers exit by themselves (None: they run out the whole grace).
        `drop_del_rate`: probability that a sandbox's teardown sends no DEL at all (also
        settable later as an attribute). `history_seconds`: how far back (clock time)
        snapshots are kept for lag faults. `seed`: for uids, sandbox ids, names and drops.
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
        self._cni_exec: CniExec = cni_exec or self.exec_plugin
        self._cni_path = os.path.dirname(plugin_path) if plugin_path else ""
        self._rng = random.Random(seed)
        # One reentrant lock for the whole model, so `wait_until` predicates may call
        # `pods()` and friends while holding it.
        self._cond = threading.Condition(threading.RLock())
        self._publish_lock = threading.Lock()  # order: _publish_lock, then _cond
        self._nodes: dict[str, _SimNode] = {}
        self._pods: dict[str, _SimPod] = {}
        self._owners: dict[str, _Owner] = {}  # by "namespace/name"
        self._namespaces: dict[str, dict[str, str]] = {}  # annotations, by name
        self._delayed: list[_DelayedDel] = []
        self._seq = 0
        self._version = 0  # bumped by every change of the model
        self._history: deque[_Snapshot] = deque()
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
        self.publish()

    # -- driver ----------------------------------------------------------------------

    def start(self) -> SimCluster:
        """Run `tick` in a background thread, and publish at least every
        `publish_interval` seconds, so `as_of` advances while nothing changes."""
        if self._thread is not None or self._closed:
            raise RuntimeError("simulated cluster already started or stopped")
        self._thread = threading.Thread(target=self._run, name="simcluster", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread, let the kubelets finish the calls they have (no
        new ones start), and publish the final state. The cluster cannot be restarted."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            self._closed = True
            kubelets = [n.kubelet for n in self._nodes.values()]
        for kubelet in kubelets:
            kubelet.shutdown(wait=True)
        self.publish()

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self.tick()
                if time.monotonic() - self._last_publish >= self.publish_interval:
                    self.publish()
            except Exception:  # the loop must survive a bug; the event log shows it
                with self._cond:
                    self._event("error", traceback.format_exc())
            self._wake.wait(TICK)

    def tick(self) -> None:
        """Advance every lifecycle to `clock()`: owners' replicas, scheduling, delayed
        DELs, and each live node's kubelet (terminations past grace, Job completions,
        sandbox starts and retries, teardowns). CNI calls are handed to the kubelets'
        threads; this returns without waiting for them."""
        with self._cond:
            if self._closed:
                return
            now = self.clock()
            changed = self._reconcile_owners(now)
            changed |= self._schedule()
            changed |= self._run_delayed_dels(now)
            for node in self._nodes.values():
                if node.up:
                    changed |= self._sync_kubelet(node, now)
            version = self._bump() if changed else None
        if version is not None:
            self._publish(version)

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Wait (real time) until `predicate()` holds, ticking when no background thread
        runs; then publish, so the file is at least as new as what the predicate saw.
        The predicate runs under the model's lock: it sees one consistent state."""
        deadline = time.monotonic() + timeout
        while True:
            if self._thread is None:
                self.tick()
            with self._cond:
                if predicate():
                    seen = self._version
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"simulated cluster: {what or 'condition'} not met in {timeout:g}s"
                    )
                self._cond.wait(min(remaining, TICK))
        self._publish(seen)

    # -- nodes -----------------------------------------------------------------------

    def add_node(self, name: str, agent_socket: str) -> None:
        """A node whose plugin calls go to the agent at `agent_socket` (name it as the
        agent's `--node`: records carry the agent's node name)."""
        with self._mutate():
            if name in self._nodes:
                raise ValueError(f"node {name} exists")
            self._nodes[name] = _SimNode(name, agent_socket, self.kubelet_workers)
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
        copied = _annotations(annotations)
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
        copied = _annotations(annotations)
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
        copied = _annotations(annotations)
        with self._mutate():
            pod = self._resolve(ref)
            pod.annotations = copied
            self._event("pod", f"annotated {pod.key} {pod.uid} {copied}")

    def delete_pod(self, ref: PodRef, grace: float | None = None, force: bool = False) -> None:
        """Delete a pod: `deleted_at` is set and the kubelet terminates it (see the
        module docstring); `grace` overrides the pod's. `force` removes it from the API
        at once, as `kubectl delete --force` does: the kubelet then finds an orphan
        sandbox and tears it down (with both DELs) when it can."""
        with self._mutate():
            pod = self._resolve(ref)
            if force:
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

    # -- owners ----------------------------------------------------------------------

    def create_deployment(
        self,
        namespace: str,
        name: str,
        replicas: int,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods named `<name>-<5 random letters>`, kept at `replicas`; `annotations`: the
        pod template's, a copy for every pod of the Deployment."""
        self._add_owner(
            _Deployment(
                namespace,
                name,
                replicas,
                node or "",
                self._grace(grace),
                annotations=_annotations(annotations),
            )
        )

    def create_statefulset(
        self,
        namespace: str,
        name: str,
        replicas: int,
        ordered: bool = True,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods named `<name>-<ordinal>`. `ordered` (OrderedReady): one pod at a time, up
        from the lowest missing ordinal once the lower ones are ready, down from the
        highest once no pod of the set is terminating. Otherwise (Parallel): all at once.
        A pod gone from the API is recreated under its name with a new UID. Pods are
        published with `owner_kind` "StatefulSet" and `owner_name` `name`, the set as
        "statefulsets": {"namespace/name": replicas} (following `scale`, gone with
        `delete_statefulset`). `annotations`: the pod template's, a copy for every pod."""
        self._add_owner(
            _StatefulSet(
                namespace,
                name,
                replicas,
                ordered,
                node or "",
                self._grace(grace),
                annotations=_annotations(annotations),
            )
        )

    def create_job(
        self,
        namespace: str,
        name: str,
        completions: int = 1,
        parallelism: int = 1,
        duration: float = 1.0,
        ttl_after_finished: float | None = None,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods run `duration` seconds, then are Succeeded (their sandbox stopped, listed
        not ready, no DEL: the address stays allocated, as with a real completed pod);
        `ttl_after_finished` seconds after the last completion the pods are deleted
        (None: kept). `annotations`: the pod template's, a copy for every pod."""
        self._add_owner(
            _Job(
                namespace,
                name,
                completions,
                parallelism,
                duration,
                ttl_after_finished,
                node or "",
                self._grace(grace),
                annotations=_annotations(annotations),
            )
        )

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set a Deployment's or StatefulSet's replicas."""
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        with self._mutate():
            owner = self._owner(namespace, name)
            if isinstance(owner, _Job):
                raise ValueError(f"{namespace}/{name} is a Job")
            owner.replicas = replicas
            self._event("owner", f"scaled {namespace}/{name} to {replicas}")

    def rolling_restart(self, namespace: str, name: str) -> None:
        """Replace every pod of a Deployment: new pods first, each old one deleted as a
        new one is ready."""
        with self._mutate():
            owner = self._owner(namespace, name)
            if not isinstance(owner, _Deployment):
                raise ValueError(f"{namespace}/{name} is not a Deployment")
            owner.generation += 1
            self._event("owner", f"rolling restart {namespace}/{name}")

    def delete_statefulset(self, namespace: str, name: str) -> None:
        """The set leaves the API (and the published `statefulsets`); its pods are
        deleted, all at once, with their grace."""
        self._delete_owner(namespace, name, _StatefulSet)

    def delete_deployment(self, namespace: str, name: str) -> None:
        """The Deployment leaves the API; its pods are deleted, all at once."""
        self._delete_owner(namespace, name, _Deployment)

    def delete_job(self, namespace: str, name: str) -> None:
        """The Job leaves the API; its pods, running or finished, are deleted."""
        self._delete_owner(namespace, name, _Job)

    def _delete_owner(self, namespace: str, name: str, kind: type) -> None:
        with self._mutate():
            owner = self._owner(namespace, name)
            if not isinstance(owner, kind):
                raise ValueError(f"{namespace}/{name} is not a {kind.__name__.lstrip('_')}")
            del self._owners[f"{namespace}/{name}"]
            now = self.clock()
            for pod in self._owned(owner):
                self._delete(pod, now)
            self._event("owner", f"deleted {kind.__name__.lstrip('_')} {namespace}/{name}")

    # -- faults ----------------------------------------------------------------------

    def lag_cluster(self, seconds: float) -> None:
        """Publish the cluster part as it was `seconds` ago (the newest snapshot at least
        that old, else the oldest kept), with that snapshot's `as_of` for the whole file."""
        with self._mutate():
            self._cluster_lag = seconds
            self._event("fault", f"cluster lags {seconds:g}s")

    def lag_runtime(self, node: str, seconds: float) -> None:
        """Publish `node`'s runtime as it was `seconds` ago (absent if the node was down
        then), with that snapshot's `as_of` for the whole file."""
        with self._mutate():
            self._node(node)
            self._runtime_lag[node] = seconds
            self._event("fault", f"runtime of {node} lags {seconds:g}s")

    def fail_cluster(self, msg: str) -> None:
        """The orchestrator answers with an error: readers get LivenessUnavailable(msg)."""
        with self._mutate():
            self._cluster_fail = msg
            self._event("fault", f"cluster fails: {msg}")

    def fail_runtime(self, node: str, msg: str) -> None:
        """`node`'s runtime answers with an error (while the node is up)."""
        with self._mutate():
            self._node(node)
            self._runtime_fail[node] = msg
            self._event("fault", f"runtime of {node} fails: {msg}")

    def stall_runtime(self, node: str, seconds: float) -> None:
        """`node`'s runtime hangs for `seconds` (clock time): readers wait, at most their
        timeout, and get LivenessUnavailable. The stall ends by itself."""
        with self._mutate():
            self._node(node)
            self._runtime_stall[node] = self.clock() + seconds
            self._event("fault", f"runtime of {node} stalls {seconds:g}s")

    def clear_faults(self) -> None:
        """End every lag, failure and stall (not drop_del/delay_del: those belong to
        pods, and `drop_del_rate` is an attribute)."""
        with self._mutate():
            self._cluster_fail = None
            self._cluster_lag = 0.0
            self._runtime_fail.clear()
            self._runtime_stall.clear()
            self._runtime_lag.clear()
            self._event("fault", "cleared")

    def drop_del(self, ref: PodRef) -> None:
        """Every teardown of this pod's sandboxes not yet started (also after a force
        delete) sends no CNI DEL, a missed DEL: the sandbox goes away, its record stays.
        The DEL after a failed ADD is still sent."""
        with self._mutate():
            pod = self._resolve(ref)
            pod.drop_del = True
            for sandbox in self._sandboxes_of(pod):
                sandbox.drop_del = True
            self._event("fault", f"DELs of {pod.key} {pod.uid} will be dropped")

    def delay_del(self, ref: PodRef, seconds: float) -> None:
        """Every teardown of this pod's sandboxes not yet started removes the sandbox at
        once and sends both DELs `seconds` later (when the node is up by then)."""
        with self._mutate():
            pod = self._resolve(ref)
            pod.del_delay = seconds
            for sandbox in self._sandboxes_of(pod):
                sandbox.del_delay = seconds
            self._event("fault", f"DELs of {pod.key} {pod.uid} delayed {seconds:g}s")

    # -- observation -----------------------------------------------------------------

    def pods(self, namespace: str | None = None) -> list[Pod]:
        """The pods in the API now (in creation order)."""
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
                uid = ref
            return list(dict.fromkeys(c.sandbox for c in self._calls if c.uid == uid))

    # -- publishing ------------------------------------------------------------------

    def publish(self) -> None:
        """Write the state (with the faults applied) for `SimFileSource` readers."""
        self._publish(None)

    def _publish(self, version: int | None) -> None:
        """Publish, unless a publish since the model reached `version` already covered
        it: kubelet threads finishing together then share one write instead of queueing
        one each (a write is O(cluster))."""
        with self._publish_lock:
            with self._cond:
                if version is not None and self._published_version >= version:
                    return
                self._published_version = self._version
                now = self.clock()
                self._take_snapshot(now)
                as_of, cluster, runtimes = self._compose(now)
            write_sim_state(self.state_path, as_of, cluster, runtimes)
            self._last_publish = time.monotonic()

    def _take_snapshot(self, now: float) -> None:
        last = self._history[-1] if self._history else None
        if last is not None and self._snapshot_version == self._version:
            snap = _Snapshot(now, last.cluster, last.runtimes)  # unchanged: share the parts
        else:
            # Unchanged pods and sandboxes are shared with the previous snapshot, so the
            # history costs a list of references per change, not a copy of the cluster.
            # The file gets each object's own `vars()`: plain dicts for the C encoder,
            # field for field what `dataclasses.asdict` would give, at no copying cost.
            interned: dict[str, Pod | Sandbox] = {}

            def share(key: str, obj: Pod | Sandbox) -> dict[str, Any]:
                previous = self._interned.get(key)
                interned[key] = previous if previous == obj else obj
                return vars(interned[key])

            pods = sorted(self._pods.values(), key=lambda p: p.seq)
            cluster = {
                "pods": [share(p.uid, p.public()) for p in pods],
                "nodes": sorted(self._nodes),
                "statefulsets": {
                    key: o.replicas
                    for key, o in self._owners.items()
                    if isinstance(o, _StatefulSet)
                },
                # The annotation dicts are replaced, never mutated: shared, not copied.
                "namespaces": dict(sorted(self._namespaces.items())),
            }
            runtimes = {
                n.name: {
                    "sandboxes": [share(s.id, s.public()) for s in n.sandboxes.values() if s.listed]
                }
                for n in self._nodes.values()
                if n.up
            }
            self._interned = interned
            snap = _Snapshot(now, cluster, runtimes)
            self._snapshot_version = self._version
        self._history.append(snap)
        # Keep the newest snapshot older than the horizon too: a lag of exactly
        # history_seconds still finds one.
        while len(self._history) > 2 and self._history[1].as_of <= now - self.history_seconds:
            self._history.popleft()

    def _past(self, t: float) -> _Snapshot:
        """The newest snapshot taken at or before `t`, else the oldest kept."""
        for snap in reversed(self._history):
            if snap.as_of <= t:
                return snap
        return self._history[0]

    def _compose(self, now: float) -> tuple[float, dict[str, Any], dict[str, dict[str, Any]]]:
        current = self._history[-1]
        as_of = now
        cluster: dict[str, Any]
        if self._cluster_fail is not None:
            cluster = {"fail": self._cluster_fail}
        else:
            snap = self._past(now - self._cluster_lag) if self._cluster_lag else current
            cluster = snap.cluster
            as_of = min(as_of, snap.as_of)
        for node, until in list(self._runtime_stall.items()):
            if now >= until:
                del self._runtime_stall[node]
                self._event("fault", f"runtime of {node} answers again (stall over)")
        runtimes: dict[str, dict[str, Any]] = {}
        for node in sorted(set(current.runtimes) | set(self._runtime_lag)):
            if node in self._runtime_fail:
                if node in current.runtimes:
                    runtimes[node] = {"fail": self._runtime_fail[node]}
            elif node in self._runtime_stall:
                if node in current.runtimes:
                    runtimes[node] = {"stall_until": self._runtime_stall[node]}
            else:
                lag = self._runtime_lag.get(node)
                snap = self._past(now - lag) if lag else current
                part = snap.runtimes.get(node)
                if part is not None:
                    runtimes[node] = part
                    as_of = min(as_of, snap.as_of)
        return as_of, cluster, runtimes

    # -- the plugin ------------------------------------------------------------------

    def exec_plugin(
        self, node: str, command: str, env: dict[str, str], stdin: bytes
    ) -> tuple[int, bytes, bytes]:
        """The default `cni_exec`: run the installed plugin as a runtime does (CNI_*
        environment, the network config on stdin)."""
        assert self.plugin_path is not None
        proc = subprocess.run(
            [self.plugin_path],
            input=stdin,
            env={"PATH": os.environ.get("PATH", os.defpath), **env},
            capture_output=True,
            timeout=self.cni_timeout,
        )
        return proc.returncode, proc.stdout, proc.stderr

    def _cni(
        self, node: _SimNode, sandbox: _SimSandbox, command: str, why: str
    ) -> tuple[int, bytes]:
        """One plugin call for `sandbox`, logged; never called under the lock. An exec
        that fails outright (no plugin, timeout) is a failed call, as for a runtime."""
        args = (
            f"IgnoreUnknown=1;K8S_POD_NAMESPACE={sandbox.namespace};K8S_POD_NAME={sandbox.name}"
            f";K8S_POD_INFRA_CONTAINER_ID={sandbox.id};K8S_POD_UID={sandbox.pod_uid}"
        )
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": sandbox.id,
            "CNI_IFNAME": IFNAME,
            "CNI_NETNS": f"/var/run/netns/sim-{sandbox.id[:12]}",
            "CNI_PATH": self._cni_path,
            "CNI_ARGS": args,
        }
        # ipward exec'd directly as the IPAM, forwarding to the node's agent.
        config = {
            "cniVersion": "1.0.0",
            "name": self.network,
            "ipam": {"type": "ipward", "pool": self.pool, "agentSocket": node.agent_socket},
        }
        stdin = json.dumps(config).encode()
        at = self.clock()
        started = time.monotonic()
        try:
            rc, out, err = self._cni_exec(node.name, command, env, stdin)
        except Exception as e:
            rc, out, err = EXEC_FAILED, b"", f"{type(e).__name__}: {e}".encode()
        elapsed_ms = (time.monotonic() - started) * 1000
        call = CniCall(
            at=at,
            node=node.name,
            command=command,
            sandbox=sandbox.id,
            pod=f"{sandbox.namespace}/{sandbox.name}",
            uid=sandbox.pod_uid,
            why=why,
            returncode=rc,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            elapsed_ms=elapsed_ms,
        )
        with self._cond:
            self._calls.append(call)
            summary = call.stdout.strip()[:200]
            self._event(
                command, f"{why} {call.pod} {sandbox.id[:12]} on {node.name}: rc {rc} {summary}"
            )
            self._cond.notify_all()
        return rc, out

    # -- kubelet tasks (kubelet threads) ---------------------------------------------

    def _submit(self, node: _SimNode, task: Callable[..., None], *args: Any) -> None:
        node.kubelet.submit(self._guarded, task, *args)

    def _guarded(self, task: Callable[..., None], *args: Any) -> None:
        try:
            task(*args)
        except Exception:  # a bug in a task: make it visible, keep the kubelet alive
            with self._mutate():
                self._event("error", traceback.format_exc())

    def _task_add(self, node: _SimNode, sandbox: _SimSandbox) -> None:
        """RunPodSandbox: ADD; on failure DEL what it may have set up, drop the sandbox,
        and let the pod try again with a new one after `retry_delay`."""
        # The kubelet only runs pods the API shows: the pod is published before its ADD.
        with self._cond:
            version = self._version
        self._publish(version)
        rc, out = self._cni(node, sandbox, "ADD", "add")
        address = _address(out) if rc == 0 else None
        if address is None:
            self._cni(node, sandbox, "DEL", "add-failed")
        elif self.list_delay:
            # The rest of RunPodSandbox: the record exists, the runtime lists nothing yet.
            time.sleep(self.list_delay)
        with self._mutate():
            sandbox.busy = False
            pod = self._pods.get(sandbox.pod_uid)
            current = pod is not None and pod.sandbox == sandbox.id
            if address is None:
                node.sandboxes.pop(sandbox.id, None)
                if pod is not None and current:
                    pod.sandbox = None
                    pod.retry_at = self.clock() + self.retry_delay
                return
            sandbox.listed = sandbox.ready = True
            if pod is not None and current:
                pod.address = address
                pod.running_since = self.clock()
                if pod.phase == PENDING:
                    pod.phase = RUNNING
                self._event("pod", f"running {pod.key} {pod.uid} {address} on {node.name}")

    def _task_teardown(self, node: _SimNode, sandbox: _SimSandbox) -> None:
        """One step: StopPodSandbox (not ready, DEL) or RemovePodSandbox (DEL, then no
        longer listed). A failed DEL leaves the step to be retried."""
        step = "remove" if sandbox.stopped else "stop"
        if step == "stop":
            with self._mutate():
                sandbox.ready = False
        rc, _ = self._cni(node, sandbox, "DEL", step)
        with self._mutate():
            sandbox.busy = False
            if rc != 0:
                sandbox.retry_at = self.clock() + self.retry_delay
            elif step == "stop":
                sandbox.stopped = True
            else:
                self._remove_sandbox(node, sandbox)

    def _task_delayed_dels(self, node: _SimNode, delayed: _DelayedDel) -> None:
        """The two DELs of a sandbox removed earlier; a failure queues both again (a
        repeated DEL changes nothing)."""
        for _ in range(2):
            rc, _out = self._cni(node, delayed.sandbox, "DEL", "delayed")
            if rc != 0:
                with self._mutate():
                    delayed.due = self.clock() + self.retry_delay
                    self._delayed.append(delayed)
                return

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
        return self._version

    def _event(self, kind: str, detail: str) -> None:
        self._events.append((self.clock(), kind, detail))

    def _node(self, name: str) -> _SimNode:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no node {name}") from None

    def _grace(self, grace: float | None) -> float:
        return self.grace if grace is None else grace

    def _named(self, namespace: str, name: str) -> _SimPod | None:
        for pod in self._pods.values():
            if pod.namespace == namespace and pod.name == name:
                return pod
        return None

    def _resolve(self, ref: PodRef) -> _SimPod:
        if isinstance(ref, Pod):
            found = self._pods.get(ref.uid)
        elif "/" in ref:
            namespace, _, name = ref.partition("/")
            found = self._named(namespace, name)
        else:
            found = self._pods.get(ref)
        if found is None:
            raise KeyError(f"no pod {ref} in the API")
        return found

    def _sandbox_of(self, pod: _SimPod) -> _SimSandbox | None:
        node = self._nodes.get(pod.node)
        if node is None or pod.sandbox is None:
            return None
        return node.sandboxes.get(pod.sandbox)

    def _sandboxes_of(self, pod: _SimPod) -> list[_SimSandbox]:
        """The pod's sandboxes whose teardown has not started."""
        node = self._nodes.get(pod.node)
        if node is None:
            return []
        return [s for s in node.sandboxes.values() if s.pod_uid == pod.uid and not s.del_mode]

    def _ready(self, pod: _SimPod) -> bool:
        sandbox = self._sandbox_of(pod)
        return pod.phase == RUNNING and sandbox is not None and sandbox.ready

    def _new_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        grace: float | None,
        owner: _Owner | None = None,
        **fields: Any,
    ) -> _SimPod:
        self._seq += 1
        pod = _SimPod(
            uid=str(uuid.UUID(int=self._rng.getrandbits(128), version=4)),
            namespace=namespace,
            name=name,
            seq=self._seq,
            grace=self._grace(grace),
            owner_kind=_OWNER_KINDS[type(owner)] if owner else "",
            owner_name=owner.name if owner else "",
            fixed_node=node,
            **fields,
        )
        if owner is not None:
            pod.annotations = dict(owner.annotations)
        self._pods[pod.uid] = pod
        self._event("pod", f"created {pod.key} {pod.uid}")
        return pod

    def _random_name(self, namespace: str, prefix: str) -> str:
        while True:
            name = f"{prefix}-{''.join(self._rng.choices(string.ascii_lowercase, k=5))}"
            if self._named(namespace, name) is None:
                return name

    def _delete(self, pod: _SimPod, now: float, grace: float | None = None) -> None:
        if pod.deleted_at is not None:
            return
        pod.deleted_at = now
        if grace is not None:
            pod.grace = grace
        self._event("pod", f"deleted {pod.key} {pod.uid}")

    def _forget(self, pod: _SimPod, why: str) -> None:
        """The pod leaves the API."""
        del self._pods[pod.uid]
        self._event("pod", f"gone {pod.key} {pod.uid} ({why})")

    def _termination_due(self, pod: _SimPod, now: float) -> bool:
        assert pod.deleted_at is not None
        if pod.terminal or pod.sandbox is None:
            wait = 0.0  # no container left to stop
        elif self.exit_after is None:
            wait = pod.grace
        else:
            wait = min(pod.grace, self.exit_after)
        return now >= pod.deleted_at + wait

    def _remove_sandbox(self, node: _SimNode, sandbox: _SimSandbox) -> None:
        node.sandboxes.pop(sandbox.id, None)
        pod = self._pods.get(sandbox.pod_uid)
        if pod is not None and pod.sandbox == sandbox.id:
            pod.sandbox = None
            pod.address = None

    def _add_owner(self, owner: _Owner) -> None:
        if isinstance(owner, _Job):
            if owner.completions < 1 or owner.parallelism < 1 or owner.duration < 0:
                raise ValueError("a Job needs completions, parallelism >= 1, duration >= 0")
        elif owner.replicas < 0:
            raise ValueError("replicas must be >= 0")
        with self._mutate():
            key = f"{owner.namespace}/{owner.name}"
            if key in self._owners:
                raise ValueError(f"{key} exists")
            self._owners[key] = owner
            self._event("owner", f"created {_OWNER_KINDS[type(owner)]} {key}")

    def _owner(self, namespace: str, name: str) -> _Owner:
        try:
            return self._owners[f"{namespace}/{name}"]
        except KeyError:
            raise KeyError(f"no owner {namespace}/{name}") from None

    def _owned(self, owner: _Owner) -> list[_SimPod]:
        kind = _OWNER_KINDS[type(owner)]
        return sorted(
            (
                p
                for p in self._pods.values()
                if p.owner_kind == kind
                and p.owner_name == owner.name
                and p.namespace == owner.namespace
            ),
            key=lambda p: p.seq,
        )

    def _reconcile_owners(self, now: float) -> bool:
        changed = False
        for owner in list(self._owners.values()):
            pods = self._owned(owner)
            if isinstance(owner, _Deployment):
                changed |= self._reconcile_deployment(owner, pods, now)
            elif isinstance(owner, _StatefulSet):
                changed |= self._reconcile_statefulset(owner, pods, now)
            else:
                changed |= self._reconcile_job(owner, pods, now)
        return changed

    def _reconcile_deployment(self, d: _Deployment, pods: list[_SimPod], now: float) -> bool:
        live = [p for p in pods if p.deleted_at is None]
        current = [p for p in live if p.generation == d.generation]
        old = [p for p in live if p.generation != d.generation]
        missing = d.replicas - len(current)
        for _ in range(missing):
            name = self._random_name(d.namespace, d.name)
            self._new_pod(d.namespace, name, d.node, d.grace, d, generation=d.generation)
        surplus = sorted(current, key=self._deletion_order)[: max(-missing, 0)]
        # Old pods go only as new ones are ready: never fewer ready than replicas.
        ready_new = min(sum(self._ready(p) for p in current), d.replicas)
        retired = sorted(old, key=self._deletion_order)[: max(len(old) + ready_new - d.replicas, 0)]
        for pod in surplus + retired:
            self._delete(pod, now)
        return bool(missing > 0 or surplus or retired)

    def _deletion_order(self, pod: _SimPod) -> tuple[bool, int]:
        """As a ReplicaSet picks pods to delete: not ready before ready, newest first."""
        return self._ready(pod), -pod.seq

    def _reconcile_statefulset(self, s: _StatefulSet, pods: list[_SimPod], now: float) -> bool:
        by_ordinal = {p.ordinal: p for p in pods}  # terminating ones too: names are taken
        condemned = sorted((o for o in by_ordinal if o >= s.replicas), reverse=True)
        if s.ordered:
            if any(p.deleted_at is not None for p in pods):
                return False  # wait for it to leave the API
            if condemned:
                self._delete(by_ordinal[condemned[0]], now)
                return True
            for ordinal in range(s.replicas):
                pod = by_ordinal.get(ordinal)
                if pod is None:
                    self._new_statefulset_pod(s, ordinal)
                    return True
                if not self._ready(pod):
                    return False
            return False
        changed = False
        for ordinal in condemned:
            if by_ordinal[ordinal].deleted_at is None:
                self._delete(by_ordinal[ordinal], now)
                changed = True
        for ordinal in range(s.replicas):
            if ordinal not in by_ordinal:
                self._new_statefulset_pod(s, ordinal)
                changed = True
        return changed

    def _new_statefulset_pod(self, s: _StatefulSet, ordinal: int) -> None:
        self._new_pod(s.namespace, f"{s.name}-{ordinal}", s.node, s.grace, s, ordinal=ordinal)

    def _reconcile_job(self, j: _Job, pods: list[_SimPod], now: float) -> bool:
        if j.finished_at is None:
            if j.succeeded >= j.completions:
                j.finished_at = now
                self._event("owner", f"Job {j.namespace}/{j.name} complete")
                return True
            active = sum(1 for p in pods if p.deleted_at is None and not p.terminal)
            wanted = min(j.parallelism, j.completions - j.succeeded) - active
            for _ in range(wanted):
                name = self._random_name(j.namespace, j.name)
                self._new_pod(j.namespace, name, j.node, j.grace, j, duration=j.duration)
            return wanted > 0
        if j.ttl_after_finished is not None and now >= j.finished_at + j.ttl_after_finished:
            del self._owners[f"{j.namespace}/{j.name}"]
            for pod in pods:
                self._delete(pod, now)
            self._event("owner", f"Job {j.namespace}/{j.name} deleted after its TTL")
            return True
        return False

    def _schedule(self) -> bool:
        """Bind unscheduled pods: the fixed node if it is in the cluster, else the live
        node with the fewest pods. An unscheduled pod that is deleted just goes."""
        changed = False
        load = {n.name: 0 for n in self._nodes.values() if n.up}
        for pod in self._pods.values():
            if pod.node in load and pod.deleted_at is None:
                load[pod.node] += 1
        for pod in sorted(self._pods.values(), key=lambda p: p.seq):
            if pod.node:
                continue
            if pod.deleted_at is not None:
                self._forget(pod, "deleted before it was scheduled")
                changed = True
            elif pod.fixed_node:
                if pod.fixed_node in self._nodes:
                    pod.node = pod.fixed_node
                    changed = True
            elif load:
                pod.node = min(load, key=lambda n: (load[n], n))
                load[pod.node] += 1
                changed = True
        return changed

    def _run_delayed_dels(self, now: float) -> bool:
        due = [
            d
            for d in self._delayed
            if d.due <= now and d.node in self._nodes and self._nodes[d.node].up
        ]
        for delayed in due:
            self._delayed.remove(delayed)
            self._submit(
                self._nodes[delayed.node],
                self._task_delayed_dels,
                self._nodes[delayed.node],
                delayed,
            )
        return bool(due)

    def _sync_kubelet(self, node: _SimNode, now: float) -> bool:
        """What the node's kubelet does now: finish Job pods, start sandboxes, tear down
        the ones no pod wants, let terminated pods leave the API."""
        changed = False
        sandboxes: dict[str, list[_SimSandbox]] = {}
        for sandbox in node.sandboxes.values():
            sandboxes.setdefault(sandbox.pod_uid, []).append(sandbox)
        for pod in [p for p in self._pods.values() if p.node == node.name]:
            mine = sandboxes.get(pod.uid, [])
            if pod.deleted_at is not None:
                if not mine and self._termination_due(pod, now):
                    self._forget(pod, "terminated")
                    changed = True
                continue
            if pod.failed_until is not None and now >= pod.failed_until:
                # A restart's Failed phase is over: Pending until the new sandbox runs.
                pod.phase = PENDING
                pod.failed_until = None
                self._event("pod", f"pending {pod.key} {pod.uid} (restarting)")
                changed = True
            if (
                pod.duration is not None
                and pod.phase == RUNNING
                and pod.running_since is not None
                and now >= pod.running_since + pod.duration
            ):
                changed |= self._complete(pod, now)
            elif (
                pod.sandbox is None
                and pod.phase in (PENDING, RUNNING)
                and now >= pod.retry_at
                and all(s.stopped for s in mine)
            ):
                # The kubelet starts a new sandbox once the pod's old ones are stopped.
                sandbox = _SimSandbox(
                    id=f"{self._rng.getrandbits(256):064x}",
                    pod_uid=pod.uid,
                    namespace=pod.namespace,
                    name=pod.name,
                    created_at=now,
                    busy=True,
                    drop_del=pod.drop_del,
                    del_delay=pod.del_delay,
                )
                node.sandboxes[sandbox.id] = sandbox
                pod.sandbox = sandbox.id
                self._submit(node, self._task_add, node, sandbox)
                changed = True
        for sandbox in list(node.sandboxes.values()):
            if sandbox.busy or now < sandbox.retry_at:
                continue
            owner = self._pods.get(sandbox.pod_uid)
            wanted = (
                owner is not None
                and owner.sandbox == sandbox.id
                and (owner.deleted_at is None or not self._termination_due(owner, now))
            )
            if not wanted:
                self._teardown(node, sandbox)
                changed = True
        return changed

    def _complete(self, pod: _SimPod, now: float) -> bool:
        """A Job's pod is done: Succeeded, its sandbox stopped without a DEL."""
        pod.phase = SUCCEEDED
        pod.finished_at = now
        sandbox = self._sandbox_of(pod)
        if sandbox is not None:
            sandbox.ready = False
        owner = self._owners.get(f"{pod.namespace}/{pod.owner_name}")
        if isinstance(owner, _Job) and pod.owner_kind == "Job":
            owner.succeeded += 1
        self._event("pod", f"succeeded {pod.key} {pod.uid}")
        return True

    def _teardown(self, node: _SimNode, sandbox: _SimSandbox) -> None:
        """Take down a sandbox no pod wants: stop and remove with their DELs (one step
        per kubelet task), or at once with the DELs dropped or delayed."""
        if not sandbox.del_mode:
            if sandbox.drop_del or self._rng.random() < self.drop_del_rate:
                sandbox.del_mode = "drop"
            elif sandbox.del_delay is not None:
                sandbox.del_mode = "delay"
            else:
                sandbox.del_mode = "del"
        if sandbox.del_mode == "del":
            sandbox.busy = True
            self._submit(node, self._task_teardown, node, sandbox)
            return
        # No DEL now: the sandbox goes at once.
        sandbox.ready = False
        self._remove_sandbox(node, sandbox)
        what = f"{sandbox.namespace}/{sandbox.name} {sandbox.id[:12]} on {node.name}"
        if sandbox.del_mode == "drop":
            self._event("fault", f"DEL dropped: {what} removed without a DEL")
        else:
            delay = sandbox.del_delay or 0.0
            self._delayed.append(_DelayedDel(self.clock() + delay, node.name, sandbox))
            self._event("fault", f"DELs delayed {delay:g}s: {what} removed")


def _annotations(annotations: dict[str, str] | None) -> dict[str, str]:
    """A copy of `annotations`, checked: the published format has strings only."""
    copied = dict(annotations or {})
    for key, value in copied.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"annotation {key!r}: {value!r}: keys and values must be str")
    return copied


def _address(stdout: bytes) -> str | None:
    """`ips[0].address` of a CNI result, without its prefix length; None if absent."""
    try:
        result = json.loads(stdout)
        return str(result["ips"][0]["address"]).split("/")[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
