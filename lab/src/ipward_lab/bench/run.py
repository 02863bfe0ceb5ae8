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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import click

from ipward import records as rec
from ipward.addr import Block
from ipward.install import write_launcher
from ipward.ledger import Ledger
from ipward.pool import PoolSpec
from ipward.records import Attachment, PodInfo
from ipward.store.base import Put, Store, StoreError, absent, at_revision
from ipward.store.sqlite import SqliteStore
from ipward_lab.etcdlab import ETCD, etcd_server
from ipward_lab.simcluster import SimFileSource, write_sim_state

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward_lab.report import Page

PLUGIN_PYTHON = "/usr/bin/python3"
HOST_LOCAL = "/usr/lib/cni/host-local"
CNI_BIN_DIR = "/usr/lib/cni"
NODE = "bench-node"
CAS_KEY = "bench/cas"

# Targets, printed next to the figures (never asserted).
TARGET_LEDGER_VS_CAS = 0.5  # ledger pairs/s >= 0.5 x raw CAS/s
TARGET_EXEC_OVER_PYTHON_MS = 10.0  # plugin ADD median - bare interpreter median
TARGET_IN_USE_VS_EMPTY = 1.3  # 10,000 in use: median within 1.3 x the empty /24's


class BenchError(Exception):
    """Something the bench needs did not work (not a slow result: those are figures)."""


# -- statistics ---------------------------------------------------------------------------


