"""Pools filled in bulk for the latency, GC and scale figures: what ADDs through ledgers
leave, written in large transactions (set-up, never measured). One node's ADDs on an
empty pool (`bulk_fill`), or a cluster's: many nodes' ADDs and the controller's warm
target (`PoolFill`, `write_adds`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ipward.core import keys, shards
from ipward.core import records as rec
from ipward.core.addr import Block, RangeSet
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, Attachment, CursorRecord, PodInfo
from ipward.ipam.allocation import record_writes
from ipward.store import schema
from ipward.store.base import Delete, Put, Store
from ipward.store.kube import KubeStore
from ipward.store.sqlite import SqliteStore
from ipward_lab.bench.common import (
    NODE,
    BenchError,
)


def fill_file(path: str, spec: PoolSpec, count: int) -> None:
    """`count` addresses of `spec` in use in the SQLite file at `path`, as one ledger
    leaves them (`bulk_fill`). Set-up, not measured: written without fsync at each commit
    (synchronous=OFF) to save time."""
    store = SqliteStore(path)
    try:
        schema.ensure(store, path, create=True)  # as ipward makes a store
        store._conn.execute("PRAGMA synchronous=OFF")
        bulk_fill(store, spec, count)
    finally:
        store.close()


class _OwnBlock:
    """One block of a node: its cursor (`next`: the offset a fresh pick starts from)
    and the records in it."""

    __slots__ = ("block", "next", "records")

    def __init__(self, block: Block, next_offset: int) -> None:
        self.block = block
        self.next = next_offset
        self.records = 0


class _NodeSet:
    """One node's blocks of one range set, and the one it fills fresh (its fill record)."""

    __slots__ = ("blocks", "fill")

    def __init__(self) -> None:
        self.blocks: dict[str, _OwnBlock] = {}
        self.fill: str | None = None


class PoolFill:
    """The blocks of one pool as ledgers on many nodes and the controller leave them when
    nothing is released: the ledger's fresh pick (`take`: the block the node fills, then
    its other active blocks in the order its affinity index lists them, then the pool's
    next never-claimed block) and the controller's warm target (`warm`: a block per node
    short of `spec.warm` free addresses per round, nodes in name order, as its pass
    assigns them). Writes nothing itself: `ops` gives what changed since the last call.
    One PoolFill follows one pool through every fill of a run (`carry_on` between
    them)."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.cursors = [0] * len(spec.range_sets)
        self.nodes: dict[tuple[str, int], _NodeSet] = {}
        self._changed_blocks: dict[str, tuple[str, _OwnBlock]] = {}  # cidr -> (node, block)
        self._new_blocks: list[tuple[str, str]] = []  # (node, cidr): affinity entries
        self._changed_fills: set[tuple[str, int]] = set()
        self._cursors_written = list(self.cursors)

    def carry_on(self, store: Store) -> None:
        """Take the block cursors as the store has them: ledgers may have claimed blocks
        since the last fill (a bulk write must never claim one again)."""
        for i, rs in enumerate(self.spec.range_sets):
            cursor = store.get(keys.block_cursor_key(self.spec.name, rs.family))
            stored = CursorRecord.decode(cursor.value).next_for(self.spec.version) if cursor else 0
            self.cursors[i] = max(self.cursors[i], stored)
        self._cursors_written = list(self.cursors)

    def _node(self, node: str, index: int) -> _NodeSet:
        return self.nodes.setdefault((node, index), _NodeSet())

    def _claim(self, node: str, index: int) -> _OwnBlock:
        """The next never-claimed block of the range set, now `node`'s (its cursor 0)."""
        rs: RangeSet = self.spec.range_sets[index]
        found = rs.next_usable_block(self.cursors[index])
        block = None if found is None else rs.block(found)
        if found is None or block is None:
            raise BenchError(f"pool {self.spec.name} has fewer blocks than asked")
        self.cursors[index] = found + 1
        own = _OwnBlock(block, 0)
        self._node(node, index).blocks[block.cidr] = own
        self._new_blocks.append((node, block.cidr))
        self._changed_blocks[block.cidr] = (node, own)
        return own

    def _fresh(self, node: str, own: _OwnBlock) -> str | None:
        offset = own.block.next_usable(own.next)
        if offset is None:
            return None
        own.next = offset + 1
        own.records += 1
        self._changed_blocks[own.block.cidr] = (node, own)
        return own.block.address(offset)

    def take(self, node: str, index: int) -> tuple[str, str]:
        """The address an ADD on `node` gets from range set `index`, and its block."""
        mine = self._node(node, index)
        order = [mine.fill] if mine.fill is not None else []
        order += sorted(c for c in mine.blocks if c != mine.fill)  # the affinity index's order
        for cidr in order:
            ip = self._fresh(node, mine.blocks[cidr])
            if ip is not None:
                break
        else:
            own = self._claim(node, index)
            ip = self._fresh(node, own)
            if ip is None:  # next_usable_block offers only blocks holding one
                raise BenchError(f"block {own.block.cidr} holds no usable address")
            cidr = own.block.cidr
        if mine.fill != cidr:
            mine.fill = cidr
            self._changed_fills.add((node, index))
        return ip, cidr

    def free(self, node: str, index: int) -> int:
        """Addresses free in the node's blocks, as the controller counts them."""
        mine = self._node(node, index)
        return sum(own.block.usable_count() - own.records for own in mine.blocks.values())

    def warm(self, nodes: Iterable[str]) -> int:
        """A controller pass's warm-target assignments for the registered `nodes`;
        returns how many blocks it gave."""
        short = [
            (node, i)
            for node in sorted(nodes)
            for i in range(len(self.spec.range_sets))
            if self.free(node, i) < self.spec.warm
        ]
        given = 0
        while short:
            for node, i in short:
                self._claim(node, i)
                given += 1
            short = [(node, i) for node, i in short if self.free(node, i) < self.spec.warm]
        return given

    def ops(self) -> list[Put]:
        """What changed since the last call: block records, the new blocks' affinity
        entries, fill records and block cursors."""
        name = self.spec.name
        out: list[Put] = []
        for cidr, (node, own) in self._changed_blocks.items():
            state = {"node": node, "state": rec.ACTIVE, "next": own.next}
            out.append(Put(keys.block_key(name, cidr), rec.encode(state)))
        out += [Put(keys.affinity_key(name, node, cidr), b"") for node, cidr in self._new_blocks]
        for node, i in sorted(self._changed_fills):
            fill = {"block": self._node(node, i).fill}
            out.append(
                Put(keys.fill_key(name, self.spec.range_sets[i].family, node), rec.encode(fill))
            )
        for i, cursor in enumerate(self.cursors):
            if cursor != self._cursors_written[i]:
                family = self.spec.range_sets[i].family
                out.append(Put(keys.block_cursor_key(name, family), rec.encode({"next": cursor})))
        self._changed_blocks.clear()
        self._new_blocks.clear()
        self._changed_fills.clear()
        self._cursors_written = list(self.cursors)
        return out


