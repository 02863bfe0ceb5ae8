"""`ipward sim`, the chaos soak: a short seeded run with every fault kind on a
three-member etcd and one on SQLite (the CI soak: about three minutes together), and
proof that its checker catches what it is there to catch."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.store.base import Delete, at_revision
from ipward_lab.fleet import IPWARD
from ipward_lab.servers import kube_apiserver
from ipward_lab.soak import FAULTS, NS, POOL, Options, Soak
from ipward_lab.soak.result import fault_unavailable
from ipward_lab.waiting import wait_for


def soak(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*IPWARD, "sim", "--no-live", "--report", str(tmp_path / "report"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def fault_counts(stdout: str) -> dict[str, int]:
    """Faults by kind, from the summary table (its cells wrap: the borders go)."""
    flat = " ".join(stdout.replace("│", " ").split())
    return {kind: int(n) for kind, n in re.findall(r"(" + "|".join(FAULTS) + r") (\d+)", flat)}


def possible(backend: str, api: str = "none") -> set[str]:
    """The faults a run on `backend` and `api` can make."""
    return {k for k in FAULTS if fault_unavailable(k, backend, api) is None}


# The CI soak's size: 60 s, every fault the run can make.
CI_RUN = ("--nodes", "3", "--pods", "24", "--duration", "60", "--seed", "7", "--faults", "all")


def test_soak_three_member_etcd_every_fault(tmp_path: Path) -> None:
    run = soak(tmp_path, "--store", "etcd-cluster", *CI_RUN)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    counts = fault_counts(run.stdout)
    assert set(counts) == possible("etcd-cluster") and min(counts.values()) >= 1, counts
    assert "kill-etcd" in counts
    report = (tmp_path / "report" / "report.html").read_text()
    assert report.count("<img") == 2 and "GC" in report and "Faults" in report


def test_soak_sqlite_every_fault(tmp_path: Path) -> None:
    run = soak(tmp_path, "--nodes", "2", "--pods", "16", "--duration", "45", "--seed", "11")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    counts = fault_counts(run.stdout)
    assert set(counts) == possible("sqlite") and "kill-etcd" not in counts, counts


@pytest.mark.slow
@pytest.mark.kstore
def test_soak_kubernetes_store_every_fault(tmp_path: Path) -> None:
    """The CI soak's run on the Kubernetes store (its own kube-apiserver), with its API
    server's faults among the rest: killed, a 409 storm, a compaction that watches meet
    as 410 (a violation unless a follower reads the ledger whole on one)."""
    if kube_apiserver.binary() is None:
        pytest.skip("KUBE_APISERVER does not name a kube-apiserver binary")
    run = soak(tmp_path, "--store", "k8s", *CI_RUN)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    counts = fault_counts(run.stdout)
    assert set(counts) == possible("k8s") and min(counts.values()) >= 1, counts
    assert {"store-api-kill", "store-conflicts", "store-relist"} <= set(counts)


def test_bad_fault_name_is_named(tmp_path: Path) -> None:
    run = soak(tmp_path, "--faults", "kill-agent,unplug-cable")
    assert run.returncode == 2 and "unplug-cable" in run.stderr and "Traceback" not in run.stderr


def test_the_checker_catches_a_lost_live_address(tmp_path: Path) -> None:
    """A record deleted under a ready pod (what a wrong GC would do) is a live-loss
    violation, reported with the address's history."""
    s = Soak(Options(nodes=1, pods=4, duration=5, faults=()), tmp_path)
    try:
        s.start()
        assert s.sim is not None and s.store is not None
        s.sim.create_deployment(NS, "web", 2)
        wait_for(lambda: len(s.sim.ready_addresses()) == 2, "2 pods ready")  # type: ignore[union-attr]
        assert s.checker.check_once() == []
        ip = sorted(s.sim.ready_addresses())[0]
        kv = s.store.get(keys.ip_key(POOL, ip))
        assert kv is not None
        s.store.txn([at_revision(kv.key, kv.mod_revision)], [Delete(kv.key)])
        found = s.checker.check_once()
        assert [(v.kind, v.address) for v in found] == [("live-loss", ip)]
        s.checker.record(found)
        (violation,) = s.result.violations
        assert any("put" in line for line in violation.history)
        assert violation.history[-1].endswith("(deleted)")
        assert json.loads(violation.history[0].split(": ", 1)[1])["ifname"] == "eth0"
    finally:
        s.close()
