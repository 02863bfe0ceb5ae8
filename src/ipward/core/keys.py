"""The store's key layout: the one place a key prefix is spelled. Everything else builds
keys, reads them back and names their prefixes through the functions and constants here
(`tests/unit/test_key_layout.py` checks that no other product module spells one).

    meta/schema                                   {version[, import]}: ipward.store.schema
    meta/poolcoverage                             {generation, pool}: rewritten by every write
                                                  that adds addresses to a pool (ipam.pools)
    pools/<pool>                                  pool spec (core.pool.PoolSpec)
    blocks/<pool>/<cidr>                          block record (records.BlockRecord)
    affinity/<pool>/<node>/<cidr>                 the node's blocks (index of blocks/)
    fill/<pool>/<family>/<node>                   {block}: the block this node fills fresh
    blockcursor/<pool>/<family>                   {next[, version]}: index of the next
                                                  never-claimed block (of that layout version)
    blockfree/<pool>/<family>/<cidr>              a released block, claimed again first
    ips/<pool>/<ip>                               allocation record (records.AddressRecord)
    nodeips/<node>/<pool>/<ip>                    a copy of the record, under its node
                                                  (index of ips/, written with the record)
    attach/<node>/<network>/<container>/<ifname>  attachment index (records.AttachmentIndex),
                                                  under the node its sandbox is on
    free/<pool>/<ip>                              {released_at, queue}: freed, cooling down
    freeq/<pool>/<family>/<node>/<ms>/<ip>        the same fact ordered by the time it was freed
    sticky/<network>/<namespace>/<name>           a sticky reservation (records.ReservationRecord)
    nodes/<node>                                  agent registration, held by its lease
    controller/leader                             {id, since}, held by the leader's lease

One record per fact and one key per address: nothing grows per pool. The texts of the
prefixes are stored data: changing one is a new schema version (ipward.store.schema).
"""

from __future__ import annotations

# Store-wide facts, under `meta/`: the schema version, and the key that serialises
# changes of what pools cover: every transaction that stores a pool or adds addresses to
# one compares it at the revision its overlap test read and rewrites it, so two such
# changes cannot both pass the test on the same view.
META = "meta/"
SCHEMA_KEY = "meta/schema"
POOL_COVERAGE_KEY = "meta/poolcoverage"
META_KEYS = (SCHEMA_KEY, POOL_COVERAGE_KEY)

POOLS = "pools/"
BLOCKS = "blocks/"
AFFINITY = "affinity/"
FILL = "fill/"
BLOCK_CURSOR = "blockcursor/"
RELEASED_BLOCKS = "blockfree/"
ADDRESSES = "ips/"
NODE_ADDRESSES = "nodeips/"
ATTACHMENTS = "attach/"
FREE = "free/"
FREE_QUEUES = "freeq/"
STICKY = "sticky/"
NODES = "nodes/"
CONTROLLER = "controller/"
LEADER_KEY = "controller/leader"

# Prefixes of keys that belong to one pool (`<prefix><pool>/...`): all of them go when the
# pool is deleted, and one left without its pool is an orphan (`ipward check`). `ips/`
# (allocation records) is not among them: records are freed, never swept.
POOL_STATE_PREFIXES = (
    BLOCKS,
    AFFINITY,
    FILL,
    BLOCK_CURSOR,
    RELEASED_BLOCKS,
    FREE,
    FREE_QUEUES,
)
# The ledger's keys, by prefix (exported and imported whole) ...
DATA_PREFIXES = (POOLS, *POOL_STATE_PREFIXES, ADDRESSES, NODE_ADDRESSES, ATTACHMENTS, STICKY)
# ... keys held by a running process's lease (never exported) ...
LEASED_PREFIXES = (CONTROLLER, NODES)
# ... and so every key ipward writes: what makes a store hold ipward data (ipward's keys
# have no common prefix), and what `ipward check` reports any other key against.
PREFIXES = (META, *DATA_PREFIXES, *LEASED_PREFIXES)


def prefix_of(key: str) -> str:
    """The prefix a key is under (`ips/` of `ips/p/10.0.0.2`), as in PREFIXES."""
    head, slash, _ = key.partition("/")
    return head + slash


def last(key: str) -> str:
    """The last part of a key: the address of `ips/`, `free/` and `freeq/` keys, the node
    of `fill/` and `nodes/` keys."""
    return key.rpartition("/")[2]


def cidr_of(key: str) -> str:
    """The CIDR at the end of a key (`.../10.0.0.64/26`)."""
    head, _, length = key.rpartition("/")
    return f"{head.rpartition('/')[2]}/{length}"


# -- pools ------------------------------------------------------------------------------


def pool_key(pool: str) -> str:
    return f"{POOLS}{pool}"


def pool_name(key: str) -> str:
    """The pool of a `pools/<pool>` key."""
    return key[len(POOLS) :]


def state_pool(key: str) -> str | None:
    """The pool a key of a pool's own state belongs to (`<prefix><pool>/...`, the
    POOL_STATE_PREFIXES), or None for any other key."""
    for prefix in POOL_STATE_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :].partition("/")[0]
    return None


def state_prefix(prefix: str, pool: str) -> str:
    """The keys of one kind (a POOL_STATE_PREFIXES entry) of one pool."""
    return f"{prefix}{pool}/"


# -- blocks -----------------------------------------------------------------------------


def block_key(pool: str, cidr: str) -> str:
    return f"{BLOCKS}{pool}/{cidr}"


def blocks_prefix(pool: str) -> str:
    return f"{BLOCKS}{pool}/"


