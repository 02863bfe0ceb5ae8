"""`ipward export` and `ipward import`: a whole ledger as JSON lines, and back.

An export is one consistent picture, every key read at one revision
(`Store.snapshot`): a header line

    {"format": "ipward-export", "format_version": 1, "schema": 1, "revision": R,
     "keys": N, "counts": {"pools": ..., "ips": ..., ...}, "not_exported": "..."}

then one line per key, `{"key": K, "value": V}`, V being the stored value as text
(ipward's values are JSON, or empty for index keys), in key order per kind. Keys held
by a lease, the node registrations (`nodes/`) and the leader key (`controller/`),
belong to running processes and are not exported: the agents and the controller write
them again when they start.

An import goes into an empty store only (refused otherwise, naming a key it found). The
file is read and checked whole before anything is written. Then the schema key is set
to say an import is in progress (every other process refuses the store meanwhile, code
106), the keys are written in bounded transactions, each also recording in the schema
key how far it got and comparing every key it writes absent, and the last one clears
the mark. An interrupted import is finished by running the same import again: it goes
on from where the schema key says (the file must be the same, by its SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import TextIO

from ipward.core import keys, testpoints
from ipward.core.errors import InvalidConfig
from ipward.store import schema
from ipward.store.base import Put, Store, StoreError, StoreIncompatible, absent, at_revision

FORMAT = "ipward-export"
FORMAT_VERSION = 1
NOT_EXPORTED = (
    "keys held by leases: node registrations (nodes/) and the leader key"
    " (controller/leader); the agents and the controller write them again"
)
BATCH_KEYS = 64  # keys per import transaction (etcd allows 128 operations by default)
BATCH_BYTES = 512 * 1024  # and at most this much value (etcd's request limit is 1.5 MiB)


def _kind(key: str) -> str:
    return keys.prefix_of(key).rstrip("/")


def export(store: Store, where: str, out: TextIO) -> dict:
    """Write the whole ledger to `out`; returns the header."""
    kvs, revision = store.snapshot((keys.META, *keys.DATA_PREFIXES))
    entries = [kv for kv in kvs if not kv.key.startswith(keys.META)]
    found = [kv for kv in kvs if kv.key == keys.SCHEMA_KEY]
    # The schema as of the same revision (open_store checked it a moment before).
    state = schema.State(schema.VERSION, None, 0)
    if found:
        state = schema.read_record(found[0], where)
        schema.refuse_unusable(state, where)
    counts: dict[str, int] = {}
    for kv in entries:
        counts[_kind(kv.key)] = counts.get(_kind(kv.key), 0) + 1
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "schema": state.version,
        "revision": revision,
        "keys": len(entries),
        "counts": counts,
        "exported_at": round(time.time(), 3),
        "not_exported": NOT_EXPORTED,
    }
    out.write(json.dumps(header, sort_keys=True) + "\n")
    for kv in entries:
        try:
            text = kv.value.decode()
        except UnicodeDecodeError:
            raise StoreError(f"{where}: {kv.key} holds a value that is not text") from None
        out.write(json.dumps({"key": kv.key, "value": text}) + "\n")
    return header


class ExportFile:
    """An export file, read and checked whole: the header, the entries, its digest."""

    def __init__(self, path: str) -> None:
        self.path = path
        digest = hashlib.sha256()
        self.entries: list[tuple[str, bytes]] = []
        try:
            with open(path, "rb") as f:
                lines = f.read().splitlines(keepends=True)
        except OSError as e:
            raise InvalidConfig(f"{path}: {e.strerror}") from None
        if not lines:
            raise InvalidConfig(f"{path}: empty; expected an 'ipward export'")
        for line in lines:
            digest.update(line)
        self.sha256 = digest.hexdigest()
        self.header = self._header(lines[0])
        seen: set[str] = set()
        counts: dict[str, int] = {}
        for number, line in enumerate(lines[1:], start=2):
            key, value = self._entry(number, line)
            if key in seen:
                raise InvalidConfig(f"{path} line {number}: key {key!r} given twice")
            seen.add(key)
            counts[_kind(key)] = counts.get(_kind(key), 0) + 1
            self.entries.append((key, value))
        if len(self.entries) != self.header["keys"] or counts != self.header["counts"]:
            raise InvalidConfig(
                f"{path}: the header announces {self.header['keys']} keys {self.header['counts']},"
                f" the file holds {len(self.entries)} {counts} (cut short?)"
            )

    @property
    def schema(self) -> int:
        return int(self.header["schema"])

    def _header(self, line: bytes) -> dict:
        try:
            header = json.loads(line)
        except ValueError as e:
            raise InvalidConfig(f"{self.path} line 1: not JSON: {e}") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise InvalidConfig(f"{self.path} line 1: not an 'ipward export' header")
        if header.get("format_version") != FORMAT_VERSION:
            raise InvalidConfig(
                f"{self.path}: export format version {header.get('format_version')!r};"
                f" this ipward reads version {FORMAT_VERSION}"
            )
        version = header.get("schema")
        if type(version) is not int or version < 1:
            raise InvalidConfig(f"{self.path} line 1: bad schema version {version!r}")
        if version > schema.VERSION:
            raise StoreIncompatible(
                f"{self.path}: exported at store schema version {version}, newer than this"
                f" ipward's ({schema.VERSION}); import it with a newer ipward"
            )
        counts = header.get("counts")
        if (
            type(header.get("keys")) is not int
            or not isinstance(counts, dict)
            or not all(type(n) is int for n in counts.values())
        ):
            raise InvalidConfig(f"{self.path} line 1: 'keys' and 'counts' must be numbers")
        return header

    def _entry(self, number: int, line: bytes) -> tuple[str, bytes]:
        where = f"{self.path} line {number}"
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise InvalidConfig(f"{where}: not JSON: {e}") from None
        if not isinstance(entry, dict) or set(entry) != {"key", "value"}:
            raise InvalidConfig(f'{where}: expected {{"key": ..., "value": ...}}')
        key, value = entry["key"], entry["value"]
        if not isinstance(key, str) or not key.startswith(keys.DATA_PREFIXES):
            raise InvalidConfig(f"{where}: key {key!r} is not one of ipward's exported kinds")
        if not isinstance(value, str):
            raise InvalidConfig(f"{where}: the value of {key} must be a string")
        return key, value.encode()


def import_file(store: Store, where: str, export_file: ExportFile, batch_keys: int) -> dict:
    """Write `export_file` into the empty store (or finish an interrupted import of the
    same file). Returns a summary."""
    progress, marker_revision = _start(store, where, export_file)
    resumed_at = written = int(progress["written"])
    entries = export_file.entries
    while written < len(entries):
        batch: list[tuple[str, bytes]] = []
        size = 0
        for key, value in entries[written : written + batch_keys]:
            if batch and size + len(value) > BATCH_BYTES:
                break
            batch.append((key, value))
            size += len(value)
        progress = {**progress, "written": written + len(batch)}
        result = store.txn(
            [at_revision(keys.SCHEMA_KEY, marker_revision), *(absent(k) for k, _ in batch)],
            [
                *(Put(k, v) for k, v in batch),
                Put(keys.SCHEMA_KEY, schema.record(export_file.schema, progress)),
            ],
        )
        if not result.succeeded:
            raise StoreError(
                f"{where}: the store changed during the import (another import or writer);"
                f" {written} of {len(entries)} keys are written"
            )
        marker_revision, written = result.revision, written + len(batch)
        testpoints.pause("import-batch")
    done = store.txn(
        [at_revision(keys.SCHEMA_KEY, marker_revision)],
        [Put(keys.SCHEMA_KEY, schema.record(export_file.schema))],
    )
    if not done.succeeded:
        raise StoreError(f"{where}: the store changed at the end of the import")
    return {
        "keys": len(entries),
        "resumed_at": resumed_at,
        "schema": export_file.schema,
        "source_revision": export_file.header["revision"],
        "revision": done.revision,
    }


def _start(store: Store, where: str, export_file: ExportFile) -> tuple[dict, int]:
    """The import's progress record and the schema key's revision: a new one written
    into an empty store, or the one of an interrupted import of this same file."""
    state = schema.read(store, where)
    if state is not None and state.importing is not None:
        if state.importing.get("sha256") != export_file.sha256:
            raise StoreIncompatible(
                f"{where}: another import is in progress (from {state.importing.get('file')!r},"
                f" {state.importing.get('written')} of {state.importing.get('keys')} keys"
                f" written); finish it with that file"
            )
        return state.importing, state.mod_revision
    found = schema.first_key(store)
    if found is not None:
        raise InvalidConfig(
            f"{where} is not empty: it holds {found} (and maybe more); import needs an empty store"
        )
    progress = {
        "file": os.path.abspath(export_file.path),
        "sha256": export_file.sha256,
        "source_revision": export_file.header["revision"],
        "keys": len(export_file.entries),
        "written": 0,
        "started_at": round(time.time(), 3),
    }
    key_as_read = at_revision(keys.SCHEMA_KEY, 0 if state is None else state.mod_revision)
    result = store.txn(
        [key_as_read], [Put(keys.SCHEMA_KEY, schema.record(export_file.schema, progress))]
    )
    if not result.succeeded:
        raise StoreError(f"{where}: the store changed as the import began; run it again")
    return progress, result.revision
