"""A pool: named range sets (one address per set, so one set per family for dual stack),
exclusions, routes, block size and cooldown. Stored as `pools/<name>`; built by the CLI
or from an inline CNI config (see `config`); created, changed and deleted through
`ipward.ipam.pools`.

What a pool covers is its layout: the range sets, exclusions and block sizes. A layout
has a version. An inline pool whose network config changes gets a new version; the
earlier layouts stay in the spec as `retired` while records may still hold their
addresses, so those records stay valid until their DEL, and nothing new is ever handed
out from them (see `ipam.pools.prune`). No two pools cover a common address, counting
retired layouts (`overlap`).
"""

from __future__ import annotations

from ipward.core.addr import (
    BITS,
    DEFAULT_BLOCK_PREFIX,
    V4,
    V6,
    Range,
    RangeSet,
    first_overlap,
    format_ip,
    merge_spans,
    parse_cidr,
    parse_ip,
)
from ipward.core.errors import InvalidConfig, PoolNotAllowed
from ipward.core.policy import DEFAULT_COOLDOWN, DEFAULT_RELEASE_DELAY, DEFAULT_WARM
from ipward.core.records import decode, encode

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from ipward.core.addr import Block

# The widest subnet a pool takes, per family: the largest private ranges (10.0.0.0/8,
# fd00::/8). Wider (a /0 is everything, loopback and multicast included) is a mistake.
MIN_PREFIX = {V4: 8, V6: 8}
MAX_SECONDS = 10**9
ACTIVE = "active"
DELETING = "deleting"  # `ipward pool delete` is removing it: no ADD may use it
# Who made a pool (its spec's `source`): `ipward pool create` on a store whose pools are
# not objects; a network config's inline ranges; an IPPool object (docs/design.md 5.16).
CLI = "cli"
CNI_CONFIG = "cni-config"
IPPOOL = "ippool"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
# Fields of the stored spec that the store keeps for itself; a declared spec (a CNI
# config) neither sets nor compares them.
_KEPT_BY_STORE = ("version", "retired", "state")


def check_name(name: object, what: str = "pool name") -> str:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
        raise InvalidConfig(f"{what} {name!r} must be letters, digits, '-', '_' or '.'")
    return name


def seconds(value: object, field: str) -> float:
    """A number of seconds, 0 to 10^9. Not a bool: `true` is not one second."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_SECONDS  # NaN fails this too
    ):
        raise InvalidConfig(f"{field} must be a number of seconds from 0 to 10^9, not {value!r}")
    return float(value)


def count(value: object, field: str) -> int:
    """A whole number >= 0, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfig(f"{field} must be a whole number >= 0, not {value!r}")
    return value


def check_routes(routes: object, where: str = "routes") -> list[dict]:
    """Routes as a CNI result carries them: `dst` a CIDR, `gw` (optional) an address of
    the same family. Other fields (CNI 1.1's mtu, table, ...) pass through."""
    if not isinstance(routes, list | tuple):
        raise InvalidConfig(f"{where} must be a list")
    out = []
    for i, route in enumerate(routes):
        if not isinstance(route, dict) or not isinstance(route.get("dst"), str):
            raise InvalidConfig(f"{where}[{i}] needs 'dst' (a CIDR): {route!r}")
        family = parse_cidr(route["dst"])[0]
        if "gw" in route:
            gw = route["gw"]
            try:
                gw_family = parse_ip(gw)[0] if isinstance(gw, str) else 0
            except InvalidConfig:
                gw_family = 0
            if gw_family == 0:
                raise InvalidConfig(f"{where}[{i}].gw {gw!r} is not an address")
            if gw_family != family:
                raise InvalidConfig(
                    f"{where}[{i}]: gw {gw} is IPv{gw_family}, dst {route['dst']} is IPv{family}"
                )
        out.append(dict(route))
    return out


def default_gateway(subnet: str) -> str | None:
    """host-local's rule, also the CLI's: the subnet's first address is the gateway,
    except in /31, /32, /127 and /128 subnets, which have no address to spare."""
    family, network, prefix = parse_cidr(subnet)
    if prefix >= BITS[family] - 1:
        return None
    return format_ip(family, network + 1)


