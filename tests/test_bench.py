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
    raw_cas_rate,
    run,
    write_launcher,
)
from ipward.store.sqlite import SqliteStore


def test_p99_nearest_rank() -> None:
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 41)]) == 40.0  # fewer than 100: the maximum


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
    for option in ("--quick", "--no-etcd", "--json"):
        assert option in result.output


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
