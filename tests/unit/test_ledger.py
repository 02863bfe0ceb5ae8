"""The ledger on a real SQLite store: allocation order, cooldown, blocks, requested
addresses, idempotency, precise free."""

from __future__ import annotations

import pytest

from ipward.core import keys as layout
from ipward.core import records as rec
from ipward.core.errors import (
    AddressOutsidePool,
    AddressTaken,
    InvalidConfig,
    OwnerChanged,
    PoolExhausted,
)
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from ipward.store.base import Put
from support import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def ledger(sqlite_store, clock) -> Ledger:
    return Ledger(sqlite_store, "node-a", clock=clock)


def pool(subnet="10.0.0.0/24", cooldown=30.0, **range_fields) -> PoolSpec:
    spec = PoolSpec("p", [[{"subnet": subnet, **range_fields}]], cooldown=cooldown)
    return spec


def att(i: int | str) -> Attachment:
    return Attachment("net", f"c{i}", "eth0")


def add(ledger: Ledger, spec: PoolSpec, i, requested=()) -> str:
    return ledger.allocate([spec], att(i), PodInfo("ns", f"pod{i}", f"uid{i}"), requested)[0].ip


def keys(store, prefix: str) -> list[str]:
    return [kv.key for kv in store.range(prefix)[0]]


def test_sequential_fresh_addresses_skip_network_and_gateway(ledger):
    spec = pool(gateway="10.0.0.1")
    assert [add(ledger, spec, i) for i in range(3)] == ["10.0.0.2", "10.0.0.3", "10.0.0.4"]


def test_add_is_idempotent_and_del_of_unknown_succeeds(ledger, sqlite_store):
    spec = pool()
    first = add(ledger, spec, 1)
    assert add(ledger, spec, 1) == first
    assert len(keys(sqlite_store, "ips/")) == 1
    assert ledger.free(att(99)) == []
    assert ledger.free(att(1)) == [f"p/{first}"]
    revision = sqlite_store.revision()
    assert ledger.free(att(1)) == []
    assert sqlite_store.revision() == revision  # a repeated DEL writes nothing


def test_cooldown_holds_freed_address_back_while_others_are_free(ledger, clock):
    spec = pool(cooldown=30)
    a = add(ledger, spec, 1)
    ledger.free(att(1))
    clock.now += 29
    assert add(ledger, spec, 2) != a  # still cooling, fresh addresses exist
    clock.now += 2
    assert add(ledger, spec, 3) == a  # cooled: oldest freed comes first


def test_oldest_freed_first(ledger, clock):
    spec = pool(cooldown=0)
    ips = [add(ledger, spec, i) for i in range(4)]
    for i in (2, 0, 3):
        ledger.free(att(i))
        clock.now += 1
    assert [add(ledger, spec, f"n{i}") for i in range(3)] == [ips[2], ips[0], ips[3]]


def test_an_address_freed_before_its_block_was_claimed_goes_first(ledger, clock):
    """Model-test finding: an address this node was given by request, in a block it did
    not hold yet, then freed, is queued under the node; the ADD that claims the block
    hands it out before any never-used address (the claim's fresh pick used to skip it
    as queued). While it cools, the claim takes a never-used one."""
    cooling = pool(cooldown=30)
    add(ledger, cooling, 1, requested=["10.0.0.7"])
    ledger.free(att(1))
    assert add(ledger, cooling, 2) == "10.0.0.1"  # cooling: a never-used one first
    spec = PoolSpec("q", [[{"subnet": "10.0.1.0/24"}]], cooldown=0)
    held = add(ledger, spec, 3, requested=["10.0.1.7"])
    ledger.free(att(3))
    clock.now += 1
    assert add(ledger, spec, 4) == held
    assert add(ledger, spec, 5) == "10.0.1.1"  # then the never-used ones, from the start


def test_cooling_address_is_used_when_nothing_else_is_free(ledger, clock):
    spec = pool("10.0.0.0/30", cooldown=300)  # two usable addresses
    add(ledger, spec, 1)
    b = add(ledger, spec, 2)
    ledger.free(att(2))
    assert add(ledger, spec, 3) == b
    with pytest.raises(PoolExhausted):
        add(ledger, spec, 4)


