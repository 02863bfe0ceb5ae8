"""What a person sees of a soak: the live view while it runs, the summary table at the
end, and the self-contained HTML report (`--report DIR`)."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from rich.console import Group
from rich.table import Table

from ipward_lab.soak.result import Options, Result

API_SERVERS = {
    "none": "none (the cluster from the state file, sim://)",
    "test": "loopback test server (k8s://)",
    "real": "kube-apiserver (k8s://)",
}


def live_view(r: Result, o: Options) -> Group:
    """The live view: the last seconds' pods, records, allocation rate and latency,
    faults and violations."""
    last = r.samples[-1] if r.samples else None
    window = r.samples[-5:]
    latencies = [ms for s in window for ms in s.add_ms]
    where = "" if o.api == "none" else f", API {o.api}"
    table = Table(title=f"ipward sim ({o.backend}{where}, seed {o.seed})", show_header=False)
    table.add_row("elapsed", f"{last.at:.0f}s of {o.duration:g}s" if last else "-")
    table.add_row("pods", f"{last.running} running of {last.pods}" if last else "-")
    table.add_row("records", str(last.records) if last else "-")
    rate = sum(s.adds for s in window) / max(1, len(window))
    table.add_row("allocations/s", f"{rate:.1f}")
    if latencies:
        table.add_row("ADD p50 / p99", f"{_pct(latencies, 50):.0f} / {_pct(latencies, 99):.0f} ms")
    table.add_row("faults", f"{len(r.faults)}: {r.faults[-1][2] if r.faults else '-'}")
    table.add_row("violations", str(len(r.violations)))
    return Group(table)


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary_rows(result: Result) -> list[tuple[str, str]]:
    o = result.options
    faults = Counter(f[1] for f in result.faults)
    failed = ", ".join(f"code {k}: {v}" for k, v in sorted(result.add_failures.items()))
    rows = [
        ("store", o.backend),
        ("API server", API_SERVERS[o.api]),
        (
            "nodes / pods / rate / duration",
            f"{o.nodes} / {o.pods} / {o.rate:g}/s / {o.duration:g}s",
        ),
        ("actions", ", ".join(f"{k} {v}" for k, v in sorted(result.actions.items()))),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(faults.items()))),
        ("ADD calls", f"{result.add_calls}; failed and retried: {failed or 'none'}"),
    ]
    latencies = [ms for s in result.samples for ms in s.add_ms]
    if latencies:
        p50, p99 = statistics.median(latencies), _pct(latencies, 99)
        rows.append(("ADD latency p50 / p99", f"{p50:.1f} / {p99:.1f} ms"))
    frees = ", ".join(f"{k} {v}" for k, v in sorted(result.gc_frees.items()))
    rows += [
        ("GC frees", frees or "-"),
        ("invariant checks", str(result.checks)),
        ("converged after", _secs(result.converged_after)),
        ("pool empty after teardown", _secs(result.emptied_after)),
        ("violations", str(len(result.violations))),
    ]
    return rows


def summary(result: Result) -> Table:
    table = Table(title="ipward sim: summary")
    table.add_column("")
    table.add_column("")
    for name, value in summary_rows(result):
        table.add_row(name, value)
    return table


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}s"


def write_report(result: Result, directory: Path) -> Path:
    """The self-contained HTML report: pool use over time, ADD latency percentiles over
    time with fault markers, GC frees by reason, the summary, the violations."""
    from ipward_lab.report import Page, line_plot

    directory.mkdir(parents=True, exist_ok=True)
    markers = [(t, kind) for t, kind, _ in result.faults]
    samples = result.samples
    page = Page(f"ipward sim: {result.options.backend}, seed {result.options.seed}")
    page.heading("Summary")
    page.table(["", ""], [list(row) for row in summary_rows(result)])
    page.figure(
        line_plot(
            {
                "records": [(s.at, s.records) for s in samples],
                "pods running": [(s.at, s.running) for s in samples],
            },
            "seconds",
            "count",
            "Pool use over time",
            markers=markers,
        ),
        "Allocation records and running pods; vertical lines are faults.",
    )
    windows = [(s.at, s.add_ms) for s in samples if s.add_ms]
    page.figure(
        line_plot(
            {
                "p50": [(t, _pct(ms, 50)) for t, ms in windows],
                "p99": [(t, _pct(ms, 99)) for t, ms in windows],
            },
            "seconds",
            "ms",
            "ADD latency (plugin exec through the agent), per second",
            markers=markers,
        ),
        "ADD latency percentiles per second; vertical lines are faults.",
    )
    page.heading("Garbage collection frees by reason")
    page.table(["reason", "addresses"], [[k, str(v)] for k, v in sorted(result.gc_frees.items())])
    page.heading("Faults")
    page.table(["at", "fault", "what"], [[f"{t:.1f}s", k, d] for t, k, d in result.faults])
    page.heading("Violations")
    if result.violations:
        for v in result.violations:
            page.paragraph(f"{v.kind} {v.address}: {v.detail}")
            if v.history:
                page.table(["history"], [[line] for line in v.history])
    else:
        page.paragraph("None.")
    path = directory / "report.html"
    page.write(path)
    return path
