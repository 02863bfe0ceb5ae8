"""`ipward agent`: one per node. Serves the CNI plugin over a Unix socket.

The plugin (`ipward.cni.plugin`, with `agentSocket` in its config) sends one call per
connection in the framed protocol of `ipward.cni.wire`; the agent answers it with
`verbs.answer(env, stdin, ledger)` on its single long-lived `Ledger(store, node)`, so the
config's `store` and `node` fields never matter here: the agent serves its own node
from its own store. An allocation is committed (the ledger's transaction has returned)
before its answer is sent.

Socket: its directory is created 0750 when missing (an existing one is never loosened;
a warning says when it is more open than that), the socket itself is 0660. A second
agent on the same path refuses to start (a lock file next to the socket, and a socket
that answers); a dead agent's socket is replaced. Every connection's peer is checked
with SO_PEERCRED: root, the agent's own user and the `--allow-gid` group are served;
anyone else gets a CNI error object with code 5 (I/O failure: the plugin could not get
its call through). Not 11: retrying cannot succeed, so "try again later" would only
hide a deployment mistake behind endless retries. Nothing is read into the ledger for
a refused peer.

Serving: a slow, idle or hostile client costs nothing to others. One I/O thread accepts
every connection at once (the listen backlog never fills while the workers are busy)
and reads requests from non-blocking sockets, each into a buffer of its own, under a
deadline for the whole request (REQUEST_DEADLINE from the accept, not per read: a client
trickling a byte at a time is cut off just the same). Only a complete request goes to
the pool of workers. Refused peers, malformed requests, requests of another protocol
version and requests over the size limits are answered by the I/O thread itself (codes
5, 6, 11, 107), never by a worker. Caps, each answered 11 at once without reading: at
most MAX_READING_PER_PROCESS requests of one process being read at once (every plugin
call is a process of its own), MAX_READING_PER_USER of one user other than root, and
`--max-connections` open in all (the open-files limit is raised to fit them). `/healthz`
says 503 when a request has waited for a worker or its answer longer than
`--stuck-seconds`, or the I/O thread is gone.

Stop (SIGTERM, SIGINT): the listening socket is shut down at once (new connections are
refused, and the plugin answers 11) and its file unlinked; calls already accepted finish
(those still arriving are read until their deadline), up to `--drain-seconds`; then the
store is closed and the agent exits 0. A second signal ends the drain early.

Metrics (Prometheus text format, on a registry of the agent's own) and `/healthz` (200
"ok" when nothing is stuck and the store answers `revision()` within HEALTH_TIMEOUT,
else 503 with the reason) are served over HTTP on `--metrics-address`, loopback by
default.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

import click
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from ipward.cluster.liveness import (
    ClusterView,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    open_source,
)
from ipward.cmd.daemon import HealthProbe, add_grace_option, parse_address, redact, start_http
from ipward.cni import verbs, wire
from ipward.cni.selection import PodDirectory, PodMeta
from ipward.cni.wire import CALL_TIMEOUT
from ipward.core import jsonc, keys, log
from ipward.core import records as rec
from ipward.core.errors import (
    DecodeFailure,
    InputTooLarge,
    InvalidConfig,
    IoFailure,
    IpwardError,
    TryAgainLater,
)
from ipward.core.names import check_node_name
from ipward.core.policy import ADD_GRACE
from ipward.core.pool import PoolSpec
from ipward.core.records import MARKED, BlockRecord
from ipward.gc import rules as gc
from ipward.ipam import blocks
from ipward.ipam.ledger import Ledger
from ipward.store import Store, StoreError, open_store_waiting
from ipward.store.base import Put

DEFAULT_SOCKET = "/run/ipward/agent.sock"
DEFAULT_METRICS = "127.0.0.1:9310"
DIR_MODE = 0o750
SOCKET_MODE = 0o660
REQUEST_DEADLINE = 10.0  # a plugin sends its whole request at once: all of it by then
REFUSED_DEADLINE = 1.0  # a refused peer gets this long to send (for its cniVersion)
REFUSED_READ_LIMIT = 64 << 10  # and so much of it is read; a larger request is not
WRITE_DEADLINE = 10.0  # for the rest of an answer the socket did not take at once
MAX_READING_PER_PROCESS = 8  # requests of one peer process being read at once
MAX_READING_PER_USER = 32  # ... of one peer user other than root
DEFAULT_MAX_CONNECTIONS = 1024  # open at once, in any state
FD_MARGIN = 256  # descriptors kept for the store, the log, metrics and the workers
IO_TICK = 0.2  # seconds between deadline checks of the I/O thread
ACCEPT_BATCH = 64  # connections accepted in a row before others' events get a turn
ACCEPT_PAUSE = 0.1  # seconds without accepting after running out of descriptors
HEALTH_TIMEOUT = 2.0
PROBE_TIMEOUT = 1.0  # connecting to an existing socket to see whether an agent answers
PEER_REFUSED = 5  # CNI "I/O failure": see the module docstring for why not 11
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_COMMAND_LABELS = frozenset(verbs.COMMANDS)
# Python does not name SO_PEERGROUPS; 59 is its value in asm-generic, which these use.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", None) or (
    59
    if os.uname().machine in ("x86_64", "i686", "aarch64", "armv7l", "riscv64", "s390x", "ppc64le")
    else None
)


class AgentError(IpwardError):
    """The agent cannot start as asked (the CLI prints the message, exit status 2)."""


# -- metrics -----------------------------------------------------------------------------


class Metrics:
    """The agent's metrics, on a registry of its own (not prometheus_client's global)."""

    def __init__(self, node: str) -> None:
        disable_created_metrics()  # no `_created` series: timestamps nobody graphs
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "ipward_agent_requests",
            "CNI calls answered, by command and result code (0: success, else the CNI error code).",
            ["command", "code"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "ipward_agent_request_seconds",
            "Time to answer a CNI call, from its last byte read to its answer sent.",
            ["command"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "ipward_agent_in_flight",
            "Connections open: the request being read, waiting for a worker or served, or"
            " the answer being written.",
            registry=self.registry,
        )
        self.protocol_errors = Counter(
            "ipward_agent_protocol_errors",
            "Requests not served: not our protocol or version, too large, incomplete at"
            " their deadline (each answered with an error), or cut short by the peer.",
            registry=self.registry,
        )
        self.refused = Counter(
            "ipward_agent_refused_peers",
            "Connections refused by the peer credential check.",
            registry=self.registry,
        )
        self.turned_away = Counter(
            "ipward_agent_turned_away",
            "Connections answered 11 without being read: too many open, or too many of"
            " one peer being read at once.",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_freed = Counter(
            "ipward_agent_reconcile_freed",
            "Records freed by reconciliation with the runtime, by reason (sandbox-gone).",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_skipped = Counter(
            "ipward_agent_reconcile_skipped",
            "Reconciliation passes that freed nothing because the runtime could not be"
            " trusted: unreachable, or listing two ready sandboxes for one pod.",
            registry=self.registry,
        )
        self.reconcile_passes = Counter(
            "ipward_agent_reconcile_passes",
            "Reconciliation passes completed with a runtime view.",
            registry=self.registry,
        )
        self.info = Gauge(
            "ipward_agent_info", "The node this agent serves.", ["node"], registry=self.registry
        )
        self.info.labels(node=node).set(1)


# -- the socket ----------------------------------------------------------------------------


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it connect."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def peer_groups(conn: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel saw it connect (SO_PEERGROUPS,
    Linux 4.13+); () where that cannot be read."""
    if _SO_PEERGROUPS is None:
        return ()
    for count in (64, 65536):
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * count)
        except OSError as e:
            if e.errno == errno.ERANGE:
                continue  # more groups than the buffer holds
            return ()
        return struct.unpack(f"{len(raw) // 4}I", raw)
    return ()