def test_exhaustion_leaves_store_unchanged(ledger, sqlite_store):
    spec = pool("10.0.0.0/30")
    add(ledger, spec, 1)
    add(ledger, spec, 2)
    revision = sqlite_store.revision()
    with pytest.raises(PoolExhausted):
        add(ledger, spec, 3)
    assert sqlite_store.revision() == revision


def test_blocks_are_claimed_in_order_as_they_fill(ledger, sqlite_store):
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], block_prefix={4: 30})
    got = [add(ledger, spec, i) for i in range(6)]
    # /30 blocks inside a /24: 10.0.0.0/30 loses .0 (network), so .1-.3, then .4-.7
    assert got == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
    assert keys(sqlite_store, "blocks/p/") == ["blocks/p/10.0.0.0/30", "blocks/p/10.0.0.4/30"]
    for kv in sqlite_store.range("blocks/p/")[0]:
        assert rec.decode(kv.value)["node"] == "node-a"


def test_requested_address_is_skipped_by_the_cursor(ledger):
    spec = pool()
    assert add(ledger, spec, "static", requested=["10.0.0.2"]) == "10.0.0.2"
    assert add(ledger, spec, 1) == "10.0.0.1"
    assert add(ledger, spec, 2) == "10.0.0.3"  # .2 is taken: the cursor skips it


def test_requested_address_errors(ledger, sqlite_store):
    spec = pool(gateway="10.0.0.1")
    add(ledger, spec, 1, requested=["10.0.0.9"])
    revision = sqlite_store.revision()
    with pytest.raises(AddressTaken):
        add(ledger, spec, 2, requested=["10.0.0.9"])
    for bad in ("10.0.1.5", "10.0.0.1", "10.0.0.0", "10.0.0.255", "fd00::1"):
        with pytest.raises(AddressOutsidePool):
            add(ledger, spec, 3, requested=[bad])
    assert sqlite_store.revision() == revision


def test_requested_address_in_cooldown_takes_it_off_the_queue(ledger, sqlite_store, clock):
    spec = pool(cooldown=30)
    a = add(ledger, spec, 1)
    ledger.free(att(1))
    assert keys(sqlite_store, "free/") == [f"free/p/{a}"]
    assert add(ledger, spec, 2, requested=[a]) == a
    assert keys(sqlite_store, "free/") == []
    assert keys(sqlite_store, "freeq/") == []
    assert check(sqlite_store)[0] == []


def test_dual_stack_gets_one_address_per_family_in_one_transaction(ledger, sqlite_store):
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}]])
    revision = sqlite_store.revision()
    got = ledger.allocate([spec], att(1), PodInfo())
    assert sorted(a.family for a in got) == [4, 6]
    # one transaction claims both blocks and writes both records, the index and the
    # pool spec
    assert sqlite_store.get(att(1).key_on("node-a")).mod_revision == sqlite_store.revision()
    assert sqlite_store.get("pools/p").mod_revision == sqlite_store.revision()
    assert sqlite_store.get("blocks/p/10.0.0.0/26").mod_revision == sqlite_store.revision()
    assert sqlite_store.revision() == revision + 1


