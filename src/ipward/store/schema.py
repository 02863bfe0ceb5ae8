"""The store's schema version: which layout of keys and records a store holds.

`meta/schema` = {"version": N} is written by whoever creates the store, as its first
write, the same on SQLite and etcd, and read by every process that opens the store
(plugin, agent, controller, CLI: `ipward.store.open_store` calls `ensure`):

  no key and no ipward keys   no store: made if the caller may create one, else
                              StoreMissing ("no store at ...")
  no key, ipward keys         version 0 (made before the key existed)
  version > VERSION           refused, naming both versions: upgrade ipward
  version < VERSION           refused: `ipward migrate` brings it up (`migrate`)
  "import" in the record      an import is in progress: refused until it finishes
  "building" in the record    a migration is building what its version adds: refused
                              until `ipward migrate` finishes it

Every refusal is StoreIncompatible (CNI code 106): permanent, never "try again".

Versions (keep the README's table in step):
  0  stores made before the schema key existed
  1  `meta/schema` written; nothing else changed
  2  the node index: `nodeips/<node>/<pool>/<ip>`, a copy of every allocation record
     under its node, written in the record's own transactions (so an agent reads only
     its node's records, in one range)
  3  the attachment index under the node: `attach/<node>/<network>/<container>/<ifname>`
     (was `attach/<network>/<container>/<ifname>`), and a reservation names its sandbox
     by that key: on the Kubernetes store what one node writes is then one object
     (docs/design.md 5.15)

The step 1 -> 2 writes the index of every record there is; a process of version 1
still writing meanwhile would leave records without their entry, so it refuses while
any agent or controller holds its registration (`nodes/`, `controller/leader`), and it
first marks the store version 2 "building": every process opening the store from then
on refuses it (a version-1 one: newer schema; this one: building), until the index is
complete. `ipward check` reports an entry missing or wrong; `--remove-orphans` fixes it.
The step 2 -> 3 moves every attachment index under its node (the node of its records;
an index of no record goes under the node "") the same way: refused while a process is
registered, built while the store is marked.

On the plugin's start path (one `get` per exec): standard library only.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core import records as rec
from ipward.store.base import (
    Delete,
    Put,
    StoreIncompatible,
    StoreMissing,
    StoreUnreachable,
    absent,
    at_revision,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ipward.store.base import Compare, KeyValue, Store

    Step = Callable[[Store], tuple[list[Compare], list[Put | Delete]]]

VERSION = 3
BUILD_ATTEMPTS = 100  # passes of a build over the store before it gives up
BUILD_CHUNK = 64  # index writes per transaction (etcd allows 128 operations by default)


class State:
    """A store's schema as read: its version, the import in progress if any, and the
    key's mod_revision (0: no key) to compare when changing it."""

    __slots__ = ("building", "importing", "mod_revision", "version")

    def __init__(
        self, version: int, importing: dict | None, mod_revision: int, building: str | None = None
    ) -> None:
        self.version = version
        self.importing = importing
        self.mod_revision = mod_revision
        self.building = building


def record(version: int, importing: dict | None = None, building: str | None = None) -> bytes:
    value: dict = {"version": version}
    if importing is not None:
        value["import"] = importing
    if building is not None:
        value["building"] = building
    return rec.encode(value)


def first_key(store: Store) -> str | None:
    """Some key of ipward's other than the schema key, or None: does the store hold
    ipward data?"""
    for prefix in (*keys.DATA_PREFIXES, *keys.LEASED_PREFIXES, keys.META):
        for kv in store.range(prefix, limit=2)[0]:
            if kv.key != keys.SCHEMA_KEY:
                return kv.key
    return None


def read(store: Store, where: str) -> State | None:
    """The store's schema, or None when there is no store (no key, no ipward data)."""
    kv = store.get(keys.SCHEMA_KEY)
    if kv is None:
        if first_key(store) is None:
            return None
        # Whoever creates a store writes the key before any other, so data seen without
        # it may only mean the key came meanwhile: read it once more.
        kv = store.get(keys.SCHEMA_KEY)
        if kv is None:
            return State(0, None, 0)
    return read_record(kv, where)