def _prepare_directory(directory: str, allow_gid: int | None) -> None:
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
        os.chmod(directory, DIR_MODE)  # makedirs' mode is filtered by the umask
        if allow_gid is not None:
            os.chown(directory, -1, allow_gid)
        log.info("created socket directory", path=directory, mode=oct(DIR_MODE))
        return
    if not stat.S_ISDIR(st.st_mode):
        raise AgentError(f"{directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~DIR_MODE:
        log.warning(
            "socket directory is more open than 0750; left as it is",
            path=directory,
            mode=oct(mode),
        )


def _answers(path: str) -> bool:
    """Does something accept connections on the Unix socket at `path`?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        probe.connect(path)
        return True
    except TimeoutError:
        return True  # a backlog full of waiting callers is a live agent, not a stale file
    except OSError:
        return False
    finally:
        probe.close()


class AgentSocket:
    """The listening socket, its lock file, and the checks around both."""

    def __init__(self, path: str, allow_gid: int | None, backlog: int) -> None:
        self.path = os.path.abspath(path)
        directory = os.path.dirname(self.path)
        _prepare_directory(directory, allow_gid)
        self._lock_fd = self._lock(self.path + ".lock")
        try:
            self._remove_stale()
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o117)  # never reachable by others, not even for a moment
            try:
                self.sock.bind(self.path)
            finally:
                os.umask(old_umask)
            os.chmod(self.path, SOCKET_MODE)
            if allow_gid is not None:
                os.chown(self.path, -1, allow_gid)
            st = os.stat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            self.sock.listen(backlog)
        except BaseException:
            os.close(self._lock_fd)
            raise

    @staticmethod
    def _lock(path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AgentError(f"another agent holds {path}; not starting") from None
        return fd

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentError(f"{self.path} exists and is not a socket; not touching it")
        if _answers(self.path):
            raise AgentError(f"an agent already answers on {self.path}; not starting")
        os.unlink(self.path)
        log.warning("removed a stale socket (nothing answered on it)", path=self.path)

    def shutdown(self) -> None:
        """Refuse new connections from now on (wakes the thread blocked in accept) and
        remove the socket file, if it is still ours."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.sock.close()
        os.close(self._lock_fd)  # the lock file stays: unlinking it would race a new agent


# -- the agent ----------------------------------------------------------------------------


def _code_of(out: str) -> str:
    try:
        code = jsonc.loads(out).get("code")
    except Exception:  # an answer that is not an error object: count it as internal
        code = None
    return str(code) if isinstance(code, int) else str(verbs.INTERNAL_ERROR)


def _network_of(stdin: bytes) -> str | None:
    try:
        name = jsonc.loads(stdin).get("name")
    except Exception:  # only for the log line
        return None
    return name if isinstance(name, str) else None


class _Connection:
    """One accepted connection: its peer, and what the I/O thread reads from it (the
    request, until `deadline`) or still has to write to it (`pending`)."""

    __slots__ = (
        "allowed",
        "body_length",
        "buffer",
        "deadline",
        "gid",
        "pending",
        "pid",
        "reading",
        "sock",
        "uid",
    )

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int, allowed: bool) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.allowed = allowed
        self.buffer = bytearray()
        self.body_length: int | None = None
        self.reading = False
        self.deadline = 0.0
        self.pending = b""


