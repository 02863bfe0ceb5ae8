"""Pools as IPPool objects (docs/design.md 5.16), the parts on their own: the object's
spec as a pool (every mistake named by its field), the object `ipward pool create`
makes and its way back, the status (equal when nothing changed, so it is not written
again), and the ledger's steps the reconciliation takes (`ipam.pools`: a changed spec
stored, a deletion that waits for its records, the fence) on an SQLite store."""

from __future__ import annotations

import pytest

from ipward.core import ippool
from ipward.core.errors import InvalidConfig, PoolsOverlap, TryAgainLater
from ipward.core.ippool import PoolObject, Usage, Verdict
from ipward.core.pool import IPPOOL, PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam import pools
from ipward.ipam.ledger import Ledger
from ipward.store.base import VALUE, Compare, Put

NOW = "2026-12-07T03:00:00Z"
LATER = "2026-12-07T03:05:00Z"


def obj(spec: dict, name: str = "p", generation: int = 1, status: dict | None = None) -> PoolObject:
    meta = {"name": name, "resourceVersion": "7", "generation": generation}
    return ippool.parse({"metadata": meta, "spec": spec, "status": status or {}})[1]


# -- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"ranges": [{"subnet": "10.0.0.0/24", "gateway": "10.1.0.1"}]}, "spec.ranges[0]: gateway"),
        ({"ranges": [{"subnet": "10.0.0.0/24"}, {"subnet": "10.9.0.0/33"}]}, "spec.ranges[1]"),
        ({"ranges": [{"subnet": "10.0.0.0/4"}]}, "spec.ranges[0]: subnet 10.0.0.0/4 is wider"),
        ({"ranges": [{"subnet": "10.0.0.0/24"}, {"subnet": "10.0.0.0/25"}]}, "spec.ranges: ranges"),
        (
            {"ranges": [{"subnet": "10.0.0.0/24"}], "blockSize": {"ipv6": 120}},
            "spec.blockSize.ipv6",
        ),
        ({"ranges": [{"subnet": "10.0.0.0/24"}], "exclude": ["ten"]}, "spec.exclude[0]"),
        ({"ranges": [{"subnet": "10.0.0.0/24"}], "cooldownSeconds": -1}, "spec.cooldownSeconds"),
        ({"ranges": [{"subnet": "10.0.0.0/24"}], "warm": 1.5}, "spec.warm"),
        ({"ranges": [{"subnet": "10.0.0.0/24"}], "borrow": "yes"}, "spec.borrow"),
        (
            {"ranges": [{"subnet": "10.0.0.0/24"}], "routes": [{"dst": "::/0", "gw": "10.0.0.1"}]},
            "spec.routes[0]",
        ),
        ({"ranges": []}, "spec.ranges"),
    ],
)
def test_a_mistake_the_schema_cannot_see_is_named_by_its_field(spec: dict, field: str) -> None:
    with pytest.raises(InvalidConfig) as refused:
        ippool.declared(obj(spec))
    assert refused.value.msg.startswith(field), refused.value.msg


def test_an_objects_defaults_are_the_clis() -> None:
    """Omitted fields mean what `ipward pool create` without its options means: the
    subnet's first address is the gateway, `none` hands it out too."""
    spec = ippool.declared(
        obj({"ranges": [{"subnet": "10.0.0.0/24"}, {"subnet": "fd00::/120", "gateway": "none"}]})
    )
    cli = PoolSpec(
        "p",
        [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}], [{"subnet": "fd00::/120"}]],
        source=IPPOOL,
    )
    assert spec.declaration() == cli.declaration()


@pytest.mark.parametrize(
    "declared",
    [
        PoolSpec("p", [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}]]),
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]]),  # gateway=none
        PoolSpec("p", [[{"subnet": "10.0.0.0/31"}]]),  # no address to spare for one
        PoolSpec(
            "p",
            [
                [{"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.10", "rangeEnd": "10.0.0.99"}],
                [{"subnet": "fd00::/64", "gateway": "fd00::1"}],
            ],
            ["10.0.0.50", "10.0.0.64/28"],
            [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
            cooldown=5,
            block_prefix={4: 28, 6: 120},
            warm=3,
            release_delay=60,
            borrow=True,
            namespaces=["shop"],
            nodes=["n1", "n2"],
        ),
    ],
)
def test_the_object_the_cli_makes_declares_its_pool_again(declared: PoolSpec) -> None:
    made = ippool.manifest(declared)
    assert made["metadata"]["finalizers"] == [ippool.FINALIZER]
    again = ippool.declared(obj(made["spec"]))
    assert again.declaration() == {**declared.declaration(), "source": IPPOOL}


def test_the_object_the_cli_makes_says_only_what_differs_from_the_defaults() -> None:
    made = ippool.manifest(PoolSpec("p", [[{"subnet": "10.0.0.0/24", "gateway": "10.0.0.1"}]]))
    assert made["spec"] == {"ranges": [{"subnet": "10.0.0.0/24"}]}


# -- the status ------------------------------------------------------------------------------


def served(subnet: str = "10.0.0.0/29") -> PoolSpec:
    return PoolSpec("p", [[{"subnet": subnet}]], source=IPPOOL)


APPLIED = Verdict(ippool.APPLIED, "held")


def test_a_status_nothing_changed_is_equal_to_the_one_written() -> None:
    """What decides that it is not written again: the conditions keep their times."""
    use = {4: Usage(2, 6, 1)}
    first = ippool.status(obj({}), APPLIED, served(), use, None, NOW)
    again = ippool.status(obj({}, status=first), APPLIED, served(), use, None, LATER)
    assert again == first
    assert first["used"] == 2 and first["capacity"] == "6" and first["appliedGeneration"] == 1
    assert first["ipv4"] == {"used": 2, "capacity": "6", "blocks": 1}