def write_adds(
    store: Store,
    fill: PoolFill,
    adds: Iterable[tuple[str, Attachment, PodInfo]],
    created_at: float,
    first: Sequence[Put] = (),
    batch: int = 2000,
) -> int:
    """Write what the ADDs `adds` ((node, attachment, pod), in order) leave: one record
    per address naming its block, with its node's index entry, one index per attachment,
    and what `fill` moved (blocks, fills, cursors; with the warm assignments made
    before), after `first`. In transactions of at most `batch` writes (and the store's
    own limit), without compares: set-up only, with nothing else writing the pool.
    Returns the ADDs."""
    if store.max_txn_ops is not None:
        batch = min(batch, store.max_txn_ops)
    spec = fill.spec
    ops: list[Put | Delete] = list(first)
    count = 0
    for node, attachment, pod in adds:
        refs = []
        for i in range(len(spec.range_sets)):
            ip, cidr = fill.take(node, i)
            refs.append(f"{spec.name}/{ip}")
            record = AddressRecord.new(attachment, pod, node, cidr, created_at, spec.version)
            ops += record_writes(spec.name, ip, record)
        ops.append(Put(attachment.key_on(node), rec.encode({"ips": refs})))
        count += 1
        if len(ops) >= batch:
            write_all(store, ops[:batch])
            ops = ops[batch:]
    write_batches(store, [*ops, *fill.ops()], batch)
    return count


def write_batches(store: Store, ops: Sequence[Put | Delete], batch: int = 2000) -> None:
    """`ops` in transactions of at most `batch` writes (and the store's own limit)."""
    if store.max_txn_ops is not None:
        batch = min(batch, store.max_txn_ops)
    for start in range(0, len(ops), batch):
        write_all(store, ops[start : start + batch])


def bulk_fill(
    store: Store,
    spec: PoolSpec,
    count: int,
    *,
    node: str = NODE,
    network: str = "benchfill",
    prefix: str = "fill",
    pods: Callable[[int], PodInfo] | None = None,
    created_at: float | None = None,
    batch: int = 2000,
) -> list[Attachment]:
    """Write what `count` ADDs through one ledger on `node` leave in an empty pool (no
    releases, no controller): the pool spec, one record per address naming its block,
    one index per attachment (`<network>/<prefix>-<i>/eth0`, pod `pods(i)`), every block
    claimed with its affinity entry and cursor, the node's fill records and the pool's
    block cursors: the same keys and values as the ledger's (tests/unit/test_bench_parts.py
    compares them), in large transactions without compares, so 100,000 take seconds.
    Set-up only: on an empty store, with nothing else writing. Returns the attachments."""
    if count <= 0:
        return []
    now = time.time() if created_at is None else created_at
    default_pod = PodInfo("bench", "fill", "uid-fill")
    attachments = [Attachment(network, f"{prefix}-{i}", "eth0") for i in range(count)]
    # The first ADD of a declared pool stores it, with the overlap guard's key.
    coverage = rec.encode({"generation": 1, "pool": spec.name})
    first = [
        Put(keys.pool_key(spec.name), rec.encode(spec.to_dict())),
        Put(keys.POOL_COVERAGE_KEY, coverage),
    ]
    adds = ((node, a, default_pod if pods is None else pods(i)) for i, a in enumerate(attachments))
    write_adds(store, PoolFill(spec), adds, now, first, batch)
    return attachments


SHARD_WRITERS = 8  # the Kubernetes store's objects written at once by a bulk write


def write_all(store: Store, ops: Sequence[Put | Delete]) -> None:
    """`ops` in one transaction; on the Kubernetes store, one transaction per object,
    SHARD_WRITERS at a time: one over several objects would lock each of them before its
    commit and resolve the locks after (docs/design.md 5.15), an atomicity a set-up
    with nothing else writing does without."""
    if not ops:
        return
    if isinstance(store, KubeStore):
        by_shard: dict[str, list[Put | Delete]] = {}
        for op in ops:
            by_shard.setdefault(shards.shard_of(op.key), []).append(op)
        with ThreadPoolExecutor(SHARD_WRITERS) as pool:
            written = all(pool.map(lambda group: store.txn([], group).succeeded, by_shard.values()))
    else:
        written = store.txn([], list(ops)).succeeded
    if not written:
        raise BenchError("bulk write failed")