class Agent:
    """Serves the plugin. One I/O thread accepts every connection at once and reads
    requests (non-blocking sockets, a buffer and a deadline each), answers refused peers
    and malformed requests itself, and hands complete requests to the workers, which
    answer them with `verbs.answer` on the agent's one `Ledger`. So a slow, idle or refused
    client holds no worker and delays no one: it costs a file descriptor, a buffer and a
    place under the caps (module docstring) until its deadline."""

    def __init__(
        self,
        store: Store,
        node: str,
        socket_path: str,
        *,
        allow_gid: int | None = None,
        max_workers: int = 16,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        stuck_seconds: float = CALL_TIMEOUT,
        metrics_address: tuple[str, int] | None = None,
        directory: PodDirectory | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self.ledger = Ledger(store, node)
        self.directory = directory
        self.allow_gid = allow_gid
        self.uid = os.getuid()
        self.metrics = Metrics(node)
        self.max_connections = max_connections
        self.stuck_seconds = stuck_seconds
        self.stopping = threading.Event()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="serve")
        self._lock = threading.Lock()  # guards the three below, shared with the workers
        self._open = 0  # connections accepted and not closed yet
        self._in_service: dict[int, tuple[float, str]] = {}  # id(conn) -> (since, command)
        self._outbox: list[_Connection] = []  # answers the workers could not send at once
        # The I/O thread's own state:
        self._watched: set[_Connection] = set()  # being read or written
        self._reading_by_pid: dict[int, int] = {}
        self._reading_by_uid: dict[int, int] = {}
        self._accept_paused_until = 0.0
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        # The kernel caps the backlog at net.core.somaxconn; a burst waits there while
        # the I/O thread accepts (the plugin waits for room rather than failing).
        self.socket = AgentSocket(socket_path, allow_gid, backlog=max(128, max_connections))
        self.socket.sock.setblocking(False)
        self._selector.register(self.socket.sock, selectors.EVENT_READ)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self.http: ThreadingHTTPServer | None = None
        try:
            if metrics_address is not None:
                probe = HealthProbe(store)

                def health() -> tuple[bool, str]:
                    if self.stopping.is_set():
                        return False, "stopping"
                    stuck = self.stuck()
                    if stuck is not None:
                        return False, stuck
                    ok, reason = probe.check()
                    return ok, "ok" if ok else reason

                self.http = start_http(
                    metrics_address, self.metrics.registry, health, "ipward-agent"
                )
        except BaseException:
            self.socket.shutdown()
            self.socket.close()
            raise
        self._io = threading.Thread(target=self._io_loop, name="io", daemon=True)

    @property
    def metrics_url(self) -> str | None:
        if self.http is None:
            return None
        address, port = self.http.server_address[:2]
        host = address.decode() if isinstance(address, bytes) else str(address)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._io.start()

    def stuck(self) -> str | None:
        """Why the agent is not serving as it should, or None: its I/O thread is gone,
        or a request has waited for a worker or its answer longer than `stuck_seconds`
        (the plugin gave up on it long before; all workers may be hanging)."""
        if self._io.ident is not None and not self._io.is_alive():
            return "the thread that accepts and reads requests has stopped"
        with self._lock:
            oldest = min(self._in_service.values(), default=None)
        if oldest is not None:
            age = time.monotonic() - oldest[0]
            if age > self.stuck_seconds:
                return (
                    f"a {oldest[1] or 'request'} has been in flight for {age:.0f}s (more than"
                    f" {self.stuck_seconds:g}s): workers stuck?"
                )
        return None

    # -- the I/O thread ----------------------------------------------------------------

    def _io_loop(self) -> None:
        while not self._closed.is_set():
            try:
                for key, mask in self._selector.select(IO_TICK):
                    if key.fileobj is self.socket.sock:
                        self._accept()
                    elif key.fileobj is self._wake_reader:
                        self._woken()
                    else:
                        self._ready(key.data, mask)
                self._take_outbox()
                self._expire(time.monotonic())
                self._resume_accepting()
            except Exception:  # a bug here must cost one connection at most, never all
                import traceback

                log.error("serving loop failed", traceback=traceback.format_exc())
                time.sleep(IO_TICK)

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (the buffer is full), or closing

    def _woken(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        if self.stopping.is_set():
            self._stop_accepting()

    def _stop_accepting(self) -> None:
        try:
            self._selector.unregister(self.socket.sock)
        except (KeyError, ValueError):
            pass  # already

    def _resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            if not self.stopping.is_set():
                self._selector.register(self.socket.sock, selectors.EVENT_READ)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then others' events get their turn
            try:
                sock, _ = self.socket.sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                self._stop_accepting()
                if self.stopping.is_set():
                    return
                # Out of descriptors or memory: pause instead of spinning on it.
                log.warning("accept failed; pausing accepting", error=str(e))
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        with self._lock:
            self._open += 1
        self.metrics.in_flight.inc()
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError as e:
            log.warning("cannot read the peer's credentials; closing", error=str(e))
            self.metrics.protocol_errors.inc()
            self._close(_Connection(sock, 0, -1, -1, False))
            return
        conn = _Connection(sock, pid, uid, gid, self._allowed(sock, uid, gid))
        busy = self._over_a_cap(conn)
        if busy is not None:
            cap, why = busy
            self.metrics.turned_away.labels(reason=cap).inc()
            log.warning("turned a connection away", reason=why, peer_pid=pid, peer_uid=uid)
            msg = f"ipward agent busy: {why}; nothing was done"
            self._reply(conn, self._error_answer(TryAgainLater(msg), b""))
            return
        conn.reading = True
        deadline = REQUEST_DEADLINE if conn.allowed else REFUSED_DEADLINE
        conn.deadline = time.monotonic() + deadline
        self._reading_by_pid[pid] = self._reading_by_pid.get(pid, 0) + 1
        if uid != 0:
            self._reading_by_uid[uid] = self._reading_by_uid.get(uid, 0) + 1
        self._watched.add(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._read(conn)  # a plugin sends at once: its request is often there already

    def _over_a_cap(self, conn: _Connection) -> tuple[str, str] | None:
        """(cap, why) when this connection is not to be read, else None. Root's
        processes are capped one by one (every plugin call is a process of its own),
        other users as a whole."""
        with self._lock:
            open_now = self._open
        if open_now > self.max_connections:
            return "connections", f"{self.max_connections} connections open"
        if self._reading_by_pid.get(conn.pid, 0) >= MAX_READING_PER_PROCESS:
            why = f"{MAX_READING_PER_PROCESS} requests of process {conn.pid} being read"
            return "process", why
        if conn.uid != 0 and self._reading_by_uid.get(conn.uid, 0) >= MAX_READING_PER_USER:
            return "user", f"{MAX_READING_PER_USER} requests of uid {conn.uid} being read"
        return None

    def _allowed(self, conn: socket.socket, uid: int, gid: int) -> bool:
        """Root, the agent's own user, or (with --allow-gid) a member of that group:
        by the peer's effective gid or its supplementary groups, as file permissions
        on the socket would judge it."""
        if uid in (0, self.uid):
            return True
        if self.allow_gid is None:
            return False
        return gid == self.allow_gid or self.allow_gid in peer_groups(conn)

    def _ready(self, conn: _Connection, mask: int) -> None:
        if conn.reading and mask & selectors.EVENT_READ:
            self._read(conn)
        elif not conn.reading and mask & selectors.EVENT_WRITE:
            self._write(conn)

    def _read(self, conn: _Connection) -> None:
        """Read what the request still lacks (never more), then act once it is whole."""
        try:
            while True:
                if conn.body_length is None:
                    want = wire.REQUEST_HEADER - len(conn.buffer)
                else:
                    want = wire.REQUEST_HEADER + conn.body_length - len(conn.buffer)
                if want <= 0:
                    break
                chunk = conn.sock.recv(min(want, 1 << 16))
                if not chunk:
                    self._end_reading(conn)
                    self._protocol_error(conn, "the peer closed the connection mid-request")
                    self._close(conn)
                    return
                conn.buffer += chunk
                if conn.body_length is None:
                    conn.body_length = wire.body_length(bytes(conn.buffer))
                    if not conn.allowed and (conn.body_length or 0) > REFUSED_READ_LIMIT:
                        self._end_reading(conn)
                        self._refuse(conn, {}, b"")  # not worth reading for its version
                        return
        except BlockingIOError:
            return  # the rest comes later (or never: the deadline)
        except wire.WireError as e:
            self._end_reading(conn)
            self._wire_error(conn, e)
            return
        except OSError as e:
            self._end_reading(conn)
            self._protocol_error(conn, f"{type(e).__name__}: {e}")
            self._close(conn)
            return
        self._end_reading(conn)
        try:
            env, stdin = wire.decode_body(bytes(conn.buffer[wire.REQUEST_HEADER :]))
        except wire.WireError as e:
            self._wire_error(conn, e)
            return
        conn.buffer = bytearray()
        if not conn.allowed:
            self._refuse(conn, env, stdin)
            return
        command = env.get("CNI_COMMAND", "")
        with self._lock:
            self._in_service[id(conn)] = (time.monotonic(), command)
        try:
            self._pool.submit(self._serve, conn, env, stdin)
        except RuntimeError:  # the pool is shut down: the agent is exiting
            with self._lock:
                self._in_service.pop(id(conn), None)
            self._reply(conn, self._error_answer(TryAgainLater("ipward agent exiting"), stdin))

    def _end_reading(self, conn: _Connection) -> None:
        """The connection leaves the reading state (and its place under the caps)."""
        if not conn.reading:
            return
        conn.reading = False
        self._watched.discard(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        for counts, key in ((self._reading_by_pid, conn.pid), (self._reading_by_uid, conn.uid)):
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)

    def _wire_error(self, conn: _Connection, error: wire.WireError) -> None:
        """Answer a request that is not one of ours (never served, never a worker)."""
        self._protocol_error(conn, f"{type(error).__name__}: {error}")
        if not conn.allowed:
            self._refuse(conn, {}, b"")
            return
        answer: IpwardError
        if isinstance(error, wire.VersionMismatch):
            answer = TryAgainLater(
                f"ipward agent speaks wire protocol {wire.VERSION} and got {error}: install"
                " the plugin of the agent's version ('ipward install-cni'); nothing was done"
            )
        elif isinstance(error, wire.TooLarge):
            answer = InputTooLarge(f"request refused: {error}; nothing was done")
        else:
            answer = DecodeFailure(f"not an ipward request: {error}; nothing was done")
        if isinstance(error, wire.VersionMismatch) and error.legacy:
            out = verbs.error_output(answer, b"").encode()
            self._reply(conn, wire.encode_legacy_answer(1, out))
        else:
            self._reply(conn, self._error_answer(answer, b""))

    def _protocol_error(self, conn: _Connection, error: str) -> None:
        self.metrics.protocol_errors.inc()
        log.warning("protocol error", error=error, peer_pid=conn.pid, peer_uid=conn.uid)

    def _refuse(self, conn: _Connection, env: dict[str, str], stdin: bytes) -> None:
        """Answer a peer the credential check refused, in the I/O thread."""
        self.metrics.refused.inc()
        command = env.get("CNI_COMMAND", "")
        allowed = f"root, uid {self.uid}" + (
            f", gid {self.allow_gid}" if self.allow_gid is not None else ""
        )
        msg = (
            f"permission denied: the ipward agent serves {allowed}; this call came from"
            f" uid {conn.uid} gid {conn.gid} (nothing was done)"
        )
        log.warning(
            "refused a peer",
            peer_pid=conn.pid,
            peer_uid=conn.uid,
            peer_gid=conn.gid,
            command=command or None,
        )
        label = command if command in _COMMAND_LABELS else "other"
        self.metrics.requests.labels(command=label, code=str(PEER_REFUSED)).inc()
        self._reply(conn, self._error_answer(IoFailure(msg), stdin))

    @staticmethod
    def _error_answer(error: IpwardError, stdin: bytes) -> bytes:
        return wire.encode_answer(1, verbs.error_output(error, stdin).encode())

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._watched if c.deadline <= now]:
            if conn.reading:
                self._end_reading(conn)
                if not conn.allowed:
                    self._refuse(conn, {}, b"")
                    continue
                self._protocol_error(conn, f"request incomplete after {REQUEST_DEADLINE:g}s")
                msg = f"request incomplete after {REQUEST_DEADLINE:g}s; nothing was done"
                self._reply(conn, self._error_answer(TryAgainLater(msg), b""))
            else:
                self._watched.discard(conn)
                self._selector.unregister(conn.sock)
                log.warning("answer not delivered: the peer does not read it", peer_pid=conn.pid)
                self._close(conn)

    # -- answering ----------------------------------------------------------------------

    def _serve(self, conn: _Connection, env: dict[str, str], stdin: bytes) -> None:
        """A worker: answer one complete request."""
        command = env.get("CNI_COMMAND", "")
        label = command if command in _COMMAND_LABELS else "other"
        started = time.monotonic()
        try:
            status, out = verbs.answer(env, stdin, self.ledger, self.directory)  # never raises
            answer = wire.encode_answer(status, out.encode())
        except Exception as e:  # a bug (an answer too large): an error, not silence
            status, out = 1, verbs.error_output(IpwardError(f"internal error: {e}"), stdin)
            answer = wire.encode_answer(status, out.encode())
        finally:
            with self._lock:
                self._in_service.pop(id(conn), None)
        code = "0" if status == 0 else _code_of(out)
        self._reply(conn, answer)
        seconds = time.monotonic() - started
        self.metrics.requests.labels(command=label, code=code).inc()
        self.metrics.seconds.labels(command=label).observe(seconds)
        fields = {
            "command": command,
            "network": _network_of(stdin),
            "container": env.get("CNI_CONTAINERID"),
            "ifname": env.get("CNI_IFNAME"),
            "code": int(code),
            "ms": round(seconds * 1000, 2),
            "peer_pid": conn.pid,
        }
        if status != 0:
            log.warning("request failed", msg_sent=out.strip(), **fields)
        else:
            log.debug("request", **fields)

    def _reply(self, conn: _Connection, answer: bytes) -> None:
        """Send an answer and close, from any thread: at once when the socket takes it
        (answers are small), else the I/O thread writes the rest until WRITE_DEADLINE.
        Whatever was committed stays committed: a retried ADD gets the same address."""
        try:
            sent = conn.sock.send(answer)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            log.warning("answer not delivered", error=str(e), peer_pid=conn.pid)
            self._close(conn)
            return
        if sent == len(answer):
            self._close(conn)
            return
        conn.pending = answer[sent:]
        conn.deadline = time.monotonic() + WRITE_DEADLINE
        with self._lock:
            self._outbox.append(conn)
        self._wake()

    def _take_outbox(self) -> None:
        with self._lock:
            outbox, self._outbox = self._outbox, []
        for conn in outbox:
            self._watched.add(conn)
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _write(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.pending)
        except BlockingIOError:
            return
        except OSError as e:
            sent = len(conn.pending)
            log.warning("answer not delivered", error=str(e), peer_pid=conn.pid)
        conn.pending = conn.pending[sent:]
        if not conn.pending:
            self._watched.discard(conn)
            self._selector.unregister(conn.sock)
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        conn.sock.close()
        with self._lock:
            self._open -= 1
        self.metrics.in_flight.dec()

    # -- stopping ----------------------------------------------------------------------

    def begin_stop(self) -> None:
        """Refuse new connections from now on; requests already accepted go on (those
        still arriving are read until their deadline)."""
        self.stopping.set()
        self.socket.shutdown()
        self._wake()

    def drain(self, seconds: float, cut_short: threading.Event | None = None) -> int:
        """Wait until every accepted connection is answered, at most `seconds`; returns
        how many are left."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                left = self._open
            if not left or time.monotonic() >= deadline:
                return left
            if cut_short is not None and cut_short.is_set():
                return left
            time.sleep(0.01)

    def close(self, wait: bool) -> None:
        self._closed.set()
        self._wake()
        if self._io.ident is not None:
            self._io.join()
        self._selector.close()
        self.socket.close()
        self._wake_reader.close()
        self._wake_writer.close()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.store.close()


class NodeDuties:
    """What the agent owes the cluster besides answering plugins, every `interval`:
    keep `nodes/<node>` alive under a lease (the controller serves registered nodes),
    and answer the release handshake for this node's marked blocks (DESIGN 5.3)."""

    def __init__(self, store: Store, node: str, interval: float, ttl: int) -> None:
        self.store = store
        self.node = node
        self.interval = interval
        self.ttl = ttl
        self.lease = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="duties", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=self.interval + 5)
        if self.lease:
            try:
                self.store.lease_revoke(self.lease)
            except StoreError as e:
                log.warning("could not deregister the node", node=self.node, error=str(e))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.register()
                self.answer_handshakes()
            except StoreError as e:
                log.warning("node duties: store unreachable", node=self.node, error=str(e))
            self.stopping.wait(self.interval)

    def register(self) -> None:
        if self.lease and self.store.lease_keepalive(self.lease) > 0:
            return
        self.lease = self.store.lease_grant(self.ttl)
        value = rec.encode({"node": self.node, "pid": os.getpid(), "since": time.time()})
        self.store.txn([], [Put(keys.node_key(self.node), value, lease=self.lease)])
        log.info("node registered", node=self.node, lease=self.lease, ttl=self.ttl)

    def answer_handshakes(self) -> list[tuple[str, str]]:
        """Answer every marked block of this node; returns (block, answer) pairs."""
        answered = []
        for pool_kv in self.store.range(keys.POOLS)[0]:
            spec = PoolSpec.decode(pool_kv.value)
            owned, _ = self.store.range(keys.affinity_prefix(spec.name, self.node))
            for entry in owned:
                kv = self.store.get(keys.block_key(spec.name, keys.cidr_of(entry.key)))
                if kv is None or BlockRecord.decode(kv.value).state != MARKED:
                    continue
                result = blocks.answer(self.store, spec, kv, time.time())
                if result is not None:
                    answered.append((keys.cidr_of(kv.key), result))
        return answered


