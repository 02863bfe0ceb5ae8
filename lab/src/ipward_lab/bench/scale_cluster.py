"""The cluster `ipward bench --scale` measures: one pool on one store (etcd; the
Kubernetes store for `--k8s-store`), nodes registered as their agents register them,
blocks and allocations as ledgers and the controller leave them (`PoolFill`), grown
stage by stage, and the simulated cluster's published state (`sim://`) that the
controller and the agents read."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.policy import REGISTRATION_REFRESH
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.ledger import Ledger
from ipward.ipam.pools import create_pool
from ipward.store.base import Put, Store
from ipward_lab.bench.common import BenchError
from ipward_lab.bench.fill import PoolFill, write_adds, write_batches
from ipward_lab.servers.etcd import EtcdServer
from ipward_lab.simcluster import write_sim_state

SCALE_POOL = "benchscale"
SCALE_SUBNET = "10.0.0.0/12"  # 16,384 /26 blocks (the default size): room for 5,000 nodes
SCALE_NETWORK = "scale"
NAMESPACE = "scale"
NODE_PODS = 30  # 150,000 pods on 5,000 nodes
AGENT_PODS = 110  # Kubernetes' default pod limit per node: what the measured nodes hold
RECORD_AGE = 3600.0  # seconds since the ADD of every filled record (past the ADD grace)
# The simulated nodes' leases outlive any run: nobody keeps 5,000 leases alive (each
# real agent renews its own every second; see README, "Scale").
REGISTRATION_TTL = 7200
LEASE_THREADS = 8  # lease grants in flight at once (each is a raft write)
CHANGE_THREADS = 8  # ledger calls in flight at once for the changed 1%


def node_name(index: int) -> str:
    return f"node-{index:05d}"


def node_count(records: int, agents: int) -> int:
    """Nodes of a cluster of `records` pods: NODE_PODS a node, the agents' among them."""
    return max(agents + 1, round(records / NODE_PODS))


