"""Store keys and record encodings: the one place that knows how facts are laid out.

    meta/schema                                   {version[, import]}: see ipward.store.schema
    meta/poolcoverage                             {generation, pool}: rewritten by every write
                                                  that adds addresses to a pool (ipam.pools)
    pools/<pool>                                  pool spec (pool.PoolSpec)
    blocks/<pool>/<cidr>                          {node, state, next[, version]}
    fill/<pool>/<family>/<node>                      {block}: the block this node fills fresh
    blockcursor/<pool>/<family>                      {next[, version]}: index of the next
                                                  unclaimed block (of that layout version)
    ips/<pool>/<ip>                               the allocation record
    attach/<network>/<container>/<ifname>         {ips: ["<pool>/<ip>", ...]}
    free/<pool>/<ip>                              {released_at, queue}: freed, cooling down
    freeq/<pool>/<family>/<node>/<ms>/<ip>           the same fact ordered by release time
    sticky/<network>/<namespace>/<name>           a sticky reservation: the identity's addresses
    nodes/<node>                                  agent registration, held by its lease
    controller/leader                             {id, since}, held by the leader's lease
    affinity/<pool>/<node>/<cidr>                 the node's blocks (index of blocks/)
    blockfree/<pool>/<family>/<cidr>              a released block, claimed again first

One record per fact and one key per address: nothing grows per pool.
"""

from __future__ import annotations

from ipward.core import jsonc

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

# Block states (DESIGN 5.3): a block takes allocations only while active.
ACTIVE = "active"
MARKED = "marked"  # the controller asks for it back
READY = "ready"  # the agent agrees: no records, nothing in flight
REFUSED = "refused"  # the agent needs it


def encode(obj: dict) -> bytes:
    return jsonc.dumps(obj, sort_keys=True).encode()


def decode(raw: bytes) -> dict:
    value = jsonc.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("record is not an object")
    return value


# Store-wide facts, under `meta/`: the schema version (`ipward.store.schema`), and the key that
# serialises changes of what pools cover: every transaction that stores a pool or adds
# addresses to one compares it at the revision its overlap test read and rewrites it, so
# two such changes cannot both pass the test on the same view.
META_PREFIX = "meta/"
SCHEMA_KEY = "meta/schema"
POOL_COVERAGE_KEY = "meta/poolcoverage"
META_KEYS = (SCHEMA_KEY, POOL_COVERAGE_KEY)
# Prefixes of keys that belong to one pool (`<prefix><pool>/...`): all of them go when the
# pool is deleted, and one left without its pool is an orphan (`ipward check`). `ips/`
# (allocation records) is not among them: records are released, never swept.
POOL_STATE_PREFIXES = (
    "blocks/",
    "affinity/",
    "fill/",
    "blockcursor/",
    "blockfree/",
    "free/",
    "freeq/",
)
# The ledger's keys, by prefix (exported and imported whole) ...
DATA_PREFIXES = ("pools/", *POOL_STATE_PREFIXES, "ips/", "attach/", "sticky/")
# ... keys held by a running process's lease (never exported) ...
LEASED_PREFIXES = ("controller/", "nodes/")
# ... and so every key ipward writes: what makes a store hold ipward data (ipward's keys
# have no common prefix), and what `ipward check` reports any other key against.
PREFIXES = (META_PREFIX, *DATA_PREFIXES, *LEASED_PREFIXES)


def node_key(node: str) -> str:
    return f"nodes/{node}"


def pool_key(pool: str) -> str:
    return f"pools/{pool}"


def block_key(pool: str, cidr: str) -> str:
    return f"blocks/{pool}/{cidr}"


def affinity_prefix(pool: str, node: str) -> str:
    return f"affinity/{pool}/{node}/"


def affinity_key(pool: str, node: str, cidr: str) -> str:
    return f"{affinity_prefix(pool, node)}{cidr}"


def released_block_prefix(pool: str, family: int) -> str:
    return f"blockfree/{pool}/{family}/"


def released_block_key(pool: str, family: int, cidr: str) -> str:
    return f"{released_block_prefix(pool, family)}{cidr}"


def fill_key(pool: str, family: int, node: str) -> str:
    return f"fill/{pool}/{family}/{node}"


