"""The namespace harness, exercised with Debian's bridge + host-local (independent of ipward).

Needs root and containernetworking-plugins; skipped otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward_lab.netlab import (
    BRIDGE_PLUGIN,
    CNI_BIN_DIR,
    NETNS_DIR,
    NetLab,
    NetLabError,
    Pod,
    bridge_network_config,
    host_local_ipam,
    root_namespace_state,
    skip_reason,
)

HOST_LOCAL = f"{CNI_BIN_DIR}/host-local"
SUBNET = "10.231.7.0/24"
GATEWAY = "10.231.7.1"


def _net_skip_reason() -> str | None:
    reason = skip_reason()
    if reason is None and not os.access(HOST_LOCAL, os.X_OK):
        reason = f"CNI host-local plugin not found at {HOST_LOCAL}"
    return reason


_REASON = _net_skip_reason()
net = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _namespaces() -> set[str]:
    return set(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else set()


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab() as lab:
        yield lab


def _config(lab: NetLab, data_dir: Path, **ipam_extra: object) -> dict[str, object]:
    return bridge_network_config(
        "ipw-test", lab.bridge, host_local_ipam(SUBNET, data_dir, **ipam_extra)
    )


# -- no root needed --------------------------------------------------------------------


def test_bridge_network_config_shape() -> None:
    ipam = {"type": "ipward", "pool": "p1"}
    conf = bridge_network_config("n1", "br-x", ipam, mtu=1400)
    assert conf == {
        "cniVersion": "1.0.0",
        "name": "n1",
        "type": "bridge",
        "bridge": "br-x",
        "isGateway": True,
        "ipMasq": False,
        "ipam": {"type": "ipward", "pool": "p1"},
        "mtu": 1400,
    }
    conf["ipam"]["pool"] = "changed"
    assert ipam["pool"] == "p1"  # deep-copied
    with pytest.raises(ValueError):
        bridge_network_config("n1", "x" * 16, ipam)


def test_pod_cni_args_like_containerd() -> None:
    pod = Pod("ns", "/var/run/netns/ns", "c0ffee", "kube-system", "web-0", "uid-1")
    assert pod.cni_args() == (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=web-0;"
        "K8S_POD_UID=uid-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee"
    )


# -- real namespaces -------------------------------------------------------------------


@net
@pytest.mark.net
def test_two_pods_add_ping_del_and_cleanup(tmp_path: Path) -> None:
    root_before = root_namespace_state()
    ns_before = _namespaces()
    data_dir = tmp_path / "host-local"
    subnet = ipaddress.ip_network(SUBNET)

    with NetLab() as lab:
        assert lab.host.startswith("ipw-host-")
        assert len(lab.bridge) <= 15
        a, b = lab.add_pod("a"), lab.add_pod("b")
        assert a.netns == f"{NETNS_DIR}/{a.name}" and os.path.exists(a.netns)
        assert a.container_id != b.container_id and len(a.container_id) == 64
        assert a.k8s_uid != b.k8s_uid and a.k8s_name == "a"
        assert lab.host_sysctl("net/ipv4/ip_forward") == "0"  # fresh namespace
        conf = _config(lab, data_dir)

        outcomes = {p.name: lab.cni("ADD", p, "eth0", conf) for p in (a, b)}
        for pod, out in zip((a, b), outcomes.values(), strict=True):
            out.raise_for_status()
            assert out.result is not None and out.result["cniVersion"] == "1.0.0"
            assert out.result["ips"][0]["gateway"] == GATEWAY
            (cidr,) = out.ips
            assert ipaddress.ip_interface(cidr).network == subnet
            assert lab.addresses(pod) == [cidr]
            sandboxes = [i for i in out.result["interfaces"] if i.get("sandbox")]
            assert sandboxes == [{"name": "eth0", "mac": sandboxes[0]["mac"], "sandbox": pod.netns}]
        addr_a, addr_b = lab.addresses(a)[0], lab.addresses(b)[0]
        assert addr_a != addr_b

        # Everything the bridge plugin configured lives in the host namespace only.
        assert lab.host_sysctl("net/ipv4/ip_forward") == "1"
        assert root_namespace_state() == root_before
        host_links = lab.links()
        assert lab.bridge in host_links
        assert sum(name.startswith("veth") for name in host_links) == 2
        # `ip netns exec` remounts /sys: sysfs shows the host namespace's devices.
        sys_net = lab.host_exec("ls", "/sys/class/net").stdout.split()
        assert lab.bridge in sys_net
        assert lab.bridge not in os.listdir("/sys/class/net")
        bridge_addrs = lab.host_exec("ip", "-j", "-4", "addr", "show", "dev", lab.bridge).stdout
        assert f'"local":"{GATEWAY}"' in bridge_addrs.replace(" ", "")

        assert lab.ping(a, addr_b)
        assert lab.ping(b, addr_a)
        assert lab.ping(a, GATEWAY)
        assert not lab.ping(a, "10.231.7.250", wait=1)  # nobody there

        # A second ADD of the same attachment is host-local's business; DEL both.
        for pod in (a, b):
            lab.cni("DEL", pod, "eth0", conf).raise_for_status()
            assert lab.addresses(pod) == []
            assert "eth0" not in lab.links(pod)
        # After DEL no veth is left in the host namespace; the bridge (with its gateway
        # address) stays until the namespace goes.
        assert sorted(lab.links()) == sorted(["lo", lab.bridge])
        leftovers = [p.name for p in (data_dir / "ipw-test").iterdir()]
        assert not [n for n in leftovers if n[0].isdigit()], leftovers  # reservation files
        # DEL is idempotent, also once the pod's namespace is gone.
        lab.cni("DEL", a, "eth0", conf).raise_for_status()
        lab.remove_pod(a)
        assert not os.path.exists(a.netns)
        lab.cni("DEL", a, "eth0", conf).raise_for_status()
        names = {lab.host, a.name, b.name}

    assert not names & _namespaces()
    assert not [n for n in _namespaces() - ns_before if lab.suffix in n]
    assert root_namespace_state() == root_before
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == root_before["ip_forward"]
    lab.close()  # idempotent


@net
@pytest.mark.net
def test_close_deletes_namespaces_after_a_failure(tmp_path: Path) -> None:
    root_before = root_namespace_state()
    created: set[str] = set()
    with pytest.raises(RuntimeError, match="boom"), NetLab() as lab:
        pod = lab.add_pod("x")
        created = {lab.host, pod.name}
        lab.cni("ADD", pod, "eth0", _config(lab, tmp_path)).raise_for_status()
        assert created <= _namespaces()
        raise RuntimeError("boom")
    assert not created & _namespaces()
    assert root_namespace_state() == root_before
    lab.close()
    with pytest.raises(NetLabError, match="closed"):
        lab.add_pod("late")


@net
@pytest.mark.net
def test_labs_are_independent(lab: NetLab) -> None:
    with NetLab() as other:
        assert other.host != lab.host and other.bridge != lab.bridge
        p1, p2 = lab.add_pod("same"), other.add_pod("same")
        assert p1.name != p2.name
        # The same k8s pod name again in one lab: a new sandbox, a new namespace.
        p3 = lab.add_pod("same", k8s_uid=p1.k8s_uid)
        assert p3.name != p1.name and p3.container_id != p1.container_id
        assert p3.k8s_uid == p1.k8s_uid
    assert not {other.host, p2.name} & _namespaces()
    assert {lab.host, p1.name, p3.name} <= _namespaces()
    with pytest.raises(ValueError):
        lab.add_pod("bad/name")


@net
@pytest.mark.net
def test_ipam_error_comes_back_through_bridge(lab: NetLab, tmp_path: Path) -> None:
    pod = lab.add_pod("e")
    conf = _config(lab, tmp_path)
    # host-local rejects K8S_* args unless IgnoreUnknown=1 is among them.
    bad_args = pod.cni_args().removeprefix("IgnoreUnknown=1;")
    out = lab.cni("ADD", pod, "eth0", conf, bad_args)
    assert not out.ok
    assert out.error is not None and isinstance(out.error.get("code"), int)
    assert "K8S_POD_NAMESPACE" in out.error.get("msg", "") + out.error.get("details", "")
    assert out.ips == []
    with pytest.raises(NetLabError):
        out.raise_for_status()
    # DEL works after a failed ADD, and clears what the failed ADD left.
    lab.cni("DEL", pod, "eth0", conf).raise_for_status()
    assert "eth0" not in lab.links(pod)
    assert not [n for n in lab.links() if n.startswith("veth")]


@net
@pytest.mark.net
def test_bridge_refuses_cni_1_1_0(lab: NetLab, tmp_path: Path) -> None:
    pod = lab.add_pod("v")
    conf = _config(lab, tmp_path)
    conf["cniVersion"] = "1.1.0"
    out = lab.cni("ADD", pod, "eth0", conf)
    assert out.returncode != 0
    assert out.error is not None and out.error["code"] == 1


@net
@pytest.mark.net
def test_cni_env_is_exactly_the_cni_variables(lab: NetLab, tmp_path: Path) -> None:
    pod = lab.add_pod("env")
    out = lab.cni(
        "ADD", pod, "net1", _config(lab, tmp_path), cni_path=["/nonexistent", CNI_BIN_DIR]
    )
    out.raise_for_status()
    assert out.env == {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": pod.container_id,
        "CNI_NETNS": pod.netns,
        "CNI_IFNAME": "net1",
        "CNI_PATH": f"/nonexistent:{CNI_BIN_DIR}",
        "CNI_ARGS": pod.cni_args(),
        # and the plugin's notes where the run keeps them (tests/conftest.py), passed on
        "IPWARD_CNI_NOTES": os.environ["IPWARD_CNI_NOTES"],
    }
    assert lab.addresses(pod, "net1") == out.ips
    assert lab.addresses(pod, "eth0") == []
    assert lab.bridge_plugin == BRIDGE_PLUGIN
