"""The Kubernetes store's commit protocol under crashes (docs/design.md 5.15, "Windows
and who closes them"), on the real kube-apiserver: a writer killed (SIGKILL) at each
step of a transaction over three shards, and an aborter killed after its abort mark;
what readers then see and what the next writer does. And the bank: processes moving
amounts between accounts in different shards, killed at random, while snapshots keep
checking the total: nothing is ever half done."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipward.core import shards
from ipward.store import open_backend
from ipward.store.base import Delete, Put, Store, StoreUnreachable, absent, at_revision
from ipward.store.kube import commit
from ipward.store.kube.objects import Conflict
from ipward_lab.waiting import wait_for
from support import Gate

pytestmark = [pytest.mark.timeout(240), pytest.mark.kstore]

# One transaction over three shards (keys of three directories: `other:` shards), its
# lock life short, so a test waits seconds, not the production 15.
WRITER = """
import sys
from ipward.store import open_backend
from ipward.store.base import Put
from ipward.store.kube import commit
from ipward.store.kube.objects import Conflict
commit.LOCK_TTL = float(sys.argv[3])
store = open_backend(sys.argv[1])
keys = sys.argv[2].split(",")
store.txn([], [Put(k, b"written") for k in keys])
print("done", flush=True)
"""

# A writer of one key: after the others' lock expired it aborts their transaction.
ABORTER = """
import sys
from ipward.store import open_backend
from ipward.store.base import Put
from ipward.store.kube import commit
from ipward.store.kube.objects import Conflict
commit.ABORT_MARGIN = 0.5
store = open_backend(sys.argv[1])
store.txn([], [Put(sys.argv[2], b"aborter")])
print("done", flush=True)
"""


@pytest.fixture
def keys() -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"/w/{run}/{d}/k" for d in ("a", "b", "c")]


@pytest.fixture
def store(kube_store_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.setattr(commit, "ABORT_MARGIN", 0.5)
    with open_backend(kube_store_url) as s:
        yield s


def start(script: str, *args: str, gate: Gate | None = None) -> subprocess.Popen[str]:
    env = gate.env if gate is not None else dict(os.environ)
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, text=True
    )


def kill_at(gate: Gate, proc: subprocess.Popen[str]) -> None:
    gate.wait_reached()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def values(store: Store, keys: list[str]) -> list[bytes | None]:
    return [kv.value if (kv := store.get(k)) else None for k in keys]


@pytest.mark.parametrize("point", ["kube-locking", "kube-locked"])
def test_a_writer_killed_before_its_commit_leaves_nothing(
    store: Store, kube_store_url: str, keys: list[str], tmp_path: Path, point: str
) -> None:
    """Locks of a transaction never committed: read as nothing at once; a writer of a
    locked key waits for the lock's expiry, marks the transaction aborted in its
    primary and writes; the dead transaction's other keys never appear."""
    gate = Gate(tmp_path, point)
    writer = start(WRITER, kube_store_url, ",".join(keys), "2", gate=gate)
    kill_at(gate, writer)
    assert values(store, keys) == [None, None, None]
    assert store.txn([], [Put(keys[2], b"next")]).succeeded  # the last locked: waits, aborts
    assert values(store, keys) == [None, None, b"next"]
    snapshot, _ = store.snapshot([k.rsplit("/", 2)[0] + "/" for k in keys[:1]])
    assert [kv.key for kv in snapshot] == [keys[2]]


def test_a_writer_killed_after_its_commit_is_applied_everywhere(
    store: Store, kube_store_url: str, keys: list[str], tmp_path: Path
) -> None:
    """Locks of a committed transaction, never resolved by their writer: every reader
    reads them as written, and the next writer of a locked key writes over them."""
    gate = Gate(tmp_path, "kube-committed")
    writer = start(WRITER, kube_store_url, ",".join(keys), "60", gate=gate)
    kill_at(gate, writer)
    assert values(store, keys) == [b"written"] * 3
    revisions = {store.get(k).mod_revision for k in keys}  # type: ignore[union-attr]
    assert len(revisions) == 1  # one transaction, one revision: its commit's
    assert store.txn([at_revision(keys[1], revisions.pop())], [Put(keys[1], b"next")]).succeeded
    assert values(store, keys) == [b"written", b"next", b"written"]


def test_an_aborter_killed_after_its_mark_leaves_the_transaction_aborted(
    store: Store, kube_store_url: str, keys: list[str], tmp_path: Path
) -> None:
    """The writer killed after its locks; another writer, past their expiry, marks the
    transaction aborted in its primary and is killed before removing the lock: the mark
    decides, the lock is nothing to readers and goes at the next writer."""
    locked = Gate(tmp_path, "kube-locked")
    writer = start(WRITER, kube_store_url, ",".join(keys), "1", gate=locked)
    kill_at(locked, writer)
    marked = Gate(tmp_path, "kube-aborted")
    aborter = start(ABORTER, kube_store_url, keys[2], gate=marked)
    kill_at(marked, aborter)
    assert values(store, keys) == [None, None, None]
    assert store.txn([], [Put(keys[1], b"next")]).succeeded  # knows the fate at once
    assert values(store, keys) == [None, b"next", None]


