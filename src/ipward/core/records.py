"""Records: what is written under each key (the keys are `keys`'), as small `__slots__`
classes, each with its encoding in one place (`encode` / `decode`: sorted compact JSON).

    ips/...        AddressRecord     an allocation: attachment, pod, node, block, when
    attach/...     AttachmentIndex   the attachment's addresses, `<pool>/<ip>` each
    blocks/...     BlockRecord       owner node, hand-back state, fresh-address cursor
    sticky/...     ReservationRecord a sticky identity's addresses and its sandbox
    fill/...       FillRecord        the block a node fills fresh addresses from
    blockcursor/.. CursorRecord      the next never-claimed block
    nodes/...      NodeRegistration  a live agent (under its lease)
    controller/..  LeaderRecord      the controller that leads (under its lease)

The free queue's record (`free/`, `FreeRecord`) is the queue's, with everything else of
it, in `ipam/free_queue.py`.

Decoding is lenient where a reader always was (a field missing reads as its default)
and strict where a record is useless without it (an address record's attachment). A
record encodes exactly the fields it was decoded or made with: an optional field is
written only when set, so a record rewritten by this code reads the same to another.

Standard library only (the plugin writes these): `__slots__` classes, no dataclasses.

Over 600 lines, on purpose: one small class per key prefix, each record's whole
encoding in one place. They stay one module because the plugin reads most of them on
each exec, and one file costs less to import than ten.
"""

from __future__ import annotations

from ipward.core.keys import attach_key, sticky_key
from ipward.core.startpath import json_dumps, json_loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

# Block states (docs/design.md 5.3): a block takes allocations only while active.
ACTIVE = "active"
MARKED = "marked"  # the controller asks for it back
READY = "ready"  # the agent agrees: no records, nothing in flight
REFUSED = "refused"  # the agent needs it


def encode(obj: dict) -> bytes:
    return json_dumps(obj, sort_keys=True).encode()


def decode(raw: bytes) -> dict:
    value = json_loads(raw)
    if not isinstance(value, dict):
        raise ValueError("record is not an object")
    return value


def _required(d: dict, field: str) -> object:
    if field not in d:
        raise ValueError(f"record has no {field!r}")
    return d[field]


def _stamp(at: float) -> float:
    """Times are stored to the millisecond."""
    return round(at, 3)


def pool_ip(pool: str, ip: str) -> str:
    """`<pool>/<ip>`: an address named across pools (attachment indexes, reservations)."""
    return f"{pool}/{ip}"


def split_pool_ip(ref: str) -> tuple[str, str]:
    """The pool and address of a `<pool>/<ip>` reference."""
    pool, _, ip = ref.partition("/")
    return pool, ip


class Attachment:
    """What an allocation belongs to: the CNI spec's own key. Its index is kept under
    the node its sandbox is on (`key_on`)."""

    __slots__ = ("container", "ifname", "network")

    def __init__(self, network: str, container: str, ifname: str) -> None:
        self.network = network
        self.container = container
        self.ifname = ifname

    def key_on(self, node: str) -> str:
        """Its index key on `node`."""
        return attach_key(node, self.network, self.container, self.ifname)

    def _identity(self) -> tuple[str, str, str]:
        return (self.network, self.container, self.ifname)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Attachment) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

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

    @classmethod
    def from_dict(cls, d: object) -> PodInfo:
        """A stored pod (anything but an object reads as no pod)."""
        if not isinstance(d, dict):
            return cls()
        return cls(
            str(d.get("namespace", "")),
            str(d.get("name", "")),
            str(d.get("uid", "")),
            str(d.get("infra_container", "")),
        )