def check_one_per_family(pools: Sequence[PoolSpec]) -> None:
    """A list of pools (`"pool": "a,b"`, annotations) gives one address per family, so
    it holds one pool per family."""
    serving: dict[int, str] = {}
    names = [pool.name for pool in pools]
    for name in names:
        if names.count(name) > 1:
            raise InvalidConfig(f"pool {name} is listed twice; a list of pools names each once")
    for pool in pools:
        for rs in pool.range_sets:
            other = serving.setdefault(rs.family, pool.name)
            if other != pool.name:
                raise InvalidConfig(
                    f"pools {other} and {pool.name} both serve IPv{rs.family}; a list of"
                    " pools takes one pool per family (an attachment gets one address of"
                    " each)"
                )


class Layout:
    """One version of what a pool covers: range sets (one per family), exclusions and
    block sizes."""

    __slots__ = ("block_prefix", "exclude", "range_sets", "version")

    def __init__(
        self,
        name: str,
        ranges: object,
        exclude: object = (),
        block_prefix: dict[int, int] | None = None,
        version: int = 0,
    ) -> None:
        self.version = count(version, "version")
        if not isinstance(exclude, list | tuple) or not all(isinstance(e, str) for e in exclude):
            raise InvalidConfig(f"pool {name}: exclude must be a list of CIDRs or addresses")
        self.exclude = list(exclude)
        self.block_prefix = dict(DEFAULT_BLOCK_PREFIX)
        for family, prefix in (block_prefix or {}).items():
            if isinstance(prefix, bool) or not isinstance(prefix, int):
                raise InvalidConfig(f"pool {name}: block size /{prefix!r} is not a prefix length")
            self.block_prefix[family] = prefix
        if not isinstance(ranges, list) or not ranges:
            raise InvalidConfig(f"pool {name}: no ranges")
        self.range_sets: list[RangeSet] = []
        for ranges_of_set in ranges:
            if not isinstance(ranges_of_set, list) or not ranges_of_set:
                raise InvalidConfig(f"pool {name}: each range set must be a non-empty list")
            built = [_range(r) for r in ranges_of_set]
            family = built[0].family
            self.range_sets.append(RangeSet(built, self.exclude, self.block_prefix[family]))
        families = [rs.family for rs in self.range_sets]
        if len(set(families)) != len(families):
            raise InvalidConfig(
                f"pool {name}: two range sets of one family; an attachment gets one address"
                " per family, so put ranges of one family in one set"
            )

    @classmethod
    def from_dict(cls, name: str, d: object) -> Layout:
        if not isinstance(d, dict):
            raise InvalidConfig(f"pool {name}: a layout must be an object")
        return cls(
            name, d.get("ranges", []), d.get("exclude", []), _block_sizes(d), d.get("version", 0)
        )

    def to_dict(self) -> dict:
        return {
            "ranges": [[r.to_dict() for r in rs.ranges] for rs in self.range_sets],
            "exclude": self.exclude,
            "blockSize": {"4": self.block_prefix[V4], "6": self.block_prefix[V6]},
        }

    def set_of(self, family: int) -> RangeSet | None:
        for rs in self.range_sets:
            if rs.family == family:
                return rs
        return None

    def usable(self, family: int, value: int) -> bool:
        rs = self.set_of(family)
        return rs is not None and rs.usable(value)


