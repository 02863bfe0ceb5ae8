"""The Kubernetes store's parts that are pure (docs/design.md 5.15): which object a key
is in (`core/shards.py`) and what one object holds, encoded and decoded
(`store/kube/content.py`). The store itself, on the real kube-apiserver:
`tests/system/test_store_conformance.py`, `test_kube_store_windows.py`."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipward.core import keys, shards
from ipward.core.records import Attachment
from ipward.store.kube.content import (
    COMPRESS_OVER,
    DEFLATED,
    THIS_UPDATE,
    Commit,
    Lock,
    Shard,
    ShardDecodeError,
    Write,
    decode,
    encode,
)

NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def test_what_a_node_writes_at_an_add_is_its_own_object_and_its_block() -> None:
    """The ADD of an attachment in a /26 block of its node: two objects, whatever pool,
    family or address; the pool's spec and cursor elsewhere."""
    add = [
        Attachment("net", "c1", "eth0").key_on("n1"),
        keys.node_ip_key("n1", "p", "10.0.0.5"),
        keys.fill_key("p", 4, "n1"),
        keys.queue_key("p", 4, "n1", 12.5, "10.0.0.9"),
        keys.affinity_key("p", "n1", "10.0.0.0/26"),
        keys.ip_key("p", "10.0.0.5"),
        keys.free_key("p", "10.0.0.9"),
        keys.block_key("p", "10.0.0.0/26"),
    ]
    assert {shards.shard_of(k) for k in add} == {"node:n1", "addr:p:10.0.0.0"}
    assert shards.shard_of(keys.ip_key("p", "fd00::7f")) == "addr:p:fd00::40"
    assert shards.shard_of(keys.pool_key("p")) == shards.shard_of(keys.block_cursor_key("p", 6))
    assert shards.shard_of(keys.released_block_key("p", 4, "10.7.3.64/26")) == (
        "released:p:4:10.7.0.0"
    )
    assert shards.kind_of(shards.shard_of(keys.node_key("n1"))) == shards.LEASE
    assert shards.shard_of("/t/x/a") == "other:/t/x"


def test_replicas_and_holders_are_where_their_keys_say() -> None:
    replica = shards.replica_key(keys.pool_key("p"), "node:n1")
    assert shards.shard_of(replica) == "node:n1" and shards.internal(replica)
    holders = shards.holders_key(keys.pool_key("p"))
    assert shards.shard_of(holders) == shards.shard_of(keys.pool_key("p"))
    assert shards.replicated(keys.pool_key("p")) and not shards.replicated(keys.ip_key("p", "1"))


@pytest.mark.parametrize(
    ("prefix", "ids", "kinds"),
    [
        (keys.node_ips_prefix("n1"), ("node:n1",), ()),
        (keys.attachments_prefix("n1"), ("node:n1",), ()),
        (keys.queue_prefix("p", 4, "n1"), ("node:n1",), ()),
        (keys.affinity_prefix("p", "n1"), ("node:n1",), ()),
        (keys.fills_prefix("p"), (), (shards.NODE,)),
        (keys.ips_prefix("p"), (), (shards.ADDR,)),
        (keys.released_block_prefix("p", 4), (), (shards.RELEASED,)),
        (keys.POOLS, (), (shards.POOL,)),
        (keys.NODES, (), (shards.LEASE,)),
        ("", (), shards.KINDS),
        ("i", (), shards.KINDS),  # a first part cut short: any prefix
        ("/t/x/", (), (shards.OTHER,)),
    ],
)
def test_a_prefix_names_the_objects_its_keys_can_be_in(
    prefix: str, ids: tuple[str, ...], kinds: tuple[str, ...]
) -> None:
    scope = shards.scope_of(prefix)
    assert (scope.ids, scope.kinds) == (ids, kinds)


@given(st.sampled_from(list(keys.PREFIXES)), st.text(min_size=1, max_size=30))
def test_every_key_is_in_a_shard_its_prefix_scope_covers(prefix: str, rest: str) -> None:
    """Whatever range reads a key's prefix finds the key's object: by id, or by a kind
    and labels the object carries."""
    key = _key(prefix, rest)
    shard_id = shards.shard_of(key)
    for cut in range(len(key) + 1):
        scope = shards.scope_of(key[:cut])
        if scope.ids:
            assert shard_id in scope.ids, (key, cut)
        else:
            labels = shards.labels_of(shard_id)
            assert labels["ipward.io/kind"] in scope.kinds, (key, cut)
            assert all(labels.get(k) == v for k, v in scope.labels.items()), (key, cut)


