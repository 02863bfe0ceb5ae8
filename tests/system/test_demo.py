"""The main job, for real: Debian's `bridge` CNI plugin with `ipward` as its IPAM, pods as
network namespaces (NetLab), on the embedded SQLite store.

`ipward demo` end to end (as a subprocess, and once in-process), then the same path without
the demo: two pods by hand, and an exhausted pool whose error must come out of bridge as
ipward wrote it. Needs root and containernetworking-plugins; skipped otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ipward_lab import demo
from ipward_lab.fleet import run_cli
from ipward_lab.netlab import (
    CNI_BIN_DIR,
    NETNS_DIR,
    NetLab,
    Pod,
    bridge_network_config,
    root_namespace_state,
    skip_reason,
)
from support import exec_plugin

_REASON = skip_reason()
net = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

DEMO_SUBNET = "10.231.80.0/24"
DEMO_GATEWAY = "10.231.80.1"
SUBNET = "10.231.81.0/24"
GATEWAY = "10.231.81.1"
# A /30 holds .0 (network), .1 (gateway), .2, .3 (broadcast): exactly one pod address.
TINY_SUBNET = "10.231.82.0/30"
TINY_GATEWAY = "10.231.82.1"
TINY_ONLY_ADDRESS = "10.231.82.2/30"
POOL_EXHAUSTED = 100  # ipward.errors.PoolExhausted.code


def _ipw_namespaces() -> set[str]:
    if not os.path.isdir(NETNS_DIR):
        return set()
    return {name for name in os.listdir(NETNS_DIR) if name.startswith("ipw-")}


def _json(proc: subprocess.CompletedProcess) -> Any:
    assert proc.returncode == 0, f"rc={proc.returncode} {proc.stdout} {proc.stderr}"
    return json.loads(proc.stdout)


def _assert_store_clean(store: str, pool: str) -> None:
    """No allocation left, `ipward check` finds nothing, the pool shows 0 used."""
    assert _json(run_cli("--json", "alloc", "list", store=store)) == []
    check = run_cli("--json", "check", store=store)
    report = _json(check)
    assert report["ok"] is True and report["problems"] == [], report
    assert report["allocations"] == 0 and report["attachments"] == 0
    (row,) = [r for r in _json(run_cli("--json", "pool", "list", store=store)) if r["name"] == pool]
    assert row["used"] == 0


# -- ipward demo -----------------------------------------------------------------------


@net
@pytest.mark.net
def test_demo_end_to_end_as_a_subprocess(tmp_path: Path) -> None:
    root_before = root_namespace_state()
    ns_before = _ipw_namespaces()
    state = tmp_path / "state"

    args = ["--pods", "4", "--subnet", DEMO_SUBNET, "--state-dir", str(state)]
    proc = subprocess.run(
        [sys.executable, "-m", "ipward_lab.demo", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr}"

    for step in range(1, 7):
        assert f"Step {step}/6" in out
    assert "installed " + str(state / "cni-bin" / "ipward") in out
    assert f"cni-bin/bridge -> {CNI_BIN_DIR}/bridge" in out
    assert (
        f"created pool demo ({ipaddress.ip_network(DEMO_SUBNET).num_addresses - 3} addresses)"
        in out
    )
    assert "4 distinct addresses in 10.231.80.0/24, each on its pod's eth0" in out
    assert "16 of 16 pings answered" in out
    assert "FAIL" not in out
    assert "one record per pod" in out
    assert "ok: 4 allocations, 4 attachments" in out  # ipward check with the pods up
    assert "again (DEL is idempotent)" in out
    assert "ok  no allocation left" in out
    assert "ok: 0 allocations, 0 attachments" in out  # ipward check after teardown
    assert "demo OK: 4 pods attached, 16 pings answered, every address freed" in out

    # The addresses the demo printed for the ADDs: four distinct pod addresses of the pool.
    added = re.findall(r"^\s+pod-(\d)\s+(10\.231\.80\.\d+/24)\s+\d+ ms$", out, re.MULTILINE)
    assert sorted(int(i) for i, _ in added) == [0, 1, 2, 3]
    ips = {ipaddress.ip_interface(cidr) for _, cidr in added}
    assert len(ips) == 4
    assert all(
        i.network == ipaddress.ip_network(DEMO_SUBNET) and str(i.ip) != DEMO_GATEWAY for i in ips
    )

    # Independently of what the demo says about itself: every namespace it made is gone,
    # nothing new under ipw-, and the machine's own namespace is as it was.
    host = re.search(r"host netns (ipw-host-[0-9a-f]+) ", out)
    assert host is not None
    suffix = host.group(1).rsplit("-", 1)[1]
    pods = re.findall(r"netns (ipw-[0-9a-f]+-\d+-pod-\d+) ", out)
    assert len(pods) == 4 and all(p.startswith(f"ipw-{suffix}-") for p in pods)
    for name in (host.group(1), *pods):
        assert not os.path.exists(os.path.join(NETNS_DIR, name)), name
    assert _ipw_namespaces() == ns_before
    assert root_namespace_state() == root_before

    # The state dir was given, so it is kept: read the store and the plugin log ourselves.
    store = f"sqlite://{state}/ipward.db"
    _assert_store_clean(store, "demo")
    log = [json.loads(line) for line in (state / "ipward.log").read_text().splitlines()]
    allocated = [e for e in log if e["msg"] == "allocated"]
    freed = [e for e in log if e["msg"] == "freed"]
    assert len(allocated) == 4 and len(freed) == 4  # the second DEL freed nothing
    assert {e["ips"][0] for e in allocated} == {f"demo/{i.ip}" for i in ips}
    assert not [e for e in log if e["level"] in ("warning", "error")]


@net
@pytest.mark.net
def test_demo_in_process_ring_pings_and_temporary_state_dir_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In-process (as `ipward demo` will run under the CLI group), with a neighbour table
    too small for a full ping mesh: each pod pings the next one and the gateway."""
    monkeypatch.setattr(demo, "neighbour_limit", lambda: 16)
    ns_before = _ipw_namespaces()
    result = CliRunner().invoke(demo.demo_command, ["--pods", "3", "--subnet", DEMO_SUBNET])
    assert result.exit_code == 0, result.output
    assert "Each pod pings the next pod and the gateway" in result.output
    assert "6 of 6 pings answered" in result.output
    assert "demo OK: 3 pods attached, 6 pings answered" in result.output
    found = re.search(r"state dir\s+(\S*ipward-demo-\S+)\s+\(temporary", result.output)
    assert found is not None, result.output
    assert not os.path.exists(found.group(1))
    assert _ipw_namespaces() == ns_before