def block_ref(key: str) -> str:
    """`<pool>/<cidr>` of a `blocks/` key: a block named across pools."""
    return key[len(BLOCKS) :]


def affinity_prefix(pool: str, node: str) -> str:
    return f"{AFFINITY}{pool}/{node}/"


def affinity_key(pool: str, node: str, cidr: str) -> str:
    return f"{affinity_prefix(pool, node)}{cidr}"


def affinity_parts(key: str) -> tuple[str, str, str]:
    """(pool, node, cidr) of an `affinity/` key; a part it lacks is empty."""
    pool, node, cidr = (*key[len(AFFINITY) :].split("/", 2), "", "")[:3]
    return pool, node, cidr


def released_block_prefix(pool: str, family: int) -> str:
    return f"{RELEASED_BLOCKS}{pool}/{family}/"


def released_block_key(pool: str, family: int, cidr: str) -> str:
    return f"{released_block_prefix(pool, family)}{cidr}"


def released_block_parts(key: str) -> tuple[str, str]:
    """(pool, cidr) of a `blockfree/` key."""
    pool, _family, cidr = key[len(RELEASED_BLOCKS) :].split("/", 2)
    return pool, cidr


def fill_key(pool: str, family: int, node: str) -> str:
    return f"{FILL}{pool}/{family}/{node}"


def fills_prefix(pool: str, family: int | None = None) -> str:
    """A pool's fill records, of one family when given."""
    return f"{FILL}{pool}/" + ("" if family is None else f"{family}/")


def fill_parts(key: str) -> tuple[str, str, str]:
    """(pool, family, node) of a `fill/` key (the family as written: text)."""
    pool, family, node = key[len(FILL) :].split("/", 2)
    return pool, family, node


def block_cursor_key(pool: str, family: int) -> str:
    return f"{BLOCK_CURSOR}{pool}/{family}"


# -- addresses --------------------------------------------------------------------------


def ip_key(pool: str, ip: str) -> str:
    return f"{ADDRESSES}{pool}/{ip}"


def ips_prefix(pool: str | None = None) -> str:
    """Every allocation record, or one pool's."""
    return ADDRESSES if pool is None else f"{ADDRESSES}{pool}/"


def ip_parts(key: str) -> tuple[str, str]:
    """(pool, ip) of an `ips/` or `free/` key."""
    pool, _, ip = key.partition("/")[2].partition("/")
    return pool, ip


def node_ip_key(node: str, pool: str, ip: str) -> str:
    return f"{NODE_ADDRESSES}{node}/{pool}/{ip}"


def node_ips_prefix(node: str | None = None) -> str:
    """The index entries of one node's allocation records, or of every node's."""
    return NODE_ADDRESSES if node is None else f"{NODE_ADDRESSES}{node}/"


def node_ip_parts(key: str) -> tuple[str, str, str]:
    """(node, pool, ip) of a `nodeips/` key; a part it lacks is empty."""
    node, pool, ip = (*key[len(NODE_ADDRESSES) :].split("/", 2), "", "")[:3]
    return node, pool, ip


def attach_key(node: str, network: str, container: str, ifname: str) -> str:
    """An attachment's index, under its node (schema version 3: what one node writes
    is kept together, docs/design.md 5.15)."""
    return f"{ATTACHMENTS}{node}/{network}/{container}/{ifname}"


def attachments_prefix(node: str) -> str:
    return f"{ATTACHMENTS}{node}/"


def attach_parts(key: str) -> tuple[str, str, str, str]:
    """(node, network, container, ifname) of an `attach/` key."""
    node, network, container, ifname = key[len(ATTACHMENTS) :].split("/", 3)
    return node, network, container, ifname


def free_key(pool: str, ip: str) -> str:
    return f"{FREE}{pool}/{ip}"


def queue_prefix(pool: str, family: int, node: str) -> str:
    return f"{FREE_QUEUES}{pool}/{family}/{node}/"


def queues_prefix(pool: str, family: int) -> str:
    """The free queues of every node of one family of a pool."""
    return f"{FREE_QUEUES}{pool}/{family}/"


def queue_key(pool: str, family: int, node: str, freed_at: float, ip: str) -> str:
    # Zero-padded milliseconds so key order is the order the addresses were freed in.
    return f"{queue_prefix(pool, family, node)}{int(freed_at * 1000):015d}/{ip}"


def is_queue_key(key: str) -> bool:
    return key.startswith(FREE_QUEUES)


def queue_prefix_of(key: str) -> str:
    """`freeq/<pool>/<family>/<node>/` of a queue entry's key."""
    return "/".join(key.split("/", 4)[:4]) + "/"


def queue_node(key: str) -> str:
    """The node whose queue an entry is in."""
    return key.split("/")[3]


def queued_at(key: str) -> float:
    """When a queue entry's address was freed (seconds; the key holds milliseconds)."""
    return int(key.rsplit("/", 2)[-2]) / 1000


# -- sticky reservations ----------------------------------------------------------------


def sticky_key(network: str, namespace: str, name: str) -> str:
    return f"{STICKY}{network}/{namespace}/{name}"


def sticky_parts(key: str) -> tuple[str, str, str]:
    """(network, namespace, name) of a `sticky/` key; a part it lacks is empty."""
    network, namespace, name = (*key[len(STICKY) :].split("/", 2), "", "")[:3]
    return network, namespace, name


# -- processes --------------------------------------------------------------------------


def node_key(node: str) -> str:
    return f"{NODES}{node}"


def registered_node(key: str) -> str | None:
    """The node a `nodes/` key registers, None for a key no node name can make."""
    name = key[len(NODES) :]
    return name if name and "/" not in name else None
