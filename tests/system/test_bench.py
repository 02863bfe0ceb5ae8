"""The bench runs and yields figures. No assertion on speed: it measures, it does not judge."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipward.core.startpath import write_launcher
from ipward_lab.bench import (
    ETCD,
    PLOT_FILL,
    PLOT_GC_MEMORY,
    PLOT_POOL_SIZE,
    PLUGIN_PYTHON,
    RecordStore,
    agent_memory,
    exec_latency,
    fill_latency,
    gc_pass_times,
    machine,
    pool_size_latency,
    run,
    run_cluster,
    run_growth,
    write_report,
)
from ipward_lab.bench.common import count_label
from ipward_lab.bench.scale import FULL as FULL_SCALE
from ipward_lab.bench.scale import PLOT_SCALE, ScaleSizes, run_scale
from ipward_lab.fleet import IPWARD
from ipward_lab.report import PNG_MAGIC
from ipward_lab.servers import kube_apiserver


@pytest.mark.skipif(not os.access(PLUGIN_PYTHON, os.X_OK), reason=f"no {PLUGIN_PYTHON}")
def test_the_launcher_the_bench_installs_runs_the_plugin(tmp_path: Path) -> None:
    """The bench installs the plugin with the product's one launcher writer (that of
    `ipward install-cni`), into a directory it makes."""
    launcher = tmp_path / "bin" / "ipward"
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
    "exec.ipward_native.median_ms",
    "exec.ipward_native.p99_ms",
    "exec.ipward_add_per_s",
    "exec.python_starts_per_s",
    "exec.add_vs_python_starts",
]


def check_cluster_result(result: dict, lines: list[str], pairs: int) -> None:
    figures = result["figures"]
    expected = list(CLUSTER_FIGURES)
    host_local = os.access("/usr/lib/cni/host-local", os.X_OK)
    if host_local:
        expected += ["exec.host_local.median_ms", "exec.host_local.p99_ms"]
        expected += ["exec.ipward_native_vs_host_local", "exec.ipward_vs_host_local"]
    missing = [name for name in expected if name not in figures]
    assert not missing, missing
    assert result["errors"] == {}, result["errors"]
    assert figures["cluster.pairs"] >= pairs
    # The difference of two medians is the one figure that is not a measurement itself;
    # etcd's own counts per pair are diagnostics that may be 0 (an agent that answers
    # from its own state sends etcd no Range at all).
    counts = {name for name in figures if ".etcd_" in name or ".cas_etcd_" in name}
    not_positive = {
        name: value
        for name, value in figures.items()
        if name != "exec.ipward_minus_python_ms"
        and name not in counts
        and not (value > 0 and math.isfinite(value))
    }
    assert not not_positive, not_positive
    negative = {name: figures[name] for name in counts if not figures[name] >= 0}
    assert not negative, negative
    assert math.isfinite(figures["exec.ipward_minus_python_ms"])
    targets = {"cluster.vs_cas", "exec.ipward_minus_python_ms"}
    assert set(result["targets"]) == targets | (
        {"exec.ipward_native_vs_host_local"} if host_local else set()
    )
    assert result["machine"]["nproc"] > 0
    assert any(line.strip().startswith("ADD only (allocations)") for line in lines)
    assert any("ipward ADD (through the agent)" in line for line in lines)
    assert any("native ipward ADD (through the agent)" in line for line in lines)
    assert any(line.strip().startswith("ipward ADDs through the agent") for line in lines)
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
        "exec.ipward_pool.median_ms",
        "exec.ipward_pool_minus_python_ms",
        "exec.sqlite_floor.median_ms",
        "exec.sqlite_floor_minus_python_ms",
        "exec.ipward_minus_floor_ms",
        "exec.ipward_pool_minus_floor_ms",
        "latency.empty_24.median_ms",
        "latency.empty_24.p99_ms",
        "latency.full90_20.median_ms",
        "latency.v6_64_10k.median_ms",
        "latency.v6_64_10k.vs_empty",
        "latency.v4_8_10k.median_ms",
        "latency.v4_8_10k.vs_empty",
    ]
    host_local = os.access("/usr/lib/cni/host-local", os.X_OK)
    if host_local:
        expected += ["exec.host_local.median_ms", "exec.host_local.p99_ms"]
        expected += ["exec.ipward_native_vs_host_local", "exec.ipward_vs_host_local"]
    if os.access(ETCD, os.X_OK):
        expected += ["etcd.raw_cas_per_s", "etcd.ledger_pairs_per_s", "etcd.ledger_vs_cas"]
    else:
        assert "etcd" in result["skipped"]
    missing = [name for name in expected if name not in figures]
    assert not missing, missing
    # The differences of two medians are the figures that are not measurements themselves.
    differences = ("_minus_python_ms", "_minus_floor_ms")
    not_positive = {
        name: value
        for name, value in figures.items()
        if not name.endswith(differences) and not (value > 0 and math.isfinite(value))
    }
    assert not not_positive, not_positive
    assert math.isfinite(figures["exec.ipward_minus_python_ms"])
    assert {"exec.ipward_minus_python_ms", "exec.ipward_pool_minus_python_ms"} <= set(
        result["targets"]
    )
    assert result["machine"]["nproc"] > 0
    assert any("ipward ADD, named pool" in line for line in lines)
    assert any("ipward ADD, inline ranges" in line for line in lines)


# -- the report's pieces -------------------------------------------------------------------


def test_gc_pass_times_and_agent_memory(tmp_path: Path) -> None:
    empty, records = RecordStore(tmp_path, 0), RecordStore(tmp_path, 300)
    times = gc_pass_times([records], repeats=1)
    assert set(times[300]) == {
        "raw_range_s",
        "look_s",
        "snapshot_s",
        "gather_s",
        "judge_s",
        "controller_pass_s",
    }
    _positive(times[300])
    for memory in (
        agent_memory(tmp_path, empty),
        agent_memory(tmp_path, records),
        agent_memory(tmp_path, records, other_node=True),
    ):
        assert set(memory) == {"rss_mib", "hwm_mib"}
        _positive(memory)
        assert memory["hwm_mib"] >= memory["rss_mib"]


def test_growth_and_report_files(tmp_path: Path) -> None:
    """The growth part at tiny sizes, then the report written from it: every file, the
    figures in the JSON, the plots embedded in the page."""
    lines: list[str] = []
    work = tmp_path / "work"
    work.mkdir()
    figures, series, tables = run_growth(
        work,
        quick=True,
        out=lines.append,
        rounds=1,
        per_round=5,
        fill_prefix=20,
        counts=(200, 1000),
    )
    for name in ("v4_24", "v4_8", "v6_64"):
        assert figures[f"growth.size.{name}.add_median_ms"] > 0
    assert figures["growth.size.v4_24.vs_24"] == 1.0
    for pct in (10, 50, 90, 99):
        assert figures[f"growth.fill.{pct}.add_p99_ms"] > 0
    for label in ("200", "1k"):
        assert figures[f"growth.gc.{label}.look_ms"] > 0
        assert figures[f"growth.gc.{label}.look_vs_range"] > 0
        assert figures[f"growth.agent.{label}.hwm_mib"] > 0
        assert figures[f"growth.agent_other.{label}.hwm_mib"] > 0
    assert figures["growth.agent.empty.rss_mib"] > 0
    assert set(tables) == {"pool_size", "fill", "gc", "agent"}
    result = {
        "machine": machine(),
        "figures": figures,
        "targets": {},
        "skipped": {"etcd": "not in this test"},
        "notes": {"quick": "yes"},
        "tables": tables,
        "series": series,
    }
    out = tmp_path / "report"
    written = write_report(result, out, console=["line <one>", "line & two"])
    names = {p.name for p in written}
    assert names == {PLOT_POOL_SIZE, PLOT_FILL, PLOT_GC_MEMORY, "report.html", "report.json"}
    for plot in (PLOT_POOL_SIZE, PLOT_FILL, PLOT_GC_MEMORY):
        assert (out / plot).read_bytes().startswith(PNG_MAGIC)
    assert json.loads((out / "report.json").read_text())["figures"] == figures
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert 'src="http' not in page and "<script" not in page
    assert "line &lt;one&gt;" in page and "line &amp; two" in page
    assert "Headline" in page and "GC pass (gc.look)" in page


def test_plugin_and_agent_do_not_load_matplotlib() -> None:
    """matplotlib is imported by the report's plotting functions only: not by the CLI
    the agent runs in, nor by the plugin."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ipward.cmd.cli, ipward.cni.verbs, ipward.cni.plugin, ipward_lab.report;"
            " print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


