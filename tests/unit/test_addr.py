"""Property tests of the address math (`ipward.addr`) and `PoolSpec`, with Python's
`ipaddress` as the independent oracle.

The product avoids `ipaddress` for import speed; the tests use it to parse, to bound
networks and to enumerate small subnets, so a wrong shift, an off-by-one at a block or
range edge, or a miscounted gateway/exclusion shows up as a disagreement.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ipward.core.addr import (
    BITS,
    V4,
    V6,
    Block,
    Range,
    RangeSet,
    first_overlap,
    format_ip,
    parse_cidr,
    parse_ip,
)
from ipward.core.errors import InvalidConfig
from ipward.core.pool import PoolSpec, overlap

# Documented defaults (module docstring of ipward.addr): /26 for IPv4, /122 for IPv6.
DEFAULT_BLOCK = {V4: 26, V6: 122}
ADDRESS = {V4: ipaddress.IPv4Address, V6: ipaddress.IPv6Address}
NETWORK = {V4: ipaddress.IPv4Network, V6: ipaddress.IPv6Network}
TOP = {V4: 2**32 - 1, V6: 2**128 - 1}
# Interesting places for a parent network, besides random ones: the ends of the address
# space, private space, IPv4-mapped and IPv4-compatible IPv6, documentation space.
EDGES = {
    V4: [0, 10 << 24, 0xC0A80000, 0xFFFFFFFF],
    V6: [0, TOP[V6], 0xFD00 << 112, 0xFFFF << 32, 1 << 32, 0x20010DB8 << 96],
}
# Exclusions of the other family belong to the other set and must be ignored.
OTHER_FAMILY_EXCLUDES = {V4: ["::/0", "::", "fd00::/8"], V6: ["0.0.0.0/0", "10.0.0.1"]}
STYLES = ["compressed", "exploded", "upper"]

# IPv6 addresses that glibc's inet_ntop writes with a dotted IPv4 tail (::a.b.c.d and
# ::ffff:a.b.c.d) while `ipaddress` (3.11) writes hex.
COMPAT_NET = ipaddress.IPv6Network("::/96")
MAPPED_NET = ipaddress.IPv6Network("::ffff:0:0/96")


def addr(family: int, value: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ADDRESS[family](value)


def render(family: int, value: int, style: str = "compressed") -> str:
    """Address text in one of several standard notations (all must parse alike)."""
    a = addr(family, value)
    if style == "exploded":
        return a.exploded
    if style == "upper":
        return str(a).upper()
    return str(a)


def clamp(value: int, family: int) -> int:
    return min(max(value, 0), TOP[family])


def dotted_by_ntop(a: ipaddress.IPv6Address) -> bool:
    return (a in COMPAT_NET and int(a) >= 1 << 16) or a in MAPPED_NET


# -- random range sets ----------------------------------------------------------------


@dataclass(frozen=True)
class RangeSpec:
    subnet: str
    start: str | None = None
    end: str | None = None
    gateway: str | None = None

    def build(self) -> Range:
        return Range(self.subnet, self.start, self.end, self.gateway)

    def as_dict(self) -> dict:
        d = {"subnet": self.subnet}
        for key, value in (("rangeStart", self.start), ("rangeEnd", self.end)):
            if value is not None:
                d[key] = value
        if self.gateway is not None:
            d["gateway"] = self.gateway
        return d


@dataclass(frozen=True)
class SetSpec:
    family: int
    parent: ipaddress.IPv4Network | ipaddress.IPv6Network
    ranges: tuple[RangeSpec, ...]
    excludes: tuple[str, ...]
    block_prefix: int | None

    def build(self) -> RangeSet:
        return RangeSet([r.build() for r in self.ranges], self.excludes, self.block_prefix)


@st.composite
def exclude_texts(draw: st.DrawFn, family: int, parent: int, host: int) -> str:
    bits = BITS[family]
    style = draw(st.sampled_from(STYLES))
    kind = draw(st.sampled_from(["address", "cidr", "cidr", "other family"]))
    if kind == "other family":
        return draw(st.sampled_from(OTHER_FAMILY_EXCLUDES[family]))
    if kind == "address":
        value = clamp(parent + draw(st.integers(-2, (1 << host) + 1)), family)
        return render(family, value, style)
    # A CIDR near or over the parent, possibly wider than it, written with host bits set.
    prefix = draw(st.integers(max(0, bits - host - 1), bits))
    value = clamp(parent + draw(st.integers(-(1 << (bits - prefix)), (1 << host) + 1)), family)
    return f"{render(family, value, style)}/{prefix}"


@st.composite
def set_specs(
    draw: st.DrawFn,
    *,
    disjoint: bool,
    valid: bool = False,
    family: int | None = None,
    max_ranges: int = 3,
) -> SetSpec:
    """Ranges carved out of one parent network of at most 1024 addresses.

    `disjoint`: the ranges' subnets never overlap (else they may be equal or nested, and
    only start/end keep them apart, if anything does). `valid`: start/end are ordered and
    inside the usable window, so every range can be built."""
    if family is None:
        family = draw(st.sampled_from([V4, V6]))
    bits = BITS[family]
    host = draw(st.integers(0, 10))
    raw = draw(st.one_of(st.integers(0, TOP[family]), st.sampled_from(EDGES[family])))
    parent = raw >> host << host
    ranges: list[RangeSpec] = []
    taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for _ in range(draw(st.integers(1, max_ranges))):
        child = draw(st.integers(0, host))
        network = parent + (draw(st.integers(0, (1 << (host - child)) - 1)) << child)
        net = NETWORK[family]((network, bits - child))
        if disjoint and any(net.overlaps(t) for t in taken):
            continue
        taken.append(net)
        size = 1 << child
        lo, hi = 0, size - 1
        if valid and bits - child < bits - 1:
            lo, hi = 1, size - 2 if family == V4 else size - 1
        offsets = st.integers(lo, hi)
        start = draw(st.none() | offsets)
        end = draw(st.none() | offsets)
        if start is not None and end is not None and (valid or draw(st.integers(0, 3))):
            start, end = sorted((start, end))
        gateway = draw(st.none() | st.integers(0, size - 1))
        host_bits = draw(st.integers(0, size - 1)) if draw(st.booleans()) else 0

        def text(offset: int | None, network: int = network) -> str | None:
            if offset is None:
                return None
            return render(family, network + offset, draw(st.sampled_from(STYLES)))

        subnet = f"{text(host_bits)}/{bits - child}"
        ranges.append(RangeSpec(subnet, text(start), text(end), text(gateway)))
    excludes = draw(st.lists(exclude_texts(family, parent, host), max_size=4))
    block_prefix = draw(st.none() | st.integers(max(1, bits - host - 2), bits))
    return SetSpec(
        family, NETWORK[family]((parent, bits - host)), tuple(ranges), tuple(excludes), block_prefix
    )


# -- the oracle -----------------------------------------------------------------------


@dataclass
class RangeOracle:
    net: ipaddress.IPv4Network | ipaddress.IPv6Network
    window: list[int]  # inside start/end, minus network (and IPv4 broadcast) address
    allowed: set[int]  # window minus gateway minus exclusions


def oracle_of(spec: SetSpec) -> list[RangeOracle]:
    excluded = []
    for text in spec.excludes:
        n = ipaddress.ip_network(text, strict=False)  # a bare address is a /32 or /128
        if n.version == spec.family:
            excluded.append((int(n.network_address), int(n.broadcast_address)))
    out = []
    for r in spec.ranges:
        net = ipaddress.ip_network(r.subnet, strict=False)
        start = int(ipaddress.ip_address(r.start)) if r.start else None
        end = int(ipaddress.ip_address(r.end)) if r.end else None
        gateway = int(ipaddress.ip_address(r.gateway)) if r.gateway else None
        network, broadcast = int(net.network_address), int(net.broadcast_address)
        window = []
        for a in range(network, broadcast + 1):
            if a == network and net.prefixlen < net.max_prefixlen - 1:
                continue  # the network address (IPv6: subnet-router anycast)
            if a == broadcast and net.version == 4 and net.prefixlen < 31:
                continue
            if (start is not None and a < start) or (end is not None and a > end):
                continue
            window.append(a)
        allowed = {
            a for a in window if a != gateway and not any(lo <= a <= hi for lo, hi in excluded)
        }
        out.append(RangeOracle(net, window, allowed))
    return out


def walk(block: Block) -> list[int]:
    """Offsets reached by walking next_usable from 0."""
    offsets: list[int] = []
    offset = block.next_usable(0)
    while offset is not None:
        assert 0 <= offset < block.size
        assert not offsets or offset > offsets[-1]
        offsets.append(offset)
        offset = block.next_usable(offset + 1)
    return offsets


def build_or_expect_error(spec: SetSpec) -> tuple[RangeSet, list[RangeOracle]] | None:
    """Build the set, or check it is rejected exactly when the oracle says it must be."""
    orc = oracle_of(spec)
    for r, o in zip(spec.ranges, orc, strict=True):
        if not o.window:
            with pytest.raises(InvalidConfig):
                r.build()
    if any(not o.window for o in orc):
        event("rejected: a range has no usable window")
        return None
    # Blocks are named by CIDR: ranges whose aligned block spans meet are rejected
    # (overlapping windows are the plainest case of it).
    block_prefix = spec.block_prefix or DEFAULT_BLOCK[spec.family]
    spans = []
    for o in orc:
        prefix = max(block_prefix, o.net.prefixlen)
        lo = ipaddress.ip_network((o.window[0], prefix), strict=False).network_address
        hi = ipaddress.ip_network((o.window[-1], prefix), strict=False).broadcast_address
        spans.append((int(lo), int(hi)))
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if a[0] <= b[1] and b[0] <= a[1]:
                with pytest.raises(InvalidConfig, match="overlap or share"):
                    spec.build()
                event("rejected: ranges share a block")
                return None
    event(f"built: {len(spec.ranges)} range(s), IPv{spec.family}")
    return spec.build(), orc


def check_against_oracle(spec: SetSpec, rs: RangeSet, orc: list[RangeOracle]) -> None:
    family, bits = spec.family, BITS[spec.family]
    assert rs.family == family
    allowed = set().union(*(o.allowed for o in orc))
    assert rs.capacity() == len(allowed)
    for r, o in zip(rs.ranges, orc, strict=True):
        assert rs.range_capacity(r) == len(o.allowed)

    # Expected blocks: per range in order, every aligned block meeting its window.
    block_prefix = spec.block_prefix or DEFAULT_BLOCK[family]
    expected = []
    for i, o in enumerate(orc):
        prefix = max(block_prefix, o.net.prefixlen)
        first, last = (
            ipaddress.ip_network((a, prefix), strict=False) for a in (o.window[0], o.window[-1])
        )
        step = first.num_addresses
        bases = range(int(first.network_address), int(last.network_address) + 1, step)
        expected += [(i, base, prefix) for base in bases]
    assert rs.block_count() == len(expected)

    found_in: dict[int, Block] = {}
    for j in range(rs.block_count()):
        b = rs.block(j)
        assert b is not None
        i = rs.ranges.index(b.range)
        assert (i, b.base, bits - b.bits) == expected[j]
        # Aligned to its size (strict parse) and inside the range's subnet.
        bnet = ipaddress.ip_network(b.cidr, strict=True)
        assert (int(bnet.network_address), bnet.num_addresses) == (b.base, b.size)
        assert bnet.subnet_of(orc[i].net)
        offsets = walk(b)
        for off in offsets:
            v = b.base + off
            assert v in orc[i].allowed
            assert v not in found_in, f"{addr(family, v)} is in two blocks"
            found_in[v] = b
            assert parse_ip(b.address(off)) == (family, v)
        assert b.usable_count() == len(offsets)
        # next_usable(k) is the first reachable offset >= k, for every k.
        pending = iter([*offsets, None])
        nxt = next(pending)
        for k in range(b.size + 1):
            if nxt is not None and nxt < k:
                nxt = next(pending)
            assert b.next_usable(k) == nxt
    assert rs.block(rs.block_count()) is None
    assert set(found_in) == allowed

    # usable / block_of over the whole parent and a little around it.
    lo = clamp(int(spec.parent.network_address) - 2, family)
    hi = clamp(int(spec.parent.broadcast_address) + 2, family)
    for v in range(lo, hi + 1):
        assert rs.usable(v) == (v in allowed), addr(family, v)
        got = rs.block_of(v)
        if v in allowed:
            want = found_in[v]
            assert got is not None
            assert (got.range, got.base, got.bits) == (want.range, want.base, want.bits)
            assert got.base <= v < got.base + got.size
        else:
            assert got is None, addr(family, v)


def check_block_cidrs(spec: SetSpec, rs: RangeSet, orc: list[RangeOracle]) -> None:
    """Blocks are named by CIDR (store keys): names are unique and resolve back."""
    family, bits = spec.family, BITS[spec.family]
    blocks = [rs.block(j) for j in range(rs.block_count())]
    assert len({b.cidr for b in blocks if b}) == len(blocks)
    for b in blocks:
        assert b is not None
        back = rs.block_by_cidr(b.cidr)
        assert back is not None
        assert (back.range, back.base, back.bits) == (b.range, b.base, b.bits)
        if b.bits > 0:  # the wrong size never names a block
            assert rs.block_by_cidr(f"{addr(family, b.base)}/{bits - b.bits + 1}") is None
    other = "10.0.0.0/8" if family == V6 else "::/0"
    assert rs.block_by_cidr(other) is None
    # Every aligned block-sized CIDR of each subnet: a block iff it meets the window.
    names = {b.cidr for b in blocks if b}
    block_prefix = spec.block_prefix or DEFAULT_BLOCK[family]
    for o in orc:
        for sub in o.net.subnets(new_prefix=max(block_prefix, o.net.prefixlen)):
            got = rs.block_by_cidr(str(sub))
            # a block of any range of that block size (subnets may overlap)
            meets = any(
                max(block_prefix, o2.net.prefixlen) == sub.prefixlen
                and int(sub.network_address) <= o2.window[-1]
                and o2.window[0] <= int(sub.broadcast_address)
                for o2 in orc
            )
            assert (got is not None) == meets, sub
            if got is not None:
                assert got.cidr in names


def check_jumps_and_spans(spec: SetSpec, rs: RangeSet, orc: list[RangeOracle]) -> None:
    """`next_usable_block(j)` is the first block >= j that `walk` finds an address in;
    `spans()` covers exactly each range's window minus exclusions, plus its gateway."""
    has_address = [bool(walk(b)) for b in (rs.block(j) for j in range(rs.block_count())) if b]
    for j in range(-1, rs.block_count() + 2):
        want = next((k for k in range(max(j, 0), len(has_address)) if has_address[k]), None)
        assert rs.next_usable_block(j) == want, j
    spans = rs.spans()
    assert all(lo <= hi for lo, hi in spans)
    assert all(a[1] + 1 < b[0] for a, b in itertools.pairwise(spans))  # merged
    assert {a for lo, hi in spans for a in range(lo, hi + 1)} == covered_by_oracle(spec, orc)


