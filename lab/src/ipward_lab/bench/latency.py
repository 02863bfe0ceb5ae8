"""Figures 3 to 5, allocate latency in the ledger: as a pool fills (an empty /24 next
to a 90%-full pool, an IPv6 /64 and a /8 with 10,000 in use), and for --report against
pool size (/24 to /8, IPv6 /64) and pool fill (10% to 99%); the pools take turns call by
call."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.ledger import Ledger
from ipward.store.sqlite import SqliteStore
from ipward_lab.bench.common import (
    NODE,
    BenchError,
    Results,
    addresses,
    summary,
    verdict,
)
from ipward_lab.bench.fill import fill_file

TARGET_IN_USE_VS_EMPTY = 1.3  # 10,000 in use: median within 1.3 x the empty /24's


class Scenario:
    __slots__ = ("fill", "label", "name", "subnet")

    def __init__(self, name: str, label: str, subnet: str, fill: int) -> None:
        self.name = name
        self.label = label
        self.subnet = subnet
        self.fill = fill


def _usable(prefix: int) -> int:
    return (1 << (32 - prefix)) - 2  # IPv4 without network and broadcast


def scenarios(quick: bool) -> list[Scenario]:
    full_prefix = 20 if quick else 16
    full = int(_usable(full_prefix) * 0.9)
    return [
        Scenario("empty_24", "empty /24", "10.1.0.0/24", 0),
        Scenario(
            f"full90_{full_prefix}",
            f"/{full_prefix}, 90% full ({full:,} in use)",
            f"10.2.0.0/{full_prefix}",
            full,
        ),
        Scenario("v6_64_10k", "IPv6 /64, 10,000 in use", "fd00:be::/64", 10_000),
        Scenario("v4_8_10k", "10.0.0.0/8, 10,000 in use", "10.0.0.0/8", 10_000),
    ]


def _scenario_pool(s: Scenario) -> PoolSpec:
    # Cooldown 0: from the second round on, every scenario reuses freed addresses the same
    # way, so the rounds exercise the fresh-address and the reuse path alike everywhere.
    return PoolSpec(f"bench-{s.name}", [[{"subnet": s.subnet}]], cooldown=0)


def allocate_latency(
    pools: Sequence[tuple[str, PoolSpec]],
    rounds: int,
    per_round: int,
    warmup: int = 20,
    releases: list[list[float]] | None = None,
) -> list[list[float]]:
    """Seconds per ledger allocate (in-process) on each (SQLite path, pool): `rounds`
    rounds of `per_round` timed allocations, each round released afterwards. The pools
    take turns call by call, so drift in the machine's speed falls on all of them
    alike. Returns one list of samples per pool; with `releases` (a list), appends the
    seconds of each release per pool to it as well."""
    stores = [SqliteStore(path) for path, _ in pools]
    try:
        ledgers = [Ledger(store, NODE) for store in stores]
        specs = [[spec] for _, spec in pools]
        pod = PodInfo("bench", "lat", "uid-lat")
        for ledger, (_, spec) in zip(ledgers, pools, strict=True):
            for i in range(warmup):
                attachment = Attachment("benchlat", f"warm-{i}", "eth0")
                ledger.allocate([spec], attachment, pod)
                ledger.free(attachment)
        samples: list[list[float]] = [[] for _ in pools]
        released: list[list[float]] = [[] for _ in pools]
        clock = time.perf_counter
        for r in range(rounds):
            attachments = [Attachment("benchlat", f"r{r}-{i}", "eth0") for i in range(per_round)]
            for attachment in attachments:
                for ledger, spec_list, out in zip(ledgers, specs, samples, strict=True):
                    start = clock()
                    ledger.allocate(spec_list, attachment, pod)
                    out.append(clock() - start)
            for attachment in attachments:
                for ledger, out in zip(ledgers, released, strict=True):
                    start = clock()
                    freed = ledger.free(attachment)
                    out.append(clock() - start)
                    if not freed:
                        raise BenchError(f"{attachment}: nothing freed")
        if releases is not None:
            releases.extend(released)
        return samples
    finally:
        for store in stores:
            store.close()


GROWTH_IN_USE = 100  # addresses in use in every pool of the pool-size series
POOL_SIZES = [  # (name, label, subnet)
    ("v4_24", "/24", "10.1.0.0/24"),
    ("v4_20", "/20", "10.2.0.0/20"),
    ("v4_16", "/16", "10.3.0.0/16"),
    ("v4_12", "/12", "10.16.0.0/12"),
    ("v4_8", "/8", "10.0.0.0/8"),
    ("v6_64", "IPv6 /64", "fd00:be::/64"),
]
FILL_PERCENTS = (10, 50, 90, 99)


def _latency_rows(
    tmp: Path,
    tag: str,
    pools: Sequence[tuple[str, PoolSpec, int]],
    rounds: int,
    per_round: int,
) -> list[dict[str, float]]:
    """Each (name, pool, addresses in use) in a SQLite file of its own, filled, then
    timed allocate and free calls taking turns: {in_use, add/del median and p99 ms}
    per pool."""
    paths = []
    for name, spec, in_use in pools:
        path = str(tmp / f"{tag}-{name}.db")
        fill_file(path, spec, in_use)
        paths.append((path, spec))
    releases: list[list[float]] = []
    adds = allocate_latency(paths, rounds, per_round, releases=releases)
    rows = []
    for (_, _, in_use), add_s, del_s in zip(pools, adds, releases, strict=True):
        add_median, add_p99 = summary(add_s)
        del_median, del_p99 = summary(del_s)
        rows.append(
            {
                "in_use": float(in_use),
                "add_median_ms": add_median,
                "add_p99_ms": add_p99,
                "del_median_ms": del_median,
                "del_p99_ms": del_p99,
            }
        )
    return rows


def pool_size_latency(
    tmp: Path, rounds: int, per_round: int, in_use: int = GROWTH_IN_USE
) -> dict[str, dict[str, float]]:
    """ADD (in-process `Ledger.allocate`) and DEL latency on SQLite in pools from /24 to
    /8 and an IPv6 /64, each with `in_use` addresses in use: {name: figures}, with the
    pool's capacity in `addresses`."""
    pools = [
        (name, PoolSpec(f"size-{name}", [[{"subnet": subnet}]], cooldown=0), in_use)
        for name, _, subnet in POOL_SIZES
    ]
    rows = _latency_rows(tmp, "size", pools, rounds, per_round)
    out = {}
    for (name, spec, _), row in zip(pools, rows, strict=True):
        out[name] = {**row, "addresses": float(spec.range_sets[0].capacity())}
    return out


