"""Faults of the simulated cluster: lagging, failing and stalling liveness (they change
what is published, never the model) and dropped or delayed DELs (what the kubelet
sends)."""

from __future__ import annotations

from ipward_lab.simcluster.model import ClusterModel, PodRef


class Faults(ClusterModel):
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