class ClusterDirectory(PodDirectory):
    """Pod annotations and owners for ADD, from a liveness source's cluster view (read
    per call: a pod created a moment ago must be found). "Could not read" is code 11,
    and so is a pod the view does not list yet: the runtime retries."""

    def __init__(self, source: LivenessSource) -> None:
        self.source = source

    def _view(self) -> ClusterView:
        try:
            return self.source.cluster_view()
        except LivenessUnavailable as e:
            raise TryAgainLater(f"cluster source: {e}") from e

    def meta(self, namespace: str, name: str, uid: str) -> PodMeta:
        view = self._view()
        if uid:
            pod = view.pods.get(uid)
        else:  # no UID in CNI_ARGS: the pod of that name
            named = view.pods_named(namespace, name)
            pod = named[0] if named else None
        if pod is None:
            raise TryAgainLater(f"pod {namespace}/{name} ({uid or 'no UID'}) not listed yet")
        return PodMeta(
            dict(pod.annotations),
            dict(view.namespaces.get(namespace, {})),
            pod.owner_kind,
            pod.owner_name,
        )

    def listed(self, namespace: str, name: str, uid: str) -> bool:
        return uid in self._view().pods


def cluster_directory(url: str, node: str) -> PodDirectory:
    """The pod directory of ADDs. `k8s://` opens in this node's scope (its pods and the
    namespaces cached, any other pod read directly): it is the directory itself, and an
    agent never caches the whole cluster's pods. Other sources answer from their cluster
    view."""
    source = open_source(url, node=node) if url.startswith("k8s://") else open_source(url)
    return source if isinstance(source, PodDirectory) else ClusterDirectory(source)