def covered_by_oracle(spec: SetSpec, orc: list[RangeOracle]) -> set[int]:
    """What a set covers for the overlap test: each range's window minus exclusions,
    and its gateway."""
    excluded = [
        (int(n.network_address), int(n.broadcast_address))
        for n in (ipaddress.ip_network(text, strict=False) for text in spec.excludes)
        if n.version == spec.family
    ]
    gateways = {parse_ip(r.gateway)[1] for r in spec.ranges if r.gateway}
    windows = {a for o in orc for a in o.window}
    return {a for a in windows if not any(lo <= a <= hi for lo, hi in excluded)} | gateways


@settings(max_examples=400, deadline=None)
@given(set_specs(disjoint=True))
def test_range_set_matches_oracle(spec: SetSpec) -> None:
    built = build_or_expect_error(spec)
    if built is not None:
        rs, orc = built
        check_against_oracle(spec, rs, orc)
        check_block_cidrs(spec, rs, orc)
        check_jumps_and_spans(spec, rs, orc)


@settings(max_examples=400, deadline=None)
@given(set_specs(disjoint=False))
def test_range_set_with_overlapping_subnets(spec: SetSpec) -> None:
    """Subnets may be equal or nested; start/end windows that overlap are rejected, and
    disjoint windows behave exactly like separate ranges (addresses, counts, blocks).
    Ranges that would share a block are rejected (blocks are named by CIDR)."""
    built = build_or_expect_error(spec)
    if built is not None:
        check_against_oracle(spec, *built)
        check_block_cidrs(spec, *built)
        check_jumps_and_spans(spec, *built)


