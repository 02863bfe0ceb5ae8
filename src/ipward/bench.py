"""`ipward bench`: measure and print how fast ipward is, each figure next to a reference
measured on the same machine in the same run. Not a test: nothing here passes or fails on
speed; targets are printed next to the figures for the reader.

1. Throughput, in-process and sequential: Ledger allocate+release pairs per second next to
   the raw store's own single-key compare-and-swap (get, then txn comparing mod_revision,
   put) on the same backend: SQLite (a temp file) and a temporary etcd on loopback.
2. Plugin exec latency: the installed `ipward` plugin's ADD (single-node mode, SQLite)
   next to `/usr/bin/python3 -I -S -c pass` and Debian's host-local ADD, interleaved.
3. Allocate latency in the ledger as a pool fills: an empty /24 next to a /16 that is 90%
   full, an IPv6 /64 and a 10.0.0.0/8 with 10,000 addresses in use.

`ipward bench --cluster` instead (`run_cluster`): N real `ipward agent` processes on one
temporary etcd, C client threads per agent looping ADD then DEL through the plugin's own
socket call, next to raw etcd CAS by as many threads in the same run (the two loads take
turns in rounds); then plugin exec ADD through an agent next to the bare interpreter and
host-local.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import click

import ipward
from ipward import records as rec
from ipward.ledger import Ledger
from ipward.pool import PoolSpec
from ipward.records import Attachment, PodInfo
from ipward.store.base import Put, Store, StoreError, absent, at_revision
from ipward.store.sqlite import SqliteStore

ETCD = "/usr/bin/etcd"
PLUGIN_PYTHON = "/usr/bin/python3"
HOST_LOCAL = "/usr/lib/cni/host-local"
CNI_BIN_DIR = "/usr/lib/cni"
NODE = "bench-node"
CAS_KEY = "bench/cas"

# Targets, printed next to the figures (never asserted).
TARGET_LEDGER_VS_CAS = 0.5  # ledger pairs/s >= 0.5 x raw CAS/s
TARGET_EXEC_OVER_PYTHON_MS = 10.0  # plugin ADD median - bare interpreter median
TARGET_IN_USE_VS_EMPTY = 1.3  # 10,000 in use: median within 1.3 x the empty /24's


class BenchError(Exception):
    """Something the bench needs did not work (not a slow result: those are figures)."""


# -- statistics ---------------------------------------------------------------------------


def p99(samples: Sequence[float]) -> float:
    """99th percentile, nearest rank: the smallest sample with >= 99% of samples at or
    below it (the maximum for fewer than 100 samples)."""
    if not samples:
        raise ValueError("p99 of no samples")
    ordered = sorted(samples)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def percentile(samples: Sequence[float], q: int) -> float:
    """q-th percentile (0 < q <= 100), nearest rank, as p99."""
    if not samples or not 0 < q <= 100:
        raise ValueError(f"percentile {q} of {len(samples)} samples")
    ordered = sorted(samples)
    return ordered[max(-(-q * len(ordered) // 100) - 1, 0)]


def _summary(samples_s: Sequence[float]) -> tuple[float, float]:
    """(median, p99) in milliseconds of samples in seconds."""
    return statistics.median(samples_s) * 1000, p99(samples_s) * 1000


# -- 1. throughput ------------------------------------------------------------------------


def _cas_loop(store: Store, n: int, key: str = CAS_KEY) -> float:
    """n single-key CAS transactions; returns the seconds they took."""
    get, txn = store.get, store.txn
    start = time.perf_counter()
    for i in range(n):
        kv = get(key)
        result = txn([at_revision(key, kv.mod_revision if kv else 0)], [Put(key, b"%d" % i)])
        if not result.succeeded:
            raise BenchError(f"CAS on {key} failed: something else writes the bench key")
    return time.perf_counter() - start


def raw_cas_rate(store: Store, n: int, warmup: int = 20) -> float:
    """The store's own single-key CAS transactions per second (get + txn comparing the
    key's mod_revision + put), sequential."""
    _cas_loop(store, warmup)
    return n / _cas_loop(store, n)


def _pair_pool() -> PoolSpec:
    return PoolSpec("benchpairs", [[{"subnet": "10.99.0.0/16", "gateway": "10.99.0.1"}]])


class _Pairs:
    """allocate+release pairs through a Ledger, each with a new attachment."""

    def __init__(self, store: Store) -> None:
        self.ledger = Ledger(store, NODE)
        self.spec = _pair_pool()
        self.count = 0

    def loop(self, n: int) -> tuple[float, float]:
        """Seconds for `n` pairs, and the part of it spent in allocate."""
        allocate, release, pools = self.ledger.allocate, self.ledger.release, [self.spec]
        pod = PodInfo("bench", "pair", "uid-pair")
        clock = time.perf_counter
        allocating = 0.0
        start = clock()
        for _ in range(n):
            attachment = Attachment("benchpairs", f"pair-{self.count}", "eth0")
            self.count += 1
            before = clock()
            allocate(pools, attachment, pod)
            allocating += clock() - before
            if not release(attachment):
                raise BenchError(f"release of {attachment} freed nothing")
        return clock() - start, allocating


def ledger_pair_rate(store: Store, n: int, warmup: int = 20) -> float:
    """Ledger allocate+release pairs per second, sequential, on `store`."""
    pairs = _Pairs(store)
    pairs.loop(warmup)
    return n / pairs.loop(n)[0]