class Reconciler:
    """DESIGN 5.5: on start and every `interval`, free this node's records whose sandbox
    the runtime positively reports gone, older than the ADD grace (the rules are
    `ipward.gc`'s; only `sandbox-gone` applies here, the runtime being the one source
    asked). A runtime that cannot be read, or that lists two ready sandboxes for one pod,
    frees nothing; the next try comes sooner (1 s, doubling up to `interval`)."""

    def __init__(
        self,
        agent: Agent,
        source: LivenessSource,
        *,
        grace: float,
        interval: float,
    ) -> None:
        self.agent = agent
        self.source = source
        self.grace = grace
        self.interval = interval
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(timeout=10)  # a source call ends within its own timeout
        self.source.close()

    def _loop(self) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            try:
                done = self.run_once() is not None
            except StoreError as e:
                log.warning("reconcile: store unreachable", node=self.agent.node, error=str(e))
                done = False
            except Exception as e:  # never let the thread die: log and retry
                log.error(
                    "reconcile failed", node=self.agent.node, error=f"{type(e).__name__}: {e}"
                )
                done = False
            if done:
                backoff = 1.0
                self.stopping.wait(self.interval)
            else:
                self.stopping.wait(min(backoff, self.interval))
                backoff = min(backoff * 2, self.interval)

    def run_once(self) -> list[gc.Verdict] | None:
        """One pass; the records freed, or None when the runtime gave no usable view."""
        node = self.agent.node
        held = gc.snapshot(self.agent.store, node)  # records first, then the runtime
        evidence = gc.gather(self.source, [node], grace=self.grace, ask_cluster=False)
        view = evidence.nodes[node]
        if not isinstance(view, NodeView):
            self.agent.metrics.reconcile_skipped.inc()
            log.warning("reconcile: nothing freed, runtime not usable", node=node, reason=view)
            return None
        freed = []
        for h in held:
            verdict = gc.judge(h, evidence)
            if verdict.reason is None:
                continue
            if gc.free(self.agent.ledger, verdict, f"agent {node} reconcile"):
                self.agent.metrics.reconcile_freed.labels(reason=verdict.reason).inc()
                freed.append(verdict)
        self.agent.metrics.reconcile_passes.inc()
        log.debug(
            "reconciled",
            node=node,
            records=len(held),
            sandboxes=len(view.sandboxes),
            freed=len(freed),
        )
        return freed


