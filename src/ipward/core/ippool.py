"""The IPPool resource (`ippools.ipward.io`, `deploy/base/crds/ippools.yaml`;
docs/design.md 5.16): a pool as a cluster-scoped Kubernetes object. Its spec is what
`ipward pool create` takes, its status what `ipward pool list` shows. Here is its shape
only, pure: an object read (`parse`), its spec as the ledger's `PoolSpec` with every
mistake named by its field (`declared`), the object `ipward pool create` makes
(`manifest`), and the status the controller writes (`status`). Who acts on the objects
is `controller/pool_objects.py`.

The spec's fields: `ranges` (each `subnet`, `start`, `end`, `gateway`: omitted, the
subnet's first address as with `ipward pool create` and host-local; `none`, no
gateway), `exclude`, `routes`, `blockSize` (`ipv4`, `ipv6`: prefix lengths), `warm`,
`cooldownSeconds`, `releaseDelaySeconds`, `borrow`, `namespaces`, `nodes`. The API's
schema refuses what it can see in one object; what it cannot (a gateway outside its
subnet, two ranges sharing a block, a block size for a family the pool lacks) is
refused here, named the same way (`spec.ranges[1]: gateway ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from ipward.core.addr import (
    BITS,
    DEFAULT_BLOCK_PREFIX,
    V4,
    V6,
    Range,
    family_of,
    parse_cidr,
    parse_ip,
)
from ipward.core.errors import InvalidConfig
from ipward.core.policy import DEFAULT_COOLDOWN, DEFAULT_RELEASE_DELAY, DEFAULT_WARM
from ipward.core.pool import IPPOOL, Layout, PoolSpec, check_routes, count, default_gateway, seconds

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from ipward.core.records import AddressRecord

GROUP = "ipward.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "IPPool"
PLURAL = "ippools"
PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
# Held on every object the controller (or `ipward pool create`) has taken on: its pool
# is deleted from the ledger, once no record holds an address of it, before it goes.
FINALIZER = "ipward.io/pool"
NO_GATEWAY = "none"
FAMILY_FIELDS = {V4: "ipv4", V6: "ipv6"}
T = TypeVar("T")

# Conditions and the reasons of `Ready`.
READY = "Ready"
OVERLAPS = "Overlaps"
EXHAUSTED = "Exhausted"
APPLIED = "Applied"  # the ledger holds the object's spec
INVALID = "Invalid"  # a mistake the schema could not see
REFUSED = "Refused"  # the name is another's (a network config's inline pool), or the
# ledger's pool of that name is being deleted
DELETING = "Deleting"
HOLDERS_SHOWN = 5  # holders named in the status of a pool being deleted


def path(name: str) -> str:
    return f"{PATH}/{name}"


@dataclass(frozen=True)
class PoolObject:
    """An IPPool as read from the API: what ipward reads of it (no `managedFields`, no
    other metadata)."""

    name: str
    uid: str
    generation: int
    resource_version: str
    spec: dict
    finalizers: tuple[str, ...]
    deleting: bool
    status: dict

    @property
    def held(self) -> bool:
        """Whether it carries ipward's finalizer."""
        return FINALIZER in self.finalizers


def parse(obj: dict) -> tuple[str, PoolObject]:
    """An object of the API (a list's item, a watch event's, an answer): (name, it).
    Raises KeyError, TypeError or ValueError when it is not an IPPool's shape."""
    meta = obj["metadata"]
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if not isinstance(spec, dict) or not isinstance(status, dict):
        raise ValueError("spec and status must be objects")
    name = str(meta["name"])
    return name, PoolObject(
        name=name,
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation", 0)),
        resource_version=str(meta["resourceVersion"]),
        spec=spec,
        finalizers=tuple(str(f) for f in meta.get("finalizers") or ()),
        deleting=bool(meta.get("deletionTimestamp")),
        status=status,
    )


# -- the spec -------------------------------------------------------------------------------


def _at(field: str, check: Callable[[], T]) -> T:
    """`check()`, its mistake named by `field`."""
    try:
        return check()
    except InvalidConfig as e:
        raise InvalidConfig(f"{field}: {e.msg}") from None


def _address_or_cidr(text: object) -> object:
    if not isinstance(text, str):
        raise InvalidConfig(f"{text!r} is not a CIDR or an address")
    return parse_cidr(text) if "/" in text else parse_ip(text)