@settings(max_examples=100, deadline=None)
@given(
    set_specs(disjoint=True, valid=True, family=V4),
    set_specs(disjoint=True, valid=True, family=V6),
    st.booleans(),
)
def test_mixed_families_in_one_set_are_rejected(a: SetSpec, b: SetSpec, v6_first: bool) -> None:
    ranges = [r.build() for r in a.ranges] + [r.build() for r in b.ranges]
    if v6_first:
        ranges.reverse()
    with pytest.raises(InvalidConfig):
        RangeSet(ranges)


# -- plain examples of ranges and sets ----------------------------------------------


@pytest.mark.parametrize(
    ("subnet", "first", "last"),
    [
        ("10.0.0.0/24", "10.0.0.1", "10.0.0.254"),
        ("10.0.0.0/30", "10.0.0.1", "10.0.0.2"),
        ("10.0.0.0/31", "10.0.0.0", "10.0.0.1"),  # RFC 3021: both usable
        ("10.0.0.7/32", "10.0.0.7", "10.0.0.7"),
        ("10.1.2.3/24", "10.1.2.1", "10.1.2.254"),  # host bits cleared
        ("fd00::/64", "fd00::1", "fd00::ffff:ffff:ffff:ffff"),  # no broadcast in IPv6
        ("fd00::/126", "fd00::1", "fd00::3"),
        ("fd00::/127", "fd00::", "fd00::1"),
        ("fd00::5/128", "fd00::5", "fd00::5"),
    ],
)
def test_range_default_bounds(subnet: str, first: str, last: str) -> None:
    r = Range(subnet)
    assert (format_ip(r.family, r.start), format_ip(r.family, r.end)) == (first, last)
    again = Range(subnet, r.to_dict()["rangeStart"], r.to_dict()["rangeEnd"])
    assert (again.start, again.end) == (r.start, r.end)


