"""`ipward pool`: create, list, show and delete pools."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from ipward.cmd.context import Context, console, pass_ctx, pass_ctx_may_create
from ipward.core import keys
from ipward.core.addr import parse_cidr, parse_ip
from ipward.core.errors import InvalidConfig
from ipward.core.policy import DEFAULT_COOLDOWN, DEFAULT_RELEASE_DELAY, DEFAULT_WARM
from ipward.core.pool import PoolSpec, check_routes, default_gateway
from ipward.core.records import BlockRecord

BAR_WIDTH = 20
MAX_BLOCK_BARS = 32


# -- pools ------------------------------------------------------------------------------


@click.group()
def pool() -> None:
    """Create, inspect and delete pools."""


def parse_range_option(text: str) -> dict:
    """`CIDR[,start=IP][,end=IP][,gateway=IP|none]` -> a range dict. Without `gateway`,
    the subnet's first address is the gateway, as with host-local (so a bridge with
    `isGateway` never shares its address with a pod); `gateway=none` hands it out."""
    parts = [p.strip() for p in text.split(",")]
    if not parts[0]:
        raise InvalidConfig(f"--range {text!r}: needs a CIDR first")
    out = {"subnet": parts[0]}
    names = {"start": "rangeStart", "end": "rangeEnd", "gateway": "gateway", "gw": "gateway"}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in names:
            raise InvalidConfig(
                f"--range {text!r}: {part!r} is not start=IP, end=IP or gateway=IP|none"
            )
        if not value:
            raise InvalidConfig(f"--range {text!r}: {key}= has no value")
        if names[key] in out:
            raise InvalidConfig(f"--range {text!r}: {key} given twice")
        out[names[key]] = value
    if "gateway" not in out:
        gateway = default_gateway(out["subnet"])
        if gateway is not None:
            out["gateway"] = gateway
    elif out["gateway"] == "none":
        del out["gateway"]
    return out


def parse_route_option(text: str) -> dict:
    """`DST[,via=GW]` -> a route dict, checked like a CNI config's routes."""
    dst, *rest = (p.strip() for p in text.split(","))
    route = {"dst": dst}
    for part in rest:
        key, sep, value = part.partition("=")
        if key != "via" or not sep or "gw" in route:
            raise InvalidConfig(f"--route {text!r}: {part!r} is not via=GW (once)")
        route["gw"] = value
    return check_routes([route], f"--route {text!r}")[0]


@pool.command("create")
@click.argument("name")
@click.option(
    "--range",
    "ranges",
    multiple=True,
    required=True,
    help="CIDR[,start=IP][,end=IP][,gateway=IP|none]; repeat for more ranges and for dual"
    " stack. Default gateway: the subnet's first address (as host-local).",
)
@click.option("--exclude", multiple=True, help="CIDR or address never handed out; repeatable.")
@click.option("--route", multiple=True, help="Route for the pool's pods: DST[,via=GW].")
@click.option(
    "--cooldown",
    type=float,
    default=DEFAULT_COOLDOWN,
    show_default=True,
    help="Seconds before a freed address is handed out again.",
)
@click.option("--block-v4", type=int, help="IPv4 block prefix (default 26).")
@click.option("--block-v6", type=int, help="IPv6 block prefix (default 122).")
@click.option(
    "--warm",
    type=int,
    default=DEFAULT_WARM,
    show_default=True,
    help="Free addresses (per family) the controller keeps on every node.",
)
@click.option(
    "--release-delay",
    type=float,
    default=DEFAULT_RELEASE_DELAY,
    show_default=True,
    help="Seconds a surplus block stays empty before the controller asks it back.",
)
@click.option(
    "--borrow/--no-borrow",
    default=False,
    show_default=True,
    help="Let a node take one address from another node's block when no block is free.",
)
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    help="Only pods of this namespace may use the pool; repeatable (default: any).",
)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    help="Only this node may use the pool; repeatable (default: any).",
)
@pass_ctx_may_create
def pool_create(
    c: Context,
    name: str,
    ranges: tuple[str, ...],
    exclude: tuple[str, ...],
    route: tuple[str, ...],
    cooldown: float,
    block_v4: int | None,
    block_v6: int | None,
    warm: int,
    release_delay: float,
    borrow: bool,
    namespaces: tuple[str, ...],
    nodes: tuple[str, ...],
) -> None:
    """Create pool NAME (refuses if it exists, or if another pool covers any of its
    addresses)."""
    from ipward.ipam import pools

    by_family: dict[int, list[dict]] = {}
    for text in ranges:
        r = parse_range_option(text)
        by_family.setdefault(parse_cidr(r["subnet"])[0], []).append(r)
    block_prefix = {}
    for family, option, prefix in ((4, "--block-v4", block_v4), (6, "--block-v6", block_v6)):
        if prefix is None:
            continue
        if family not in by_family:
            raise InvalidConfig(f"{option} {prefix}: the pool has no IPv{family} range")
        block_prefix[family] = prefix
    spec = PoolSpec(
        name,
        [by_family[f] for f in sorted(by_family)],
        list(exclude),
        [parse_route_option(text) for text in route],
        cooldown,
        block_prefix,
        warm=warm,
        release_delay=release_delay,
        borrow=borrow,
        namespaces=namespaces,
        nodes=nodes,
    )
    pools.create_pool(c.store, spec)
    c.emit(
        spec.to_dict(), f"created pool [bold]{name}[/] ({spec.attachments_capacity():,} addresses)"
    )


