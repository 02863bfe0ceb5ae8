"""`ipward status`, `check`, `gc`, `migrate`, `export` and `import`: the store as a
whole."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from ipward.cmd.context import (
    Context,
    age,
    console,
    listed_timeout_option,
    open_listed_source,
    pass_ctx,
    pass_ctx_may_create,
)
from ipward.cmd.daemon import add_grace_option, redact
from ipward.cmd.pools import bar, pools_in_use
from ipward.core import keys
from ipward.core.policy import CLOCK_SKEW_BOUND
from ipward.core.records import LeaderRecord
from ipward.gc import clocks
from ipward.gc import rules as gc_rules
from ipward.ipam import transfer
from ipward.store import refuse_damaged, schema

if TYPE_CHECKING:
    from ipward.ipam.check import Problem

# -- check, release, status -------------------------------------------------------------


@click.command("check")
@click.option(
    "--remove-orphans",
    is_flag=True,
    help="Then repair what can be repaired, after showing it, each by compare on the"
    " revision read: remove bad keys and values, write back lost records from their"
    " node index copies, free records no attachment's index lists (logged), remove keys"
    " left by deleted pools and state a pool's current ranges do not use, prune earlier"
    " pool versions no record holds, and put the node index in step with the records."
    " Never a key ipward does not know (it may be another program's); refused on a store"
    " that reports damage.",
)
@pass_ctx
def check_command(c: Context, remove_orphans: bool) -> None:
    """Report broken invariants; exit status 1 if any."""
    from ipward.ipam.check import check, repair

    problems, counts = check(c.store)
    said = [p.detail for p in problems if p.kind == "integrity"]
    repaired: dict[str, Any] = {}
    if remove_orphans:
        from ipward.ipam import pools

        refuse_damaged(c.where, said)
        fixes = [p for p in problems if p.fix]
        if fixes and not c.as_json:
            console.print(_problem_table(fixes, f"repairing {len(fixes)} problem(s)", fix=True))
        done = repair(c.ledger(), fixes)
        keys, pruned = pools.remove_orphans(c.store)
        indexed = schema.repair_node_index(c.store)
        repaired = {
            "removed": keys,
            "pruned": {name: {"keys": k, "layouts": n} for name, (k, n) in pruned.items()},
            "node_index": [{"fixed": kind, "key": key} for kind, key in indexed],
            "repaired": [p.to_dict() for p in fixes],
            "unreadable_removed": done["remove"],
            "records_restored": done["restore"],
            "unlisted_freed": done["free"],
        }
        if not c.as_json:
            pruned_keys = sum(k for k, _ in pruned.values())
            pruned_layouts = sum(n for _, n in pruned.values())
            console.print(
                f"removed {len(done['remove'])} bad key(s) or value(s), restored"
                f" {len(done['restore'])} lost record(s), freed {len(done['free'])} unlisted"
                f" record(s); removed {len(keys)} orphan key(s), {pruned_keys} stale key(s),"
                f" pruned {pruned_layouts} earlier pool version(s), fixed {len(indexed)} node"
                " index entries"
            )
        problems, counts = check(c.store)
    data = {"ok": not problems, "problems": [p.to_dict() for p in problems], **counts, **repaired}
    if c.as_json:
        c.emit(data, None)
    elif problems:
        console.print(_problem_table(problems, f"{len(problems)} problem(s)"))
        if said:
            console.print(
                "the store reports damage: move the ledger to a sound store (README: Damaged"
                " stores)"
            )
    else:
        console.print(
            f"ok: {counts['allocations']} allocations, {counts['attachments']} attachments,"
            f" {counts['free']} cooling down, {counts['pools']} pools"
        )
    sys.exit(1 if problems else 0)


def _problem_table(problems: list[Problem], title: str, fix: bool = False) -> Table:
    table = Table("problem", "key", "detail", *(["fix", "revision"] if fix else []), title=title)
    for p in problems:
        table.add_row(p.kind, p.key or "-", p.detail, *([p.fix, str(p.revision)] if fix else []))
    return table


@click.command("gc")
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
@listed_timeout_option
@pass_ctx
def gc_command(
    c: Context,
    liveness: str,
    node: str,
    add_grace: float,
    dry_run: bool,
    confirm_after: float,
    show_all: bool,
    timeout: float,
) -> None:
    """Garbage-collect leaked addresses with the controller's rules, once."""
    source = open_listed_source(liveness, node, timeout)
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
            age(now - d["created_at"]),
            verdict,
            d["evidence"],
        )
    console.print(table)


@click.command("status")
@pass_ctx
def status_command(c: Context) -> None:
    """Store, revision, the controller leading, the nodes with a live agent (and those
    whose clock is off this machine's), pools and how full they are."""
    pools: list[dict[str, Any]] = [
        {"name": spec.name, "used": used, "capacity": spec.attachments_capacity()}
        for spec, used in pools_in_use(c)
    ]
    leader_kv = c.store.get(keys.LEADER_KEY)
    leader = LeaderRecord.decode(leader_kv.value) if leader_kv is not None else None
    registrations = c.store.range(keys.NODES)[0]
    offsets = clocks.measure_all(registrations, time.time())
    nodes = sorted(name for kv in registrations if (name := keys.registered_node(kv.key)))
    skewed = {node: offset for node, offset in sorted(offsets.items()) if offset.skewed}
    data = {
        "store": redact(c.store_url),
        "revision": c.store.revision(),
        "schema": schema.VERSION,  # open_store refuses any other
        "leader": {"id": leader.ident, "since": leader.since} if leader else None,
        "nodes": nodes,
        # Each node's clock minus this machine's, as its registration shows it: at least
        # `min`, at most `max` (None: its agent does not say how often it writes it).
        "clocks": {n: {"offset_min": o.low, "offset_max": o.high} for n, o in offsets.items()},
        "clocks_skewed": list(skewed),
        "pools": pools,
    }
    since = f" (since {age(time.time() - leader.since)} ago)" if leader else ""
    lines = [
        f"store     {data['store']}",
        f"revision  {data['revision']}",
        f"schema    {data['schema']}",
        f"leader    {leader.ident + since if leader else '(no controller leads)'}",
        f"nodes     {len(nodes):,} with a live agent",
    ]
    for node, offset in skewed.items():
        lines.append(
            f"clock     {node} {offset.describe()} (more than {CLOCK_SKEW_BOUND:g}s off;"
            " record ages are corrected for it)"
        )
    for p in pools:
        lines.append(
            f"pool      {p['name']:<16} {bar(p['used'], p['capacity'])}"
            f"  {p['used']:,}/{p['capacity']:,}"
        )
    c.emit(data, "\n".join(lines))


# -- schema, export, import -------------------------------------------------------------


@click.command("migrate")
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


@click.command("export")
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


@click.command("import")
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
