"""`ipward sim --api real`: the soak on the real kube-apiserver (when KUBE_APISERVER names
it), and the lab that starts it. Apart from tests/system/test_kube_sim.py so the two long soaks
through `k8s://` can run on two test workers at once."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ipward_lab.servers import kube_apiserver
from ipward_lab.servers.etcd import free_port
from ipward_lab.soak import Options, Soak


@pytest.mark.skipif(
    kube_apiserver.binary() is None, reason="KUBE_APISERVER names no kube-apiserver"
)
def test_soak_through_the_real_kube_apiserver(tmp_path: Path) -> None:
    """A short soak on the real kube-apiserver (its own: `api-down` restarts it), with
    the faults it can make: no address on two ready pods, no live address lost,
    `ipward check` clean, convergence, an empty pool after teardown (which needs the
    k8s:// source to keep its quiet resources current: the real server sends them no
    bookmark, see test_a_quiet_resource_stays_current_on_the_real_server)."""
    faults = ("kill-agent", "kill-leader", "drop-del", "delay-del", "api-down")
    options = Options(nodes=2, pods=12, duration=40, seed=5, faults=faults, api="real", settle=60)
    s = Soak(options, tmp_path)
    result = s.run(live=False)
    assert not result.violations, result.violations
    assert {kind for _, kind, _ in result.faults} == set(faults)


@pytest.mark.skipif(
    kube_apiserver.binary() is None, reason="KUBE_APISERVER names no kube-apiserver"
)
def test_the_kube_apiserver_lab_takes_another_port_when_its_first_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found flaky in CI: a port free when chosen was taken (by a test's etcd, also
    choosing at random) before the server bound it, and the fixture failed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = taken.getsockname()[1]
        ports = iter([first])
        monkeypatch.setattr(
            "ipward_lab.servers.kube_apiserver.free_port", lambda: next(ports, None) or free_port()
        )
        executable = kube_apiserver.binary()
        assert executable is not None
        with kube_apiserver.kube_apiserver(executable, tmp_path) as lab:
            assert lab.port != first and lab.ready()
            assert "address already in use" in lab.log_path.read_text()
