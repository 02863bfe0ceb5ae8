"""Whether the store an agent starts on is the one its node's pods got their addresses
from (docs/design.md 5.15, "Moving"): an upgrade must never move running pods onto a
store that does not know their addresses, or it would hand them out again.

The evidence is the plugin's notes on the node (`cni/notes.py`: one per attachment whose
ADD reached an agent, until its DEL) and the node's runtime: an attachment noted whose
sandbox the runtime lists ready got its addresses from an agent. When the store knows
none of those attachments (no index under this node: `attach/<node>/...`), it is not
that agent's store, and the agent refuses to serve, saying how to move the ledger. Some
known and some not is a store that holds this node's ledger (a note can outlive a
refused ADD's sandbox until its DEL): served. No runtime to read: nothing to judge by,
served (logged).
"""

from __future__ import annotations

import os

from ipward.cluster.liveness import LivenessSource, LivenessUnavailable
from ipward.cni.notes import NOTES_DIR, NOTES_DIR_VARIABLE
from ipward.core import keys, log
from ipward.store.base import Store

EXAMPLES = 3


class UnknownToStore(Exception):
    """The store knows none of this node's running attachments."""


def noted_attachments(notes_dir: str) -> list[tuple[str, str, str]]:
    """(network, container, ifname) of every note on this node."""
    found = []
    try:
        networks = os.listdir(notes_dir)
    except FileNotFoundError:
        return []
    for network in networks:
        try:
            containers = os.listdir(os.path.join(notes_dir, network))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for container in containers:
            try:
                ifnames = os.listdir(os.path.join(notes_dir, network, container))
            except (NotADirectoryError, FileNotFoundError):
                continue
            found += [(network, container, ifname) for ifname in ifnames]
    return found


def check_store_knows_node(
    store: Store, where: str, node: str, source: LivenessSource | None
) -> None:
    """Raise UnknownToStore when the store knows none of this node's running noted
    attachments (see the module's docstring)."""
    notes_dir = os.environ.get(NOTES_DIR_VARIABLE.decode()) or NOTES_DIR.decode()
    noted = noted_attachments(notes_dir)
    if not noted:
        return
    if source is None:
        log.warning(
            "not checked that the store knows this node's pods: no runtime to read",
            node=node,
            notes=len(noted),
        )
        return
    try:
        ready = {s.id for s in source.node_view(node).sandboxes.values() if s.ready}
    except LivenessUnavailable as e:
        log.warning(
            "not checked that the store knows this node's pods: the runtime did not answer",
            node=node,
            error=str(e),
        )
        return
    running = [a for a in noted if a[1] in ready]
    if not running:
        return
    known = {kv.key for kv in store.range(keys.attachments_prefix(node))[0]}
    if any(keys.attach_key(node, *a) in known for a in running):
        return
    shown = ", ".join("/".join(a) for a in running[:EXAMPLES])
    raise UnknownToStore(
        f"the store at {where} knows none of the {len(running)} attachments whose pods run"
        f" on node {node} with addresses from ipward (e.g. {shown}): they got them from"
        " another store, which this one would hand out again. Move the ledger first"
        " (`ipward --store OLD export -o FILE`, then `ipward --store NEW import FILE`:"
        " README: Moving a ledger between stores), or start the agent on the store it used"
    )