def test_failed_dual_stack_add_writes_nothing(ledger, sqlite_store):
    """IPv4 would need a new block but IPv6 is exhausted: no block is claimed."""
    spec = PoolSpec(
        "p", [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/126"}]], block_prefix={4: 30}
    )
    for i in range(3):  # fills IPv6 (3 usable) and the first IPv4 /30 block
        ledger.allocate([spec], att(i), PodInfo())
    revision = sqlite_store.revision()
    with pytest.raises(PoolExhausted):
        ledger.allocate([spec], att(9), PodInfo())
    assert sqlite_store.revision() == revision


def test_large_pools_cost_what_small_ones_do(ledger, sqlite_store):
    """A /8 and an IPv6 /64: allocation claims one block and writes one record per
    address; nothing proportional to the range is ever written."""
    for subnet in ("10.0.0.0/8", "fd00:1::/64"):
        spec = PoolSpec("p", [[{"subnet": subnet}]])
        for i in range(70):
            add(ledger, spec, f"{subnet}-{i}")
        for i in range(70):
            ledger.free(att(f"{subnet}-{i}"))
        sqlite_store.txn([], [])
    # 2 pools' worth of blocks: 70 addresses span two /26 (or /122) blocks each
    assert len(keys(sqlite_store, "blocks/")) == 4
    assert len(keys(sqlite_store, "free/")) == 140
    assert keys(sqlite_store, "ips/") == []


def test_free_never_touches_an_address_owned_by_another_attachment(ledger, sqlite_store):
    spec = pool()
    ip = add(ledger, spec, 1)
    # Corrupt on purpose: attachment 2's index claims the address of attachment 1.
    sqlite_store.txn([], [Put(att(2).key_on("node-a"), rec.encode({"ips": [f"p/{ip}"]}))])
    assert ledger.free(att(2)) == []
    assert sqlite_store.get(layout.ip_key("p", ip)) is not None
    assert sqlite_store.get(att(2).key_on("node-a")) is None  # the stray index entry is dropped


def test_free_address_compares_revision(ledger, sqlite_store):
    spec = pool()
    ip = add(ledger, spec, 1)
    kv = sqlite_store.get(layout.ip_key("p", ip))
    with pytest.raises(OwnerChanged):
        ledger.free_address("p", ip, kv.mod_revision - 1, "test")
    assert sqlite_store.get(layout.ip_key("p", ip)) is not None
    ledger.free_address("p", ip, kv.mod_revision, "test")
    assert sqlite_store.get(layout.ip_key("p", ip)) is None
    assert sqlite_store.get(att(1).key_on("node-a")) is None
    assert check(sqlite_store)[0] == []


def test_cooldown_survives_a_restart(sqlite_url, clock):
    from ipward.store import open_store

    spec = pool("10.0.0.0/29", cooldown=30)
    with open_store(sqlite_url) as store:
        first = Ledger(store, "node-a", clock=clock)
        freed = add(first, spec, 1)
        first.free(att(1))
    clock.now += 5
    with open_store(sqlite_url) as store:
        again = Ledger(store, "node-a", clock=clock)
        assert add(again, spec, 2) != freed


class TestCheck:
    def test_clean_store_is_clean(self, ledger, sqlite_store):
        spec = pool()
        for i in range(5):
            add(ledger, spec, i)
        ledger.free(att(3))
        problems, counts = check(sqlite_store)
        assert problems == []
        assert counts["allocations"] == 4 and counts["free"] == 1

    def test_each_broken_invariant_is_reported(self, ledger, sqlite_store):
        spec = pool()
        ip1 = add(ledger, spec, 1)
        ip2 = add(ledger, spec, 2)
        ledger.free(att(2))
        other = PoolSpec("q", [[{"subnet": "10.0.0.0/24"}]])
        sqlite_store.txn([], [Put("pools/q", rec.encode(other.to_dict()))])
        record = rec.decode(sqlite_store.get(layout.ip_key("p", ip1)).value)
        sqlite_store.txn(
            [],
            [
                # same address on the same network through an overlapping pool
                Put(layout.ip_key("q", ip1), rec.encode({**record, "container": "dup"})),
                # an index pointing at nothing
                Put(att(7).key_on("node-a"), rec.encode({"ips": ["p/10.0.0.77"]})),
                # a record outside its pool
                Put(layout.ip_key("p", "192.168.1.1"), rec.encode({**record, "container": "x"})),
                # freed and allocated at once
                Put(layout.ip_key("p", ip2), rec.encode({**record, "container": "y"})),
            ],
        )
        kinds = {p.kind for p in check(sqlite_store)[0]}
        assert kinds >= {
            "duplicate-address",
            "index-dangling",
            "index-missing",
            "outside-pool",
            "free-and-allocated",
        }


class TestMemory:
    """Two ledgers on one store, as two processes of one node: each remembers what it
    read and wrote, and the other changes it behind its back."""

    @pytest.fixture
    def other(self, sqlite_url, clock):
        from ipward.store import open_store

        store = open_store(sqlite_url)
        yield Ledger(store, "node-a", clock=clock)
        store.close()

    def test_stale_memory_never_frees_another_attachments_address(self, ledger, other):
        spec = pool(cooldown=0)
        ip = add(ledger, spec, 1)
        other.free(att(1))  # behind ledger's back
        assert add(other, spec, 2, requested=[ip]) == ip
        assert ledger.free(att(1)) == []  # its memory of att 1 is stale: nothing freed
        assert other.lookup(att(2))[0].ip == ip

    def test_refusal_on_stale_memory_is_checked_again(self, ledger, other):
        spec = pool(cooldown=0)
        ip = add(ledger, spec, 1)
        other.free(att(1))
        # ledger still remembers ip as allocated; the refusal is re-checked on fresh reads
        assert add(ledger, spec, 3, requested=[ip]) == ip

    def test_interleaved_ledgers_never_hand_out_one_address_twice(
        self, ledger, other, sqlite_store
    ):
        spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], block_prefix={4: 28}, cooldown=0)
        got = []
        for i in range(120):
            who = ledger if i % 3 else other
            got.append(add(who, spec, i))
            if i % 4 == 0:
                (other if i % 3 else ledger).free(att(i - 1))
        live = {kv.key for kv in sqlite_store.range("ips/")[0]}
        assert check(sqlite_store)[0] == []
        held = [ledger.lookup(att(i)) for i in range(120)]
        owned = [a[0].ip for a in held if a]
        assert len(owned) == len(set(owned)) == len(live)

    def test_a_pool_deleted_behind_a_long_lived_ledger_is_unknown_not_busy(
        self, ledger, sqlite_store
    ):
        from ipward.core.errors import UnknownPool
        from ipward.store.base import Delete

        sqlite_store.txn([], [Put("pools/p", rec.encode(pool().to_dict()))])
        named = ledger.get_pool("p")
        ledger.allocate([named], att(1), PodInfo())
        sqlite_store.txn([], [Delete("pools/p")])  # `ipward pool delete` elsewhere
        with pytest.raises(UnknownPool):
            ledger.allocate([ledger.get_pool("p")], att(2), PodInfo())


