"""`ipward bench`'s default run (figures 1 to 3) and, for --report, how cost grows
(figures 4 to 7), section by section, then the console tables."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ipward_lab.bench.common import (
    Results,
    machine,
    print_table,
)
from ipward_lab.bench.gc_memory import gc_growth, memory_growth
from ipward_lab.bench.latency import fill_growth, latency_section, pool_size_growth
from ipward_lab.bench.plugin_exec import exec_section
from ipward_lab.bench.throughput import throughput_section


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
    r = Results()
    if rounds is None or per_round is None:
        rounds, per_round = (2, 50) if quick else (5, 100)
    pool_size_growth(tmp, rounds, per_round, out, r)
    fill_growth(tmp, quick, rounds, per_round, fill_prefix, out, r)
    stores = gc_growth(tmp, quick, counts, out, r)
    memory_growth(tmp, stores, out, r)
    return r.figures, r.series, r.tables


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
    r = Results()
    info = machine()
    out(f"ipward bench{' --quick' if quick else ''}: {info['nproc']} CPUs ({info['platform']})")
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )
    with tempfile.TemporaryDirectory(prefix="ipward-bench-") as tmp_name:
        tmp = Path(tmp_name)
        throughput_section(tmp, quick, etcd, out, r)
        exec_section(tmp, quick, out, r)
        latency_section(tmp, quick, out, r)
        if growth:
            figures, r.series, tables = run_growth(tmp, quick, out)
            r.figures.update(figures)
            r.tables.update(tables)

    elapsed = time.perf_counter() - began
    for rows in r.tables.values():
        out("")
        print_table(rows, out)
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
    r.notes["elapsed_s"] = f"{elapsed:.1f}"
    result = {
        "machine": info,
        "figures": r.figures,
        "targets": r.targets,
        "skipped": r.skipped,
        "notes": r.notes,
        "tables": r.tables,
    }
    if growth:
        result["series"] = r.series
    return result


GROWTH_NOTES = [
    "  4, 5: in-process Ledger.allocate and free on SQLite (fsync at commit), pools with",
    "     cooldown 0 filled as one ledger leaves them (blocks claimed in order); the pools",
    "     take turns call by call.",
    "  6: records of one node, all listed ready by the simulated runtime; gc.look = records",
    "     (snapshot), registrations and liveness (the simulated cluster's state file, read",
    "     once for the node and once for the cluster), then every record judged; controller",
    "     = Controller.gc_pass (also the sticky reservations). Raw range: store.range('ips/').",
    "  7: a real `ipward agent` on the same stores; VmRSS settled after its first reconcile",
    "     pass, VmHWM its peak; 'another node': the agent of a node holding none of them.",
]
