"""The agent's listening socket: its directory and modes, the lock against a second
agent on the same path, the handover to the agent standing by, and who is at the other
end of a connection (SO_PEERCRED, SO_PEERGROUPS). What a refused peer gets is
`server`'s."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
import threading
import time

from ipward.core import log
from ipward.core.errors import IpwardError

DEFAULT_SOCKET = "/run/ipward/agent.sock"
DIR_MODE = 0o750
LOCK_POLL = 0.1  # seconds between looks at another agent's lock, standing by
# Seconds a stopping agent serves on, waiting for its successor to put its socket over
# the path. Not a moment: in a surge roll the successor may still be starting when the
# old agent is told to stop (its pod counts as Ready by /healthz on the port the two
# share on the host, which the old agent answers), and a loaded node takes seconds to
# start it. Found on the real cluster's roll: with 2 s the path was gone before the new
# agent came, and an ADD meanwhile failed (11).
HANDOVER_WAIT = 10.0
SOCKET_MODE = 0o660
PROBE_TIMEOUT = 1.0  # connecting to an existing socket to see whether an agent answers
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Python does not name SO_PEERGROUPS; 59 is its value in asm-generic, which these use.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", None) or (
    59
    if os.uname().machine in ("x86_64", "i686", "aarch64", "armv7l", "riscv64", "s390x", "ppc64le")
    else None
)


class AgentError(IpwardError):
    """The agent cannot start as asked (the CLI prints the message, exit status 2)."""


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
    """The socket's directory, made 0750 (group `allow_gid`) when missing, or when it is
    empty and ours: made for the agent by someone else with their defaults (a
    DaemonSet's hostPath `DirectoryOrCreate` is 0755). One in use is never changed: a
    warning says when it is more open than 0750."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
        _own(directory, allow_gid)
        log.info("created socket directory", path=directory, mode=oct(DIR_MODE))
        return
    if not stat.S_ISDIR(st.st_mode):
        raise AgentError(f"{directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~DIR_MODE and st.st_uid == os.getuid() and not os.listdir(directory):
        _own(directory, allow_gid)
        log.info("made an empty socket directory 0750", path=directory, mode_was=oct(mode))
        return
    if mode & ~DIR_MODE:
        log.warning(
            "socket directory is more open than 0750; left as it is",
            path=directory,
            mode=oct(mode),
        )


def _own(directory: str, allow_gid: int | None) -> None:
    os.chmod(directory, DIR_MODE)  # makedirs' mode is filtered by the umask
    if allow_gid is not None:
        os.chown(directory, -1, allow_gid)


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


class Stopped(Exception):
    """Stopped while standing by for another agent's socket."""


class AgentSocket:
    """The listening socket, its lock file, and the checks around both.

    A second agent for the same path (the next version's, rolled out with a surge)
    stands by until the first lets the lock go (`hand_over`, as it stops). Every agent
    binds its socket beside the path, listening, and renames it over the path: the path
    names one listening socket or the other at every moment, and the first accepts until
    it sees its socket replaced, so no call finds the path missing or refused while one
    agent hands over to the next. `stop` ends the wait (`Stopped`)."""

    def __init__(
        self, path: str, allow_gid: int | None, backlog: int, stop: threading.Event | None = None
    ) -> None:
        self.path = os.path.abspath(path)
        directory = os.path.dirname(self.path)
        _prepare_directory(directory, allow_gid)
        self._lock_fd, took_over = self._lock(self.path + ".lock", stop)
        try:
            self._check_path(stale_if_silent=not took_over)
            staged = self.path + ".new"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)  # left by an agent killed before its rename
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o117)  # never reachable by others, not even for a moment
            try:
                self.sock.bind(staged)
            finally:
                os.umask(old_umask)
            os.chmod(staged, SOCKET_MODE)
            if allow_gid is not None:
                os.chown(staged, -1, allow_gid)
            st = os.stat(staged)
            self._identity = (st.st_dev, st.st_ino)
            self.sock.listen(backlog)
            os.rename(staged, self.path)
        except BaseException:
            os.close(self._lock_fd)
            raise

    @staticmethod
    def _lock(path: str, stop: threading.Event | None) -> tuple[int, bool]:
        """The lock file's descriptor, locked; and whether another agent held it first
        (it hands its socket over now)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop is None:
                    os.close(fd)
                    raise AgentError(f"another agent holds {path}; not starting") from None
            if not waiting:
                waiting = True
                log.info(
                    "another agent serves this socket; standing by to take over when it stops",
                    lock=path,
                )
            if stop.wait(LOCK_POLL):
                os.close(fd)
                raise Stopped
        if waiting:
            log.info("took the socket over from the agent before", lock=path)
        return fd, waiting

    def _check_path(self, stale_if_silent: bool) -> None:
        """What is at the path may be replaced: nothing, or a socket. With the lock held,
        a socket that answers is a stopping agent's, which let the lock go and accepts
        until its successor's socket is renamed over the path (`hand_over`), whether
        that successor stood by or started meanwhile; one nothing answers on (a killed
        agent's) is removed when `stale_if_silent` (not after standing by: the agent
        before is stopping)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentError(f"{self.path} exists and is not a socket; not touching it")
        if not stale_if_silent or _answers(self.path):
            return
        os.unlink(self.path)
        log.warning("removed a stale socket (nothing answered on it)", path=self.path)

    def _names_ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def hand_over(
        self, wait: float = HANDOVER_WAIT, cut_short: threading.Event | None = None
    ) -> bool:
        """Let the lock go, and go on accepting until an agent (standing by, or starting
        meanwhile) has renamed its socket over the path (True: it serves the path from
        now on, while this one drains). With none after `wait` seconds, or once
        `cut_short` is set (the lock taken back, so none can come meanwhile), the socket
        file is removed (False): calls fail at once from then on, as at any stopped
        agent's."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        deadline = time.monotonic() + wait
        while self._names_ours():
            over = time.monotonic() >= deadline or (cut_short is not None and cut_short.is_set())
            if over and self._relock():
                ours = self._names_ours()  # none renames over it while this holds the lock
                if ours:
                    os.unlink(self.path)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                return not ours
            time.sleep(LOCK_POLL / 10)
        return True

    def _relock(self) -> bool:
        """The lock taken again, when no agent standing by took it meanwhile."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()
        os.close(self._lock_fd)  # the lock file stays: unlinking it would race a new agent
