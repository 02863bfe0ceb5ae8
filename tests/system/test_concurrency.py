"""The concurrency proof (docs/design.md 2, 4, 5.1, 5.2): real processes exec'ing the
real plugin against one SQLite file, SIGKILLed mid-operation, never mocks.

`test_sixteen_plugins_with_sigkill` runs 16 worker processes, each looping ADD/DEL through
the installed plugin (one exec per call, CNI_* environment and config on stdin, as a
runtime does) on two inline pools sharing one store file: a /22 that never runs dry and a
/27 where exhaustion (code 100) is a legal answer. Every call is journaled by its worker
(append + fsync) before it starts and after it returns. Meanwhile the test SIGKILLs
plugin processes (through a pidfd, so never a recycled pid): any of them, ones with the
store open, and ones inside a write transaction (holding SQLite's WAL write lock, seen in
/proc/locks); and it kills whole workers with their plugin child, restarting them only
once every process of the killed group is gone. Then:

  * per attachment, the journal bounds what the store may hold: last call a successful
    ADD of A -> recorded once, with A; a completed DEL -> no record; calls killed after
    that widen what is allowed, never to two records;
  * the store's own history (a watch from revision 1) is explained call by call by the
    journal, and no revision ever has one address under two attachments;
  * across attachments, no two ever provably held one address at the same moment (an
    ADD's hold runs from its successful return to the start of the next DEL);
  * `ipward check`, an independent structural check of records and indexes, and SQLite's
    integrity check pass; a DEL of everything through the plugin leaves no record and no
    index; and every address of both pools can be handed out again (no leak, nothing
    lost from the free queue).

Assertions hold for every interleaving; only the kill timing is random (seeded).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.errors import PoolExhausted
from ipward.core.pool import PoolSpec
from ipward.core.records import AddressRecord
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from ipward.store import open_store
from ipward.store.base import DELETE, PUT
from ipward_lab.fleet import run_cli
from ipward_lab.waiting import wait_for

NODE = "node-a"
WORKERS = 16
BIG_PER_WORKER = 5  # 80 attachments on a /22: never runs dry
SMALL_PER_WORKER = 4  # 64 attachments on a /27 (29 usable): exhaustion is routine
CHURN_SECONDS = 18.0
WORKER_KILLS = 6
MAX_OPS = 3000  # per worker incarnation; the churn time is the real bound
SEED = 20240611
ANY = "*"  # "some address, which one is not known"

# The worker: loops ADD/DEL through the plugin executable, journaling every call before
# it starts and after it returns. Standard library only; one argument, a JSON spec.
WORKER = r"""
import json, os, random, subprocess, sys, time

