"""The executable's entry point (`ipward install-cni` writes a launcher calling `main`).

Cluster mode: the network config names the node agent's socket in `ipam.agentSocket`,
and nowhere else counts. The config is parsed (`startpath.json_loads`, CPython's C scanner) and only
that field of the `ipam` section is read: a key of that name anywhere else, such as in
`args.cni`, which Multus fills from pod annotations, is only data. The call is then sent
(`ipward.cni.wire`) and the agent's answer printed as is, but only to an agent the plugin
can trust: the socket file must be owned by root or by the plugin's own user, and so
must the process listening on it (SO_PEERCRED, read after connecting and before a byte
is sent). Anything else is refused with code 5 and nothing is sent. This path imports
only `_socket`, `posix` (the C module under `os`, whose Python layer alone costs
~0.8 ms), `core.startpath` and `wire`, so it costs little over the interpreter's own start.

Everything else runs `ipward.cni.verbs` in-process on SQLite (single-node mode), which also
answers VERSION (it needs no agent) and a configuration over `wire.MAX_CONFIG` (107),
whatever the config says, so both paths give the same answers to the same input.
"""

from __future__ import annotations

import posix
import sys

from ipward.cni.wire import CALL_TIMEOUT, FORWARDED, MAX_CONFIG, WireError, agent_socket
from ipward.core.startpath import json_loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    import _socket
    from collections.abc import Callable, Mapping
    from typing import NoReturn

_S_IFMT, _S_IFSOCK = 0o170000, 0o140000


def read_stdin() -> bytes:
    """The network configuration, read up to one byte past its limit (enough to refuse
    it; a runtime closes stdin, so this never waits for more)."""
    try:
        return sys.stdin.buffer.read(MAX_CONFIG + 1)
    except (AttributeError, OSError, ValueError):  # no stdin at all
        return b""


def trusted_uids() -> tuple[int, ...]:
    """Whose socket and agent the plugin talks to: root and its own (effective) user."""
    return (0, posix.geteuid())


class Refused(WireError):
    """The call cannot get through and retrying cannot help (code 5): the socket or the
    process behind it is not root's or ours, or the caller is kept out. Nothing was
    sent."""


def _failed(step: str, error: OSError) -> WireError:
    """Why `step` failed, in the words the native plugin uses too (`strerror`)."""
    reason = f"{step}: {error.strerror or error}"  # a socket timeout has no strerror
    return Refused(reason) if isinstance(error, PermissionError) else WireError(reason)


def forward(
    path: str,
    env: Mapping[str, str | bytes],
    stdin: bytes,
    timeout: float = CALL_TIMEOUT,
    before_sending: Callable[[], None] | None = None,
) -> tuple[int, bytes]:
    """Send one call to the agent at `path`; its exit status and stdout. Raises
    `Refused` when the socket or the process behind it is not root's or ours (nothing
    is sent then), `wire.WireError` when no answer comes, each saying why in the words
    of the native plugin (src/ipward/cni/native). `before_sending` runs once the agent is
    trusted, before a byte is sent (an ADD's note); what it raises, nothing is sent."""
    import _socket

    from ipward.cni.wire import NO_ANSWER, encode_request, read_answer

    request = encode_request(env, stdin)
    trusted = trusted_uids()
    try:
        st = posix.stat(path)
    except OSError as e:
        raise _failed("stat", e) from None
    if st.st_mode & _S_IFMT != _S_IFSOCK:
        raise Refused(f"{path} is not a socket")
    if st.st_uid not in trusted:
        raise Refused(
            f"{path} is owned by uid {st.st_uid}; the plugin talks only to a socket of root"
            f" or of its own uid {trusted[-1]}"
        )
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError as e:
        raise _failed("socket", e) from None
    try:
        sock.settimeout(timeout)
        _connect(sock, path, timeout)
        try:
            raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        except OSError as e:
            raise _failed("SO_PEERCRED", e) from None
        peer_pid = int.from_bytes(raw[0:4], sys.byteorder)
        peer_uid = int.from_bytes(raw[4:8], sys.byteorder)
        if peer_uid not in trusted:
            raise Refused(
                f"the process listening on {path} (pid {peer_pid}) runs as uid {peer_uid};"
                f" the plugin talks only to an agent of root or of its own uid {trusted[-1]}"
            )
        if before_sending is not None:
            before_sending()
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered without reading all of it (busy, or refused): read that
        except OSError as e:
            raise _failed("send", e) from None
        try:
            return read_answer(sock.recv)
        except ConnectionResetError as e:
            raise WireError(f"{NO_ANSWER}: {e.strerror}") from None
        except OSError as e:
            raise _failed("recv", e) from None
    finally:
        sock.close()


