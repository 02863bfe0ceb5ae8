"""`ipward bench --kube --quick --json` end to end: a cluster of its own (not the session's
`kube_cluster`), host-local then ipward, and the figures it prints. Marked `kube`.

Run in this process (click's runner): the bench takes the machine's containerd lock,
which this process may hold already for the session's cluster (re-entrant here; a
second process would wait for it until the session ends)."""

from __future__ import annotations

import glob
import json
import sys

import pytest
from click.testing import CliRunner

from ipward_lab.bench import bench_command
from kube_checks import require_cluster_lab

# `slow` too: a cluster of its own (~2.5 min), not in CI's 15 minutes of kube tests.
pytestmark = [pytest.mark.kube, pytest.mark.slow, pytest.mark.timeout(1800)]

QUICK_PODS = 30
QUICK_ROUNDS = 3


def test_bench_kube_quick_measures_both_ipams_and_removes_its_cluster() -> None:
    require_cluster_lab()
    before = set(glob.glob("/tmp/ipwb-*"))
    result = CliRunner().invoke(bench_command, ["--kube", "--quick", "--json"])
    sys.stderr.write(result.stderr)  # its progress and table, shown when a check fails
    assert result.exit_code == 0, repr(result.exception)
    figures = json.loads(result.stdout)
    for ipam in ("host-local", "ipward"):
        f = figures[ipam]
        assert (f["pods"], f["runs"]) == (QUICK_PODS, 2), ipam  # interleaved runs
        assert f["cni_adds"] >= QUICK_PODS, f"{ipam}: an ADD measured for each pod"
        assert 0 < f["pod_running_p50_s"] <= f["pod_running_p99_s"] <= f["all_running_s"]
        assert 0 < f["cni_add_p50_ms"] <= f["cni_add_p99_ms"], ipam
        assert len(f["rounds"]) == QUICK_ROUNDS, ipam
        assert all(r["seconds"] > r["down_seconds"] > 0 for r in f["rounds"]), ipam
    assert figures["ipward"]["sts_addresses_kept"] == QUICK_ROUNDS, figures["ipward"]["rounds"]
    assert set(figures["ratios"]) >= {"all_running_s", "cni_add_p50_ms", "sts_round_p50_s"}
    assert figures["table"][0] == ["", "host-local", "ipward", "ipward/host-local"]
    assert "all Running" in result.stderr
    assert set(glob.glob("/tmp/ipwb-*")) == before, "the bench's cluster was not removed"