def read_record(kv: KeyValue, where: str) -> State:
    """The schema key's record, checked."""
    try:
        value = rec.decode(kv.value)
        version = value["version"]
        importing = value.get("import")
        building = value.get("building")
        if type(version) is not int or version < 1 or not isinstance(importing, dict | None):
            raise ValueError(f"bad version {version!r}")
        if not isinstance(building, str | None):
            raise ValueError(f"bad building {building!r}")
    except (ValueError, KeyError) as e:
        raise StoreIncompatible(f"{where}: unreadable {keys.SCHEMA_KEY} record: {e}") from None
    return State(version, importing, kv.mod_revision, building)


def refuse_unusable(state: State, where: str) -> None:
    """Raise StoreIncompatible unless this code may use a store in `state`."""
    if state.importing is not None:
        progress = state.importing
        raise StoreIncompatible(
            f"{where}: an import is in progress ({progress.get('written')} of"
            f" {progress.get('keys')} keys written, from {progress.get('file')!r}); run"
            " `ipward import` with the same file to finish it"
        )
    if state.building is not None and state.version <= VERSION:
        raise StoreIncompatible(
            f"{where}: schema version {state.version} is being migrated to ({state.building});"
            " run `ipward migrate` to finish it"
        )
    if state.version > VERSION:
        raise StoreIncompatible(
            f"{where}: store schema version {state.version} is newer than this ipward's"
            f" ({VERSION}); upgrade ipward"
        )
    if state.version < VERSION:
        raise StoreIncompatible(
            f"{where}: store schema version {state.version} is older than this ipward's"
            f" ({VERSION}); run `ipward migrate`"
        )


def ensure(store: Store, where: str, *, create: bool) -> None:
    """Check the store's schema; with `create`, make a store that is not there (write
    the key by compare-and-swap: of several processes creating at once, one writes it
    and the others read it)."""
    state = read(store, where)
    if state is None:
        if not create:
            raise StoreMissing(f"no store at {where}")
        store.txn([absent(keys.SCHEMA_KEY)], [Put(keys.SCHEMA_KEY, record(VERSION))])
        state = read(store, where)
        if state is None:
            raise StoreUnreachable(
                f"{where}: {keys.SCHEMA_KEY} vanished right after it was written"
            )
    refuse_unusable(state, where)


# -- migrations -------------------------------------------------------------------------


def _to_1(store: Store) -> tuple[list[Compare], list[Put | Delete]]:
    """0 -> 1: only the schema key, which `migrate` writes with every step."""
    return [], []


def _refuse_while_running(store: Store, step: str, why: str) -> None:
    running = [kv.key for prefix in keys.LEASED_PREFIXES for kv in store.range(prefix)[0]]
    if running:
        raise StoreIncompatible(
            f"schema {step} {why}: stop them first ({', '.join(running[:5])}"
            f"{', ...' if len(running) > 5 else ''} registered), then run `ipward migrate`"
        )


def _to_2(store: Store) -> tuple[list[Compare], list[Put | Delete]]:
    """1 -> 2: refused while a process of version 1 may still write records (see the
    module's docstring); the index itself is BUILDS[2]."""
    why = "builds the node index, and running processes would write records without it"
    _refuse_while_running(store, "1 -> 2", why)
    return [], []


def _to_3(store: Store) -> tuple[list[Compare], list[Put | Delete]]:
    """2 -> 3: refused while a process of version 2 may still write attachment indexes
    where they were; the move itself is BUILDS[3]."""
    why = "moves the attachment index, and running processes would write it where it was"
    _refuse_while_running(store, "2 -> 3", why)
    return [], []