class PoolSpec:
    __slots__ = (
        "block_prefix",
        "borrow",
        "cooldown",
        "exclude",
        "layout",
        "name",
        "namespaces",
        "nodes",
        "range_sets",
        "release_delay",
        "retired",
        "revision",
        "routes",
        "source",
        "state",
        "warm",
    )

    def __init__(
        self,
        name: str,
        ranges: list[list[dict]],
        exclude: Sequence[str] = (),
        routes: Sequence[dict] = (),
        cooldown: float = DEFAULT_COOLDOWN,
        block_prefix: dict[int, int] | None = None,
        source: str = CLI,
        warm: int = DEFAULT_WARM,
        release_delay: float = DEFAULT_RELEASE_DELAY,
        borrow: bool = False,
        namespaces: Sequence[str] = (),
        nodes: Sequence[str] = (),
        version: int = 0,
        retired: Sequence[Layout] = (),
        state: str = ACTIVE,
    ) -> None:
        self.name = check_name(name)
        # Who may use the pool: pod namespaces and nodes (empty: any).
        self.namespaces = _names(namespaces, "namespaces")
        self.nodes = _names(nodes, "nodes")
        self.routes = check_routes(routes)
        self.cooldown = seconds(cooldown, "cooldown")
        self.source = source
        self.warm = count(warm, "warm")
        self.release_delay = seconds(release_delay, "release_delay")
        if not isinstance(borrow, bool):
            raise InvalidConfig(f"borrow must be true or false, not {borrow!r}")
        self.borrow = borrow
        if state not in (ACTIVE, DELETING):
            raise InvalidConfig(f"pool {name}: state {state!r} is not {ACTIVE} or {DELETING}")
        self.state = state
        self.layout = Layout(self.name, ranges, exclude, block_prefix, version)
        self.range_sets = self.layout.range_sets
        self.exclude = self.layout.exclude
        self.block_prefix = self.layout.block_prefix
        # Earlier layouts whose addresses records may still hold (newest last).
        self.retired = list(retired)
        # mod_revision of `pools/<name>` when the spec was read from the store; None for a
        # spec declared by its user (a CNI config), which the allocation stores itself.
        self.revision: int | None = None

    @property
    def version(self) -> int:
        """The layout's version: a block cursor or block `next` of another version
        indexes other ranges and is not used."""
        return self.layout.version

    @property
    def deleting(self) -> bool:
        return self.state == DELETING

    @property
    def inline(self) -> bool:
        """Declared by a network config's inline ranges (not a pool made on purpose)."""
        return self.source == CNI_CONFIG

    @classmethod
    def from_dict(cls, d: dict) -> PoolSpec:
        if not isinstance(d, dict):
            raise InvalidConfig("pool spec must be an object")
        name = check_name(d.get("name"))
        retired = d.get("retired", [])
        if not isinstance(retired, list):
            raise InvalidConfig(f"pool {name}: retired must be a list of layouts")
        return cls(
            name=name,
            ranges=d.get("ranges", []),
            exclude=d.get("exclude", []),
            routes=d.get("routes", []),
            cooldown=d.get("cooldown", DEFAULT_COOLDOWN),
            block_prefix=_block_sizes(d),
            source=d.get("source", CLI),
            warm=d.get("warm", DEFAULT_WARM),
            release_delay=d.get("releaseDelay", DEFAULT_RELEASE_DELAY),
            borrow=d.get("borrow", False),
            namespaces=d.get("namespaces", []),
            nodes=d.get("nodes", []),
            version=d.get("version", 0),
            retired=[Layout.from_dict(name, r) for r in retired],
            state=d.get("state", ACTIVE),
        )

    @classmethod
    def decode(cls, raw: bytes) -> PoolSpec:
        """A stored spec (`pools/<name>`); raises InvalidConfig or ValueError when it is
        not one."""
        return cls.from_dict(decode(raw))

    def encode(self) -> bytes:
        return encode(self.to_dict())

    def to_dict(self) -> dict:
        return {
            **self.declaration(),
            **({"version": self.version} if self.version else {}),
            **(
                {"retired": [{**r.to_dict(), "version": r.version} for r in self.retired]}
                if self.retired
                else {}
            ),
            **({"state": self.state} if self.state != ACTIVE else {}),
        }

    def declaration(self) -> dict:
        """What its user declares (the CLI's options, a CNI config's ipam section):
        the stored spec without what the store keeps for itself (version, retired
        layouts, state)."""
        return {
            "name": self.name,
            **self.layout.to_dict(),
            "routes": self.routes,
            "cooldown": self.cooldown,
            "source": self.source,
            "warm": self.warm,
            "releaseDelay": self.release_delay,
            "borrow": self.borrow,
            **({"namespaces": self.namespaces} if self.namespaces else {}),
            **({"nodes": self.nodes} if self.nodes else {}),
        }

    def same_layout(self, other: PoolSpec) -> bool:
        return self.layout.to_dict() == other.layout.to_dict()

    def succeed(self, stored: PoolSpec) -> bool:
        """Make this declaration the next version of `stored` (docs/design.md 5.7): it
        takes the stored layout version and retired layouts; a layout other than the
        stored one becomes a new version, the stored layout retired (records may hold
        its addresses). True when the layout changed (the overlap test is then due)."""
        self.retired = list(stored.retired)
        self.layout.version = stored.version
        if self.same_layout(stored):
            return False
        self.retired.append(stored.layout)
        self.layout.version = stored.version + 1
        return True

    def check_allowed(self, namespace: str, node: str) -> None:
        """Raise PoolNotAllowed when the pool does not serve this pod's namespace or
        this node."""
        if self.namespaces and namespace not in self.namespaces:
            raise PoolNotAllowed(
                f"pool {self.name} serves namespaces {', '.join(self.namespaces)}, not"
                f" {namespace or '(no namespace given)'}"
            )
        if self.nodes and node not in self.nodes:
            raise PoolNotAllowed(
                f"pool {self.name} serves nodes {', '.join(self.nodes)}, not {node}"
            )

    def set_of(self, value_family: int) -> int | None:
        """Index of the range set of this family, if the pool has one."""
        for i, rs in enumerate(self.range_sets):
            if rs.family == value_family:
                return i
        return None

    def usable(self, family: int, value: int) -> bool:
        """May this pool hand the address out now (its current layout)."""
        return self.layout.usable(family, value)

    def explains(self, family: int, value: int) -> bool:
        """May a record of this pool hold the address: usable now, or in a retired
        layout (an allocation made before the pool's last change)."""
        return self.usable(family, value) or any(r.usable(family, value) for r in self.retired)

    def layouts(self) -> list[Layout]:
        return [self.layout, *self.retired]

    def block_by_cidr(self, cidr: str) -> Block | None:
        """The block of the current layout with this CIDR, or None (not a block of it)."""
        for rs in self.range_sets:
            block = rs.block_by_cidr(cidr)
            if block is not None:
                return block
        return None

    def attachments_capacity(self) -> int:
        """How many attachments fit: each takes one address of every range set."""
        return min(rs.capacity() for rs in self.range_sets)