def test_range_start_and_end_clamped_to_usable_window() -> None:
    r = Range("10.0.0.0/24", start="10.0.0.0", end="10.0.0.255")
    assert (r.start, r.end) == (parse_ip("10.0.0.1")[1], parse_ip("10.0.0.254")[1])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"subnet": "10.0.0.0/24", "gateway": "10.0.1.1"},
        {"subnet": "10.0.0.0/24", "gateway": "fd00::1"},
        {"subnet": "10.0.0.0/24", "start": "10.0.1.0"},
        {"subnet": "10.0.0.0/24", "end": "9.255.255.255"},
        {"subnet": "10.0.0.0/24", "start": "10.0.0.9", "end": "10.0.0.8"},
        {"subnet": "10.0.0.0/24", "start": "10.0.0.255"},  # only the broadcast left
        {"subnet": "10.0.0.0/24", "end": "10.0.0.0"},  # only the network address left
        {"subnet": "fd00::/64", "start": "fd00::9", "end": "fd00::8"},
        {"subnet": "fd00::/64", "end": "fd00::"},
        {"subnet": "fd00::/64", "gateway": "fd00:0:0:1::1"},
        {"subnet": "10.0.0.0"},
        {"subnet": "10.0.0.0/33"},
        {"subnet": "fd00::/129"},
        {"subnet": "10.0.0.0/24", "start": "not an address"},
    ],
)
def test_range_rejects(kwargs: dict) -> None:
    with pytest.raises(InvalidConfig):
        Range(**kwargs)


def test_overlapping_ranges_are_rejected() -> None:
    for a, b in [
        (Range("10.0.0.0/24"), Range("10.0.0.128/25")),
        (Range("10.0.0.0/24"), Range("10.0.0.0/24")),
        (Range("10.0.0.0/24", end="10.0.0.10"), Range("10.0.0.0/24", start="10.0.0.10")),
        (Range("fd00::/64"), Range("fd00::/120")),
    ]:
        with pytest.raises(InvalidConfig, match="overlap"):
            RangeSet([a, b])
    with pytest.raises(InvalidConfig):
        RangeSet([])
    with pytest.raises(InvalidConfig):
        RangeSet([Range("10.0.0.0/24"), Range("fd00::/64")])


def test_small_set_by_hand() -> None:
    rs = RangeSet(
        [Range("192.168.1.0/28", gateway="192.168.1.1")],
        excludes=["192.168.1.4/31", "192.168.1.9", "fd00::/8"],
        block_prefix=30,
    )
    # .1 gateway, .4-.5 excluded, .9 excluded, .0/.15 network/broadcast.
    usable = {2, 3, 6, 7, 8, 10, 11, 12, 13, 14}
    assert rs.capacity() == len(usable)
    assert rs.block_count() == 4
    assert [rs.block(j).cidr for j in range(4)] == [  # type: ignore[union-attr]
        f"192.168.1.{4 * j}/30" for j in range(4)
    ]
    b1 = rs.block(1)
    assert b1 is not None
    assert (b1.next_usable(0), b1.usable_count(), b1.address(2)) == (2, 2, "192.168.1.6")
    b3 = rs.block(3)
    assert b3 is not None
    assert (b3.next_usable(3), b3.usable_count()) == (None, 3)


# -- ranges sharing a block --------------------------------------------------------


@pytest.mark.parametrize(
    "ranges",
    [
        [("10.0.0.0/30", None, "10.0.0.1"), ("10.0.0.0/30", "10.0.0.2", None)],
        [("10.0.0.0/30", None, None), ("10.0.0.0/29", "10.0.0.5", None)],
        [("10.0.0.0/24", "10.0.0.10", "10.0.0.20"), ("10.0.0.0/24", "10.0.0.30", "10.0.0.40")],
    ],
)
def test_ranges_sharing_a_block_are_rejected(ranges) -> None:
    """Blocks are named by CIDR, so two ranges reaching into one block would collide."""
    with pytest.raises(InvalidConfig, match="overlap or share"):
        RangeSet([Range(subnet, start=start, end=end) for subnet, start, end in ranges])


def test_ranges_in_separate_blocks_of_one_subnet_are_fine() -> None:
    rs = RangeSet([Range("10.0.0.0/24", end="10.0.0.60"), Range("10.0.0.0/24", start="10.0.0.64")])
    assert [rs.block(i).cidr for i in range(rs.block_count())] == [  # type: ignore[union-attr]
        "10.0.0.0/26",
        "10.0.0.64/26",
        "10.0.0.128/26",
        "10.0.0.192/26",
    ]


# -- scale: arithmetic only -----------------------------------------------------------


def value_of(text: str) -> int:
    return parse_ip(text)[1]


