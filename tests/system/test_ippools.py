"""Pools as Kubernetes objects (docs/design.md 5.16), on a real kube-apiserver of this
module's own (an IPPool is cluster-scoped: the session's API server holds other tests'
ledgers, whose pools are not objects). Objects are created through the API as `kubectl
apply` creates them (strict field validation); real `ipward controller` and `ipward
agent` processes on the `k8s://` store in `ipward-system`, the plugin exec'd as a runtime
does. Each test leaves no object and no ledger behind. Waits poll the API, the store and
the logs with a deadline; nothing asserts how long anything took."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from ipward.controller.pool_objects import STATUS_INTERVAL
from ipward.core import ippool, keys
from ipward.core import records as rec
from ipward.core.ippool import PoolObject
from ipward.core.pool import PoolSpec
from ipward.kubeapi.client import ApiClient, ApiError
from ipward.kubeapi.config import from_kubeconfig
from ipward.store import open_store
from ipward.store.kube import DEFAULT_NAMESPACE
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers import kube_apiserver, kube_store
from ipward_lab.waiting import wait_for
from support import Gate, exec_plugin

TTL = 2
CONTROLLER = ("--interval", "0.2", "--lease-ttl", str(TTL))
TAKEOVER = 4 * TTL + 30  # bound on a successor's first pass (process start included)
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
LEDGER = f"/apis/{ippool.GROUP}/{ippool.VERSION}/namespaces/{DEFAULT_NAMESPACE}/ledgershards"


# -- the module's API server, and a clean store for each test --------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    executable = kube_apiserver.binary()
    if executable is None:
        pytest.skip("KUBE_APISERVER does not name a kube-apiserver binary")
    with kube_apiserver.kube_apiserver(executable, tmp_path_factory.mktemp("ippools")) as lab:
        kube_store.install(lab.kubeconfig, DEFAULT_NAMESPACE)
        yield lab


@pytest.fixture(scope="module")
def admin(api: Any) -> Iterator[ApiClient]:
    client = ApiClient(from_kubeconfig(str(api.kubeconfig)))
    yield client
    client.close()


@pytest.fixture
def url(api: Any, admin: ApiClient) -> Iterator[str]:
    """The `k8s://` store in `ipward-system` (its pools are objects); afterwards every
    IPPool is let go and deleted, and every ledger object too."""
    yield kube_store.store_url(api.kubeconfig, DEFAULT_NAMESPACE)
    for name in objects(admin):
        try:
            admin.request("PATCH", ippool.path(name), body={"metadata": {"finalizers": []}})
            admin.request("DELETE", ippool.path(name))
        except ApiError as e:
            if not e.not_found:
                raise
    admin.request("DELETE", LEDGER)
    wait_for(
        lambda: not objects(admin) and not admin.request("GET", LEDGER)["items"], "a clean API"
    )


class Processes:
    """The test's agents and controllers, all stopped (killed) at its end."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))  # AF_UNIX paths are short
        self.started: list[fleet.Process] = []

    def controller(self, ident: str, env: dict[str, str] | None = None) -> fleet.Controller:
        ctl = fleet.Controller(ident, self.url, self.tmp, CONTROLLER, env)
        self.started.append(ctl)
        ctl.wait_started()
        return ctl

    def agent(self, node: str) -> fleet.Agent:
        agent = fleet.Agent(node, self.url, self.run_dir / f"{node}.sock", self.tmp)
        self.started.append(agent)
        return agent.wait_ready()

    def close(self) -> None:
        for process in self.started:
            process.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture
