"""The executable's entry point (`ipward install-cni` writes a launcher calling `main`).

With `agentSocket` in the ipam config (cluster mode) the call is forwarded to the node's
agent and its answer printed as is: this path imports only `_socket` and `posix` (the C
module under `os`, whose Python layer alone costs ~0.8 ms per exec) and `ipward.wire`,
so it costs little over the interpreter's own start. Without it,
`ipward.cni` runs the ledger in-process on SQLite (single-node mode).

`agentSocket` is found by scanning the raw config for the key and its plain string
value (no escapes), not by parsing JSON; a config where the scan finds nothing takes
the full in-process path, which parses properly and refuses what it must.
"""

from __future__ import annotations

import posix
import sys

AGENT_UNREACHABLE = 11


def _string_field(data: bytes, name: bytes) -> str | None:
    """The plain string value of `"name": "..."` in raw JSON, or None."""
    at = data.find(b'"' + name + b'"')
    if at < 0:
        return None
    i = at + len(name) + 2
    while i < len(data) and data[i] in b" \t\r\n":
        i += 1
    if i >= len(data) or data[i] != ord(":"):
        return None
    i += 1
    while i < len(data) and data[i] in b" \t\r\n":
        i += 1
    if i >= len(data) or data[i] != ord('"'):
        return None
    end = data.find(b'"', i + 1)
    value = data[i + 1 : end] if end > 0 else b""
    if not value or b"\\" in value:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None


def forward(
    path: str, env: dict[str, str], stdin: bytes, timeout: float = 60.0
) -> tuple[int, bytes]:
    """Send one call to the agent at `path`; its exit status and stdout."""
    import _socket

    from ipward.wire import encode_env, frame, recv_frame

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(frame(encode_env(env)) + frame(stdin))
        answer = recv_frame(sock.recv)
    finally:
        sock.close()
    if not answer:
        raise OSError("empty answer from the agent")
    return answer[0], answer[1:]


def _unreachable(stdin: bytes, path: str, error: BaseException) -> bytes:
    version = _string_field(stdin, b"cniVersion") or "1.0.0"
    command = _environ().get("CNI_COMMAND", "")
    what = "nothing was released; retry the DEL" if command == "DEL" else "try again later"
    msg = f"ipward agent at {path} unreachable ({type(error).__name__}: {error}); {what}"
    quoted = msg.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{"cniVersion":"{version}","code":{AGENT_UNREACHABLE},"msg":"{quoted}"}}\n'.encode()


def _environ() -> dict[str, str]:
    return {k.decode(): v.decode(errors="replace") for k, v in posix.environ.items()}


def main() -> None:
    stdin = sys.stdin.buffer.read()
    path = _string_field(stdin, b"agentSocket")
    if path is None:
        from ipward.cni import main as in_process

        in_process(stdin)
        return
    try:
        status, out = forward(path, _environ(), stdin)
    except Exception as e:  # any failure to get an answer is "try again", never success
        status, out = 1, _unreachable(stdin, path, e)
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    posix._exit(status)