def test_concurrent_callers_are_combined_and_get_distinct_addresses(sqlite_url, clock):
    """Threads of one process (an agent) allocating at once: every address distinct,
    fewer allocating transactions than allocations, the ledger consistent."""
    import threading

    from ipward.store import open_store

    store = open_store(sqlite_url)
    ledger = Ledger(store, "node-a", clock=clock)
    spec = pool("10.1.0.0/20", cooldown=0)
    ledger.allocate([spec], att("first"), PodInfo())  # the block is claimed up front
    commits = []
    real_txn = ledger.cache.txn

    def counting(compares, ops):
        done = real_txn(compares, ops)
        if done and any(op.key.startswith("attach/") for op in ops):
            commits.append(sum(op.key.startswith("attach/") for op in ops))
        return done

    ledger.cache.txn = counting
    got: list[str] = []
    barrier = threading.Barrier(16)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(25):
            got.append(ledger.allocate([spec], att(f"{t}-{i}"), PodInfo())[0].ip)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 400
    assert sum(commits) == 400
    assert len(commits) < 400  # some transactions carried several allocations
    assert check(store)[0] == []
    store.close()


def test_check_reports_a_block_with_two_owners_and_a_released_block_in_use(ledger, sqlite_store):
    spec = pool()
    add(ledger, spec, 1)
    assert check(sqlite_store)[0] == []
    sqlite_store.txn(
        [],
        [
            Put("affinity/p/node-b/10.0.0.0/26", b""),  # a second node lists the block
            Put("affinity/p/node-a/10.0.0.64/26", b""),  # a block that does not exist
            Put("blockfree/p/4/10.0.0.0/26", b""),  # released, but still a block
        ],
    )
    problems = [p for p in check(sqlite_store)[0] if p.kind == "block-owner"]
    assert sorted(p.key for p in problems) == [
        "affinity/p/10.0.0.64/26",
        "blockfree/p/4/10.0.0.0/26",
        "blocks/p/10.0.0.0/26",
    ]


# -- a failed ADD writes nothing; blocks with no address are never claimed ---------------


def whole_store(store) -> list[tuple]:
    return [(kv.key, kv.value, kv.mod_revision) for kv in store.range("")[0]]