def fill_latency(
    tmp: Path, prefix: int, rounds: int, per_round: int, percents: Sequence[int] = FILL_PERCENTS
) -> dict[int, dict[str, float]]:
    """ADD and DEL latency in one /`prefix` pool filled to each of `percents` (a file
    each): {percent: figures}. Fewer than `per_round` + 20 addresses left free is an
    error (the rounds would exhaust the pool)."""
    pools = []
    for pct in percents:
        spec = PoolSpec(f"fill-{pct}", [[{"subnet": f"10.4.0.0/{prefix}"}]], cooldown=0)
        capacity = spec.range_sets[0].capacity()
        in_use = capacity * pct // 100
        if capacity - in_use < per_round + 20:
            raise BenchError(
                f"/{prefix} at {pct}% leaves too few addresses for {per_round} calls a round"
            )
        pools.append((str(pct), spec, in_use))
    rows = _latency_rows(tmp, "fill", pools, rounds, per_round)
    return {pct: row for pct, row in zip(percents, rows, strict=True)}


def latency_section(tmp: Path, quick: bool, out: Callable[[str], object], r: Results) -> None:
    """Figure 3 into `r`: figures, targets, table."""
    rounds, per_round = (2, 50) if quick else (5, 100)
    lat_rows = [
        [
            f"3. ledger allocate, SQLite ({rounds * per_round} allocs)",
            "median ms",
            "p99 ms",
            "vs empty",
            "target",
        ]
    ]
    todo = scenarios(quick)
    pools = []
    for s in todo:
        spec = _scenario_pool(s)
        path = str(tmp / f"latency-{s.name}.db")
        if s.fill:
            out(f"  ... filling {s.label} (written in bulk as one ledger leaves it)")
            fill_file(path, spec, s.fill)
        pools.append((path, spec))
    out(f"  ... {rounds * per_round} timed allocations in each pool, taking turns")
    all_samples = allocate_latency(pools, rounds, per_round)
    empty_median = 0.0
    for s, samples in zip(todo, all_samples, strict=True):
        median, tail = summary(samples)
        r.figures[f"latency.{s.name}.median_ms"] = median
        r.figures[f"latency.{s.name}.p99_ms"] = tail
        if not s.fill:
            empty_median = median
            lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", "1.00x", ""])
            continue
        ratio = median / empty_median
        r.figures[f"latency.{s.name}.vs_empty"] = ratio
        target = ""
        if s.fill == 10_000:
            ok = ratio <= TARGET_IN_USE_VS_EMPTY
            r.targets[f"latency.{s.name}.vs_empty"] = {
                "value": ratio,
                "target": f"<= {TARGET_IN_USE_VS_EMPTY}",
                "met": ok,
            }
            target = f"<= {TARGET_IN_USE_VS_EMPTY}x {verdict(ok)}"
        lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", f"{ratio:.2f}x", target])
    r.tables["latency"] = lat_rows


