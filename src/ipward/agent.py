"""`ipward agent`: one per node. Serves the CNI plugin over a Unix socket.

The plugin (`ipward.plugin`, with `agentSocket` in its config) sends one call per
connection in the framed protocol of `ipward.wire`; the agent answers it with
`cni.answer(env, stdin, ledger)` on its single long-lived `Ledger(store, node)`, so the
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

Serving: one thread accepts, a bounded pool of workers serves, one call per
connection, with a read timeout. Protocol garbage (bad frames, oversize lengths,
non-UTF-8) closes that connection and is logged; it never stops the agent.

Stop (SIGTERM, SIGINT): the listening socket is shut down at once (new connections are
refused, and the plugin answers 11) and its file unlinked; calls in flight finish, up
to `--drain-seconds`; then the store is closed and the agent exits 0. A second signal
ends the drain early.

Metrics (Prometheus text format, on a registry of the agent's own) and `/healthz` (200
"ok" when the store answers `revision()` within HEALTH_TIMEOUT, else 503 with the
reason) are served over HTTP on `--metrics-address`, loopback by default.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import stat
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import ThreadingHTTPServer

import click
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from ipward import blocks, cni, gc, jsonc, log
from ipward import records as rec
from ipward.config import check_node_name
from ipward.errors import InvalidConfig, IpwardError, TryAgainLater
from ipward.ledger import ADD_GRACE, Ledger
from ipward.liveness import (
    ClusterView,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    open_source,
)
from ipward.pool import PoolSpec
from ipward.selection import PodDirectory, PodMeta
from ipward.serving import HealthProbe, add_grace_option, parse_address, redact, start_http
from ipward.store import Store, StoreError, open_store_waiting
from ipward.store.base import Put
from ipward.wire import MAX_FRAME, WireError, decode_env, frame, recv_frame

DEFAULT_SOCKET = "/run/ipward/agent.sock"
DEFAULT_METRICS = "127.0.0.1:9310"
DIR_MODE = 0o750
SOCKET_MODE = 0o660
READ_TIMEOUT = 10.0  # a plugin sends its whole request at once; a stalled peer is cut off
REFUSED_READ_TIMEOUT = 1.0  # a refused peer gets this long to send (for its cniVersion)
WRITE_TIMEOUT = 10.0
HEALTH_TIMEOUT = 2.0
PROBE_TIMEOUT = 1.0  # connecting to an existing socket to see whether an agent answers
PEER_REFUSED = 5  # CNI "I/O failure": see the module docstring for why not 11
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_COMMAND_LABELS = frozenset(cni.COMMANDS)
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
            "Connections being served (reading, answering or writing the answer).",
            registry=self.registry,
        )
        self.protocol_errors = Counter(
            "ipward_agent_protocol_errors",
            "Connections closed without an answer: not our protocol, too large, too slow,"
            " or the peer went away.",
            registry=self.registry,
        )
        self.refused = Counter(
            "ipward_agent_refused_peers",
            "Connections refused by the peer credential check.",
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
    return str(code) if isinstance(code, int) else str(cni.INTERNAL_ERROR)


def _network_of(stdin: bytes) -> str | None:
    try:
        name = jsonc.loads(stdin).get("name")
    except Exception:  # only for the log line
        return None
    return name if isinstance(name, str) else None


def _error_object(stdin: bytes, code: int, msg: str) -> bytes:
    from ipward.plugin import _string_field

    version = _string_field(stdin, b"cniVersion") or "1.0.0"
    return (jsonc.dumps({"cniVersion": version, "code": code, "msg": msg}) + "\n").encode()


class Agent:
    def __init__(
        self,
        store: Store,
        node: str,
        socket_path: str,
        *,
        allow_gid: int | None = None,
        max_workers: int = 16,
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
        self.stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="serve")
        self._futures: set[Future[None]] = set()
        self._futures_lock = threading.Lock()
        self.socket = AgentSocket(socket_path, allow_gid, backlog=max(128, 4 * max_workers))
        self.http: ThreadingHTTPServer | None = None
        try:
            if metrics_address is not None:
                probe = HealthProbe(store)

                def health() -> tuple[bool, str]:
                    if self.stopping.is_set():
                        return False, "stopping"
                    ok, reason = probe.check()
                    return ok, "ok" if ok else reason

                self.http = start_http(
                    metrics_address, self.metrics.registry, health, "ipward-agent"
                )
        except BaseException:
            self.socket.shutdown()
            self.socket.close()
            raise
        self._acceptor = threading.Thread(target=self._accept_loop, name="accept", daemon=True)

    @property
    def metrics_url(self) -> str | None:
        if self.http is None:
            return None
        address, port = self.http.server_address[:2]
        host = address.decode() if isinstance(address, bytes) else str(address)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._acceptor.start()

    # -- accepting ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self.socket.sock
        while not self.stopping.is_set():
            # A worker slot first: when all are busy, callers wait in the listen backlog
            # instead of in an unbounded queue inside the agent.
            if not self._slots.acquire(timeout=0.5):
                continue
            try:
                conn, _ = listener.accept()
            except OSError as e:
                self._slots.release()
                if self.stopping.is_set():
                    break
                log.warning("accept failed", error=str(e))
                time.sleep(0.05 if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM) else 0)
                continue
            future = self._pool.submit(self._serve, conn)
            with self._futures_lock:
                self._futures.add(future)
            future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        with self._futures_lock:
            self._futures.discard(future)
        self._slots.release()

    # -- serving -----------------------------------------------------------------------

    def _allowed(self, conn: socket.socket, uid: int, gid: int) -> bool:
        """Root, the agent's own user, or (with --allow-gid) a member of that group:
        by the peer's effective gid or its supplementary groups, as file permissions
        on the socket would judge it."""
        if uid in (0, self.uid):
            return True
        if self.allow_gid is None:
            return False
        return gid == self.allow_gid or self.allow_gid in peer_groups(conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn, self.metrics.in_flight.track_inprogress():
            try:
                self._serve_one(conn)
            except Exception:  # a bug here must cost one connection, never the agent
                import traceback

                log.error("serving a connection failed", traceback=traceback.format_exc())
                self.metrics.protocol_errors.inc()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            log.warning("cannot read the peer's credentials; closing", error=str(e))
            self.metrics.protocol_errors.inc()
            return
        if not self._allowed(conn, uid, gid):
            self._refuse(conn, pid, uid, gid)
            return
        conn.settimeout(READ_TIMEOUT)
        try:
            env = decode_env(recv_frame(conn.recv))
            stdin = recv_frame(conn.recv)
        except (WireError, OSError, UnicodeDecodeError) as e:
            self.metrics.protocol_errors.inc()
            log.warning(
                "protocol error; connection closed",
                error=f"{type(e).__name__}: {e}",
                peer_pid=pid,
                peer_uid=uid,
            )
            return
        command = env.get("CNI_COMMAND", "")
        label = command if command in _COMMAND_LABELS else "other"
        started = time.monotonic()
        status, out = cni.answer(env, stdin, self.ledger, self.directory)  # never raises
        code = "0" if status == 0 else _code_of(out)
        delivered = self._send(conn, status, out.encode())
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
            "peer_pid": pid,
        }
        if status != 0:
            log.warning("request failed", msg_sent=out.strip(), **fields)
        else:
            log.debug("request", **fields)
        if delivered is not None:
            # Whatever was committed stays committed: a retried ADD gets the same address.
            log.warning("answer not delivered", error=delivered, **fields)

    def _send(self, conn: socket.socket, status: int, out: bytes) -> str | None:
        """Send the answer frame; None when sent, else why not."""
        if len(out) + 1 > MAX_FRAME:
            out = _error_object(b"", cni.INTERNAL_ERROR, "answer too large for the protocol")
            status = 1
        try:
            conn.settimeout(WRITE_TIMEOUT)
            conn.sendall(frame(bytes((status,)) + out))
        except (OSError, WireError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _refuse(self, conn: socket.socket, pid: int, uid: int, gid: int) -> None:
        self.metrics.refused.inc()
        conn.settimeout(REFUSED_READ_TIMEOUT)
        command, stdin = "", b""
        try:  # read what it sent (bounded, briefly): the answer is in its cniVersion
            env = decode_env(recv_frame(conn.recv))
            command = env.get("CNI_COMMAND", "")
            stdin = recv_frame(conn.recv)
        except (WireError, OSError, UnicodeDecodeError):
            pass
        allowed = f"root, uid {self.uid}" + (
            f", gid {self.allow_gid}" if self.allow_gid is not None else ""
        )
        msg = (
            f"permission denied: the ipward agent serves {allowed}; this call came from"
            f" uid {uid} gid {gid} (nothing was done)"
        )
        log.warning(
            "refused a peer", peer_pid=pid, peer_uid=uid, peer_gid=gid, command=command or None
        )
        label = command if command in _COMMAND_LABELS else "other"
        self.metrics.requests.labels(command=label, code=str(PEER_REFUSED)).inc()
        self._send(conn, 1, _error_object(stdin, PEER_REFUSED, msg))

    # -- stopping ----------------------------------------------------------------------

    def begin_stop(self) -> None:
        """Refuse new connections from now on; calls in flight go on."""
        self.stopping.set()
        self.socket.shutdown()

    def drain(self, seconds: float, cut_short: threading.Event | None = None) -> int:
        """Wait for the calls in flight, at most `seconds`; returns how many are left."""
        self._acceptor.join()
        self.socket.close()  # after the acceptor: what it accepted is in flight
        deadline = time.monotonic() + seconds
        while True:
            with self._futures_lock:
                left = len(self._futures)
            if not left or time.monotonic() >= deadline:
                return left
            if cut_short is not None and cut_short.is_set():
                return left
            time.sleep(0.01)

    def close(self, wait: bool) -> None:
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
        self.store.txn([], [Put(rec.node_key(self.node), value, lease=self.lease)])
        log.info("node registered", node=self.node, lease=self.lease, ttl=self.ttl)

    def answer_handshakes(self) -> list[tuple[str, str]]:
        """Answer every marked block of this node; returns (block, answer) pairs."""
        answered = []
        for pool_kv in self.store.range("pools/")[0]:
            spec = PoolSpec.from_dict(rec.decode(pool_kv.value))
            owned, _ = self.store.range(rec.affinity_prefix(spec.name, self.node))
            for entry in owned:
                kv = self.store.get(rec.block_key(spec.name, blocks.cidr_of(entry.key)))
                if kv is None or rec.decode(kv.value).get("state") != rec.MARKED:
                    continue
                result = blocks.answer(self.store, spec, kv, time.time())
                if result is not None:
                    answered.append((blocks.cidr_of(kv.key), result))
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
    directory = ClusterDirectory(open_source(cluster)) if cluster else None
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
    try:
        agent = Agent(
            store,
            node,
            socket_path,
            allow_gid=allow_gid,
            max_workers=max_workers,
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
    " cri:///run/containerd/containerd.sock, or sim:///PATH (the simulated cluster)."
    " Without it, nothing is reconciled.",
)
@click.option(
    "--cluster",
    help="Where pods' annotations and owners are read for ADD (pool selection, sticky"
    " StatefulSet addresses): sim:///PATH (the simulated cluster). Without it, the CNI"
    " config alone decides.",
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