def block_cursor_key(pool: str, family: int) -> str:
    return f"blockcursor/{pool}/{family}"


def ip_key(pool: str, ip: str) -> str:
    return f"ips/{pool}/{ip}"


def attach_key(network: str, container: str, ifname: str) -> str:
    return f"attach/{network}/{container}/{ifname}"


def free_key(pool: str, ip: str) -> str:
    return f"free/{pool}/{ip}"


def queue_prefix(pool: str, family: int, node: str) -> str:
    return f"freeq/{pool}/{family}/{node}/"


def queue_key(pool: str, family: int, node: str, released_at: float, ip: str) -> str:
    # Zero-padded milliseconds so key order is release order.
    return f"{queue_prefix(pool, family, node)}{int(released_at * 1000):015d}/{ip}"


def sticky_key(network: str, namespace: str, name: str) -> str:
    return f"sticky/{network}/{namespace}/{name}"


def split_pool_ip(ref: str) -> tuple[str, str]:
    """`<pool>/<ip>` as stored in an attachment index."""
    pool, _, ip = ref.partition("/")
    return pool, ip


class Attachment:
    """What an allocation belongs to: the CNI spec's own key."""

    __slots__ = ("container", "ifname", "network")

    def __init__(self, network: str, container: str, ifname: str) -> None:
        self.network = network
        self.container = container
        self.ifname = ifname

    @property
    def key(self) -> str:
        return attach_key(self.network, self.container, self.ifname)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Attachment) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"{self.network}/{self.container}/{self.ifname}"


class PodInfo:
    """Attributes of the pod behind an attachment (from CNI_ARGS); never part of the key."""

    __slots__ = ("infra_container", "name", "namespace", "uid")

    def __init__(
        self, namespace: str = "", name: str = "", uid: str = "", infra_container: str = ""
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.uid = uid
        self.infra_container = infra_container

    def to_dict(self) -> dict:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
            "infra_container": self.infra_container,
        }


def ip_record(
    attachment: Attachment,
    pod: PodInfo,
    node: str,
    block: str,
    created_at: float,
    requested: bool,
) -> dict:
    return {
        "network": attachment.network,
        "container": attachment.container,
        "ifname": attachment.ifname,
        "pod": pod.to_dict(),
        "node": node,
        "block": block,
        "created_at": round(created_at, 3),
        "requested": requested,
    }


class Sticky:
    """An ADD's request to keep its addresses for a stable identity (network, pod
    namespace, pod name): StatefulSet pods, or pods that ask for it. `may_take(uid)`
    says whether a reservation still bound to a pod of another UID may be taken over
    (that pod is known gone); None: always (no cluster to ask)."""

    __slots__ = ("key", "may_take", "name", "namespace", "owner_kind", "owner_name", "ttl")

    def __init__(
        self,
        network: str,
        namespace: str,
        name: str,
        owner_kind: str = "",
        owner_name: str = "",
        ttl: float | None = None,
        may_take: Callable[[str], bool] | None = None,
    ) -> None:
        self.key = sticky_key(network, namespace, name)
        self.namespace = namespace
        self.name = name
        self.owner_kind = owner_kind
        self.owner_name = owner_name
        self.ttl = ttl
        self.may_take = may_take

    def record(
        self, refs: list[str], attachment: Attachment, uid: str, node: str, now: float
    ) -> dict:
        return {
            "ips": refs,
            "attachment": attachment.key,
            "uid": uid,
            "node": node,
            "owner_kind": self.owner_kind,
            "owner_name": self.owner_name,
            "ttl": self.ttl,
            "bound_at": round(now, 3),
            "detached_at": None,
        }


def detached(record: dict, now: float) -> dict:
    """An allocation record of a sticky address whose sandbox is gone: it keeps the
    address (nobody else can take it, no block release can happen under it) for the
    next sandbox of its identity."""
    return {**record, "container": "", "detached_at": round(now, 3)}


def is_detached(record: dict) -> bool:
    return bool(record.get("sticky")) and not record.get("container")


def record_attachment(record: dict) -> Attachment:
    return Attachment(record["network"], record["container"], record["ifname"])
