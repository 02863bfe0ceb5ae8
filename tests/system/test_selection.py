"""Pool selection and sticky identities at ADD, through the real plugin and a real
agent reading the published cluster state (`--cluster sim://...`): each rule of the
order (requested address, pod annotation, namespace annotation, config), pool
restrictions by namespace and node, and what an unreadable cluster does."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipward.cluster.liveness import Pod
from ipward.core import keys
from ipward.core import records as rec
from ipward.store import open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.simcluster import write_sim_state
from ipward_lab.waiting import wait_for
from support import PluginResult, exec_plugin

NODE = "n1"


class Cluster:
    """The published cluster state the agent reads, and the agent."""

    def __init__(self, tmp: Path, url: str, plugin: Path) -> None:
        self.url = url
        self.plugin = plugin
        self.state = tmp / "cluster.json"
        self.pods: list[Pod] = []
        self.namespaces: dict[str, dict[str, str]] = {}
        self.fail: str | None = None
        self.publish()
        self.run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
        self.agent = fleet.Agent(
            NODE,
            url,
            self.run_dir / "agent.sock",
            tmp,
            ("--cluster", f"sim://{self.state}"),
            metrics=False,
        ).wait_ready()
        # The agent registers its node (a write) on its own thread: done before a test
        # compares store revisions.
        with open_store(url) as store:
            wait_for(lambda: store.get(keys.node_key(NODE)), "the agent's node registration")

    def publish(self) -> None:
        cluster = (
            {"fail": self.fail}
            if self.fail
            else {
                "pods": self.pods,
                "nodes": [NODE],
                "statefulsets": {"db/db": 3},
                "namespaces": self.namespaces,
            }
        )
        write_sim_state(str(self.state), time.time(), cluster, {NODE: {"sandboxes": []}})

    def pod(self, namespace: str, name: str, **kw: object) -> Pod:
        pod = Pod(
            uid=f"uid-{namespace}-{name}", namespace=namespace, name=name, phase="Pending", **kw
        )  # type: ignore[arg-type]
        self.pods.append(pod)
        self.publish()
        return pod

    def add(self, pod: Pod, config: dict | None = None, ip: str = "") -> PluginResult:
        args = (
            f"IgnoreUnknown=1;K8S_POD_NAMESPACE={pod.namespace};K8S_POD_NAME={pod.name}"
            f";K8S_POD_UID={pod.uid};K8S_POD_INFRA_CONTAINER_ID=sb-{pod.name}"
        )
        if ip:
            args += f";IP={ip}"
        return exec_plugin(
            self.plugin, "ADD", config or self.config(), container=f"sb-{pod.name}", args=args
        )

    def config(self, **ipam: object) -> dict:
        section = {"type": "ipward", "pool": "blue", "agentSocket": str(self.agent.socket)}
        section.update(ipam)
        return {"cniVersion": "1.0.0", "name": "net", "ipam": section}

    def revision(self) -> int:
        with open_store(self.url) as store:
            return store.revision()

    def close(self) -> None:
        self.agent.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path, plugin: Path, sqlite_url: str) -> Iterator[Cluster]:
    for name, cidr, extra in (
        ("blue", "10.1.0.0/24", ()),
        ("green", "10.2.0.0/24", ()),
        ("v6", "fd00:6::/64", ()),
        ("prod-only", "10.3.0.0/24", ("--namespace", "prod")),
        ("other-node", "10.4.0.0/24", ("--node", "n7")),
    ):
        run_cli("pool", "create", name, "--range", cidr, *extra, store=sqlite_url, check=True)
    c = Cluster(tmp_path, sqlite_url, plugin)
    try:
        yield c
    finally:
        c.close()


def address(res: PluginResult) -> list[str]:
    assert res.returncode == 0, res
    assert res.json is not None
    return [entry["address"].split("/")[0] for entry in res.json["ips"]]


def test_the_config_pool_when_nothing_else_says(cluster: Cluster) -> None:
    (ip,) = address(cluster.add(cluster.pod("web", "a")))
    assert ip.startswith("10.1.0.")


def test_pod_annotation_then_namespace_annotation(cluster: Cluster) -> None:
    cluster.namespaces["team"] = {"ipward.io/pool": "green"}
    (from_namespace,) = address(cluster.add(cluster.pod("team", "a")))
    assert from_namespace.startswith("10.2.0.")
    pod = cluster.pod("team", "b", annotations={"ipward.io/pool": "blue"})
    (from_pod,) = address(cluster.add(pod))
    assert from_pod.startswith("10.1.0.")


def test_annotation_lists_one_pool_per_family(cluster: Cluster) -> None:
    pod = cluster.pod("web", "dual", annotations={"ipward.io/pool": "green, v6"})
    v4, v6 = address(cluster.add(pod))
    assert v4.startswith("10.2.0.") and v6.startswith("fd00:6::")


def test_annotation_naming_an_invalid_pool_name_is_invalid_config(cluster: Cluster) -> None:
    """Finding (issue 21, 7): a name no pool can have in `ipward.io/pool` answered 103
    (unknown pool); the README's tables say a bad pool name is 7. The message names the
    annotation, whose it is, and the name; nothing is written. A valid name of no pool
    stays 103."""
    pod = cluster.pod("web", "bad", annotations={"ipward.io/pool": "green,no/such pool"})
    cluster.namespaces["odd"] = {"ipward.io/pool": "x" * 254}
    spaced = cluster.pod("odd", "long")
    before = cluster.revision()
    for res, whose, name in (
        (cluster.add(pod), "pod web/bad", "'no/such pool'"),
        (cluster.add(spaced), "namespace odd", "longer than 253"),
    ):
        assert res.returncode != 0 and res.json["code"] == 7, res
        assert "ipward.io/pool" in res.json["msg"] and whose in res.json["msg"], res
        assert name in res.json["msg"], res
    assert cluster.revision() == before
    unknown = cluster.pod("web", "unknown", annotations={"ipward.io/pool": "no-such-pool"})
    res = cluster.add(unknown)
    assert res.returncode != 0 and res.json["code"] == 103, res


@pytest.mark.parametrize(
    ("value", "code", "words"),
    [
        ("no-such-pool", 103, ["no-such-pool"]),
        ("green,green", 7, ["green", "twice"]),
        ("green,blue", 7, ["green", "blue", "IPv4"]),
        ("prod-only", 105, ["prod-only"]),
        ("", 7, ["names no pool"]),
        (" , ", 7, ["names no pool"]),
    ],
    ids=["unknown", "doubled", "two-of-one-family", "not-allowed", "empty", "only-commas"],
)
def test_an_annotation_refused_names_the_annotation_and_the_pod(
    cluster: Cluster, value: str, code: int, words: list[str]
) -> None:
    """Found on a real cluster: an unknown or doubled pool in `ipward.io/pool` was
    reported without the annotation or the pod, and an empty one fell back to the
    network's pool without a word. Of the pod's annotation and of its namespace's."""
    cluster.namespaces["annotated"] = {"ipward.io/pool": value}
    cases = (
        (cluster.pod("web", "p", annotations={"ipward.io/pool": value}), "of pod web/p"),
        (cluster.pod("annotated", "q"), "of namespace annotated (for pod annotated/q)"),
    )
    before = cluster.revision()
    for pod, whose in cases:
        res = cluster.add(pod)
        assert res.returncode != 0 and res.json["code"] == code, res
        assert f"annotation ipward.io/pool {whose}" in res.json["msg"], res
        for word in words:
            assert word in res.json["msg"], res
    assert cluster.revision() == before


