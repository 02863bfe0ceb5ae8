"""`ipward bench --report DIR`: the growth figures and the cluster part with the run,
then one self-contained page (every table, the plots, the console output), the plots
as PNG files and the result as JSON."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ipward.store.base import StoreError
from ipward_lab.bench.cluster import run_cluster
from ipward_lab.bench.common import (
    BenchError,
    Console,
    addresses,
    count_label,
    print_table,
)
from ipward_lab.bench.run import run
from ipward_lab.servers.etcd import ETCD

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward_lab.report import Page

PLOT_POOL_SIZE = "add-latency-vs-pool-size.png"
PLOT_FILL = "add-latency-vs-fill.png"
PLOT_GC_MEMORY = "gc-and-memory-vs-records.png"

REPORT_SECTIONS = [  # (table, its plot, the plot's caption), in the page's order
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
    for kind, what in (("ipward_pool", "named pool"), ("ipward", "inline ranges")):
        if f"exec.{kind}.median_ms" not in f:
            continue
        host_local = f.get("exec.host_local.median_ms")
        add(
            f"plugin ADD exec, single-node, {what} (median)",
            f"{f[f'exec.{kind}.median_ms']:.2f} ms",
            f"python3 -I -S start {f['exec.python.median_ms']:.2f} ms"
            + (f"; host-local {host_local:.2f} ms" if host_local is not None else ""),
            f"{f[f'exec.{kind}_minus_python_ms']:+.2f} ms",
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
    return rows + _growth_headline(result.get("series", {}))


def _growth_headline(series: dict) -> list[list[str]]:
    """The headline's rows of how cost grows (--report)."""
    rows: list[list[str]] = []

    def add(label: str, value: str, reference: str, ratio: str) -> None:
        rows.append([label, value, reference, ratio])

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
    from ipward_lab.report import line_plot

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
                (x, f"{p['label']}\n{addresses(p['addresses'])}")
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
        plots[PLOT_GC_MEMORY] = _gc_memory_plot(passes, agents, series["agent_empty"])
    return plots


def _gc_memory_plot(passes: list[dict], agents: list[dict], empty: dict) -> bytes:
    """GC pass time and agent memory against the number of records, side by side."""
    from ipward_lab.report import Panel, line_plots

    counts = [p["records"] for p in passes]
    ticks = [(n, count_label(n)) for n in counts]
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
    return line_plots([gc_panel, memory_panel], columns=2)


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
    for key, plot, caption in REPORT_SECTIONS:
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
    say = Console(out)

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
    written = write_report(result, directory, say.lines)
    out("")
    print_table(
        [["headline", "value", "reference (same run)", "vs reference"], *headline(result)], out
    )
    out("")
    out(f"  report ({notes['report_elapsed_s']} s in all):")
    for path in written:
        out(f"    {path}")
    return result