class AddressRecord:
    """`ips/<pool>/<ip>`: one allocated address. `sticky` names the reservation of a
    sticky address; `detached_at` is set (and `container` empty) once its sandbox is
    gone and the reservation keeps it. `created_at`: when its ADD committed (None in a
    record that lacks it: each reader says what that means to it)."""

    __slots__ = (
        "block",
        "container",
        "created_at",
        "detached_at",
        "ifname",
        "layout",
        "network",
        "node",
        "pod",
        "requested",
        "sticky",
    )

    def __init__(
        self,
        attachment: Attachment,
        pod: PodInfo,
        node: str,
        block: str,
        created_at: float | None,
        requested: bool = False,
        sticky: str | None = None,
        detached_at: float | None = None,
        layout: int | None = None,
    ) -> None:
        self.network = attachment.network
        self.container = attachment.container
        self.ifname = attachment.ifname
        self.pod = pod
        self.node = node
        self.block = block
        self.created_at = created_at
        self.requested = requested
        self.sticky = sticky
        self.detached_at = detached_at
        self.layout = layout

    @classmethod
    def new(
        cls,
        attachment: Attachment,
        pod: PodInfo,
        node: str,
        block: str,
        now: float,
        layout: int | None,
        requested: bool = False,
        sticky: str | None = None,
    ) -> AddressRecord:
        """The record an allocation writes, stamped `now`."""
        return cls(attachment, pod, node, block, _stamp(now), requested, sticky, None, layout)

    @property
    def attachment(self) -> Attachment:
        return Attachment(self.network, self.container, self.ifname)

    @property
    def index_key(self) -> str:
        """Its attachment's index key: under the record's node, as written with it."""
        return self.attachment.key_on(self.node)

    @property
    def is_detached(self) -> bool:
        """A sticky address whose sandbox is gone: its reservation holds it."""
        return bool(self.sticky) and not self.container

    def detached(self, now: float) -> AddressRecord:
        """This record once its sandbox is gone: it keeps the address (nobody else can
        take it, no block can be handed back under it) for the next sandbox of its
        identity."""
        gone = Attachment(self.network, "", self.ifname)
        return AddressRecord(
            gone,
            self.pod,
            self.node,
            self.block,
            self.created_at,
            self.requested,
            self.sticky,
            _stamp(now),
            self.layout,
        )

    def to_dict(self) -> dict:
        out: dict = {
            "network": self.network,
            "container": self.container,
            "ifname": self.ifname,
            "pod": self.pod.to_dict(),
            "node": self.node,
            "block": self.block,
            "requested": self.requested,
        }
        if self.created_at is not None:
            out["created_at"] = self.created_at
        if self.sticky is not None:
            out["sticky"] = self.sticky
        if self.detached_at is not None:
            out["detached_at"] = self.detached_at
        if self.layout is not None:
            out["layout"] = self.layout
        return out

    def encode(self) -> bytes:
        return encode(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> AddressRecord:
        attachment = Attachment(
            str(_required(d, "network")),
            str(_required(d, "container")),
            str(_required(d, "ifname")),
        )
        created = d.get("created_at")
        detached = d.get("detached_at")
        layout = d.get("layout")
        return cls(
            attachment,
            PodInfo.from_dict(d.get("pod")),
            str(d.get("node", "")),
            str(d.get("block", "")),
            created if isinstance(created, int | float) else None,
            bool(d.get("requested", False)),
            d.get("sticky") or None,
            detached if isinstance(detached, int | float) else None,
            layout if isinstance(layout, int) and not isinstance(layout, bool) else None,
        )

    @classmethod
    def decode(cls, raw: bytes) -> AddressRecord:
        """Raises ValueError when it is not an allocation record."""
        return cls.from_dict(decode(raw))


class AttachmentIndex:
    """`attach/<network>/<container>/<ifname>`: the attachment's addresses, each as
    `<pool>/<ip>` (an idempotent ADD answers them, a DEL frees them)."""

    __slots__ = ("refs",)

    def __init__(self, refs: list[str]) -> None:
        self.refs = refs

    def encode(self) -> bytes:
        return encode({"ips": self.refs})

    @classmethod
    def decode(cls, raw: bytes) -> AttachmentIndex:
        refs = decode(raw).get("ips", [])
        if not isinstance(refs, list):
            raise ValueError("attachment index: 'ips' is not a list")
        return cls([str(r) for r in refs])


class BlockRecord:
    """`blocks/<pool>/<cidr>`: the node that owns the block, its state in the hand-back
    (ACTIVE, MARKED, READY, REFUSED), and `next`, the offset of its first never-used
    address, valid for the pool layout `version` it was written under (0: the pool's
    first layout, and then not written)."""

    __slots__ = ("answered_at", "marked_at", "next", "node", "state", "version")

    def __init__(
        self,
        node: str,
        state: str,
        next: int | None = None,
        version: int = 0,
        marked_at: float | None = None,
        answered_at: float | None = None,
    ) -> None:
        self.node = node
        self.state = state
        self.next = next
        self.version = version
        self.marked_at = marked_at
        self.answered_at = answered_at

    @classmethod
    def claimed(cls, node: str, next_offset: int, version: int) -> BlockRecord:
        """A block a node has just claimed, fresh addresses from `next_offset` on."""
        return cls(node, ACTIVE, next_offset, version)

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def next_for(self, version: int) -> int:
        """The never-used cursor, if written under this layout version; else 0 (the
        ranges changed since, and addresses behind the cursor may have been freed
        without a queue entry while they were outside the pool: a fresh pick skips what
        is taken)."""
        return int(self.next or 0) if self.version == version else 0

    def advanced(self, next_offset: int, version: int) -> BlockRecord:
        """The cursor moved on (stamped with the layout version it indexes)."""
        return self._copy(next=next_offset, version=version)

    def marked(self, now: float) -> BlockRecord:
        return self._copy(state=MARKED, marked_at=now)

    def answered(self, state: str, now: float) -> BlockRecord:
        return self._copy(state=state, answered_at=now)

    def resumed(self) -> BlockRecord:
        """Back to work after a refusal: out of the hand-back, cursor as it was."""
        return self._copy(state=ACTIVE, marked_at=None, answered_at=None)

    def taken_back(self, version: int) -> BlockRecord:
        """Back to work because its node needs the space: out of the hand-back, and
        next = 0, so addresses whose free entries the controller already cleaned are
        found again as fresh (those still recorded or queued are skipped)."""
        return self._copy(state=ACTIVE, next=0, version=version, marked_at=None, answered_at=None)

    def _copy(self, **changes: object) -> BlockRecord:
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return BlockRecord(**fields)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        out: dict = {"node": self.node, "state": self.state}
        if self.next is not None:
            out["next"] = self.next
        if self.version:
            out["version"] = self.version
        if self.marked_at is not None:
            out["marked_at"] = self.marked_at
        if self.answered_at is not None:
            out["answered_at"] = self.answered_at
        return out

    def encode(self) -> bytes:
        return encode(self.to_dict())

    @classmethod
    def decode(cls, raw: bytes) -> BlockRecord:
        d = decode(raw)
        marked, answered = d.get("marked_at"), d.get("answered_at")
        return cls(
            str(d.get("node", "")),
            str(d.get("state", "")),
            d.get("next"),
            d.get("version", 0),
            marked if isinstance(marked, int | float) else None,
            answered if isinstance(answered, int | float) else None,
        )


class ReservationRecord:
    """`sticky/<network>/<namespace>/<name>`: a sticky identity's addresses (`ips`, each
    `<pool>/<ip>`), the sandbox holding them (`attachment`, its index key; "" once
    detached), the pod's UID and node, its owner, and how long it outlives its sandbox
    (`ttl`; None: as long as its StatefulSet ordinal)."""

    __slots__ = (
        "attachment",
        "bound_at",
        "detached_at",
        "ips",
        "node",
        "owner_kind",
        "owner_name",
        "ttl",
        "uid",
    )

    def __init__(
        self,
        ips: list[str],
        attachment: str,
        uid: str,
        node: str,
        owner_kind: str,
        owner_name: str,
        ttl: float | None,
        bound_at: float | None,
        detached_at: float | None = None,
    ) -> None:
        self.ips = ips
        self.attachment = attachment
        self.uid = uid
        self.node = node
        self.owner_kind = owner_kind
        self.owner_name = owner_name
        self.ttl = ttl
        self.bound_at = bound_at
        self.detached_at = detached_at

    @property
    def bound(self) -> bool:
        return bool(self.attachment)

    def detached(self, now: float) -> ReservationRecord:
        """No sandbox holds it any more (from `now`)."""
        return ReservationRecord(
            self.ips,
            "",
            self.uid,
            self.node,
            self.owner_kind,
            self.owner_name,
            self.ttl,
            self.bound_at,
            _stamp(now),
        )

    def to_dict(self) -> dict:
        return {
            "ips": self.ips,
            "attachment": self.attachment,
            "uid": self.uid,
            "node": self.node,
            "owner_kind": self.owner_kind,
            "owner_name": self.owner_name,
            "ttl": self.ttl,
            "bound_at": self.bound_at,
            "detached_at": self.detached_at,
        }

    def encode(self) -> bytes:
        return encode(self.to_dict())

    @classmethod
    def decode(cls, raw: bytes) -> ReservationRecord:
        return cls.from_dict(decode(raw))

    @classmethod
    def from_dict(cls, d: dict) -> ReservationRecord:
        ips = d.get("ips", [])
        ttl, bound, detached = d.get("ttl"), d.get("bound_at"), d.get("detached_at")
        return cls(
            [str(r) for r in ips] if isinstance(ips, list) else [],
            str(d.get("attachment") or ""),
            str(d.get("uid", "")),
            str(d.get("node", "")),
            str(d.get("owner_kind", "")),
            str(d.get("owner_name", "")),
            ttl if isinstance(ttl, int | float) else None,
            bound if isinstance(bound, int | float) else None,
            detached if isinstance(detached, int | float) else None,
        )


class FillRecord:
    """`fill/<pool>/<family>/<node>`: the block the node takes fresh addresses from."""

    __slots__ = ("block",)

    def __init__(self, block: str) -> None:
        self.block = block

    def encode(self) -> bytes:
        return encode({"block": self.block})

    @classmethod
    def decode(cls, raw: bytes) -> FillRecord:
        return cls(str(decode(raw).get("block", "")))


class CursorRecord:
    """`blockcursor/<pool>/<family>`: the index of the next never-claimed block, for
    the layout `version` it was written under (0: not written)."""

    __slots__ = ("next", "version")

    def __init__(self, next: int, version: int = 0) -> None:
        self.next = next
        self.version = version

    def next_for(self, version: int) -> int:
        """Where the walk for never-claimed blocks starts: this index, if it indexes
        this layout version's blocks; else 0 (the pool's ranges changed since: the walk
        passes the blocks already claimed)."""
        return self.next if self.version == version else 0

    def encode(self) -> bytes:
        out: dict = {"next": self.next}
        if self.version:
            out["version"] = self.version
        return encode(out)

    @classmethod
    def decode(cls, raw: bytes) -> CursorRecord:
        d = decode(raw)
        return cls(int(d.get("next", 0)), d.get("version", 0))


class Sticky:
    """An ADD's request to keep its addresses for a stable identity (network, pod
    namespace, pod name): StatefulSet pods, or pods that ask for it. `may_take(uid)`
    says whether a reservation still bound to a pod of another UID may be taken over
    (that pod is known gone); None: always (no cluster to ask). `sandbox_listed(id)`
    says whether this node's runtime still lists a sandbox (its teardown is not over);
    None: no runtime to ask."""

    __slots__ = (
        "key",
        "may_take",
        "name",
        "namespace",
        "owner_kind",
        "owner_name",
        "sandbox_listed",
        "ttl",
    )

    def __init__(
        self,
        network: str,
        namespace: str,
        name: str,
        owner_kind: str = "",
        owner_name: str = "",
        ttl: float | None = None,
        may_take: Callable[[str], bool] | None = None,
        sandbox_listed: Callable[[str], bool] | None = None,
    ) -> None:
        self.key = sticky_key(network, namespace, name)
        self.namespace = namespace
        self.name = name
        self.owner_kind = owner_kind
        self.owner_name = owner_name
        self.ttl = ttl
        self.may_take = may_take
        self.sandbox_listed = sandbox_listed

    def record(
        self, refs: list[str], attachment: Attachment, uid: str, node: str, now: float
    ) -> ReservationRecord:
        """The reservation bound to `attachment` from `now`."""
        return ReservationRecord(
            refs,
            attachment.key_on(node),
            uid,
            node,
            self.owner_kind,
            self.owner_name,
            self.ttl,
            _stamp(now),
        )


class NodeRegistration:
    """`nodes/<node>`, under the agent's lease: the node has a live agent. `pid` and
    `since` are for an operator reading the key; the key's presence is the fact. `clock`
    is the agent's wall clock when it put the key, put again every `refresh` seconds:
    a judge reading it measures the node's clock offset (`ipward.gc.clocks`). A
    registration written before `clock` existed has only `since`, which was the clock at
    its put too, and no `refresh`. `runtime`: the agent judges its node's records by its
    runtime (it reconciles), so the cluster's word alone frees nothing there (the
    `ipward.gc.rules` docstring, rule 4); absent in older registrations (False)."""

    __slots__ = ("clock", "node", "pid", "refresh", "runtime", "since")

    def __init__(
        self,
        node: str,
        pid: int,
        since: float,
        clock: float,
        refresh: float | None,
        runtime: bool = False,
    ) -> None:
        self.node = node
        self.pid = pid
        self.since = since
        self.clock = clock
        self.refresh = refresh
        self.runtime = runtime

    def encode(self) -> bytes:
        return encode(
            {
                "node": self.node,
                "pid": self.pid,
                "since": _stamp(self.since),
                "clock": _stamp(self.clock),
                "refresh": self.refresh,
                "runtime": self.runtime,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> NodeRegistration:
        d = decode(raw)
        since, clock, refresh = (_number(d.get(k)) for k in ("since", "clock", "refresh"))
        if since is None:
            raise ValueError("registration without 'since'")
        pid = d.get("pid")
        return cls(
            str(d.get("node", "")),
            pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
            since,
            since if clock is None else clock,
            refresh if refresh is not None and refresh > 0 else None,
            d.get("runtime") is True,
        )


def _number(value: object) -> float | None:
    """`value` if a finite number (not a bool, not NaN or infinite), else None. (`math`
    is not imported: the plugin's start path.)"""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


class LeaderRecord:
    """The controller leader key, under the leader's lease: which controller instance
    leads, and since when. Its exact bytes are the fence every leader write compares."""

    __slots__ = ("ident", "since")

    def __init__(self, ident: str, since: float) -> None:
        self.ident = ident
        self.since = since

    def encode(self) -> bytes:
        return encode({"id": self.ident, "since": round(self.since, 3)})

    @classmethod
    def decode(cls, raw: bytes) -> LeaderRecord:
        d = decode(raw)
        since = d.get("since", 0.0)
        return cls(str(d.get("id", "")), float(since) if isinstance(since, int | float) else 0.0)