def procs(url: str, tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(url, tmp_path)
    yield processes
    processes.close()


# -- helpers -------------------------------------------------------------------------------


def objects(admin: ApiClient) -> list[str]:
    return [item["metadata"]["name"] for item in admin.request("GET", ippool.PATH)["items"]]


def apply(admin: ApiClient, name: str, spec: dict) -> dict:
    """Create an IPPool as `kubectl apply -f` does (fields checked strictly)."""
    body = {"apiVersion": ippool.API_VERSION, "kind": ippool.KIND, "metadata": {"name": name}}
    return admin.request(
        "POST", ippool.PATH, {"fieldValidation": "Strict"}, body={**body, "spec": spec}
    )


def change(admin: ApiClient, name: str, spec: dict) -> None:
    """A changed spec, as `kubectl apply -f` of an edited file sends it (a merge patch)."""
    admin.request("PATCH", ippool.path(name), body={"spec": spec})


def get(admin: ApiClient, name: str) -> PoolObject | None:
    try:
        return ippool.parse(admin.request("GET", ippool.path(name)))[1]
    except ApiError as e:
        if e.not_found:
            return None
        raise


def condition(admin: ApiClient, name: str, kind: str, status: str = "") -> dict:
    """The object's condition `kind` once the controller judged its current generation
    (and, given `status`, once it says that)."""

    def judged() -> dict | None:
        obj = get(admin, name)
        found = ippool.condition(obj, kind) if obj is not None else None
        if found is None or obj is None or found.get("observedGeneration") != obj.generation:
            return None
        return found if status in ("", found.get("status")) else None

    found: dict = wait_for(judged, f"{name}'s {kind} condition for its generation {status}")
    return found


def ledger_spec(url: str, name: str) -> dict | None:
    with open_store(url) as store:
        kv = store.get(keys.pool_key(name))
    return rec.decode(kv.value) if kv is not None else None


def config(agent: fleet.Agent, pool: str) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "podnet",
        "ipam": {"type": "ipward", "pool": pool, "agentSocket": str(agent.socket)},
    }


def add(plugin: Path, agent: fleet.Agent, pool: str, pod: str) -> Any:
    args = f"K8S_POD_NAMESPACE=shop;K8S_POD_NAME={pod}"
    return exec_plugin(plugin, "ADD", config(agent, pool), container=pod, args=args)


def delete(plugin: Path, agent: fleet.Agent, pool: str, pod: str) -> Any:
    return exec_plugin(plugin, "DEL", config(agent, pool), container=pod)


