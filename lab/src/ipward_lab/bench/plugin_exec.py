"""Figure 2, plugin exec latency: the installed plugin's ADD (single-node on SQLite, or
through an agent) next to `/usr/bin/python3 -I -S -c pass` and Debian's host-local ADD,
interleaved run by run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ipward.cmd.install import write_launcher
from ipward_lab.bench.common import (
    CNI_BIN_DIR,
    HOST_LOCAL,
    PLUGIN_PYTHON,
    BenchError,
    Results,
    summary,
    verdict,
)

TARGET_EXEC_OVER_PYTHON_MS = 10.0  # plugin ADD median - bare interpreter median


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


def exec_kinds(tmp: Path, ipward_cfg: bytes) -> dict[str, _Exec]:
    """Install the plugin in tmp/bin as `ipward install-cni` does; the bare interpreter,
    the plugin with `ipward_cfg` and host-local (when installed), in that order."""
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin's interpreter")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    write_launcher(bin_dir / "ipward")
    cni_path = f"{bin_dir}:{CNI_BIN_DIR}"
    host_local_cfg = ipam_config(
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
    return kinds


def exec_latency(tmp: Path, runs: int, warmup: int = 5) -> dict[str, float]:
    """ADD exec latency of the installed plugin, of a bare interpreter and of host-local,
    interleaved run by run; DEL of every ADD afterwards (not timed)."""
    ipward_cfg = ipam_config(
        {
            "type": "ipward",
            "store": f"sqlite://{tmp}/b.db",
            "ranges": [[{"subnet": "10.10.0.0/16"}]],
        }
    )
    return interleaved_adds(exec_kinds(tmp, ipward_cfg), runs, warmup)


def interleaved_adds(kinds: dict[str, _Exec], runs: int, warmup: int) -> dict[str, float]:
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
        out[f"{kind}.median_ms"], out[f"{kind}.p99_ms"] = summary(values)
    return out


def exec_section(tmp: Path, quick: bool, out: Callable[[str], object], r: Results) -> None:
    """Figure 2, single-node, into `r`: figures, target, table."""
    runs = 40 if quick else 200
    out(f"  ... plugin exec: {runs} ADDs each of python, ipward and host-local, interleaved")
    exec_dir = tmp / "exec"
    exec_dir.mkdir()
    ex = exec_latency(exec_dir, runs)
    for key, value in ex.items():
        r.figures[f"exec.{key}"] = float(value)
    diff = r.figures["exec.ipward.median_ms"] - r.figures["exec.python.median_ms"]
    r.figures["exec.ipward_minus_python_ms"] = diff
    ok = diff <= TARGET_EXEC_OVER_PYTHON_MS
    r.targets["exec.ipward_minus_python_ms"] = {
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
        if f"exec.{kind}.median_ms" in r.figures:
            exec_rows.append(
                [
                    label,
                    f"{r.figures[f'exec.{kind}.median_ms']:.2f}",
                    f"{r.figures[f'exec.{kind}.p99_ms']:.2f}",
                    "",
                    "",
                ]
            )
        else:
            r.skipped[f"exec.{kind}"] = f"{HOST_LOCAL} is missing"
            exec_rows.append([label, "skipped", "", "", ""])
    exec_rows.append(
        [
            "ipward - python (median)",
            f"{diff:+.2f}",
            "",
            "",
            f"<= {TARGET_EXEC_OVER_PYTHON_MS:.0f} ms {verdict(ok)}",
        ]
    )

    r.tables["exec"] = exec_rows