def test_demo_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ns_before = _ipw_namespaces()
    result = CliRunner().invoke(demo.demo_command, ["--pods", "2"])
    assert result.exit_code == demo.EXIT_CANNOT_RUN
    assert "ipward demo cannot run here" in result.output
    assert "needs root" in result.output
    assert "Step 1/6" not in result.output
    assert _ipw_namespaces() == ns_before


def test_demo_refuses_a_subnet_too_small_for_the_pods() -> None:
    result = CliRunner().invoke(demo.demo_command, ["--pods", "20", "--subnet", "10.0.0.0/28"])
    assert result.exit_code == 2
    assert "room for 13 pods, not 20" in result.output


# -- the same path by hand: NetLab + bridge + the installed ipward plugin ---------------


@pytest.fixture
def lab() -> Iterator[NetLab]:
    root_before = root_namespace_state()
    with NetLab() as lab:
        yield lab
    assert not os.path.exists(lab.host_netns)
    assert all(not os.path.exists(p.netns) for p in lab.pods)
    assert root_namespace_state() == root_before


def _network(lab: NetLab, store: str, pool: str, log_file: Path) -> dict[str, Any]:
    ipam = {"type": "ipward", "store": store, "pool": pool, "logFile": str(log_file)}
    return bridge_network_config("ipw-demo-test", lab.bridge, ipam)


