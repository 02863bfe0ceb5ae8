"""Publishing the simulated cluster's state for `sim://` readers (`source.SimFileSource`):
snapshots after every change, kept `history_seconds` for lag faults, composed with the
faults applied, written atomically by `source.write_sim_state`. With an API server
(`SimCluster(api=...)`), a thread keeps the server's objects in step with the model
(`mirror`), and the file carries the runtimes only: in a real cluster the pods come from
the API and the sandboxes from each node's runtime."""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

from ipward.cluster.liveness import Pod, Sandbox
from ipward.kubeapi.client import ApiError, ApiUnreachable
from ipward_lab.simcluster.mirror import Wanted, WantedPod, replica_set_name, status_of
from ipward_lab.simcluster.model import TICK, ClusterModel, SimPod, Snapshot, StatefulSet
from ipward_lab.simcluster.source import write_sim_state

MIRROR_BACKOFF = (0.1, 2.0)  # seconds between rounds after a failed one: first, most


class Publishing(ClusterModel):
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
            snap = Snapshot(now, last.cluster, last.runtimes)  # unchanged: share the parts
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
                    key: o.replicas for key, o in self._owners.items() if isinstance(o, StatefulSet)
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
            snap = Snapshot(now, cluster, runtimes)
            self._snapshot_version = self._version
        self._history.append(snap)
        # Keep the newest snapshot older than the horizon too: a lag of exactly
        # history_seconds still finds one.
        while len(self._history) > 2 and self._history[1].as_of <= now - self.history_seconds:
            self._history.popleft()

    def _past(self, t: float) -> Snapshot:
        """The newest snapshot taken at or before `t`, else the oldest kept."""
        for snap in reversed(self._history):
            if snap.as_of <= t:
                return snap
        return self._history[0]

    def _compose(self, now: float) -> tuple[float, dict[str, Any], dict[str, dict[str, Any]]]:
        current = self._history[-1]
        as_of = now
        cluster: dict[str, Any]
        if self._mirror is not None:  # a reader asking the file for the cluster is wrong
            cluster = {"fail": f"the cluster is in the Kubernetes API at {self._mirror.url}"}
        elif self._cluster_fail is not None:
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

    # -- to a Kubernetes API server ------------------------------------------------------

    def wait_mirrored(self, timeout: float = 30.0) -> None:
        """Wait (real time) until the API server holds what the model holds now (a round
        of requests completed on the model's current version); TimeoutError with the
        last failure otherwise. Needs `start()` (the thread that sends the requests)."""
        if self._mirror is None or self._mirror_thread is None:
            raise RuntimeError("no API server, or not started")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._mirrored_version != self._version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = self.mirror_failure or "the model kept changing"
                    raise TimeoutError(
                        f"API server {self._mirror.url} not in step in {timeout:g}s: {why}"
                    )
                self._cond.wait(min(remaining, TICK))

    def _mirror_loop(self) -> None:
        """Rounds of requests (`KubeMirror.apply`) after every change of the model, and
        at least every second; after a failed round, again with a growing backoff."""
        assert self._mirror is not None
        backoff = MIRROR_BACKOFF[0]
        while not self._stopping.is_set():
            self._mirror_wake.wait(1.0)
            self._mirror_wake.clear()
            if self._stopping.is_set():
                return
            with self._cond:
                wanted = self._wanted()
            try:
                self._mirror.apply(wanted, self._adopt)
            except Exception as e:
                self._mirror_failed(e)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, MIRROR_BACKOFF[1])
                self._mirror_wake.set()
                continue
            backoff = MIRROR_BACKOFF[0]
            with self._cond:
                if self.mirror_failure:
                    self._event("api", f"requests to {self._mirror.url} succeed again")
                    self.mirror_failure = ""
                self._mirrored_version = wanted.version
                self._cond.notify_all()

    def _mirror_failed(self, e: Exception) -> None:
        """The server refused or did not answer (a fault: it comes back), or a bug (an
        "error" event, as for the kubelet's)."""
        assert self._mirror is not None
        why = f"{type(e).__name__}: {e}"
        with self._cond:
            if not isinstance(e, ApiError | ApiUnreachable):
                self._event("error", traceback.format_exc())
            elif not self.mirror_failure:
                self._event("api", f"requests to {self._mirror.url} fail: {why}")
            self.mirror_failure = why

    def _adopt(self, key: str, uid: str) -> None:
        """The API server created pod `key` with its own UID: the pod takes it, and its
        kubelet may run it now."""
        with self._mutate():
            pod = self._pods.pop(key, None)
            if pod is None:
                return  # gone meanwhile: the next round removes it from the server
            pod.uid = uid
            pod.in_api = True
            self._pods[uid] = pod
            if uid != key:
                self._aliases[key] = uid
            self._event("pod", f"created in the API {pod.key} {uid}")

    def _wanted(self) -> Wanted:
        """What the server should hold now (under the lock); see `mirror`."""
        namespaces = dict(self._namespaces)
        pods: dict[str, WantedPod] = {}
        for pod in sorted(self._pods.values(), key=lambda p: p.seq):
            if not pod.node or (not pod.in_api and pod.deleted_at is not None):
                continue  # not scheduled, or deleted before the server had it
            namespaces.setdefault(pod.namespace, {})
            wanted = WantedPod(
                key=pod.uid,
                created=pod.in_api,
                namespace=pod.namespace,
                name=pod.name,
                node=pod.node,
                grace=max(1, math.ceil(pod.grace)),
                owner=_api_owner(pod),
                annotations=pod.annotations,
                status=status_of(pod.phase, pod.running_since, pod.finished_at),
                deleting=pod.deleted_at is not None,
            )
            pods[wanted.path] = wanted
        statefulsets = {
            key: owner.replicas
            for key, owner in self._owners.items()
            if isinstance(owner, StatefulSet)
        }
        return Wanted(self._version, namespaces, frozenset(self._nodes), statefulsets, pods)


def _api_owner(pod: SimPod) -> tuple[str, str] | None:
    """The controlling owner as the API names it: a Deployment's pods belong to the
    ReplicaSet of their template generation."""
    if pod.owner_kind == "Deployment":
        return "ReplicaSet", replica_set_name(pod.owner_name, pod.generation, pod.namespace)
    return (pod.owner_kind, pod.owner_name) if pod.owner_kind else None
