"""The cluster lab's processes: its daemons (`Daemons`: started in a session of their own,
journaled before anything else can happen to them, killed, restarted), and how the lab
knows a process for its own after a crash: by pid and start time, by namespace, by
cgroup (`pids_in`); and SIGKILLs them until they are gone (`kill_until_gone`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ipward_lab.kubecluster.common import ClusterError, wait_for
from ipward_lab.kubecluster.state import ClusterState

# In the argv of the lab's own observers that live in a node's namespaces (the address
# witness's scanners): not the node's, so a power off spares them (`down` does not).
OBSERVER_MARK = "ipward-lab-observer"


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a PID with another start
    time is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def observer(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return OBSERVER_MARK.encode() in argv


def ns_id(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def pids_in(
    ns_ids: set[tuple[int, int]], cgroups: Iterable[Path], processes: Iterable[dict[str, Any]]
) -> set[int]:
    """Every process (but this one) in a network or mount namespace of `ns_ids`, in a
    cgroup under `cgroups`, or of the journal's `processes` (same pid and start time)."""
    pids: set[int] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        for kind in ("net", "mnt"):
            if ns_id(f"/proc/{entry}/ns/{kind}") in ns_ids:
                pids.add(int(entry))
    for cgroup in cgroups:
        if cgroup.is_dir():
            for dirpath, _, files in os.walk(cgroup):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        for line in Path(dirpath, "cgroup.procs").read_text().split():
                            pids.add(int(line))
    for p in processes:
        if p.get("start") and start_time(p["pid"]) == p["start"]:
            pids.add(p["pid"])
    pids.discard(me)
    return pids


def kill_until_gone(alive: Callable[[], set[int]], timeout: float, poll: float) -> set[int]:
    """SIGKILL every process `alive()` lists (reaping those that are our children) until
    it lists none; what it still lists after `timeout` (empty: all gone)."""
    last: set[int] = set()

    def gone() -> bool:
        nonlocal last
        last = alive()
        for pid in last:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in last:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return not last

    with contextlib.suppress(ClusterError):
        wait_for(gone, "the processes gone", timeout, poll)
    return last


class Daemons:
    """The lab's daemons, by name (`kube-apiserver`, `n1-kubelet`, `n2-containerd`,
    `route-syncer`...), recorded in cluster.json's `processes` (pid, argv, env) and in
    the journal (pid and start time, for `down`)."""

    def __init__(self, lab: ClusterState) -> None:
        self.lab = lab

    def launch(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Start a daemon of the lab (a session of its own, output to logs/NAME.log)."""
        log = self.lab.state / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.record(name, proc.pid, argv, env)
        return proc.pid

    def record(
        self, name: str, pid: int, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> None:
        """Daemon `name` started as `pid` (by `launch`, or by a lab of its own)."""
        self.lab.journal.record("process", name=name, pid=pid, start=start_time(pid))
        self.lab.info.setdefault("processes", {})[name] = {
            "pid": pid,
            "argv": list(argv),
            "env": env,
        }

    def running(self, name: str) -> bool:
        """Daemon `name` was started (and not forgotten)."""
        return name in self.lab.info.get("processes", {})

    def kill(self, name: str, timeout: float = 30.0) -> None:
        """SIGKILL the lab's daemon `name` (e.g. `n1-kubelet`, `n2-containerd`,
        `kube-apiserver`) and wait until it is gone; its pods and their shims live on."""
        pid = self.lab.info["processes"][name]["pid"]
        started = start_time(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        wait_for(lambda: start_time(pid) != started or zombie(pid), f"{name} gone", timeout, 0.05)

    def forget(self, name: str) -> None:
        """Kill daemon `name` for good: it is no longer the lab's."""
        self.kill(name)
        del self.lab.info["processes"][name]

    def restart(self, name: str) -> int:
        """Kill the daemon `name` and start it again with the same command line (a
        node's kubelet or containerd after a crash); its new pid."""
        self.kill(name)
        entry = self.lab.info["processes"][name]
        pid = self.launch(name, entry["argv"], env=entry.get("env"))
        self.lab.write_info()
        return pid

    def alive(self, name: str) -> bool:
        """True; ClusterError with the tail of its log when daemon `name` exited."""
        pid = self.lab.info.get("processes", {}).get(name, {}).get("pid")
        if pid is None or start_time(pid) is None:
            raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
        return True

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.lab.state / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