def test_range_fully_excluded_is_exhausted_and_writes_nothing(ledger, sqlite_store):
    """Found: the pool was refused (100) but its blocks were claimed and cursor and
    fill keys written for a pool that was never stored."""
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], exclude=["10.0.0.0/24"])
    before = whole_store(sqlite_store)
    with pytest.raises(PoolExhausted):
        add(ledger, spec, 1)
    assert whole_store(sqlite_store) == before
    assert not sqlite_store.range("blocks/")[0]


@pytest.mark.parametrize(
    ("subnet", "excluded", "first"),
    [
        ("10.0.0.0/16", "10.0.0.0/18", "10.0.64.0"),
        ("10.0.0.0/8", "10.0.0.0/9", "10.128.0.0"),
        ("fd00::/64", "fd00::/65", "fd00::8000:0:0:0"),
    ],
)
def test_excluded_head_of_a_range_is_jumped_over_in_one_transaction(
    ledger, sqlite_store, subnet, excluded, first
):
    """Found: a /16 with a /18 excluded failed twice with 11 after claiming every
    all-excluded block, one CAS each (about 99 revisions). The first block with an
    address is found by arithmetic and claimed by the allocating transaction."""
    spec = PoolSpec("p", [[{"subnet": subnet}]], exclude=[excluded])
    revision = sqlite_store.revision()
    assert add(ledger, spec, 1) == first
    assert sqlite_store.revision() == revision + 1
    assert [kv.key for kv in sqlite_store.range("blocks/")[0]] == [
        f"blocks/p/{first}/{26 if '.' in first else 122}"
    ]
    assert check(sqlite_store)[0] == []


def test_a_block_taken_by_requested_addresses_is_claimed_on_the_way(ledger, sqlite_store):
    """The walk passes a never-claimed block whose every usable address was requested:
    it is claimed in the same transaction (so its addresses go back to a queue once
    freed) and the fresh address comes from the next block."""
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], block_prefix={4: 29}, cooldown=0)
    for i, ip in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]):
        add(ledger, spec, f"r{i}", requested=[ip])
    # requested addresses are ahead of the fresh cursor: a verifying retry finds the way
    fresh = {add(ledger, spec, i) for i in range(4)}
    assert "10.0.0.6" in fresh and not fresh & {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
    assert sqlite_store.get("blocks/p/10.0.0.0/29") is not None
    assert check(sqlite_store)[0] == []


def test_more_full_blocks_than_one_claim_takes_are_claimed_first(ledger, sqlite_store):
    """Past MAX_FULL_CLAIMS never-claimed blocks whose every address was requested, the
    walk claims those on their own (`ClaimFirst`) and the ADD goes on past them: it gets
    the first address of the next block, and every block it passed is claimed."""
    spec = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], block_prefix={4: 30}, cooldown=0)
    rs = spec.range_sets[0]
    full = [rs.block(i) for i in range(17)]  # one more than MAX_FULL_CLAIMS
    for block in full:
        for offset in range(block.size):
            if rs.usable(block.base + offset):
                add(ledger, spec, f"r{block.cidr}-{offset}", requested=[block.address(offset)])
    assert add(ledger, spec, "fresh") == rs.block(17).address(0)
    claimed = {layout.cidr_of(k) for k in keys(sqlite_store, "blocks/p/")}
    assert claimed == {b.cidr for b in full} | {rs.block(17).cidr}
    assert check(sqlite_store)[0] == []


def test_cni_gc_frees_though_its_pool_was_rewritten_since_it_was_remembered(
    ledger, sqlite_store, clock
):
    """Model-test finding (etcd, slow run): after a refused `pool delete` (the spec
    marked deleting, then put back), a CNI GC left an unlisted attachment's address: its
    compare-and-delete failed on the spec revision remembered, and was taken for the
    record's change."""
    from ipward.ipam import pools

    spec = pool(cooldown=0)
    kept, gone = add(ledger, spec, 1), add(ledger, spec, 2)
    with pytest.raises(InvalidConfig):
        pools.delete_pool(sqlite_store, "p")  # in use: refused, the spec rewritten
    clock.now += 60
    assert ledger.collect_network("net", {("c1", "eth0")}, grace=0) == [f"p/{gone}"]
    assert [kv.key for kv in sqlite_store.range("ips/")[0]] == [layout.ip_key("p", kept)]
    assert check(sqlite_store)[0] == []