def p99(samples: Sequence[float]) -> float:
    """99th percentile, nearest rank: the smallest sample with >= 99% of samples at or
    below it (the maximum for fewer than 100 samples)."""
    if not samples:
        raise ValueError("p99 of no samples")
    ordered = sorted(samples)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def percentile(samples: Sequence[float], q: int) -> float:
    """q-th percentile (0 < q <= 100), nearest rank, as p99."""
    if not samples or not 0 < q <= 100:
        raise ValueError(f"percentile {q} of {len(samples)} samples")
    ordered = sorted(samples)
    return ordered[max(-(-q * len(ordered) // 100) - 1, 0)]


def _summary(samples_s: Sequence[float]) -> tuple[float, float]:
    """(median, p99) in milliseconds of samples in seconds."""
    return statistics.median(samples_s) * 1000, p99(samples_s) * 1000


# -- 1. throughput ------------------------------------------------------------------------


def _cas_loop(store: Store, n: int, key: str = CAS_KEY) -> float:
    """n single-key CAS transactions; returns the seconds they took."""
    get, txn = store.get, store.txn
    start = time.perf_counter()
    for i in range(n):
        kv = get(key)
        result = txn([at_revision(key, kv.mod_revision if kv else 0)], [Put(key, b"%d" % i)])
        if not result.succeeded:
            raise BenchError(f"CAS on {key} failed: something else writes the bench key")
    return time.perf_counter() - start


def raw_cas_rate(store: Store, n: int, warmup: int = 20) -> float:
    """The store's own single-key CAS transactions per second (get + txn comparing the
    key's mod_revision + put), sequential."""
    _cas_loop(store, warmup)
    return n / _cas_loop(store, n)


def _pair_pool() -> PoolSpec:
    return PoolSpec("benchpairs", [[{"subnet": "10.99.0.0/16", "gateway": "10.99.0.1"}]])


class _Pairs:
    """allocate+release pairs through a Ledger, each with a new attachment."""

    def __init__(self, store: Store) -> None:
        self.ledger = Ledger(store, NODE)
        self.spec = _pair_pool()
        self.count = 0

    def loop(self, n: int) -> tuple[float, float]:
        """Seconds for `n` pairs, and the part of it spent in allocate."""
        allocate, release, pools = self.ledger.allocate, self.ledger.release, [self.spec]
        pod = PodInfo("bench", "pair", "uid-pair")
        clock = time.perf_counter
        allocating = 0.0
        start = clock()
        for _ in range(n):
            attachment = Attachment("benchpairs", f"pair-{self.count}", "eth0")
            self.count += 1
            before = clock()
            allocate(pools, attachment, pod)
            allocating += clock() - before
            if not release(attachment):
                raise BenchError(f"release of {attachment} freed nothing")
        return clock() - start, allocating


def ledger_pair_rate(store: Store, n: int, warmup: int = 20) -> float:
    """Ledger allocate+release pairs per second, sequential, on `store`."""
    pairs = _Pairs(store)
    pairs.loop(warmup)
    return n / pairs.loop(n)[0]


def throughput(store: Store, n: int, chunks: int = 4, warmup: int = 20) -> dict[str, float]:
    """Raw CAS rate and ledger pair rate on one store, measured in alternating chunks so
    that drift in the machine's speed falls on both alike."""
    pairs = _Pairs(store)
    _cas_loop(store, warmup)
    pairs.loop(warmup)
    per_chunk = max(n // chunks, 1)
    cas_s = pair_s = alloc_s = 0.0
    for _ in range(chunks):
        cas_s += _cas_loop(store, per_chunk)
        whole, allocating = pairs.loop(per_chunk)
        pair_s += whole
        alloc_s += allocating
    total = per_chunk * chunks
    return {
        "raw_cas_per_s": total / cas_s,
        "ledger_pairs_per_s": total / pair_s,
        "ledger_allocations_per_s": total / alloc_s,
        "n": total,
    }


# -- a temporary etcd ---------------------------------------------------------------------


@contextlib.contextmanager
def _etcd(root: Path) -> Iterator[str]:
    """A one-member etcd on free loopback ports with its data in `root` (etcd's
    defaults otherwise: fsync on); yields its etcd:// URL and stops it on exit."""
    with etcd_server(root) as server:
        yield server.url


# -- 2. plugin exec -----------------------------------------------------------------------


def _ipam_config(ipam: dict) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "benchnet", "ipam": ipam}).encode()


class _Exec:
    """Runs one executable with a CNI environment and stdin, timing each exec."""

    def __init__(self, argv: list[str], stdin: bytes, cni_path: str) -> None:
        self.argv = argv
        self.stdin = stdin
        self.base_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/x",
            "CNI_PATH": cni_path,
        }

    def run(self, command: str, container: str) -> float:
        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        done = subprocess.run(self.argv, input=self.stdin, env=env, capture_output=True)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            raise BenchError(
                f"{' '.join(self.argv)} {command} {container} exited {done.returncode}:"
                f" {done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
            )
        return elapsed


def _exec_kinds(tmp: Path, ipward_cfg: bytes) -> dict[str, _Exec]:
    """Install the plugin in tmp/bin as `ipward install-cni` does; the bare interpreter,
    the plugin with `ipward_cfg` and host-local (when installed), in that order."""
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin's interpreter")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    write_launcher(bin_dir / "ipward")
    cni_path = f"{bin_dir}:{CNI_BIN_DIR}"
    host_local_cfg = _ipam_config(
        {
            "type": "host-local",
            "dataDir": str(tmp / "host-local"),
            "ranges": [[{"subnet": "10.20.0.0/16"}]],
        }
    )
    kinds: dict[str, _Exec] = {
        "python": _Exec([PLUGIN_PYTHON, "-I", "-S", "-c", "pass"], b"", cni_path),
        "ipward": _Exec([str(bin_dir / "ipward")], ipward_cfg, cni_path),
    }
    if os.access(HOST_LOCAL, os.X_OK):
        kinds["host_local"] = _Exec([HOST_LOCAL], host_local_cfg, cni_path)
    return kinds


def exec_latency(tmp: Path, runs: int, warmup: int = 5) -> dict[str, float]:
    """ADD exec latency of the installed plugin, of a bare interpreter and of host-local,
    interleaved run by run; DEL of every ADD afterwards (not timed)."""
    ipward_cfg = _ipam_config(
        {
            "type": "ipward",
            "store": f"sqlite://{tmp}/b.db",
            "ranges": [[{"subnet": "10.10.0.0/16"}]],
        }
    )
    return _interleaved_adds(_exec_kinds(tmp, ipward_cfg), runs, warmup)


def _interleaved_adds(kinds: dict[str, _Exec], runs: int, warmup: int) -> dict[str, float]:
    """ADD of every kind, interleaved run by run; then DEL of every ADD of the kinds that
    allocate (not timed). {kind.median_ms, kind.p99_ms} for each kind."""
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    added: list[str] = []
    for i in range(-warmup, runs):
        container = f"bench-{'warm' if i < 0 else 'run'}-{abs(i)}"
        for kind, ex in kinds.items():
            elapsed = ex.run("ADD", container)
            if i >= 0:
                samples[kind].append(elapsed)
        added.append(container)
    for container in added:
        for kind in ("ipward", "host_local"):
            if kind in kinds:
                kinds[kind].run("DEL", container)
    out: dict[str, float] = {}
    for kind, values in samples.items():
        out[f"{kind}.median_ms"], out[f"{kind}.p99_ms"] = _summary(values)
    return out


# -- 3. allocate latency as the pool fills ------------------------------------------------


class Scenario:
    __slots__ = ("fill", "label", "name", "subnet")

    def __init__(self, name: str, label: str, subnet: str, fill: int) -> None:
        self.name = name
        self.label = label
        self.subnet = subnet
        self.fill = fill


def _usable(prefix: int) -> int:
    return (1 << (32 - prefix)) - 2  # IPv4 without network and broadcast


def scenarios(quick: bool) -> list[Scenario]:
    full_prefix = 20 if quick else 16
    full = int(_usable(full_prefix) * 0.9)
    return [
        Scenario("empty_24", "empty /24", "10.1.0.0/24", 0),
        Scenario(
            f"full90_{full_prefix}",
            f"/{full_prefix}, 90% full ({full:,} in use)",
            f"10.2.0.0/{full_prefix}",
            full,
        ),
        Scenario("v6_64_10k", "IPv6 /64, 10,000 in use", "fd00:be::/64", 10_000),
        Scenario("v4_8_10k", "10.0.0.0/8, 10,000 in use", "10.0.0.0/8", 10_000),
    ]


def _scenario_pool(s: Scenario) -> PoolSpec:
    # Cooldown 0: from the second round on, every scenario reuses freed addresses the same
    # way, so the rounds exercise the fresh-address and the reuse path alike everywhere.
    return PoolSpec(f"bench-{s.name}", [[{"subnet": s.subnet}]], cooldown=0)


def _fill(path: str, spec: PoolSpec, count: int) -> None:
    """`count` addresses of `spec` in use in the SQLite file at `path`, as one ledger
    leaves them (`bulk_fill`). Set-up, not measured: written without fsync at each commit
    (synchronous=OFF) to save time."""
    store = SqliteStore(path)
    try:
        store._conn.execute("PRAGMA synchronous=OFF")
        bulk_fill(store, spec, count)
    finally:
        store.close()


class _BlockFiller:
    """One range set's blocks as one ledger on one node fills them from an empty pool
    with no releases: blocks claimed in order as they run out, addresses taken in
    order within a block (`Block.next_usable`), so exclusions and the gateway are
    skipped the ledger's way."""

    def __init__(self, spec: PoolSpec, index: int, node: str) -> None:
        self.spec = spec
        self.rs = spec.range_sets[index]
        self.node = node
        self.claimed = 0  # blocks claimed: the pool's block cursor
        self.block: Block | None = None  # the block being filled (the node's fill record)
        self.offset = 0  # where to look from in it
        self.last: dict[str, int] = {}  # cidr -> the block's cursor (last offset taken + 1)

    def take(self) -> tuple[str, str]:
        """The next address and its block's CIDR."""
        while True:
            if self.block is not None:
                found = self.block.next_usable(self.offset)
                if found is not None:
                    self.offset = found + 1
                    self.last[self.block.cidr] = found + 1
                    return self.block.address(found), self.block.cidr
            # The block is used up (or none is claimed yet): claim the next one.
            block = self.rs.block(self.claimed)
            if block is None:
                raise BenchError(f"pool {self.spec.name} has fewer addresses than asked")
            self.claimed += 1
            self.block = block
            self.offset = 0
            self.last.setdefault(block.cidr, 0)

    def ops(self) -> list[Put]:
        """The blocks, their affinity entries, the node's fill record and the cursor."""
        name, family = self.spec.name, self.rs.family
        out: list[Put] = []
        for cidr, next_offset in self.last.items():
            state = {"node": self.node, "state": rec.ACTIVE, "next": next_offset}
            out.append(Put(rec.block_key(name, cidr), rec.encode(state)))
            out.append(Put(rec.affinity_key(name, self.node, cidr), b""))
        if self.block is not None:
            out.append(
                Put(rec.fill_key(name, family, self.node), rec.encode({"block": self.block.cidr}))
            )
            out.append(Put(rec.block_cursor_key(name, family), rec.encode({"next": self.claimed})))
        return out


def bulk_fill(
    store: Store,
    spec: PoolSpec,
    count: int,
    *,
    node: str = NODE,
    network: str = "benchfill",
    prefix: str = "fill",
    pods: Callable[[int], PodInfo] | None = None,
    created_at: float | None = None,
    batch: int = 2000,
) -> list[Attachment]:
    """Write what `count` ADDs through one ledger on `node` leave in an empty pool (no
    releases): the pool spec, one record per address naming its block, one index per
    attachment (`<network>/<prefix>-<i>/eth0`, pod `pods(i)`), every block claimed with
    its affinity entry and cursor, the node's fill records and the pool's block cursors:
    the same keys and values as the ledger's (tests/test_bench.py compares them), in
    large transactions without compares, so 100,000 take seconds. Set-up only: on an
    empty store, with nothing else writing. Returns the attachments."""
    if count <= 0:
        return []
    now = time.time() if created_at is None else created_at
    default_pod = PodInfo("bench", "fill", "uid-fill")
    fillers = [_BlockFiller(spec, i, node) for i in range(len(spec.range_sets))]
    ops: list[Put] = [Put(rec.pool_key(spec.name), rec.encode(spec.to_dict()))]
    attachments = []
    for i in range(count):
        attachment = Attachment(network, f"{prefix}-{i}", "eth0")
        pod = default_pod if pods is None else pods(i)
        refs = []
        for filler in fillers:
            ip, cidr = filler.take()
            refs.append(f"{spec.name}/{ip}")
            record = rec.ip_record(attachment, pod, node, cidr, now, False)
            ops.append(Put(rec.ip_key(spec.name, ip), rec.encode(record)))
        ops.append(Put(attachment.key, rec.encode({"ips": refs})))
        attachments.append(attachment)
        if len(ops) >= batch:
            _write(store, ops)
            ops = []
    for filler in fillers:
        ops += filler.ops()
    _write(store, ops)
    return attachments


def _write(store: Store, ops: Sequence[Put]) -> None:
    if ops and not store.txn([], list(ops)).succeeded:
        raise BenchError("bulk write failed")


def allocate_latency(
    pools: Sequence[tuple[str, PoolSpec]],
    rounds: int,
    per_round: int,
    warmup: int = 20,
    releases: list[list[float]] | None = None,
) -> list[list[float]]:
    """Seconds per ledger allocate (in-process) on each (SQLite path, pool): `rounds`
    rounds of `per_round` timed allocations, each round released afterwards. The pools
    take turns call by call, so drift in the machine's speed falls on all of them
    alike. Returns one list of samples per pool; with `releases` (a list), appends the
    seconds of each release per pool to it as well."""
    stores = [SqliteStore(path) for path, _ in pools]
    try:
        ledgers = [Ledger(store, NODE) for store in stores]
        specs = [[spec] for _, spec in pools]
        pod = PodInfo("bench", "lat", "uid-lat")
        for ledger, (_, spec) in zip(ledgers, pools, strict=True):
            for i in range(warmup):
                attachment = Attachment("benchlat", f"warm-{i}", "eth0")
                ledger.allocate([spec], attachment, pod)
                ledger.release(attachment)
        samples: list[list[float]] = [[] for _ in pools]
        released: list[list[float]] = [[] for _ in pools]
        clock = time.perf_counter
        for r in range(rounds):
            attachments = [Attachment("benchlat", f"r{r}-{i}", "eth0") for i in range(per_round)]
            for attachment in attachments:
                for ledger, spec_list, out in zip(ledgers, specs, samples, strict=True):
                    start = clock()
                    ledger.allocate(spec_list, attachment, pod)
                    out.append(clock() - start)
            for attachment in attachments:
                for ledger, out in zip(ledgers, released, strict=True):
                    start = clock()
                    freed = ledger.release(attachment)
                    out.append(clock() - start)
                    if not freed:
                        raise BenchError(f"release of {attachment} freed nothing")
        if releases is not None:
            releases.extend(released)
        return samples
    finally:
        for store in stores:
            store.close()


# -- 4. how cost grows: pool size, pool fill, records ---------------------------------------

GROWTH_IN_USE = 100  # addresses in use in every pool of the pool-size series
POOL_SIZES = [  # (name, label, subnet)
    ("v4_24", "/24", "10.1.0.0/24"),
    ("v4_20", "/20", "10.2.0.0/20"),
    ("v4_16", "/16", "10.3.0.0/16"),
    ("v4_12", "/12", "10.16.0.0/12"),
    ("v4_8", "/8", "10.0.0.0/8"),
    ("v6_64", "IPv6 /64", "fd00:be::/64"),
]
FILL_PERCENTS = (10, 50, 90, 99)
RECORD_COUNTS = (1_000, 10_000, 100_000)
GC_POOL = "benchgc"
GC_SUBNET = "10.0.0.0/8"
OTHER_NODE = "bench-other-node"
RECORD_AGE = 3600.0  # seconds since the ADD of every record of the GC stores (past the grace)
AGENT_RECONCILE_TIMEOUT = 300.0


def _count_label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def _latency_rows(
    tmp: Path,
    tag: str,
    pools: Sequence[tuple[str, PoolSpec, int]],
    rounds: int,
    per_round: int,
) -> list[dict[str, float]]:
    """Each (name, pool, addresses in use) in a SQLite file of its own, filled, then
    timed allocate and release calls taking turns: {in_use, add/del median and p99 ms}
    per pool."""
    paths = []
    for name, spec, in_use in pools:
        path = str(tmp / f"{tag}-{name}.db")
        _fill(path, spec, in_use)
        paths.append((path, spec))
    releases: list[list[float]] = []
    adds = allocate_latency(paths, rounds, per_round, releases=releases)
    rows = []
    for (_, _, in_use), add_s, del_s in zip(pools, adds, releases, strict=True):
        add_median, add_p99 = _summary(add_s)
        del_median, del_p99 = _summary(del_s)
        rows.append(
            {
                "in_use": float(in_use),
                "add_median_ms": add_median,
                "add_p99_ms": add_p99,
                "del_median_ms": del_median,
                "del_p99_ms": del_p99,
            }
        )
    return rows


def pool_size_latency(
    tmp: Path, rounds: int, per_round: int, in_use: int = GROWTH_IN_USE
) -> dict[str, dict[str, float]]:
    """ADD (in-process `Ledger.allocate`) and DEL latency on SQLite in pools from /24 to
    /8 and an IPv6 /64, each with `in_use` addresses in use: {name: figures}, with the
    pool's capacity in `addresses`."""
    pools = [
        (name, PoolSpec(f"size-{name}", [[{"subnet": subnet}]], cooldown=0), in_use)
        for name, _, subnet in POOL_SIZES
    ]
    rows = _latency_rows(tmp, "size", pools, rounds, per_round)
    out = {}
    for (name, spec, _), row in zip(pools, rows, strict=True):
        out[name] = {**row, "addresses": float(spec.range_sets[0].capacity())}
    return out


def fill_latency(
    tmp: Path, prefix: int, rounds: int, per_round: int, percents: Sequence[int] = FILL_PERCENTS
) -> dict[int, dict[str, float]]:
    """ADD and DEL latency in one /`prefix` pool filled to each of `percents` (a file
    each): {percent: figures}. Fewer than `per_round` + 20 addresses left free is an
    error (the rounds would exhaust the pool)."""
    pools = []
    for pct in percents:
        spec = PoolSpec(f"fill-{pct}", [[{"subnet": f"10.4.0.0/{prefix}"}]], cooldown=0)
        capacity = spec.range_sets[0].capacity()
        in_use = capacity * pct // 100
        if capacity - in_use < per_round + 20:
            raise BenchError(
                f"/{prefix} at {pct}% leaves too few addresses for {per_round} calls a round"
            )
        pools.append((str(pct), spec, in_use))
    rows = _latency_rows(tmp, "fill", pools, rounds, per_round)
    return {pct: row for pct, row in zip(percents, rows, strict=True)}


class RecordStore:
    """A SQLite store holding `records` allocation records of one node (pool
    `benchgc`, 10.0.0.0/8), every record's sandbox listed ready in a simulated
    cluster's published state: `state` with the runtime's sandboxes and the cluster's
    pods (what the controller's GC reads), `runtime_state` with the sandboxes only (what
    its agent's runtime answers), `other_state` with another node's empty runtime."""

    def __init__(self, tmp: Path, records: int) -> None:
        self.records = records
        label = _count_label(records)
        self.path = str(tmp / f"records-{label}.db")
        self.state = str(tmp / f"records-{label}.state.json")
        self.runtime_state = str(tmp / f"records-{label}.runtime.json")
        self.other_state = str(tmp / f"records-{label}.other.json")
        spec = PoolSpec(GC_POOL, [[{"subnet": GC_SUBNET}]])
        now = time.time()
        store = SqliteStore(self.path)
        try:
            store._conn.execute("PRAGMA synchronous=OFF")
            bulk_fill(
                store,
                spec,
                records,
                network="benchgc",
                prefix="sandbox",
                pods=lambda i: PodInfo("bench", f"pod-{i}", f"uid-{i}"),
                created_at=now - RECORD_AGE,
            )
        finally:
            store.close()
        sandboxes = [
            {
                "id": f"sandbox-{i}",
                "ready": True,
                "namespace": "bench",
                "name": f"pod-{i}",
                "uid": f"uid-{i}",
                "created_at": now - RECORD_AGE,
            }
            for i in range(records)
        ]
        pods = [
            {
                "uid": f"uid-{i}",
                "namespace": "bench",
                "name": f"pod-{i}",
                "phase": "Running",
                "node": NODE,
            }
            for i in range(records)
        ]
        runtimes = {NODE: {"sandboxes": sandboxes}}
        write_sim_state(self.state, now, {"pods": pods, "nodes": [NODE]}, runtimes)
        write_sim_state(self.runtime_state, now, {"pods": [], "nodes": [NODE]}, runtimes)
        # Another node's runtime, which holds none of these sandboxes.
        write_sim_state(
            self.other_state, now, {"pods": [], "nodes": [NODE]}, {OTHER_NODE: {"sandboxes": []}}
        )


def gc_pass_times(stores: Sequence[RecordStore], repeats: int) -> dict[int, dict[str, float]]:
    """Per store, the median seconds (of `repeats`, the stores taking turns) of: the raw
    `store.range("ips/")` (the reference), one `gc.look` pass (records, registrations,
    liveness, every record judged), its parts alone (`snapshot`, `gather`, `judge`),
    and the controller's own `gc_pass` (also the sticky reservations; first pass, so
    nothing is confirmed). Every record must be judged alive."""
    from ipward import gc
    from ipward.controller import Controller, Election, Metrics
    from ipward.ledger import ADD_GRACE

    samples: dict[int, dict[str, list[float]]] = {s.records: {} for s in stores}
    sessions = []
    try:
        for s in stores:
            store = SqliteStore(s.path)
            source = SimFileSource(s.state, timeout=30.0)
            controller = Controller(
                store,
                Election(store, "bench", 10),  # never started: gc_pass only reads
                Metrics("bench", lambda: False),
                interval=3600.0,
                ready_delay=3600.0,
                liveness=source,
            )
            sessions.append((s, store, source, controller))
        for _ in range(repeats):
            for s, store, source, controller in sessions:
                times = samples[s.records]

                def timed(name: str, times: dict[str, list[float]] = times) -> _Timer:
                    return _Timer(times.setdefault(name, []))

                with timed("raw_range_s"):
                    kvs, _ = store.range("ips/")
                if len(kvs) != s.records:
                    raise BenchError(f"{len(kvs)} records in {s.path}, expected {s.records}")
                del kvs
                with timed("look_s"):
                    verdicts = gc.look(store, source, ADD_GRACE).verdicts
                leaked = sum(v.reason is not None for v in verdicts)
                if leaked or len(verdicts) != s.records:
                    raise BenchError(f"GC judged {leaked} of {len(verdicts)} records leaked")
                del verdicts
                with timed("snapshot_s"):
                    held = gc.snapshot(store)
                with timed("gather_s"):
                    evidence = gc.gather(
                        source,
                        sorted({h.node for h in held}),
                        grace=ADD_GRACE,
                        registered=gc.registered_nodes(store),
                    )
                with timed("judge_s"):
                    for h in held:
                        gc.judge(h, evidence)
                del held, evidence
                with timed("controller_pass_s"):
                    freed = controller.gc_pass()
                if freed:
                    raise BenchError(f"the controller's GC pass freed {len(freed)} records")
    finally:
        for _, store, _, _ in sessions:
            store.close()
    return {
        n: {name: statistics.median(values) for name, values in times.items()}
        for n, times in samples.items()
    }


class _Timer:
    """`with _Timer(samples):` appends the seconds the block took."""

    def __init__(self, samples: list[float]) -> None:
        self.samples = samples
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self.start)