REPORT_FIGURES = [
    "sqlite.ledger_allocations_per_s",
    "exec.ipward.median_ms",
    "latency.empty_24.median_ms",
    "growth.size.v4_24.add_median_ms",
    "growth.size.v4_8.vs_24",
    "growth.size.v6_64.add_p99_ms",
    "growth.fill.10.add_median_ms",
    "growth.fill.99.vs_first",
    "growth.gc.1k.look_ms",
    "growth.gc.10k.raw_range_ms",
    "growth.gc.10k.controller_pass_ms",
    "growth.agent.empty.hwm_mib",
    "growth.agent.10k.hwm_mib",
    "growth.agent_other.10k.hwm_mib",
]


@pytest.mark.slow
def test_report_quick_run(tmp_path: Path) -> None:
    """`ipward bench --report DIR --quick --no-etcd` as a subprocess."""
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "ipward", "bench", "--report", str(out), "--quick", "--no-etcd"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "7. agent memory" in done.stdout
    for name in ("report.html", "report.json", PLOT_POOL_SIZE, PLOT_FILL, PLOT_GC_MEMORY):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "report.json").read_text())
    missing = [name for name in REPORT_FIGURES if name not in result["figures"]]
    assert not missing, missing
    assert result["skipped"]["cluster"] == "--no-etcd"
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and 'src="http' not in page