def test_ipv4_slash8() -> None:
    rs = RangeSet([Range("10.0.0.0/8", gateway="10.0.0.1")])
    n = 2**18
    assert rs.block_count() == n  # /8 in /26 blocks
    assert rs.capacity() == 2**24 - 3  # minus network, broadcast, gateway
    first, last = rs.block(0), rs.block(n - 1)
    assert first is not None and last is not None
    assert rs.block(n) is None
    assert first.cidr == "10.0.0.0/26"
    assert (first.next_usable(0), first.usable_count()) == (2, 62)
    assert last.cidr == "10.255.255.192/26"
    assert last.next_usable(60) == 60
    assert last.next_usable(62) == 62
    assert last.address(62) == "10.255.255.254"
    assert last.next_usable(63) is None  # broadcast
    assert last.usable_count() == 63
    middle = rs.block(n // 2)
    assert middle is not None and middle.cidr == "10.128.0.0/26"
    assert middle.usable_count() == 64
    got = rs.block_of(value_of("10.200.3.77"))
    assert got is not None and got.cidr == "10.200.3.64/26"
    back = rs.block_by_cidr("10.200.3.64/26")
    assert back is not None and back.base == got.base
    assert rs.block_of(value_of("10.255.255.255")) is None
    assert rs.block_of(value_of("10.0.0.1")) is None
    assert rs.block_by_cidr("10.0.0.0/25") is None
    assert rs.block_by_cidr("11.0.0.0/26") is None


def test_ipv4_slash8_with_exclusions() -> None:
    rs = RangeSet(
        [Range("10.0.0.0/8", gateway="10.0.0.1")],
        excludes=["10.128.0.0/9", "10.0.0.0/30", "10.1.2.3"],
    )
    # The upper half (2**23 - 1 of it in the range, the broadcast is not), the /30's
    # .1 (gateway, counted once), .2 and .3, and 10.1.2.3.
    assert rs.capacity() == 2**24 - 3 - (2**23 - 1) - 2 - 1
    n = rs.block_count()
    assert n == 2**18  # exclusions do not remove blocks
    assert rs.block(n // 2 + 5).next_usable(0) is None  # type: ignore[union-attr]
    assert rs.block(n - 1).next_usable(0) is None  # type: ignore[union-attr]
    assert rs.block(n - 1).usable_count() == 0  # type: ignore[union-attr]
    assert rs.block(n // 2 - 1).next_usable(63) == 63  # type: ignore[union-attr]
    assert rs.block(0).next_usable(0) == 4  # type: ignore[union-attr]
    assert not rs.usable(value_of("10.200.0.1"))
    assert rs.block_of(value_of("10.1.2.3")) is None
    assert rs.block_of(value_of("10.1.2.4")) is not None


def test_ipv6_slash64() -> None:
    rs = RangeSet([Range("fd00::/64", gateway="fd00::1")], excludes=["fd00::8000:0:0:0/65"])
    n = 2**58  # /64 in /122 blocks
    assert rs.block_count() == n
    assert rs.capacity() == 2**64 - 2 - 2**63  # network, gateway, upper half
    last = rs.block(n - 1)
    assert last is not None and last.cidr == "fd00::ffff:ffff:ffff:ffc0/122"
    assert last.next_usable(0) is None
    assert rs.block(n) is None
    below = rs.block(n // 2 - 1)
    assert below is not None and below.cidr == "fd00::7fff:ffff:ffff:ffc0/122"
    assert below.next_usable(63) == 63
    assert below.address(63) == "fd00::7fff:ffff:ffff:ffff"
    assert below.usable_count() == 64
    got = rs.block_of(value_of("fd00::1234:5678:9abc:def1"))
    assert got is not None and got.cidr == "fd00::1234:5678:9abc:dec0/122"
    assert rs.block_of(value_of("fd00::8000:0:0:1")) is None
    assert rs.block_by_cidr("fd00::7fff:ffff:ffff:ffc0/122") is not None
    first = rs.block(0)
    assert first is not None and (first.next_usable(0), first.usable_count()) == (2, 62)


def test_ipv6_slash64_no_exclusions() -> None:
    rs = RangeSet([Range("2001:db8::/64")])
    assert rs.capacity() == 2**64 - 1
    last = rs.block(rs.block_count() - 1)
    assert last is not None
    assert (last.next_usable(63), last.usable_count()) == (63, 64)


def test_ipv6_slash48() -> None:
    rs = RangeSet([Range("2001:db8:abcd::/48", gateway="2001:db8:abcd::1")], block_prefix=64)
    assert rs.block_count() == 2**16
    assert rs.capacity() == 2**80 - 2
    last = rs.block(2**16 - 1)
    assert last is not None and last.cidr == "2001:db8:abcd:ffff::/64"
    assert last.next_usable(2**64 - 1) == 2**64 - 1
    assert last.address(2**64 - 1) == "2001:db8:abcd:ffff:ffff:ffff:ffff:ffff"
    assert last.usable_count() == 2**64
    assert rs.block(2**16) is None
    default = RangeSet([Range("2001:db8:abcd::/48")])
    assert default.block_count() == 2 ** (122 - 48)
    end = default.block(default.block_count() - 1)
    assert end is not None and end.cidr == "2001:db8:abcd:ffff:ffff:ffff:ffff:ffc0/122"
    assert default.capacity() == 2**80 - 1


def test_multiple_ranges_block_numbering() -> None:
    rs = RangeSet(
        [
            Range("10.0.1.0/24", start="10.0.1.100"),
            Range("10.0.0.0/24", end="10.0.0.70"),
            Range("10.9.0.0/30"),
        ]
    )
    cidrs = [rs.block(j).cidr for j in range(rs.block_count())]  # type: ignore[union-attr]
    assert cidrs == [
        "10.0.1.64/26",
        "10.0.1.128/26",
        "10.0.1.192/26",
        "10.0.0.0/26",
        "10.0.0.64/26",
        "10.9.0.0/30",
    ]
    assert rs.capacity() == (254 - 100 + 1) + 70 + 2


# -- parse / format ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses())
def test_parse_ip_agrees_with_ipaddress(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    family = a.version
    for text in {str(a), a.exploded, str(a).upper()}:
        assert parse_ip(text) == (family, int(a))
    text = format_ip(family, int(a))
    assert parse_ip(text) == (family, int(a))
    if family == V4 or not dotted_by_ntop(a):  # type: ignore[arg-type]
        assert text == str(a)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([V4, V6]).flatmap(
        lambda f: st.tuples(
            st.just(f), st.integers(0, TOP[f]) | st.sampled_from([0, 1, TOP[f], 0xFFFF, 1 << 16])
        )
    )
)
def test_format_parse_round_trip(fv: tuple[int, int]) -> None:
    family, value = fv
    text = format_ip(family, value)
    assert parse_ip(text) == (family, value)
    assert format_ip(*parse_ip(text)) == text
    assert ipaddress.ip_address(text) == addr(family, value)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("2001:0db8:0000:0000:0000:0000:0000:0001", "2001:db8::1"),
        ("2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"),  # first of equal runs
        ("2001:db8:0:1:0:0:0:1", "2001:db8:0:1::1"),  # longest run
        ("2001:db8:0:1:1:1:1:1", "2001:db8:0:1:1:1:1:1"),  # no :: for a single 0
        ("FD00::ABCD", "fd00::abcd"),
        ("0:0:0:0:0:0:0:0", "::"),
        ("1::", "1::"),
        ("010.000.000.001", None),
        ("10.0.0.1", "10.0.0.1"),
    ],
)
def test_canonical_text_examples(text: str, canonical: str | None) -> None:
    if canonical is None:
        with pytest.raises(InvalidConfig):
            parse_ip(text)
    else:
        assert format_ip(*parse_ip(text)) == canonical == str(ipaddress.ip_address(text))


def test_format_ip_ipv4_compatible_matches_ipaddress() -> None:
    assert format_ip(V6, 0x10000) == str(ipaddress.IPv6Address(0x10000))


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789abcdefABCDEF:./ xg", max_size=45) | st.text(max_size=20))
def test_parse_ip_accepts_what_ipaddress_accepts(text: str) -> None:
    try:
        a = ipaddress.ip_address(text)
        want = (a.version, int(a)) if "%" not in text else None  # zone ids: not ours
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(InvalidConfig):
            parse_ip(text)
    else:
        assert parse_ip(text) == want


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(), st.data())
def test_parse_cidr_agrees_with_ipaddress(
    a: ipaddress.IPv4Address | ipaddress.IPv6Address, data: st.DataObject
) -> None:
    bits = a.max_prefixlen
    prefix = data.draw(st.integers(0, bits))
    text = f"{data.draw(st.sampled_from([str(a), a.exploded]))}/{prefix}"
    net = ipaddress.ip_network(text, strict=False)
    want = (a.version, int(net.network_address), prefix)
    assert parse_cidr(text) == want
    has_host_bits = int(a) != int(net.network_address)
    if has_host_bits:
        with pytest.raises(InvalidConfig):
            parse_cidr(text, strict=True)
        with pytest.raises(ValueError):
            ipaddress.ip_network(text, strict=True)
    else:
        assert parse_cidr(text, strict=True) == want
    # Leading zeros in the prefix are fine (as in ipaddress); too long is not.
    assert parse_cidr(f"{a}/0{prefix}") == want
    bad = data.draw(st.integers(bits + 1, bits + 10**6))
    with pytest.raises(InvalidConfig):
        parse_cidr(f"{a}/{bad}")
    with pytest.raises(InvalidConfig):
        parse_cidr(str(a))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "/",
        "/24",
        "10.0.0.0/",
        "10.0.0.0/-1",
        "10.0.0.0/+24",
        "10.0.0.0/ 24",
        "10.0.0.0/24 ",
        "10.0.0.0/0x18",
        "10.0.0.0/24.0",
        "10.0.0.0/255.255.255.0",
        "10.0.0.0/24/8",
        "10.0.0.0/33",
        "10.0.0.256/24",
        "10.0.0/24",
        "::/129",
        "fd00::/1280",
        "fd00::g/64",
        "fd00::/64%eth0",
        "fe80::1%eth0/64",
        "10.0.0.0",
        "fd00::",
    ],
)
def test_parse_cidr_rejects(text: str) -> None:
    with pytest.raises(InvalidConfig):
        parse_cidr(text)