@net
@pytest.mark.net
def test_two_pods_get_distinct_addresses_ping_and_are_freed(
    lab: NetLab, cni_bin: Path, sqlite_url: str, tmp_path: Path
) -> None:
    run_cli(
        "pool",
        "create",
        "pods",
        "--range",
        f"{SUBNET},gateway={GATEWAY}",
        store=sqlite_url,
        check=True,
    )
    conf = _network(lab, sqlite_url, "pods", tmp_path / "ipward.log")
    cni_path = [str(cni_bin), CNI_BIN_DIR]
    a = lab.add_pod("web-0", k8s_namespace="shop")
    b = lab.add_pod("web-1", k8s_namespace="shop")

    addresses: dict[str, str] = {}
    for pod in (a, b):
        out = lab.cni("ADD", pod, "eth0", conf, cni_path=cni_path).raise_for_status()
        assert out.result is not None
        (cidr,) = out.ips
        assert out.result["ips"][0]["gateway"] == GATEWAY
        assert lab.addresses(pod, "eth0") == [cidr]  # read from inside the pod
        iface = ipaddress.ip_interface(cidr)
        assert iface.network == ipaddress.ip_network(SUBNET)
        assert str(iface.ip) != GATEWAY
        addresses[pod.name] = str(iface.ip)
    assert addresses[a.name] != addresses[b.name]

    assert lab.ping(a, addresses[b.name])
    assert lab.ping(b, addresses[a.name])
    assert lab.ping(a, GATEWAY) and lab.ping(b, GATEWAY)

    rows = _json(run_cli("--json", "alloc", "list", store=sqlite_url))
    by_ip = {row["ip"]: row for row in rows}
    assert set(by_ip) == set(addresses.values())
    for pod in (a, b):
        row = by_ip[addresses[pod.name]]
        assert row["pool"] == "pods"
        assert (row["network"], row["container"], row["ifname"]) == (
            "ipw-demo-test",
            pod.container_id,
            "eth0",
        )
        assert row["pod"] == {
            "namespace": "shop",
            "name": pod.k8s_name,
            "uid": pod.k8s_uid,
            "infra_container": pod.container_id,
        }
    report = _json(run_cli("--json", "check", store=sqlite_url))
    assert report["ok"] and report["allocations"] == 2

    for pod in (a, b):
        lab.cni("DEL", pod, "eth0", conf, cni_path=cni_path).raise_for_status()
        assert lab.addresses(pod, "eth0") == []
        assert "eth0" not in lab.links(pod)
    _assert_store_clean(sqlite_url, "pods")


@net
@pytest.mark.net
def test_exhausted_pool_error_comes_out_of_bridge_verbatim_and_del_still_works(
    lab: NetLab, cni_bin: Path, sqlite_url: str, tmp_path: Path
) -> None:
    run_cli(
        "pool", "create", "tiny", "--range", f"{TINY_SUBNET},gateway={TINY_GATEWAY}",
        store=sqlite_url, check=True,
    )  # fmt: skip
    (tiny,) = _json(run_cli("--json", "pool", "list", store=sqlite_url))
    assert tiny["capacity"] == 1
    conf = _network(lab, sqlite_url, "tiny", tmp_path / "ipward.log")
    cni_path = [str(cni_bin), CNI_BIN_DIR]
    first: Pod = lab.add_pod("first")
    second: Pod = lab.add_pod("second")

    ok = lab.cni("ADD", first, "eth0", conf, cni_path=cni_path).raise_for_status()
    assert ok.ips == [TINY_ONLY_ADDRESS]
    assert lab.addresses(first) == [TINY_ONLY_ADDRESS]

    failed = lab.cni("ADD", second, "eth0", conf, cni_path=cni_path)
    assert failed.returncode != 0, failed.describe()
    assert failed.error is not None, failed.describe()
    assert failed.error["code"] == POOL_EXHAUSTED, failed.describe()
    assert "tiny" in failed.error["msg"]

    # The same call made to the plugin itself, without bridge: the error is the same one.
    direct = exec_plugin(
        cni_bin / "ipward",
        "ADD",
        conf,
        container=second.container_id,
        netns=second.netns,
        args=second.cni_args(),
    )
    assert direct.returncode != 0 and direct.json is not None
    assert direct.json["code"] == POOL_EXHAUSTED
    for field in ("code", "msg", "details"):
        assert failed.error.get(field) == direct.json.get(field), (failed.error, direct.json)

    # DEL after a failed ADD succeeds, removes what bridge left, and frees nothing else.
    lab.cni("DEL", second, "eth0", conf, cni_path=cni_path).raise_for_status()
    assert "eth0" not in lab.links(second)
    assert len([link for link in lab.links() if link.startswith("veth")]) == 1  # first's
    (row,) = _json(run_cli("--json", "alloc", "list", store=sqlite_url))
    assert (row["ip"], row["container"]) == (TINY_ONLY_ADDRESS.split("/")[0], first.container_id)
    assert _json(run_cli("--json", "check", store=sqlite_url))["ok"]
    assert lab.ping(first, TINY_GATEWAY)

    lab.cni("DEL", first, "eth0", conf, cni_path=cni_path).raise_for_status()
    _assert_store_clean(sqlite_url, "tiny")