def test_an_annotation_pool_on_a_gateway_bridge_is_refused(cluster: Cluster) -> None:
    """Finding (a real cluster): a pool chosen by `ipward.io/pool` on a `bridge` network
    with `isGateway` can never work: the bridge holds one IPv4 gateway (its network's
    pool's) and refuses the other pool's, so every such pod stayed ContainerCreating.
    Refused at selection now (7, naming the annotation, the pools and the way out),
    nothing written; the network's own pool by annotation, or on a bridge without a
    gateway, is served."""
    gateway = {**cluster.config(), "type": "bridge", "isDefaultGateway": True}
    plain = {**cluster.config(), "type": "bridge"}
    green = cluster.pod("web", "green", annotations={"ipward.io/pool": "green"})
    before = cluster.revision()
    res = cluster.add(green, gateway)
    assert res.returncode != 0 and res.json["code"] == 7, res
    for words in ("annotation ipward.io/pool of pod web/green", "pool green", "pool blue"):
        assert words in res.json["msg"], res
    assert cluster.revision() == before
    assert address(cluster.add(green, plain))[0].startswith("10.2.0.")
    own = cluster.pod("web", "blue", annotations={"ipward.io/pool": "blue"})
    assert address(cluster.add(own, gateway))


def test_requested_address_picks_the_pool_holding_it(cluster: Cluster) -> None:
    (ip,) = address(cluster.add(cluster.pod("web", "static"), ip="10.2.0.77"))
    assert ip == "10.2.0.77"
    before = cluster.revision()
    res = cluster.add(cluster.pod("web", "nowhere"), ip="192.168.9.9")
    assert res.returncode != 0 and res.json["code"] == 102, res
    assert "192.168.9.9" in res.json["msg"]
    assert cluster.revision() == before