def _memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (peak resident) of a process in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
    return {"rss_mib": values["VmRSS"], "hwm_mib": values["VmHWM"]}


def agent_memory(tmp: Path, records: RecordStore, other_node: bool = False) -> dict[str, float]:
    """A real `ipward agent` (fleet.Agent) of the records' node on their store, its
    runtime the simulated one listing every record's sandbox ready; once its first
    reconcile pass has read and judged every record of its node (its "reconciled" log
    line), its VmRSS and VmHWM in MiB. Then it is stopped. With `other_node`, the agent
    of another node (its pass reads every record and keeps none)."""
    from ipward_lab.fleet import Agent, FleetError

    label = f"{_count_label(records.records)}{'-other' if other_node else ''}"
    node, state = (OTHER_NODE, records.other_state) if other_node else (NODE, records.runtime_state)
    expected = 0 if other_node else records.records
    agent = Agent(
        node,
        f"sqlite://{records.path}",
        tmp / "sockets" / f"agent-{label}.sock",
        tmp / "agent-logs",
        extra=("--liveness", f"sim://{state}", "--reconcile-interval", "3600"),
        metrics=False,
    )
    try:
        agent.wait_started(AGENT_READY_TIMEOUT)
        deadline = time.monotonic() + AGENT_RECONCILE_TIMEOUT
        while not (passes := agent.logged("reconciled")):
            if not agent.running or time.monotonic() > deadline:
                raise BenchError(f"agent on {label} records: no reconcile pass:\n{agent.output()}")
            time.sleep(0.05)
        if passes[0].get("records") != expected or passes[0].get("freed"):
            raise BenchError(f"agent on {label} records: unexpected pass {passes[0]}")
        # The line is logged before the pass lets go of what it read: wait until the
        # resident size stops moving (or 3 s), then read it.
        memory = _memory_mib(agent.pid)
        settle = time.monotonic() + 3.0
        while time.monotonic() < settle:
            time.sleep(0.1)
            now = _memory_mib(agent.pid)
            steady = abs(now["rss_mib"] - memory["rss_mib"]) < 0.25
            memory = now
            if steady:
                break
        return memory
    except FleetError as e:
        raise BenchError(str(e)) from None
    finally:
        try:
            agent.stop(AGENT_STOP_TIMEOUT)
        except (subprocess.TimeoutExpired, FleetError):
            agent.kill()


def _addresses(n: float) -> str:
    if n >= 1e12:
        return f"2^{round(math.log2(n + 2))}"
    return f"{n:,.0f}"