def run_agent(
    node: str,
    store_url: str,
    socket_path: str,
    *,
    metrics_address: tuple[str, int] | None,
    allow_gid: int | None,
    max_workers: int,
    drain_seconds: float,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    stuck_seconds: float = CALL_TIMEOUT,
    duty_interval: float = 1.0,
    node_ttl: int = 10,
    liveness: str | None = None,
    add_grace: float = ADD_GRACE,
    reconcile_interval: float = 60.0,
    cluster: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status."""
    signals = [0]
    stop = threading.Event()
    cut_short = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        signals[0] += 1
        if stop.is_set():
            cut_short.set()
        stop.set()

    # Before anything that takes time: a stop asked for during start is not lost.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    source = open_source(liveness, node=node) if liveness else None
    directory = cluster_directory(cluster, node) if cluster else None
    try:
        # The schema is checked before serving: while the store cannot be reached, the
        # plugin finds no agent and answers 11, as it would for an unreachable store.
        store = open_store_waiting(store_url, stop)
    except StoreError as e:  # not usable (106), a bad URL: permanent
        log.error("store not usable; not starting", store=redact(store_url), error=str(e))
        raise AgentError(f"store {redact(store_url)}: {e}") from e
    if store is None:
        log.info("agent stopped while waiting for its store", node=node)
        for s, handler in previous.items():
            signal.signal(s, handler)
        return 0
    try:
        store_revision: int | str = store.revision()
    except StoreError as e:  # serve anyway: calls answer 11 until the store is back
        store_revision = f"unreachable ({e})"
        log.warning("store unreachable at start; serving anyway", error=str(e))
    max_connections = _descriptors_for(max_connections)
    try:
        agent = Agent(
            store,
            node,
            socket_path,
            allow_gid=allow_gid,
            max_workers=max_workers,
            max_connections=max_connections,
            stuck_seconds=stuck_seconds,
            metrics_address=metrics_address,
            directory=directory,
        )
    except OSError as e:  # the socket's directory, file, lock or owner
        store.close()
        raise AgentError(f"socket {socket_path}: {e}") from e
    except BaseException:
        store.close()
        raise
    agent.start()
    duties = NodeDuties(store, node, duty_interval, node_ttl)
    duties.start()
    reconciler = None
    if source is not None:
        reconciler = Reconciler(agent, source, grace=add_grace, interval=reconcile_interval)
        reconciler.start()
    log.info(
        "agent started",
        node=node,
        store=redact(store_url),
        store_revision=store_revision,
        socket=agent.socket.path,
        metrics=agent.metrics_url,
        pid=os.getpid(),
        uid=agent.uid,
        allow_gid=allow_gid,
        max_workers=max_workers,
        max_connections=max_connections,
        stuck_seconds=stuck_seconds,
        liveness=liveness,
        cluster=cluster,
        add_grace=add_grace,
        reconcile_interval=reconcile_interval,
    )
    while not stop.wait(1.0):
        pass
    log.info("agent stopping: new connections refused, draining", signal_count=signals[0])
    started = time.monotonic()
    agent.begin_stop()
    if reconciler is not None:
        reconciler.stop()
    duties.stop()
    left = agent.drain(drain_seconds, cut_short)
    fields = {"seconds": round(time.monotonic() - started, 3), "abandoned": left}
    if left:
        log.warning("drain incomplete: calls still running are abandoned", **fields)
    else:
        log.info("drained", **fields)
    agent.close(wait=not left)
    for s, handler in previous.items():
        signal.signal(s, handler)
    log.info("agent stopped", node=node)
    if left:
        os._exit(0)  # workers still running must not hold the interpreter's exit
    return 0


def _descriptors_for(max_connections: int) -> int:
    """Raise the open-files limit (up to its hard limit) so that `max_connections` fit
    beside what the agent needs otherwise; the number of connections that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "open-files limit too low for --max-connections; serving fewer",
            max_connections=max(soft - FD_MARGIN, 1),
            limit=soft,
        )
        return max(soft - FD_MARGIN, 1)
    return max_connections


