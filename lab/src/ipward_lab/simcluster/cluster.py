"""`SimCluster`: the simulated cluster put together from its parts, and its driver (a
background thread that ticks, or `tick` and `wait_until` called by a test)."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

from ipward_lab.simcluster.faults import Faults
from ipward_lab.simcluster.kubelet import Kubelet
from ipward_lab.simcluster.model import TICK
from ipward_lab.simcluster.publishing import Publishing
from ipward_lab.simcluster.workloads import Workloads


class SimCluster(Workloads, Kubelet, Faults, Publishing):
    """The simulated cluster; see the package docstring. Thread-safe."""

    def start(self) -> SimCluster:
        """Run `tick` in a background thread, and publish at least every
        `publish_interval` seconds, so `as_of` advances while nothing changes; with an
        API server, keep it in step in another thread."""
        if self._thread is not None or self._closed:
            raise RuntimeError("simulated cluster already started or stopped")
        self._thread = threading.Thread(target=self._run, name="simcluster", daemon=True)
        self._thread.start()
        if self._mirror is not None:
            self._mirror_thread = threading.Thread(
                target=self._mirror_loop, name="simcluster-api", daemon=True
            )
            self._mirror_thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread, let the kubelets finish the calls they have (no
        new ones start), and publish the final state. The cluster cannot be restarted."""
        self._stopping.set()
        self._wake.set()
        self._mirror_wake.set()
        if self._thread is not None:
            self._thread.join()
        if self._mirror_thread is not None:
            self._mirror_thread.join()  # a request ends within the client's timeout
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
            self._ticks += 1
        if version is not None:
            self._publish(version)

    def wait_ticks(self, ticks: int = 3, timeout: float = 10.0) -> None:
        """Until `ticks` more ticks have ended: what a check that nothing happened (no
        sandbox started, no pod replaced) waits for. The first may have begun before
        this call."""
        with self._cond:
            target = self._ticks + ticks
        self.wait_until(lambda: self._ticks >= target, timeout, f"{ticks} more ticks")

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