def coverage(layouts: Sequence[Layout], family: int) -> list[tuple[int, int]]:
    """Sorted disjoint spans of the addresses some layout covers in one family."""
    sets = [rs for rs in (lay.set_of(family) for lay in layouts) if rs is not None]
    return merge_spans([span for rs in sets for span in rs.spans()])


def overlap(spec: PoolSpec, other: PoolSpec) -> str | None:
    """Why `spec` may not be stored next to `other`: the first addresses both cover
    (current or retired layouts of either), or None when they share none."""
    mine = spec.layouts()
    for theirs, earlier in ((other.layout, False), *((r, True) for r in other.retired)):
        for family in (V4, V6):
            common = first_overlap(coverage(mine, family), coverage([theirs], family))
            if common is not None:
                lo, hi = (format_ip(family, v) for v in common)
                where = lo if lo == hi else f"{lo}-{hi}"
                held = (
                    f" (an earlier version of {other.name}, whose addresses records still"
                    " hold; it is pruned once none does: the controller's pass or"
                    " 'ipward check --remove-orphans')"
                    if earlier
                    else ""
                )
                return f"pool {spec.name} would overlap pool {other.name}: both cover {where}{held}"
    return None


def _block_sizes(d: dict) -> dict[int, int]:
    block = d.get("blockSize", {})
    if not isinstance(block, dict):
        raise InvalidConfig('blockSize must be like {"4": 26, "6": 122}')
    return {
        V4: block.get("4", DEFAULT_BLOCK_PREFIX[V4]),
        V6: block.get("6", DEFAULT_BLOCK_PREFIX[V6]),
    }


def _names(value: object, field: str) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise InvalidConfig(f"{field} must be a list of names")
    return list(value)


def _range(r: object) -> Range:
    if not isinstance(r, dict) or not isinstance(r.get("subnet"), str):
        raise InvalidConfig(f"a range needs a 'subnet' (CIDR): {r!r}")
    for field in ("rangeStart", "rangeEnd", "gateway"):
        if field in r and not isinstance(r[field], str):
            raise InvalidConfig(f"range field {field} must be an address string")
    family, _, prefix = parse_cidr(r["subnet"])
    if prefix < MIN_PREFIX[family]:
        raise InvalidConfig(
            f"subnet {r['subnet']} is wider than a pool takes: IPv4 /{MIN_PREFIX[V4]} to /32,"
            f" IPv6 /{MIN_PREFIX[V6]} to /128"
        )
    return Range(r["subnet"], r.get("rangeStart"), r.get("rangeEnd"), r.get("gateway"))


__all__ = [
    "CLI",
    "CNI_CONFIG",
    "IPPOOL",
    "V6",
    "Layout",
    "PoolSpec",
    "check_name",
    "coverage",
    "overlap",
]