@pytest.mark.parametrize(
    ("pool", "namespace", "names"),
    [("prod-only", "dev", "namespaces prod"), ("other-node", "prod", "nodes n7")],
)
def test_a_pool_refuses_other_namespaces_and_nodes(
    cluster: Cluster, pool: str, namespace: str, names: str
) -> None:
    pod = cluster.pod(namespace, "x", annotations={"ipward.io/pool": pool})
    before = cluster.revision()
    res = cluster.add(pod)
    assert res.returncode != 0 and res.json["code"] == 105, res
    assert pool in res.json["msg"] and names in res.json["msg"]
    assert cluster.revision() == before


def test_restricted_pool_serves_its_namespace(cluster: Cluster) -> None:
    pod = cluster.pod("prod", "api", annotations={"ipward.io/pool": "prod-only"})
    (ip,) = address(cluster.add(pod))
    assert ip.startswith("10.3.0.")


def test_unreadable_cluster_or_unknown_pod_is_try_again(cluster: Cluster) -> None:
    ghost = Pod(uid="never-published", namespace="web", name="ghost", phase="Pending")
    before = cluster.revision()
    res = cluster.add(ghost)
    assert res.json["code"] == 11 and "not listed" in res.json["msg"], res
    known = cluster.pod("web", "known")
    cluster.fail = "apiserver: 503"
    cluster.publish()
    res = cluster.add(known)
    assert res.json["code"] == 11 and "503" in res.json["msg"], res
    assert cluster.revision() == before
    cluster.fail = None
    cluster.publish()
    assert address(cluster.add(known))


@pytest.mark.parametrize(
    ("kw", "config", "owner", "ttl"),
    [
        ({"owner_kind": "StatefulSet", "owner_name": "db"}, {}, "StatefulSet", None),
        ({"annotations": {"ipward.io/sticky": "true"}}, {}, "", 600),
        ({}, {"sticky": True, "stickyTTL": 90}, "", 90),
    ],
    ids=["statefulset", "annotation", "config"],
)
def test_sticky_when_statefulset_annotation_or_config(
    cluster: Cluster, kw: dict, config: dict, owner: str, ttl: float | None
) -> None:
    pod = cluster.pod("db", "db-0", **kw)
    (ip,) = address(cluster.add(pod, cluster.config(**config)))
    with open_store(cluster.url) as store:
        kv = store.get(keys.sticky_key("net", "db", "db-0"))
        assert kv is not None
        held = rec.decode(kv.value)
    assert held["ips"] == [f"blue/{ip}"] and held["owner_kind"] == owner and held["ttl"] == ttl
    assert run_cli("check", store=cluster.url).returncode == 0


def test_not_sticky_otherwise(cluster: Cluster) -> None:
    address(cluster.add(cluster.pod("web", "plain")))
    with open_store(cluster.url) as store:
        assert store.range("sticky/")[0] == []
