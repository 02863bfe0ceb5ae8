"""What the unit tests of the ledger's parts share: a pool, an attachment, a
`StoreCache` of a node on a real SQLite store, and the allocating transaction of picks
made by hand (no `Ledger`, no process, no socket)."""

from __future__ import annotations

from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.allocating import pool_guard
from ipward.ipam.allocation import Pick, writes
from ipward.ipam.cache import StoreCache
from ipward.store.base import Store
from support import ManualClock

NOW = ManualClock().now  # where every test's clock starts


def pool(subnet: str = "10.0.0.0/24", cooldown: float = 30.0, **more: object) -> PoolSpec:
    """A pool of /28 blocks (stored by the first allocation that uses it)."""
    return PoolSpec("p", [[{"subnet": subnet}]], cooldown=cooldown, block_prefix={4: 28}, **more)


def att(i: int | str) -> Attachment:
    return Attachment("net", f"c{i}", "eth0")


def pod(i: int | str) -> PodInfo:
    return PodInfo("ns", f"pod{i}", f"uid{i}")


def node_cache(store: Store, node: str = "n1", clock: ManualClock | None = None) -> StoreCache:
    return StoreCache(store, node, clock or ManualClock())


def commit(cache: StoreCache, spec: PoolSpec, i: int | str, picks: list[Pick]) -> bool:
    """The allocating transaction of `picks` for attachment `i`, as `allocate_one`
    builds it (the pool's guard added)."""
    compares, ops = writes(cache.node, att(i), pod(i), picks, cache.clock())
    guard_compares, guard_ops = pool_guard(cache, spec)
    return cache.txn(compares + guard_compares, ops + guard_ops)