def _pool_usage(c: Context, spec: PoolSpec) -> dict:
    """Allocations of the pool bucketed per claimed block and per range."""
    kvs, revision = c.store.range(keys.ips_prefix(spec.name))
    blocks, _ = c.store.range(keys.blocks_prefix(spec.name))
    per_block: dict[str, int] = {keys.cidr_of(kv.key): 0 for kv in blocks}
    per_range: dict[str, int] = {}
    for kv in kvs:
        family, value = parse_ip(keys.last(kv.key))
        index = spec.set_of(family)
        rs = spec.range_sets[index] if index is not None else None
        block = rs.block_of(value) if rs else None
        if block is None:
            continue
        per_block[block.cidr] = per_block.get(block.cidr, 0) + 1
        per_range[block.range.subnet] = per_range.get(block.range.subnet, 0) + 1
    return {"used": len(kvs), "revision": revision, "blocks": per_block, "ranges": per_range}


def bar(used: int, total: int) -> str:
    share = used / total if total else 0.0
    filled = round(share * BAR_WIDTH)
    if used and not filled:
        filled = 1  # a used range never looks empty
    color = "green" if share < 0.7 else "yellow" if share < 0.9 else "red"
    return f"[{color}]{'█' * filled}[/][dim]{'░' * (BAR_WIDTH - filled)}[/] {share:6.1%}"


def pools_in_use(c: Context) -> list[tuple[PoolSpec, int]]:
    """Every pool with how many attachments it serves (each holds one address of every
    family, so: the most records of any one family), to set against its capacity."""
    out = []
    for kv in c.store.range(keys.POOLS)[0]:
        spec = PoolSpec.decode(kv.value)
        per_family: dict[bool, int] = {}
        for record in c.store.range(keys.ips_prefix(spec.name))[0]:
            v6 = ":" in record.key
            per_family[v6] = per_family.get(v6, 0) + 1
        out.append((spec, max(per_family.values(), default=0)))
    return out


@pool.command("list")
@pass_ctx
def pool_list(c: Context) -> None:
    """All pools with their size and use."""
    rows: list[dict[str, Any]] = []
    for spec, used in pools_in_use(c):
        ranges = [r.subnet for rs in spec.range_sets for r in rs.ranges]
        rows.append(
            {
                "name": spec.name,
                "ranges": ranges,
                "capacity": spec.attachments_capacity(),
                "used": used,
                "source": spec.source,
            }
        )
    table = Table("pool", "ranges", "used", "capacity", "use", "source")
    for r in rows:
        table.add_row(
            r["name"],
            " ".join(r["ranges"]),
            f"{r['used']:,}",
            f"{r['capacity']:,}",
            bar(r["used"], r["capacity"]),
            r["source"],
        )
    c.emit(rows, table)


@pool.command("show")
@click.argument("name")
@pass_ctx
def pool_show(c: Context, name: str) -> None:
    """A pool's spec and a bar per block (or per range, for large pools)."""
    spec = c.ledger().get_pool(name)
    usage = _pool_usage(c, spec)
    data = {"spec": spec.to_dict(), **usage, "capacity": spec.attachments_capacity()}
    if c.as_json:
        c.emit(data, None)
        return
    console.print(
        f"[bold]{name}[/]  {usage['used']:,} of {spec.attachments_capacity():,} in use"
        f"  (cooldown {spec.cooldown:g}s, read at revision {usage['revision']})"
    )
    table = Table("range", "start", "end", "gateway", "used", "use")
    for rs in spec.range_sets:
        for r in rs.ranges:
            d = r.to_dict()
            total = rs.range_capacity(r)
            used = usage["ranges"].get(r.subnet, 0)
            table.add_row(
                r.subnet,
                d["rangeStart"],
                d["rangeEnd"],
                d.get("gateway", "-"),
                f"{used:,}",
                bar(used, total),
            )
    console.print(table)
    if spec.exclude:
        console.print("excluded: " + ", ".join(spec.exclude))
    blocks = usage["blocks"]
    if blocks and len(blocks) <= MAX_BLOCK_BARS:
        block_table = Table("block", "node", "state", "used", "use")
        states = {
            keys.cidr_of(kv.key): BlockRecord.decode(kv.value)
            for kv in c.store.range(keys.blocks_prefix(spec.name))[0]
        }
        for cidr in sorted(blocks, key=lambda b: parse_cidr(b)[:2]):
            found = None
            for rs in spec.range_sets:
                found = found or rs.block_by_cidr(cidr)
            total = found.usable_count() if found else 0
            state = states.get(cidr)
            block_table.add_row(
                cidr,
                state.node if state is not None else "-",
                state.state if state is not None else "unclaimed",
                str(blocks[cidr]),
                bar(blocks[cidr], total),
            )
        console.print(block_table)
    elif blocks:
        console.print(f"{len(blocks)} blocks claimed (bars shown up to {MAX_BLOCK_BARS})")


@pool.command("delete")
@click.argument("name")
@pass_ctx
def pool_delete(c: Context, name: str) -> None:
    """Delete pool NAME and every key of it; refuses while any address of it is
    allocated. Safe against ADDs in flight; run it again to finish one interrupted."""
    from ipward.ipam import pools

    removed = pools.delete_pool(c.store, name)
    c.emit({"deleted": name, "keys": removed}, f"deleted pool [bold]{name}[/]")
