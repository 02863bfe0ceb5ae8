"""Address math: ranges, range sets, exclusions and blocks, as pure functions on integers.

Nothing here enumerates a range. A range set is a list of ranges of one family; it is
cut into aligned blocks (default /26 for IPv4, /122 for IPv6, never larger than the
range's subnet) numbered in range order, and block `j`, the block of an address, and the
next usable address at or after an offset in a block are all found by arithmetic over
the handful of ranges and exclusions. A 10.0.0.0/8 or an IPv6 /64 costs what a /24 does.

Never handed out: the gateway, excluded addresses, and in IPv4 subnets wider than /31
the network and broadcast addresses.

On the CNI plugin's start path: parsing uses `_socket.inet_pton` (C, already loaded)
rather than `ipaddress`, whose import alone costs ~4 ms per plugin exec.
"""

from __future__ import annotations

import _socket

from ipward.core.errors import InvalidConfig

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

V4 = 4
V6 = 6
_AF = {V4: _socket.AF_INET, V6: _socket.AF_INET6}
BITS = {V4: 32, V6: 128}
DEFAULT_BLOCK_PREFIX = {V4: 26, V6: 122}


def family_of(text: str) -> int:
    """The family of an address or CIDR in text (no parsing: IPv6 text has a colon)."""
    return V6 if ":" in text else V4


def parse_ip(text: str) -> tuple[int, int]:
    """(family, integer) of an address in any standard notation."""
    family = family_of(text)
    try:
        packed = _socket.inet_pton(_AF[family], text)
    except (OSError, ValueError, TypeError):
        raise InvalidConfig(f"not an IP address: {text!r}") from None
    return family, int.from_bytes(packed, "big")


def format_ip(family: int, value: int) -> str:
    """Canonical text of an address (the form used in store keys). IPv6 follows RFC 5952
    here rather than the C library's inet_ntop, whose output for some ranges (`::/96`)
    differs between glibc and musl: keys must be the same on every node."""
    if family == V4:
        return _socket.inet_ntop(_socket.AF_INET, value.to_bytes(4, "big"))
    groups = [(value >> (16 * (7 - i))) & 0xFFFF for i in range(8)]
    best_start, best_len, start = -1, 1, -1  # compress only runs of two or more
    for i, group in enumerate([*groups, 1]):
        if group == 0 and start < 0:
            start = i
        elif group != 0 and start >= 0:
            if i - start > best_len:
                best_start, best_len = start, i - start
            start = -1
    text = [f"{g:x}" for g in groups]
    if best_start < 0:
        return ":".join(text)
    return ":".join(text[:best_start]) + "::" + ":".join(text[best_start + best_len :])


def parse_cidr(text: str, strict: bool = False) -> tuple[int, int, int]:
    """(family, network, prefix length). Host bits are cleared unless `strict`, in which
    case they are an error."""
    if not isinstance(text, str) or "/" not in text:
        raise InvalidConfig(f"not a CIDR (address/prefix): {text!r}")
    address, _, length = text.partition("/")
    family, value = parse_ip(address)
    digits = length.lstrip("0") or "0"
    if not (length.isascii() and length.isdigit() and len(length) <= 5) or not (
        int(digits) <= BITS[family]
    ):
        raise InvalidConfig(f"bad prefix length in {text!r}")
    prefix = int(digits)
    network = value >> (BITS[family] - prefix) << (BITS[family] - prefix)
    if strict and network != value:
        raise InvalidConfig(f"{text!r} has host bits set")
    return family, network, prefix


def format_cidr(family: int, network: int, prefix: int) -> str:
    return f"{format_ip(family, network)}/{prefix}"


class Range:
    """One subnet, optionally narrowed by start/end, with an optional gateway."""

    __slots__ = ("end", "family", "gateway", "network", "prefix", "start")

    def __init__(
        self,
        subnet: str,
        start: str | None = None,
        end: str | None = None,
        gateway: str | None = None,
    ) -> None:
        self.family, self.network, self.prefix = parse_cidr(subnet)
        size = 1 << (BITS[self.family] - self.prefix)
        first, last = self.network, self.network + size - 1
        # Never the network address (IPv6: subnet-router anycast) nor the IPv4 broadcast.
        if self.prefix < BITS[self.family] - 1:
            first += 1
            if self.family == V4:
                last -= 1
        # None is "not given"; an empty string is a mistake, never a quiet default.
        self.start = self._inside(start, "rangeStart") if start is not None else first
        self.end = self._inside(end, "rangeEnd") if end is not None else last
        self.start, self.end = max(self.start, first), min(self.end, last)
        if self.start > self.end:
            raise InvalidConfig(f"range {subnet} has no usable address between start and end")
        self.gateway = self._inside(gateway, "gateway") if gateway is not None else None

    def _inside(self, text: str, field: str) -> int:
        try:
            family, value = parse_ip(text)
        except InvalidConfig:
            raise InvalidConfig(
                f"{field} {text!r} of range {self.subnet} is not an address"
            ) from None
        size = 1 << (BITS[self.family] - self.prefix)
        if family != self.family or not self.network <= value < self.network + size:
            raise InvalidConfig(f"{field} {text} is outside subnet {self.subnet}")
        return value

    @property
    def subnet(self) -> str:
        return format_cidr(self.family, self.network, self.prefix)

    def contains(self, value: int) -> bool:
        return self.start <= value <= self.end

    def to_dict(self) -> dict:
        d = {"subnet": self.subnet}
        d["rangeStart"] = format_ip(self.family, self.start)
        d["rangeEnd"] = format_ip(self.family, self.end)
        if self.gateway is not None:
            d["gateway"] = format_ip(self.family, self.gateway)
        return d


