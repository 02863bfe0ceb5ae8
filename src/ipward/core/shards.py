"""Which object of the Kubernetes store a key is in (docs/design.md 5.15): a pure
function of the key, chosen so that what one transaction writes is in few objects and
what one node writes is in its own.

    node:<node>                      its attach/, nodeips/, fill/, freeq/, affinity/ keys
    addr:<pool>:<base>               ips/ and free/ of 64 addresses (an IPv4 /26, an IPv6
                                     /122) from <base>; blocks/ based in them
    pool:<pool>                      pools/<pool>, blockcursor/<pool>/...
    released:<pool>:<family>:<base>  blockfree/ of blocks in an IPv4 /16 (IPv6 /112)
    sticky:<network>:<ns>:<bucket>   sticky/ (16 buckets per namespace, by name)
    meta                             meta/
    lease:<key>                      nodes/<node>, controller/leader: one object each
    other:<directory>                any other key, with the keys of its directory (the
                                     store's conformance suite writes such keys)

A range read needs every object a prefix's keys can be in: `scope_of` names them
exactly when the prefix pins one, else by kind and the labels every object of the
kind carries (`labels_of`). Labels hold hashes of names (a label value is at most 63
characters of a small alphabet; node and pool names are longer and freer).
"""

from __future__ import annotations

import hashlib

from ipward.core import keys
from ipward.core.addr import V4, format_ip, parse_cidr, parse_ip

NODE = "node"
ADDR = "addr"
POOL = "pool"
RELEASED = "released"
STICKY = "sticky"
META = "meta"
LEASE = "lease"
OTHER = "other"  # keys of no ipward prefix (the store's own tests): by their directory
PROBE = "probe"  # a process's own object, written to mark a point its watch reaches
# The order a transaction's primary is chosen in (its first written shard): a node's
# own object first, since only its agent writes it often.
KINDS = (NODE, ADDR, STICKY, RELEASED, POOL, META, LEASE, OTHER, PROBE)

# Kinds no one watches without watching every shard (the controller does): a commit's
# locks in them may wait for the next update of their object (docs/design.md 5.15).
WATCHED_WITH_EVERYTHING = frozenset((ADDR,))

ADDRESSES_PER_SHARD = 64
RELEASED_SPAN = {V4: 16, 6: 112}  # prefix length of the span of one released shard
BUCKETS = 16
SEP = ":"


def _digest(text: str, length: int = 16) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:length]


def _bucket(text: str) -> str:
    return str(int(_digest(text, 8), 16) % BUCKETS)


def _masked(ip: str, span_bits: int) -> str:
    family, value = parse_ip(ip)
    return format_ip(family, value & ~((1 << span_bits) - 1))


def _addr_base(ip: str) -> str:
    return _masked(ip, ADDRESSES_PER_SHARD.bit_length() - 1)


def _cidr_base(cidr: str) -> str:
    family, network, _ = parse_cidr(cidr)
    return _addr_base(format_ip(family, network))


def _released_base(cidr: str) -> tuple[int, str]:
    family, network, _ = parse_cidr(cidr)
    width = 32 if family == V4 else 128
    bits = width - RELEASED_SPAN[family]
    return family, format_ip(family, network & ~((1 << bits) - 1))


def shard(kind: str, *parts: str) -> str:
    return SEP.join((kind, *parts))


def kind_of(shard_id: str) -> str:
    return shard_id.partition(SEP)[0]


# Keys compared by nearly every transaction, written rarely (a pool's spec): each is
# replicated into the node shards that compare it (docs/design.md 5.15), under a key no
# ipward key can be; its home keeps the list of those that hold a replica.
REPLICATED_PREFIXES = (keys.POOLS,)
REPLICA = "~replica/"
HOLDERS = "~holders/"


def replicated(key: str) -> bool:
    return key.startswith(REPLICATED_PREFIXES)


def replica_key(key: str, shard_id: str) -> str:
    """The replica of `key` held in the shard `shard_id` (a shard id holds no '/')."""
    return f"{REPLICA}{shard_id}/{key}"


def holders_key(key: str) -> str:
    return HOLDERS + key


PROBE_KEY = "~probe/"


def internal(key: str) -> bool:
    """A key of the store's own (replicas, holders), never read or watched as data."""
    return key.startswith("~")


def shard_of(key: str) -> str:
    """The shard holding `key` (a replica's: named in it; a holders key's: its key's
    home)."""
    if key.startswith(HOLDERS):
        return shard_of(key[len(HOLDERS) :])
    if key.startswith(REPLICA):
        return key[len(REPLICA) :].partition("/")[0]
    head = keys.prefix_of(key)
    if head not in keys.PREFIXES:
        return shard(OTHER, key.rpartition("/")[0])
    rest = key[len(head) :]
    parts = rest.split("/")
    if head in (keys.NODE_ADDRESSES, keys.ATTACHMENTS):
        return shard(NODE, parts[0])
    if head == keys.FILL:
        return shard(NODE, parts[2])
    if head == keys.FREE_QUEUES:
        return shard(NODE, parts[2])
    if head == keys.AFFINITY:
        return shard(NODE, parts[1])
    if head in (keys.ADDRESSES, keys.FREE):
        pool, ip = keys.ip_parts(key)
        return shard(ADDR, pool, _addr_base(ip))
    if head == keys.BLOCKS:
        pool, _, cidr = rest.partition("/")
        return shard(ADDR, pool, _cidr_base(cidr))
    if head == keys.RELEASED_BLOCKS:
        pool, cidr = keys.released_block_parts(key)
        family, base = _released_base(cidr)
        return shard(RELEASED, pool, str(family), base)
    if head in (keys.POOLS, keys.BLOCK_CURSOR):
        return shard(POOL, parts[0])
    if head == keys.STICKY:
        network, namespace, name = keys.sticky_parts(key)
        return shard(STICKY, network, namespace, _bucket(name))
    if head == keys.META:
        return META
    return shard(LEASE, key)  # keys.LEASED_PREFIXES