# -- plugin exec and the scale run ---------------------------------------------------------


@pytest.mark.skipif(not os.access(PLUGIN_PYTHON, os.X_OK), reason=f"no {PLUGIN_PYTHON}")
def test_exec_latency_of_a_named_pool_and_inline_ranges(tmp_path: Path) -> None:
    """Single-node mode both ways, next to the bare interpreter, every ADD answered."""
    figures = exec_latency(tmp_path, runs=3, warmup=1)
    for kind in ("python", "ipward_pool", "ipward"):
        _positive({k: v for k, v in figures.items() if k.startswith(f"{kind}.")})
        assert {f"{kind}.median_ms", f"{kind}.p99_ms"} <= set(figures)


SCALE_ROW = {
    "records",
    "pass_work_ms",
    "reconcile_vs_work",
    "duties_keepalive_etcd_ms",
    "duties_look_etcd_ms",
    "duties_etcd_cores",
    "duties_etcd_cores_every_second",
    "nodes",
    "register_s",
    "fill_s",
    "publish_s",
    "fill_records_per_s",
    "db_bytes",
    "db_in_use_bytes",
    "db_bytes_per_record",
    "blocks_per_node",
    "agent_rss_mib",
    "agent_hwm_mib",
    "reconcile_ms",
    "reconcile_max_ms",
    "node_read_ms",
    "controller_first_pass_ms",
    "controller_steady_pass_ms",
    "controller_rss_mib",
    "controller_hwm_mib",
    "controller_assigned_first",
    "controller_pass_errors",
    "controller_view_rereads",
    "changed_pods",
    "add_running_p50_ms",
    "add_running_p99_ms",
    "add_paused_p50_ms",
    "add_paused_p99_ms",
    "adds_running",
    "adds_paused",
    "add_p99_vs_paused",
    "controller_cpu",
    "churn_errors",
    "liveness_hwm_mib",
    "stage_s",
}
# Counts that are 0 when all is well.
SCALE_ZEROS = {"controller_assigned_first", "controller_pass_errors", "churn_errors"}