def test_cni_gc_frees_only_this_nodes_attachments(sqlite_store, clock):
    """Found: CNI GC ranged the network's attachments over the whole cluster, so a
    runtime's GC on one node freed every other node's pods' addresses (its list names
    only its own)."""
    spec = pool(cooldown=0)
    here = Ledger(sqlite_store, "node-a", clock=clock)
    there = Ledger(sqlite_store, "node-b", clock=clock)
    mine, listed = add(here, spec, "gone"), add(here, spec, "kept")
    theirs = add(there, spec, "elsewhere")
    clock.now += 60
    assert here.collect_network("net", {("ckept", "eth0")}, grace=0) == [f"p/{mine}"]
    left = {kv.key for kv in sqlite_store.range("ips/")[0]}
    assert left == {layout.ip_key("p", listed), layout.ip_key("p", theirs)}
    assert check(sqlite_store)[0] == []


# -- a pool whose ranges change (an inline network's config) -----------------------------


def inline(subnet: str, **kw) -> PoolSpec:
    return PoolSpec("net", [[{"subnet": subnet}]], cooldown=0, source="cni-config", **kw)


def add_to(ledger: Ledger, spec: PoolSpec, i) -> str:
    return ledger.allocate([spec], att(i), PodInfo("ns", f"pod{i}"))[0].ip


def test_a_changed_subnet_is_a_new_version_and_old_records_stay_valid(ledger, sqlite_store):
    """Found: after ADD/DEL on 10.20.0.0/24, a config switched to 10.30.0.0/26 answered
    100 forever (the block cursor indexed the old ranges), and check marked the old
    records outside-pool."""
    old = add_to(ledger, inline("10.20.0.0/24"), "old")
    for i in range(70):  # two blocks claimed: the cursor stands at 2
        add_to(ledger, inline("10.20.0.0/24"), i)
    for i in range(70):
        ledger.free(att(i))
    assert check(sqlite_store)[0] == []
    new = add_to(ledger, inline("10.30.0.0/26"), "new")
    assert new == "10.30.0.1"
    stored = ledger.get_pool("net", fresh=True)
    assert stored.version == 1 and [r.to_dict()["ranges"] for r in stored.retired] == [
        [[{"subnet": "10.20.0.0/24", "rangeStart": "10.20.0.1", "rangeEnd": "10.20.0.254"}]]
    ]
    assert check(sqlite_store)[0] == []  # the old record is held by the retired layout
    # An idempotent ADD of the old attachment answers its address with its own prefix.
    (again,) = ledger.allocate([inline("10.30.0.0/26")], att("old"), PodInfo())
    assert (again.ip, again.prefix) == (old, 24)
    # Its DEL frees it without queueing it: the pool no longer hands it out.
    assert ledger.free(att("old")) == [f"net/{old}"]
    assert sqlite_store.get(layout.free_key("net", old)) is None
    assert check(sqlite_store)[0] == []
    # The new /26 serves its whole capacity: 62 addresses, then 100.
    got = {new} | {add_to(ledger, inline("10.30.0.0/26"), f"n{i}") for i in range(61)}
    assert len(got) == 62 and all(ip.startswith("10.30.0.") for ip in got)
    revision = sqlite_store.revision()
    with pytest.raises(PoolExhausted):
        add_to(ledger, inline("10.30.0.0/26"), "one-too-many")
    assert sqlite_store.revision() == revision
    assert check(sqlite_store)[0] == []