def labels_of(shard_id: str) -> dict[str, str]:
    """The labels of a shard's object: its kind, and the names a range may select it
    by (hashed)."""
    kind, *parts = shard_id.split(SEP)
    labels = {"ipward.io/kind": kind}
    if kind in (ADDR, POOL):
        labels["ipward.io/pool"] = _digest(parts[0])
    elif kind == RELEASED:
        labels["ipward.io/pool"] = _digest(parts[0])
        labels["ipward.io/family"] = parts[1]
    elif kind == NODE:
        labels["ipward.io/node"] = _digest(parts[0])
    elif kind == STICKY:
        labels["ipward.io/network"] = _digest(parts[0])
        labels["ipward.io/namespace"] = _digest(parts[0] + "/" + parts[1])
    elif kind == LEASE:
        labels["ipward.io/lease"] = keys.prefix_of(shard_id[len(LEASE) + 1 :]).rstrip("/")
    return labels


class Scope:
    """Where a prefix's keys can be: the shards `ids` exactly, or every shard of `kinds`
    whose labels include `labels`."""

    __slots__ = ("ids", "kinds", "labels")

    def __init__(
        self,
        ids: tuple[str, ...] = (),
        kinds: tuple[str, ...] = (),
        labels: dict[str, str] | None = None,
    ) -> None:
        self.ids = ids
        self.kinds = kinds
        self.labels = labels or {}

    def __repr__(self) -> str:
        return f"Scope(ids={self.ids}, kinds={self.kinds}, labels={self.labels})"


EVERYTHING = Scope(kinds=KINDS)


def scope_of(prefix: str) -> Scope:
    """The shards the keys starting with `prefix` can be in. A part of the prefix counts
    only when a '/' ends it (`ips/p` is every pool whose name starts with p)."""
    head = keys.prefix_of(prefix)
    if not prefix.endswith("/") and head == prefix:
        return EVERYTHING  # no whole first part: `i` could be ips/ or another's
    if head not in keys.PREFIXES:
        return Scope(kinds=(OTHER,))
    whole = prefix[len(head) :].split("/")[:-1]  # the parts a '/' ends
    if head == keys.META:
        return Scope(ids=(META,))
    if head in keys.LEASED_PREFIXES:
        return Scope(kinds=(LEASE,), labels={"ipward.io/lease": head.rstrip("/")})
    if head in (keys.NODE_ADDRESSES, keys.ATTACHMENTS):
        return Scope(ids=(shard(NODE, whole[0]),)) if whole else Scope(kinds=(NODE,))
    if head in (keys.FILL, keys.FREE_QUEUES):
        return Scope(ids=(shard(NODE, whole[2]),)) if len(whole) >= 3 else Scope(kinds=(NODE,))
    if head == keys.AFFINITY:
        return Scope(ids=(shard(NODE, whole[1]),)) if len(whole) >= 2 else Scope(kinds=(NODE,))
    if head in (keys.ADDRESSES, keys.FREE, keys.BLOCKS):
        if whole:
            return Scope(kinds=(ADDR,), labels={"ipward.io/pool": _digest(whole[0])})
        return Scope(kinds=(ADDR,))
    if head == keys.RELEASED_BLOCKS:
        labels = {"ipward.io/pool": _digest(whole[0])} if whole else {}
        if len(whole) >= 2:
            labels["ipward.io/family"] = whole[1]
        return Scope(kinds=(RELEASED,), labels=labels)
    if head in (keys.POOLS, keys.BLOCK_CURSOR):
        if head == keys.BLOCK_CURSOR and whole:
            return Scope(ids=(shard(POOL, whole[0]),))
        return Scope(kinds=(POOL,))
    if head == keys.STICKY:
        if len(whole) >= 2:
            label = _digest(whole[0] + "/" + whole[1])
            return Scope(kinds=(STICKY,), labels={"ipward.io/namespace": label})
        if whole:
            return Scope(kinds=(STICKY,), labels={"ipward.io/network": _digest(whole[0])})
        return Scope(kinds=(STICKY,))
    return EVERYTHING


def object_name(shard_id: str) -> str:
    """The Kubernetes object name of a shard: its kind, a readable part and a hash (a
    name is at most 253 lowercase letters, digits, '-' and '.')."""
    kind, _, rest = shard_id.partition(SEP)
    readable = "".join(c if c.isascii() and c.isalnum() else "-" for c in rest.lower())
    readable = "-".join(p for p in readable.split("-") if p)[:48]
    return f"{kind}.{readable + '.' if readable else ''}{_digest(shard_id, 20)}"