def _parse_gid(text: str | None) -> int | None:
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    import grp

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise InvalidConfig(f"--allow-gid {text!r}: no such group") from None


@click.command("agent")
@click.option(
    "--node",
    default=lambda: os.uname().nodename,
    show_default="this host's name",
    help="The node this agent serves (its records name it; the CNI config's 'node' is ignored).",
)
@click.option(
    "--store",
    "store_url",
    envvar="IPWARD_STORE",
    help="Store URL (else IPWARD_STORE, else the global --store). The CNI config's 'store'"
    " is ignored.",
)
@click.option(
    "--socket",
    "socket_path",
    default=DEFAULT_SOCKET,
    show_default=True,
    help="Unix socket the plugin connects to ('agentSocket' in its config).",
)
@click.option(
    "--metrics-address",
    default=DEFAULT_METRICS,
    show_default=True,
    help="HOST:PORT for /metrics and /healthz, or 'off'.",
)
@click.option("--allow-gid", help="Also serve callers whose group is this (name or number).")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Append logs here (else stderr).")
@click.option(
    "--log-level",
    type=click.Choice(list(log.LEVELS)),
    default="info",
    show_default=True,
)
@click.option("--max-workers", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    help="Connections open at once; more are answered 11 at once, without being read.",
)
@click.option(
    "--stuck-seconds",
    type=click.FloatRange(1),
    default=CALL_TIMEOUT,
    show_default=True,
    help="/healthz reports the agent stuck when a request waits this long for a worker"
    " or its answer (the plugin gives up after 60 s).",
)
@click.option(
    "--drain-seconds",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, how long calls in flight may take to finish.",
)
@click.option(
    "--duty-interval",
    type=click.FloatRange(0.05),
    default=1.0,
    show_default=True,
    help="Seconds between keeping the node registered and answering block handshakes.",
)
@click.option(
    "--node-ttl",
    type=click.IntRange(1),
    default=10,
    show_default=True,
    help="Lease TTL of the node's registration (etcd raises it to at least 2).",
)
@click.option(
    "--liveness",
    help="Where the runtime lists this node's sandboxes, for reconciliation:"
    " cri:///run/containerd/containerd.sock, or sim:///PATH (the labs' simulated"
    " cluster); not k8s:// (the API lists no sandboxes). Without it, nothing is"
    " reconciled.",
)
@click.option(
    "--cluster",
    help="Where pods' annotations and owners are read for ADD (pool selection, sticky"
    " StatefulSet addresses): k8s:// or k8s://?kubeconfig=PATH (the Kubernetes API), or"
    " sim:///PATH (the labs' simulated cluster). Without it, the CNI config alone"
    " decides.",
)
@add_grace_option
@click.option(
    "--reconcile-interval",
    type=click.FloatRange(0.1),
    default=60.0,
    show_default=True,
    help="Seconds between reconciliation passes.",
)
@click.pass_context
def agent_command(
    ctx: click.Context,
    node: str,
    store_url: str | None,
    socket_path: str,
    metrics_address: str,
    allow_gid: str | None,
    log_file: str | None,
    log_level: str,
    max_workers: int,
    max_connections: int,
    stuck_seconds: float,
    drain_seconds: float,
    duty_interval: float,
    node_ttl: int,
    liveness: str | None,
    cluster: str | None,
    add_grace: float,
    reconcile_interval: float,
) -> None:
    """Serve the CNI plugin of this node over a Unix socket (one agent per node)."""
    log.configure(log_file, log_level, "ipward-agent")
    url = store_url or getattr(ctx.obj, "store_url", None)
    if not url:
        raise InvalidConfig("no store: give --store or IPWARD_STORE")
    check_node_name(node, "--node")
    status = run_agent(
        node,
        url,
        socket_path,
        metrics_address=parse_address(metrics_address),
        allow_gid=_parse_gid(allow_gid),
        max_workers=max_workers,
        max_connections=max_connections,
        stuck_seconds=stuck_seconds,
        drain_seconds=drain_seconds,
        duty_interval=duty_interval,
        node_ttl=node_ttl,
        liveness=liveness,
        add_grace=add_grace,
        reconcile_interval=reconcile_interval,
        cluster=cluster,
    )
    ctx.exit(status)


__all__ = [
    "Agent",
    "AgentError",
    "Metrics",
    "Reconciler",
    "agent_command",
    "peer_credentials",
    "run_agent",
]
