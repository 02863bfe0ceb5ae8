"""What test modules of both layers import (fixtures are in the conftests): the
repository's root, a clock moved by hand, the exchanges recorded from a real
kube-apiserver, the plugin exec'd as a runtime does, and a test point held open.
Waiting, the CLI and the processes are the labs' (`ipward_lab.waiting`,
`ipward_lab.fleet`)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

from ipward_lab.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
K8S_WIRE = REPO / "tests" / "k8s_wire"  # exchanges recorded from a real kube-apiserver


class ManualClock:
    """A clock that moves only when told: deadlines, and the times written, become
    exact."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


PT_INTERP = 3  # an ELF program header naming the dynamic loader
EM_X86_64 = 62


def static_x86_64_executable(data: bytes) -> bool:
    """`data` is a 64-bit ELF for x86-64 that names no dynamic loader (so it uses no C
    library of the host's, glibc, musl or none)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    machine = struct.unpack_from("<H", data, 18)[0]
    phoff, _, _, _, phentsize, phnum = struct.unpack_from("<QQIHHH", data, 32)
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return machine == EM_X86_64 and phnum > 0 and PT_INTERP not in types


def recorded(name: str) -> dict:
    """An exchange recorded from a real kube-apiserver (`k8s_wire/README.md`)."""
    return json.loads((K8S_WIRE / f"{name}.json").read_text())  # type: ignore[no-any-return]


class PluginResult:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        try:
            self.json = json.loads(proc.stdout) if proc.stdout.strip() else None
        except ValueError:  # not what a plugin may print: the test's assertions say so
            self.json = None

    def __repr__(self) -> str:
        return f"PluginResult(rc={self.returncode}, stdout={self.stdout!r}, stderr={self.stderr!r})"


def exec_plugin(
    plugin: Path,
    command: str,
    config: dict | bytes | str,
    container: str = "c0",
    ifname: str = "eth0",
    args: str = "",
    netns: str = "/var/run/netns/test",
    env: dict[str, str] | None = None,
    root: Path | None = None,
    timeout: float = 60,
) -> PluginResult:
    """Exec the plugin as a runtime would: CNI_* environment, config on stdin; with
    `root`, chrooted there (`plugin` is then its path inside)."""
    data = json.dumps(config).encode() if isinstance(config, dict) else config
    if isinstance(data, str):
        data = data.encode()
    full_env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_IFNAME": ifname,
        "CNI_NETNS": netns,
        "CNI_PATH": str(plugin.parent),
        "CNI_ARGS": args,
        "IPWARD_CNI_NOTES": os.environ.get("IPWARD_CNI_NOTES"),  # tests/conftest.py
    }
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    argv = [shutil.which("chroot") or "chroot", str(root), str(plugin)] if root else [str(plugin)]
    proc = subprocess.run(argv, input=data, env=full_env, capture_output=True, timeout=timeout)
    return PluginResult(proc)


class Gate:
    """A test point held open (`IPWARD_TEST_GATES`): the process waits at it until the
    test opens it, so the test acts exactly in the window."""

    def __init__(self, tmp: Path, point: str) -> None:
        self.dir = tmp / f"gate-{point}"
        self.dir.mkdir()
        self.point = point
        self.env = {**os.environ, "IPWARD_TEST_GATES": f"{point}={self.dir}"}

    def wait_reached(self) -> None:
        wait_for((self.dir / f"{self.point}.reached").exists, f"the {self.point} gate")

    def open(self) -> None:
        (self.dir / f"{self.point}.open").touch()
