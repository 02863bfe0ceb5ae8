"""`ipward`: the command line. Human tables by default, `--json` for scripts; the store
comes from `--store` or `IPWARD_STORE`. Errors are one line naming what is wrong, with
exit status 2 (1 is kept for `check` finding problems).

Over 600 lines, for now: every command group (pool, alloc, release, check and gc,
export and import, install-cni) is here on one shared context; one module per group is
the layout's next step."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ipward.cmd.daemon import add_grace_option, redact
from ipward.cni.config import DEFAULT_STORE
from ipward.core import extensions, keys
from ipward.core.addr import format_ip, parse_cidr, parse_ip
from ipward.core.errors import InvalidConfig, IpwardError
from ipward.core.policy import DEFAULT_COOLDOWN, DEFAULT_RELEASE_DELAY, DEFAULT_WARM
from ipward.core.pool import PoolSpec, check_routes, default_gateway
from ipward.core.records import AddressRecord, BlockRecord, ReservationRecord
from ipward.gc import rules as gc_rules
from ipward.ipam import transfer
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreError, open_backend, open_store, schema, store_location

# Scripts and CI pipe the output: give tables room instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 200)
BAR_WIDTH = 20
MAX_BLOCK_BARS = 32


class Context:
    def __init__(self, store_url: str, as_json: bool) -> None:
        self.store_url = store_url
        self.as_json = as_json
        self.create = False  # set by the commands that may make a store (pass_ctx_may_create)
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store, checked (ipward's, at this code's schema); made only by a command
        that may create it: any other finds "no store at ..." and creates nothing."""
        if self._store is None:
            self._store = open_store(self.store_url, create=self.create)
        return self._store

    def backend(self) -> Store:
        """The store without the schema check, for the commands that handle the schema
        themselves (`migrate`, `import`)."""
        if self._store is None:
            self._store = open_backend(self.store_url, create=self.create)
        return self._store

    @property
    def where(self) -> str:
        return store_location(self.store_url)

    def ledger(self) -> Ledger:
        return Ledger(self.store, node=os.uname().nodename)

    def emit(self, data: object, human: object) -> None:
        if self.as_json:
            click.echo(json.dumps(data, indent=2, sort_keys=True))
        else:
            console.print(human)


def _set_global(ctx: click.Context, param: click.Parameter, value: object) -> None:
    """A global option given after the command's name: it wins over one given before."""
    if value is not None and value is not False:
        setattr(ctx.find_object(Context), str(param.name), value)


