"""Real `ipward agent` and `ipward controller` processes, started, watched and killed
from Python: what `ipward sim` runs, and what the scenario tests run. Each process logs
JSON lines to a file of its own and serves metrics on a loopback port it picks itself
(read back from its start log line)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ipward.cni.plugin import forward
from ipward.cni.wire import WireError
from ipward_lab.waiting import wait_for

IPWARD = [sys.executable, "-m", "ipward"]
_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def run_cli(
    *args: str, store: str | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """`ipward ARGS` (on `store` when given, as IPWARD_STORE), its output captured."""
    env = dict(os.environ)
    if store:
        env["IPWARD_STORE"] = store
    return subprocess.run(
        [*IPWARD, *args], capture_output=True, text=True, env=env, check=check, timeout=120
    )


class FleetError(Exception):
    """A process did not start or answer as expected (its log tail is in the message)."""


class Process:
    """One ipward process and its log."""

    started_msg = ""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        log_level: str = "debug",
    ) -> None:
        self.name = name
        self.args = args
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.monotonic_ns()
        self.log_path = log_dir / f"{name}-{stamp}.log"
        self.stderr_path = log_dir / f"{name}-{stamp}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*IPWARD, *args, "--log-file", str(self.log_path), "--log-level", log_level],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a signal to the test's group does not reach it
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> list[dict]:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a SIGKILL
        return out

    def logged(self, msg: str) -> list[dict]:
        return [e for e in self.logs() if e.get("msg") == msg]

    def output(self, tail: int = 4000) -> str:
        text = ""
        for path in (self.stderr_path, self.log_path):
            try:
                text += path.read_text(errors="replace")
            except OSError:
                pass
        return text[-tail:]

    def wait_started(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = self.logged(self.started_msg)
            if found:
                return found[-1]
            if not self.running:
                raise FleetError(f"{self.name} exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise FleetError(f"{self.name} not started after {timeout}s:\n{self.output()}")
            time.sleep(0.02)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample of its /metrics; [] when it does not answer."""
        url = self.metrics_url()
        if url is None:
            return []
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                out.append((m[1], dict(_LABEL.findall(m[2] or "")), float(m[3])))
        return out

    def healthz(self) -> str:
        """Its /healthz answer (an unhealthy one as "503: " and its reason), or why there
        is none."""
        url = self.metrics_url()
        if url is None:
            return "not started"
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                return str(r.read().decode().strip())
        except urllib.error.HTTPError as e:
            return f"{e.code}: {e.read().decode().strip()}"
        except OSError as e:
            return f"unreachable: {e}"

    def metric(self, name: str, **labels: str) -> float | None:
        for sample, got, value in self.metrics():
            if sample == name and got == labels:
                return value
        return None

    def _total(self, *names: str) -> float:
        """The sum of unlabelled samples `names` of one read of its /metrics (0 for a
        sample it does not have, or when it does not answer)."""
        return sum(value for sample, got, value in self.metrics() if sample in names and not got)

    def metrics_url(self) -> str | None:
        """Where its /metrics and /healthz answer, as its start line says."""
        started = self.logged(self.started_msg)
        url = started[-1].get("metrics") if started else None
        return str(url) if url else None

    def kill(self) -> None:
        """SIGKILL (a stopped process is continued first, or it would not die cleanly)."""
        if self.running:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM once it runs (before its handler is set, SIGTERM just kills it)."""
        if self.running:
            self.wait_started()
            self.proc.terminate()
        return self.proc.wait(timeout)


class Agent(Process):
    started_msg = "agent started"

    def __init__(
        self,
        node: str,
        store: str,
        socket_path: Path,
        log_dir: Path,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        metrics: bool = True,
        log_level: str = "debug",
    ) -> None:
        """`log_level` info leaves out a line per request (the bench's agents)."""
        self.node = node
        self.socket = socket_path
        args = [
            "agent",
            "--node",
            node,
            "--store",
            store,
            "--socket",
            str(socket_path),
            "--metrics-address",
            "127.0.0.1:0" if metrics else "off",
            *extra,
        ]
        super().__init__(f"agent-{node}", args, log_dir, env, log_level)

    def wait_ready(self, timeout: float = 30.0) -> Agent:
        """Until a VERSION call through its socket is answered and its start is logged
        (the line that names its metrics address comes after the socket serves)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise FleetError(f"{self.name} exited {self.proc.returncode}:\n{self.output()}")
            try:
                status, _ = forward(str(self.socket), {"CNI_COMMAND": "VERSION"}, b"{}", 5.0)
                if status == 0:
                    self.wait_started(max(deadline - time.monotonic(), 0.0))
                    return self
            except (OSError, WireError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"{self.name} not ready after {timeout}s:\n{self.output()}")
            time.sleep(0.02)

    def reconcile_passes(self) -> float:
        """Its reconciliation passes ended: completed with a runtime view, or skipped
        without one."""
        return self._total(
            "ipward_agent_reconcile_passes_total", "ipward_agent_reconcile_skipped_total"
        )


class Controller(Process):
    started_msg = "controller started"

    def __init__(
        self,
        ident: str,
        store: str,
        log_dir: Path,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.ident = ident
        args = [
            "controller",
            "--id",
            ident,
            "--store",
            store,
            "--metrics-address",
            "127.0.0.1:0",
            *extra,
        ]
        super().__init__(f"controller-{ident}", args, log_dir, env)

    @property
    def leading(self) -> bool:
        return self.metric("ipward_controller_leader") == 1

    def gc_passes(self) -> float:
        """Its garbage-collection passes ended (only a leader makes them): judged, or
        skipped with no liveness source answering."""
        return self._total("ipward_gc_pass_seconds_count", "ipward_gc_skipped_passes_total")

    def passes(self) -> float:
        """Its passes over every pool ended (only a leader makes them)."""
        return self._total("ipward_controller_pass_seconds_count")


def wait_passes(counters: list[Callable[[], float]], passes: int, what: str) -> None:
    """Until each of `counters` (e.g. `Controller.gc_passes`) has gone up by `passes`
    from now. The first pass counted may have begun before this call: one that must see
    the state as it is now is the second."""
    start = [counter() for counter in counters]
    wait_for(
        lambda: all(c() >= s + passes for c, s in zip(counters, start, strict=True)),
        f"{passes} more {what}",
    )
