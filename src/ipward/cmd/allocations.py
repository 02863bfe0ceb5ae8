"""`ipward alloc list` and `ipward release`: the allocations, and freeing one by hand."""

from __future__ import annotations

import time

import click
from rich.table import Table

from ipward.cmd.context import (
    Context,
    age,
    console,
    listed_timeout_option,
    open_listed_source,
    pass_ctx,
)
from ipward.cmd.daemon import add_grace_option
from ipward.core import keys
from ipward.core.addr import format_ip, parse_ip
from ipward.core.errors import InvalidConfig
from ipward.core.records import AddressRecord, ReservationRecord
from ipward.gc import rules as gc_rules

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.store.base import KeyValue

# -- allocations ------------------------------------------------------------------------


@click.group()
def alloc() -> None:
    """Inspect allocations."""


@alloc.command("list")
@click.option("--pool", "pool_name", help="Only this pool.")
@click.option("--node", help="Only records made on this node.")
@click.option("--pod", help="Only this pod: NAMESPACE/NAME (or NAME).")
@pass_ctx
def alloc_list(c: Context, pool_name: str | None, node: str | None, pod: str | None) -> None:
    """Every allocation, with its attachment, pod, node and revision. A key or record
    that cannot be read is left out and named on stderr (`ipward check` reports it)."""
    from ipward.ipam.check import unreadable

    prefix = keys.ips_prefix(pool_name or None)
    rows = []
    now = time.time()
    damaged = []
    reservations = {}
    for kv in c.store.range(keys.STICKY)[0]:
        if unreadable(kv) is None:
            reservations[kv.key] = ReservationRecord.decode(kv.value)
    for kv in c.store.range(prefix)[0]:
        problem = unreadable(kv)
        if problem is not None:
            damaged.append(problem)
            continue
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
            age(now - r.get("created_at", now)),
            _sticky_text(state) if state else "-",
            str(r["revision"]),
        )
    c.emit(rows, table if rows else "no allocations")
    for problem in damaged:
        click.echo(f"ipward: not listed: {problem!r} (see 'ipward check')", err=True)


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
        f"TTL {age(state['ttl_left'])} left"
        if state["ttl_left"] is not None
        else f"kept by {state['owner']}"
    )
    return f"detached {age(state['detached_for'])}, {lives}"


@click.command("release")
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
@click.option(
    "--liveness",
    help="With --ip: first judge the record as garbage collection does, on this source"
    " (k8s:// or k8s://?kubeconfig=PATH, cri:///SOCKET with --node, sim:///PATH), and"
    " refuse while it does not show the pod gone. Without it, nothing is checked.",
)
@click.option("--node", "liveness_node", default="", help="The node a cri:// socket belongs to.")
@add_grace_option
@listed_timeout_option
@pass_ctx
def release_command(
    c: Context,
    pool_name: str | None,
    ip: str | None,
    sticky: str | None,
    network: str | None,
    revision: int | None,
    yes: bool,
    liveness: str | None,
    liveness_node: str,
    add_grace: float,
    timeout: float,
) -> None:
    """Free one address (--pool, --ip) or one sticky reservation (--sticky) by hand:
    compare-and-delete, refused if it changed since it was shown. A sticky address given
    by --ip is detached (its reservation keeps it), not freed."""
    if sticky:
        if pool_name or ip:
            raise InvalidConfig("--sticky frees a reservation; do not give --pool or --ip too")
        if liveness:
            raise InvalidConfig(
                "--liveness checks the pod of an address (--ip); a detached"
                " reservation (--sticky) has no sandbox to check"
            )
        _release_sticky(c, sticky, network, revision, yes)
        return
    if not pool_name or not ip:
        raise InvalidConfig("give --pool and --ip (an address), or --sticky NS/NAME")
    ip = format_ip(*parse_ip(ip))
    kv = c.store.get(keys.ip_key(pool_name, ip))
    if kv is None:
        raise InvalidConfig(f"--ip {ip} is not allocated in pool {pool_name}")
    record = AddressRecord.decode(kv.value)
    p = record.pod
    if liveness:
        checked = _judged_gone(c, kv, liveness, liveness_node, add_grace, timeout)
    else:
        checked = "nothing checked (no --liveness)"
        click.echo(
            f"ipward: warning: nothing checked that pod {p.namespace}/{p.name} no longer uses"
            f" {pool_name}/{ip} (--liveness URL judges it as garbage collection does)",
            err=True,
        )
    shown = revision if revision is not None else kv.mod_revision
    if revision is None and not yes and not c.as_json:
        console.print(
            f"{pool_name}/{ip} belongs to {record.attachment!r} (pod {p.namespace}/{p.name},"
            f" node {record.node}, revision {kv.mod_revision})"
        )
        if not click.confirm("release it?", default=False):
            raise click.Abort
    freed = c.ledger().free_address(
        pool_name, ip, shown, f"ipward release by an operator: {checked}"
    )
    c.emit(
        {
            "released": f"{pool_name}/{ip}",
            "record": freed.to_dict(),
            "revision": shown,
            "checked": checked,
        },
        f"released {pool_name}/{ip} ({checked})",
    )


def _judged_gone(
    c: Context, kv: KeyValue, liveness: str, node: str, grace: float, timeout: float
) -> str:
    """What shows the record's pod gone, judged as garbage collection judges it (its
    rules, the live read before a free on the cluster's word); InvalidConfig (nothing
    changed) saying what shows it alive, or why nothing shows it gone."""
    where = "/".join(keys.ip_parts(kv.key))
    held = gc_rules.held_records([kv])
    if not held:
        return "its record holds no sandbox"  # detached: its reservation keeps it
    source = open_listed_source(liveness, node, timeout)
    try:
        look = gc_rules.look_at(held, [], gc_rules.registrations(c.store), source, grace)
        verdict = look.verdicts[0]
        if verdict.reason is None:
            raise InvalidConfig(
                f"{where} not released: {verdict.evidence} (on {liveness}; nothing changed)"
            )
        live = gc_rules.live_word(source, verdict)
    finally:
        source.close()
    if not live.confirmed:
        raise InvalidConfig(
            f"{where} not released: {verdict.reason} on the cached view ({verdict.evidence}),"
            f" not confirmed by a live read: {live.evidence} (nothing changed)"
        )
    return f"{verdict.reason}: {verdict.evidence}"


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
