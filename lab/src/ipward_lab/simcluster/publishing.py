"""Publishing the simulated cluster's state for `sim://` readers (`source.SimFileSource`):
snapshots after every change, kept `history_seconds` for lag faults, composed with the
faults applied, written atomically by `source.write_sim_state`."""

from __future__ import annotations

import time
from typing import Any

from ipward.cluster.liveness import Pod, Sandbox
from ipward_lab.simcluster.model import ClusterModel, Snapshot, StatefulSet
from ipward_lab.simcluster.source import write_sim_state


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
