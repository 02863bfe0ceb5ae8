"""Figure 2, plugin exec latency: the installed plugin's ADD (single-node on SQLite, or
through an agent: then also the native plugin's, `install-cni --standalone`) next to
`/usr/bin/python3 -I -S -c pass` and Debian's host-local ADD, interleaved run by run."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ipward.core.pool import PoolSpec
from ipward.core.startpath import PluginNotBuilt, native_plugin, write_executable, write_launcher
from ipward.ipam.pools import create_pool
from ipward.store import open_store
from ipward_lab.bench.common import (
    CNI_BIN_DIR,
    HOST_LOCAL,
    PLUGIN_PYTHON,
    BenchError,
    Results,
    summary,
    verdict,
)

TARGET_EXEC_OVER_PYTHON_MS = 5.0  # plugin ADD median - bare interpreter median
EXEC_POOL = "benchexec"
# The floor of any Python plugin on SQLite, the reference next to the plugin's own
# share: the bare interpreter importing `_sqlite3` (with the plugin's stand-in for
# `functools`, `core/startpath.py`), one fsynced WAL transaction of one read and one
# write, an answer on stdout. Nothing of ipward.
SQLITE_FLOOR = """\
import sys, _functools, posix
def lru_cache(maxsize):
    return lambda f: _functools._lru_cache_wrapper(f, maxsize, False, tuple)
stand_in = type(sys)("functools")
stand_in.lru_cache = lru_cache
sys.modules["functools"] = stand_in
import _sqlite3
del sys.modules["functools"]
db = _sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB) WITHOUT ROWID")
db.execute("BEGIN IMMEDIATE")
n = db.execute("SELECT count(*) FROM kv").fetchone()[0]
db.execute("INSERT INTO kv VALUES (?, ?)", (f"ips/{n}", b'{"container": "x"}'))
db.execute("COMMIT")
posix.write(1, b'{"cniVersion":"1.0.0","ips":[{"address":"10.30.0.2/16"}]}')
"""
REFERENCES = ("python", "sqlite_floor")  # exec'd for their time only: no DEL


class ExecError(BenchError):
    """An exec'd plugin answered with an error (a figure's loop may count it and go on)."""


def ipam_config(ipam: dict) -> bytes:
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
        if "IPWARD_CNI_NOTES" in os.environ:  # the plugin's notes where its caller keeps them
            self.base_env["IPWARD_CNI_NOTES"] = os.environ["IPWARD_CNI_NOTES"]

    def run(self, command: str, container: str) -> float:
        env = dict(self.base_env, CNI_COMMAND=command, CNI_CONTAINERID=container)
        start = time.perf_counter()
        done = subprocess.run(self.argv, input=self.stdin, env=env, capture_output=True)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            raise ExecError(
                f"{' '.join(self.argv)} {command} {container} exited {done.returncode}:"
                f" {done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
            )
        return elapsed


def exec_kinds(
    tmp: Path, ipward_cfgs: dict[str, bytes], references: bool = True
) -> dict[str, _Exec]:
    """Install the plugin in tmp/bin as `ipward install-cni` does; the bare interpreter,
    the plugin with each of `ipward_cfgs` (by kind) and host-local (when installed), in
    that order; without `references`, the plugin's kinds only."""
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin's interpreter")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    write_launcher(bin_dir / "ipward")
    cni_path = f"{bin_dir}:{CNI_BIN_DIR}"
    plugin = {
        kind: _Exec([str(bin_dir / "ipward")], cfg, cni_path) for kind, cfg in ipward_cfgs.items()
    }
    if not references:
        return plugin
    host_local_cfg = ipam_config(
        {
            "type": "host-local",
            "dataDir": str(tmp / "host-local"),
            "ranges": [[{"subnet": "10.20.0.0/16"}]],
        }
    )
    kinds = {"python": _Exec([PLUGIN_PYTHON, "-I", "-S", "-c", "pass"], b"", cni_path), **plugin}
    if os.access(HOST_LOCAL, os.X_OK):
        kinds["host_local"] = _Exec([HOST_LOCAL], host_local_cfg, cni_path)
    return kinds


def native_exec(tmp: Path, cfg: bytes) -> _Exec:
    """The native plugin installed in tmp/bin as `ipward install-cni --standalone` does,
    with `cfg` (it forwards every call to an agent). BenchError when it was not built."""
    try:
        data = native_plugin()
    except PluginNotBuilt as e:
        raise BenchError(str(e)) from None
    bin_dir = tmp / "bin"
    write_executable(bin_dir / "ipward-native", data)
    return _Exec([str(bin_dir / "ipward-native")], cfg, f"{bin_dir}:{CNI_BIN_DIR}")


def exec_latency(tmp: Path, runs: int, warmup: int = 5) -> dict[str, float]:
    """ADD exec latency of the installed plugin in single-node mode, with a named pool
    (`ipward_pool`: made beforehand in its SQLite store, as `ipward pool create` makes
    it) and with an inline host-local-style `ranges` (`ipward`: the drop-in case), of a
    bare interpreter and of host-local, interleaved run by run; DEL of every ADD
    afterwards (not timed)."""
    pool_db = str(tmp / "pool.db")
    store = open_store(f"sqlite://{pool_db}", create=True)
    try:
        create_pool(store, PoolSpec(EXEC_POOL, [[{"subnet": "10.11.0.0/16"}]]))
    finally:
        store.close()
    configs = {
        "ipward_pool": ipam_config(
            {"type": "ipward", "store": f"sqlite://{pool_db}", "pool": EXEC_POOL}
        ),
        "ipward": ipam_config(
            {
                "type": "ipward",
                "store": f"sqlite://{tmp}/b.db",
                "ranges": [[{"subnet": "10.10.0.0/16"}]],
            }
        ),
    }
    kinds = exec_kinds(tmp, configs)
    floor = [PLUGIN_PYTHON, "-I", "-S", "-c", SQLITE_FLOOR, str(tmp / "floor.db")]
    kinds = {"python": kinds.pop("python"), "sqlite_floor": _Exec(floor, b"", ""), **kinds}
    return interleaved_adds(kinds, runs, warmup)


