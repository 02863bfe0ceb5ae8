"""`ipward bench --kube`'s parts in this process: the CNI ADDs read from containerd's
debug log (lines copied from a real run, `data/containerd-cni.log`), each pod's time to
Running from the pods read over time, and the table's ratios. (The run on a real
cluster: `tests/system/test_kube_bench.py`.)"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from ipward_lab.bench.common import BenchError
from ipward_lab.bench.kube import (
    CniAdd,
    IpamFigures,
    PodStart,
    Round,
    cni_adds,
    log_fields,
    log_time,
    pod_start,
    ratios,
    start_figures,
    table,
)

LOG = (Path(__file__).parent / "data" / "containerd-cni.log").read_text().splitlines()


def test_log_time_reads_rfc3339_with_nanoseconds() -> None:
    utc = int(datetime.datetime(2026, 11, 27, 13, 52, 36, tzinfo=datetime.UTC).timestamp())
    assert log_time("2026-11-27T13:52:36.031144081Z") == utc * 10**9 + 31144081
    assert log_time("2026-11-27T13:52:36.5Z") == utc * 10**9 + 500_000_000  # zeros trimmed
    assert log_time("2026-11-27T13:52:36Z") == utc * 10**9
    assert log_time("2026-11-27T14:52:36.25+01:00") == utc * 10**9 + 250_000_000
    with pytest.raises(ValueError):
        log_time("13:52:36")


def test_log_fields_unquotes_values() -> None:
    fields = log_fields(LOG[0])
    assert fields["level"] == "debug"
    assert fields["msg"] == (
        'generated id for sandbox name "start-8d88cd6b5-smmh4_bench-host-local-start_'
        'f28b28e7-c80c-44c4-a079-e5fe67d7f4a2_0"'
    )
    assert fields["podsandboxid"].startswith("0f25bb810b49")
    assert log_fields("time=x level=debug msg=ImageFsInfo")["msg"] == "ImageFsInfo"


def test_cni_adds_pair_begin_and_result_per_sandbox_of_the_namespace() -> None:
    """Two sandboxes of the namespace, their ADDs interleaved with each other's lines;
    the sandboxes of other namespaces in the same log are not counted."""
    adds = cni_adds(LOG, "bench-host-local-start")
    assert [(a.sandbox[:12], a.pod) for a in adds] == [
        ("0f25bb810b49", "start-8d88cd6b5-smmh4"),
        ("2ea9417eff95", "start-8d88cd6b5-q8m9z"),
    ]
    assert adds[0].seconds == 0.09477739  # 13:52:36.031144081 to 13:52:36.125921471
    assert adds[1].seconds == 0.060082133
    assert [a.pod for a in cni_adds(LOG, "bench-host-local-sts")] == ["sts-1"]
    assert cni_adds(LOG, "bench-ipward-start") == []


def test_a_begin_without_a_result_is_a_failed_add() -> None:
    """The controller's first sandbox failed its ADD (no plugin yet: logged as errors
    that name no podsandboxid field), the kubelet's second one succeeded."""
    adds = cni_adds(LOG, "ipward-system")
    assert [(a.sandbox[:12], a.ended is None) for a in adds] == [
        ("fd7bb6f73772", True),
        ("528f0d734f33", False),
    ]
    with pytest.raises(ValueError, match="failed"):
        _ = adds[0].seconds
    figures = start_figures([PodStart(3.0, [1.0, 2.0, 3.0])], adds)
    assert (figures.cni_adds, figures.cni_adds_failed) == (1, 1)
    assert figures.cni_add_p50_ms == pytest.approx(113.798527)


def test_runs_are_pooled_and_their_all_running_is_the_median() -> None:
    adds = [CniAdd(str(i), "p", 0, int(ms * 1e6)) for i, ms in enumerate((10, 20, 30, 40))]
    starts = [PodStart(3.0, [1.0, 3.0]), PodStart(5.0, [2.0, 5.0]), PodStart(4.0, [4.0, 4.0])]
    figures = start_figures(starts, adds)
    assert (figures.pods, figures.runs, figures.all_running_s) == (2, 3, 4.0)
    # Nearest rank, of the pooled 1, 2, 3, 4, 4, 5 and 10, 20, 30, 40 ms.
    assert (figures.pod_running_p50_s, figures.pod_running_p99_s) == (3.0, 5.0)
    assert (figures.cni_adds, figures.cni_add_p50_ms) == (4, pytest.approx(20.0))