def run_growth(
    tmp: Path,
    quick: bool,
    out: Callable[[str], object] = print,
    *,
    rounds: int | None = None,
    per_round: int | None = None,
    fill_prefix: int | None = None,
    counts: Sequence[int] | None = None,
) -> tuple[dict[str, float], dict, dict[str, list[list[str]]]]:
    """How cost grows (`ipward bench --report`): ADD latency against pool size and pool
    fill, GC pass time and agent memory against the number of records, each next to
    its reference from the same run (the /24, the 10% fill, the raw store read, the
    agent on an empty store). Sizes default by `quick`: rounds x per_round timed calls
    (2 x 50, else 5 x 100), the filled pool's prefix (/18, else /16), record counts (1k
    and 10k, else also 100k). Returns (figures, series for the plots, tables)."""
    figures: dict[str, float] = {}
    series: dict = {}
    tables: dict[str, list[list[str]]] = {}
    if rounds is None or per_round is None:
        rounds, per_round = (2, 50) if quick else (5, 100)
    samples = f"{rounds * per_round}"

    # 4. pool size -------------------------------------------------------------------
    out(
        f"  ... ADD vs pool size: {samples} timed allocations and releases in pools /24 to /8"
        f" and IPv6 /64, {GROWTH_IN_USE} in use each, taking turns"
    )
    sizes = pool_size_latency(tmp, rounds, per_round)
    base = sizes["v4_24"]["add_median_ms"]
    rows = [
        [
            f"4. ADD vs pool size ({GROWTH_IN_USE} in use, {samples} allocs)",
            "addresses",
            "ADD median ms",
            "ADD p99 ms",
            "DEL median ms",
            "vs /24",
        ]
    ]
    series["pool_size"] = []
    for name, label, _ in POOL_SIZES:
        row = sizes[name]
        row["vs_24"] = row["add_median_ms"] / base
        for key, value in row.items():
            figures[f"growth.size.{name}.{key}"] = value
        series["pool_size"].append({"name": name, "label": label, **row})
        rows.append(
            [
                label,
                _addresses(row["addresses"]),
                f"{row['add_median_ms']:.3f}",
                f"{row['add_p99_ms']:.3f}",
                f"{row['del_median_ms']:.3f}",
                f"{row['vs_24']:.2f}x",
            ]
        )
    tables["pool_size"] = rows

    # 5. pool fill -------------------------------------------------------------------
    prefix = fill_prefix or (18 if quick else 16)
    out(
        f"  ... ADD vs fill: a /{prefix} at {', '.join(f'{p}%' for p in FILL_PERCENTS)} (bulk"
        f" written), {samples} timed allocations and releases each, taking turns"
    )
    fills = fill_latency(tmp, prefix, rounds, per_round)
    base = fills[FILL_PERCENTS[0]]["add_median_ms"]
    rows = [
        [
            f"5. ADD vs fill, /{prefix} ({samples} allocs)",
            "in use",
            "ADD median ms",
            "ADD p99 ms",
            "DEL median ms",
            f"vs {FILL_PERCENTS[0]}%",
        ]
    ]
    series["fill"] = []
    for pct, row in fills.items():
        row["vs_first"] = row["add_median_ms"] / base
        for key, value in row.items():
            figures[f"growth.fill.{pct}.{key}"] = value
        series["fill"].append({"percent": pct, "prefix": prefix, **row})
        rows.append(
            [
                f"{pct}% full",
                f"{row['in_use']:,.0f}",
                f"{row['add_median_ms']:.3f}",
                f"{row['add_p99_ms']:.3f}",
                f"{row['del_median_ms']:.3f}",
                f"{row['vs_first']:.2f}x",
            ]
        )
    tables["fill"] = rows

    # 6. GC pass against records -------------------------------------------------------
    if counts is None:
        counts = RECORD_COUNTS[:2] if quick else RECORD_COUNTS
    repeats = 3
    out(
        f"  ... GC: stores of {', '.join(_count_label(n) for n in counts)} records (bulk"
        f" written), every sandbox listed ready; {repeats} passes each, taking turns"
    )
    stores = [RecordStore(tmp, n) for n in counts]
    passes = gc_pass_times(stores, repeats)
    rows = [
        [
            f"6. GC pass, SQLite (median of {repeats})",
            "raw range ms",
            "gc.look ms",
            "vs range",
            "snapshot ms",
            "liveness ms",
            "judge ms",
            "controller ms",
        ]
    ]
    series["gc"] = []
    for n in counts:
        t = {key.removesuffix("_s") + "_ms": value * 1000 for key, value in passes[n].items()}
        t["look_vs_range"] = t["look_ms"] / t["raw_range_ms"]
        t["look_us_per_record"] = t["look_ms"] * 1000 / n
        label = _count_label(n)
        for key, value in t.items():
            figures[f"growth.gc.{label}.{key}"] = value
        series["gc"].append({"records": n, **t})
        rows.append(
            [
                f"{n:,} records",
                f"{t['raw_range_ms']:.1f}",
                f"{t['look_ms']:.1f}",
                f"{t['look_vs_range']:.1f}x",
                f"{t['snapshot_ms']:.1f}",
                f"{t['gather_ms']:.1f}",
                f"{t['judge_ms']:.1f}",
                f"{t['controller_pass_ms']:.1f}",
            ]
        )
    tables["gc"] = rows

    # 7. agent memory against records --------------------------------------------------
    out(
        "  ... agent memory: a real agent on an empty store, then on each store (its own"
        " node's records, then another node's), after its first reconcile pass"
    )
    empty = RecordStore(tmp, 0)
    reference = agent_memory(tmp, empty)
    figures["growth.agent.empty.rss_mib"] = reference["rss_mib"]
    figures["growth.agent.empty.hwm_mib"] = reference["hwm_mib"]
    series["agent_empty"] = reference
    rows = [
        [
            "7. agent memory, after one reconcile pass",
            "VmRSS MiB",
            "VmHWM MiB",
            "peak vs empty",
            "peak KiB/record",
        ],
        [
            "empty store (reference)",
            f"{reference['rss_mib']:.1f}",
            f"{reference['hwm_mib']:.1f}",
            "1.00x",
            "",
        ],
    ]
    series["agent"] = []
    for whose in ("own", "other"):
        for s in stores:
            memory = agent_memory(tmp, s, other_node=whose == "other")
            memory["hwm_vs_empty"] = memory["hwm_mib"] / reference["hwm_mib"]
            memory["hwm_kib_per_record"] = (
                (memory["hwm_mib"] - reference["hwm_mib"]) * 1024 / s.records
            )
            label = _count_label(s.records)
            prefix_name = "agent" if whose == "own" else "agent_other"
            for key, value in memory.items():
                figures[f"growth.{prefix_name}.{label}.{key}"] = value
            series["agent"].append({"records": s.records, "node": whose, **memory})
            rows.append(
                [
                    f"{s.records:,} records, {'its node' if whose == 'own' else 'another node'}",
                    f"{memory['rss_mib']:.1f}",
                    f"{memory['hwm_mib']:.1f}",
                    f"{memory['hwm_vs_empty']:.2f}x",
                    f"{memory['hwm_kib_per_record']:.2f}",
                ]
            )
    tables["agent"] = rows
    return figures, series, tables


# -- the run ------------------------------------------------------------------------------


def _version_of(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "missing"
    if done.returncode != 0:
        return "missing"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "?"


def machine() -> dict[str, str | int]:
    etcd = _version_of([ETCD, "--version"]).removeprefix("etcd Version: ")
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count() or 0,
        "platform": platform.platform(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "plugin_python": _version_of(
            [PLUGIN_PYTHON, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"]
        )
        + f" ({PLUGIN_PYTHON} -I -S)",
        "sqlite": sqlite3.sqlite_version,
        "etcd": etcd,
    }


def _table(rows: list[list[str]], out: Callable[[str], object], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            # First column left-aligned, figures right-aligned.
            cells.append(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]))
        out((indent + "  ".join(cells)).rstrip())


def _verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def run(
    quick: bool = False,
    etcd: bool = True,
    out: Callable[[str], object] = print,
    growth: bool = False,
) -> dict:
    """Measure everything, print a report with `out`, and return the figures:
    {"machine": {...}, "figures": {name: number}, "targets": {name: {...}},
     "skipped": {part: reason}, "notes": {...}, "tables": {name: rows}}; with `growth`
    also how cost grows (`run_growth`: its figures are `growth.*`, its points in
    "series")."""
    began = time.perf_counter()
    figures: dict[str, float] = {}
    targets: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    info = machine()
    out(f"ipward bench{' --quick' if quick else ''}: {info['nproc']} CPUs ({info['platform']})")
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )

    with tempfile.TemporaryDirectory(prefix="ipward-bench-") as tmp_name:
        tmp = Path(tmp_name)

        # 1. throughput -------------------------------------------------------------
        rows = [
            [
                "1. sequential, in-process",
                "raw CAS/s",
                "allocs/s",
                "vs CAS",
                "pairs/s",
                "vs CAS",
                "target (allocs)",
            ]
        ]
        backends: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Store]]]] = []
        n_sqlite = 600 if quick else 3000
        n_etcd = 100 if quick else 500
        backends.append(("sqlite", lambda: SqliteStore(str(tmp / "throughput.db"))))
        if not etcd:
            skipped["etcd"] = "--no-etcd"
        elif not os.access(ETCD, os.X_OK):
            skipped["etcd"] = f"{ETCD} is missing (Debian package etcd-server)"
        else:
            backends.append(("etcd", lambda: _etcd_store(tmp / "etcd")))
        for name, opener in backends:
            n = n_sqlite if name == "sqlite" else n_etcd
            out(f"  ... {name}: {n} raw CAS and {n} allocate+release pairs, interleaved")
            try:
                with opener() as store:
                    t = throughput(store, n)
            except (BenchError, StoreError) as e:
                if name == "sqlite":
                    raise
                skipped[name] = f"failed: {e}"
                out(f"  ... {name} skipped: {e}")
                continue
            ratio = t["ledger_allocations_per_s"] / t["raw_cas_per_s"]
            pair_ratio = t["ledger_pairs_per_s"] / t["raw_cas_per_s"]
            figures[f"{name}.raw_cas_per_s"] = t["raw_cas_per_s"]
            figures[f"{name}.ledger_allocations_per_s"] = t["ledger_allocations_per_s"]
            figures[f"{name}.ledger_pairs_per_s"] = t["ledger_pairs_per_s"]
            figures[f"{name}.ledger_vs_cas"] = ratio
            figures[f"{name}.pairs_vs_cas"] = pair_ratio
            ok = ratio >= TARGET_LEDGER_VS_CAS
            targets[f"{name}.ledger_vs_cas"] = {
                "value": ratio,
                "target": f">= {TARGET_LEDGER_VS_CAS}",
                "met": ok,
            }
            rows.append(
                [
                    f"{name} (n={t['n']:.0f})",
                    f"{t['raw_cas_per_s']:.0f}",
                    f"{t['ledger_allocations_per_s']:.0f}",
                    f"{ratio:.2f}x",
                    f"{t['ledger_pairs_per_s']:.0f}",
                    f"{pair_ratio:.2f}x",
                    f">= {TARGET_LEDGER_VS_CAS}x {_verdict(ok)}",
                ]
            )
        if "etcd" in skipped:
            rows.append(["etcd", "skipped:", skipped["etcd"].splitlines()[0][:60], "", "", "", ""])

        # 2. plugin exec ------------------------------------------------------------
        runs = 40 if quick else 200
        out(f"  ... plugin exec: {runs} ADDs each of python, ipward and host-local, interleaved")
        exec_dir = tmp / "exec"
        exec_dir.mkdir()
        ex = exec_latency(exec_dir, runs)
        for key, value in ex.items():
            figures[f"exec.{key}"] = float(value)
        diff = figures["exec.ipward.median_ms"] - figures["exec.python.median_ms"]
        figures["exec.ipward_minus_python_ms"] = diff
        ok = diff <= TARGET_EXEC_OVER_PYTHON_MS
        targets["exec.ipward_minus_python_ms"] = {
            "value": diff,
            "target": f"<= {TARGET_EXEC_OVER_PYTHON_MS} ms",
            "met": ok,
        }
        exec_rows = [[f"2. exec latency ({runs} runs)", "median ms", "p99 ms", "", ""]]
        labels = {
            "python": f"{PLUGIN_PYTHON} -I -S -c pass",
            "host_local": "host-local ADD",
            "ipward": "ipward ADD (single-node, SQLite)",
        }
        for kind, label in labels.items():
            if f"exec.{kind}.median_ms" in figures:
                exec_rows.append(
                    [
                        label,
                        f"{figures[f'exec.{kind}.median_ms']:.2f}",
                        f"{figures[f'exec.{kind}.p99_ms']:.2f}",
                        "",
                        "",
                    ]
                )
            else:
                skipped[f"exec.{kind}"] = f"{HOST_LOCAL} is missing"
                exec_rows.append([label, "skipped", "", "", ""])
        exec_rows.append(
            [
                "ipward - python (median)",
                f"{diff:+.2f}",
                "",
                "",
                f"<= {TARGET_EXEC_OVER_PYTHON_MS:.0f} ms {_verdict(ok)}",
            ]
        )

        # 3. allocate latency as the pool fills -------------------------------------
        rounds, per_round = (2, 50) if quick else (5, 100)
        lat_rows = [
            [
                f"3. ledger allocate, SQLite ({rounds * per_round} allocs)",
                "median ms",
                "p99 ms",
                "vs empty",
                "target",
            ]
        ]
        todo = scenarios(quick)
        pools = []
        for s in todo:
            spec = _scenario_pool(s)
            path = str(tmp / f"latency-{s.name}.db")
            if s.fill:
                out(f"  ... filling {s.label} (written in bulk as one ledger leaves it)")
                _fill(path, spec, s.fill)
            pools.append((path, spec))
        out(f"  ... {rounds * per_round} timed allocations in each pool, taking turns")
        all_samples = allocate_latency(pools, rounds, per_round)
        empty_median = 0.0
        for s, samples in zip(todo, all_samples, strict=True):
            median, tail = _summary(samples)
            figures[f"latency.{s.name}.median_ms"] = median
            figures[f"latency.{s.name}.p99_ms"] = tail
            if not s.fill:
                empty_median = median
                lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", "1.00x", ""])
                continue
            ratio = median / empty_median
            figures[f"latency.{s.name}.vs_empty"] = ratio
            target = ""
            if s.fill == 10_000:
                ok = ratio <= TARGET_IN_USE_VS_EMPTY
                targets[f"latency.{s.name}.vs_empty"] = {
                    "value": ratio,
                    "target": f"<= {TARGET_IN_USE_VS_EMPTY}",
                    "met": ok,
                }
                target = f"<= {TARGET_IN_USE_VS_EMPTY}x {_verdict(ok)}"
            lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", f"{ratio:.2f}x", target])
        tables = {"throughput": rows, "exec": exec_rows, "latency": lat_rows}

        # 4-7. how cost grows --------------------------------------------------------
        series: dict = {}
        if growth:
            growth_figures, series, growth_tables = run_growth(tmp, quick, out)
            figures.update(growth_figures)
            tables.update(growth_tables)

    elapsed = time.perf_counter() - began
    for table in tables.values():
        out("")
        _table(table, out)
    out("")
    out("  1: allocs/s times the allocate calls of the pairs loop; a pair is one allocate and")
    out("     one release, each its own durable transaction, so pairs/s is bounded by half the")
    out("     CAS rate; raw CAS is get + txn(compare mod_revision, put) on one key; same run.")
    out("  3: pools with cooldown 0; rounds of allocations, each round released (untimed)")
    out("     before the next, so later rounds reuse freed addresses in every pool alike.")
    if growth:
        for line in GROWTH_NOTES:
            out(line)
    out(f"  whole run: {elapsed:.1f} s")
    notes["elapsed_s"] = f"{elapsed:.1f}"
    result = {
        "machine": info,
        "figures": figures,
        "targets": targets,
        "skipped": skipped,
        "notes": notes,
        "tables": tables,
    }
    if growth:
        result["series"] = series
    return result