def throughput(store: Store, n: int, chunks: int = 4, warmup: int = 20) -> dict[str, float]:
    """Raw CAS rate and ledger pair rate on one store, measured in alternating chunks so
    that drift in the machine's speed falls on both alike."""
    pairs = _Pairs(store)
    _cas_loop(store, warmup)
    pairs.loop(warmup)
    per_chunk = max(n // chunks, 1)
    cas_s = pair_s = alloc_s = 0.0
    for _ in range(chunks):
        cas_s += _cas_loop(store, per_chunk)
        whole, allocating = pairs.loop(per_chunk)
        pair_s += whole
        alloc_s += allocating
    total = per_chunk * chunks
    return {
        "raw_cas_per_s": total / cas_s,
        "ledger_pairs_per_s": total / pair_s,
        "ledger_allocations_per_s": total / alloc_s,
        "n": total,
    }


# -- a temporary etcd ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _etcd(root: Path, timeout: float = 30.0) -> Iterator[str]:
    """A one-member etcd on free loopback ports with its data in `root`; yields its
    etcd:// URL and stops it on exit. etcd's defaults otherwise (fsync on)."""
    client = f"http://127.0.0.1:{_free_port()}"
    peer = f"http://127.0.0.1:{_free_port()}"
    log_path = root / "etcd.log"
    args = [
        ETCD,
        "--name=bench",
        f"--data-dir={root / 'data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=bench={peer}",
        f"--initial-cluster-token=ipward-bench-{uuid.uuid4().hex}",
        "--initial-cluster-state=new",
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        deadline = time.monotonic() + timeout
        while not _etcd_healthy(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                raise BenchError(f"etcd did not become healthy (exit {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        yield "etcd://" + client.removeprefix("http://")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _etcd_healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(client_url + "/health", timeout=1) as r:
            return bool(json.load(r).get("health") == "true")
    except (OSError, ValueError):
        return False


# -- 2. plugin exec -----------------------------------------------------------------------


def _install_plugin(bin_dir: Path) -> str:
    """Put the plugin at bin_dir/ipward: with `ipward install-cni` when the CLI has it,
    else the same launcher written here. Returns how it was installed."""
    target = bin_dir / "ipward"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ipward.cli import main; sys.argv[0] = 'ipward'; main()",
                "install-cni",
                "--bin-dir",
                str(bin_dir),
            ],
            capture_output=True,
            timeout=60,
        )
        if done.returncode == 0 and os.access(target, os.X_OK):
            return "ipward install-cni"
    except (OSError, subprocess.TimeoutExpired):
        pass
    write_launcher(target)
    return "bench launcher (ipward install-cni not available)"


def write_launcher(target: Path) -> None:
    """The plugin launcher `ipward install-cni` writes: the system interpreter with -I -S
    (one shebang word: Linux passes everything after the interpreter as one argument),
    then the package's own directory on sys.path."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(ipward.__file__)))
    target.write_text(
        f"#!{PLUGIN_PYTHON} -IS\nimport sys\nsys.path.insert(0, {src!r})\n"
        "from ipward.cni import main\nmain()\n"
    )
    target.chmod(0o755)


def _ipam_config(ipam: dict) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "benchnet", "ipam": ipam}).encode()


class _Exec:
    """Runs one executable with a CNI environment and stdin, timing each exec."""

    def __init__(self, argv: list[str], stdin: bytes, cni_path: str) -> None:
        self.argv = argv
        self.stdin = stdin
        self.base_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/x",
            "CNI_PATH": cni_path,
        }

    def run(self, command: str, container: str) -> float:
        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        done = subprocess.run(self.argv, input=self.stdin, env=env, capture_output=True)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            raise BenchError(
                f"{' '.join(self.argv)} {command} {container} exited {done.returncode}:"
                f" {done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
            )
        return elapsed


def _exec_kinds(tmp: Path, ipward_cfg: bytes) -> tuple[str, dict[str, _Exec]]:
    """Install the plugin in tmp/bin; the bare interpreter, the plugin with `ipward_cfg`
    and host-local (when installed), in that order, and how the plugin was installed."""
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin's interpreter")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    installed = _install_plugin(bin_dir)
    cni_path = f"{bin_dir}:{CNI_BIN_DIR}"
    host_local_cfg = _ipam_config(
        {
            "type": "host-local",
            "dataDir": str(tmp / "host-local"),
            "ranges": [[{"subnet": "10.20.0.0/16"}]],
        }
    )
    kinds: dict[str, _Exec] = {
        "python": _Exec([PLUGIN_PYTHON, "-I", "-S", "-c", "pass"], b"", cni_path),
        "ipward": _Exec([str(bin_dir / "ipward")], ipward_cfg, cni_path),
    }
    if os.access(HOST_LOCAL, os.X_OK):
        kinds["host_local"] = _Exec([HOST_LOCAL], host_local_cfg, cni_path)
    return installed, kinds


def exec_latency(tmp: Path, runs: int, warmup: int = 5) -> dict[str, float | str]:
    """ADD exec latency of the installed plugin, of a bare interpreter and of host-local,
    interleaved run by run; DEL of every ADD afterwards (not timed)."""
    ipward_cfg = _ipam_config(
        {
            "type": "ipward",
            "store": f"sqlite://{tmp}/b.db",
            "ranges": [[{"subnet": "10.10.0.0/16"}]],
        }
    )
    installed, kinds = _exec_kinds(tmp, ipward_cfg)
    out: dict[str, float | str] = {"installed": installed}
    out.update(_interleaved_adds(kinds, runs, warmup))
    return out


def _interleaved_adds(kinds: dict[str, _Exec], runs: int, warmup: int) -> dict[str, float]:
    """ADD of every kind, interleaved run by run; then DEL of every ADD of the kinds that
    allocate (not timed). {kind.median_ms, kind.p99_ms} for each kind."""
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    added: list[str] = []
    for i in range(-warmup, runs):
        container = f"bench-{'warm' if i < 0 else 'run'}-{abs(i)}"
        for kind, ex in kinds.items():
            elapsed = ex.run("ADD", container)
            if i >= 0:
                samples[kind].append(elapsed)
        added.append(container)
    for container in added:
        for kind in ("ipward", "host_local"):
            if kind in kinds:
                kinds[kind].run("DEL", container)
    out: dict[str, float] = {}
    for kind, values in samples.items():
        out[f"{kind}.median_ms"], out[f"{kind}.p99_ms"] = _summary(values)
    return out


# -- 3. allocate latency as the pool fills ------------------------------------------------


class Scenario:
    __slots__ = ("fill", "label", "name", "subnet")

    def __init__(self, name: str, label: str, subnet: str, fill: int) -> None:
        self.name = name
        self.label = label
        self.subnet = subnet
        self.fill = fill


def _usable(prefix: int) -> int:
    return (1 << (32 - prefix)) - 2  # IPv4 without network and broadcast


def scenarios(quick: bool) -> list[Scenario]:
    full_prefix = 20 if quick else 16
    full = int(_usable(full_prefix) * 0.9)
    return [
        Scenario("empty_24", "empty /24", "10.1.0.0/24", 0),
        Scenario(
            f"full90_{full_prefix}",
            f"/{full_prefix}, 90% full ({full:,} in use)",
            f"10.2.0.0/{full_prefix}",
            full,
        ),
        Scenario("v6_64_10k", "IPv6 /64, 10,000 in use", "fd00:be::/64", 10_000),
        Scenario("v4_8_10k", "10.0.0.0/8, 10,000 in use", "10.0.0.0/8", 10_000),
    ]


def _scenario_pool(s: Scenario) -> PoolSpec:
    # Cooldown 0: from the second round on, every scenario reuses freed addresses the same
    # way, so the rounds exercise the fresh-address and the reuse path alike everywhere.
    return PoolSpec(f"bench-{s.name}", [[{"subnet": s.subnet}]], cooldown=0)


def _fill(path: str, spec: PoolSpec, count: int) -> None:
    """`count` allocations through the ledger. The fill is set-up, not measured: the
    file is written without fsync at each commit (synchronous=OFF) to save time."""
    store = SqliteStore(path)
    try:
        store._conn.execute("PRAGMA synchronous=OFF")
        ledger = Ledger(store, NODE)
        pod = PodInfo("bench", "fill", "uid-fill")
        for i in range(count):
            ledger.allocate([spec], Attachment("benchfill", f"fill-{i}", "eth0"), pod)
    finally:
        store.close()


def allocate_latency(
    pools: Sequence[tuple[str, PoolSpec]], rounds: int, per_round: int, warmup: int = 20
) -> list[list[float]]:
    """Seconds per ledger allocate (in-process) on each (SQLite path, pool): `rounds`
    rounds of `per_round` timed allocations, each round released afterwards (not timed).
    The pools take turns allocation by allocation, so drift in the machine's speed
    falls on all of them alike. Returns one list of samples per pool."""
    stores = [SqliteStore(path) for path, _ in pools]
    try:
        ledgers = [Ledger(store, NODE) for store in stores]
        specs = [[spec] for _, spec in pools]
        pod = PodInfo("bench", "lat", "uid-lat")
        for ledger, (_, spec) in zip(ledgers, pools, strict=True):
            for i in range(warmup):
                attachment = Attachment("benchlat", f"warm-{i}", "eth0")
                ledger.allocate([spec], attachment, pod)
                ledger.release(attachment)
        samples: list[list[float]] = [[] for _ in pools]
        clock = time.perf_counter
        for r in range(rounds):
            attachments = [Attachment("benchlat", f"r{r}-{i}", "eth0") for i in range(per_round)]
            for attachment in attachments:
                for ledger, spec_list, out in zip(ledgers, specs, samples, strict=True):
                    start = clock()
                    ledger.allocate(spec_list, attachment, pod)
                    out.append(clock() - start)
            for ledger in ledgers:
                for attachment in attachments:
                    ledger.release(attachment)
        return samples
    finally:
        for store in stores:
            store.close()


# -- the run ------------------------------------------------------------------------------


def _version_of(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "missing"
    if done.returncode != 0:
        return "missing"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "?"


def machine() -> dict[str, str | int]:
    etcd = _version_of([ETCD, "--version"]).removeprefix("etcd Version: ")
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count() or 0,
        "platform": platform.platform(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "plugin_python": _version_of(
            [PLUGIN_PYTHON, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"]
        )
        + f" ({PLUGIN_PYTHON} -I -S)",
        "sqlite": sqlite3.sqlite_version,
        "etcd": etcd,
    }


def _table(rows: list[list[str]], out: Callable[[str], object], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            # First column left-aligned, figures right-aligned.
            cells.append(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]))
        out((indent + "  ".join(cells)).rstrip())


def _verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def run(quick: bool = False, etcd: bool = True, out: Callable[[str], object] = print) -> dict:
    """Measure everything, print a report with `out`, and return the figures:
    {"machine": {...}, "figures": {name: number}, "targets": {name: {...}},
     "skipped": {part: reason}, "notes": {...}}."""
    began = time.perf_counter()
    figures: dict[str, float] = {}
    targets: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    info = machine()
    out(f"ipward bench{' --quick' if quick else ''}: {info['nproc']} CPUs ({info['platform']})")
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )

    with tempfile.TemporaryDirectory(prefix="ipward-bench-") as tmp_name:
        tmp = Path(tmp_name)

        # 1. throughput -------------------------------------------------------------
        rows = [
            [
                "1. sequential, in-process",
                "raw CAS/s",
                "allocs/s",
                "vs CAS",
                "pairs/s",
                "vs CAS",
                "target (allocs)",
            ]
        ]
        backends: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Store]]]] = []
        n_sqlite = 600 if quick else 3000
        n_etcd = 100 if quick else 500
        backends.append(("sqlite", lambda: SqliteStore(str(tmp / "throughput.db"))))
        if not etcd:
            skipped["etcd"] = "--no-etcd"
        elif not os.access(ETCD, os.X_OK):
            skipped["etcd"] = f"{ETCD} is missing (Debian package etcd-server)"
        else:
            backends.append(("etcd", lambda: _etcd_store(tmp / "etcd")))
        for name, opener in backends:
            n = n_sqlite if name == "sqlite" else n_etcd
            out(f"  ... {name}: {n} raw CAS and {n} allocate+release pairs, interleaved")
            try:
                with opener() as store:
                    t = throughput(store, n)
            except (BenchError, StoreError) as e:
                if name == "sqlite":
                    raise
                skipped[name] = f"failed: {e}"
                out(f"  ... {name} skipped: {e}")
                continue
            ratio = t["ledger_allocations_per_s"] / t["raw_cas_per_s"]
            pair_ratio = t["ledger_pairs_per_s"] / t["raw_cas_per_s"]
            figures[f"{name}.raw_cas_per_s"] = t["raw_cas_per_s"]
            figures[f"{name}.ledger_allocations_per_s"] = t["ledger_allocations_per_s"]
            figures[f"{name}.ledger_pairs_per_s"] = t["ledger_pairs_per_s"]
            figures[f"{name}.ledger_vs_cas"] = ratio
            figures[f"{name}.pairs_vs_cas"] = pair_ratio
            ok = ratio >= TARGET_LEDGER_VS_CAS
            targets[f"{name}.ledger_vs_cas"] = {
                "value": ratio,
                "target": f">= {TARGET_LEDGER_VS_CAS}",
                "met": ok,
            }
            rows.append(
                [
                    f"{name} (n={t['n']:.0f})",
                    f"{t['raw_cas_per_s']:.0f}",
                    f"{t['ledger_allocations_per_s']:.0f}",
                    f"{ratio:.2f}x",
                    f"{t['ledger_pairs_per_s']:.0f}",
                    f"{pair_ratio:.2f}x",
                    f">= {TARGET_LEDGER_VS_CAS}x {_verdict(ok)}",
                ]
            )
        if "etcd" in skipped:
            rows.append(["etcd", "skipped:", skipped["etcd"].splitlines()[0][:60], "", "", "", ""])

        # 2. plugin exec ------------------------------------------------------------
        runs = 40 if quick else 200
        out(f"  ... plugin exec: {runs} ADDs each of python, ipward and host-local, interleaved")
        exec_dir = tmp / "exec"
        exec_dir.mkdir()
        ex = exec_latency(exec_dir, runs)
        notes["plugin_installed_by"] = str(ex.pop("installed"))
        for key, value in ex.items():
            figures[f"exec.{key}"] = float(value)
        diff = figures["exec.ipward.median_ms"] - figures["exec.python.median_ms"]
        figures["exec.ipward_minus_python_ms"] = diff
        ok = diff <= TARGET_EXEC_OVER_PYTHON_MS
        targets["exec.ipward_minus_python_ms"] = {
            "value": diff,
            "target": f"<= {TARGET_EXEC_OVER_PYTHON_MS} ms",
            "met": ok,
        }
        exec_rows = [[f"2. exec latency ({runs} runs)", "median ms", "p99 ms", "", ""]]
        labels = {
            "python": f"{PLUGIN_PYTHON} -I -S -c pass",
            "host_local": "host-local ADD",
            "ipward": "ipward ADD (single-node, SQLite)",
        }
        for kind, label in labels.items():
            if f"exec.{kind}.median_ms" in figures:
                exec_rows.append(
                    [
                        label,
                        f"{figures[f'exec.{kind}.median_ms']:.2f}",
                        f"{figures[f'exec.{kind}.p99_ms']:.2f}",
                        "",
                        "",
                    ]
                )
            else:
                skipped[f"exec.{kind}"] = f"{HOST_LOCAL} is missing"
                exec_rows.append([label, "skipped", "", "", ""])
        exec_rows.append(
            [
                "ipward - python (median)",
                f"{diff:+.2f}",
                "",
                "",
                f"<= {TARGET_EXEC_OVER_PYTHON_MS:.0f} ms {_verdict(ok)}",
            ]
        )

        # 3. allocate latency as the pool fills -------------------------------------
        rounds, per_round = (2, 50) if quick else (5, 100)
        lat_rows = [
            [
                f"3. ledger allocate, SQLite ({rounds * per_round} allocs)",
                "median ms",
                "p99 ms",
                "vs empty",
                "target",
            ]
        ]
        todo = scenarios(quick)
        pools = []
        for s in todo:
            spec = _scenario_pool(s)
            path = str(tmp / f"latency-{s.name}.db")
            if s.fill:
                out(f"  ... filling {s.label} through the ledger")
                _fill(path, spec, s.fill)
            pools.append((path, spec))
        out(f"  ... {rounds * per_round} timed allocations in each pool, taking turns")
        all_samples = allocate_latency(pools, rounds, per_round)
        empty_median = 0.0
        for s, samples in zip(todo, all_samples, strict=True):
            median, tail = _summary(samples)
            figures[f"latency.{s.name}.median_ms"] = median
            figures[f"latency.{s.name}.p99_ms"] = tail
            if not s.fill:
                empty_median = median
                lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", "1.00x", ""])
                continue
            ratio = median / empty_median
            figures[f"latency.{s.name}.vs_empty"] = ratio
            target = ""
            if s.fill == 10_000:
                ok = ratio <= TARGET_IN_USE_VS_EMPTY
                targets[f"latency.{s.name}.vs_empty"] = {
                    "value": ratio,
                    "target": f"<= {TARGET_IN_USE_VS_EMPTY}",
                    "met": ok,
                }
                target = f"<= {TARGET_IN_USE_VS_EMPTY}x {_verdict(ok)}"
            lat_rows.append([s.label, f"{median:.3f}", f"{tail:.3f}", f"{ratio:.2f}x", target])

    elapsed = time.perf_counter() - began
    out("")
    _table(rows, out)
    out("")
    _table(exec_rows, out)
    out("")
    _table(lat_rows, out)
    out("")
    out(f"  plugin installed by: {notes['plugin_installed_by']}")
    out("  1: allocs/s times the allocate calls of the pairs loop; a pair is one allocate and")
    out("     one release, each its own durable transaction, so pairs/s is bounded by half the")
    out("     CAS rate; raw CAS is get + txn(compare mod_revision, put) on one key; same run.")
    out("  3: pools with cooldown 0; rounds of allocations, each round released (untimed)")
    out("     before the next, so later rounds reuse freed addresses in every pool alike.")
    out(f"  whole run: {elapsed:.1f} s")
    notes["elapsed_s"] = f"{elapsed:.1f}"
    return {
        "machine": info,
        "figures": figures,
        "targets": targets,
        "skipped": skipped,
        "notes": notes,
    }


@contextlib.contextmanager
def _etcd_store(root: Path) -> Iterator[Store]:
    from ipward.store.etcd import EtcdStore  # grpc: only when etcd is measured

    root.mkdir()
    with _etcd(root) as url:
        store = EtcdStore.from_url(url)
        try:
            yield store
        finally:
            store.close()


# -- the cluster: agents on one etcd -------------------------------------------------------

CLUSTER_POOL = "benchcluster"
CLUSTER_SUBNET = "10.64.0.0/14"
CLUSTER_BLOCK_V4 = 26
AGENT_READY_TIMEOUT = 30.0
AGENT_STOP_TIMEOUT = 10.0
AGENT_MAX_WORKERS = 16  # the agent's default --max-workers, which the bench leaves as is
TARGET_CLUSTER_VS_CAS = 0.5  # aggregate ADDs/s >= 0.5 x raw CAS/s at the same concurrency
TARGET_AGENT_EXEC_OVER_PYTHON_MS = 5.0  # plugin ADD (through the agent) - bare interpreter


class _AgentProcess:
    """One real `ipward agent` process of the bench's cluster, its log in a file."""

    def __init__(self, root: Path, index: int, store_url: str) -> None:
        self.node = f"bench-node-{index}"
        self.socket = str(root / "sockets" / f"agent-{index}.sock")
        self.log_path = root / f"agent-{index}.log"
        self.stderr_path = root / f"agent-{index}.stderr"
        args = [
            sys.executable,
            "-m",
            "ipward.cli",
            "agent",
            "--node",
            self.node,
            "--store",
            store_url,
            "--socket",
            self.socket,
            "--metrics-address",
            "off",
            "--log-file",
            str(self.log_path),
        ]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )

    def wait_ready(self, deadline: float) -> None:
        """Until a VERSION call through its socket is answered."""
        from ipward.plugin import forward
        from ipward.wire import WireError

        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"agent {self.node} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                status, _ = forward(self.socket, {"CNI_COMMAND": "VERSION"}, b"{}", timeout=5.0)
                if status == 0:
                    return
            except (OSError, WireError):
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"agent {self.node} did not answer in time:\n{self.tail()}")
            time.sleep(0.02)

    def tail(self, lines: int = 15) -> str:
        text = ""
        for path in (self.stderr_path, self.log_path):
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (the agent drains and exits), then SIGKILL if it does not."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(AGENT_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _cluster_pool() -> PoolSpec:
    return PoolSpec(
        CLUSTER_POOL,
        [[{"subnet": CLUSTER_SUBNET}]],
        cooldown=0,
        block_prefix={4: CLUSTER_BLOCK_V4},
    )