def _uses_store(create: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Pass the Context to a command and give it the global options, so `ipward check
    --store URL` works as `ipward --store URL check` does (as etcdctl and kubectl take
    flags anywhere). Options on the command, rather than a group that moves words around
    before parsing: click parses them, `--help` lists them, and a command's own option
    of the same name (`sim --store KIND`) is never taken for the global one."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            c = click.get_current_context().find_object(Context)
            assert c is not None
            c.create = create
            return f(c, *args, **kwargs)

        run = click.option(
            "--store",
            "store_url",
            expose_value=False,
            callback=_set_global,
            help="Store URL (also before the command, or IPWARD_STORE).",
        )(run)
        return click.option(
            "--json",
            "as_json",
            is_flag=True,
            expose_value=False,
            callback=_set_global,
            help="Machine-readable output (also before the command).",
        )(run)

    return decorate


pass_ctx = _uses_store(create=False)
pass_ctx_may_create = _uses_store(create=True)


class IpwardGroup(click.Group):
    """Turns our errors into one clear line instead of a traceback. Also offers the commands
    other installed distributions declare (`extensions.COMMANDS`: the labs' demo, sim,
    bench); without them, they are simply not there."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *extensions.added(extensions.COMMANDS)})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None:
            entry = extensions.added(extensions.COMMANDS).get(name)
            command = entry.load() if entry is not None else None
        return command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except IpwardError as e:
            click.echo(f"ipward: {e.msg}" + (f" ({e.details})" if e.details else ""), err=True)
            sys.exit(2)
        except StoreError as e:
            click.echo(f"ipward: store: {e}", err=True)
            sys.exit(2)


@click.group(cls=IpwardGroup)
@click.option(
    "--store",
    envvar="IPWARD_STORE",
    default=DEFAULT_STORE,
    show_default=True,
    help="Store URL: sqlite:///PATH or etcd://HOST:PORT[,HOST:PORT].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.version_option(package_name="ipward", prog_name="ipward", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, store: str, as_json: bool) -> None:
    """ipward: cluster-wide IP address management for container networks."""
    ctx.obj = Context(store, as_json)
    ctx.call_on_close(lambda: ctx.obj._store.close() if ctx.obj._store else None)


# -- pools ------------------------------------------------------------------------------


@cli.group()
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


def _bar(used: int, total: int) -> str:
    share = used / total if total else 0.0
    filled = round(share * BAR_WIDTH)
    if used and not filled:
        filled = 1  # a used range never looks empty
    color = "green" if share < 0.7 else "yellow" if share < 0.9 else "red"
    return f"[{color}]{'█' * filled}[/][dim]{'░' * (BAR_WIDTH - filled)}[/] {share:6.1%}"


def _pools_in_use(c: Context) -> list[tuple[PoolSpec, int]]:
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
    for spec, used in _pools_in_use(c):
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
            _bar(r["used"], r["capacity"]),
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
                _bar(used, total),
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
                _bar(blocks[cidr], total),
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


# -- allocations ------------------------------------------------------------------------


@cli.group()
def alloc() -> None:
    """Inspect allocations."""


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


@alloc.command("list")
@click.option("--pool", "pool_name", help="Only this pool.")
@click.option("--node", help="Only records made on this node.")
@click.option("--pod", help="Only this pod: NAMESPACE/NAME (or NAME).")
@pass_ctx
def alloc_list(c: Context, pool_name: str | None, node: str | None, pod: str | None) -> None:
    """Every allocation, with its attachment, pod, node and revision."""
    prefix = keys.ips_prefix(pool_name or None)
    rows = []
    now = time.time()
    reservations = {
        kv.key: ReservationRecord.decode(kv.value) for kv in c.store.range(keys.STICKY)[0]
    }
    for kv in c.store.range(prefix)[0]:
        pname, ip = keys.ip_parts(kv.key)
        record = AddressRecord.decode(kv.value)
        p = record.pod
        if node and record.node != node:
            continue
        if pod and pod not in (f"{p.namespace}/{p.name}", p.name):
            continue
        row = {"pool": pname, "ip": ip, "revision": kv.mod_revision, **record.to_dict()}
        if record.sticky:
            row["sticky_state"] = _sticky_state(reservations.get(record.sticky), now)
        rows.append(row)
    rows.sort(key=lambda r: (r["pool"], parse_ip(r["ip"])))
    table = Table(
        "pool",
        "address",
        "network",
        "container",
        "ifname",
        "pod",
        "node",
        "age",
        "sticky",
        "revision",
    )
    for r in rows:
        p = r.get("pod", {})
        pod_text = f"{p.get('namespace')}/{p.get('name')}" if p.get("name") else "-"
        state = r.get("sticky_state")
        table.add_row(
            r["pool"],
            r["ip"],
            r["network"],
            r["container"][:12] or "-",
            r["ifname"],
            pod_text,
            r.get("node", "-"),
            _age(now - r.get("created_at", now)),
            _sticky_text(state) if state else "-",
            str(r["revision"]),
        )
    c.emit(rows, table if rows else "no allocations")


def _sticky_state(held: ReservationRecord | None, now: float) -> dict:
    """A reservation's state for `alloc list`: bound or detached (since when), and how
    long it lives (a StatefulSet's as long as its ordinal; others their TTL)."""
    if held is None:
        return {"state": "missing"}
    if held.bound:
        return {"state": "bound", "owner": held.owner_kind or "-"}
    since = float(held.detached_at or now)
    ttl = held.ttl
    left = None if ttl is None else max(0.0, since + float(ttl) - now)
    return {
        "state": "detached",
        "detached_for": round(now - since, 1),
        "ttl_left": None if left is None else round(left, 1),
        "owner": held.owner_kind or "-",
    }


def _sticky_text(state: dict) -> str:
    if state["state"] != "detached":
        return str(state["state"])
    lives = (
        f"TTL {_age(state['ttl_left'])} left"
        if state["ttl_left"] is not None
        else f"kept by {state['owner']}"
    )
    return f"detached {_age(state['detached_for'])}, {lives}"


# -- check, release, status -------------------------------------------------------------


@cli.command("check")
@click.option(
    "--remove-orphans",
    is_flag=True,
    help="First remove keys left by deleted pools and state a pool's current ranges do"
    " not use, prune earlier pool versions no record holds (each a compare-and-"
    "delete; never an allocation record, never a key ipward does not know), and put"
    " the node index in step with the records.",
)
@pass_ctx
def check_command(c: Context, remove_orphans: bool) -> None:
    """Report broken invariants; exit status 1 if any."""
    from ipward.ipam.check import check

    removed: dict[str, Any] = {}
    if remove_orphans:
        from ipward.ipam import pools

        keys, pruned = pools.remove_orphans(c.store)
        indexed = schema.repair_node_index(c.store)
        removed = {
            "removed": keys,
            "pruned": {name: {"keys": k, "layouts": n} for name, (k, n) in pruned.items()},
            "node_index": [{"fixed": kind, "key": key} for kind, key in indexed],
        }
        if not c.as_json:
            pruned_keys = sum(k for k, _ in pruned.values())
            pruned_layouts = sum(n for _, n in pruned.values())
            console.print(
                f"removed {len(keys)} orphan key(s), {pruned_keys} stale key(s), pruned"
                f" {pruned_layouts} earlier pool version(s), fixed {len(indexed)} node index"
                " entries"
            )
    problems, counts = check(c.store)
    data = {"ok": not problems, "problems": [p.to_dict() for p in problems], **counts, **removed}
    if c.as_json:
        c.emit(data, None)
    elif problems:
        table = Table("problem", "key", "detail", title=f"{len(problems)} problem(s)")
        for p in problems:
            table.add_row(p.kind, p.key, p.detail)
        console.print(table)
    else:
        console.print(
            f"ok: {counts['allocations']} allocations, {counts['attachments']} attachments,"
            f" {counts['free']} cooling down, {counts['pools']} pools"
        )
    sys.exit(1 if problems else 0)


@cli.command("gc")
@click.option(
    "--liveness",
    required=True,
    help="Where liveness is read: k8s:// or k8s://?kubeconfig=PATH (the Kubernetes API:"
    " the cluster), cri:///SOCKET (one node's runtime, with --node), or sim:///PATH (the"
    " labs' simulated cluster).",
)
@click.option(
    "--node",
    default="",
    help="The node a cri:// socket belongs to (not with k8s://: a node's scope of the"
    " API has no cluster view).",
)
@add_grace_option
@click.option("--dry-run", is_flag=True, help="Only list the candidates; free nothing.")
@click.option(
    "--confirm-after",
    type=click.FloatRange(0),
    default=5.0,
    show_default=True,
    help="Seconds between the two looks of a real run (a record is freed only when both find it).",
)
@click.option("--all", "show_all", is_flag=True, help="Also list the records kept, and why.")
@pass_ctx
def gc_command(
    c: Context,
    liveness: str,
    node: str,
    add_grace: float,
    dry_run: bool,
    confirm_after: float,
    show_all: bool,
) -> None:
    """Garbage-collect leaked addresses with the controller's rules, once."""
    from ipward.cluster.liveness import open_source

    source = open_source(liveness, node=node)
    try:
        freed: list[gc_rules.Verdict] = []
        if dry_run:
            verdicts = gc_rules.look(c.store, source, add_grace).verdicts
        else:
            verdicts, freed = gc_rules.collect_once(
                c.ledger(),
                source,
                grace=add_grace,
                confirm_after=confirm_after,
                who="ipward gc",
                sleep=time.sleep,
            )
    finally:
        source.close()
    candidates = [v for v in verdicts if v.reason]
    shown = verdicts if show_all else candidates
    freed_refs = {v.held.ref for v in freed}
    data = {
        "dry_run": dry_run,
        "records": len(verdicts),
        "candidates": [v.to_dict() for v in candidates],
        "freed": sorted(freed_refs),
        **({"kept": [v.to_dict() for v in verdicts if not v.reason]} if show_all else {}),
    }
    if c.as_json:
        c.emit(data, None)
        return
    title = f"{len(candidates)} candidate(s) of {len(verdicts)} record(s)" + (
        "" if dry_run else f", {len(freed)} freed"
    )
    table = Table("address", "attachment", "node", "pod", "age", "verdict", "evidence", title=title)
    now = time.time()
    for v in sorted(shown, key=lambda v: (v.reason is None, v.held.ref)):
        d = v.to_dict()
        verdict = v.reason or "kept"
        if v.reason and not dry_run:
            verdict += " (freed)" if v.held.ref in freed_refs else " (not confirmed)"
        network, container, ifname = d["attachment"].split("/", 2)
        table.add_row(
            d["address"],
            f"{network}/{container[:12]}/{ifname}",
            d["node"],
            d["pod"],
            _age(now - d["created_at"]),
            verdict,
            d["evidence"],
        )
    console.print(table)


@cli.command("release")
@click.option("--pool", "pool_name", help="Pool of the address.")
@click.option("--ip", help="Address to release.")
@click.option(
    "--sticky",
    "sticky",
    metavar="NS/NAME",
    help="Free the sticky reservation of this pod identity (it must be detached).",
)
@click.option("--network", help="With --sticky: the network, when the identity has several.")
@click.option(
    "--revision",
    type=int,
    help="Release only if the record is still at this revision (from alloc list).",
)
@click.option("--yes", is_flag=True, help="Do not ask; release the record as shown.")
@pass_ctx
def release_command(
    c: Context,
    pool_name: str | None,
    ip: str | None,
    sticky: str | None,
    network: str | None,
    revision: int | None,
    yes: bool,
) -> None:
    """Free one address (--pool, --ip) or one sticky reservation (--sticky) by hand:
    compare-and-delete, refused if it changed since it was shown. A sticky address given
    by --ip is detached (its reservation keeps it), not freed."""
    if sticky:
        if pool_name or ip:
            raise InvalidConfig("--sticky frees a reservation; do not give --pool or --ip too")
        _release_sticky(c, sticky, network, revision, yes)
        return
    if not pool_name or not ip:
        raise InvalidConfig("give --pool and --ip (an address), or --sticky NS/NAME")
    ip = format_ip(*parse_ip(ip))
    kv = c.store.get(keys.ip_key(pool_name, ip))
    if kv is None:
        raise InvalidConfig(f"--ip {ip} is not allocated in pool {pool_name}")
    record = AddressRecord.decode(kv.value)
    shown = revision if revision is not None else kv.mod_revision
    if revision is None and not yes and not c.as_json:
        p = record.pod
        console.print(
            f"{pool_name}/{ip} belongs to {record.attachment!r} (pod {p.namespace}/{p.name},"
            f" node {record.node}, revision {kv.mod_revision})"
        )
        if not click.confirm("release it?", default=False):
            raise click.Abort
    freed = c.ledger().release_address(pool_name, ip, shown, "ipward release by an operator")
    c.emit(
        {"released": f"{pool_name}/{ip}", "record": freed.to_dict(), "revision": shown},
        f"released {pool_name}/{ip}",
    )


def _release_sticky(
    c: Context, identity: str, network: str | None, revision: int | None, yes: bool
) -> None:
    namespace, sep, name = identity.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise InvalidConfig(f"--sticky {identity!r}: expected NAMESPACE/NAME")
    found = [
        kv
        for kv in c.store.range(keys.STICKY)[0]
        if keys.sticky_parts(kv.key)[1:] == (namespace, name)
        and (network is None or keys.sticky_parts(kv.key)[0] == network)
    ]
    if not found:
        raise InvalidConfig(f"--sticky {identity}: no reservation for it")
    if len(found) > 1:
        networks = ", ".join(keys.sticky_parts(kv.key)[0] for kv in found)
        raise InvalidConfig(
            f"--sticky {identity} is reserved on networks {networks}: give --network"
        )
    kv = found[0]
    held = ReservationRecord.decode(kv.value)
    if held.bound:
        raise InvalidConfig(
            f"--sticky {identity}: bound to {held.attachment}; its pod holds the address"
            " (delete the pod first)"
        )
    shown = revision if revision is not None else kv.mod_revision
    if revision is None and not yes and not c.as_json:
        console.print(f"{kv.key} holds {', '.join(held.ips)} (revision {kv.mod_revision})")
        if not click.confirm("free it?", default=False):
            raise click.Abort
    freed = c.ledger().free_sticky(kv.key, shown, "ipward release --sticky by an operator")
    c.emit(
        {"released": kv.key, "ips": freed, "revision": shown},
        f"released {kv.key}: {', '.join(freed)}",
    )


@cli.command("status")
@pass_ctx
def status_command(c: Context) -> None:
    """Store, revision, pools and how full they are."""
    pools: list[dict[str, Any]] = [
        {"name": spec.name, "used": used, "capacity": spec.attachments_capacity()}
        for spec, used in _pools_in_use(c)
    ]
    data = {
        "store": redact(c.store_url),
        "revision": c.store.revision(),
        "schema": schema.VERSION,  # open_store refuses any other
        "pools": pools,
    }
    lines = [
        f"store     {data['store']}",
        f"revision  {data['revision']}",
        f"schema    {data['schema']}",
    ]
    for p in pools:
        lines.append(
            f"pool      {p['name']:<16} {_bar(p['used'], p['capacity'])}"
            f"  {p['used']:,}/{p['capacity']:,}"
        )
    c.emit(data, "\n".join(lines))


# -- schema, export, import -------------------------------------------------------------


@cli.command("migrate")
@pass_ctx
def migrate_command(c: Context) -> None:
    """Bring the store to this ipward's schema version, one step (one transaction) per
    version; safe to run again. Refuses a store newer than this ipward."""
    found, reached = schema.migrate(c.backend(), c.where)
    data = {"store": c.where, "found": found, "version": schema.VERSION, "steps": reached}
    if reached:
        steps = ", ".join(f"{v - 1} -> {v}" for v in reached)
        human = f"migrated {c.where} from schema version {found} to {schema.VERSION} ({steps})"
    else:
        human = f"{c.where} is at schema version {schema.VERSION}: nothing to do"
    c.emit(data, human)


@cli.command("export")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    help="Write here (replaced atomically when complete) instead of to stdout.",
)
@pass_ctx
def export_command(c: Context, output: str | None) -> None:
    """The whole ledger as JSON lines, read at one revision: a header, then one line per
    key. Leased keys (node registrations, the leader key) are not exported."""
    if output is None:
        header = transfer.export(c.store, c.where, sys.stdout)
    else:
        partial = f"{output}.partial-{os.getpid()}"
        try:
            with open(partial, "w") as f:
                header = transfer.export(c.store, c.where, f)
            os.replace(partial, output)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    summary = f"exported {header['keys']:,} keys at revision {header['revision']} to {output}"
    if output is not None:
        click.echo(json.dumps(header) if c.as_json else summary, err=not c.as_json)


@cli.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--batch-keys",
    type=click.IntRange(1, 100),
    default=transfer.BATCH_KEYS,
    show_default=True,
    help="Keys per transaction.",
)
@pass_ctx_may_create
def import_command(c: Context, file: str, batch_keys: int) -> None:
    """Load an `ipward export` FILE into an empty store (made if there is none), in
    bounded transactions; other processes refuse the store until it is done. An import
    cut short is finished by running the same command again."""
    export_file = transfer.ExportFile(file)  # checked whole before the store is touched
    summary = transfer.import_file(c.backend(), c.where, export_file, batch_keys)
    human = (
        f"imported {summary['keys']:,} keys into {c.where}"
        f" (exported at revision {summary['source_revision']})"
    )
    if summary["resumed_at"]:
        human += f", resumed after key {summary['resumed_at']:,}"
    if summary["schema"] < schema.VERSION:
        human += f"; schema version {summary['schema']}: run `ipward migrate`"
    c.emit(summary, human)


