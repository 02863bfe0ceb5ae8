"""Real etcd servers on loopback in a temp dir, one member or a small cluster: for the
tests, `ipward sim` and `ipward bench` (never for production, where etcd is run by its
operators).

Uses the Debian `etcd` (3.4) binary. Every process is stopped when its context manager
exits, also on failure. Settings are etcd's defaults apart from addresses: no unsafe
flags, so a write etcd acknowledged is on disk (WAL fsync) as in production.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.store.etcd import EtcdStore

ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"
READY_TIMEOUT = 30.0


def _ephemeral_ports() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


# Listening ports are taken below the kernel's ephemeral range: a port the kernel handed
# out with bind(0) is free only until some process's next outgoing connection takes it
# (tests run in parallel workers, each with many clients), while ports down here are
# only ever taken by a listener, which the test bind sees.
_FIRST_EPHEMERAL = _ephemeral_ports().start
LISTEN_PORTS = range(max(1024, _FIRST_EPHEMERAL - 12000), _FIRST_EPHEMERAL)


def free_port() -> int:
    """A loopback port nothing listens on now, outside the ephemeral range."""
    for _ in range(200):
        port = random.choice(LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTEN_PORTS}")


class EtcdServer:
    """One etcd member. Its ports and data dir stay the same across restarts."""

    def __init__(
        self,
        data_root: Path,
        name: str = "m0",
        extra_args: Sequence[str] = (),
        client_scheme: str = "http",
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
        detach: bool = False,
    ) -> None:
        """`client_scheme` https needs --cert-file and --key-file among `extra_args`.
        `host` is the address it listens on; `command_prefix` goes before its command
        line (e.g. `nsenter --net=FILE`); `detach` starts it in a session of its own, so
        it outlives the process that started it (the cluster lab)."""
        self.name = name
        self.client_scheme = client_scheme
        self.host = host
        self.command_prefix = list(command_prefix)
        self.detach = detach
        self.dir = Path(data_root) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "etcd.log"
        self.extra_args = list(extra_args)
        self.cluster_token = uuid.uuid4().hex
        self.proc: subprocess.Popen[bytes] | None = None
        self.args: list[str] = []  # its command line, once started
        self.client_port = self.peer_port = self.metrics_port = 0  # see choose_ports

    def choose_ports(self) -> None:
        """Ports free now, for a member never started (its data would name the old):
        chosen just before the first start (`first_start`), or by its cluster."""
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()
        self.initial_cluster = f"{self.name}={self.peer_url}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        scheme = "etcds" if self.client_scheme == "https" else "etcd"
        return f"{scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self) -> None:
        """Start the process without waiting; see wait_ready."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        assert self.client_port, "no ports chosen"
        client = f"{self.client_scheme}://{self.endpoint}"
        args = [
            *self.command_prefix,
            ETCD,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--listen-metrics-urls=http://{self.host}:{self.metrics_port}",
            f"--initial-cluster={self.initial_cluster}",
            f"--initial-cluster-token={self.cluster_token}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
            *self.extra_args,
        ]
        self.args = args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.detach,
            )

    def healthy(self) -> bool:
        """The member answers /health with a leader (so it can serve requests)."""
        url = f"http://{self.host}:{self.metrics_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        wait_serving(f"etcd {self.name}", self.healthy, self.proc, self.log_tail, timeout, 0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it lingers."""
        if self.running:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed that was not already written."""
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the socket still accepts connections but nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.wait_ready()

    def etcdctl(self, *args: str, stdin: str = "") -> str:
        return run_etcdctl([self.endpoint], *args, stdin=stdin)


PORT_TRIES = 3


class _Server(Protocol):
    def start(self) -> None: ...
    def wait_ready(self) -> None: ...
    def stop(self) -> None: ...
    def log_tail(self) -> str: ...


def first_start(server: _Server, choose_ports: Callable[[], None]) -> None:
    """Start `server` on ports just chosen (`choose_ports`), and wait until it is ready.
    A port free when chosen can be taken before the server binds it (by another test's
    server, choosing at random too): then other ports, up to PORT_TRIES times."""
    for attempt in range(1, PORT_TRIES + 1):
        choose_ports()
        server.start()
        try:
            server.wait_ready()
            return
        except RuntimeError:
            if attempt == PORT_TRIES or "address already in use" not in server.log_tail():
                raise
            server.stop()


def wait_serving(
    what: str,
    ready: Callable[[], bool],
    proc: subprocess.Popen[bytes] | None,
    log_tail: Callable[[], str],
    timeout: float,
    poll: float,
) -> None:
    """Wait until `ready()`; RuntimeError with the log's tail when the process exits
    first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is None or proc.poll() is not None:
            code = None if proc is None else proc.returncode
            raise RuntimeError(f"{what} exited ({code}):\n{log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{log_tail()}")
        time.sleep(poll)


def run_etcdctl(endpoints: Sequence[str], *args: str, stdin: str = "") -> str:
    env = dict(os.environ, ETCDCTL_API="3")
    out = subprocess.run(
        [ETCDCTL, f"--endpoints={','.join(endpoints)}", "--command-timeout=5s", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=20,
    )
    if out.returncode != 0:
        raise RuntimeError(f"etcdctl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


@contextlib.contextmanager
def etcd_server(
    tmp_dir: Path, extra_args: Sequence[str] = (), client_scheme: str = "http"
) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_dir, extra_args=extra_args, client_scheme=client_scheme)
    try:
        first_start(server, server.choose_ports)
        yield server
    finally:
        server.resume()  # a paused process does not act on SIGTERM until continued
        server.stop()


@contextlib.contextmanager
def etcd_store(tmp_dir: Path) -> Iterator[EtcdStore]:
    """A store client on a one-member etcd of its own (`etcd_server`); closed, then the
    member stopped, on exit."""
    from ipward.store.etcd import EtcdStore  # grpc: only when a client is wanted

    with etcd_server(tmp_dir) as server:
        store = EtcdStore.from_url(server.url)
        try:
            yield store
        finally:
            store.close()


class EtcdCluster:
    def __init__(self, tmp_dir: Path, members: int = 3) -> None:
        self.members = [EtcdServer(tmp_dir, f"m{i}") for i in range(members)]
        for m in self.members:
            m.choose_ports()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = uuid.uuid4().hex
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = token

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        # All at once: each member waits for the others to form a quorum.
        for m in self.members:
            m.start()
        for m in self.members:
            m.wait_ready()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def leader(self, timeout: float = 10.0) -> EtcdServer:
        """The live member that is leader, waiting out an election in progress."""
        deadline = time.monotonic() + timeout
        while True:
            live = [m for m in self.members if m.running]
            statuses = json.loads(
                run_etcdctl([m.endpoint for m in live], "endpoint", "status", "-w", "json")
            )
            for st in statuses:
                status = st["Status"]
                if status["leader"] == status["header"]["member_id"]:
                    return next(m for m in live if m.endpoint == st["Endpoint"])
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader among {[m.name for m in live]}")
            time.sleep(0.1)

    def kill(self, member: EtcdServer) -> None:
        member.kill()

    def restart(self, member: EtcdServer) -> None:
        member.restart()


@contextlib.contextmanager
def etcd_cluster(tmp_dir: Path, members: int = 3) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_dir, members)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