# MIGRATIONS[n] brings a store from version n to n + 1: it reads what it needs and
# returns the compares and writes of one transaction, to which `migrate` adds a compare
# on the schema key as read and its new version. A version in BUILDS needs more than one
# transaction: the bump marks the store "building" (every other process refuses it), and
# BUILDS[n + 1], idempotent and resumable, runs before `migrate` clears the mark.
MIGRATIONS: dict[int, Step] = {0: _to_1, 1: _to_2, 2: _to_3}


def node_index_drift(
    records: Sequence[KeyValue], entries: Sequence[KeyValue]
) -> list[tuple[str, KeyValue | None, KeyValue | None, str]]:
    """How the node index (`entries`, under `nodeips/`) differs from the allocation
    records (`records`, under `ips/`): (kind, record, entry, the entry's key) for each
    record without its node's entry ("missing"), each entry whose copy of the record
    differs from it ("stale") and each entry whose record is not there or is another
    node's ("dangling"). A record that cannot be read, or names no node, wants no entry
    (`ipward check` reports the record itself)."""
    wanted: dict[str, KeyValue] = {}
    for kv in records:
        try:
            node = rec.AddressRecord.decode(kv.value).node
        except (ValueError, KeyError, TypeError):
            continue
        if node:
            pool, ip = keys.ip_parts(kv.key)
            wanted[keys.node_ip_key(node, pool, ip)] = kv
    found = {kv.key: kv for kv in entries}
    drift: list[tuple[str, KeyValue | None, KeyValue | None, str]] = [
        ("missing", kv, None, key) if key not in found else ("stale", kv, found[key], key)
        for key, kv in wanted.items()
        if key not in found or found[key].value != kv.value
    ]
    by_key = {kv.key: kv for kv in records}
    for key, entry in found.items():
        if key not in wanted:
            _, pool, ip = keys.node_ip_parts(key)
            drift.append(("dangling", by_key.get(keys.ip_key(pool, ip)), entry, key))
    return drift


