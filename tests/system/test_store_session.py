"""The lease session (`ipward.store.session`) on real stores (SQLite and a real etcd): a
lease granted and kept alive every TTL/3, what it guarantees (`valid_until`), its loss
noticed when a keepalive answers it gone, a failed keepalive due again within a second
(the etcd server killed), and letting go with and without revoking."""

from __future__ import annotations

import time

import pytest

from ipward.store import Store, StoreUnreachable, open_backend
from ipward.store.base import Put
from ipward.store.session import RETRY, LeaseSession
from ipward_lab.servers.etcd import EtcdServer

pytestmark = pytest.mark.timeout(120)

TTL = 30  # keepalives every 10 s


def test_a_session_keeps_its_lease_every_third_of_its_ttl(either_store: Store) -> None:
    session = LeaseSession(either_store, TTL)
    now = time.monotonic()
    lease = session.grant(now)
    assert lease and session.lease == lease
    assert (session.due, session.valid_until) == (now + TTL / 3, now + TTL)
    either_store.txn([], [Put("held", b"x", lease=lease)])
    later = now + 1.0  # the time the keepalive is sent, as its holder tells it
    left = session.keep(later)
    assert 0 < left <= TTL
    assert session.due == later + TTL / 3
    assert session.valid_until == later + left  # not before: the lease was alive then
    assert session.answered_at == later
    assert either_store.get("held") is not None
    session.revoke()


def test_a_lost_lease_is_noticed_and_let_go(either_store: Store) -> None:
    session = LeaseSession(either_store, TTL)
    lease = session.grant(time.monotonic())
    either_store.lease_revoke(lease)  # gone behind its back (expired, as far as it can tell)
    assert session.keep(time.monotonic()) == 0
    assert session.lease == 0
    assert session.keep(time.monotonic()) == 0  # none held: nothing asked of the store


def test_revoking_deletes_the_keys_under_the_lease_and_releasing_leaves_them(
    either_store: Store,
) -> None:
    session = LeaseSession(either_store, TTL)
    either_store.txn([], [Put("released", b"x", lease=session.grant(time.monotonic()))])
    released = session.release()
    assert session.lease == 0 and session.valid_until == 0.0
    assert either_store.get("released") is not None  # until the lease expires
    either_store.txn([], [Put("revoked", b"x", lease=session.grant(time.monotonic()))])
    session.revoke()
    assert session.lease == 0
    assert either_store.get("revoked") is None
    either_store.lease_revoke(released)


def test_a_failed_keepalive_is_due_again_within_a_second(etcd: EtcdServer) -> None:
    with open_backend(f"{etcd.url}?timeout=1") as store:
        session = LeaseSession(store, TTL)
        session.grant(time.monotonic())
        etcd.kill()
        try:
            now = time.monotonic()
            with pytest.raises(StoreUnreachable):
                session.keep(now)
            assert session.due == now + RETRY  # not a third of the TTL on
            assert session.lease  # not lost: the store did not say so
        finally:
            etcd.restart()
        assert session.keep(time.monotonic()) > 0
        session.revoke()