def _create_pool(store: Store, spec: PoolSpec) -> None:
    key = rec.pool_key(spec.name)
    if not store.txn([absent(key)], [Put(key, rec.encode(spec.to_dict()))]).succeeded:
        raise BenchError(f"pool {spec.name} already exists in the bench's own etcd")


class _Client:
    """One client thread of the cluster load: ADD then DEL of a new attachment, again and
    again, through `forward()` to its agent (what the plugin executable does)."""

    def __init__(self, index: int, socket_path: str) -> None:
        self.index = index
        self.socket = socket_path
        self.stdin = _ipam_config(
            {"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL}
        )
        self.base_env = {
            "CNI_IFNAME": "eth0",
            "CNI_NETNS": "/var/run/netns/bench",
            "CNI_PATH": CNI_BIN_DIR,
        }
        self.seq = 0
        self.adds = 0  # successful ADDs measured
        self.dels = 0
        self.add_s: list[float] = []
        self.del_s: list[float] = []
        self.allocs = 0  # successful ADDs of the ADD-only phases
        self.alloc_s: list[float] = []
        self.held: list[str] = []
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}

    def call(self, command: str, container: str) -> tuple[bool, float]:
        from ipward.plugin import forward

        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        try:
            status, out = forward(self.socket, env, self.stdin)
        except Exception as e:  # what the plugin answers then: 11, try again later
            status, out = 1, json.dumps({"code": 11, "msg": f"{type(e).__name__}: {e}"}).encode()
        elapsed = time.perf_counter() - start
        if status != 0:
            try:
                code = str(json.loads(out).get("code"))
            except (ValueError, AttributeError):
                code = "?"
            key = f"{command} code {code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            self.examples.setdefault(key, out.decode(errors="replace").strip()[:300])
        return status == 0, elapsed

    def loop(self, pairs: int | None, seconds: float | None, measured: bool) -> None:
        """ADD+DEL pairs until `pairs` are done or `seconds` have passed."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (pairs is None or done < pairs) and clock() < deadline:
            container = f"c{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            deleted, del_s = self.call("DEL", container)  # also after a failed ADD, as a runtime
            done += 1
            if measured:
                self.add_s.append(add_s)
                self.del_s.append(del_s)
                self.adds += added
                self.dels += deleted

    def allocate_only(self, ops: int | None, seconds: float | None) -> None:
        """ADDs of new attachments only, kept (the allocation rate): `ops` of them, or
        for `seconds`."""
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (ops is None or done < ops) and clock() < deadline:
            container = f"k{self.index}-{self.seq}"
            self.seq += 1
            added, add_s = self.call("ADD", container)
            done += 1
            self.alloc_s.append(add_s)
            if added:
                self.allocs += 1
                self.held.append(container)

    def release_held(self) -> None:
        """DEL what allocate_only kept (not measured)."""
        while self.held:
            self.call("DEL", self.held.pop())


class _CasClient:
    """One thread of the reference: get + txn(compare mod_revision, put) on a key of its
    own, through a store client it shares with the other threads of its group."""

    def __init__(self, store: Store, key: str) -> None:
        self.store = store
        self.key = key
        self.count = 0
        self.cas_s: list[float] = []

    def loop(self, n: int | None, seconds: float | None, measured: bool) -> None:
        get, txn, key = self.store.get, self.store.txn, self.key
        clock = time.perf_counter
        deadline = clock() + seconds if seconds is not None else math.inf
        done = 0
        while (n is None or done < n) and clock() < deadline:
            start = clock()
            kv = get(key)
            result = txn([at_revision(key, kv.mod_revision if kv else 0)], [Put(key, b"%d" % done)])
            elapsed = clock() - start
            if not result.succeeded:
                raise BenchError(f"CAS on {key} failed: something else writes the bench key")
            done += 1
            if measured:
                self.cas_s.append(elapsed)
                self.count += 1


def _parallel(work: Sequence[Callable[[], None]]) -> float:
    """Run each callable in a thread of its own, all released at once; returns the
    seconds from the release to the end of the last one. Re-raises the first failure."""
    barrier = threading.Barrier(len(work) + 1)
    failures: list[BaseException] = []

    def target(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as e:  # handed to the caller after every thread has ended
            failures.append(e)

    threads = [threading.Thread(target=target, args=(fn,), daemon=True) for fn in work]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return elapsed


def _etcd_counters(client_url: str) -> dict[str, float] | None:
    """etcd's own counts (from its /metrics): Txn and Range calls served, WAL fsyncs;
    None when they cannot be read (the figures are diagnostics, not the measurement)."""
    counts = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
    try:
        with urllib.request.urlopen(client_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                if 'grpc_method="Txn"' in line:
                    counts["txn"] += float(line.rsplit(" ", 1)[1])
                elif 'grpc_method="Range"' in line:
                    counts["range"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_disk_wal_fsync_duration_seconds_count "):
                counts["fsync"] = float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return counts


class _Counted:
    """etcd's counts summed over the phases of one kind."""

    def __init__(self, client_url: str) -> None:
        self.client_url = client_url
        self.sums: dict[str, float] | None = {"txn": 0.0, "range": 0.0, "fsync": 0.0}
        self.seconds = 0.0

    def measure(self, phase: Callable[[], float]) -> float:
        before = _etcd_counters(self.client_url)
        elapsed = phase()
        after = _etcd_counters(self.client_url)
        self.seconds += elapsed
        if before is None or after is None or self.sums is None:
            self.sums = None
        else:
            for k in self.sums:
                self.sums[k] += after[k] - before[k]
        return elapsed


