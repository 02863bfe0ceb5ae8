"""Pool specs replicated into the node shards that compare them (docs/design.md 5.15),
seen from two processes' caches on the real kube-apiserver: a spec changed by one store
is what the other's next transaction compares, although its cached copy of the spec's
home is older. (Found by the IPPool tests: a transaction retried on its stale home
copy until its timeout, answering 11 instead of the branch the new spec chooses.)"""

from __future__ import annotations

import uuid

import pytest

from ipward.store import open_backend
from ipward.store.base import VALUE, Compare, Put

pytestmark = [pytest.mark.timeout(120), pytest.mark.kstore]


def value_is(key: str, value: bytes) -> Compare:
    return Compare(key, VALUE, "==", value)


def test_a_spec_changed_elsewhere_is_what_the_next_compare_sees(kube_store_url: str) -> None:
    run = uuid.uuid4().hex[:8]
    spec, attach = f"pools/p-{run}", f"attach/n-{run}/net/c1/eth0"
    with open_backend(kube_store_url) as here, open_backend(kube_store_url) as there:
        here.txn([], [Put(spec, b"v1")])
        # Compared from the node's shard: the spec replicated there, both cached here.
        chosen = here.txn([value_is(spec, b"v1")], [Put(attach, b"first")], [])
        assert chosen.succeeded
        there.txn([], [Put(spec, b"v2")])
        # Here the spec's home is cached as v1, the replica in the node's shard is v2.
        stale = here.txn([value_is(spec, b"v1")], [Put(attach, b"on v1")], [Put(attach, b"not")])
        assert not stale.succeeded
        fresh = here.txn([value_is(spec, b"v2")], [Put(attach, b"on v2")], [])
        assert fresh.succeeded
        got = here.get(attach)
        assert got is not None and got.value == b"on v2"