def test_a_condition_that_changes_takes_the_new_time_and_the_others_keep_theirs() -> None:
    first = ippool.status(obj({}), APPLIED, served(), {4: Usage(2, 6, 1)}, None, NOW)
    full = ippool.status(obj({}, status=first), APPLIED, served(), {4: Usage(6, 6, 1)}, None, LATER)
    times = {c["type"]: (c["status"], c["lastTransitionTime"]) for c in full["conditions"]}
    assert times == {
        ippool.READY: ("True", NOW),
        ippool.OVERLAPS: ("False", NOW),
        ippool.EXHAUSTED: ("True", LATER),
    }


def test_a_refused_change_says_which_generation_the_pool_keeps_serving() -> None:
    before = ippool.status(obj({}), APPLIED, served(), {}, None, NOW)
    overlap = Verdict(ippool.OVERLAPS, "pool p would overlap pool q: both cover 10.0.0.1")
    later = obj({}, generation=2, status=before)
    status = ippool.status(later, overlap, served(), {}, None, LATER)
    ready = ippool.condition(obj({}, status=status), ippool.READY)
    assert ready is not None and ready["status"] == "False" and ready["reason"] == ippool.OVERLAPS
    assert ready["message"].endswith("; the pool keeps serving generation 1's spec")
    assert status["appliedGeneration"] == 1 and status["observedGeneration"] == 2
    overlaps = ippool.condition(obj({}, status=status), ippool.OVERLAPS)
    assert overlaps is not None and "pool q" in overlaps["message"]


def test_usage_counts_records_by_the_family_of_their_block() -> None:
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/120"}]])
    use = ippool.usage(spec, {"10.0.0.0/26": 3, "fd00::/122": 2}, ["10.0.0.0/26", "fd00::/122"])
    assert use == {4: Usage(3, 254, 1), 6: Usage(2, 255, 1)}


# -- the ledger's steps ------------------------------------------------------------------------


def test_a_changed_declaration_is_stored_as_changed_ranges_are(sqlite_store) -> None:
    """Other fields in place; another layout as a new version, the old one retired;
    refused (nothing written) when the new layout would overlap another pool."""
    pools.create_pool(sqlite_store, PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], source=IPPOOL))
    pools.create_pool(sqlite_store, PoolSpec("q", [[{"subnet": "10.1.0.0/24"}]], source=IPPOOL))
    warmer = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], warm=9, source=IPPOOL)
    assert pools.change_pool(sqlite_store, warmer)
    assert not pools.change_pool(sqlite_store, warmer)  # held already: nothing written
    stored = PoolSpec.decode(sqlite_store.get("pools/p").value)
    assert stored.warm == 9 and stored.version == 0 and not stored.retired
    wider = PoolSpec("p", [[{"subnet": "10.0.0.0/23"}]], source=IPPOOL)
    assert pools.change_pool(sqlite_store, wider)
    stored = PoolSpec.decode(sqlite_store.get("pools/p").value)
    assert stored.version == 1 and [r.to_dict()["ranges"] for r in stored.retired] == [
        [[{"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.1", "rangeEnd": "10.0.0.254"}]]
    ]
    revision = sqlite_store.get("pools/p").mod_revision
    with pytest.raises(PoolsOverlap) as refused:
        pools.change_pool(sqlite_store, PoolSpec("p", [[{"subnet": "10.0.0.0/15"}]], source=IPPOOL))
    assert refused.value.other == "q"
    assert sqlite_store.get("pools/p").mod_revision == revision


def test_a_deletion_waits_for_the_records_keeping_the_pool_marked(sqlite_store) -> None:
    """`delete_when_free`: marked deleting (ADDs refused) while records hold addresses,
    which it returns; the pool removed with every key of it once none does."""
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], source=IPPOOL)
    pools.create_pool(sqlite_store, spec)
    ledger = Ledger(sqlite_store, "n1")
    ledger.allocate([ledger.get_pool("p")], Attachment("net", "c1", "eth0"), PodInfo("ns", "a"))
    held = pools.delete_when_free(sqlite_store, "p")
    assert [kv.key for kv in held] == ["ips/p/10.0.0.1"]
    assert PoolSpec.decode(sqlite_store.get("pools/p").value).deleting
    assert pools.delete_when_free(sqlite_store, "p") == held  # still marked, still held
    ledger.free(Attachment("net", "c1", "eth0"))
    assert pools.delete_when_free(sqlite_store, "p") == []
    assert {kv.key.split("/")[0] for kv in sqlite_store.range("")[0]} == {"meta"}


def test_a_fenced_step_writes_nothing_once_the_fence_fails(sqlite_store) -> None:
    sqlite_store.txn([], [Put("controller/leader", b"us")])
    fence = [Compare("controller/leader", VALUE, "==", b"us")]
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], source=IPPOOL)
    sqlite_store.txn([], [Put("controller/leader", b"another")])
    with pytest.raises(TryAgainLater):
        pools.create_pool(sqlite_store, spec, fence)
    assert sqlite_store.get("pools/p") is None
    pools.create_pool(sqlite_store, spec)
    with pytest.raises(TryAgainLater):
        pools.delete_when_free(sqlite_store, "p", fence)
    assert not PoolSpec.decode(sqlite_store.get("pools/p").value).deleting