spec = json.loads(sys.argv[1])
rng = random.Random(spec["seed"])
journal = os.open(spec["journal"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
errlog = os.open(spec["errlog"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
configs = {}
for net, path in spec["configs"].items():
    with open(path, "rb") as f:
        configs[net] = f.read()
attachments = [tuple(a) for a in spec["attachments"]]
belief = {}


def note(*words):
    stamps = [str(time.monotonic_ns()), "%.6f" % time.time(), spec["slot"]]
    line = " ".join([*stamps, *map(str, words)]) + "\n"
    os.write(journal, line.encode())
    os.fsync(journal)


# A predecessor killed mid-write may have left half a line: end it, it will not parse.
os.write(journal, ("\nincarnation %s\n" % spec["incarnation"]).encode())
os.fsync(journal)
for seq in range(spec["max_ops"]):
    if time.monotonic() > spec["deadline"] or os.path.exists(spec["stop"]):
        break
    net, cid = rng.choice(attachments)
    p_add = {"absent": 0.9, "present": 0.3}.get(belief.get((net, cid)), 0.5)
    op = "ADD" if rng.random() < p_add else "DEL"
    tag = "%s.%s.%d" % (spec["slot"], spec["incarnation"], seq)
    env = {
        "CNI_COMMAND": op,
        "CNI_CONTAINERID": cid,
        "CNI_IFNAME": "eth0",
        "CNI_NETNS": "/var/run/netns/" + cid,
        "CNI_PATH": os.path.dirname(spec["plugin"]),
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=%s" % cid,
    }
    note("start", op, net, cid, tag)
    proc = subprocess.Popen(
        [spec["plugin"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out, err = proc.communicate(configs[net])
    rc = proc.returncode
    if b"Traceback" in out or b"Traceback" in err:
        os.write(errlog, (json.dumps({"tag": tag, "rc": rc, "stdout": out.decode(errors="replace"),
                                      "stderr": err.decode(errors="replace")}) + "\n").encode())
    if rc < 0:
        belief.pop((net, cid), None)
        note("killed", op, net, cid, tag, "sig=%d" % -rc)
        continue
    try:
        result = json.loads(out) if out.strip() else {}
    except ValueError:
        result = None
    if rc == 0 and op == "ADD" and isinstance(result, dict) and result.get("ips"):
        belief[(net, cid)] = "present"
        note("ok", op, net, cid, tag, result["ips"][0]["address"].split("/")[0])
    elif rc == 0 and op == "DEL" and not out.strip():
        belief[(net, cid)] = "absent"
        note("ok", op, net, cid, tag)
    else:
        code = result.get("code") if isinstance(result, dict) else None
        note("err", op, net, cid, tag, "code=%s" % code)
        os.write(errlog, (json.dumps({"tag": tag, "rc": rc, "stdout": out.decode(errors="replace"),
                                      "stderr": err.decode(errors="replace")}) + "\n").encode())
"""


# -- helpers: configs, processes --------------------------------------------------------


def _config(
    network: str,
    url: str,
    subnet: str,
    gateway: str,
    cooldown: float | None,
    log_file: Path | None = None,
) -> dict:
    ipam: dict = {
        "type": "ipward",
        "store": url,
        "node": NODE,
        "ranges": [[{"subnet": subnet, "gateway": gateway}]],
    }
    if cooldown is not None:
        ipam["cooldown"] = cooldown
    if log_file is not None:
        ipam["logFile"] = str(log_file)
        ipam["logLevel"] = "info"
    return {"cniVersion": "1.0.0", "name": network, "type": "bridge", "ipam": ipam}


def _env(plugin: Path, command: str, container: str, args: str = "") -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_IFNAME": "eth0",
        "CNI_NETNS": f"/var/run/netns/{container}",
        "CNI_PATH": str(plugin.parent),
        "CNI_ARGS": args,
    }


class Outcome:
    """What one plugin exec returned."""

    def __init__(self, rc: int, stdout: bytes, stderr: bytes) -> None:
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        try:
            self.json = json.loads(stdout) if stdout.strip() else None
        except ValueError:
            self.json = None

    @property
    def address(self) -> str | None:
        if self.rc == 0 and isinstance(self.json, dict) and self.json.get("ips"):
            return str(self.json["ips"][0]["address"]).split("/")[0]
        return None

    @property
    def code(self) -> int | None:
        return self.json.get("code") if isinstance(self.json, dict) else None

    def __repr__(self) -> str:
        return f"Outcome(rc={self.rc}, stdout={self.stdout!r}, stderr={self.stderr[-2000:]!r})"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2])


def _live_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _children(parents: set[int], plugin: Path) -> list[int]:
    """Live plugin processes exec'd by the workers."""
    out = []
    for pid in _live_pids():
        stat = _proc_stat(pid)
        if stat is None or stat[0] in "ZX" or stat[1] not in parents:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(plugin).encode() in cmdline:
            out.append(pid)
    return out


def _kill_plugin(pid: int, parents: set[int]) -> bool:
    """SIGKILL `pid` if it is still a worker's child. The pidfd pins the process, so the
    check and the kill are about the same one, never a recycled pid."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        stat = _proc_stat(pid)
        if stat is None or stat[0] in "ZX" or stat[1] not in parents:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def _wal_lockers(shm: Path) -> tuple[set[int], set[int]]:
    """From /proc/locks: pids with the store open (any POSIX lock on its WAL index) and
    pids inside a write transaction (SQLite's WAL write lock, byte 120 of the index)."""
    try:
        inode = shm.stat().st_ino
    except OSError:
        return set(), set()
    opened, writing = set(), set()
    for line in Path("/proc/locks").read_text().splitlines():
        words = line.split()  # "7: POSIX  ADVISORY  WRITE 4242 fe:00:2148808 120 120"
        if len(words) != 8 or words[1] != "POSIX" or words[5].rsplit(":", 1)[-1] != str(inode):
            continue  # other locks, or a blocked waiter ("7: -> POSIX ...")
        opened.add(int(words[4]))
        if words[3] == "WRITE" and words[6] == "120":
            writing.add(int(words[4]))
    return opened, writing


def _pick_victim(
    rng: random.Random, parents: set[int], plugin: Path, shm: Path
) -> tuple[str, int | None]:
    """A plugin process to SIGKILL: a third of the time any of them (most are starting
    up), a third one with the store open, a third one inside a write transaction (waiting
    a moment for one to appear); falling back to any."""
    where = rng.choice(("anywhere", "store-open", "in-write-txn"))
    if where != "anywhere":

        def found() -> list[int]:
            opened, writing = _wal_lockers(shm)
            return [
                pid
                for pid in sorted(writing if where == "in-write-txn" else opened)
                if (stat := _proc_stat(pid)) is not None and stat[1] in parents
            ]

        # One look for the store open, a moment for a write transaction; else any.
        moment = 0.05 if where == "in-write-txn" else 0.0
        with contextlib.suppress(TimeoutError):
            pids = wait_for(found, f"a plugin {where}", moment, 0.0005, failure=TimeoutError)
            return where, rng.choice(pids)
    children = _children(parents, plugin)
    return "anywhere", (rng.choice(children) if children else None)


def _wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    """Until no process of the group is alive (a zombie can commit nothing)."""

    def gone() -> bool:
        alive = [
            pid
            for pid in _live_pids()
            if (s := _proc_stat(pid)) is not None and s[2] == pgid and s[0] not in "ZX"
        ]
        assert not alive, f"still alive: {alive}"
        return True

    wait_for(
        gone, f"process group {pgid} gone after SIGKILL", timeout, 0.005, passing=(AssertionError,)
    )


def _run_plugins(
    plugin: Path, calls: list[tuple[dict[str, str], bytes]], parallel: int = 8
) -> list[Outcome]:
    """Exec the plugin once per call, `parallel` at a time; outcomes in call order."""
    outcomes: list[Outcome] = []
    for i in range(0, len(calls), parallel):
        procs = [
            subprocess.Popen(
                [str(plugin)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            for env, _ in calls[i : i + parallel]
        ]
        for proc, (env, data) in zip(procs, calls[i : i + parallel], strict=True):
            try:
                out, err = proc.communicate(data, timeout=120)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                    p.wait()
                raise AssertionError(f"plugin hung for 120 s: {env}") from None
            outcomes.append(Outcome(proc.returncode, out, err))
    return outcomes


def _run_gated(plugin: Path, calls: list[tuple[dict[str, str], bytes]], tmp: Path) -> list[Outcome]:
    """Start every plugin, let each load up to its read of stdin, then feed them all at
    once, so the store work of all of them overlaps as much as processes allow."""
    procs = []
    errs = []
    for i, (env, _) in enumerate(calls):
        err = open(tmp / f"gated-{i}.stderr", "w+b")  # noqa: SIM115
        errs.append(err)
        procs.append(
            subprocess.Popen(
                [str(plugin)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )
        )
    waiting = {p.pid for p in procs}

    def all_reading() -> bool:
        for pid in list(waiting):
            try:
                syscall = Path(f"/proc/{pid}/syscall").read_text().split()
            except OSError:
                syscall = []
            if syscall[:2] == ["0", "0x0"]:  # blocked in read(0, ...)
                waiting.discard(pid)
        return not waiting

    with contextlib.suppress(TimeoutError):  # best effort: a gate, not an assertion
        wait_for(all_reading, "every plugin in its read of stdin", 10, 0.002, failure=TimeoutError)
    for proc, (_, data) in zip(procs, calls, strict=True):
        assert proc.stdin is not None
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died before reading: its outcome says how
    outcomes = []
    for proc, err in zip(procs, errs, strict=True):
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.wait(timeout=120)
        err.seek(0)
        outcomes.append(Outcome(proc.returncode, out, err.read()))
        err.close()
    return outcomes


# -- helpers: the store -----------------------------------------------------------------


def _dump(url: str, prefixes: tuple[str, ...] = ("ips/", "attach/", "free/", "freeq/")) -> str:
    store = open_store(url)
    try:
        lines = []
        for prefix in prefixes:
            for kv in store.range(prefix)[0]:
                lines.append(f"{kv.key} @{kv.mod_revision} {kv.value.decode()}")
        return "\n".join(lines)
    finally:
        store.close()


def _holdings(url: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Per attachment key, {pool: ip} from the records, checked against the attachment
    indexes; and the structural problems found (independent of `ipward check`)."""
    store = open_store(url)
    try:
        records = {kv.key: rec.decode(kv.value) for kv in store.range("ips/")[0]}
        indexes = {kv.key: rec.decode(kv.value)["ips"] for kv in store.range("attach/")[0]}
    finally:
        store.close()
    problems = []
    holdings: dict[str, dict[str, str]] = {}
    for key, record in records.items():
        _, pool, ip = key.split("/", 2)
        owner = AddressRecord.from_dict(record).index_key
        held = holdings.setdefault(owner, {})
        if pool in held:
            problems.append(f"{owner} holds two addresses of {pool}: {held[pool]} and {ip}")
        held[pool] = ip
        if f"{pool}/{ip}" not in indexes.get(owner, []):
            problems.append(f"{key} (owner {owner}) is not listed by its index")
    listed: dict[str, str] = {}
    for index_key, refs in indexes.items():
        if not refs:
            problems.append(f"{index_key} lists no address")
        for ref in refs:
            if ref in listed:
                problems.append(f"{ref} listed by two attachments: {listed[ref]} and {index_key}")
            listed[ref] = index_key
            record = records.get(f"ips/{ref}")
            if record is None:
                problems.append(f"{index_key} lists {ref}, which has no record")
            elif AddressRecord.from_dict(record).index_key != index_key:
                problems.append(f"{index_key} lists {ref}, recorded for another attachment")
    return holdings, problems


def _assert_store_sound(url: str) -> None:
    store = open_store(url)
    try:
        problems, _ = check(store)
    finally:
        store.close()
    assert not problems, f"check(store) found {problems}\n{_dump(url)}"
    cli = run_cli("check", store=url)
    assert cli.returncode == 0, f"ipward check: {cli.returncode}\n{cli.stdout}\n{cli.stderr}"
    _, structural = _holdings(url)
    assert not structural, "\n".join(structural) + "\n" + _dump(url)
    path = url[len("sqlite://") :]
    conn = sqlite3.connect(path)
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    assert integrity == [("ok",)], f"PRAGMA integrity_check: {integrity}"


def _assert_free_queue_consistent(url: str) -> None:
    """free/<pool>/<ip> and freeq/... name the same addresses, one queue entry each, and
    each free record points at its own queue entry."""
    store = open_store(url)
    try:
        frees = {kv.key: rec.decode(kv.value) for kv in store.range("free/")[0]}
        queue = [kv.key for kv in store.range("freeq/")[0]]
    finally:
        store.close()
    queued = {}
    for key in queue:
        pool, ip = key.split("/")[1], key.rsplit("/", 1)[1]
        assert f"free/{pool}/{ip}" not in queued, f"{ip} queued twice"
        queued[f"free/{pool}/{ip}"] = key
    assert set(frees) == set(queued), (sorted(set(frees) ^ set(queued)), _dump(url))
    for key, record in frees.items():
        assert record["queue"] == queued[key], (key, record, queued[key])


# -- the journal ------------------------------------------------------------------------


class Op:
    """One plugin call as journaled: started, and how it ended (None: worker killed)."""

    __slots__ = (
        "addr",
        "code",
        "end",
        "end_ts",
        "end_wall",
        "kind",
        "line",
        "start_ts",
        "start_wall",
        "tag",
    )

    def __init__(self, kind: str, tag: str, start_ts: int, line: str) -> None:
        self.kind = kind
        self.tag = tag
        self.start_ts = start_ts  # CLOCK_MONOTONIC ns: one clock for all processes
        self.start_wall = 0.0  # time.time(), to line up with the plugin's log
        self.line = line
        self.end: str | None = None
        self.end_ts: int | None = None
        self.end_wall: float | None = None
        self.addr: str | None = None
        self.code: str | None = None

    def __repr__(self) -> str:
        end = f"{self.end} {self.addr or self.code or ''}".strip() if self.end else "(no end)"
        return f"[{self.tag} {self.kind} @{self.start_ts}: {end}]"


def _read_journals(paths: list[Path]) -> dict[tuple[str, str], list[Op]]:
    """Calls per (network, container), in the order they were made."""
    ops: dict[tuple[str, str], list[Op]] = {}
    by_tag: dict[str, Op] = {}
    for path in paths:
        for line in path.read_text().split("\n"):
            words = line.split()
            if len(words) < 8 or words[3] not in ("start", "ok", "err", "killed"):
                continue  # incarnation marks, a line cut by a SIGKILL
            ts, wall, event, kind, net, cid, tag = int(words[0]), float(words[1]), *words[3:8]
            extra = words[8] if len(words) > 8 else None
            if event == "start":
                op = by_tag[tag] = Op(kind, tag, ts, line)
                op.start_wall = wall
                ops.setdefault((net, cid), []).append(op)
                continue
            op = by_tag[tag]
            op.end, op.end_ts, op.end_wall = event, ts, wall
            if event == "ok" and kind == "ADD":
                op.addr = extra
            elif event == "err":
                op.code = extra
    return ops


def _allowed_states(ops: list[Op]) -> tuple[set[str | None], list[str]]:
    """What the store may hold for an attachment after its calls: None (nothing), an
    address, or ANY; and the idempotency violations seen on the way."""
    states: set[str | None] = {None}
    violations = []
    for op in ops:
        if op.end == "ok" and op.kind == "ADD":
            if None not in states and ANY not in states and op.addr not in states:
                violations.append(f"{op}: ADD of a held attachment returned another address")
            states = {op.addr}
        elif op.end == "ok":
            states = {None}
        elif op.end == "err":
            pass  # an answered error changed nothing
        elif op.kind == "ADD":  # killed, outcome unknown: maybe committed
            if None in states:
                states = states | {ANY}
        else:
            states = states | {None}
    return states, violations


def _overlapping_holds(ops: dict[tuple[str, str], list[Op]]) -> list[str]:
    """Two attachments provably holding one address at the same moment."""
    spans: dict[tuple[str, str], list[tuple[int, float, str, str]]] = {}
    for (net, cid), calls in ops.items():
        for i, op in enumerate(calls):
            if op.end == "ok" and op.kind == "ADD":
                assert op.end_ts is not None and op.addr is not None
                release = next((c.start_ts for c in calls[i + 1 :] if c.kind == "DEL"), None)
                until = float("inf") if release is None else release
                spans.setdefault((net, op.addr), []).append((op.end_ts, until, cid, op.tag))
    found = []
    for (net, addr), held in spans.items():
        held.sort()
        for i, (start, until, cid, tag) in enumerate(held):
            for start2, _, cid2, tag2 in held[i + 1 :]:
                if start2 >= until:
                    break
                if cid2 != cid:
                    found.append(
                        f"{net} {addr}: {cid} held it from {start} ({tag}) until {until},"
                        f" {cid2} got it at {start2} ({tag2})"
                    )
    return found


def _read_plugin_log(path: Path) -> list[dict]:
    entries = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # cut by a SIGKILL
    return entries


def _history(url: str) -> list[tuple[int, str, str, str | None]]:
    """Every change of an attachment index, oldest first, from the store's own revision
    history (a watch from revision 1): (revision, put|delete, key, address)."""
    store = open_store(url)
    last = store.revision()
    watch = store.watch("attach/", 1)
    timer = threading.Timer(2.0, watch.cancel)  # in case the newest revision is no index's
    timer.start()
    out: list[tuple[int, str, str, str | None]] = []
    try:
        for event in watch:
            kv = event.kv
            address = None
            if event.kind == PUT:
                refs = rec.decode(kv.value)["ips"]
                address = rec.split_pool_ip(refs[0])[1] if len(refs) == 1 else ",".join(refs)
            out.append((kv.mod_revision, event.kind, kv.key, address))
            if kv.mod_revision >= last:
                watch.cancel()
    finally:
        timer.cancel()
        store.close()
    return out


def _explain(ops: list[Op], changes: list[tuple[str, str | None]]) -> int | None:
    """Match an attachment's journaled calls, in order, to the changes the store committed
    for it: each call commits at most one change; a successful ADD of a held attachment
    returns the held address and commits nothing, of a free one commits exactly the PUT of
    the address it returned; a completed DEL of a held attachment commits its delete; an
    answered error commits nothing; a killed call may or may not have committed its
    change. None if no matching explains the history; else the fewest killed calls that
    must have committed (a SIGKILL that landed after the commit, before the answer)."""
    n = len(changes)

    def held(i: int) -> str | None:
        return changes[i - 1][1] if i and changes[i - 1][0] == PUT else None

    def next_is(i: int, kind: str, address: str | None = None) -> bool:
        return i < n and changes[i][0] == kind and (address is None or changes[i][1] == address)

    configs = {0: 0}  # changes explained so far -> fewest killed calls that committed
    for op in ops:
        after: dict[int, int] = {}

        def reach(i: int, cost: int, after: dict[int, int] = after) -> None:
            after[i] = min(cost, after.get(i, cost))

        for i, cost in configs.items():
            address = held(i)
            if op.end == "ok" and op.kind == "ADD":
                if address is not None and address == op.addr:
                    reach(i, cost)
                elif address is None and next_is(i, PUT, op.addr):
                    reach(i + 1, cost)
            elif op.end == "ok":
                if address is None:
                    reach(i, cost)
                elif next_is(i, DELETE):
                    reach(i + 1, cost)
            elif op.end == "err":
                if op.kind == "DEL" or address is None:  # ADD of a held attachment never fails
                    reach(i, cost)
            else:
                reach(i, cost)
                if next_is(i, PUT if op.kind == "ADD" else DELETE) and (
                    (address is None) == (op.kind == "ADD")
                ):
                    reach(i + 1, cost + 1)
        configs = after
    return configs.get(n)


# -- the tests --------------------------------------------------------------------------


def test_sixteen_plugins_with_sigkill(plugin: Path, sqlite_url: str, tmp_path: Path) -> None:
    """16 workers churn ADD/DEL through the plugin on one SQLite file while plugins and
    workers are SIGKILLed; then the journals, the store's history and its final state
    must agree, and everything must come back free (see the module docstring)."""
    rng = random.Random(SEED)
    plugin_log = tmp_path / "plugin.log"
    nets = {
        "big": _config("big", sqlite_url, "10.20.0.0/22", "10.20.0.1", None, plugin_log),
        "small": _config("small", sqlite_url, "10.30.0.0/27", "10.30.0.1", 1.0, plugin_log),
    }
    config_paths = {}
    for net, config in nets.items():
        config_paths[net] = tmp_path / f"{net}.json"
        config_paths[net].write_text(json.dumps(config))
    worker_py = tmp_path / "worker.py"
    worker_py.write_text(WORKER)
    stop = tmp_path / "stop"
    churn_end = time.monotonic() + CHURN_SECONDS
    slots = [f"w{i:02d}" for i in range(WORKERS)]
    attachments = {
        slot: [("big", f"{slot}-b{j}") for j in range(BIG_PER_WORKER)]
        + [("small", f"{slot}-s{j}") for j in range(SMALL_PER_WORKER)]
        for slot in slots
    }
    journals = {slot: tmp_path / f"journal-{slot}.log" for slot in slots}
    errlogs = {slot: tmp_path / f"errors-{slot}.log" for slot in slots}
    incarnations = dict.fromkeys(slots, 0)

    def start(slot: str) -> subprocess.Popen:
        spec = {
            "slot": slot,
            "incarnation": incarnations[slot],
            "seed": rng.randrange(2**32),
            "plugin": str(plugin),
            "configs": {net: str(p) for net, p in config_paths.items()},
            "attachments": attachments[slot],
            "journal": str(journals[slot]),
            "errlog": str(errlogs[slot]),
            "stop": str(stop),
            "deadline": churn_end + 30,  # fallback only: the stop file ends the churn
            "max_ops": MAX_OPS,
        }
        return subprocess.Popen(
            [sys.executable, str(worker_py), json.dumps(spec)], start_new_session=True
        )

    workers = {slot: start(slot) for slot in slots}
    worker_kill_at = sorted(
        time.monotonic() + rng.uniform(2, CHURN_SECONDS - 3) for _ in range(WORKER_KILLS)
    )
    shm = Path(sqlite_url[len("sqlite://") :] + "-shm")
    kills = dict.fromkeys(("anywhere", "store-open", "in-write-txn"), 0)
    worker_kills = 0
    try:
        while time.monotonic() < churn_end:
            time.sleep(rng.uniform(0.01, 0.12))
            parents = {w.pid for w in workers.values()}
            where, target = _pick_victim(rng, parents, plugin, shm)
            if target is not None and _kill_plugin(target, parents):
                kills[where] += 1
            if worker_kill_at and time.monotonic() >= worker_kill_at[0]:
                worker_kill_at.pop(0)
                slot = rng.choice(slots)
                victim = workers[slot]
                os.killpg(victim.pid, signal.SIGKILL)  # the worker and its plugin child
                victim.wait(timeout=30)
                _wait_group_gone(victim.pid)
                worker_kills += 1
                incarnations[slot] += 1
                workers[slot] = start(slot)
        stop.touch()
        for slot, worker in workers.items():
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"worker {slot} hung; journal tail:\n"
                    + "\n".join(journals[slot].read_text().splitlines()[-5:])
                ) from None
            _wait_group_gone(worker.pid)
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()

    ops = _read_journals(list(journals.values()))
    calls = [op for net_ops in ops.values() for op in net_ops]
    stats = {
        "calls": len(calls),
        "plugin_kills": kills,
        "worker_kills": worker_kills,
        "killed_calls": sum(op.end == "killed" for op in calls),
        "unfinished_calls": sum(op.end is None for op in calls),
        "ok_add": sum(op.end == "ok" and op.kind == "ADD" for op in calls),
        "ok_del": sum(op.end == "ok" and op.kind == "DEL" for op in calls),
        "exhausted": sum(op.code == "code=100" for op in calls),
    }
    print(f"\nchurn: {stats}")
    ran = sum(kills.values()) and worker_kills and stats["ok_add"]
    assert ran, f"the churn did not run: {stats}"
    log = _read_plugin_log(plugin_log)

    # Errors: only exhaustion, and only on the small pool; no traceback anywhere.
    errors = [(net, op) for (net, _), net_ops in ops.items() for op in net_ops if op.end == "err"]
    unexpected = [(net, op) for net, op in errors if not (net == "small" and op.code == "code=100")]
    err_lines = [
        line for p in errlogs.values() if p.exists() for line in p.read_text().splitlines()
    ]
    evidence = [line for line in err_lines if any(f'"{op.tag}"' in line for _, op in unexpected)]
    assert not unexpected, f"unexpected plugin errors: {unexpected[:20]}\n" + "\n".join(
        evidence[:20]
    )
    tracebacks = [line for line in err_lines if "Traceback" in line]
    assert not tracebacks, "\n".join(tracebacks[:5])
    internal = [e for e in log if e.get("level") == "error" or "traceback" in e]
    assert not internal, f"internal errors in the plugin log: {internal[:5]}"

    # Never two holders at once, and a held attachment's ADD returns what it holds.
    overlaps = _overlapping_holds(ops)
    assert not overlaps, "duplicate address in time:\n" + "\n".join(overlaps[:20])
    allowed = {}
    for (net, cid), net_ops in ops.items():
        allowed[(net, cid)], violations = _allowed_states(net_ops)
        assert not violations, f"{net}/{cid}: {violations}\n{net_ops}"

    # The store's own history, change by change: explained by the journals, attachment
    # by attachment, and never one address under two attachments at any revision.
    history = _history(sqlite_url)
    changes: dict[str, list[tuple[str, str | None]]] = {}
    holder: dict[tuple[str, str], str] = {}
    for revision, kind, key, address in history:
        net = key.split("/")[1]
        mine = changes.setdefault(key, [])
        if kind == PUT:
            assert address is not None and "," not in address, (revision, key, address)
            assert not mine or mine[-1][0] == DELETE, f"@{revision} {key} put twice: {mine}"
            other = holder.setdefault((net, address), key)
            assert other == key, f"@{revision} {address} put for {key} while {other} holds it"
        else:
            assert mine and mine[-1][0] == PUT, f"@{revision} {key} deleted, not held: {mine}"
            del holder[(net, str(mine[-1][1]))]
        mine.append((kind, address))
    strangers = set(changes) - {keys.attach_key(NODE, net, cid, "eth0") for net, cid in ops}
    assert not strangers, f"indexes of attachments nobody added: {strangers}"
    committed_kills = 0
    for (net, cid), net_ops in ops.items():
        key = keys.attach_key(NODE, net, cid, "eth0")
        fewest = _explain(net_ops, changes.get(key, []))
        assert fewest is not None, (
            f"{key}: the store's history is not explained by the journal\n"
            + "\n".join(f"  {op.line}  -> {op}" for op in net_ops)
            + f"\nchanges: {changes.get(key, [])}"
        )
        committed_kills += fewest
    print(f"killed calls that provably committed first: {committed_kills}")

    # The store after the churn: sound, and what the journals say it must hold.
    _assert_store_sound(sqlite_url)
    holdings, _ = _holdings(sqlite_url)
    known = {keys.attach_key(NODE, net, cid, "eth0") for net, cid in ops}
    strangers = set(holdings) - known
    assert not strangers, f"records of attachments nobody added: {strangers}"
    for (net, cid), states in allowed.items():
        held = holdings.get(keys.attach_key(NODE, net, cid, "eth0"), {})
        assert set(held) <= {net}, f"{net}/{cid} holds addresses of another pool: {held}"
        actual = held.get(net)
        fits = actual in states or (actual is not None and ANY in states)
        assert fits, (
            f"{net}/{cid} holds {actual}, the journal allows {states}:\n"
            + "\n".join(op.line + f"  -> {op}" for op in ops[(net, cid)][-8:])
            + "\n"
            + _dump(sqlite_url, ("ips/", "attach/"))
        )

    # DEL everything through the plugin: nothing may stay behind.
    data = {net: json.dumps(config).encode() for net, config in nets.items()}
    every = [(net, cid) for slot in slots for net, cid in attachments[slot]]
    outcomes = _run_plugins(plugin, [(_env(plugin, "DEL", cid), data[net]) for net, cid in every])
    failed = [(a, o) for a, o in zip(every, outcomes, strict=True) if o.rc != 0]
    assert not failed, f"cleanup DEL failed: {failed[:5]}"
    left = _dump(sqlite_url, ("ips/", "attach/"))
    assert left == "", f"left after DEL of every attachment:\n{left}"
    _assert_store_sound(sqlite_url)
    _assert_free_queue_consistent(sqlite_url)

    # Every address of both pools can be handed out again: nothing leaked, nothing lost
    # from the free queue (freed addresses still cooling are handed out last, not never).
    store = open_store(sqlite_url)
    try:
        ledger = Ledger(store, NODE)
        for net in nets:
            spec = ledger.get_pool(net)
            capacity = spec.range_sets[0].capacity()
            got = _fill(ledger, spec, f"probe-{net}")
            assert len(got) == capacity, f"{net}: {len(got)} of {capacity} addresses handed out"
            assert len(set(got)) == capacity
            for i in range(capacity):
                ledger.free(rec.Attachment(net, f"probe-{net}-{i}", "eth0"))
    finally:
        store.close()
    assert _dump(sqlite_url, ("ips/", "attach/")) == ""
    _assert_store_sound(sqlite_url)


def _fill(ledger: Ledger, spec: PoolSpec, prefix: str) -> list[str]:
    """Allocate until the pool is exhausted; the addresses handed out."""
    got = []
    for i in range(spec.range_sets[0].capacity() + 1):
        attachment = rec.Attachment(spec.name, f"{prefix}-{i}", "eth0")
        try:
            got += [a.ip for a in ledger.allocate([spec], attachment, rec.PodInfo())]
        except PoolExhausted:
            break
    return got


def _create_store(plugin: Path, data: bytes) -> None:
    """Let one plugin create the store file (a DEL of nothing), so a race that follows is
    about the ledger, not about the file's creation (test_concurrent_first_use)."""
    (done,) = _run_plugins(plugin, [(_env(plugin, "DEL", "nobody"), data)])
    assert done.rc == 0, done


def test_concurrent_first_use(plugin: Path, tmp_path: Path) -> None:
    """8 plugins ADD 8 attachments at once on a store file that does not exist yet (the
    first pods of a new node start together): every one gets an address."""
    for rnd in range(12):
        url = f"sqlite://{tmp_path}/first-{rnd}.db"
        data = json.dumps(_config("first", url, "10.60.0.0/24", "10.60.0.1", None)).encode()
        calls = [(_env(plugin, "ADD", f"first-{i}"), data) for i in range(8)]
        outcomes = _run_gated(plugin, calls, tmp_path)
        assert all(o.rc == 0 for o in outcomes), [o for o in outcomes if o.rc != 0]
        assert len({o.address for o in outcomes}) == 8, outcomes
        _assert_store_sound(url)


def test_concurrent_same_attachment(plugin: Path, sqlite_url: str, tmp_path: Path) -> None:
    """8 plugins ADD one attachment at once: one address, one record, all agree. Round 0
    races on a pool with no block claimed yet, the next rounds over a freed (queued)
    address. In the last rounds half of the 8 also ask for static addresses, each in
    another unclaimed block: then only the attachment's own uniqueness check, not a
    shared block or queue entry, keeps it to one record."""
    config = _config("same", sqlite_url, "10.40.0.0/22", "10.40.0.1", 0)
    data = json.dumps(config).encode()
    _create_store(plugin, data)
    requests = [
        [],
        [],
        [],
        ["10.40.1.10", "10.40.1.100", "10.40.2.10", "10.40.3.200"],
        ["10.40.1.20", "10.40.1.110", "10.40.2.20", "10.40.3.210"],
    ]
    for rnd, wanted in enumerate(requests):
        cid = f"same-{rnd}"
        args = [f"IP={ip}" for ip in wanted] + [""] * (8 - len(wanted))
        calls = [(_env(plugin, "ADD", cid, a), data) for a in args]
        outcomes = _run_gated(plugin, calls, tmp_path)
        succeeded = [o for o in outcomes if o.rc == 0]
        if not wanted:
            assert len(succeeded) == 8, outcomes
        failed = [o for o in outcomes if o.rc != 0]
        assert all(o.code not in (None, 999) for o in failed), failed
        addresses = {o.address for o in succeeded}
        assert len(addresses) == 1 and None not in addresses, outcomes
        holdings, problems = _holdings(sqlite_url)
        assert not problems, f"{problems}\n{outcomes}\n{_dump(sqlite_url)}"
        assert holdings.get(keys.attach_key(NODE, "same", cid, "eth0")) == {"same": addresses.pop()}
        assert len(holdings) == 1, holdings  # the earlier rounds' are deleted below
        _assert_store_sound(sqlite_url)
        # Free it again so the next round also races over a queued (cooled) address.
        (done,) = _run_plugins(plugin, [(_env(plugin, "DEL", cid), data)])
        assert done.rc == 0, done


def test_concurrent_requested_address(plugin: Path, sqlite_url: str, tmp_path: Path) -> None:
    """8 plugins request one static address (CNI_ARGS IP=) for 8 attachments: exactly one
    gets it, the others are told 101 (address taken). Rounds: an unclaimed block of a pool
    never used, an address still cooling in the free queue, one ahead of a block cursor."""
    config = _config("req", sqlite_url, "10.50.0.0/24", "10.50.0.1", None)
    data = json.dumps(config).encode()
    _create_store(plugin, data)

    def race(rnd: int, ip: str) -> None:
        calls = [(_env(plugin, "ADD", f"req-{rnd}-{i}", f"IP={ip}"), data) for i in range(8)]
        outcomes = _run_gated(plugin, calls, tmp_path)
        winners = [i for i, o in enumerate(outcomes) if o.rc == 0]
        assert len(winners) == 1, outcomes
        assert outcomes[winners[0]].address == ip, outcomes
        losers = [o for i, o in enumerate(outcomes) if i != winners[0]]
        assert all(o.rc != 0 and o.code == 101 for o in losers), losers
        holdings, problems = _holdings(sqlite_url)
        assert not problems, problems
        owners = [key for key, held in holdings.items() if held.get("req") == ip]
        assert owners == [keys.attach_key(NODE, "req", f"req-{rnd}-{winners[0]}", "eth0")], holdings
        for i in range(8):
            if i != winners[0]:
                assert keys.attach_key(NODE, "req", f"req-{rnd}-{i}", "eth0") not in holdings
        _assert_store_sound(sqlite_url)

    race(0, "10.50.0.77")  # no block claimed yet
    # An address freed a moment ago (queued, cooling) is requested by 8 at once.
    (first,) = _run_plugins(plugin, [(_env(plugin, "ADD", "plain-1"), data)])
    assert first.rc == 0 and first.address, first
    (freed,) = _run_plugins(plugin, [(_env(plugin, "DEL", "plain-1"), data)])
    assert freed.rc == 0, freed
    assert f"free/req/{first.address}" in _dump(sqlite_url, ("free/",))
    race(1, first.address)
    assert f"free/req/{first.address}" not in _dump(sqlite_url, ("free/",))
    # An address inside the block being filled, ahead of its cursor.
    race(2, "10.50.0.20")
    # The cursor must now step over it: plain ADDs never hand it out again.
    plain = _run_plugins(
        plugin, [(_env(plugin, "ADD", f"plain-{i}"), data) for i in range(2, 30)], parallel=4
    )
    assert all(o.rc == 0 for o in plain), plain
    handed = [o.address for o in plain]
    assert len(set(handed)) == len(handed)
    assert not {"10.50.0.77", "10.50.0.20", first.address} & set(handed), handed
    _assert_store_sound(sqlite_url)