def _key(prefix: str, rest: str) -> str:
    """A well-formed key of `prefix`, its names from `rest` (no '/')."""
    name = "".join(c for c in rest if c.isalnum()) or "x"
    return {
        keys.META: keys.SCHEMA_KEY,
        keys.POOLS: keys.pool_key(name),
        keys.BLOCKS: keys.block_key(name, "10.1.2.64/26"),
        keys.AFFINITY: keys.affinity_key(name, name, "10.1.2.64/26"),
        keys.FILL: keys.fill_key(name, 4, name),
        keys.BLOCK_CURSOR: keys.block_cursor_key(name, 6),
        keys.RELEASED_BLOCKS: keys.released_block_key(name, 6, "fd00::40/122"),
        keys.ADDRESSES: keys.ip_key(name, "10.1.2.3"),
        keys.NODE_ADDRESSES: keys.node_ip_key(name, name, "fd00::3"),
        keys.ATTACHMENTS: keys.attach_key(name, name, name, "eth0"),
        keys.FREE: keys.free_key(name, "10.1.2.3"),
        keys.FREE_QUEUES: keys.queue_key(name, 4, name, 1.0, "10.1.2.3"),
        keys.STICKY: keys.sticky_key(name, name, name),
        keys.NODES: keys.node_key(name),
        keys.CONTROLLER: keys.LEADER_KEY,
    }[prefix]


@given(st.text(min_size=1, max_size=300))
def test_an_object_name_is_a_kubernetes_name(text: str) -> None:
    name = shards.object_name(shards.shard(shards.NODE, text))
    assert len(name) <= 253 and NAME.match(name), name


def test_names_of_shards_that_differ_differ() -> None:
    ids = [shards.shard(shards.NODE, n) for n in ("a", "A", "a_", "a-", "a.b")]
    assert len({shards.object_name(i) for i in ids}) == len(ids)


def _shard() -> Shard:
    shard = Shard("node:n1", 10)
    shard.put("k/committed", b"v", 0, rev=7)
    shard.put("k/new", b"\xff binary", 3)
    shard.locks["t1"] = Lock(
        "addr:p:10.0.0.0",
        99.5,
        {"k/locked": Write(b"w"), "k/gone": Write(None), "~r": Write(b"c", 0, (3, 4, 2))},
        ["k/read"],
    )
    shard.commits["t2"] = Commit(THIS_UPDATE, ["addr:p:10.0.0.0"], 12.0)
    shard.aborted["t3"] = 11.0
    shard.leases[42] = [10, 3]
    shard.last = "t2"
    return shard


def test_a_shard_reads_back_as_written_at_the_revision_of_its_update() -> None:
    """What an update writes carries "this update" and reads back as the object's new
    resourceVersion; what it did not write keeps its revisions."""
    data = encode(_shard(), committing={"t2"})
    back = decode("node:n1", 20, data)
    assert (back.entries["k/committed"].mod, back.entries["k/committed"].create) == (7, 7)
    new = back.entries["k/new"]
    assert (new.value, new.create, new.mod, new.version, new.lease) == (
        b"\xff binary",
        20,
        20,
        1,
        3,
    )
    lock = back.locks["t1"]
    assert lock.primary == "addr:p:10.0.0.0" and lock.expires == 99.5 and lock.reads == ["k/read"]
    assert lock.writes["k/gone"].value is None and lock.writes["~r"].copy == (3, 4, 2)
    assert back.commits["t2"].rev == 20 and back.aborted == {"t3": 11.0}
    assert back.leases == {42: [10, 3]} and back.last == "t2"


def test_a_large_shard_is_stored_deflated_and_reads_back() -> None:
    shard = Shard("addr:p:10.0.0.0", 5)
    for i in range(64):
        shard.put(f"ips/p/10.0.0.{i}", b'{"attachment": "net/c/eth0"}' * 8, 0)
    data = encode(shard)
    assert data.startswith(DEFLATED) and len(data) < 64 * 8 * 28
    back = decode(shard.id, 6, data)
    assert len(back.entries) == 64 and back.entries["ips/p/10.0.0.3"].mod == 6
    small = encode(Shard("node:n1", 1))
    assert len(small) <= COMPRESS_OVER and not small.startswith(DEFLATED)


@pytest.mark.parametrize(
    "data",
    [
        "not json",
        "[]",
        '{"format": 2}',
        '{"format": 1, "keys": {"k": ["v", -1, 1, 1, 0]}}',
        '{"format": 1, "keys": {"k": [5, 1, 1, 1, 0]}}',
        '{"format": 1, "locks": {"t": {"primary": "p"}}}',
        DEFLATED + "!!!",
        DEFLATED + "eJwLycgsVgCi4pKizLx0AD4TBws=",  # deflated, but not JSON
    ],
    ids=[
        "not-json",
        "a-list",
        "other-format",
        "negative-revision",
        "value-not-text",
        "lock-without-writes",
        "not-base64",
        "deflated-not-json",
    ],
)
def test_data_that_is_not_a_shard_is_refused_never_read_as_empty(data: str) -> None:
    with pytest.raises(ShardDecodeError):
        decode("node:n1", 3, data)
