"""`ipward agent`: one per node. Serves the CNI plugin over a Unix socket.

The plugin (`ipward.cni.plugin`, with `agentSocket` in its config) sends one call per
connection in the framed protocol of `ipward.cni.wire`; the agent answers it with
`verbs.answer(env, stdin, ledger)` on its single long-lived `Ledger(store, node)`, so the
config's `store` and `node` fields never matter here: the agent serves its own node
from its own store. An allocation is committed (the ledger's transaction has returned)
before its answer is sent.

Socket: its directory is created 0750 when missing (an existing one is never loosened;
a warning says when it is more open than that; an empty one of its own user is made
0750), the socket itself is 0660. A second agent on the same path (a rollout's surge)
stands by on the lock file next to the socket until the first stops, then renames its
own socket over the path (`listener.AgentSocket`: the path answers all along); a dead
agent's socket is replaced. Every connection's
peer is checked with SO_PEERCRED: root, the agent's own user and the `--allow-gid` group
are served; anyone else gets a CNI error object with code 5 (I/O failure: the plugin
could not get its call through). Not 11: retrying cannot succeed, so "try again later"
would only hide a deployment mistake behind endless retries. Nothing is read into the
ledger for a refused peer.

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

Stop (SIGTERM, SIGINT): the socket is handed over (`AgentSocket.hand_over`): connections
are accepted and served until the next agent has put its socket over the path, or, with
none within `--handover-seconds`, the socket file is unlinked (new connections then
fail, and the plugin answers 11); calls accepted finish (those still arriving are read
until their deadline), within `--drain-seconds` of the stop in all; then the store is
closed and the agent exits 0. A second signal ends the handover and the drain early.

Metrics (Prometheus text format, on a registry of the agent's own) and `/healthz` (200
"ok" when nothing is stuck, the store answers `revision()` within HEALTH_TIMEOUT and
the `--cluster` source is read as it should, else 503 with the reason: `cmd.agent`) are
served over HTTP on `--metrics-address`, loopback by default.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ipward.agent.listener import HANDOVER_WAIT, AgentSocket, peer_credentials, peer_groups
from ipward.agent.metrics import Metrics
from ipward.cluster.pods import PodDirectory
from ipward.cni import verbs, wire
from ipward.cni.wire import CALL_TIMEOUT
from ipward.core import log
from ipward.core.errors import (
    DecodeFailure,
    InputTooLarge,
    IoFailure,
    IpwardError,
    TryAgainLater,
)
from ipward.core.startpath import json_loads
from ipward.ipam.ledger import Ledger
from ipward.store import Store

REQUEST_DEADLINE = 10.0  # a plugin sends its whole request at once: all of it by then
REFUSED_DEADLINE = 1.0  # a refused peer gets this long to send (for its cniVersion)
REFUSED_READ_LIMIT = 64 << 10  # and so much of it is read; a larger request is not
WRITE_DEADLINE = 10.0  # for the rest of an answer the socket did not take at once
MAX_READING_PER_PROCESS = 8  # requests of one peer process being read at once
MAX_READING_PER_USER = 32  # ... of one peer user other than root
DEFAULT_MAX_CONNECTIONS = 1024  # open at once, in any state
IO_TICK = 0.2  # seconds between deadline checks of the I/O thread
ACCEPT_BATCH = 64  # connections accepted in a row before others' events get a turn
ACCEPT_PAUSE = 0.1  # seconds without accepting after running out of descriptors
PEER_REFUSED = 5  # CNI "I/O failure": see the module docstring for why not 11
_COMMAND_LABELS = frozenset(verbs.COMMANDS)
# -- the agent ----------------------------------------------------------------------------


def _code_of(out: str) -> str:
    try:
        code = json_loads(out).get("code")
    except Exception:  # an answer that is not an error object: count it as internal
        code = None
    return str(code) if isinstance(code, int) else str(verbs.INTERNAL_ERROR)


def _network_of(stdin: bytes) -> str | None:
    try:
        name = json_loads(stdin).get("name")
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
        directory: PodDirectory | None = None,
        sandboxes: Callable[[str], bool] | None = None,
        standby_until: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self.ledger = Ledger(store, node)
        self.directory = directory
        self.sandboxes = sandboxes
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
        self.socket = AgentSocket(
            socket_path, allow_gid, backlog=max(128, max_connections), stop=standby_until
        )
        self.socket.sock.setblocking(False)
        self._selector.register(self.socket.sock, selectors.EVENT_READ)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self._io = threading.Thread(target=self._io_loop, name="io", daemon=True)

    def start(self) -> None:
        self._io.start()

    def health(self) -> tuple[bool, str]:
        """For `/healthz`: serving as it should (else why not: stopping, or stuck)."""
        if self.stopping.is_set():
            return False, "stopping"
        stuck = self.stuck()
        return (False, stuck) if stuck is not None else (True, "ok")

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

    def _stop_accepting(self) -> None:
        try:
            self._selector.unregister(self.socket.sock)
        except (KeyError, ValueError):
            pass  # already

    def _resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self.socket.sock, selectors.EVENT_READ)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then others' events get their turn
            try:
                sock, _ = self.socket.sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                self._stop_accepting()
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
            status, out = verbs.answer(  # never raises
                env, stdin, self.ledger, self.directory, self.sandboxes
            )
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

    def begin_stop(
        self, handover: float = HANDOVER_WAIT, cut_short: threading.Event | None = None
    ) -> bool:
        """The socket handed over (`AgentSocket.hand_over`, waiting up to `handover`
        seconds for the next agent; True: to it, False: to none, its file removed);
        requests accepted go on (those still arriving are read until their deadline),
        and so does accepting: only those that reached the socket before it was
        replaced or removed come."""
        self.stopping.set()
        return self.socket.hand_over(handover, cut_short)

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
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.store.close()