def interleaved_adds(kinds: dict[str, _Exec], runs: int, warmup: int) -> dict[str, float]:
    """ADD of every kind, interleaved run by run, each of a new attachment (kinds that
    share an agent never ADD one twice); then DEL of every ADD of the kinds that
    allocate (not timed). {kind.median_ms, kind.p99_ms} for each kind."""
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    added: list[str] = []
    for i in range(-warmup, runs):
        run = f"{'warm' if i < 0 else 'run'}-{abs(i)}"
        for kind, ex in kinds.items():
            elapsed = ex.run("ADD", f"bench-{kind}-{run}")
            if i >= 0:
                samples[kind].append(elapsed)
        added.append(run)
    for run in added:
        for kind, ex in kinds.items():
            if kind not in REFERENCES:
                ex.run("DEL", f"bench-{kind}-{run}")
    out: dict[str, float] = {}
    for kind, values in samples.items():
        out[f"{kind}.median_ms"], out[f"{kind}.p99_ms"] = summary(values)
    return out


def exec_rates(
    kinds: dict[str, _Exec], concurrency: int, seconds: float, rounds: int
) -> dict[str, float]:
    """Execs per second of each kind with `concurrency` loops at once, each exec an ADD of
    a new attachment; the kinds take turns in `rounds`, `seconds` each in all; DEL of
    every ADD afterwards (not timed). {kind: per second}."""
    done: dict[str, int] = dict.fromkeys(kinds, 0)
    wall: dict[str, float] = dict.fromkeys(kinds, 0.0)
    added: dict[str, list[str]] = {kind: [] for kind in kinds}
    lock = threading.Lock()
    for r in range(rounds):
        for kind, ex in kinds.items():
            deadline = time.monotonic() + seconds / rounds

            def loop(
                i: int, kind: str = kind, ex: _Exec = ex, deadline: float = deadline, rnd: int = r
            ) -> None:
                n = 0
                while time.monotonic() < deadline:
                    container = f"rate-{rnd}-{i}-{n}"
                    ex.run("ADD", container)
                    n += 1
                    with lock:
                        done[kind] += 1
                        added[kind].append(container)

            began = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(loop, range(concurrency)))
            wall[kind] += time.perf_counter() - began
    for kind, ex in kinds.items():
        if kind != "python":
            for container in added[kind]:
                ex.run("DEL", container)
    return {kind: done[kind] / wall[kind] for kind in kinds}


def exec_section(tmp: Path, quick: bool, out: Callable[[str], object], r: Results) -> None:
    """Figure 2, single-node, into `r`: figures, targets (each plugin kind's median over
    the bare interpreter's), table."""
    runs = 40 if quick else 200
    out(
        f"  ... plugin exec: {runs} ADDs each of python, ipward (named pool, inline ranges)"
        " and host-local, interleaved"
    )
    exec_dir = tmp / "exec"
    exec_dir.mkdir()
    ex = exec_latency(exec_dir, runs)
    for key, value in ex.items():
        r.figures[f"exec.{key}"] = float(value)
    exec_rows = [
        [f"2. exec latency ({runs} runs)", "median ms", "p99 ms", "- python", "- floor", "target"]
    ]
    labels = {
        "python": f"{PLUGIN_PYTHON} -I -S -c pass",
        "sqlite_floor": "  floor: + _sqlite3, one fsynced transaction",
        "host_local": "host-local ADD",
        "ipward_pool": "ipward ADD, named pool (single-node, SQLite)",
        "ipward": "ipward ADD, inline ranges (single-node, SQLite)",
    }
    for kind, label in labels.items():
        if f"exec.{kind}.median_ms" not in r.figures:
            r.skipped[f"exec.{kind}"] = f"{HOST_LOCAL} is missing"
            exec_rows.append([label, "skipped", "", "", "", ""])
            continue
        row = [label, f"{r.figures[f'exec.{kind}.median_ms']:.2f}"]
        row.append(f"{r.figures[f'exec.{kind}.p99_ms']:.2f}")
        median = r.figures[f"exec.{kind}.median_ms"]
        if kind == "sqlite_floor":
            diff = median - r.figures["exec.python.median_ms"]
            r.figures["exec.sqlite_floor_minus_python_ms"] = diff
            row += [f"{diff:+.2f}", "", ""]
        elif kind.startswith("ipward"):
            diff = median - r.figures["exec.python.median_ms"]
            ok = diff <= TARGET_EXEC_OVER_PYTHON_MS
            r.figures[f"exec.{kind}_minus_python_ms"] = diff
            own = median - r.figures["exec.sqlite_floor.median_ms"]
            r.figures[f"exec.{kind}_minus_floor_ms"] = own
            r.targets[f"exec.{kind}_minus_python_ms"] = {
                "value": diff,
                "target": f"<= {TARGET_EXEC_OVER_PYTHON_MS} ms",
                "met": ok,
            }
            target = f"<= {TARGET_EXEC_OVER_PYTHON_MS:.0f} ms {verdict(ok)}"
            row += [f"{diff:+.2f}", f"{own:+.2f}", target]
        else:
            row += ["", "", ""]
        exec_rows.append(row)
    r.tables["exec"] = exec_rows
