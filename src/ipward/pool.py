"""A pool: named range sets (one address per set, so one set per family for dual stack),
exclusions, routes, block size and cooldown. Stored as `pools/<name>`; built by the CLI
or from an inline CNI config (see `config`)."""

from __future__ import annotations

from ipward.addr import DEFAULT_BLOCK_PREFIX, V4, V6, Range, RangeSet
from ipward.errors import InvalidConfig, PoolNotAllowed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

DEFAULT_COOLDOWN = 30.0
DEFAULT_WARM = 16  # free addresses the controller keeps on every node, per family
DEFAULT_RELEASE_DELAY = 180.0  # how long a surplus block stays empty before it is asked back
# A block's release compares each of its addresses absent in one etcd transaction, whose
# compares etcd caps at 128 by default: larger blocks are never asked back.
MAX_RELEASABLE_BLOCK = 128
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def check_name(name: object, what: str = "pool name") -> str:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
        raise InvalidConfig(f"{what} {name!r} must be letters, digits, '-', '_' or '.'")
    return name


class PoolSpec:
    __slots__ = (
        "block_prefix",
        "borrow",
        "cooldown",
        "exclude",
        "name",
        "namespaces",
        "nodes",
        "range_sets",
        "release_delay",
        "revision",
        "routes",
        "source",
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
        source: str = "cli",
        warm: int = DEFAULT_WARM,
        release_delay: float = DEFAULT_RELEASE_DELAY,
        borrow: bool = False,
        namespaces: Sequence[str] = (),
        nodes: Sequence[str] = (),
    ) -> None:
        self.name = check_name(name)
        # Who may use the pool: pod namespaces and nodes (empty: any).
        self.namespaces = _names(namespaces, "namespaces")
        self.nodes = _names(nodes, "nodes")
        self.exclude = [str(e) for e in exclude]
        self.routes = [dict(r) for r in routes]
        if not isinstance(cooldown, int | float) or not 0 <= cooldown <= 10**9:  # NaN too
            raise InvalidConfig(f"cooldown must be a number of seconds >= 0, not {cooldown!r}")
        self.cooldown = float(cooldown)
        self.block_prefix = dict(DEFAULT_BLOCK_PREFIX)
        self.block_prefix.update(block_prefix or {})
        self.source = source
        if not isinstance(warm, int) or warm < 0:
            raise InvalidConfig(f"warm must be a number of addresses >= 0, not {warm!r}")
        if not isinstance(release_delay, int | float) or not 0 <= release_delay <= 10**9:
            raise InvalidConfig(f"release_delay must be seconds >= 0, not {release_delay!r}")
        if not isinstance(borrow, bool):
            raise InvalidConfig(f"borrow must be true or false, not {borrow!r}")
        self.warm = warm
        self.release_delay = float(release_delay)
        self.borrow = borrow
        # mod_revision of `pools/<name>` when the spec was read from the store; None for a
        # spec declared by its user (a CNI config), which the allocation stores itself.
        self.revision: int | None = None
        if not ranges:
            raise InvalidConfig(f"pool {name}: no ranges")
        self.range_sets = []
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
    def from_dict(cls, d: dict) -> PoolSpec:
        if not isinstance(d, dict):
            raise InvalidConfig("pool spec must be an object")
        block = d.get("blockSize", {})
        if not isinstance(block, dict) or not all(isinstance(v, int) for v in block.values()):
            raise InvalidConfig('blockSize must be like {"4": 26, "6": 122}')
        return cls(
            name=d.get("name"),  # type: ignore[arg-type]
            ranges=d.get("ranges", []),
            exclude=d.get("exclude", []),
            routes=d.get("routes", []),
            cooldown=d.get("cooldown", DEFAULT_COOLDOWN),
            block_prefix={
                V4: block.get("4", DEFAULT_BLOCK_PREFIX[V4]),
                V6: block.get("6", DEFAULT_BLOCK_PREFIX[V6]),
            },
            source=d.get("source", "cli"),
            warm=d.get("warm", DEFAULT_WARM),
            release_delay=d.get("releaseDelay", DEFAULT_RELEASE_DELAY),
            borrow=d.get("borrow", False),
            namespaces=d.get("namespaces", []),
            nodes=d.get("nodes", []),
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "ranges": [[r.to_dict() for r in rs.ranges] for rs in self.range_sets],
            "exclude": self.exclude,
            "routes": self.routes,
            "cooldown": self.cooldown,
            "blockSize": {"4": self.block_prefix[V4], "6": self.block_prefix[V6]},
            "source": self.source,
            "warm": self.warm,
            "releaseDelay": self.release_delay,
            "borrow": self.borrow,
            **({"namespaces": self.namespaces} if self.namespaces else {}),
            **({"nodes": self.nodes} if self.nodes else {}),
        }

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

    def attachments_capacity(self) -> int:
        """How many attachments fit: each takes one address of every range set."""
        return min(rs.capacity() for rs in self.range_sets)


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
    return Range(r["subnet"], r.get("rangeStart"), r.get("rangeEnd"), r.get("gateway"))


__all__ = ["V6", "PoolSpec", "check_name"]