@pytest.mark.parametrize("text", [None, 24, b"10.0.0.0/8"])
def test_parse_cidr_rejects_non_strings(text: object) -> None:
    with pytest.raises(InvalidConfig):
        parse_cidr(text)  # type: ignore[arg-type]


@settings(max_examples=500, deadline=None)
@given(
    st.text(alphabet="0123456789abcdef:./ -+x", max_size=50)
    | st.text(max_size=30)
    | st.builds(lambda a, t: f"{a}/{t}", st.ip_addresses(), st.text("0123456789+- .x", max_size=6))
)
def test_parse_cidr_only_raises_invalid_config(text: str) -> None:
    try:
        got = parse_cidr(text)
    except InvalidConfig:
        return
    net = ipaddress.ip_network(text, strict=False)  # what we accept, ipaddress accepts
    assert got == (net.version, int(net.network_address), net.prefixlen)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(
            "10.0.0.0/\u00b2",
            id="superscript-digit",
        ),
        pytest.param(
            "10.0.0.0/\u0662\u0664",
            id="arabic-indic-digits",
        ),
        pytest.param(
            "10.0.0.0/" + "0" * 4300 + "24",
            id="4302-digit-prefix",
        ),
    ],
)
def test_parse_cidr_non_ascii_or_huge_prefix(text: str) -> None:
    with pytest.raises(InvalidConfig):
        parse_cidr(text)


# -- PoolSpec -------------------------------------------------------------------------


# Two valid range sets of one family (each from its own random parent network).
TWO_SETS_OF_ONE_FAMILY = st.sampled_from([V4, V6]).flatmap(
    lambda f: st.tuples(
        set_specs(disjoint=True, valid=True, family=f),
        set_specs(disjoint=True, valid=True, family=f),
    )
)