def agent_exec_latency(tmp: Path, socket_path: str, runs: int, warmup: int = 5) -> dict:
    """ADD exec latency of the installed plugin forwarding to the agent at `socket_path`
    (`agentSocket` in its config), of a bare interpreter and of host-local, interleaved
    run by run; DEL of every ADD afterwards (not timed)."""
    ipward_cfg = _ipam_config({"type": "ipward", "agentSocket": socket_path, "pool": CLUSTER_POOL})
    installed, kinds = _exec_kinds(tmp, ipward_cfg)
    out: dict[str, float | str] = {"installed": installed}
    out.update(_interleaved_adds(kinds, runs, warmup))
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ms(samples: Sequence[float], q: int) -> float:
    return percentile(samples, q) * 1000


def run_cluster(
    agents: int = 3,
    concurrency: int = 8,
    duration: float | None = None,
    quick: bool = False,
    out: Callable[[str], object] = print,
    operations: int | None = None,
    chunks: int | None = None,
) -> dict:
    """`agents` real agent processes on one temporary etcd, `concurrency` client threads
    per agent looping ADD then DEL through `forward()`, next to raw etcd CAS by as many
    threads (one store client per `concurrency` threads, like the agents), the two loads
    taking turns in `chunks`; then plugin exec ADD through an agent next to a bare
    interpreter and host-local. Each load runs `duration` seconds in all (20, --quick 4)
    or, with `operations`, that many ADD+DEL pairs (and raw CAS) per thread in all.
    Prints a report with `out`; returns {"machine", "figures", "targets", "errors",
    "notes"} like `run`."""
    if agents < 1 or concurrency < 1:
        raise BenchError("--agents and --concurrency must be at least 1")
    if not os.access(ETCD, os.X_OK):
        raise BenchError(f"{ETCD} is missing (Debian package etcd-server): --cluster needs it")
    from ipward.store.etcd import EtcdStore  # grpc: only when etcd is measured

    began = time.perf_counter()
    threads = agents * concurrency
    chunks = chunks or (2 if quick else 4)
    if duration is None:
        duration = 4.0 if quick else 20.0
    per_chunk_ops = None if operations is None else max(operations // chunks, 1)
    per_chunk_s = None if operations is not None else duration / chunks
    warm_pairs = 3 if quick else 10
    exec_runs = 40 if quick else 200
    figures: dict[str, float] = {}
    targets: dict[str, dict] = {}
    notes: dict[str, str] = {}
    info = machine()
    out(
        f"ipward bench --cluster{' --quick' if quick else ''}: {_plural(agents, 'agent')} x"
        f" {concurrency} concurrent ADDs on one etcd; {info['nproc']} CPUs ({info['platform']})"
    )
    out(
        f"  python {info['python']}; plugin {info['plugin_python']};"
        f" sqlite {info['sqlite']}; etcd {info['etcd']}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="ipward-bench-cluster-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        (tmp / "etcd").mkdir()
        url = stack.enter_context(_etcd(tmp / "etcd"))
        client_url = "http://" + url.removeprefix("etcd://")
        admin = EtcdStore.from_url(url)
        stack.callback(admin.close)
        spec = _cluster_pool()
        _create_pool(admin, spec)
        out(
            f"  ... etcd up; pool {spec.name} {CLUSTER_SUBNET} (/{CLUSTER_BLOCK_V4} blocks,"
            f" cooldown 0); starting {_plural(agents, 'agent')}"
        )
        procs: list[_AgentProcess] = []
        for i in range(agents):
            proc = _AgentProcess(tmp, i, url)
            stack.callback(proc.stop)  # stopped before etcd (the stack unwinds in reverse)
            procs.append(proc)
        deadline = time.monotonic() + AGENT_READY_TIMEOUT
        for proc in procs:
            proc.wait_ready(deadline)
        stores = []
        for _ in range(agents):
            store = EtcdStore.from_url(url)
            stack.callback(store.close)
            stores.append(store)
        clients = [_Client(i, procs[i // concurrency].socket) for i in range(threads)]
        cas = [_CasClient(stores[i // concurrency], f"bench/cas/{i}") for i in range(threads)]

        # 1. cluster allocation rate and the raw CAS rate, taking turns ----------------
        out(f"  ... warm-up: {warm_pairs} ADD+DEL pairs and {warm_pairs} raw CAS per thread")
        _parallel([partial(c.loop, warm_pairs, None, False) for c in clients])
        _parallel([partial(c.loop, warm_pairs, None, False) for c in cas])
        size = f"{per_chunk_ops} per thread" if per_chunk_ops else f"{per_chunk_s:.1f} s"
        out(
            f"  ... {chunks} rounds of {size} each: {threads} threads of ADD+DEL through the"
            f" agents, then of raw CAS, then of ADD only (deleted after, untimed)"
        )
        counted_cluster = _Counted(client_url)
        counted_cas = _Counted(client_url)
        counted_alloc = _Counted(client_url)
        cluster_load = [partial(c.loop, per_chunk_ops, per_chunk_s, True) for c in clients]
        cas_load = [partial(c.loop, per_chunk_ops, per_chunk_s, True) for c in cas]
        alloc_load = [partial(c.allocate_only, per_chunk_ops, per_chunk_s) for c in clients]
        for _ in range(chunks):
            counted_cluster.measure(partial(_parallel, cluster_load))
            counted_cas.measure(partial(_parallel, cas_load))
            counted_alloc.measure(partial(_parallel, alloc_load))
            _parallel([c.release_held for c in clients])
        adds = sum(c.adds for c in clients)
        dels = sum(c.dels for c in clients)
        pairs = sum(len(c.add_s) for c in clients)
        add_s = [x for c in clients for x in c.add_s]
        del_s = [x for c in clients for x in c.del_s]
        cas_s = [x for c in cas for x in c.cas_s]
        n_cas = sum(c.count for c in cas)
        if not adds or not n_cas:
            raise BenchError("no ADD succeeded: see the errors" if n_cas else "no CAS measured")
        errors: dict[str, int] = {}
        examples: dict[str, str] = {}
        for c in clients:
            for key, count in c.errors.items():
                errors[key] = errors.get(key, 0) + count
            for key, text in c.examples.items():
                examples.setdefault(key, text)
        cluster_s, cas_wall = counted_cluster.seconds, counted_cas.seconds
        figures["cluster.add_per_s"] = adds / cluster_s
        figures["cluster.del_per_s"] = dels / cluster_s
        figures["cluster.alloc_per_s"] = sum(c.allocs for c in clients) / counted_alloc.seconds
        figures["cluster.raw_cas_per_s"] = n_cas / cas_wall
        alloc_s = [x for c in clients for x in c.alloc_s]
        for name, samples in (("add", add_s), ("del", del_s), ("cas", cas_s), ("alloc", alloc_s)):
            for q in (50, 90, 99):
                figures[f"cluster.{name}_p{q}_ms"] = _ms(samples, q)
        # The target is on allocations per second: the ADD-only phases.
        ratio = figures["cluster.alloc_per_s"] / figures["cluster.raw_cas_per_s"]
        figures["cluster.vs_cas"] = ratio
        figures["cluster.pairs_vs_cas"] = (
            figures["cluster.add_per_s"] / figures["cluster.raw_cas_per_s"]
        )
        figures["cluster.pairs"] = float(pairs)
        figures["cluster.cas"] = float(n_cas)
        ok = ratio >= TARGET_CLUSTER_VS_CAS
        targets["cluster.vs_cas"] = {
            "value": ratio,
            "target": f">= {TARGET_CLUSTER_VS_CAS}",
            "met": ok,
        }
        if counted_cluster.sums is not None and counted_cas.sums is not None:
            sums = counted_cluster.sums
            figures["cluster.etcd_txn_per_pair"] = sums["txn"] / pairs
            figures["cluster.etcd_range_per_pair"] = sums["range"] / pairs
            figures["cluster.etcd_fsync_per_s"] = sums["fsync"] / cluster_s
            sums = counted_cas.sums
            figures["cluster.cas_etcd_txn_per_cas"] = sums["txn"] / n_cas
            figures["cluster.cas_etcd_fsync_per_s"] = sums["fsync"] / cas_wall

        # 2. plugin exec through an agent ---------------------------------------------
        out(
            f"  ... plugin exec: {exec_runs} ADDs each of python, ipward (through agent 0)"
            " and host-local, interleaved"
        )
        exec_dir = tmp / "exec"
        exec_dir.mkdir()
        ex = agent_exec_latency(exec_dir, procs[0].socket, exec_runs)
        notes["plugin_installed_by"] = str(ex.pop("installed"))
        for key, value in ex.items():
            figures[f"exec.{key}"] = float(value)
        diff = figures["exec.ipward.median_ms"] - figures["exec.python.median_ms"]
        figures["exec.ipward_minus_python_ms"] = diff
        exec_ok = diff <= TARGET_AGENT_EXEC_OVER_PYTHON_MS
        targets["exec.ipward_minus_python_ms"] = {
            "value": diff,
            "target": f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS} ms",
            "met": exec_ok,
        }
        out(f"  ... stopping {_plural(agents, 'agent')} and etcd")
    # (agents and etcd are stopped here, also when anything above failed)

    f = figures
    heading = f"1. {_plural(agents, 'agent')} x {concurrency}, one etcd ({threads} threads)"
    rows = [[heading, "per s", "p50 ms", "p90 ms", "p99 ms", "vs CAS", "target"]]
    rows.append(
        [
            f"raw etcd CAS, {_plural(agents, 'client')} x {concurrency} threads",
            f"{f['cluster.raw_cas_per_s']:.0f}",
            f"{f['cluster.cas_p50_ms']:.2f}",
            f"{f['cluster.cas_p90_ms']:.2f}",
            f"{f['cluster.cas_p99_ms']:.2f}",
            "1.00x",
            "",
        ]
    )
    rows.append(
        [
            "ADD only (allocations)",
            f"{f['cluster.alloc_per_s']:.0f}",
            f"{f['cluster.alloc_p50_ms']:.2f}",
            f"{f['cluster.alloc_p90_ms']:.2f}",
            f"{f['cluster.alloc_p99_ms']:.2f}",
            f"{ratio:.2f}x",
            f">= {TARGET_CLUSTER_VS_CAS}x {_verdict(ok)}",
        ]
    )
    rows.append(
        [
            "ADD in an ADD+DEL loop",
            f"{f['cluster.add_per_s']:.0f}",
            f"{f['cluster.add_p50_ms']:.2f}",
            f"{f['cluster.add_p90_ms']:.2f}",
            f"{f['cluster.add_p99_ms']:.2f}",
            f"{f['cluster.pairs_vs_cas']:.2f}x",
            "",
        ]
    )
    rows.append(
        [
            "DEL through the agents",
            f"{f['cluster.del_per_s']:.0f}",
            f"{f['cluster.del_p50_ms']:.2f}",
            f"{f['cluster.del_p90_ms']:.2f}",
            f"{f['cluster.del_p99_ms']:.2f}",
            "",
            "",
        ]
    )
    exec_rows = [[f"2. exec latency ({exec_runs} runs)", "median ms", "p99 ms", ""]]
    labels = {
        "python": f"{PLUGIN_PYTHON} -I -S -c pass",
        "host_local": "host-local ADD",
        "ipward": "ipward ADD (through the agent)",
    }
    for kind, label in labels.items():
        if f"exec.{kind}.median_ms" in f:
            exec_rows.append(
                [label, f"{f[f'exec.{kind}.median_ms']:.2f}", f"{f[f'exec.{kind}.p99_ms']:.2f}", ""]
            )
        else:
            exec_rows.append([label, "skipped", f"({HOST_LOCAL} is missing)", ""])
    exec_rows.append(
        [
            "ipward - python (median)",
            f"{diff:+.2f}",
            "",
            f"<= {TARGET_AGENT_EXEC_OVER_PYTHON_MS:.0f} ms {_verdict(exec_ok)}",
        ]
    )
    elapsed = time.perf_counter() - began
    out("")
    _table(rows, out)
    if errors:
        for key, count in sorted(errors.items()):
            out(f"  ERRORS: {key}: {count} (first: {examples[key]})")
    else:
        out(f"  errors: none in {sum(len(c.add_s) for c in clients)} measured ADD+DEL pairs")
    if "cluster.etcd_txn_per_pair" in f:
        out(
            f"  etcd served {f['cluster.etcd_txn_per_pair']:.2f} Txn and"
            f" {f['cluster.etcd_range_per_pair']:.2f} Range calls per ADD+DEL pair"
            f" (raw CAS: {f['cluster.cas_etcd_txn_per_cas']:.2f} Txn per CAS);"
            f" WAL fsyncs/s {f['cluster.etcd_fsync_per_s']:.0f}"
            f" (raw CAS: {f['cluster.cas_etcd_fsync_per_s']:.0f})"
        )
    out("")
    _table(exec_rows, out)
    out("")
    out(f"  plugin installed by: {notes['plugin_installed_by']}")
    out("  1: client threads call their agent through forward() (the plugin's own socket")
    out("     call); per s = successful calls over the wall time of the rounds. Each round:")
    out("     ADD+DEL loop, raw CAS (get + txn(compare mod_revision, put) on a key per thread),")
    out("     then ADD only (the allocation rate; what it allocated is deleted after, untimed).")
    if concurrency > AGENT_MAX_WORKERS:
        out(
            f"     An agent serves {AGENT_MAX_WORKERS} calls at a time (its default"
            " --max-workers); the other callers wait in its listen backlog."
        )
    out(f"  whole run: {elapsed:.1f} s")
    notes["elapsed_s"] = f"{elapsed:.1f}"
    notes["agents"] = str(agents)
    notes["concurrency"] = str(concurrency)
    return {
        "machine": info,
        "figures": figures,
        "targets": targets,
        "errors": errors,
        "notes": notes,
    }


@click.command("bench")
@click.option(
    "--quick", is_flag=True, help="Fewer runs, a /20 instead of a /16 (~10 s instead of ~30 s)."
)
@click.option("--no-etcd", "no_etcd", is_flag=True, help="Skip the etcd measurements.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the figures as JSON (the report goes to stderr)."
)
@click.option(
    "--cluster",
    is_flag=True,
    help="Instead: agents on one temporary etcd under concurrent ADD/DEL, next to raw etcd"
    " CAS at the same concurrency, and plugin exec through an agent.",
)
@click.option(
    "--agents",
    type=click.IntRange(1, 64),
    help="--cluster: agent processes (default 3).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    help="--cluster: concurrent ADD/DEL client threads per agent (default 8).",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.1),
    help="--cluster: seconds of each load in all (default 20, --quick 4).",
)
def bench_command(
    quick: bool,
    no_etcd: bool,
    as_json: bool,
    cluster: bool,
    agents: int | None,
    concurrency: int | None,
    duration: float | None,
) -> None:
    """Measure allocation throughput and latency against references from the same run."""

    def report(line: str) -> None:
        click.echo(line, err=as_json)

    if not cluster and (agents, concurrency, duration) != (None, None, None):
        raise click.UsageError("--agents, --concurrency and --duration go with --cluster")
    if cluster and no_etcd:
        raise click.UsageError("--cluster measures agents on etcd: it does not go with --no-etcd")
    try:
        if cluster:
            result = run_cluster(
                agents=3 if agents is None else agents,
                concurrency=8 if concurrency is None else concurrency,
                duration=duration,
                quick=quick,
                out=report,
            )
        else:
            result = run(quick=quick, etcd=not no_etcd, out=report)
    except BenchError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))


__all__ = [
    "BenchError",
    "agent_exec_latency",
    "allocate_latency",
    "bench_command",
    "exec_latency",
    "ledger_pair_rate",
    "p99",
    "percentile",
    "raw_cas_rate",
    "run",
    "run_cluster",
    "throughput",
    "write_launcher",
]