def _connect(sock: _socket.socket, path: str, timeout: float) -> None:
    """Connect, waiting while the listen backlog is full: a Unix socket with a timeout
    says EAGAIN at once then, where a blocking one would wait for room."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError as e:
            if time.monotonic() > deadline:
                raise _failed("connect", e) from None
            time.sleep(0.002)
        except OSError as e:
            raise _failed("connect", e) from None


def _unreachable(stdin: bytes, path: str, command: bytes | None, error: Exception) -> bytes:
    """The error object when the agent gave no answer (never success: nothing was done)."""
    from ipward.cni.cniio import error_output
    from ipward.cni.notes import NoteFailure
    from ipward.core.errors import IoFailure, IpwardError, NotAvailable, TryAgainLater

    answer: IpwardError
    if command == b"STATUS":
        answer = NotAvailable(f"cannot serve ADD: ipward agent at {path}: {error}")
    elif isinstance(error, NoteFailure):
        answer = TryAgainLater(f"ADD not sent to the ipward agent at {path}: {error.strerror}")
    elif isinstance(error, Refused):  # retrying cannot help
        answer = IoFailure(f"ipward agent at {path} not usable ({error}); nothing was sent")
    else:
        what = "nothing was freed; retry the DEL" if command == b"DEL" else "try again later"
        answer = TryAgainLater(f"ipward agent at {path} unreachable ({error}); {what}")
    return error_output(answer, stdin).encode()


def configured(stdin: bytes, command: bytes | None) -> tuple[str | None, object]:
    """The agent socket a call goes to, with the parsed config: the `ipam.agentSocket`
    of a config within its limit that parses. No socket for VERSION (it needs no agent)
    and for anything else."""
    if len(stdin) > MAX_CONFIG or command == b"VERSION":
        return None, None
    try:
        config = json_loads(stdin)
    except Exception:  # not JSON: answered without an agent (code 6)
        return None, None
    return agent_socket(config), config


def attachment_note(config: object) -> bytes | None:
    """The note of the call's attachment (docs/design.md 5.14), if it names one."""
    from ipward.cni import notes

    network = config.get("name") if isinstance(config, dict) else None
    return notes.note_path(network, posix.environ)


def send(path: str, stdin: bytes, command: bytes | None, config: object) -> NoReturn:
    """Forward the call to the agent at `path`, print its answer (or why none came) and
    exit with its status. An ADD notes its attachment before it is sent; a DEL served
    removes the note, and a DEL that got no answer succeeds when there is none (nothing
    can be held: docs/design.md 5.14)."""
    from ipward.cni import notes

    environ = posix.environ
    env = {name: environ[name.encode()] for name in FORWARDED if name.encode() in environ}
    note = attachment_note(config) if command in (b"ADD", b"DEL") else None
    before_sending = None
    if command == b"ADD" and note is not None:
        agent, note_of_add = path, note

        def before_sending() -> None:
            notes.write(note_of_add, agent)

    try:
        status, out = forward(path, env, stdin, before_sending=before_sending)
    except Exception as e:  # any failure to get an answer is an error, never success
        if command == b"DEL" and not notes.held(note):
            finish(0, b"")
        status, out = 1, _unreachable(stdin, path, command, e)
    if command == b"DEL" and status == 0:
        notes.remove(note)
    finish(status, out)


def finish(status: int, out: bytes) -> NoReturn:
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    posix._exit(status)


def main() -> None:
    stdin = read_stdin()
    command = posix.environ.get(b"CNI_COMMAND")
    path, config = configured(stdin, command)
    if path is None:
        from ipward.cni.verbs import main as in_process

        in_process(stdin)
        return
    send(path, stdin, command, config)
