"""`ipward sim`: the chaos soak. The whole system under churn and faults, checked all
along, in numbers and pictures.

What runs, all real: a store (SQLite by default; one etcd; a three-member etcd on
loopback; or the Kubernetes store on a kube-apiserver of its own), one `ipward agent`
per simulated node and two `ipward controller`s (leader election), the installed plugin
executable, and the simulated cluster
(`ipward_lab.simcluster`) as the runtime and orchestrator both: Deployments scaling and
rolling, StatefulSets scaled down and up fast (sticky addresses), Jobs completing, pods
deleted and restarted, at `--rate` actions per second, for `--duration` seconds.

With `--api test` or `--api real` the simulated cluster is published to a Kubernetes API
server (the loopback test server, or the kube-apiserver named by KUBE_APISERVER): agents
read pods, annotations and owners through `--cluster k8s://` and their runtime through
`--liveness sim://`, controllers the cluster through `--liveness k8s://`, as in a real
cluster. The checks read the simulated cluster's own truth, as without.

Faults, at random times (seeded), each enabled kind at least once: SIGKILL an agent (it
comes back after a few seconds), SIGKILL the leading controller (a new one starts),
SIGKILL an etcd member (three-member etcd only; restarted), stall a node's runtime,
drop a pod's DELs, delay a pod's DELs past the GC grace; with an API server: `api-expire`
(410 on every watch: relist), `api-cut` (every watch stream cut), `api-down` (down 4 s,
then back: relist; the real kube-apiserver is stopped and started again), `api-stall` (no
events, no bookmarks, until a controller's garbage collection finds its source stale,
a violation if none does within 60 s); on the Kubernetes store, its API server's
(`kube_store`): `store-api-kill`, `store-conflicts` (409s), `store-relist` (410s).
`--faults all` is every kind the run can make; a
kind named that it cannot make is refused.

Checked all along, every 0.1 s: no address is held by two ready pods; no ready pod's
address record is gone or owned by another sandbox (what GC must never do), confirmed
by reading the cluster before and after the store. At the end: faults cleared and every
process back, then convergence (exactly the running pods' addresses recorded, every pod
running), `ipward check`, then everything deleted and the pool empty, `ipward check`
again. Any violation makes the exit status 1, with the history of the address (every
version of its record, with revisions).

Parts: `driver` (`Soak`: the run), `checker` (what is checked, all along and at the
end), `view` (live view, summary, HTML report), `result` (options, faults, violations),
`command` (`ipward sim`), `kube_store` (the Kubernetes store's API server and its
faults); and `world`, the soak's processes and checker around the
simulated cluster for the scenario tests (`World`, `agents`).
"""

from ipward_lab.soak.command import sim_command
from ipward_lab.soak.driver import Soak
from ipward_lab.soak.result import FAULTS, NS, POOL, Options, Result, Violation

__all__ = ["FAULTS", "NS", "POOL", "Options", "Result", "Soak", "Violation", "sim_command"]