def test_a_failed_update_that_let_go_a_lock_keeps_its_commit_record(
    kube_store_url: str, keys: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer's update that applies, in passing, the lock of its own committed
    transaction and then fails (the object moved: 409) applied nothing: the
    transaction's commit record stays until an update that was made lets the lock go.
    (Found by the `kube` node-gone story: a record pruned on a failed update's word left
    the lock to be judged aborted by other processes, the write lost: a node index entry
    left behind, dangling.)"""
    monkeypatch.setattr(commit, "RESOLVE_DELAY", 600.0)  # its resolver stays out of it
    monkeypatch.setattr(commit, "RECORD_HORIZON", 0.0)  # records go as soon as they may
    monkeypatch.setattr(commit, "LOCK_TTL", 1.0)
    monkeypatch.setattr(commit, "ABORT_MARGIN", 0.5)
    written = keys[:2]
    primary, secondary = sorted((shards.shard_of(k) for k in written), key=commit._rank)
    locked = next(k for k in written if shards.shard_of(k) == secondary)
    with open_backend(kube_store_url) as writer, open_backend(kube_store_url) as other:
        assert writer.txn([], [Put(k, b"written") for k in written]).succeeded
        c = writer.committer
        stale = c.cached(secondary)
        assert len(stale.locks) == 1, "the secondary holds the committed transaction's lock"
        expires = next(iter(stale.locks.values())).expires
        # Another process moves the secondary's object (its lock untouched: it does not
        # know the transaction's fate), so the writer's next update of it fails...
        other.committer.write_as_is(other.committer.read(secondary))
        with pytest.raises(Conflict):
            c.write_as_is(stale)
        # ...and the writer's next update of the primary must keep the commit record.
        c.write_as_is(c.read(primary))
        assert c.read(primary).commits, "the commit record went while its lock is stored"
        wait_for(lambda: c.clock() > expires + 0.6, "the lock's expiry, and the margin")
    with open_backend(kube_store_url) as reader:  # knows no fate: reads the primary
        assert values(reader, written) == [b"written", b"written"], locked


def test_a_commit_whose_answer_was_lost_and_then_followed_is_known_committed(
    kube_store_url: str, keys: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer to a commit (the primary's update holding the commit record) is lost
    and another process updates the primary before the writer reads it back: the
    writer knows its transaction committed by the record, at the record's revision, and
    lets its other locks go as applied. (Judged by "the last update was mine" alone, it
    took the transaction for not made and dropped the locks: half a transaction.)"""
    written = keys[:2]
    primary, _ = sorted((shards.shard_of(k) for k in written), key=commit._rank)
    with open_backend(kube_store_url) as writer, open_backend(kube_store_url) as other:
        write = writer.committer.objects.write
        lost: list[int] = []

        def commit_answer_lost(shard: Any, data: str) -> int:
            rv = write(shard, data)
            if shard.id == primary and shard.commits and not lost:
                lost.append(rv)
                other.committer.write_as_is(other.committer.read(primary))
                raise StoreUnreachable("the answer to the commit was lost")
            return rv

        monkeypatch.setattr(writer.committer.objects, "write", commit_answer_lost)
        assert writer.txn([], [Put(k, b"written") for k in written]).succeeded
        assert lost, "the commit's answer was not lost"
        assert {writer.get(k).mod_revision for k in written} == set(lost)  # type: ignore[union-attr]
    with open_backend(kube_store_url) as reader:
        assert values(reader, written) == [b"written", b"written"]
        assert {reader.get(k).mod_revision for k in written} == set(lost)  # type: ignore[union-attr]


def test_a_commit_whose_answer_and_read_back_were_lost_is_settled_in_its_primary(
    kube_store_url: str, keys: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit is made, its answer lost, and the read back fails too (the API server
    away): the writer settles the fate in the primary (its record, or an abort mark a
    late commit cannot pass) before it lets any lock go. (It took the transaction for
    aborted and dropped its other locks unapplied: the primary's half made, the rest
    lost; the chaos soak met it as node index entries with no record.)"""
    written = keys[:2]
    primary, _ = sorted((shards.shard_of(k) for k in written), key=commit._rank)
    with open_backend(kube_store_url) as writer:
        objects = writer.committer.objects
        write, get = objects.write, objects.get
        away: list[str] = []

        def commit_made_and_answer_lost(shard: Any, data: str) -> int:
            rv = write(shard, data)
            if shard.id == primary and shard.commits and not away:
                away.append("commit")
                raise StoreUnreachable("the answer to the commit was lost")
            return rv

        def read_back_lost(shard_id: str) -> Any:
            if away == ["commit"]:
                away.append("read back")
                raise StoreUnreachable("the API server is away")
            return get(shard_id)

        monkeypatch.setattr(objects, "write", commit_made_and_answer_lost)
        monkeypatch.setattr(objects, "get", read_back_lost)
        assert writer.txn([], [Put(k, b"written") for k in written]).succeeded
        assert away == ["commit", "read back"]
    with open_backend(kube_store_url) as reader:
        assert values(reader, written) == [b"written", b"written"]


def test_a_delete_of_a_key_a_stale_copy_lacks_still_deletes_it(
    kube_store_url: str, keys: list[str]
) -> None:
    """A writer whose cached copy of a shard lacks a key another process wrote since
    deletes that key all the same, alone or beside writes elsewhere; and a transaction
    that writes nothing judges its compares on the shard as it is now. (A delete was
    dropped on the stale copy's word, nothing checking that copy: the chaos soak met it
    as a free queue entry left behind by the controller's release of a block.)"""
    written, other = keys[0], keys[1]
    with open_backend(kube_store_url) as writer, open_backend(kube_store_url) as another:
        assert writer.get(other) is None  # the writer's copy of the other shard: without it
        assert another.txn([], [Put(other, b"theirs")]).succeeded
        assert writer.txn([], [Put(written, b"mine"), Delete(other)]).succeeded
        assert another.get(other) is None, "the delete was dropped on a stale copy"
        assert another.txn([], [Put(other, b"again")]).succeeded
        assert writer.txn([], [Delete(other)]).succeeded
        assert another.get(other) is None, "the lone delete was dropped on a stale copy"
        assert another.txn([], [Put(other, b"third")]).succeeded
        assert not writer.txn([absent(other)], []).succeeded, "judged on the stale copy"


# -- the bank ----------------------------------------------------------------------------

TELLER = """
import random, sys
from ipward.store import open_backend
from ipward.store.base import Put, at_revision
from ipward.store.kube import commit
from ipward.store.kube.objects import Conflict
commit.LOCK_TTL = 2.0
commit.ABORT_MARGIN = 0.5
store = open_backend(sys.argv[1])
accounts = sys.argv[2].split(",")
rng = random.Random(int(sys.argv[3]))
while True:
    a, b = rng.sample(accounts, 2)
    ka, kb = store.get(a), store.get(b)
    amount = rng.randint(1, 5)
    store.txn(
        [at_revision(a, ka.mod_revision), at_revision(b, kb.mod_revision)],
        [Put(a, str(int(ka.value) - amount).encode()),
         Put(b, str(int(kb.value) + amount).encode())],
    )
    print("moved", flush=True)
"""

ACCOUNTS, START = 6, 100


def test_the_bank_keeps_its_total_through_kill_9(store: Store, kube_store_url: str) -> None:
    """Three tellers move amounts between accounts of six shards by two-key
    transactions; one of them is killed (SIGKILL) every few transfers, wherever it is,
    and started again. Every snapshot meanwhile, and the end, holds the same total."""
    run = uuid.uuid4().hex[:8]
    accounts = [f"/bank/{run}/{i}/balance" for i in range(ACCOUNTS)]
    for key in accounts:
        assert store.txn([], [Put(key, str(START).encode())]).succeeded
    total = ACCOUNTS * START
    rng = random.Random(7)
    tellers: list[subprocess.Popen[str]] = []
    moved = [0]

    def teller(seed: int) -> subprocess.Popen[str]:
        proc = start(TELLER, kube_store_url, ",".join(accounts), str(seed))
        threading.Thread(target=_count, args=(proc, moved), daemon=True).start()
        return proc

    tellers = [teller(i) for i in range(3)]
    kills = 0
    try:
        while kills < 12:
            target = moved[0] + rng.randint(2, 6)
            wait_for(lambda target=target: moved[0] >= target, "transfers", timeout=120)
            victim = rng.randrange(len(tellers))
            tellers[victim].send_signal(signal.SIGKILL)
            tellers[victim].wait(30)
            tellers[victim] = teller(100 + kills)
            kills += 1
            kvs, revision = store.snapshot([f"/bank/{run}/"])
            assert sum(int(kv.value) for kv in kvs) == total, (revision, kvs)
    finally:
        for proc in tellers:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    kvs, _ = store.snapshot([f"/bank/{run}/"])
    assert len(kvs) == ACCOUNTS and sum(int(kv.value) for kv in kvs) == total
    assert moved[0] > 12, moved
    print(json.dumps({"transfers": moved[0], "kills": kills}))


def _count(proc: subprocess.Popen[str], moved: list[int]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("moved"):
            moved[0] += 1