@st.composite
def pool_args(draw: st.DrawFn) -> dict:
    families = draw(st.sampled_from([[V4], [V6], [V4, V6], [V6, V4]]))
    ranges, excludes = [], []
    for family in families:
        spec = draw(set_specs(disjoint=True, valid=True, family=family))
        ranges.append([r.as_dict() for r in spec.ranges])
        excludes += spec.excludes
    return {
        "name": draw(st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True)),
        "ranges": ranges,
        "exclude": excludes,
        "routes": draw(
            st.lists(
                st.sampled_from(
                    [
                        {"dst": "0.0.0.0/0"},
                        {"dst": "::/0"},
                        {"dst": "10.0.0.0/8", "gw": "10.0.0.1"},
                        {"dst": "::/0", "gw": "fd00::1"},
                    ]
                ),
                max_size=2,
            )
        ),
        "cooldown": draw(
            st.integers(0, 10**6) | st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
        ),
        "block_prefix": draw(
            st.none() | st.fixed_dictionaries({V4: st.integers(1, 32), V6: st.integers(1, 128)})
        ),
        "source": draw(st.sampled_from(["cli", "cni-config"])),
    }


@settings(max_examples=100, deadline=None)
@given(pool_args())
def test_pool_spec_round_trip(args: dict) -> None:
    spec = PoolSpec(**args)
    d = spec.to_dict()
    again = PoolSpec.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict() == d
    assert again.attachments_capacity() == spec.attachments_capacity()
    assert spec.attachments_capacity() == min(rs.capacity() for rs in spec.range_sets)
    assert [rs.family for rs in again.range_sets] == [rs.family for rs in spec.range_sets]
    for rs_a, rs_b in zip(spec.range_sets, again.range_sets, strict=True):
        assert rs_a.block_prefix == rs_b.block_prefix
        assert rs_a.block_count() == rs_b.block_count()
        assert rs_a.excludes == rs_b.excludes
        for ra, rb in zip(rs_a.ranges, rs_b.ranges, strict=True):
            assert (ra.network, ra.prefix, ra.start, ra.end, ra.gateway) == (
                rb.network,
                rb.prefix,
                rb.start,
                rb.end,
                rb.gateway,
            )
    # The stored form names the effective bounds (checked against the oracle).
    for set_dicts, rs in zip(args["ranges"], spec.range_sets, strict=True):
        for given_range, r in zip(set_dicts, rs.ranges, strict=True):
            given_spec = RangeSpec(
                given_range["subnet"], given_range.get("rangeStart"), given_range.get("rangeEnd")
            )
            parent = ipaddress.ip_network(given_range["subnet"], strict=False)
            [o] = oracle_of(SetSpec(rs.family, parent, (given_spec,), (), None))
            stored = r.to_dict()
            assert parse_ip(stored["rangeStart"])[1] == o.window[0]
            assert parse_ip(stored["rangeEnd"])[1] == o.window[-1]


def test_pool_spec_from_dict_defaults() -> None:
    spec = PoolSpec.from_dict({"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]]})
    assert spec.cooldown == 30.0
    assert spec.block_prefix == {V4: 26, V6: 122}
    assert spec.attachments_capacity() == 254
    assert PoolSpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()


@settings(max_examples=50, deadline=None)
@given(TWO_SETS_OF_ONE_FAMILY)
def test_pool_spec_two_sets_of_one_family(pair: tuple[SetSpec, SetSpec]) -> None:
    a, b = pair
    with pytest.raises(InvalidConfig, match="one family"):
        PoolSpec("p", [[r.as_dict() for r in a.ranges], [r.as_dict() for r in b.ranges]])


@settings(max_examples=50, deadline=None)
@given(
    st.integers(max_value=-1)
    | st.floats(max_value=-1e-12, allow_nan=False)
    | st.sampled_from(["30", None, [], {}])
)
def test_pool_spec_bad_cooldown(cooldown: object) -> None:
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], cooldown=cooldown)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig):
        PoolSpec.from_dict(
            {"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]], "cooldown": cooldown}
        )


def test_pool_spec_nan_cooldown() -> None:
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], cooldown=float("nan"))


@settings(max_examples=100, deadline=None)
@given(set_specs(disjoint=True, valid=True, max_ranges=1), st.data())
def test_pool_spec_gateway_outside_subnet(spec: SetSpec, data: st.DataObject) -> None:
    r = spec.ranges[0]
    net = ipaddress.ip_network(r.subnet, strict=False)
    family = spec.family
    text = data.draw(
        st.integers(0, TOP[family])
        .filter(lambda v: addr(family, v) not in net)
        .map(lambda v: render(family, v))
        | st.sampled_from(OTHER_FAMILY_EXCLUDES[family][1:])  # an address of the other family
    )
    for field in ("gateway", "rangeStart", "rangeEnd"):
        bad = {**r.as_dict(), field: text}
        with pytest.raises(InvalidConfig):
            PoolSpec("p", [[bad]])
        with pytest.raises(InvalidConfig):
            PoolSpec.from_dict({"name": "p", "ranges": [[bad]]})


@settings(max_examples=100, deadline=None)
@given(set_specs(disjoint=True, valid=True, max_ranges=1), st.data())
def test_pool_spec_start_after_end(spec: SetSpec, data: st.DataObject) -> None:
    [o] = oracle_of(spec)
    r = spec.ranges[0]
    net = o.net
    # Any start > end inside the subnet (clamping to the usable window cannot fix that).
    lo, hi = int(net.network_address), int(net.broadcast_address)
    if hi - lo >= 1:
        end = data.draw(st.integers(lo, hi - 1))
        start = data.draw(st.integers(end + 1, hi))
        bad = {
            "subnet": r.subnet,
            "rangeStart": render(spec.family, start),
            "rangeEnd": render(spec.family, end),
        }
        with pytest.raises(InvalidConfig):
            PoolSpec("p", [[bad]])
        with pytest.raises(InvalidConfig):
            PoolSpec.from_dict({"name": "p", "ranges": [[bad]]})