GROWTH_NOTES = [
    "  4, 5: in-process Ledger.allocate and release on SQLite (fsync at commit), pools with",
    "     cooldown 0 filled as one ledger leaves them (blocks claimed in order); the pools",
    "     take turns call by call.",
    "  6: records of one node, all listed ready by the simulated runtime; gc.look = records",
    "     (snapshot), registrations and liveness (the simulated cluster's state file, read",
    "     once for the node and once for the cluster), then every record judged; controller",
    "     = Controller.gc_pass (also the sticky reservations). Raw range: store.range('ips/').",
    "  7: a real `ipward agent` on the same stores; VmRSS settled after its first reconcile",
    "     pass, VmHWM its peak; 'another node': the agent of a node holding none of them.",
]


@contextlib.contextmanager
def _etcd_store(root: Path) -> Iterator[Store]:
    from ipward.store.etcd import EtcdStore  # grpc: only when etcd is measured

    root.mkdir()
    with _etcd(root) as url:
        store = EtcdStore.from_url(url)
        try:
            yield store
        finally:
            store.close()


# -- the cluster: agents on one etcd -------------------------------------------------------

CLUSTER_POOL = "benchcluster"
CLUSTER_SUBNET = "10.64.0.0/14"
CLUSTER_BLOCK_V4 = 26
AGENT_READY_TIMEOUT = 30.0
AGENT_STOP_TIMEOUT = 10.0
AGENT_MAX_WORKERS = 16  # the agent's default --max-workers, which the bench leaves as is
TARGET_CLUSTER_VS_CAS = 0.5  # aggregate ADDs/s >= 0.5 x raw CAS/s at the same concurrency
TARGET_AGENT_EXEC_OVER_PYTHON_MS = 5.0  # plugin ADD (through the agent) - bare interpreter


class _AgentProcess:
    """One real `ipward agent` process of the bench's cluster, its log in a file."""

    def __init__(self, root: Path, index: int, store_url: str) -> None:
        self.node = f"bench-node-{index}"
        self.socket = str(root / "sockets" / f"agent-{index}.sock")
        self.log_path = root / f"agent-{index}.log"
        self.stderr_path = root / f"agent-{index}.stderr"
        args = [
            sys.executable,
            "-m",
            "ipward.cli",
            "agent",
            "--node",
            self.node,
            "--store",
            store_url,
            "--socket",
            self.socket,
            "--metrics-address",
            "off",
            "--log-file",
            str(self.log_path),
        ]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )

    def wait_ready(self, deadline: float) -> None:
        """Until a VERSION call through its socket is answered."""
        from ipward.plugin import forward
        from ipward.wire import WireError

        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"agent {self.node} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                status, _ = forward(self.socket, {"CNI_COMMAND": "VERSION"}, b"{}", timeout=5.0)
                if status == 0:
                    return
            except (OSError, WireError):
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"agent {self.node} did not answer in time:\n{self.tail()}")
            time.sleep(0.02)

    def tail(self, lines: int = 15) -> str:
        text = ""
        for path in (self.stderr_path, self.log_path):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (the agent drains and exits), then SIGKILL if it does not."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(AGENT_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _cluster_pool() -> PoolSpec:
    return PoolSpec(
        CLUSTER_POOL,
        [[{"subnet": CLUSTER_SUBNET}]],
        cooldown=0,
        block_prefix={4: CLUSTER_BLOCK_V4},
    )


def _create_pool(store: Store, spec: PoolSpec) -> None:
    key = rec.pool_key(spec.name)
    if not store.txn([absent(key)], [Put(key, rec.encode(spec.to_dict()))]).succeeded:
        raise BenchError(f"pool {spec.name} already exists in the bench's own etcd")


class _Client:
    """One client thread of the cluster load: ADD then DEL of a new attachment, again and
    again, through `forward()` to its agent (what the plugin executable does)."""

    def __init__(self, index: int, socket_path: str) -> None:
        self.index = index
        self.socket = socket_path
        self.stdin = _ipam_config(
            {"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL}
        )
        self.base_env = {
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/bench",
            "CNI_PATH": CNI_BIN_DIR,
        }
        self.seq = 0
        self.adds = 0  # successful ADDs measured
        self.dels = 0
        self.add_s: list[float] = []
        self.del_s: list[float] = []
        self.allocs = 0  # successful ADDs of the ADD-only phases
        self.alloc_s: list[float] = []
        self.held: list[str] = []
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}

    def call(self, command: str, container: str) -> tuple[bool, float]:
        from ipward.plugin import forward

        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        try:
            status, out = forward(self.socket, env, self.stdin)
        except Exception as e:  # what the plugin answers then: 11, try again later
            status, out = 1, json.dumps({"code": 11, "msg": f"{type(e).__name__}: {e}"}).encode()
        elapsed = time.perf_counter() - start
        if status != 0:
            try:
                code = str(json.loads(out).get("code"))
            except (ValueError, AttributeError):
                code = "?"
            key = f"{command} code {code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            self.examples.setdefault(key, out.decode(errors="replace").strip()[:300])
        return status == 0, elapsed

    def loop(self, pairs: int | None, seconds: float | None, measured: bool) -> None:
        """ADD+DEL pairs until `pairs` are done or `seconds` have passed."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (pairs is None or done < pairs) and clock() < deadline:
            container = f"c{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            deleted, del_s = self.call("DEL", container)  # also after a failed ADD, as a runtime
            done += 1
            if measured:
                self.add_s.append(add_s)
                self.del_s.append(del_s)
                self.adds += added
                self.dels += deleted

    def allocate_only(self, ops: int | None, seconds: float | None) -> None:
        """ADDs of new attachments only, kept (the allocation rate): `ops` of them, or
        for `seconds`."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (ops is None or done < ops) and clock() < deadline:
            container = f"k{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            done += 1
            self.alloc_s.append(add_s)
            if added:
                self.allocs += 1
                self.held.append(container)

    def release_held(self) -> None:
        """DEL what allocate_only kept (not measured)."""
        while self.held:
            self.call("DEL", self.held.pop())


class _CasClient:
    """One thread of the reference: get + txn(compare mod_revision, put) on a key of its
    own, through a store client it shares with the other threads of its group."""

    def __init__(self, store: Store, key: str) -> None:
        self.store = store
        self.key = key
        self.count = 0
        self.cas_s: list[float] = []

    def loop(self, n: int | None, seconds: float | None, measured: bool) -> None:
        get, txn, key = self.store.get, self.store.txn, self.key
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (n is None or done < n) and clock() < deadline:
            start = clock()
            kv = get(key)
            result = txn([at_revision(key, kv.mod_revision if kv else 0)], [Put(key, b"%d" % done)])
            elapsed = clock() - start
            if not result.succeeded:
                raise BenchError(f"CAS on {key} failed: something else writes the bench key")
            done += 1
            if measured:
                self.cas_s.append(elapsed)
                self.count += 1


