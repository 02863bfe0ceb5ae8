"""`ipward bench`: measure and print how fast ipward is, each figure next to a reference
measured on the same machine in the same run. Not a test: nothing here passes or fails on
speed; targets are printed next to the figures for the reader.

1. Throughput, in-process and sequential: Ledger allocate+release pairs per second next to
   the raw store's own single-key compare-and-swap (get, then txn comparing mod_revision,
   put) on the same backend: SQLite (a temp file) and a temporary etcd on loopback.
2. Plugin exec latency: the installed `ipward` plugin's ADD (single-node mode, SQLite)
   next to `/usr/bin/python3 -I -S -c pass` and Debian's host-local ADD, interleaved.
3. Allocate latency in the ledger as a pool fills: an empty /24 next to a /16 that is 90%
   full, an IPv6 /64 and a 10.0.0.0/8 with 10,000 addresses in use.

`ipward bench --report DIR` (`run_report`) also measures how cost grows (`run_growth`):
4. ADD and DEL latency against pool size (/24 to /8, IPv6 /64), next to the /24;
5. ADD and DEL latency against pool fill (10% to 99%), next to the 10% fill;
6. one GC pass (`gc.look`, and the controller's `gc_pass`) against the number of records
   (1k, 10k, 100k), next to the raw read of those records;
7. a real agent's memory after its reconcile pass over those records, next to the same
   agent on an empty store;
then runs the cluster part (unless --no-etcd) and writes DIR/report.html (self-contained,
`ipward_lab.report`), DIR/report.json and the plots as PNG files.

`ipward bench --cluster` instead (`run_cluster`): N real `ipward agent` processes on one
temporary etcd, C client threads per agent looping ADD then DEL through the plugin's own
socket call, next to raw etcd CAS by as many threads in the same run (the two loads take
turns in rounds); then plugin exec ADD through an agent next to the bare interpreter and
host-local.

`ipward bench --scale` instead (`run_scale`): one temporary etcd grown stage by stage to
5,000 nodes and 150,000 allocations (`ScaleCluster`, the state written in bulk as ledgers
and the controller leave it: `PoolFill`); at each stage a real probe agent (memory,
reconcile pass), a real controller (memory, first and steady pass) and real agents under
plugin ADD/DEL churn with the controller running and paused; a table and a plot.

`ipward bench --kube` instead (`kube.run_kube`): pod start on a real cluster of 3 nodes
made on this machine (`ipward_lab.kubecluster`), host-local then ipward in the same run:
N pods of a Deployment at once (until all are Running, each pod's time, each sandbox's
CNI ADD from containerd's debug log) and rounds of a StatefulSet scaled 5->0->5 (their
time, the addresses kept); a table with the ratios.

`ipward bench --k8s` instead (`k8s_memory.measure`): the memory of the `k8s://` source,
controller-scoped and agent-scoped, on the test API server filled with a cluster's pods.

Modules, one a figure: `throughput` (1), `plugin_exec` (2), `latency` (3, 4, 5), `fill`
(pools filled in bulk for them), `gc_memory` (6, 7), `cluster` (--cluster), `scale` and
`scale_cluster` (--scale), `kube` (--kube), `k8s_memory` (--k8s), `report` (--report),
`run` (the default run and the growth part, section by section), `command`, and
`common` (what they share, `Results` among it).
"""

from ipward_lab.bench.cluster import agent_exec_latency, run_cluster
from ipward_lab.bench.command import bench_command
from ipward_lab.bench.common import NODE, PLUGIN_PYTHON, BenchError, machine, p99, percentile
from ipward_lab.bench.fill import PoolFill, bulk_fill, write_adds, write_all
from ipward_lab.bench.gc_memory import RecordStore, agent_memory, gc_pass_times
from ipward_lab.bench.latency import allocate_latency, fill_latency, pool_size_latency
from ipward_lab.bench.plugin_exec import exec_latency
from ipward_lab.bench.report import (
    PLOT_FILL,
    PLOT_GC_MEMORY,
    PLOT_POOL_SIZE,
    run_report,
    write_report,
)
from ipward_lab.bench.run import run, run_growth
from ipward_lab.bench.throughput import ledger_pair_rate, raw_cas_rate, throughput
from ipward_lab.servers.etcd import ETCD

__all__ = [
    "ETCD",
    "NODE",
    "PLOT_FILL",
    "PLOT_GC_MEMORY",
    "PLOT_POOL_SIZE",
    "PLUGIN_PYTHON",
    "BenchError",
    "PoolFill",
    "RecordStore",
    "agent_exec_latency",
    "agent_memory",
    "allocate_latency",
    "bench_command",
    "bulk_fill",
    "exec_latency",
    "fill_latency",
    "gc_pass_times",
    "ledger_pair_rate",
    "machine",
    "p99",
    "percentile",
    "pool_size_latency",
    "raw_cas_rate",
    "run",
    "run_cluster",
    "run_growth",
    "run_report",
    "throughput",
    "write_adds",
    "write_all",
    "write_report",
]