class ScaleCluster:
    """One pool on the store at `url` (`store` open on it; `etcd` the etcd that keeps
    it: the store's own, or the API server's), grown stage by stage (`grow`). The first
    `agents` nodes hold AGENT_PODS records each (real agents run there); the others
    NODE_PODS or so. Record i is pod `scale/pod-<i>` (UID `uid-<i>`), sandbox
    `sandbox-<i>` until `change` gives it a new one. `cluster_state` is what the
    controller reads (every pod and node: a cluster's API; no runtime, which a
    controller cannot reach), and `runtime_state(node)` what an agent's runtime lists
    (its node's sandboxes)."""

    def __init__(self, url: str, store: Store, tmp: Path, agents: int, etcd: EtcdServer) -> None:
        self.url = url
        self.etcd = etcd
        self.store = store
        self.tmp = tmp
        self.agents = agents
        self.spec = PoolSpec(SCALE_POOL, [[{"subnet": SCALE_SUBNET}]])
        create_pool(store, self.spec)  # as `ipward pool create`
        self.fill = PoolFill(self.spec)
        self.nodes: list[str] = []
        self.placement: list[str] = []  # the node of record i
        self.sandboxes: list[str] = []  # the sandbox (container ID) of record i
        self.changed_rounds = 0
        self.cluster_state = str(tmp / "cluster.state.json")
        self.created_at = time.time() - RECORD_AGE

    @property
    def agent_nodes(self) -> list[str]:
        return self.nodes[: self.agents]

    @property
    def records(self) -> int:
        return len(self.placement)

    def runtime_state(self, node: str) -> str:
        return str(self.tmp / f"runtime-{node}.state.json")

    # -- growing

    def grow(self, records: int) -> dict[str, float]:
        """Register the stage's new nodes, fill its new records on them, as the
        controller (warm blocks on registration, topped up after) and the nodes' ledgers
        would have; publish the state. Returns the seconds each step took."""
        if records <= self.records:
            raise BenchError(f"stage of {records} records after {self.records}: stages must grow")
        first = not self.nodes
        if first and records <= self.agents * AGENT_PODS:
            raise BenchError(
                f"{records} records: the first stage needs more than the agents' nodes hold"
                f" ({self.agents} x {AGENT_PODS})"
            )
        began = time.perf_counter()
        new_nodes = [node_name(i) for i in range(len(self.nodes), node_count(records, self.agents))]
        self.register(new_nodes)
        self.nodes += new_nodes
        registered = time.perf_counter()
        quotas = dict.fromkeys(new_nodes, 0)
        to_place = records - self.records
        if first:
            for node in new_nodes[: self.agents]:
                quotas[node] = AGENT_PODS
            to_place -= self.agents * AGENT_PODS
            spread = new_nodes[self.agents :]
        else:
            spread = new_nodes or self.nodes[self.agents :]  # no new node: the others
        base, extra = divmod(to_place, len(spread))
        for i, node in enumerate(spread):
            quotas[node] += base + (i < extra)
        self.fill.carry_on(self.store)  # ledgers may have claimed blocks since
        self.fill.warm(self.nodes)  # the controller's pass after the nodes registered
        write_adds(self.store, self.fill, self._adds(quotas), self.created_at)
        self.fill.warm(self.nodes)  # and its pass after their ADDs
        write_batches(self.store, self.fill.ops())
        filled = time.perf_counter()
        self.publish(first)
        return {
            "register_s": registered - began,
            "fill_s": filled - registered,
            "publish_s": time.perf_counter() - filled,
        }

    def _adds(self, quotas: dict[str, int]) -> Iterator[tuple[str, Attachment, PodInfo]]:
        for node, count in quotas.items():
            for _ in range(count):
                i = len(self.placement)
                self.placement.append(node)
                self.sandboxes.append(f"sandbox-{i}")
                yield node, Attachment(SCALE_NETWORK, f"sandbox-{i}", "eth0"), self._pod(i)

    @staticmethod
    def _pod(i: int) -> PodInfo:
        return PodInfo(NAMESPACE, f"pod-{i}", f"uid-{i}")

    def register(self, nodes: list[str]) -> None:
        """`nodes/<node>` under a lease of its own, as each node's agent writes it:
        leases granted LEASE_THREADS at a time, keys written in batches within etcd's
        operations limit."""
        if not nodes:
            return
        with ThreadPoolExecutor(LEASE_THREADS) as pool:
            leases = list(pool.map(lambda _: self.store.lease_grant(REGISTRATION_TTL), nodes))
        now = time.time()
        ops = [
            Put(
                keys.node_key(node),
                rec.NodeRegistration(node, os.getpid(), now, now, REGISTRATION_REFRESH).encode(),
                lease=lease,
            )
            for node, lease in zip(nodes, leases, strict=True)
        ]
        write_batches(self.store, ops)

    # -- the simulated cluster's state

    def publish(self, runtimes: bool) -> None:
        """The cluster's state for the controller; with `runtimes`, the agent nodes'
        runtimes too (their records never change)."""
        now = time.time()
        pods = [
            {
                "uid": f"uid-{i}",
                "namespace": NAMESPACE,
                "name": f"pod-{i}",
                "phase": "Running",
                "node": node,
            }
            for i, node in enumerate(self.placement)
        ]
        write_sim_state(self.cluster_state, now, {"pods": pods, "nodes": self.nodes}, {})
        if not runtimes:
            return
        for node in self.agent_nodes:
            sandboxes = [
                {
                    "id": self.sandboxes[i],
                    "ready": True,
                    "namespace": NAMESPACE,
                    "name": f"pod-{i}",
                    "uid": f"uid-{i}",
                    "created_at": self.created_at,
                }
                for i, at in enumerate(self.placement)
                if at == node
            ]
            write_sim_state(
                self.runtime_state(node),
                now,
                {"pods": [], "nodes": [node]},
                {node: {"sandboxes": sandboxes}},
            )

    # -- measured facts

    def db_size(self) -> dict[str, float]:
        """etcd's own database size (`etcdctl endpoint status`), in bytes, and in use."""
        status = json.loads(self.etcd.etcdctl("endpoint", "status", "-w", "json"))[0]["Status"]
        size = float(status["dbSize"])
        return {"db_bytes": size, "db_in_use_bytes": float(status.get("dbSizeInUse", size))}

    def blocks(self) -> int:
        return len(self.store.range(keys.blocks_prefix(SCALE_POOL))[0])

    # -- the steady state's changes

    def change(self, count: int) -> int:
        """`count` pods of the non-agent nodes get a new sandbox, as after a restart:
        DEL of the old attachment and ADD of a new one for the same pod, through each
        node's ledger (in this process, CHANGE_THREADS at a time). A different slice of
        the pods each call. Returns how many pods got one."""
        first = self.agents * AGENT_PODS  # the agents' records come first
        others = self.records - first
        count = min(count, others)
        stride = max(others // count, 1)
        offset = self.changed_rounds % stride
        self.changed_rounds += 1
        picked = [first + offset + k * stride for k in range(count)]
        ledgers: dict[str, Ledger] = {}

        def one(i: int) -> None:
            node = self.placement[i]
            ledger = ledgers[node]
            old = Attachment(SCALE_NETWORK, self.sandboxes[i], "eth0")
            new = Attachment(SCALE_NETWORK, f"sandbox-{i}-{self.changed_rounds}", "eth0")
            if not ledger.free(old, "bench: the pod's sandbox restarted"):
                raise BenchError(f"record {i}: {old} was not allocated")
            ledger.allocate([ledger.get_pool(SCALE_POOL)], new, self._pod(i))
            self.sandboxes[i] = new.container

        for i in picked:  # one ledger per node, made before the threads share them
            ledgers.setdefault(self.placement[i], Ledger(self.store, self.placement[i]))
        with ThreadPoolExecutor(CHANGE_THREADS) as pool:
            list(pool.map(one, picked))
        return len(picked)
