"""A simulated Kubernetes-like cluster that drives the real ipward plugin.

Why it exists: garbage collection is only as good as the lifecycles it is tested against,
and the ones that make IPAMs leak or hand out an address twice are the kubelet's and the
runtime's, not a test's idea of them: DEL sent twice (stop, then remove), a DEL that never
comes, a Job's pod that completes and keeps its sandbox (and address) until the pod is
deleted, a StatefulSet pod coming back under the same name with a new UID, an unreachable
node whose pods stay in the API, a liveness source that lags or fails. This package plays
those lifecycles with real plugin processes talking to real agents, and publishes what a
runtime and the orchestrator would answer, for `sim://` readers (`SimFileSource`: agents
and controllers in other processes).

Parts (`SimCluster` is them put together, in `cluster`, with the driver):
  * `model`: nodes, pods, owners, namespaces under one lock; the operations on them;
  * `workloads`: Deployments, StatefulSets, Jobs reconciled, and the scheduler;
  * `kubelet`: sandboxes, the plugin exec'd (ADD; DEL at stop and again at remove);
  * `faults`: lagging, failing, stalling liveness; dropped and delayed DELs;
  * `publishing`: snapshots, composed with the faults, written for readers; with an API
    server, the thread keeping it in step with the model;
  * `mirror`: what the model wants an API server to hold, and the requests that get it
    there (`KubeMirror`, through `ipward_lab.servers.kube_admin`);
  * `source`: the state file's format, its writer and the `sim://` source reading it.

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

With an API server (`SimCluster(api=KubeAdmin(...))`: the loopback test server or the
real kube-apiserver), the model's namespaces, nodes, pods and StatefulSets are kept in
step there by a thread (`wait_mirrored` waits for it), as a cluster's controllers and
kubelets would write them (see `mirror`); a pod's UID is the one the server gave it, and
its kubelet runs it only once the server has it. The state file then carries the
runtimes only (its cluster part is an error naming the server), as in a real cluster the
pods come from the API and the sandboxes from each node's runtime. While the server is
down the model goes on (pods it creates wait; deletions are sent once it is back).

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

from ipward_lab.simcluster.cluster import SimCluster
from ipward_lab.simcluster.model import CniCall, CniExec, PodRef
from ipward_lab.simcluster.source import SimFileSource, open_sim_source, write_sim_state

__all__ = [
    "CniCall",
    "CniExec",
    "PodRef",
    "SimCluster",
    "SimFileSource",
    "open_sim_source",
    "write_sim_state",
]