def check_scale_result(
    result: dict, stages: tuple[int, ...], agents: int, errors_allowed: bool = False
) -> None:
    """Every figure of every stage, sane. `errors_allowed`: a controller pass or a
    churn call that failed at a large size is a finding the run counts, not a broken
    bench (at a tiny size there is none)."""
    rows = result["series"]["scale"]
    assert [row["records"] for row in rows] == list(stages)
    assert not [k for k in result["notes"] if ".failed." in k], result["notes"]
    for row in rows:
        assert set(row) == SCALE_ROW, set(row) ^ SCALE_ROW
        # etcd's CPU for the node duties is counted in ticks: none at a tiny sample.
        may_be_zero = SCALE_ZEROS | {"controller_cpu"} | {k for k in row if "duties_" in k}
        _positive({k: v for k, v in row.items() if k not in may_be_zero})
        assert 0 <= row["duties_etcd_cores"] <= row["duties_etcd_cores_every_second"]
        # The fill left what the controller's passes would have: its first assigns nothing.
        assert row["controller_assigned_first"] == 0
        if not errors_allowed:
            assert row["churn_errors"] == row["controller_pass_errors"] == 0
        assert 0 <= row["controller_cpu"] <= (os.cpu_count() or 1)
        assert row["changed_pods"] == max(row["records"] // 100, 1)
        assert row["controller_view_rereads"] == 1  # at its start: the steady pass follows
        assert row["nodes"] > agents
        assert row["agent_hwm_mib"] >= row["agent_rss_mib"]
    assert set(result["targets"]) == {
        f"scale.{count_label(stages[-1])}.add_p99_vs_paused",
        f"scale.{count_label(stages[-1])}.agent_hwm_mib",
        "scale.reconcile_spread",
        f"scale.{count_label(stages[-1])}.controller_hwm_mib",
        "scale.steady_pass_vs_reference",
    }
    table = result["tables"]["scale"]
    assert table[0][1:-1] == [count_label(n) for n in stages]
    assert all(len(row) == len(table[0]) for row in table)


@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"no {ETCD}")
@pytest.mark.skipif(not os.access(PLUGIN_PYTHON, os.X_OK), reason=f"no {PLUGIN_PYTHON}")
def test_tiny_scale_run(tmp_path: Path) -> None:
    """Two small stages on one etcd, one agent node, one churn loop: every figure of
    every stage, the targets, the table, the report's files."""
    stages = (250, 400)
    lines: list[str] = []
    sizes = ScaleSizes(
        stages,
        agents=1,
        churn_threads=1,
        rounds=1,
        round_seconds=1.0,
        reconcile_passes=2,
        duty_samples=20,
    )
    result = run_scale(sizes, out=lines.append, report_dir=tmp_path / "report")
    check_scale_result(result, stages, agents=1)
    assert (tmp_path / "report" / PLOT_SCALE).read_bytes().startswith(PNG_MAGIC)
    assert (
        json.loads((tmp_path / "report" / "scale.json").read_text())["figures"]
        == (result["figures"])
    )
    page = (tmp_path / "report" / "scale.html").read_text()
    assert page.count('src="data:image/png;base64,') == 1
    assert any(line.strip().startswith("agent reconcile ms") for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 8 minutes on 2 cores; the run keeps each under 20
@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"no {ETCD}")
def test_full_scale_run(tmp_path: Path) -> None:
    """The full run: 5,000 nodes and 150,000 allocations at its last stage."""
    result = run_scale(FULL_SCALE, report_dir=tmp_path / "report")
    check_scale_result(
        result, tuple(FULL_SCALE.stages), agents=FULL_SCALE.agents, errors_allowed=True
    )
    print(json.dumps({"targets": result["targets"], "notes": result["notes"]}, indent=1))
    assert result["series"]["scale"][-1]["nodes"] == 5000


