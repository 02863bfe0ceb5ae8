"""Figure 1, the ledger's rate: allocate+release pairs per second in-process and
sequential, next to the raw store's own single-key compare-and-swap on the same backend
(SQLite, and a temporary etcd on loopback), measured in alternating chunks."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.ledger import Ledger
from ipward.store.base import Put, Store, StoreError, at_revision
from ipward.store.sqlite import SqliteStore
from ipward_lab.bench.common import (
    CAS_KEY,
    NODE,
    BenchError,
    Results,
    verdict,
)
from ipward_lab.servers.etcd import ETCD, etcd_store

TARGET_LEDGER_VS_CAS = 0.5  # ledger pairs/s >= 0.5 x raw CAS/s


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
        allocate, free, pools = self.ledger.allocate, self.ledger.free, [self.spec]
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
            if not free(attachment):
                raise BenchError(f"{attachment}: nothing freed")
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


def throughput_section(
    tmp: Path, quick: bool, etcd: bool, out: Callable[[str], object], r: Results
) -> None:
    """Figure 1 on SQLite and (unless skipped) etcd, into `r`: figures, targets, table."""
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
        r.skipped["etcd"] = "--no-etcd"
    elif not os.access(ETCD, os.X_OK):
        r.skipped["etcd"] = f"{ETCD} is missing (Debian package etcd-server)"
    else:
        backends.append(("etcd", lambda: etcd_store(tmp / "etcd")))
    for name, opener in backends:
        n = n_sqlite if name == "sqlite" else n_etcd
        out(f"  ... {name}: {n} raw CAS and {n} allocate+release pairs, interleaved")
        try:
            with opener() as store:
                t = throughput(store, n)
        except (BenchError, StoreError) as e:
            if name == "sqlite":
                raise
            r.skipped[name] = f"failed: {e}"
            out(f"  ... {name} r.skipped: {e}")
            continue
        ratio = t["ledger_allocations_per_s"] / t["raw_cas_per_s"]
        pair_ratio = t["ledger_pairs_per_s"] / t["raw_cas_per_s"]
        r.figures[f"{name}.raw_cas_per_s"] = t["raw_cas_per_s"]
        r.figures[f"{name}.ledger_allocations_per_s"] = t["ledger_allocations_per_s"]
        r.figures[f"{name}.ledger_pairs_per_s"] = t["ledger_pairs_per_s"]
        r.figures[f"{name}.ledger_vs_cas"] = ratio
        r.figures[f"{name}.pairs_vs_cas"] = pair_ratio
        ok = ratio >= TARGET_LEDGER_VS_CAS
        r.targets[f"{name}.ledger_vs_cas"] = {
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
                f">= {TARGET_LEDGER_VS_CAS}x {verdict(ok)}",
            ]
        )
    if "etcd" in r.skipped:
        rows.append(["etcd", "skipped:", r.skipped["etcd"].splitlines()[0][:60], "", "", "", ""])
    r.tables["throughput"] = rows