def test_no_add_measured_is_an_error() -> None:
    failed = [CniAdd("a", "p", 1, None)]
    with pytest.raises(BenchError, match="no CNI ADD"):
        start_figures([PodStart(1.0, [1.0])], failed)


def pod(uid: str, phase: str, container: str = "running", deleting: bool = False) -> dict:
    metadata: dict[str, Any] = {"uid": uid, "name": uid}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-27T13:52:36Z"
    return {
        "metadata": metadata,
        "status": {
            "phase": phase,
            "podIP": "10.244.1.2" if phase == "Running" else "",
            "containerStatuses": [{"name": "sleep", "state": {container: {}}}],
        },
    }


def test_pod_start_times_each_pod_from_when_it_is_first_running() -> None:
    """A pod counts from the first reading that shows it Running with its containers
    running: not a Running phase over a terminated container (kubelet 1.26's new
    StatefulSet pod), not a pod being deleted."""
    readings = [
        (0.25, [pod("a", "Pending", "waiting"), pod("b", "Pending", "waiting")]),
        (0.5, [pod("a", "Running"), pod("b", "Running", "terminated")]),
        (0.75, [pod("a", "Running"), pod("b", "Running", deleting=True)]),
        (1.0, [pod("a", "Running"), pod("b", "Running")]),
        (1.25, [pod("a", "Running"), pod("b", "Running")]),
    ]
    start = pod_start(readings, 2)
    assert start == PodStart(1.0, [0.5, 1.0])
    assert pod_start(readings[:3], 2) is None
    assert pod_start(iter(readings), 1) == PodStart(0.5, [0.5])


def figures(scale: float, kept: bool, failed: int = 0) -> IpamFigures:
    return IpamFigures(
        pods=100,
        runs=2,
        all_running_s=40.0 * scale,
        pod_running_p50_s=20.0 * scale,
        pod_running_p99_s=39.0 * scale,
        cni_adds=100,
        cni_adds_failed=failed,
        cni_add_p50_ms=300.0 * scale,
        cni_add_p99_ms=900.0 * scale,
        rounds=[Round(5.0 * scale, 3.0, kept), Round(6.0 * scale, 3.0, kept)],
    )


def test_table_puts_ipward_over_host_local() -> None:
    rows = table({"host-local": figures(1.0, False), "ipward": figures(1.5, True, failed=2)})
    by_label = {r[0].strip(): r[1:] for r in rows}
    assert rows[0] == ["", "host-local", "ipward", "ipward/host-local"]
    assert by_label["100 pods at once, 2 runs: all Running p50 (s)"] == ["40.0", "60.0", "1.50x"]
    assert by_label["CNI ADD p99 (ms)"] == ["900", "1350", "1.50x"]
    assert by_label["StatefulSet 5->0->5, 2 rounds: p50 (s)"] == ["5.0", "7.5", "1.50x"]
    assert by_label["round max (s)"] == ["6.0", "9.0", "1.50x"]
    assert by_label["addresses kept (rounds)"] == ["0/2", "2/2", ""]
    assert rows[6] == ["  CNI ADDs failed (retried)", "0", "2", ""]


def test_ratios_of_the_times() -> None:
    host_local, ipward = figures(1.0, False).to_json(), figures(2.0, True).to_json()
    assert ipward["sts_addresses_kept"] == 2 and host_local["sts_addresses_kept"] == 0
    got = ratios(host_local, ipward)
    assert set(got) == {
        "all_running_s",
        "pod_running_p50_s",
        "pod_running_p99_s",
        "cni_add_p50_ms",
        "cni_add_p99_ms",
        "sts_round_p50_s",
        "sts_round_max_s",
    }
    assert all(v == pytest.approx(2.0) for v in got.values())
    host_local["cni_add_p50_ms"] = 0.0  # nothing to divide by: left out
    assert "cni_add_p50_ms" not in ratios(host_local, ipward)
