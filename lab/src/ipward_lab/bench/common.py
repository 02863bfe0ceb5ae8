"""What every figure of the bench uses: its error, the paths and names it runs with,
percentiles, the machine's description, console tables, and the `Results` a run
collects."""

from __future__ import annotations

import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipward.core.startpath import PLUGIN_PYTHON
from ipward_lab.fleet import FleetError, Process
from ipward_lab.servers.etcd import ETCD

HOST_LOCAL = "/usr/lib/cni/host-local"
CNI_BIN_DIR = "/usr/lib/cni"
NODE = "bench-node"
CAS_KEY = "bench/cas"
AGENT_READY_TIMEOUT = 30.0
AGENT_STOP_TIMEOUT = 10.0


class BenchError(Exception):
    """Something the bench needs did not work (not a slow result: those are figures)."""


@dataclass
class Results:
    """What a run collects: figures by name, targets met or not, parts skipped and why,
    notes, the console tables by name and the plots' series."""

    figures: dict[str, float] = field(default_factory=dict)
    targets: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    tables: dict[str, list[list[str]]] = field(default_factory=dict)
    series: dict = field(default_factory=dict)

    def with_errors(self, info: dict, errors: dict[str, Any]) -> dict:
        """A run of agents under load as `--json` prints it: the machine, the figures,
        targets, notes and tables, and the calls that failed (by kind)."""
        return {
            "machine": info,
            "figures": self.figures,
            "targets": self.targets,
            "errors": errors,
            "notes": self.notes,
            "tables": self.tables,
        }


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


def summary(samples_s: Sequence[float]) -> tuple[float, float]:
    """(median, p99) in milliseconds of samples in seconds."""
    return statistics.median(samples_s) * 1000, p99(samples_s) * 1000


def percentile_ms(samples: Sequence[float], q: int) -> float:
    return percentile(samples, q) * 1000


def count_label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def addresses(n: float) -> str:
    if n >= 1e12:
        return f"2^{round(math.log2(n + 2))}"
    return f"{n:,.0f}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Console:
    """`say(line)` prints with `out` and keeps the line (a report shows them all)."""

    def __init__(self, out: Callable[[str], object]) -> None:
        self.out = out
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.out(line)


class Timer:
    """`with Timer(samples):` appends the seconds the block took."""

    def __init__(self, samples: list[float]) -> None:
        self.samples = samples
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self.start)


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (peak resident) of a process in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
    return {"rss_mib": values["VmRSS"], "hwm_mib": values["VmHWM"]}


def settled_memory(pid: int, seconds: float = 3.0) -> dict[str, float]:
    """`memory_mib` once the resident size stops moving (or after `seconds`): a process
    that just logged the end of a pass may still be letting go of what it read."""
    memory = memory_mib(pid)
    settle = time.monotonic() + seconds
    while time.monotonic() < settle:
        time.sleep(0.1)
        now = memory_mib(pid)
        steady = abs(now["rss_mib"] - memory["rss_mib"]) < 0.25
        memory = now
        if steady:
            break
    return memory


def version_of(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "missing"
    if done.returncode != 0:
        return "missing"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "?"


def machine() -> dict[str, str | int]:
    etcd = version_of([ETCD, "--version"]).removeprefix("etcd Version: ")
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count() or 0,
        "platform": platform.platform(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "plugin_python": version_of(
            [PLUGIN_PYTHON, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"]
        )
        + f" ({PLUGIN_PYTHON} -I -S)",
        "sqlite": sqlite3.sqlite_version,
        "etcd": etcd,
    }


def print_table(rows: list[list[str]], out: Callable[[str], object], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            # First column left-aligned, figures right-aligned.
            cells.append(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]))
        out((indent + "  ".join(cells)).rstrip())


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def stop_process(proc: Process) -> None:
    """SIGTERM (an agent drains, a controller ends its pass, and exits), then SIGKILL
    if it does not."""
    try:
        proc.stop(AGENT_STOP_TIMEOUT)
    except (subprocess.TimeoutExpired, FleetError):
        proc.kill()
