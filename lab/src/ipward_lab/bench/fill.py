"""Pools filled in bulk for the latency and GC figures: what N ADDs through one ledger
leave in an empty pool, written in large transactions (set-up, never measured)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.addr import Block
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord, Attachment, PodInfo
from ipward.store import schema
from ipward.store.base import Put, Store
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


class _BlockFiller:
    """One range set's blocks as one ledger on one node fills them from an empty pool
    with no releases: blocks claimed in order as they run out, addresses taken in
    order within a block (`Block.next_usable`), so exclusions and the gateway are
    skipped the ledger's way."""

    def __init__(self, spec: PoolSpec, index: int, node: str) -> None:
        self.spec = spec
        self.rs = spec.range_sets[index]
        self.node = node
        self.claimed = 0  # blocks claimed: the pool's block cursor
        self.block: Block | None = None  # the block being filled (the node's fill record)
        self.offset = 0  # where to look from in it
        self.last: dict[str, int] = {}  # cidr -> the block's cursor (last offset taken + 1)

    def take(self) -> tuple[str, str]:
        """The next address and its block's CIDR."""
        while True:
            if self.block is not None:
                found = self.block.next_usable(self.offset)
                if found is not None:
                    self.offset = found + 1
                    self.last[self.block.cidr] = found + 1
                    return self.block.address(found), self.block.cidr
            # The block is used up (or none is claimed yet): claim the next one that holds
            # an address (the ledger never claims one that does not).
            index = self.rs.next_usable_block(self.claimed)
            block = None if index is None else self.rs.block(index)
            if index is None or block is None:
                raise BenchError(f"pool {self.spec.name} has fewer addresses than asked")
            self.claimed = index + 1
            self.block = block
            self.offset = 0
            self.last.setdefault(block.cidr, 0)

    def ops(self) -> list[Put]:
        """The blocks, their affinity entries, the node's fill record and the cursor."""
        name, family = self.spec.name, self.rs.family
        out: list[Put] = []
        for cidr, next_offset in self.last.items():
            state = {"node": self.node, "state": rec.ACTIVE, "next": next_offset}
            out.append(Put(keys.block_key(name, cidr), rec.encode(state)))
            out.append(Put(keys.affinity_key(name, self.node, cidr), b""))
        if self.block is not None:
            out.append(
                Put(keys.fill_key(name, family, self.node), rec.encode({"block": self.block.cidr}))
            )
            out.append(Put(keys.block_cursor_key(name, family), rec.encode({"next": self.claimed})))
        return out


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
    releases): the pool spec, one record per address naming its block, one index per
    attachment (`<network>/<prefix>-<i>/eth0`, pod `pods(i)`), every block claimed with
    its affinity entry and cursor, the node's fill records and the pool's block cursors:
    the same keys and values as the ledger's (tests/test_bench.py compares them), in
    large transactions without compares, so 100,000 take seconds. Set-up only: on an
    empty store, with nothing else writing. Returns the attachments."""
    if count <= 0:
        return []
    now = time.time() if created_at is None else created_at
    default_pod = PodInfo("bench", "fill", "uid-fill")
    fillers = [_BlockFiller(spec, i, node) for i in range(len(spec.range_sets))]
    # The first ADD of a declared pool stores it, with the overlap guard's key.
    coverage = rec.encode({"generation": 1, "pool": spec.name})
    ops: list[Put] = [
        Put(keys.pool_key(spec.name), rec.encode(spec.to_dict())),
        Put(keys.POOL_COVERAGE_KEY, coverage),
    ]
    attachments = []
    for i in range(count):
        attachment = Attachment(network, f"{prefix}-{i}", "eth0")
        pod = default_pod if pods is None else pods(i)
        refs = []
        for filler in fillers:
            ip, cidr = filler.take()
            refs.append(f"{spec.name}/{ip}")
            record = AddressRecord.new(attachment, pod, node, cidr, now)
            ops.append(Put(keys.ip_key(spec.name, ip), record.encode()))
        ops.append(Put(attachment.key, rec.encode({"ips": refs})))
        attachments.append(attachment)
        if len(ops) >= batch:
            write_all(store, ops)
            ops = []
    for filler in fillers:
        ops += filler.ops()
    write_all(store, ops)
    return attachments


def write_all(store: Store, ops: Sequence[Put]) -> None:
    if ops and not store.txn([], list(ops)).succeeded:
        raise BenchError("bulk write failed")
