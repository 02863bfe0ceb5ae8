"""The simulated kubelets: per node, a small thread pool that execs the real plugin (ADD
when a sandbox starts; DEL at stop and again at remove, retried when it fails; none or
late when a fault says so), and the decisions of each tick (start, complete, tear down)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

from ipward_lab.simcluster.model import (
    EXEC_FAILED,
    IFNAME,
    PENDING,
    RUNNING,
    SUCCEEDED,
    ClusterModel,
    CniCall,
    DelayedDel,
    Job,
    SimNode,
    SimPod,
    SimSandbox,
)


def _passed_on() -> dict[str, str]:
    """What a runtime's own environment gives the plugins it execs: PATH, and where
    the plugin keeps its notes when the lab's user says (docs/design.md 5.14)."""
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    if "IPWARD_CNI_NOTES" in os.environ:
        env["IPWARD_CNI_NOTES"] = os.environ["IPWARD_CNI_NOTES"]
    return env


class Kubelet(ClusterModel):
    def exec_plugin(
        self, node: str, command: str, env: dict[str, str], stdin: bytes
    ) -> tuple[int, bytes, bytes]:
        """The default `cni_exec`: run the installed plugin as a runtime does (CNI_*
        environment, the network config on stdin)."""
        assert self.plugin_path is not None
        proc = subprocess.run(
            [self.plugin_path],
            input=stdin,
            env={**_passed_on(), **env},
            capture_output=True,
            timeout=self.cni_timeout,
        )
        return proc.returncode, proc.stdout, proc.stderr

    def _cni(self, node: SimNode, sandbox: SimSandbox, command: str, why: str) -> tuple[int, bytes]:
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
            rc, out, err = (self._cni_exec or self.exec_plugin)(node.name, command, env, stdin)
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

    def _submit(self, node: SimNode, task: Callable[..., None], *args: Any) -> None:
        node.kubelet.submit(self._guarded, task, *args)

    def _guarded(self, task: Callable[..., None], *args: Any) -> None:
        try:
            task(*args)
        except Exception:  # a bug in a task: make it visible, keep the kubelet alive
            with self._mutate():
                self._event("error", traceback.format_exc())

    def _task_add(self, node: SimNode, sandbox: SimSandbox) -> None:
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

    def _task_teardown(self, node: SimNode, sandbox: SimSandbox) -> None:
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

    def _task_delayed_dels(self, node: SimNode, delayed: DelayedDel) -> None:
        """The two DELs of a sandbox removed earlier; a failure queues both again (a
        repeated DEL changes nothing)."""
        for _ in range(2):
            rc, _out = self._cni(node, delayed.sandbox, "DEL", "delayed")
            if rc != 0:
                with self._mutate():
                    delayed.due = self.clock() + self.retry_delay
                    self._delayed.append(delayed)
                return

    # -- decisions of a tick (under the lock) ------------------------------------------

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

    def _sync_kubelet(self, node: SimNode, now: float) -> bool:
        """What the node's kubelet does now: finish Job pods, start sandboxes, tear down
        the ones no pod wants, let terminated pods leave the API."""
        changed = False
        sandboxes: dict[str, list[SimSandbox]] = {}
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
                and pod.in_api
                and pod.phase in (PENDING, RUNNING)
                and now >= pod.retry_at
                and all(s.stopped for s in mine)
            ):
                # The kubelet starts a new sandbox once the pod's old ones are stopped (and
                # runs only pods the API shows: with an API server, once created there).
                sandbox = SimSandbox(
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

    def _complete(self, pod: SimPod, now: float) -> bool:
        """A Job's pod is done: Succeeded, its sandbox stopped without a DEL."""
        pod.phase = SUCCEEDED
        pod.finished_at = now
        sandbox = self._sandbox_of(pod)
        if sandbox is not None:
            sandbox.ready = False
        owner = self._owners.get(f"{pod.namespace}/{pod.owner_name}")
        if isinstance(owner, Job) and pod.owner_kind == "Job":
            owner.succeeded += 1
        self._event("pod", f"succeeded {pod.key} {pod.uid}")
        return True

    def _teardown(self, node: SimNode, sandbox: SimSandbox) -> None:
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
            self._delayed.append(DelayedDel(self.clock() + delay, node.name, sandbox))
            self._event("fault", f"DELs delayed {delay:g}s: {what} removed")


def _address(stdout: bytes) -> str | None:
    """`ips[0].address` of a CNI result, without its prefix length; None if absent."""
    try:
        result = json.loads(stdout)
        return str(result["ips"][0]["address"]).split("/")[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