def test_pool_spec_mixed_family_set_and_overlap() -> None:
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}, {"subnet": "fd00::/64"}]])
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}, {"subnet": "10.0.0.0/25"}]])
    dual = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/120"}]])
    assert (dual.set_of(V4), dual.set_of(V6)) == (0, 1)
    assert dual.attachments_capacity() == min(254, 255)
    assert [rs.capacity() for rs in dual.range_sets] == [254, 255]
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [])
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[]])
    with pytest.raises(InvalidConfig):
        PoolSpec("bad name!", [[{"subnet": "10.0.0.0/24"}]])
    with pytest.raises(InvalidConfig):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24", "gateway": 5}]])


# -- jumping over excluded blocks, coverage and overlap ---------------------------------


@st.composite
def span_lists(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Sorted, disjoint spans of small integers."""
    cuts = sorted(set(draw(st.lists(st.integers(0, 60), max_size=10))))
    spans = [(lo, hi) for lo, hi in zip(cuts[::2], cuts[1::2], strict=False)]
    return [(lo, hi) for lo, hi in spans if lo <= hi]


@settings(max_examples=300, deadline=None)
@given(span_lists(), span_lists())
def test_first_overlap_is_the_lowest_common_span(a: list, b: list) -> None:
    in_a = {v for lo, hi in a for v in range(lo, hi + 1)}
    in_b = {v for lo, hi in b for v in range(lo, hi + 1)}
    common = in_a & in_b
    got = first_overlap(a, b)
    if not common:
        assert got is None
        return
    assert got is not None
    lo, hi = got
    assert lo == min(common)
    assert set(range(lo, hi + 1)) <= common
    assert first_overlap(b, a) == got


def test_next_usable_block_jumps_over_a_slash9_in_a_slash8(monkeypatch) -> None:
    """A /8 with its first /9 excluded: the first block with an address is found by
    arithmetic, not by looking at 2^17 blocks one after the other."""
    rs = RangeSet([Range("10.0.0.0/8")], excludes=["10.0.0.0/9"])
    looked = []
    real = RangeSet.excluded_span
    monkeypatch.setattr(
        RangeSet, "excluded_span", lambda self, v: looked.append(v) or real(self, v)
    )
    j = rs.next_usable_block(0)
    assert j == 2**17
    assert rs.block(j).cidr == "10.128.0.0/26"  # type: ignore[union-attr]
    assert len(looked) <= 2
    assert rs.next_usable_block(2**18) is None
    v6 = RangeSet([Range("fd00::/64")], excludes=["fd00::/65", "fd00:0:0:0:8000::/122"])
    assert v6.next_usable_block(0) == 2**57 + 1  # the /65, then one excluded block


@settings(max_examples=200, deadline=None)
@given(TWO_SETS_OF_ONE_FAMILY)
def test_pools_overlap_exactly_when_they_share_a_covered_address(pair) -> None:
    """Two pools overlap iff an address is covered by both: inside a range's window and
    not excluded, or a gateway (it is in use on the network)."""
    pools, covered = [], []
    for i, spec in enumerate(pair):
        try:
            pools.append(
                PoolSpec(f"p{i}", [[r.as_dict() for r in spec.ranges]], list(spec.excludes))
            )
        except InvalidConfig:
            return  # ranges sharing a block: not a pool (the oracle tests cover it)
        covered.append(covered_by_oracle(spec, oracle_of(spec)))
    why = overlap(pools[0], pools[1])
    assert (why is not None) == bool(covered[0] & covered[1]), why
    if why is not None:
        assert "p1" in why and "both cover" in why


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cooldown", True),
        ("cooldown", False),
        ("warm", True),
        ("release_delay", True),
        ("cooldown", 10**10),
        ("warm", -1),
    ],
)
def test_pool_spec_rejects_bools_where_numbers_go(field: str, value: object) -> None:
    """`true` is an int in Python: never one second, one address or one block."""
    with pytest.raises(InvalidConfig, match=field):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], **{field: value})  # type: ignore[arg-type]


def test_pool_spec_rejects_bool_block_size_and_empty_addresses() -> None:
    with pytest.raises(InvalidConfig, match="block size"):
        PoolSpec.from_dict(
            {"name": "p", "ranges": [[{"subnet": "10.0.0.0/24"}]], "blockSize": {"4": True}}
        )
    for field in ("rangeStart", "rangeEnd", "gateway"):
        with pytest.raises(InvalidConfig, match=field):
            PoolSpec("p", [[{"subnet": "10.0.0.0/24", field: ""}]])


@pytest.mark.parametrize(
    ("subnet", "ok"),
    [
        ("0.0.0.0/0", False),
        ("10.0.0.0/7", False),
        ("10.0.0.0/8", True),
        ("10.0.0.7/32", True),
        ("::/0", False),
        ("fc00::/7", False),
        ("fd00::/8", True),
        ("fd00::/64", True),
        ("fd00::5/128", True),
    ],
)
def test_pool_subnet_prefix_lengths(subnet: str, ok: bool) -> None:
    """A pool's subnet is at most as wide as the largest private range of its family."""
    if ok:
        assert PoolSpec("p", [[{"subnet": subnet}]]).attachments_capacity() >= 1
    else:
        with pytest.raises(InvalidConfig, match="wider than a pool takes"):
            PoolSpec("p", [[{"subnet": subnet}]])


@pytest.mark.parametrize(
    ("route", "needle"),
    [
        ({"dst": "0.0.0.0/0", "gw": "nope"}, "gw 'nope' is not an address"),
        ({"dst": "0.0.0.0/0", "gw": ""}, "is not an address"),
        ({"dst": "0.0.0.0/0", "gw": 7}, "is not an address"),
        ({"dst": "0.0.0.0/0", "gw": "fd00::1"}, "IPv6"),
        ({"dst": "::/0", "gw": "10.0.0.1"}, "IPv4"),
        ({"dst": "10.0.0.0/33"}, "prefix"),
        ({"gw": "10.0.0.1"}, "dst"),
    ],
)
def test_pool_spec_routes_are_checked(route: dict, needle: str) -> None:
    with pytest.raises(InvalidConfig, match=needle):
        PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], routes=[route])