def _parallel(work: Sequence[Callable[[], None]]) -> float:
    """Run each callable in a thread of its own, all released at once; returns the
    seconds from the release to the end of the last one. Re-raises the first failure."""
    barrier = threading.Barrier(len(work) + 1)
    failures: list[BaseException] = []

    def target(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as e:  # handed to the caller after every thread has ended
            failures.append(e)

    threads = [threading.Thread(target=target, args=(fn,), daemon=True) for fn in work]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return elapsed


def _etcd_counters(client_url: str) -> dict[str, float] | None:
    """etcd's own counts (from its /metrics): Txn and Range calls served, WAL fsyncs;
    None when they cannot be read (the figures are diagnostics, not the measurement)."""
    counts = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
    try:
        with urllib.request.urlopen(client_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                if 'grpc_method="Txn"' in line:
                    counts["txn"] += float(line.rsplit(" ", 1)[1])
                elif 'grpc_method="Range"' in line:
                    counts["range"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_disk_wal_fsync_duration_seconds_count "):
                counts["fsync"] = float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return counts


class _Counted:
    """etcd's counts summed over the phases of one kind."""

    def __init__(self, client_url: str) -> None:
        self.client_url = client_url
        self.sums: dict[str, float] | None = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
        self.seconds = 0.0

    def measure(self, phase: Callable[[], float]) -> float:
        before = _etcd_counters(self.client_url)
        elapsed = phase()
        after = _etcd_counters(self.client_url)
        self.seconds += elapsed
        if before is None or after is None or self.sums is None:
            self.sums = None
        else:
            for k in self.sums:
                self.sums[k] += after[k] - before[k]
        return elapsed


def agent_exec_latency(tmp: Path, socket_path: str, runs: int, warmup: int = 5) -> dict[str, float]:
    """ADD exec latency of the installed plugin forwarding to the agent at `socket_path`
    (`agentSocket` in its config), of a bare interpreter and of host-local, interleaved
    run by run; DEL of every ADD afterwards (not timed)."""
    ipward_cfg = _ipam_config({"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL})
    return _interleaved_adds(_exec_kinds(tmp, ipward_cfg), runs, warmup)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ms(samples: Sequence[float], q: int) -> float:
    return percentile(samples, q) * 1000


def run_cluster(
    agents: int = 3,
    concurrency: int = 8,
    duration: float | None = None,
    quick: bool = False,
    out: Callable[[str], object] = print,
    operations: int | None = None,
    chunks: int | None = None,
) -> dict:
    """`agents` real agent processes on one temporary etcd, `concurrency` client threads
    per agent looping ADD then DEL through `forward()`, next to raw etcd CAS by as many
    threads (one store client per `concurrency` threads, like the agents), the two loads
    taking turns in `chunks`; then plugin exec ADD through an agent next to a bare
    interpreter and host-local. Each load runs `duration` seconds in all (20, --quick 4)
    or, with `operations`, that many ADD+DEL pairs (and raw CAS) per thread in all.
    Prints a report with `out`; returns {"machine", "figures", "targets", "errors",
    "notes"} like `run`."""
    if agents < 1 or concurrency < 1:
        raise BenchError("--agents and --concurrency must be at least 1")
    if not os.access(ETCD, os.X_OK):
        raise BenchError(f"{ETCD} is missing (Debian package etcd-server): --cluster needs it")
    from ipward.store.etcd import EtcdStore  # grpc: only when etcd is measured

    began = time.perf_counter()
    threads = agents * concurrency
    chunks = chunks or (2 if quick else 4)
    if duration is None:
        duration = 4.0 if quick else 20.0
    per_chunk_ops = None if operations is None else max(operations // chunks, 1)
    per_chunk_s = None if operations is not None else duration / chunks
    warm_pairs = 3 if quick else 10
    exec_runs = 40 if quick else 200
    figures: dict[str, float] = {}
    targets: dict[str, dict] = {}
    notes: dict[str, str] = {}
    info = machine()
    out(
        f"ipward bench --cluster{' --quick' if quick else ''}: {_plural(agents, 'agent')} x"
        f" {concurrency} concurrent ADDs on one etcd; {info['nproc']} CPUs ({info['platform']})"
    )
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="ipward-bench-cluster-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        (tmp / "etcd").mkdir()
        url = stack.enter_context(_etcd(tmp / "etcd"))
        client_url = "http://" + url.removeprefix("etcd://")
        admin = EtcdStore.from_url(url)
        stack.callback(admin.close)
        spec = _cluster_pool()
        _create_pool(admin, spec)
        out(
            f"  ... etcd up; pool {spec.name} {CLUSTER_SUBNET} (/{CLUSTER_BLOCK_V4} blocks,"
            f" cooldown 0); starting {_plural(agents, 'agent')}"
        )
        procs: list[_AgentProcess] = []
        for i in range(agents):
            proc = _AgentProcess(tmp, i, url)
            stack.callback(proc.stop)  # stopped before etcd (the stack unwinds in reverse)
            procs.append(proc)
        deadline = time.monotonic() + AGENT_READY_TIMEOUT
        for proc in procs:
            proc.wait_ready(deadline)
        stores = []
        for _ in range(agents):
            store = EtcdStore.from_url(url)
            stack.callback(store.close)
            stores.append(store)
        clients = [_Client(i, procs[i // concurrency].socket) for i in range(threads)]
        cas = [_CasClient(stores[i // concurrency], f"bench/cas/{i}") for i in range(threads)]

        # 1. cluster allocation rate and the raw CAS rate, taking turns ----------------
        out(f"  ... warm-up: {warm_pairs} ADD+DEL pairs and {warm_pairs} raw CAS per thread")
        _parallel([partial(c.loop, warm_pairs, None, False) for c in clients])
        _parallel([partial(c.loop, warm_pairs, None, False) for c in cas])
        size = f"{per_chunk_ops} per thread" if per_chunk_ops else f"{per_chunk_s:.1f} s"
        out(
            f"  ... {chunks} rounds of {size} each: {threads} threads of ADD+DEL through the"
            f" agents, then of raw CAS, then of ADD only (deleted after, untimed)"
        )
        counted_cluster = _Counted(client_url)
        counted_cas = _Counted(client_url)
        counted_alloc = _Counted(client_url)
        cluster_load = [partial(c.loop, per_chunk_ops, per_chunk_s, True) for c in clients]
        cas_load = [partial(c.loop, per_chunk_ops, per_chunk_s, True) for c in cas]
        alloc_load = [partial(c.allocate_only, per_chunk_ops, per_chunk_s) for c in clients]
        for _ in range(chunks):
            counted_cluster.measure(partial(_parallel, cluster_load))
            counted_cas.measure(partial(_parallel, cas_load))
            counted_alloc.measure(partial(_parallel, alloc_load))
            _parallel([c.release_held for c in clients])
        adds = sum(c.adds for c in clients)
        dels = sum(c.dels for c in clients)
        pairs = sum(len(c.add_s) for c in clients)
        add_s = [x for c in clients for x in c.add_s]
        del_s = [x for c in clients for x in c.del_s]
        cas_s = [x for c in cas for x in c.cas_s]
        n_cas = sum(c.count for c in cas)
        if not adds or not n_cas:
            raise BenchError("no ADD succeeded: see the errors" if n_cas else "no CAS measured")
        errors: dict[str, int] = {}
        examples: dict[str, str] = {}
        for c in clients:
            for key, count in c.errors.items():
                errors[key] = errors.get(key, 0) + count
            for key, text in c.examples.items():
                examples.setdefault(key, text)
        cluster_s, cas_wall = counted_cluster.seconds, counted_cas.seconds
        figures["cluster.add_per_s"] = adds / cluster_s
        figures["cluster.del_per_s"] = dels / cluster_s
        figures["cluster.alloc_per_s"] = sum(c.allocs for c in clients) / counted_alloc.seconds
        figures["cluster.raw_cas_per_s"] = n_cas / cas_wall
        alloc_s = [x for c in clients for x in c.alloc_s]
        for name, samples in (("add", add_s), ("del", del_s), ("cas", cas_s), ("alloc", alloc_s)):
            for q in (50, 90, 99):
                figures[f"cluster.{name}_p{q}_ms"] = _ms(samples, q)
        # The target is on allocations per second: the ADD-only phases.
        ratio = figures["cluster.alloc_per_s"] / figures["cluster.raw_cas_per_s"]
        figures["cluster.vs_cas"] = ratio
        figures["cluster.pairs_vs_cas"] = (
            figures["cluster.add_per_s"] / figures["cluster.raw_cas_per_s"]
        )
        figures["cluster.pairs"] = float(pairs)
        figures["cluster.cas"] = float(n_cas)
        ok = ratio >= TARGET_CLUSTER_VS_CAS
        targets["cluster.vs_cas"] = {
            "value": ratio,
            "target": f">= {TARGET_CLUSTER_VS_CAS}",
            "met": ok,
        }
        if counted_cluster.sums is not None and counted_cas.sums is not None:
            sums = counted_cluster.sums
            figures["cluster.etcd_txn_per_pair"] = sums["txn"] / pairs
            figures["cluster.etcd_range_per_pair"] = sums["range"] / pairs
            figures["cluster.etcd_fsync_per_s"] = sums["fsync"] / cluster_s
            sums = counted_cas.sums
            figures["cluster.cas_etcd_txn_per_cas"] = sums["txn"] / n_cas
            figures["cluster.cas_etcd_fsync_per_s"] = sums["fsync"] / cas_wall

        # 2. plugin exec through an agent ---------------------------------------------
        out(
            f"  ... plugin exec: {exec_runs} ADDs each of python, ipward (through agent 0)"
            " and host-local, interleaved"
        )
        exec_dir = tmp / "exec"
        exec_dir.mkdir()
        ex = agent_exec_latency(exec_dir, procs[0].socket, exec_runs)
        for key, value in ex.items():
            figures[f"exec.{key}"] = float(value)
        diff = figures["exec.ipward.median_ms"] - figures["exec.python.median_ms"]
        figures["exec.ipward_minus_python_ms"] = diff
        exec_ok = diff <= TARGET_AGENT_EXEC_OVER_PYTHON_MS
        targets["exec.ipward_minus_python_ms"] = {
            "value": diff,
            "target": f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS} ms",
            "met": exec_ok,
        }
        out(f"  ... stopping {_plural(agents, 'agent')} and etcd")
    # (agents and etcd are stopped here, also when anything above failed)

    f = figures
    heading = f"1. {_plural(agents, 'agent')} x {concurrency}, one etcd ({threads} threads)"
    rows = [[heading, "per s", "p50 ms", "p90 ms", "p99 ms", "vs CAS", "target"]]
    rows.append(
        [
            f"raw etcd CAS, {_plural(agents, 'client')} x {concurrency} threads",
            f"{f['cluster.raw_cas_per_s']:.0f}",
            f"{f['cluster.cas_p50_ms']:.2f}",
            f"{f['cluster.cas_p90_ms']:.2f}",
            f"{f['cluster.cas_p99_ms']:.2f}",
            "1.00x",
            "",
        ]
    )
    rows.append(
        [
            "ADD only (allocations)",
            f"{f['cluster.alloc_per_s']:.0f}",
            f"{f['cluster.alloc_p50_ms']:.2f}",
            f"{f['cluster.alloc_p90_ms']:.2f}",
            f"{f['cluster.alloc_p99_ms']:.2f}",
            f"{ratio:.2f}x",
            f">= {TARGET_CLUSTER_VS_CAS}x {_verdict(ok)}",
        ]
    )
    rows.append(
        [
            "ADD in an ADD+DEL loop",
            f"{f['cluster.add_per_s']:.0f}",
            f"{f['cluster.add_p50_ms']:.2f}",
            f"{f['cluster.add_p90_ms']:.2f}",
            f"{f['cluster.add_p99_ms']:.2f}",
            f"{f['cluster.pairs_vs_cas']:.2f}x",
            "",
        ]
    )
    rows.append(
        [
            "DEL through the agents",
            f"{f['cluster.del_per_s']:.0f}",
            f"{f['cluster.del_p50_ms']:.2f}",
            f"{f['cluster.del_p90_ms']:.2f}",
            f"{f['cluster.del_p99_ms']:.2f}",
            "",
            "",
        ]
    )
    exec_rows = [[f"2. exec latency ({exec_runs} runs)", "median ms", "p99 ms", ""]]
    labels = {
        "python": f"{PLUGIN_PYTHON} -I -S -c pass",
        "host_local": "host-local ADD",
        "ipward": "ipward ADD (through the agent)",
    }
    for kind, label in labels.items():
        if f"exec.{kind}.median_ms" in f:
            exec_rows.append(
                [label, f"{f[f'exec.{kind}.median_ms']:.2f}", f"{f[f'exec.{kind}.p99_ms']:.2f}", ""]
            )
        else:
            exec_rows.append([label, "skipped", f"({HOST_LOCAL} is missing)", ""])
    exec_rows.append(
        [
            "ipward - python (median)",
            f"{diff:+.2f}",
            "",
            f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS:.0f} ms {_verdict(exec_ok)}",
        ]
    )
    elapsed = time.perf_counter() - began
    out("")
    _table(rows, out)
    if errors:
        for key, count in sorted(errors.items()):
            out(f"  ERRORS: {key}: {count} (first: {examples[key]})")
    else:
        out(f"  errors: none in {sum(len(c.add_s) for c in clients)} measured ADD+DEL pairs")
    if "cluster.etcd_txn_per_pair" in f:
        out(
            f"  etcd served {f['cluster.etcd_txn_per_pair']:.2f} Txn and"
            f" {f['cluster.etcd_range_per_pair']:.2f} Range calls per ADD+DEL pair"
            f" (raw CAS: {f['cluster.cas_etcd_txn_per_cas']:.2f} Txn per CAS);"
            f" WAL fsyncs/s {f['cluster.etcd_fsync_per_s']:.0f}"
            f" (raw CAS: {f['cluster.cas_etcd_fsync_per_s']:.0f})"
        )
    out("")
    _table(exec_rows, out)
    out("")
    out("  1: client threads call their agent through forward() (the plugin's own socket")
    out("     call); per s = successful calls over the wall time of the rounds. Each round:")
    out("     ADD+DEL loop, raw CAS (get + txn(compare mod_revision, put) on a key per thread),")
    out("     then ADD only (the allocation rate; what it allocated is deleted after, untimed).")
    if concurrency > AGENT_MAX_WORKERS:
        out(
            f"     An agent serves {AGENT_MAX_WORKERS} calls at a time (its default"
            " --max-workers); the other callers wait in its listen backlog."
        )
    out(f"  whole run: {elapsed:.1f} s")
    notes["elapsed_s"] = f"{elapsed:.1f}"
    notes["agents"] = str(agents)
    notes["concurrency"] = str(concurrency)
    return {
        "machine": info,
        "figures": figures,
        "targets": targets,
        "errors": errors,
        "notes": notes,
        "tables": {"cluster": rows, "exec": exec_rows},
    }


# -- the report ---------------------------------------------------------------------------

PLOT_POOL_SIZE = "add-latency-vs-pool-size.png"
PLOT_FILL = "add-latency-vs-fill.png"
PLOT_GC_MEMORY = "gc-and-memory-vs-records.png"


def headline(result: dict) -> list[list[str]]:
    """The report's first table: [figure, value, reference from the same run, ratio]
    for every part that was measured."""
    f = result["figures"]
    rows: list[list[str]] = []

    def add(label: str, value: str, reference: str, ratio: str) -> None:
        rows.append([label, value, reference, ratio])

    for name, what in (("sqlite", "SQLite"), ("etcd", "etcd")):
        if f"{name}.ledger_allocations_per_s" in f:
            add(
                f"allocations/s, sequential, {what}",
                f"{f[f'{name}.ledger_allocations_per_s']:,.0f}",
                f"raw CAS {f[f'{name}.raw_cas_per_s']:,.0f}/s",
                f"{f[f'{name}.ledger_vs_cas']:.2f}x",
            )
    if "exec.ipward.median_ms" in f:
        host_local = f.get("exec.host_local.median_ms")
        add(
            "plugin ADD exec, single-node (median)",
            f"{f['exec.ipward.median_ms']:.2f} ms",
            f"python3 -I -S start {f['exec.python.median_ms']:.2f} ms"
            + (f"; host-local {host_local:.2f} ms" if host_local is not None else ""),
            f"{f['exec.ipward_minus_python_ms']:+.2f} ms",
        )
    cluster = result.get("cluster")
    if cluster:
        c = cluster["figures"]
        add(
            f"allocations/s, {cluster['notes']['agents']} agents x"
            f" {cluster['notes']['concurrency']} callers, etcd",
            f"{c['cluster.alloc_per_s']:,.0f}",
            f"raw etcd CAS {c['cluster.raw_cas_per_s']:,.0f}/s, same concurrency",
            f"{c['cluster.vs_cas']:.2f}x",
        )
        host_local = c.get("exec.host_local.median_ms")
        add(
            "plugin ADD exec through the agent (median)",
            f"{c['exec.ipward.median_ms']:.2f} ms",
            f"python3 -I -S start {c['exec.python.median_ms']:.2f} ms"
            + (f"; host-local {host_local:.2f} ms" if host_local is not None else ""),
            f"{c['exec.ipward_minus_python_ms']:+.2f} ms",
        )
    series = result.get("series", {})
    sizes = {p["name"]: p for p in series.get("pool_size", [])}
    if sizes:
        base = sizes["v4_24"]
        for name in ("v4_8", "v6_64"):
            p = sizes[name]
            add(
                f"ADD median, {p['label']} ({p['in_use']:,.0f} in use)",
                f"{p['add_median_ms']:.3f} ms",
                f"/24 {base['add_median_ms']:.3f} ms",
                f"{p['vs_24']:.2f}x",
            )
    fills = series.get("fill", [])
    if fills:
        first, last = fills[0], fills[-1]
        add(
            f"ADD median, /{last['prefix']} {last['percent']}% full",
            f"{last['add_median_ms']:.3f} ms",
            f"{first['percent']}% full {first['add_median_ms']:.3f} ms",
            f"{last['vs_first']:.2f}x",
        )
    passes = series.get("gc", [])
    if passes:
        p = passes[-1]
        add(
            f"GC pass (gc.look), {p['records']:,} records",
            f"{p['look_ms']:,.0f} ms",
            f"raw store range {p['raw_range_ms']:,.0f} ms",
            f"{p['look_vs_range']:.1f}x",
        )
    agents = [a for a in series.get("agent", []) if a["node"] == "own"]
    if agents:
        a, empty = agents[-1], series["agent_empty"]
        add(
            f"agent peak memory (VmHWM), {a['records']:,} records",
            f"{a['hwm_mib']:.0f} MiB",
            f"empty store {empty['hwm_mib']:.0f} MiB",
            f"{a['hwm_vs_empty']:.2f}x",
        )
    return rows


def report_plots(series: dict) -> dict[str, bytes]:
    """The report's plots as PNG, by file name (those whose series were measured)."""
    from ipward_lab.report import Panel, line_plot, line_plots

    plots: dict[str, bytes] = {}
    sizes = series.get("pool_size", [])
    if sizes:
        positions = list(range(len(sizes)))
        in_use = sizes[0]["in_use"]
        plots[PLOT_POOL_SIZE] = line_plot(
            {
                label: [(x, p[key]) for x, p in zip(positions, sizes, strict=True)]
                for label, key in (
                    ("ADD median", "add_median_ms"),
                    ("ADD p99", "add_p99_ms"),
                    ("DEL median", "del_median_ms"),
                )
            },
            "pool (usable addresses)",
            "ms per call",
            f"Ledger ADD latency vs pool size ({in_use:,.0f} in use, SQLite)",
            xticks=[
                (x, f"{p['label']}\n{_addresses(p['addresses'])}")
                for x, p in zip(positions, sizes, strict=True)
            ],
            styles={"DEL median": ":"},
        )
    fills = series.get("fill", [])
    if fills:
        plots[PLOT_FILL] = line_plot(
            {
                label: [(p["percent"], p[key]) for p in fills]
                for label, key in (
                    ("ADD median", "add_median_ms"),
                    ("ADD p99", "add_p99_ms"),
                    ("DEL median", "del_median_ms"),
                )
            },
            "pool fill",
            "ms per call",
            f"Ledger ADD latency vs pool fill (/{fills[0]['prefix']}, SQLite)",
            xticks=[(p["percent"], f"{p['percent']}%") for p in fills],
            styles={"DEL median": ":"},
        )
    passes = series.get("gc", [])
    agents = series.get("agent", [])
    if passes and agents:
        counts = [p["records"] for p in passes]
        ticks = [(n, _count_label(n)) for n in counts]
        gc_panel = Panel(
            {
                label: [(p["records"], p[key]) for p in passes]
                for label, key in (
                    ("GC pass (gc.look)", "look_ms"),
                    ("  records read (snapshot)", "snapshot_ms"),
                    ("  liveness read (sim state)", "gather_ms"),
                    ("  judging", "judge_ms"),
                    ("raw store range (reference)", "raw_range_ms"),
                )
            },
            "allocation records",
            "ms per pass",
            "GC pass time",
            logx=True,
            logy=True,
            xticks=ticks,
            styles={
                "  records read (snapshot)": "--",
                "  liveness read (sim state)": "--",
                "  judging": "--",
                "raw store range (reference)": ":",
            },
        )
        own = [a for a in agents if a["node"] == "own"]
        other = [a for a in agents if a["node"] == "other"]
        empty = series["agent_empty"]
        memory_panel = Panel(
            {
                "peak (VmHWM), its node's records": [(a["records"], a["hwm_mib"]) for a in own],
                "after the pass (VmRSS)": [(a["records"], a["rss_mib"]) for a in own],
                "peak, another node's records": [(a["records"], a["hwm_mib"]) for a in other],
                "empty store, peak (reference)": [(n, empty["hwm_mib"]) for n in counts],
            },
            "allocation records",
            "MiB",
            "Agent memory after a reconcile pass",
            logx=True,
            xticks=ticks,
            styles={"empty store, peak (reference)": ":"},
        )
        plots[PLOT_GC_MEMORY] = line_plots([gc_panel, memory_panel], columns=2)
    return plots


def write_report(result: dict, directory: str | Path, console: Sequence[str] = ()) -> list[Path]:
    """DIR/report.html (one self-contained page: every table of the run, the plots,
    the console output), the plots as PNG files, and DIR/report.json (the result).
    Returns the files written."""
    from ipward_lab.report import Page, save_png

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    info = result["machine"]
    notes = result["notes"]
    tables = result.get("tables", {})
    plots = report_plots(result.get("series", {}))
    written = []
    for name, png in plots.items():
        save_png(png, root / name)
        written.append(root / name)

    page = Page(f"ipward bench report{' (--quick)' if notes.get('quick') == 'yes' else ''}")
    page.paragraph(
        f"{info['nproc']} CPUs ({info['platform']}); Python {info['python']}; plugin"
        f" interpreter {info['plugin_python']}; SQLite {info['sqlite']}; etcd {info['etcd']}."
        f" Run {notes.get('started', '')}, {notes.get('report_elapsed_s', '?')} s in all."
    )
    page.paragraph(
        "Every figure stands next to a reference measured on the same machine in the same"
        " run: the store's own transaction rate, the bare interpreter's start, host-local's"
        " ADD, the smallest pool, the emptiest pool, the raw store read, the agent on an"
        " empty store. Nothing here passes or fails: targets are printed for the reader."
    )
    page.heading("Headline")
    page.table(["figure", "value", "reference (same run)", "vs reference"], headline(result))
    sections = [
        ("throughput", None, ""),
        ("exec", None, ""),
        ("latency", None, ""),
        (
            "pool_size",
            PLOT_POOL_SIZE,
            "ADD and DEL latency (in-process ledger, SQLite) as the"
            " pool grows from a /24 to a /8 and an IPv6 /64, the same addresses in use.",
        ),
        ("fill", PLOT_FILL, "ADD and DEL latency as one pool fills from 10% to 99%."),
        (
            "gc",
            PLOT_GC_MEMORY,
            "Left: one garbage-collection pass and its parts against the"
            " number of allocation records, next to the raw read of the records. Right: a real"
            " agent's memory after its reconcile pass read them, next to the agent on an empty"
            " store.",
        ),
        ("agent", None, ""),
    ]
    for key, plot, caption in sections:
        if key not in tables:
            continue
        _report_table(page, tables[key])
        if plot and plot in plots:
            page.figure(plots[plot], caption, alt=plot)
    cluster = result.get("cluster")
    if cluster:
        page.heading("Cluster mode: agents on one etcd")
        for key in ("cluster", "exec"):
            _report_table(page, cluster["tables"][key], level=3)
        if cluster.get("errors"):
            page.paragraph(f"errors: {cluster['errors']}")
    if result.get("skipped"):
        page.heading("Skipped")
        page.table(["part", "why"], [[k, v] for k, v in sorted(result["skipped"].items())])
    targets = dict(result.get("targets", {}))
    if cluster:
        targets.update({f"cluster: {k}": v for k, v in cluster.get("targets", {}).items()})
    if targets:
        page.heading("Targets")
        page.table(
            ["figure", "value", "target", "met"],
            [
                [name, f"{t['value']:.2f}", str(t["target"]), "yes" if t["met"] else "NO"]
                for name, t in sorted(targets.items())
            ],
        )
    if console:
        page.heading("Console output")
        page.preformatted("\n".join(console))
    page.write(root / "report.html")
    written.append(root / "report.html")
    with open(root / "report.json", "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    written.append(root / "report.json")
    return written


def _report_table(page: Page, rows: list[list[str]], level: int = 2) -> None:
    """A console table (its first row the header, the header's first cell its title)."""
    page.heading(rows[0][0], level)
    page.table(["", *rows[0][1:]], rows[1:])


def run_report(
    directory: str | Path,
    quick: bool = False,
    etcd: bool = True,
    out: Callable[[str], object] = print,
) -> dict:
    """`ipward bench --report DIR`: `run` with the growth measurements, then the cluster
    part (`run_cluster`) when etcd is measured, then `write_report` into `directory`.
    Returns the result written to DIR/report.json (the cluster's under "cluster")."""
    began = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    console: list[str] = []

    def say(line: str) -> None:
        console.append(line)
        out(line)

    result = run(quick=quick, etcd=etcd, out=say, growth=True)
    if not etcd:
        result["skipped"]["cluster"] = "--no-etcd"
    elif not os.access(ETCD, os.X_OK):
        result["skipped"]["cluster"] = f"{ETCD} is missing (Debian package etcd-server)"
    else:
        say("")
        try:
            result["cluster"] = run_cluster(quick=quick, out=say)
        except (BenchError, StoreError) as e:
            result["skipped"]["cluster"] = f"failed: {e}"
            say(f"  ... cluster part failed: {e}")
    notes = result["notes"]
    notes["quick"] = "yes" if quick else "no"
    notes["started"] = started
    notes["report_elapsed_s"] = f"{time.perf_counter() - began:.1f}"
    written = write_report(result, directory, console)
    out("")
    _table([["headline", "value", "reference (same run)", "vs reference"], *headline(result)], out)
    out("")
    out(f"  report ({notes['report_elapsed_s']} s in all):")
    for path in written:
        out(f"    {path}")
    return result


@click.command("bench")
@click.option(
    "--quick", is_flag=True, help="Fewer runs, a /20 instead of a /16 (~10 s instead of ~30 s)."
)
@click.option("--no-etcd", "no_etcd", is_flag=True, help="Skip the etcd measurements.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the figures as JSON (the report goes to stderr)."
)
@click.option(
    "--cluster",
    is_flag=True,
    help="Instead: agents on one temporary etcd under concurrent ADD/DEL, next to raw etcd"
    " CAS at the same concurrency, and plugin exec through an agent.",
)
@click.option(
    "--agents",
    type=click.IntRange(1, 64),
    help="--cluster: agent processes (default 3).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    help="--cluster: concurrent ADD/DEL client threads per agent (default 8).",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.1),
    help="--cluster: seconds of each load in all (default 20, --quick 4).",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False),
    help="Also measure how cost grows (ADD vs pool size and fill, GC pass and agent memory"
    " vs records) and run the cluster part (unless --no-etcd); write DIR/report.html,"
    " DIR/report.json and the plots as PNG in DIR (~2 min with --quick, ~5 min without).",
)
def bench_command(
    quick: bool,
    no_etcd: bool,
    as_json: bool,
    cluster: bool,
    agents: int | None,
    concurrency: int | None,
    duration: float | None,
    report_dir: str | None,
) -> None:
    """Measure allocation throughput and latency against references from the same run."""

    def report(line: str) -> None:
        click.echo(line, err=as_json)

    if not cluster and (agents, concurrency, duration) != (None, None, None):
        raise click.UsageError("--agents, --concurrency and --duration go with --cluster")
    if cluster and no_etcd:
        raise click.UsageError("--cluster measures agents on etcd: it does not go with --no-etcd")
    if cluster and report_dir:
        raise click.UsageError(
            "--report runs the cluster part itself (unless --no-etcd): drop --cluster"
        )
    try:
        if report_dir:
            result = run_report(report_dir, quick=quick, etcd=not no_etcd, out=report)
        elif cluster:
            result = run_cluster(
                agents=3 if agents is None else agents,
                concurrency=8 if concurrency is None else concurrency,
                duration=duration,
                quick=quick,
                out=report,
            )
        else:
            result = run(quick=quick, etcd=not no_etcd, out=report)
    except BenchError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))


__all__ = [
    "BenchError",
    "agent_exec_latency",
    "agent_memory",
    "allocate_latency",
    "bench_command",
    "bulk_fill",
    "exec_latency",
    "fill_latency",
    "gc_pass_times",
    "ledger_pair_rate",
    "p99",
    "percentile",
    "pool_size_latency",
    "raw_cas_rate",
    "run",
    "run_cluster",
    "run_growth",
    "run_report",
    "throughput",
    "write_report",
]
