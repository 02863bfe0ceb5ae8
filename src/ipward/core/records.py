"""Record encodings: how each fact is written under its key (the keys are `keys`'),
and the values an allocation carries (attachment, pod).
"""

from __future__ import annotations

from ipward.core import jsonc
from ipward.core.keys import attach_key, sticky_key

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