class RangeSet:
    """Ranges of one family, from which an attachment gets one address; exclusions are
    CIDRs or single addresses. Cut into aligned blocks of `block_prefix`."""

    __slots__ = ("_block_counts", "block_prefix", "excludes", "family", "ranges")

    def __init__(
        self, ranges: list[Range], excludes: Sequence[str] = (), block_prefix: int | None = None
    ) -> None:
        if not ranges:
            raise InvalidConfig("a range set needs at least one range")
        self.family = ranges[0].family
        if any(r.family != self.family for r in ranges):
            raise InvalidConfig("a range set mixes IPv4 and IPv6; use one set per family")
        self.ranges = ranges
        self.block_prefix = (
            DEFAULT_BLOCK_PREFIX[self.family] if block_prefix is None else block_prefix
        )
        if not isinstance(self.block_prefix, int) or not (
            0 < self.block_prefix <= BITS[self.family]
        ):
            raise InvalidConfig(f"block size /{self.block_prefix} is not valid")
        # Blocks are named by CIDR, so two ranges may not reach into one block. (zip, not
        # itertools.pairwise: itertools is not loaded on the plugin path.)
        by_span = sorted(((self._block_span(r), r) for r in ranges), key=lambda pair: pair[0])
        for (a_span, a), (b_span, b) in zip(by_span, by_span[1:], strict=False):  # noqa: RUF007
            if b_span[0] <= a_span[1]:
                raise InvalidConfig(
                    f"ranges {_describe(a)} and {_describe(b)} overlap or share a"
                    f" /{max(self.block_prefix, a.prefix)} block; merge them into one range"
                    " (with 'exclude' for the gap) or choose a smaller block size"
                )
        spans = []
        for text in excludes:
            family, lo, prefix = parse_cidr(text) if "/" in text else (*parse_ip(text), None)
            if family != self.family:
                continue  # an exclusion of the other family belongs to the other set
            hi = lo + (1 << (BITS[family] - prefix)) - 1 if prefix is not None else lo
            spans.append((lo, hi))
        self.excludes = merge_spans(spans)
        self._block_counts = [self._first_last_block(r) for r in ranges]

    # -- blocks ---------------------------------------------------------------------

    def block_bits(self, r: Range) -> int:
        """Host bits of a block in range `r`: a block never spans beyond the subnet."""
        return BITS[self.family] - max(self.block_prefix, r.prefix)

    def _block_span(self, r: Range) -> tuple[int, int]:
        bits = self.block_bits(r)
        return r.start >> bits << bits, ((r.end >> bits) + 1 << bits) - 1

    def _first_last_block(self, r: Range) -> tuple[int, int]:
        bits = self.block_bits(r)
        return r.start >> bits, r.end >> bits

    def block_count(self) -> int:
        return sum(last - first + 1 for first, last in self._block_counts)

    def block(self, index: int) -> Block | None:
        """Block number `index` of the set (ranges in order), or None past the end."""
        if index < 0:
            return None
        for r, (first, last) in zip(self.ranges, self._block_counts, strict=True):
            count = last - first + 1
            if index < count:
                bits = self.block_bits(r)
                return Block(self, r, (first + index) << bits, bits)
            index -= count
        return None

    def next_usable_block(self, index: int) -> int | None:
        """The smallest block number >= `index` whose block holds an address that may be
        handed out, or None past the end. Jumps over excluded spans (and the gateway), so
        a /8 with a /9 excluded costs what a /24 does, not one step per block."""
        offset = 0
        for r, (first, last) in zip(self.ranges, self._block_counts, strict=True):
            count = last - first + 1
            if index < offset + count:
                bits = self.block_bits(r)
                base = (first + max(index - offset, 0)) << bits
                value = self.next_usable_value(r, max(base, r.start), r.end)
                if value is not None:
                    return offset + (value >> bits) - first
            offset += count
        return None

    def block_of(self, value: int) -> Block | None:
        """The block holding a usable address `value`, or None if it is not one."""
        r = self.range_of(value)
        if r is None or not self.usable(value, r):
            return None
        bits = self.block_bits(r)
        return Block(self, r, value >> bits << bits, bits)

    def block_by_cidr(self, cidr: str) -> Block | None:
        family, network, prefix = parse_cidr(cidr)
        if family != self.family:
            return None
        r = self.range_of_span(network, network + (1 << (BITS[family] - prefix)) - 1)
        if r is None or BITS[family] - prefix != self.block_bits(r):
            return None
        return Block(self, r, network, self.block_bits(r))

    # -- addresses ------------------------------------------------------------------

    def range_of(self, value: int) -> Range | None:
        for r in self.ranges:
            if r.contains(value):
                return r
        return None

    def range_of_span(self, lo: int, hi: int) -> Range | None:
        for r in self.ranges:
            if lo <= r.end and r.start <= hi:
                return r
        return None

    def excluded_span(self, value: int) -> tuple[int, int] | None:
        for lo, hi in self.excludes:
            if lo <= value <= hi:
                return lo, hi
            if lo > value:
                break
        return None

    def next_usable_value(self, r: Range, value: int, last: int) -> int | None:
        """The smallest address in [value, last] of range `r` that may be handed out, or
        None. The cost is bounded by the number of exclusions, not the span's size."""
        value = max(value, r.start)
        last = min(last, r.end)
        while value <= last:
            if value == r.gateway:
                value += 1
                continue
            span = self.excluded_span(value)
            if span is None:
                return value
            value = span[1] + 1
        return None

    def spans(self) -> list[tuple[int, int]]:
        """The addresses the set covers, as sorted disjoint spans: every range's
        start..end minus the exclusions. The gateway counts as covered (it is in use on
        the network even though it is never handed out). For the overlap test between
        pools: arithmetic on a handful of spans, never an enumeration."""
        spans = []
        for r in self.ranges:
            lo = r.start
            for elo, ehi in self.excludes:
                if ehi < lo:
                    continue
                if elo > r.end:
                    break
                if elo > lo:
                    spans.append((lo, elo - 1))
                lo = ehi + 1
            if lo <= r.end:
                spans.append((lo, r.end))
            if r.gateway is not None:
                spans.append((r.gateway, r.gateway))
        return merge_spans(spans)

    def usable(self, value: int, r: Range | None = None) -> bool:
        """May `value` be handed out: inside a range, not a gateway, not excluded."""
        r = r or self.range_of(value)
        return (
            r is not None
            and r.contains(value)
            and value != r.gateway
            and self.excluded_span(value) is None
        )

    def capacity(self) -> int:
        """How many addresses the set can hand out (arithmetic, no enumeration)."""
        return sum(self.range_capacity(r) for r in self.ranges)

    def range_capacity(self, r: Range) -> int:
        return _count_usable(r.start, r.end, r.gateway, self.excludes)


