"""`ipward sim --api real`: the soak on the real kube-apiserver (when KUBE_APISERVER names
it). Apart from tests/test_kube_sim.py so the two long soaks through `k8s://` can run on
two test workers at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipward_lab import kubelab
from ipward_lab.sim import Options, Soak


@pytest.mark.skipif(kubelab.binary() is None, reason="KUBE_APISERVER names no kube-apiserver")
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
