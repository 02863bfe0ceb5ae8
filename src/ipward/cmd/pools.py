"""`ipward pool`: create, list, show and delete pools.

On a store whose pools are IPPool objects (a `k8s://` store in `ipward-system`:
`controller/pool_objects.py`, docs/design.md 5.16) the commands act on the objects:
`create` makes the object and takes its first step at once (its pool into the ledger,
through the overlap guard; refused, the object is withdrawn and nothing is left), so
the pool is usable when it returns, with a controller running or not; `delete` deletes
the object and takes the finalizer's step (the pool deleted once no address of it is
allocated; until then it says what holds it, and the controller finishes); `list` and
`show` add each object's state. A pool with no object (a network config's inline pool,
one moved in by `ipward import`) is deleted as on etcd. Elsewhere, the ledger only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from ipward.cmd.context import Context, console, pass_ctx, pass_ctx_may_create
from ipward.core import ippool, keys
from ipward.core.addr import parse_cidr, parse_ip
from ipward.core.errors import (
    InvalidConfig,
    IpwardError,
    PoolExists,
    TryAgainLater,
)
from ipward.core.policy import DEFAULT_COOLDOWN, DEFAULT_RELEASE_DELAY, DEFAULT_WARM
from ipward.core.pool import CLI, IPPOOL, PoolSpec, check_routes, default_gateway
from ipward.core.records import AddressRecord, BlockRecord

if TYPE_CHECKING:
    from ipward.controller.pool_objects import ObjectSteps
    from ipward.core.ippool import PoolObject
    from ipward.kubeapi.client import ApiClient

BAR_WIDTH = 20
MAX_BLOCK_BARS = 32
ATTEMPTS = 5  # an object's step tried again when it changed meanwhile (the controller's write)
NO_RESOURCE = (
    "the Kubernetes API serves no IPPool resource (ippools.ipward.io): install it"
    " (kubectl apply -k deploy/base)"
)


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

    objects = _objects_client(c)
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
        source=CLI if objects is None else IPPOOL,
    )
    if objects is None:
        pools.create_pool(c.store, spec)
    else:
        with _api(objects):
            _create_object(c, objects, spec)
    c.emit(
        spec.to_dict(), f"created pool [bold]{name}[/] ({spec.attachments_capacity():,} addresses)"
    )


# -- pools as IPPool objects --------------------------------------------------------------


def _objects_client(c: Context) -> ApiClient | None:
    from ipward.controller.pool_objects import objects_client

    return objects_client(c.store_url)


@contextlib.contextmanager
def _api(client: ApiClient) -> Iterator[None]:
    """The API's refusals as the CLI's errors (one line, exit status 2); the client
    closed after."""
    from ipward.kubeapi.client import ApiError, ApiUnreachable

    try:
        yield
    except ApiError as e:
        raise IpwardError(f"Kubernetes API: {e}") from None
    except ApiUnreachable as e:
        raise TryAgainLater(f"Kubernetes API unreachable: {e}") from None
    finally:
        client.close()


def _steps(c: Context, client: ApiClient) -> ObjectSteps:
    from ipward.controller.pool_objects import ObjectSteps

    return ObjectSteps(c.store, client, lambda: [])  # the CLI's writes are not fenced


def _get_object(client: ApiClient, name: str) -> PoolObject | None:
    from ipward.kubeapi.client import ApiError

    try:
        return ippool.parse(client.request("GET", ippool.path(name)))[1]
    except ApiError as e:
        if e.not_found:
            return None
        raise


def _objects(client: ApiClient) -> dict[str, PoolObject]:
    from ipward.kubeapi.client import ApiError

    try:
        listed = client.request("GET", ippool.PATH)
    except ApiError as e:
        if e.status == 404:
            raise IpwardError(NO_RESOURCE) from None
        raise
    return dict(ippool.parse(item) for item in listed.get("items") or [])


def _create_object(c: Context, client: ApiClient, spec: PoolSpec) -> None:
    """The object, then its pool in the ledger (the step the controller would take);
    refused, the object is withdrawn: nothing is left."""
    from ipward.ipam import pools
    from ipward.kubeapi.client import ApiError

    store, name = c.store, spec.name
    if store.get(keys.pool_key(name)) is not None:
        raise PoolExists(f"pool {name} already exists")
    pools.check_overlap(store, spec)  # refused before anything is written
    try:
        answer = client.request(
            "POST", ippool.PATH, {"fieldValidation": "Strict"}, body=ippool.manifest(spec)
        )
    except ApiError as e:
        if e.status == 409:
            raise PoolExists(
                f"pool {name} already exists (an IPPool object: kubectl get ipwpool {name})"
            ) from None
        if e.status in (400, 422):
            raise InvalidConfig(f"the Kubernetes API refused pool {name}: {e.message}") from None
        if e.status == 404:
            raise IpwardError(NO_RESOURCE) from None
        raise
    obj = ippool.parse(answer)[1]
    steps = _steps(c, client)
    for _ in range(ATTEMPTS):
        try:
            verdict, _ = steps.apply(obj, store.get(keys.pool_key(name)))
        except TryAgainLater:
            continue  # the controller stored it meanwhile: judged again on what is there
        if verdict.reason == ippool.APPLIED:
            return
        _withdraw(client, steps, name)
        raise InvalidConfig(verdict.message)
    _withdraw(client, steps, name)
    raise TryAgainLater(f"pool {name}: the ledger kept changing while it was created; try again")


def _withdraw(client: ApiClient, steps: ObjectSteps, name: str) -> None:
    """The object just made deleted again, and released (its pool is not in the
    ledger, so the finalizer's step only lets it go)."""
    from ipward.kubeapi.client import ApiError

    with contextlib.suppress(ApiError):
        client.request("DELETE", ippool.path(name))
    for _ in range(ATTEMPTS):
        obj = _get_object(client, name)
        if obj is None or not obj.held or steps.delete(obj) is not None:
            return


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
    """All pools with their size and use (and, where pools are IPPool objects, each
    object's state, and the objects not in the ledger)."""
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
    client = _objects_client(c)
    if client is not None:
        with _api(client):
            objects = _objects(client)
        for row in rows:
            found = objects.pop(row["name"], None)
            row["object"] = _state(found) if found is not None else None
        for obj in objects.values():  # not in the ledger (its status says why)
            rows.append(_unstored_row(obj))
        rows.sort(key=lambda r: r["name"])
    columns = ["pool", "ranges", "used", "capacity", "use", "source"]
    table = Table(*columns, *(["object"] if client is not None else []))
    for r in rows:
        cells = [
            r["name"],
            " ".join(r["ranges"]),
            f"{r['used']:,}",
            f"{r['capacity']:,}",
            bar(r["used"], r["capacity"]),
            r["source"],
        ]
        if client is not None:
            state = r["object"]
            cells.append(state["reason"] if state is not None else "-")
        table.add_row(*cells)
    c.emit(rows, table)


def _state(obj: PoolObject) -> dict[str, Any]:
    """An object's state as its status says it (`Ready`'s reason and message), or
    that no controller has judged it yet."""
    ready = ippool.condition(obj, ippool.READY)
    if ready is None or ready.get("observedGeneration") != obj.generation:
        waiting = "Deleting" if obj.deleting else "Pending"
        return {"ready": False, "reason": waiting, "message": "not judged yet"}
    return {
        "ready": ready.get("status") == "True",
        "reason": str(ready.get("reason", "")),
        "message": str(ready.get("message", "")),
    }


def _unstored_row(obj: PoolObject) -> dict[str, Any]:
    """An object whose pool is not in the ledger (invalid, overlapping, refused, or not
    applied yet)."""
    given = obj.spec.get("ranges")
    subnets = [r.get("subnet") for r in given if isinstance(r, dict)] if given else []
    try:
        capacity = ippool.declared(obj).attachments_capacity()
    except InvalidConfig:
        capacity = 0
    return {
        "name": obj.name,
        "ranges": [str(s) for s in subnets],
        "capacity": capacity,
        "used": 0,
        "source": IPPOOL,
        "object": _state(obj),
    }


@pool.command("show")
@click.argument("name")
@pass_ctx
def pool_show(c: Context, name: str) -> None:
    """A pool's spec and a bar per block (or per range, for large pools); where pools
    are IPPool objects, its object's conditions too."""
    client = _objects_client(c)
    obj = None
    if client is not None:
        with _api(client):
            obj = _get_object(client, name)
    if obj is not None and c.store.get(keys.pool_key(name)) is None:
        _show_unstored(c, obj)
        return
    spec = c.ledger().get_pool(name)
    usage = _pool_usage(c, spec)
    data = {"spec": spec.to_dict(), **usage, "capacity": spec.attachments_capacity()}
    if client is not None:
        data["object"] = None if obj is None else {**_state(obj), "status": obj.status}
    if c.as_json:
        c.emit(data, None)
        return
    console.print(
        f"[bold]{name}[/]  {usage['used']:,} of {spec.attachments_capacity():,} in use"
        f"  (cooldown {spec.cooldown:g}s, read at revision {usage['revision']})"
    )
    if client is not None:
        _print_conditions(obj)
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


def _show_unstored(c: Context, obj: PoolObject) -> None:
    """An object whose pool is not in the ledger: its spec and why."""
    data = {"object": {**_state(obj), "spec": obj.spec, "status": obj.status}}
    if c.as_json:
        c.emit(data, None)
        return
    given = obj.spec.get("ranges") or []
    subnets = " ".join(str(r.get("subnet")) for r in given if isinstance(r, dict))
    console.print(f"[bold]{obj.name}[/]  IPPool object, not in the ledger  ({subnets})")
    _print_conditions(obj)


def _print_conditions(obj: PoolObject | None) -> None:
    if obj is None:
        console.print("no IPPool object (a network config's pool, or moved in by import)")
        return
    state = _state(obj)
    console.print(f"object: {state['reason']}: {state['message']}")
    for kind in (ippool.OVERLAPS, ippool.EXHAUSTED):
        found = ippool.condition(obj, kind)
        if found is not None and found.get("status") == "True":
            console.print(f"{kind}: {found.get('message', '')}")


@pool.command("delete")
@click.argument("name")
@pass_ctx
def pool_delete(c: Context, name: str) -> None:
    """Delete pool NAME and every key of it; refuses while any address of it is
    allocated. Safe against ADDs in flight; run it again to finish one interrupted. On
    a store whose pools are IPPool objects: deletes the object; while addresses are
    allocated, the pool is marked deleting (ADDs get 103) and the controller finishes
    once they are freed."""
    from ipward.ipam import pools

    objects = _objects_client(c)
    if objects is not None:
        with _api(objects):
            obj = _get_object(objects, name)
            if obj is not None:
                _delete_object(c, objects, obj)
                return
    removed = pools.delete_pool(c.store, name)
    c.emit({"deleted": name, "keys": removed}, f"deleted pool [bold]{name}[/]")


def _delete_object(c: Context, client: ApiClient, obj: PoolObject) -> None:
    """The object deleted, then the finalizer's step (the controller's, taken here so
    that a pool no address holds is gone when this returns)."""
    from ipward.controller.pool_objects import source_of
    from ipward.ipam import pools
    from ipward.kubeapi.client import ApiError

    name = obj.name
    with contextlib.suppress(ApiError):
        client.request("DELETE", ippool.path(name))
    steps = _steps(c, client)
    held: list | None = None
    for _ in range(ATTEMPTS):
        found = _get_object(client, name)
        try:
            held = [] if found is None or not found.held else steps.delete(found)
        except TryAgainLater:
            continue  # the controller took the same step meanwhile: read again
        if held is not None:
            break
    if held is None:
        raise TryAgainLater(f"pool {name}: its object kept changing; run it again")
    if held:
        shown = [
            ippool.holder(keys.last(kv.key), AddressRecord.decode(kv.value))
            for kv in held[: ippool.HOLDERS_SHOWN]
        ]
        more = ", ..." if len(held) > len(shown) else ""
        c.emit(
            {"deleting": name, "addresses": len(held), "heldBy": shown},
            f"pool [bold]{name}[/] is being deleted: {len(held):,} address"
            f"{'' if len(held) == 1 else 'es'} still allocated ({'; '.join(shown)}{more});"
            " new ADDs of it get 103, and the controller deletes it once they are freed"
            f" (kubectl get ipwpool {name} -o yaml: status.deletion)",
        )
        return
    left = c.store.get(keys.pool_key(name))
    if left is not None and source_of(left) == IPPOOL:
        pools.delete_pool(c.store, name)  # the object went unheld: nothing else will
    c.emit({"deleted": name}, f"deleted pool [bold]{name}[/]")