@pytest.mark.parametrize(
    ("changed", "fields"),
    [
        # its address is now the gateway and excluded: no longer usable in the new layout
        ("10.64.103.0/30", {"gateway": "10.64.103.2", "exclude": ["10.64.103.2/31"]}),
        # its address is usable in both layouts, under another prefix
        ("10.64.103.0/29", {}),
    ],
)
def test_a_repeated_add_answers_the_layout_its_address_was_given_under(
    ledger, sqlite_store, changed, fields
):
    """Model-test finding (etcd, slow run): after a network's ranges changed, a
    repeated ADD answered its held address with the new layout's prefix and gateway
    (10.64.103.2/30, gateway 10.64.103.2: the address itself)."""
    old = PoolSpec(
        "net",
        [[{"subnet": "10.64.103.0/28", "gateway": "10.64.103.1"}]],
        cooldown=0,
        source="cni-config",
    )
    (first,) = ledger.allocate([old], att("c0"), PodInfo())
    assert (first.ip, first.prefix, first.gateway) == ("10.64.103.2", 28, "10.64.103.1")
    spec = PoolSpec(
        "net",
        [[{"subnet": changed, "gateway": fields.get("gateway", "10.64.103.1")}]],
        cooldown=0,
        source="cni-config",
        exclude=fields.get("exclude", []),
    )
    add_to(ledger, spec, "other")  # the new layout is stored
    assert ledger.get_pool("net", fresh=True).version == 1
    (again,) = ledger.allocate([spec], att("c0"), PodInfo())
    assert (again.ip, again.prefix, again.gateway) == (first.ip, 28, first.gateway)
    (looked,) = ledger.lookup(att("c0"))  # type: ignore[misc]
    assert (looked.ip, looked.prefix, looked.gateway) == (first.ip, 28, first.gateway)
    from ipward.ipam import pools

    assert pools.prune(sqlite_store, "net")[1] == 0  # its record still names the old layout
    (kept,) = ledger.lookup(att("c0"))  # type: ignore[misc]
    assert kept.prefix == 28
    assert check(sqlite_store)[0] == []


def test_new_ranges_start_at_their_first_block(ledger, sqlite_store):
    """Found: switching to another /24 skipped its first blocks (the cursor kept the old
    index)."""
    for i in range(130):  # three /26 blocks of the first /24
        add_to(ledger, inline("10.20.0.0/24"), i)
    assert add_to(ledger, inline("10.40.0.0/24"), "x") == "10.40.0.1"
    assert check(sqlite_store)[0] == []


def test_ranges_changed_and_changed_back_lose_and_double_nothing(ledger, sqlite_store):
    """A -> B -> A with records held across both changes: every address of A is handed
    out exactly once in the end (freed ones found again though their block's cursor
    had passed them, none twice)."""
    a = [add_to(ledger, inline("10.20.0.0/26"), i) for i in range(10)]
    ledger.free(att(3))  # freed while A is current: queued
    add_to(ledger, inline("10.30.0.0/26"), "b")  # B
    ledger.free(att(4))  # freed while A is retired: not queued
    add_to(ledger, inline("10.20.0.0/26"), "again")  # A again, a third version
    assert ledger.get_pool("net", fresh=True).version == 2
    assert check(sqlite_store)[0] == []
    got = {a[i] for i in range(10) if i not in (3, 4)}
    got.add(ledger.lookup(att("again"))[0].ip)  # type: ignore[index]
    while True:
        try:
            ip = add_to(ledger, inline("10.20.0.0/26"), f"fill{len(got)}")
        except PoolExhausted:
            break
        assert ip not in got
        got.add(ip)
    assert len(got) == 62  # the whole /26, a[3] and a[4] included
    assert check(sqlite_store)[0] == []


def test_an_inline_pool_overlapping_another_is_refused_and_writes_nothing(ledger, sqlite_store):
    ledger.allocate([pool("10.0.0.0/24")], att(1), PodInfo())
    revision = sqlite_store.revision()
    with pytest.raises(
        InvalidConfig, match=r"would overlap pool p: both cover 10\.0\.0\.129-10\.0\.0\.254"
    ):
        add_to(ledger, inline("10.0.0.128/25"), 2)
    assert sqlite_store.revision() == revision
    add_to(ledger, inline("10.0.1.0/24"), 3)  # next to it: fine
    # A change of ranges is tested too: growing into p is refused.
    revision = sqlite_store.revision()
    with pytest.raises(InvalidConfig, match="would overlap pool p"):
        add_to(ledger, inline("10.0.0.0/23"), 4)
    assert sqlite_store.revision() == revision


