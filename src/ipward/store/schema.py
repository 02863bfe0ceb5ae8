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

Every refusal is StoreIncompatible (CNI code 106): permanent, never "try again".

Versions (keep the README's table in step):
  0  stores made before the schema key existed
  1  `meta/schema` written; nothing else changed

On the plugin's start path (one `get` per exec): standard library only.
"""

from __future__ import annotations

from ipward.core import keys
from ipward.core import records as rec
from ipward.store.base import (
    Put,
    StoreIncompatible,
    StoreMissing,
    StoreUnavailable,
    absent,
    at_revision,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.store.base import Compare, Delete, KeyValue, Store

    Step = Callable[[Store], tuple[list[Compare], list[Put | Delete]]]

VERSION = 1


class State:
    """A store's schema as read: its version, the import in progress if any, and the
    key's mod_revision (0: no key) to compare when changing it."""

    __slots__ = ("importing", "mod_revision", "version")

    def __init__(self, version: int, importing: dict | None, mod_revision: int) -> None:
        self.version = version
        self.importing = importing
        self.mod_revision = mod_revision


def record(version: int, importing: dict | None = None) -> bytes:
    value: dict = {"version": version}
    if importing is not None:
        value["import"] = importing
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
        if type(version) is not int or version < 1 or not isinstance(importing, dict | None):
            raise ValueError(f"bad version {version!r}")
    except (ValueError, KeyError) as e:
        raise StoreIncompatible(f"{where}: unreadable {keys.SCHEMA_KEY} record: {e}") from None
    return State(version, importing, kv.mod_revision)


def refuse_unusable(state: State, where: str) -> None:
    """Raise StoreIncompatible unless this code may use a store in `state`."""
    if state.importing is not None:
        progress = state.importing
        raise StoreIncompatible(
            f"{where}: an import is in progress ({progress.get('written')} of"
            f" {progress.get('keys')} keys written, from {progress.get('file')!r}); run"
            " `ipward import` with the same file to finish it"
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
            raise StoreUnavailable(
                f"{where}: {keys.SCHEMA_KEY} vanished right after it was written"
            )
    refuse_unusable(state, where)


# -- migrations -------------------------------------------------------------------------


def _to_1(store: Store) -> tuple[list[Compare], list[Put | Delete]]:
    """0 -> 1: only the schema key, which `migrate` writes with every step."""
    return [], []


# MIGRATIONS[n] brings a store from version n to n + 1: it reads what it needs and
# returns the compares and writes of one transaction, to which `migrate` adds a compare
# on the schema key as read and its new version. A step that needs more than one
# transaction must be idempotent and resumable, and bump the key only in its last.
MIGRATIONS: dict[int, Step] = {0: _to_1}


def migrate(store: Store, where: str) -> tuple[int, list[int]]:
    """Bring the store to VERSION, one step (one transaction) at a time; safe to run
    again, and alongside another `migrate` (a step that lost the race is re-read).
    Returns the version found and the versions reached."""
    reached: list[int] = []
    found: int | None = None
    while True:
        state = read(store, where)
        if state is None:
            raise StoreMissing(f"no store at {where}")
        if found is None:
            found = state.version
        if state.version >= VERSION or state.importing is not None:
            refuse_unusable(state, where)  # a newer store, an import: not for migrate
            return found, reached
        compares, ops = MIGRATIONS[state.version](store)
        bump = Put(keys.SCHEMA_KEY, record(state.version + 1))
        key_as_read = at_revision(keys.SCHEMA_KEY, state.mod_revision)
        if store.txn([*compares, key_as_read], [*ops, bump]).succeeded:
            reached.append(state.version + 1)