# -- install ----------------------------------------------------------------------------


@cli.command("install-cni")
@click.option(
    "--bin-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="The runtime's CNI bin dir (e.g. /opt/cni/bin).",
)
@click.option("--name", default="ipward", show_default=True, help="Executable name.")
@click.option(
    "--standalone",
    is_flag=True,
    help="Write one self-contained file for a host without ipward (a Kubernetes node): it"
    " runs on the host's /usr/bin/python3 and forwards every call to the node agent.",
)
@click.option(
    "--host-root",
    default="/",
    show_default=True,
    type=click.Path(file_okay=False),
    help="With --standalone: where the host's root is mounted, to check its python3.",
)
def install_cni(bin_dir: str, name: str, standalone: bool, host_root: str) -> None:
    """Install the plugin executable into a CNI bin dir."""
    from ipward.cmd import install, standalone_build

    target = Path(bin_dir) / name
    if not standalone:
        install.write_launcher(target)
    else:
        problem = standalone_build.host_python_problem(Path(host_root))
        if problem:
            raise click.BadParameter(problem, param_hint="--host-root")
        install.write_executable(target, standalone_build.standalone_plugin())
    click.echo(f"installed {target}")


def _attach_commands() -> None:
    from ipward.cmd.agent import agent_command
    from ipward.cmd.controller import controller_command

    cli.add_command(agent_command, "agent")
    cli.add_command(controller_command, "controller")


_attach_commands()


def main() -> None:
    cli(prog_name="ipward")
