"""Workloads for the cluster lab and when their pods run: the test pod (the static `sleep`
image, never pulled), StatefulSets, Deployments and bare pods of it, and `is_running`,
what "Running" means for a pod on kubelet 1.26. Shared by `ipward bench --kube` and the
`kube` stories."""

from __future__ import annotations

from typing import Any

from ipward_lab.containerd.images import SLEEP_IMAGE


def container(env: dict[str, str] | None = None, args: list[str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "sleep", "image": SLEEP_IMAGE, "imagePullPolicy": "Never"}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if args:
        c["args"] = args
    return c


def pod_spec(
    node: str | None = None,
    slow_stop: bool = False,
    grace: int = 2,
    spread: str = "",
    strict: bool = False,
) -> dict[str, Any]:
    """A test pod: the static `sleep`; `slow_stop`: it ignores SIGTERM, so the kubelet
    kills it only after `grace` seconds (its sandbox's teardown comes that late);
    `spread`: the pods labelled app=SPREAD spread over the nodes, `strict`ly or not (then
    they still go elsewhere when a node is drained or gone)."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "containers": [container({"SLEEP_IGNORE_TERM": "1"} if slow_stop else None)],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if spread:
        spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule" if strict else "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app": spread}},
            }
        ]
    return spec


def statefulset(name: str, replicas: int, policy: str = "Parallel", **spec: Any) -> dict[str, Any]:
    return _replicated(
        "StatefulSet", name, replicas, spec, podManagementPolicy=policy, serviceName=name
    )


def deployment(name: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return _replicated("Deployment", name, replicas, spec)


def _replicated(
    kind: str, name: str, replicas: int, spec: dict[str, Any], **more: Any
) -> dict[str, Any]:
    """A workload of `kind` keeping `replicas` test pods (`pod_spec(**spec)`) labelled
    app=NAME; `more`: the kind's own fields of its spec."""
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            **more,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec(**spec)},
        },
    }


def bare_pod(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": pod_spec(**spec),
    }


def manifest(*objects: dict[str, Any]) -> dict[str, Any]:
    """One `kubectl apply -f -` input of `objects`."""
    return {"apiVersion": "v1", "kind": "List", "items": list(objects)}


def is_running(pod: dict[str, Any]) -> bool:
    """Running, every container of it running, not being deleted. Not the phase alone:
    a kubelet 1.26 reports a StatefulSet's new pod Running, with the address of the pod
    of that name it replaces, while its own sandbox is not made yet (its container
    statuses are the old pod's, terminated)."""
    status = pod["status"]
    containers = status.get("containerStatuses", [])
    return (
        status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and not pod["metadata"].get("deletionTimestamp")
        and bool(containers)
        and all("running" in c.get("state", {}) for c in containers)
    )


def addresses(pods: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each pod's address, by name."""
    return {name: p["status"]["podIP"] for name, p in pods.items()}


def pod_state(pod: dict[str, Any]) -> str:
    """Its phase, why its containers wait, and its node."""
    status = pod["status"]
    waiting = [
        c["state"]["waiting"].get("reason", "")
        for c in status.get("containerStatuses", [])
        if "waiting" in c.get("state", {})
    ]
    return f"{status.get('phase')} {','.join(waiting)} on {pod['spec'].get('nodeName')}"