def test_plain_adds_and_dels_never_write_the_coverage_key(ledger, sqlite_store):
    """Only a write that stores a pool or adds addresses to one serialises on
    `poolcoverage`: the hot path adds no contention."""
    add_to(ledger, inline("10.20.0.0/24"), "first")  # stores the pool
    written = sqlite_store.get(layout.POOL_COVERAGE_KEY).mod_revision
    for i in range(70):  # across a block claim
        add_to(ledger, inline("10.20.0.0/24"), i)
    for i in range(70):
        ledger.free(att(i))
    add_to(ledger, inline("10.20.0.0/24", routes=[{"dst": "0.0.0.0/0"}]), "routes")  # not ranges
    assert sqlite_store.get(layout.POOL_COVERAGE_KEY).mod_revision == written
    add_to(ledger, inline("10.20.0.0/23"), "wider")  # grows: tested and written
    assert sqlite_store.get(layout.POOL_COVERAGE_KEY).mod_revision > written


def test_a_combined_batch_writes_an_attachment_once(sqlite_store, clock, monkeypatch, tmp_path):
    """Finding (hostile pass 2): calls of one attachment queued behind another batch were
    combined into one transaction, which wrote a record for each call (the compare that
    the attachment is absent was the same for all): the attachment held four addresses
    of one pool. The combiner alone (no turns taken by the ledger) now puts one call of
    an attachment in a batch; the others find its addresses in the next."""
    import threading

    from ipward.core import testpoints
    from ipward.ipam.cache import StoreCache
    from ipward.ipam.combining import Combiner
    from ipward_lab.waiting import wait_for

    cache = StoreCache(sqlite_store, "node-a", clock)
    spec = pool()
    combiner = Combiner(cache)
    combiner.allocate([spec], att("warm"), PodInfo("ns", "warm", "u"))  # the block claimed
    monkeypatch.setitem(testpoints._GATES, "allocate", str(tmp_path))
    answers: dict[str, list[str]] = {}

    def one(attachment: Attachment) -> None:
        got = combiner.allocate([spec], attachment, PodInfo("ns", "p", "u"))
        answers.setdefault(attachment.container, []).append(got[0].ip)

    lead = threading.Thread(target=one, args=(att("lead"),))
    lead.start()
    wait_for((tmp_path / "allocate.reached").exists, "the lead's batch at its commit")
    queued = [att(f"other{i}") for i in range(2)] + [att("dup")] * 4
    threads = [threading.Thread(target=one, args=(a,)) for a in queued]
    for t in threads:
        t.start()
    waiting = combiner._waiting[(spec.name,)]
    wait_for(lambda: len(waiting) == len(queued), "every call queued behind the lead")
    (tmp_path / "allocate.open").touch()
    for t in [lead, *threads]:
        t.join()
    dup_records = [
        kv.key
        for kv in sqlite_store.range("ips/")[0]
        if rec.AddressRecord.decode(kv.value).container == "cdup"
    ]
    assert len(dup_records) == 1, dup_records
    assert len(answers["cdup"]) == 4 and len(set(answers["cdup"])) == 1, answers
    problems, _ = check(sqlite_store)
    assert not problems, problems


def test_an_inline_pool_keeps_the_borrow_it_was_stored_with(ledger, sqlite_store):
    """Borrowing became the default (issue 27, 6), which a network config does not
    declare: an inline pool stored before, not borrowing, stays so, with its layout and
    no write of its spec, so agents of both versions agree on it; a new one borrows."""
    old = inline("10.20.0.0/24", borrow=False)
    add_to(ledger, old, "before")  # as the earlier version stored it
    written = sqlite_store.get(layout.pool_key("net"))
    add_to(ledger, inline("10.20.0.0/24"), "after")  # the new default, undeclared
    kv = sqlite_store.get(layout.pool_key("net"))
    assert kv.mod_revision == written.mod_revision
    stored = PoolSpec.decode(kv.value)
    assert stored.borrow is False and stored.version == 0 and stored.retired == []
    add_to(ledger, PoolSpec("new", [[{"subnet": "10.21.0.0/24"}]], source="cni-config"), "n")
    assert PoolSpec.decode(sqlite_store.get(layout.pool_key("new")).value).borrow is True