def test_kubernetes_source_memory_next_to_its_targets() -> None:
    """`ipward bench --k8s`: each scope measured in its own process, with its target."""
    done = subprocess.run(
        [*IPWARD, "bench", "--k8s", "--pods", "500", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["cluster_pods"] == 500
    assert figures["controller"]["pods"] == 500
    assert 0 < figures["agent"]["pods"] < 500  # its node's pods only
    for scope, target in (("controller", "200 MiB"), ("agent", "60 MiB")):
        assert figures[scope]["rss"] > figures[scope]["baseline"] > 0
        assert f"{scope}: " in done.stderr and f"target {target}" in done.stderr


K8S_STORE_LOADS = ("raw_1", "add_1", "del_1", "raw_32", "add_32", "del_32", "add_32x3", "del_32x3")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 2.5 minutes on 2 cores
@pytest.mark.skipif(kube_apiserver.binary() is None, reason="KUBE_APISERVER names no binary")
@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason=f"no {ETCD}")
def test_k8s_store_quick_run() -> None:
    """`ipward bench --k8s-store --quick --json`: both stores under every load, the API
    writes counted, the fill's objects, memory and relist storm; its servers and
    directories gone after."""
    before = set(glob.glob("/tmp/ipward-bench-k8s-store-*"))
    done = subprocess.run(
        [*IPWARD, "bench", "--k8s-store", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert not result["errors"], result["errors"]
    f = result["figures"]
    for side in ("k8s", "etcd"):
        for load in K8S_STORE_LOADS:
            key = f"k8s_store.{side}.{load}"
            assert f[f"{key}.ops"] > 0 and f[f"{key}.per_s"] > 0, key
            assert 0 < f[f"{key}.p50_ms"] <= f[f"{key}.p99_ms"], key
            assert f[f"{key}.writes_per_op"] > 0, key
    # An ADD alone writes its node's object and its block's (docs/design.md 5.15).
    assert f["k8s_store.k8s.add_1.ledger_writes_per_op"] >= 2
    assert f["k8s_store.k8s.add_32.vs_raw"] > 0
    assert f["k8s_store.k8s.add_1.writes_less_idle_per_op"] > 0
    # The node's plugin exec'd through an agent of each store, beside host-local's.
    for side in ("k8s", "etcd"):
        for kind in ("ipward_native", "ipward", "host_local", "python"):
            key = f"k8s_store.{side}.exec.{kind}"
            assert 0 < f[f"{key}.median_ms"] <= f[f"{key}.p99_ms"], key
        assert f[f"k8s_store.{side}.exec.native_vs_host_local"] > 0
    assert set(result["targets"]) == {
        "k8s_store.k8s.add_32.vs_raw",
        "k8s_store.k8s.add_1.writes_less_idle_per_op",
        "k8s_store.etcd.exec.native_vs_host_local",
    }
    fill = {k.removeprefix("k8s_store.fill."): v for k, v in f.items() if ".fill." in k}
    assert fill["records"] == 3000 and fill["nodes"] == 100
    assert fill["objects.node"] == fill["objects.lease"] == 100  # a node's: its own, its lease
    assert fill["objects.addr"] > 0
    assert fill["objects"] >= fill["objects.node"] + fill["objects.lease"] + fill["objects.addr"]
    assert 0 < fill["object_bytes_p50"] <= fill["object_bytes_max"] < 1.5 * 2**20
    assert fill["agent_hwm_mib"] > 0 and fill["controller_hwm_mib"] > 0
    assert fill["changed_pods"] > 0
    assert fill["relist.done"] + fill["relist.errors"] == fill["relist.agents"] == 100
    assert fill["relist.done"] > 0 and fill["relist.keys"] > 0
    assert 0 < fill["relist.api_rss_before_mib"] <= fill["relist.api_rss_peak_mib"]
    assert set(result["tables"]) == {"load", "cost", "exec", "fill"}
    assert "relist storm" in done.stderr and "ADDs/s at 32-way" in done.stderr
    assert set(glob.glob("/tmp/ipward-bench-k8s-store-*")) == before


def _positive(figures: dict[str, float]) -> None:
    bad = {k: v for k, v in figures.items() if not (v > 0 and math.isfinite(v))}
    assert not bad, bad


def test_latency_against_pool_size_and_fill(tmp_path: Path) -> None:
    sizes = pool_size_latency(tmp_path, rounds=1, per_round=5, in_use=10)
    assert set(sizes) == {"v4_24", "v4_20", "v4_16", "v4_12", "v4_8", "v6_64"}
    for row in sizes.values():
        assert row["in_use"] == 10
        _positive(row)
    assert sizes["v4_8"]["addresses"] == 2**24 - 2
    fills = fill_latency(tmp_path, prefix=22, rounds=1, per_round=5, percents=(10, 95))
    assert [fills[p]["in_use"] for p in (10, 95)] == [1022 * 10 // 100, 1022 * 95 // 100]
    for row in fills.values():
        _positive(row)