def repair_node_index(store: Store) -> list[tuple[str, str]]:
    """Make the node index match the records: write each missing or stale entry (a copy
    of its record) and delete each dangling one, every fix compared against the record
    and the entry as read, in bounded transactions; read again until nothing differs.
    Returns (kind, entry key) fixed."""
    fixed: list[tuple[str, str]] = []
    # Two compares a fix: within the store's limit on a transaction's compares.
    chunk_size = min(BUILD_CHUNK, max(1, (store.max_txn_ops or BUILD_CHUNK * 2) // 2))
    for _ in range(BUILD_ATTEMPTS):
        # Both at one revision: a write between two reads would look like drift.
        kvs, _ = store.snapshot((keys.ADDRESSES, keys.NODE_ADDRESSES))
        records = [kv for kv in kvs if kv.key.startswith(keys.ADDRESSES)]
        entries = [kv for kv in kvs if kv.key.startswith(keys.NODE_ADDRESSES)]
        drift = node_index_drift(records, entries)
        if not drift:
            return fixed
        for start in range(0, len(drift), chunk_size):
            chunk = drift[start : start + chunk_size]
            compares: list[Compare] = []
            ops: list[Put | Delete] = []
            for kind, record_kv, entry, key in chunk:
                _, pool, ip = keys.node_ip_parts(key)
                if record_kv is None:
                    compares.append(absent(keys.ip_key(pool, ip)))
                else:
                    compares.append(at_revision(record_kv.key, record_kv.mod_revision))
                compares.append(at_revision(key, entry.mod_revision if entry else 0))
                if kind == "dangling" or record_kv is None:
                    ops.append(Delete(key))
                else:
                    ops.append(Put(key, record_kv.value))
            if store.txn(compares, ops).succeeded:
                fixed += [(kind, key) for kind, _, _, key in chunk]
    raise StoreUnreachable("the node index kept changing while it was repaired; run it again")


def move_attachment_index(store: Store) -> list[str]:
    """Schema 3: every attachment index from `attach/<network>/<container>/<ifname>` to
    under its node (its records' node; "" for an index of none), and each reservation's
    sandbox named by the new key; each move compared against what was read, in bounded
    transactions; read again until none is left. Returns the keys moved."""
    moved: list[str] = []
    for _ in range(BUILD_ATTEMPTS):
        kvs, _ = store.snapshot((keys.ADDRESSES, keys.ATTACHMENTS, keys.STICKY))
        nodes: dict[str, str] = {}  # old index key -> its records' node
        for kv in kvs:
            if kv.key.startswith(keys.ADDRESSES):
                try:
                    record = rec.AddressRecord.decode(kv.value)
                except (ValueError, KeyError, TypeError):
                    continue
                attachment = record.attachment
                nodes[_old_attach_key(attachment)] = record.node
        steps: list[tuple[list[Compare], list[Put | Delete], str]] = []
        for kv in kvs:
            if kv.key.startswith(keys.ATTACHMENTS) and kv.key.count("/") == 3:
                new = keys.ATTACHMENTS + nodes.get(kv.key, "") + kv.key[len(keys.ATTACHMENTS) - 1 :]
                steps.append(
                    (
                        [at_revision(kv.key, kv.mod_revision), absent(new)],
                        [Delete(kv.key), Put(new, kv.value)],
                        kv.key,
                    )
                )
            elif kv.key.startswith(keys.STICKY):
                try:
                    held = rec.ReservationRecord.decode(kv.value)
                except (ValueError, KeyError, TypeError):
                    continue
                if held.attachment and held.attachment.count("/") == 3:
                    held.attachment = (
                        keys.ATTACHMENTS + held.node + held.attachment[len(keys.ATTACHMENTS) - 1 :]
                    )
                    steps.append(
                        (
                            [at_revision(kv.key, kv.mod_revision)],
                            [Put(kv.key, held.encode())],
                            kv.key,
                        )
                    )
        if not steps:
            return moved
        for start in range(0, len(steps), BUILD_CHUNK // 2):
            chunk = steps[start : start + BUILD_CHUNK // 2]
            compares = [c for step in chunk for c in step[0]]
            ops = [op for step in chunk for op in step[1]]
            if store.txn(compares, ops).succeeded:
                moved += [step[2] for step in chunk]
    raise StoreUnreachable("the attachment index kept changing while it moved; run it again")


def _old_attach_key(attachment: rec.Attachment) -> str:
    """An attachment's index key before schema 3."""
    return f"{keys.ATTACHMENTS}{attachment.network}/{attachment.container}/{attachment.ifname}"


# What a version's build does (the store is marked "building" with its name meanwhile).
BUILDS: dict[int, tuple[str, Callable[[Store], object]]] = {
    2: ("node index", repair_node_index),
    3: ("attachment index under nodes", move_attachment_index),
}


def migrate(store: Store, where: str) -> tuple[int, list[int]]:
    """Bring the store to VERSION, one step (one transaction, or a build between two)
    at a time; safe to run again, and alongside another `migrate` (a step that lost the
    race is re-read). Returns the version found and the versions reached."""
    reached: list[int] = []
    found: int | None = None
    while True:
        state = read(store, where)
        if state is None:
            raise StoreMissing(f"no store at {where}")
        if found is None:
            found = state.version
        key_as_read = at_revision(keys.SCHEMA_KEY, state.mod_revision)
        if state.building is not None and state.version in BUILDS:
            BUILDS[state.version][1](store)
            done = Put(keys.SCHEMA_KEY, record(state.version))
            if store.txn([key_as_read], [done]).succeeded:
                reached.append(state.version)
            continue
        if state.version >= VERSION or state.importing is not None:
            refuse_unusable(state, where)  # a newer store, an import: not for migrate
            return found, reached
        compares, ops = MIGRATIONS[state.version](store)
        target = state.version + 1
        building = BUILDS[target][0] if target in BUILDS else None
        bump = Put(keys.SCHEMA_KEY, record(target, building=building))
        if store.txn([*compares, key_as_read], [*ops, bump]).succeeded and building is None:
            reached.append(target)