class Block:
    """An aligned slice of one range: `size` addresses from `base`."""

    __slots__ = ("base", "bits", "range", "range_set")

    def __init__(self, range_set: RangeSet, r: Range, base: int, bits: int) -> None:
        self.range_set = range_set
        self.range = r
        self.base = base
        self.bits = bits

    @property
    def size(self) -> int:
        return 1 << self.bits

    @property
    def cidr(self) -> str:
        return format_cidr(
            self.range_set.family, self.base, BITS[self.range_set.family] - self.bits
        )

    def next_usable(self, offset: int) -> int | None:
        """The smallest offset >= `offset` whose address may be handed out, or None.
        Jumps over exclusions, so the cost is bounded by their number, not the size."""
        value = self.range_set.next_usable_value(
            self.range, self.base + offset, self.base + self.size - 1
        )
        return None if value is None else value - self.base

    def address(self, offset: int) -> str:
        return format_ip(self.range_set.family, self.base + offset)

    def usable_count(self) -> int:
        """Addresses of the block that may be handed out (for usage displays)."""
        lo = max(self.base, self.range.start)
        hi = min(self.base + self.size - 1, self.range.end)
        return _count_usable(lo, hi, self.range.gateway, self.range_set.excludes) if lo <= hi else 0


def _describe(r: Range) -> str:
    return f"{r.subnet} ({format_ip(r.family, r.start)}-{format_ip(r.family, r.end)})"


def first_overlap(
    a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]
) -> tuple[int, int] | None:
    """The first span (lowest addresses) common to two lists of sorted disjoint spans,
    or None when they share no address. One pass over both lists."""
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            return lo, hi
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return None


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping, non-adjacent spans covering the same addresses."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _count_usable(lo: int, hi: int, gateway: int | None, excludes: list[tuple[int, int]]) -> int:
    """Addresses in [lo, hi] that are neither the gateway nor excluded."""
    total = hi - lo + 1
    gateway_counted = gateway is not None and lo <= gateway <= hi
    for elo, ehi in excludes:
        overlap = min(ehi, hi) - max(elo, lo) + 1
        if overlap > 0:
            total -= overlap
            if gateway_counted and elo <= gateway <= ehi:  # type: ignore[operator]
                gateway_counted = False
    return total - (1 if gateway_counted else 0)