def pool_size_growth(
    tmp: Path, rounds: int, per_round: int, out: Callable[[str], object], r: Results
) -> None:
    """Figure 4 (--report) into `r`: figures `growth.size.*`, series, table."""
    samples = f"{rounds * per_round}"
    out(
        f"  ... ADD vs pool size: {samples} timed allocations and releases in pools /24 to /8"
        f" and IPv6 /64, {GROWTH_IN_USE} in use each, taking turns"
    )
    sizes = pool_size_latency(tmp, rounds, per_round)
    base = sizes["v4_24"]["add_median_ms"]
    rows = [
        [
            f"4. ADD vs pool size ({GROWTH_IN_USE} in use, {samples} allocs)",
            "addresses",
            "ADD median ms",
            "ADD p99 ms",
            "DEL median ms",
            "vs /24",
        ]
    ]
    r.series["pool_size"] = []
    for name, label, _ in POOL_SIZES:
        row = sizes[name]
        row["vs_24"] = row["add_median_ms"] / base
        for key, value in row.items():
            r.figures[f"growth.size.{name}.{key}"] = value
        r.series["pool_size"].append({"name": name, "label": label, **row})
        rows.append(
            [
                label,
                addresses(row["addresses"]),
                f"{row['add_median_ms']:.3f}",
                f"{row['add_p99_ms']:.3f}",
                f"{row['del_median_ms']:.3f}",
                f"{row['vs_24']:.2f}x",
            ]
        )
    r.tables["pool_size"] = rows


def fill_growth(
    tmp: Path,
    quick: bool,
    rounds: int,
    per_round: int,
    fill_prefix: int | None,
    out: Callable[[str], object],
    r: Results,
) -> None:
    """Figure 5 (--report) into `r`: figures `growth.fill.*`, series, table."""
    samples = f"{rounds * per_round}"
    prefix = fill_prefix or (18 if quick else 16)
    out(
        f"  ... ADD vs fill: a /{prefix} at {', '.join(f'{p}%' for p in FILL_PERCENTS)} (bulk"
        f" written), {samples} timed allocations and releases each, taking turns"
    )
    fills = fill_latency(tmp, prefix, rounds, per_round)
    base = fills[FILL_PERCENTS[0]]["add_median_ms"]
    rows = [
        [
            f"5. ADD vs fill, /{prefix} ({samples} allocs)",
            "in use",
            "ADD median ms",
            "ADD p99 ms",
            "DEL median ms",
            f"vs {FILL_PERCENTS[0]}%",
        ]
    ]
    r.series["fill"] = []
    for pct, row in fills.items():
        row["vs_first"] = row["add_median_ms"] / base
        for key, value in row.items():
            r.figures[f"growth.fill.{pct}.{key}"] = value
        r.series["fill"].append({"percent": pct, "prefix": prefix, **row})
        rows.append(
            [
                f"{pct}% full",
                f"{row['in_use']:,.0f}",
                f"{row['add_median_ms']:.3f}",
                f"{row['add_p99_ms']:.3f}",
                f"{row['del_median_ms']:.3f}",
                f"{row['vs_first']:.2f}x",
            ]
        )
    r.tables["fill"] = rows
