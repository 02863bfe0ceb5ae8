"""The bench runs and yields figures. No assertion on speed: it measures, it does not judge."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipward.bench import (
    ETCD,
    PLUGIN_PYTHON,
    bench_command,
    ledger_pair_rate,
    p99,
    percentile,
    raw_cas_rate,
    run,
    run_cluster,
    write_launcher,
)
from ipward.store.sqlite import SqliteStore


def test_p99_nearest_rank() -> None:
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 41)]) == 40.0  # fewer than 100: the maximum


def test_percentile_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 90) == 90.0
    assert percentile(samples, 99) == p99(samples) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 1) == 7.0


def test_raw_cas_and_ledger_rates_on_sqlite(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "bench.db"))
    try:
        cas = raw_cas_rate(store, n=20, warmup=2)
        pairs = ledger_pair_rate(store, n=20, warmup=2)
    finally:
        store.close()
    assert cas > 0 and math.isfinite(cas)
    assert pairs > 0 and math.isfinite(pairs)


@pytest.mark.skipif(not os.access(PLUGIN_PYTHON, os.X_OK), reason=f"no {PLUGIN_PYTHON}")
def test_fallback_launcher_runs_the_plugin(tmp_path: Path) -> None:
    launcher = tmp_path / "ipward"
    write_launcher(launcher)
    done = subprocess.run(
        [str(launcher)],
        input=b'{"cniVersion":"1.0.0"}',
        env={"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done
    assert "1.0.0" in json.loads(done.stdout)["supportedVersions"]


def test_command_options() -> None:
    result = CliRunner().invoke(bench_command, ["--help"])
    assert result.exit_code == 0
    for option in ("--quick", "--no-etcd", "--json", "--cluster", "--agents", "--concurrency"):
        assert option in result.output
    misplaced = CliRunner().invoke(bench_command, ["--agents", "2"])
    assert misplaced.exit_code == 2 and "--cluster" in misplaced.output


CLUSTER_FIGURES = [
    "cluster.raw_cas_per_s",
    "cluster.add_per_s",
    "cluster.del_per_s",
    "cluster.alloc_per_s",
    "cluster.vs_cas",
    "cluster.add_p50_ms",
    "cluster.add_p90_ms",
    "cluster.add_p99_ms",
    "cluster.del_p50_ms",
    "cluster.del_p99_ms",
    "cluster.cas_p50_ms",
    "cluster.cas_p99_ms",
    "exec.python.median_ms",
    "exec.python.p99_ms",
    "exec.ipward.median_ms",
    "exec.ipward.p99_ms",
]


def check_cluster_result(result: dict, lines: list[str], pairs: int) -> None:
    figures = result["figures"]
    expected = list(CLUSTER_FIGURES)
    if os.access("/usr/lib/cni/host-local", os.X_OK):
        expected += ["exec.host_local.median_ms", "exec.host_local.p99_ms"]
    missing = [name for name in expected if name not in figures]
    assert not missing, missing
    assert result["errors"] == {}, result["errors"]
    assert figures["cluster.pairs"] >= pairs
    # The difference of two medians is the one figure that is not a measurement itself.
    not_positive = {
        name: value
        for name, value in figures.items()
        if name != "exec.ipward_minus_python_ms" and not (value > 0 and math.isfinite(value))
    }
    assert not not_positive, not_positive
    assert math.isfinite(figures["exec.ipward_minus_python_ms"])
    assert set(result["targets"]) == {"cluster.vs_cas", "exec.ipward_minus_python_ms"}
    assert result["machine"]["nproc"] > 0
    assert any(line.strip().startswith("ADD only (allocations)") for line in lines)
    assert any("ipward ADD (through the agent)" in line for line in lines)
    assert any(line.strip().startswith("errors: none") for line in lines)


@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"no {ETCD}")
@pytest.mark.skipif(not os.access(PLUGIN_PYTHON, os.X_OK), reason=f"no {PLUGIN_PYTHON}")
def test_tiny_cluster_run() -> None:
    """One agent, two client threads, a few dozen ADD+DEL pairs: the whole path runs and
    every call is answered with success (--quick: 40 plugin execs of each kind)."""
    lines: list[str] = []
    result = run_cluster(agents=1, concurrency=2, quick=True, operations=16, out=lines.append)
    check_cluster_result(result, lines, pairs=2 * 16)


@pytest.mark.slow
@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"no {ETCD}")
def test_cluster_quick_run() -> None:
    """Three agents, eight client threads each, the --quick duration."""
    lines: list[str] = []
    result = run_cluster(agents=3, concurrency=8, quick=True, out=lines.append)
    check_cluster_result(result, lines, pairs=24)
    assert result["notes"]["agents"] == "3"


@pytest.mark.slow
def test_quick_run_reports_every_figure() -> None:
    lines: list[str] = []
    result = run(quick=True, out=lines.append)
    figures = result["figures"]
    expected = [
        "sqlite.raw_cas_per_s",
        "sqlite.ledger_pairs_per_s",
        "sqlite.ledger_vs_cas",
        "exec.python.median_ms",
        "exec.python.p99_ms",
        "exec.ipward.median_ms",
        "exec.ipward.p99_ms",
        "latency.empty_24.median_ms",
        "latency.empty_24.p99_ms",
        "latency.full90_20.median_ms",
        "latency.v6_64_10k.median_ms",
        "latency.v6_64_10k.vs_empty",
        "latency.v4_8_10k.median_ms",
        "latency.v4_8_10k.vs_empty",
    ]
    if os.access("/usr/lib/cni/host-local", os.X_OK):
        expected += ["exec.host_local.median_ms", "exec.host_local.p99_ms"]
    if os.access(ETCD, os.X_OK):
        expected += ["etcd.raw_cas_per_s", "etcd.ledger_pairs_per_s", "etcd.ledger_vs_cas"]
    else:
        assert "etcd" in result["skipped"]
    missing = [name for name in expected if name not in figures]
    assert not missing, missing
    # The difference of two medians is the one figure that is not a measurement itself.
    not_positive = {
        name: value
        for name, value in figures.items()
        if name != "exec.ipward_minus_python_ms" and not (value > 0 and math.isfinite(value))
    }
    assert not not_positive, not_positive
    assert math.isfinite(figures["exec.ipward_minus_python_ms"])
    assert result["machine"]["nproc"] > 0
    assert any("ipward ADD" in line for line in lines)