def _strings(value: object, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidConfig(f"{field} must be a list of names")
    return value


def _range(name: str, r: object, field: str) -> tuple[int, dict]:
    """One range of the spec: (its family, the range as a pool spec holds it)."""
    if not isinstance(r, dict) or not isinstance(r.get("subnet"), str):
        raise InvalidConfig(f"{field}.subnet is required (a CIDR)")
    out = {"subnet": r["subnet"]}
    for given, stored in (("start", "rangeStart"), ("end", "rangeEnd")):
        if given in r:
            out[stored] = r[given]
    gateway = r.get("gateway")
    if gateway is None:
        gateway = _at(f"{field}.subnet", lambda: default_gateway(out["subnet"]))
    if gateway != NO_GATEWAY and gateway is not None:
        out["gateway"] = gateway
    _at(field, lambda: Layout(name, [[out]]))  # its own mistakes, named by its field
    return family_of(out["subnet"]), out


def declared(obj: PoolObject) -> PoolSpec:
    """The pool the object declares (source `ippool`); InvalidConfig naming the field of
    the first mistake."""
    spec = obj.spec
    ranges = spec.get("ranges")
    if not isinstance(ranges, list) or not ranges:
        raise InvalidConfig("spec.ranges: a pool needs at least one range")
    by_family: dict[int, list[dict]] = {}
    for i, r in enumerate(ranges):
        family, stored = _range(obj.name, r, f"spec.ranges[{i}]")
        by_family.setdefault(family, []).append(stored)
    exclude = spec.get("exclude", [])
    if not isinstance(exclude, list):
        raise InvalidConfig("spec.exclude must be a list of CIDRs or addresses")
    for i, text in enumerate(exclude):
        _at(f"spec.exclude[{i}]", partial(_address_or_cidr, text))
    block_prefix: dict[int, int] = {}
    sizes = spec.get("blockSize", {})
    if not isinstance(sizes, dict):
        raise InvalidConfig("spec.blockSize must be an object (ipv4, ipv6)")
    for family, key in FAMILY_FIELDS.items():
        if key not in sizes:
            continue
        prefix, field = sizes[key], f"spec.blockSize.{key}"
        if isinstance(prefix, bool) or not isinstance(prefix, int):
            raise InvalidConfig(f"{field} must be a prefix length")
        if not 0 < prefix <= BITS[family]:
            raise InvalidConfig(f"{field}: /{prefix} is not an IPv{family} prefix length")
        if family not in by_family:
            raise InvalidConfig(f"{field}: the pool has no IPv{family} range")
        block_prefix[family] = prefix
    routes = check_routes(spec.get("routes", []), "spec.routes")
    cooldown = seconds(spec.get("cooldownSeconds", DEFAULT_COOLDOWN), "spec.cooldownSeconds")
    delay = spec.get("releaseDelaySeconds", DEFAULT_RELEASE_DELAY)
    release_delay = seconds(delay, "spec.releaseDelaySeconds")
    warm = count(spec.get("warm", DEFAULT_WARM), "spec.warm")
    borrow = _boolean(spec.get("borrow", False), "spec.borrow")
    namespaces = _strings(spec.get("namespaces", []), "spec.namespaces")
    nodes = _strings(spec.get("nodes", []), "spec.nodes")
    return _at(  # what only the ranges together can get wrong (two sharing a block)
        "spec.ranges",
        lambda: PoolSpec(
            obj.name,
            [by_family[f] for f in sorted(by_family)],
            exclude,
            routes,
            cooldown,
            block_prefix,
            source=IPPOOL,
            warm=warm,
            release_delay=release_delay,
            borrow=borrow,
            namespaces=namespaces,
            nodes=nodes,
        ),
    )


def _boolean(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{field} must be true or false")
    return value


def manifest(spec: PoolSpec) -> dict:
    """The object of the pool `spec` (what `ipward pool create` makes): only what differs
    from the defaults, so it reads as a person would write it (`declared` of it is
    `spec` again); with the finalizer, since its pool goes into the ledger at once."""
    ranges = []
    for rs in spec.range_sets:
        for r in rs.ranges:
            given, default = r.to_dict(), Range(r.subnet).to_dict()
            out = {"subnet": r.subnet}
            for field, stored in (("start", "rangeStart"), ("end", "rangeEnd")):
                if given[stored] != default[stored]:
                    out[field] = given[stored]
            gateway = given.get("gateway")
            if gateway != default_gateway(r.subnet):
                out["gateway"] = gateway or NO_GATEWAY
            ranges.append(out)
    body: dict = {"ranges": ranges}
    if spec.exclude:
        body["exclude"] = list(spec.exclude)
    if spec.routes:
        body["routes"] = [dict(route) for route in spec.routes]
    sizes = {
        FAMILY_FIELDS[rs.family]: rs.block_prefix
        for rs in spec.range_sets
        if rs.block_prefix != DEFAULT_BLOCK_PREFIX[rs.family]
    }
    if sizes:
        body["blockSize"] = sizes
    for field, value, default_value in (
        ("warm", spec.warm, DEFAULT_WARM),
        ("cooldownSeconds", spec.cooldown, DEFAULT_COOLDOWN),
        ("releaseDelaySeconds", spec.release_delay, DEFAULT_RELEASE_DELAY),
        ("borrow", spec.borrow, False),
    ):
        if value != default_value:
            body[field] = value
    if spec.namespaces:
        body["namespaces"] = list(spec.namespaces)
    if spec.nodes:
        body["nodes"] = list(spec.nodes)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": spec.name, "finalizers": [FINALIZER]},
        "spec": body,
    }


# -- the status -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What became of an object's spec: `reason` (APPLIED, INVALID, OVERLAPS, REFUSED,
    DELETING) and, in words, why."""

    reason: str
    message: str


@dataclass(frozen=True)
class Usage:
    """One family of a pool: addresses allocated, addresses it may hand out, blocks
    claimed by nodes."""

    used: int
    capacity: int
    blocks: int


def usage(
    spec: PoolSpec, records_per_block: Mapping[str, int], blocks: Iterable[str]
) -> dict[int, Usage]:
    """Per family of the pool: records (counted by the block each names), capacity of
    its range set, claimed blocks."""
    used: dict[int, int] = {}
    for block, n in records_per_block.items():
        family = family_of(block)
        used[family] = used.get(family, 0) + n
    claimed: dict[int, int] = {}
    for cidr in blocks:
        family = family_of(cidr)
        claimed[family] = claimed.get(family, 0) + 1
    return {
        rs.family: Usage(used.get(rs.family, 0), rs.capacity(), claimed.get(rs.family, 0))
        for rs in spec.range_sets
    }


def holder(ip: str, record: AddressRecord) -> str:
    """Who holds an address, in a few words: pod (or network and container), interface,
    node, address."""
    pod = record.pod
    who = f"{pod.namespace}/{pod.name}" if pod.name else f"{record.network}/{record.container[:12]}"
    return f"{who} {record.ifname} on {record.node}: {ip}"


def status(
    obj: PoolObject,
    verdict: Verdict,
    served: PoolSpec | None,
    use: Mapping[int, Usage],
    held: tuple[int, Sequence[str]] | None,
    now: str,
) -> dict:
    """The status of `obj`: `verdict` on its spec; `served`, the ledger's pool of that
    name when it is the object's (with `use`, its usage); `held`, while it is being
    deleted, how many addresses still hold it and a few of their holders; `now`, the
    time of a condition that changes (one that does not keeps its time, so a status
    that did not change is equal to the one before)."""
    out: dict = {"observedGeneration": obj.generation}
    applied = obj.generation if verdict.reason == APPLIED else None
    if applied is None and served is not None:
        applied = obj.status.get("appliedGeneration")
    if applied is not None:
        out["appliedGeneration"] = applied
    if served is not None:
        out["ranges"] = ",".join(r.subnet for rs in served.range_sets for r in rs.ranges)
        out["used"] = max((u.used for u in use.values()), default=0)
        out["capacity"] = str(served.attachments_capacity())
        for family, u in sorted(use.items()):
            out[FAMILY_FIELDS[family]] = {
                "used": u.used,
                "capacity": str(u.capacity),
                "blocks": u.blocks,
            }
    else:
        given = obj.spec.get("ranges")
        subnets = (
            [r.get("subnet") for r in given if isinstance(r, dict)]
            if isinstance(given, list)
            else []
        )
        out["ranges"] = ",".join(str(s) for s in subnets)
    if held is not None:
        out["deletion"] = {"addresses": held[0], "heldBy": list(held[1])}
    ready = verdict.reason == APPLIED
    message = verdict.message
    if served is not None and verdict.reason in (INVALID, OVERLAPS, REFUSED):
        earlier = f"generation {applied}'s" if applied is not None else "an earlier"
        message += f"; the pool keeps serving {earlier} spec"
    overlaps = verdict.reason == OVERLAPS
    full = [
        f"IPv{f}" for f, u in sorted(use.items()) if served is not None and u.used >= u.capacity
    ]
    out["conditions"] = [
        _condition(obj, READY, ready, verdict.reason, message, now),
        _condition(
            obj,
            OVERLAPS,
            overlaps,
            OVERLAPS if overlaps else "NoOverlap",
            verdict.message if overlaps else "no other pool covers an address of its spec",
            now,
        ),
        _condition(
            obj,
            EXHAUSTED,
            bool(full),
            EXHAUSTED if full else "HasFree",
            f"every {' and '.join(full)} address is allocated" if full else "addresses are free",
            now,
        ),
    ]
    return out


def _condition(obj: PoolObject, kind: str, true: bool, reason: str, message: str, now: str) -> dict:
    value = "True" if true else "False"
    since = now
    for before in obj.status.get("conditions") or ():
        if (
            isinstance(before, dict)
            and before.get("type") == kind
            and before.get("status") == value
        ):
            since = str(before.get("lastTransitionTime") or now)
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "observedGeneration": obj.generation,
        "lastTransitionTime": since,
    }


def condition(obj: PoolObject, kind: str) -> dict | None:
    """The object's condition of that type, as its status has it (None: not written)."""
    for found in obj.status.get("conditions") or ():
        if isinstance(found, dict) and found.get("type") == kind:
            return found
    return None