def cli_json(*args: str, url: str) -> Any:
    done = run_cli("--json", *args, store=url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check_clean(url: str) -> None:
    done = run_cli("check", store=url)
    assert done.returncode == 0, done.stdout + done.stderr


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.kstore
def test_an_applied_pool_is_allocated_from_and_its_status_counts_at_a_bounded_rate(
    admin: ApiClient, procs: Processes, plugin: Path
) -> None:
    """An IPPool applied becomes a ledger pool; ADDs through a real agent allocate from
    it; its status (what `kubectl get` prints: name, ranges, used, capacity, age) counts
    them, written at most once every STATUS_INTERVAL seconds, never per ADD."""
    apply(admin, "web", {"ranges": [{"subnet": "10.30.0.0/24"}], "warm": 4})
    ctl = procs.controller("c1")
    condition(admin, "web", ippool.READY, "True")
    stored = ledger_spec(procs.url, "web")
    assert stored is not None and stored["source"] == "ippool" and stored["warm"] == 4
    obj = get(admin, "web")
    assert obj is not None and obj.held  # the finalizer, put on by the controller
    agent = procs.agent("n1")
    adds = [add(plugin, agent, "web", f"web-{i}") for i in range(8)]
    assert all(a.returncode == 0 for a in adds), adds
    assert {a.json["ips"][0]["address"].rsplit(".", 1)[0] for a in adds} == {"10.30.0"}

    def counted() -> PoolObject | None:
        found = get(admin, "web")
        return found if found is not None and found.status.get("used") == len(adds) else None

    status = wait_for(counted, "the status to count every ADD").status
    assert status["capacity"] == "253" and status["ranges"] == "10.30.0.0/24"
    assert status["ipv4"]["used"] == len(adds) and status["ipv4"]["blocks"] >= 1
    written = [e["ts"] for e in ctl.logged("pool object status written") if e["pool"] == "web"]
    gaps = [later - earlier for earlier, later in pairwise(written)]
    assert gaps and all(gap >= STATUS_INTERVAL - 0.05 for gap in gaps), gaps  # the log's clock

    table = admin.request("GET", ippool.PATH, accept=TABLE)  # what `kubectl get` prints
    columns = [c["name"] for c in table["columnDefinitions"] if not c.get("priority")]
    assert columns == ["Name", "Ranges", "Used", "Capacity", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:4] == ["web", "10.30.0.0/24", len(adds), "253"]


@pytest.mark.kstore
def test_invalid_specs_are_refused_naming_the_field(admin: ApiClient, procs: Processes) -> None:
    """What the schema can see is refused by the API, the message naming the field;
    what it cannot (a gateway outside its subnet, a block size for a family the pool
    lacks) the controller refuses in the status, naming it the same way. Nothing reaches
    the ledger."""
    mistakes = {
        "spec.ranges[0].subnet": {"ranges": [{"subnet": "10.0.0.0/33"}]},
        "spec.ranges[0].gateway": {"ranges": [{"subnet": "10.0.0.0/24", "gateway": "10.0.0"}]},
        "spec.ranges": {"ranges": []},
        "spec.warm": {"ranges": [{"subnet": "10.0.0.0/24"}], "warm": -1},
        "spec.blockSize.ipv4": {"ranges": [{"subnet": "10.0.0.0/24"}], "blockSize": {"ipv4": 40}},
        "spec.cooldownSeconds": {"ranges": [{"subnet": "10.0.0.0/24"}], "cooldownSeconds": "1m"},
        "spec.namespaces[0]": {"ranges": [{"subnet": "10.0.0.0/24"}], "namespaces": ["Shop_1"]},
        "spec.exclude[0]": {"ranges": [{"subnet": "10.0.0.0/24"}], "exclude": ["ten"]},
        "spec.colour": {"ranges": [{"subnet": "10.0.0.0/24"}], "colour": "red"},
        "spec.routes[0].dst": {
            "ranges": [{"subnet": "10.0.0.0/24"}],
            "routes": [{"gw": "10.0.0.1"}],
        },
    }
    for field, spec in mistakes.items():
        with pytest.raises(ApiError) as refused:
            apply(admin, "bad", spec)
        assert refused.value.status in (400, 422) and field in refused.value.message, field
    assert objects(admin) == []

    apply(admin, "outside", {"ranges": [{"subnet": "10.1.0.0/24", "gateway": "10.2.0.1"}]})
    apply(admin, "v6size", {"ranges": [{"subnet": "10.3.0.0/24"}], "blockSize": {"ipv6": 120}})
    procs.controller("c1")
    for name, field in (("outside", "spec.ranges[0]: gateway"), ("v6size", "spec.blockSize.ipv6")):
        ready = condition(admin, name, ippool.READY)
        assert ready["status"] == "False" and ready["reason"] == ippool.INVALID, ready
        assert ready["message"].startswith(field), ready
        assert ledger_spec(procs.url, name) is None


@pytest.mark.kstore
def test_an_overlapping_pool_allocates_nothing_and_names_the_other(
    admin: ApiClient, procs: Processes, plugin: Path
) -> None:
    """Overlap spans objects, so no schema sees it: the second pool's Overlaps condition
    names the first, it is not in the ledger and an ADD from it is 103 (unknown pool). A
    change that would overlap is refused the same way, the pool serving its earlier
    spec; a change that does not is applied as the ledger takes changed ranges (a new
    layout version)."""
    apply(admin, "first", {"ranges": [{"subnet": "10.40.0.0/24"}]})
    procs.controller("c1")
    condition(admin, "first", ippool.READY, "True")
    apply(admin, "second", {"ranges": [{"subnet": "10.40.0.128/25"}]})
    overlaps = condition(admin, "second", ippool.OVERLAPS)
    assert overlaps["status"] == "True" and "pool first" in overlaps["message"], overlaps
    assert condition(admin, "second", ippool.READY)["reason"] == ippool.OVERLAPS
    assert ledger_spec(procs.url, "second") is None
    agent = procs.agent("n1")
    refused = add(plugin, agent, "second", "pod-0")
    assert refused.returncode != 0 and refused.json["code"] == 103, refused
    assert cli_json("alloc", "list", url=procs.url) == []

    change(admin, "first", {"ranges": [{"subnet": "10.40.0.0/25"}], "warm": 2})  # now beside it
    condition(admin, "second", ippool.READY, "True")
    assert ledger_spec(procs.url, "second") is not None
    first = ledger_spec(procs.url, "first")
    assert first is not None and first["version"] == 1 and first["warm"] == 2
    assert first["ranges"][0][0]["subnet"] == "10.40.0.0/25"

    change(admin, "first", {"ranges": [{"subnet": "10.40.0.0/24"}]})  # back over second
    ready = condition(admin, "first", ippool.READY, "False")
    assert ready["reason"] == ippool.OVERLAPS and "pool second" in ready["message"], ready
    assert "keeps serving generation 2's spec" in ready["message"], ready
    assert ledger_spec(procs.url, "first")["ranges"][0][0]["subnet"] == "10.40.0.0/25"  # type: ignore[index]
    check_clean(procs.url)


@pytest.mark.kstore
def test_deleting_a_pool_that_holds_addresses_waits_for_them(
    admin: ApiClient, procs: Processes, plugin: Path
) -> None:
    """The finalizer holds the object while records hold addresses; its status says how
    many and which; the pool is marked deleting in the ledger (ADDs get 103); after the
    DELs the ledger pool goes, then the object."""
    apply(admin, "web", {"ranges": [{"subnet": "10.50.0.0/24"}]})
    procs.controller("c1")
    condition(admin, "web", ippool.READY, "True")
    agent = procs.agent("n1")
    held = [add(plugin, agent, "web", f"web-{i}") for i in range(2)]
    assert all(a.returncode == 0 for a in held), held
    admin.request("DELETE", ippool.path("web"))

    def waiting() -> dict | None:
        obj = get(admin, "web")
        return (obj.status.get("deletion") or None) if obj is not None else None

    deletion = wait_for(waiting, "the status to say what holds the pool")
    assert deletion["addresses"] == 2, deletion
    assert any(h.startswith("shop/web-0 eth0 on n1: 10.50.0.") for h in deletion["heldBy"]), (
        deletion
    )
    ready = condition(admin, "web", ippool.READY, "False")
    assert ready["reason"] == ippool.DELETING and "2 addresses" in ready["message"], ready
    assert (ledger_spec(procs.url, "web") or {}).get("state") == "deleting"
    late = add(plugin, agent, "web", "web-late")
    assert late.returncode != 0 and late.json["code"] == 103, late

    assert all(delete(plugin, agent, "web", f"web-{i}").returncode == 0 for i in range(2))
    wait_for(lambda: get(admin, "web") is None, "the object gone once its addresses are freed")
    assert ledger_spec(procs.url, "web") is None
    check_clean(procs.url)


@pytest.mark.kstore
def test_the_cli_round_trips_through_the_objects(
    admin: ApiClient, procs: Processes, plugin: Path, api: Any
) -> None:
    """`ipward pool create` makes the object and its pool at once (no controller
    running); `list` and `show` read the objects; an overlapping `create` leaves
    nothing; `delete` deletes the object and waits for nothing when no address is held,
    and says what holds it when some are. A store in another namespace keeps its pools
    in its ledger."""
    made = run_cli(
        "pool", "create", "web", "--range", "10.60.0.0/24", "--warm", "3", store=procs.url
    )
    assert made.returncode == 0, made.stderr
    obj = get(admin, "web")
    assert obj is not None and obj.held
    assert obj.spec == {"ranges": [{"subnet": "10.60.0.0/24"}], "warm": 3}
    stored = ledger_spec(procs.url, "web")
    assert stored is not None
    assert PoolSpec.from_dict(stored).declaration() == ippool.declared(obj).declaration()

    overlapping = run_cli("pool", "create", "wide", "--range", "10.60.0.0/16", store=procs.url)
    assert overlapping.returncode == 2 and "pool web" in overlapping.stderr, overlapping
    assert objects(admin) == ["web"] and ledger_spec(procs.url, "wide") is None
    bad = run_cli("pool", "create", "Web_2", "--range", "10.61.0.0/24", store=procs.url)
    assert bad.returncode == 2 and "metadata.name" in bad.stderr, bad  # the API's own words
    assert ledger_spec(procs.url, "Web_2") is None

    procs.controller("c1")
    condition(admin, "web", ippool.READY, "True")
    (row,) = cli_json("pool", "list", url=procs.url)
    assert row["name"] == "web" and row["object"]["reason"] == ippool.APPLIED, row
    shown = cli_json("pool", "show", "web", url=procs.url)
    assert shown["object"]["ready"] is True and shown["capacity"] == 253

    agent = procs.agent("n1")
    assert add(plugin, agent, "web", "web-0").returncode == 0
    deleting = cli_json("pool", "delete", "web", url=procs.url)
    assert deleting["addresses"] == 1 and deleting["heldBy"][0].startswith("shop/web-0"), deleting
    assert delete(plugin, agent, "web", "web-0").returncode == 0
    wait_for(lambda: get(admin, "web") is None, "the controller to finish the delete")

    assert (
        run_cli("pool", "create", "db", "--range", "10.62.0.0/24", store=procs.url).returncode == 0
    )
    assert cli_json("pool", "delete", "db", url=procs.url) == {"deleted": "db"}
    assert objects(admin) == [] and ledger_spec(procs.url, "db") is None

    elsewhere = kube_store.store_url(api.kubeconfig, "ledger-elsewhere")
    kube_store.install(api.kubeconfig, "ledger-elsewhere")
    assert (
        run_cli("pool", "create", "own", "--range", "10.63.0.0/24", store=elsewhere).returncode == 0
    )
    assert objects(admin) == [] and ledger_spec(elsewhere, "own") is not None
    (row,) = cli_json("pool", "list", url=elsewhere)
    assert "object" not in row
    admin.request("DELETE", LEDGER.replace(DEFAULT_NAMESPACE, "ledger-elsewhere"))


def test_on_sqlite_the_cli_makes_pools_in_the_ledger(sqlite_url: str) -> None:
    """On SQLite (as on etcd) nothing changes: the ledger only, no object column."""
    made = run_cli("pool", "create", "web", "--range", "10.64.0.0/24", store=sqlite_url)
    assert made.returncode == 0, made.stderr
    (row,) = cli_json("pool", "list", url=sqlite_url)
    assert row["source"] == "cli" and "object" not in row
    assert "object" not in cli_json("pool", "show", "web", url=sqlite_url)
    assert cli_json("pool", "delete", "web", url=sqlite_url)["deleted"] == "web"


KILLED_AT = {
    "pool-create": "between its overlap test and the transaction storing the pool",
    "pool-delete": "between the check that no record holds the pool and removing its keys",
    "pool-object-release": "between removing the pool from the ledger and the object's release",
}


@pytest.mark.kstore
@pytest.mark.parametrize("point", sorted(KILLED_AT))
def test_a_successor_finishes_what_a_killed_controller_left(
    admin: ApiClient, procs: Processes, tmp_path: Path, point: str
) -> None:
    """The leader SIGKILLed mid-reconcile (held at a test point, see KILLED_AT); its
    successor takes over and leaves nothing half done: the pool in the ledger once and
    Ready, or the pool and its object gone; `ipward check` clean."""
    gate = Gate(tmp_path, point)
    creating = point == "pool-create"
    if not creating:
        made = run_cli("pool", "create", "web", "--range", "10.70.0.0/24", store=procs.url)
        assert made.returncode == 0, made.stderr
    first = procs.controller("c1", env=gate.env)
    if creating:
        apply(admin, "web", {"ranges": [{"subnet": "10.70.0.0/24"}]})
    else:
        admin.request("DELETE", ippool.path("web"))
    gate.wait_reached()
    first.kill()
    procs.controller("c2")
    if creating:
        condition(admin, "web", ippool.READY, "True")
        assert ledger_spec(procs.url, "web") is not None
    else:
        wait_for(lambda: get(admin, "web") is None, "the object gone", TAKEOVER)
        assert ledger_spec(procs.url, "web") is None
    check_clean(procs.url)


@pytest.mark.kstore
def test_an_object_a_network_configs_pool_has_the_name_of_is_refused(
    admin: ApiClient, procs: Processes, plugin: Path
) -> None:
    """A pool a network config declares (inline ranges) is the config's: an IPPool of
    its name is refused, and deleting that object leaves the config's pool alone."""
    agent = procs.agent("n1")
    inline = {
        "cniVersion": "1.0.0",
        "name": "podnet",
        "ipam": {
            "type": "ipward",
            "ranges": [[{"subnet": "10.80.0.0/24"}]],
            "agentSocket": str(agent.socket),
        },
    }
    assert exec_plugin(plugin, "ADD", inline, container="c0").returncode == 0
    apply(admin, "podnet", {"ranges": [{"subnet": "10.80.0.0/24"}]})
    procs.controller("c1")
    ready = condition(admin, "podnet", ippool.READY)
    assert ready["reason"] == ippool.REFUSED and "network config" in ready["message"], ready
    admin.request("DELETE", ippool.path("podnet"))
    wait_for(lambda: get(admin, "podnet") is None, "the refused object gone")
    assert (ledger_spec(procs.url, "podnet") or {}).get("source") == "cni-config"
    check_clean(procs.url)
