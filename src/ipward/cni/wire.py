"""The plugin <-> agent protocol over a Unix stream socket: one request and one answer
per connection. This is version 2; version 1 sent the variables as `KEY=VALUE` lines, so
a newline inside a value (a container ID, `CNI_ARGS`) could add a variable of its
choosing, turning a CHECK into a DEL or an ADD for one container into an ADD for another.

    request = "IPWARDQ" version length body      length: of body
    body    = count (field(name) field(value)){count} field(stdin)
    answer  = "IPWARDA" version status field(stdout)
    field   = length, then that many bytes
    length  = 4 bytes, big-endian;  version, count, status = 1 byte each

`count` variables follow, each by name (one of FORWARDED, at most once) and value. The
values are the bytes of the plugin's environment as they are, `stdin` is the network
configuration exactly as the runtime gave it, and `stdout` is what the plugin prints,
verbatim, with `status` its exit status. Every byte of a value is data, counted by its
field's length: no value can end a field, add a variable or change another.

The agent decodes the values as `env_text` says (UTF-8, undecodable bytes kept as
surrogates, as Python decodes `os.environ`) and the in-process plugin decodes its own
environment the same way (`environment`), so `verbs.answer` sees the same call on both
paths and validates it the same way: what one path refuses, the other refuses with the
same code.

Limits: stdin at most MAX_CONFIG (the network configuration's documented limit, the
same on both paths: code 107), a value at most MAX_VALUE (Linux's limit for one
environment string: whatever a runtime can pass fits), an answer at most MAX_ANSWER.

Versions: a request that does not carry this version's magic gets an answer that says
so, with code 11 (a rolling upgrade replaces the plugin next to its agent, and the
runtime's retry then goes through): a version 1 plugin (its request starts with a zero
byte, the top of a 4-byte length) in version 1's answer format, which it prints; a
later version in this format. A version 1 agent closes the connection on a version 2
request without answering (the magic read as a length is too large); the plugin answers
11 and says why that may be.

Standard library only and nothing costly to import: the plugin loads this on every call.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

VERSION = 2
REQUEST_MAGIC = b"IPWARDQ" + bytes((VERSION,))
ANSWER_MAGIC = b"IPWARDA" + bytes((VERSION,))
REQUEST_HEADER = len(REQUEST_MAGIC) + 4  # magic and the body's length
ANSWER_HEADER = len(ANSWER_MAGIC) + 1 + 4  # magic, status and stdout's length
FORWARDED = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS")
MAX_CONFIG = 1 << 20  # bytes of network configuration on stdin (README: limits)
MAX_VALUE = 128 << 10  # bytes of one variable: Linux's MAX_ARG_STRLEN
MAX_ANSWER = 4 << 20  # a result echoes the config's dns and routes, JSON-escaped (<= 3x)
MAX_REQUEST = 1 + sum(8 + len(n) + MAX_VALUE for n in FORWARDED) + 4 + MAX_CONFIG
MAX_SOCKET_PATH = 107  # bytes: sun_path holds 108 with its terminating NUL
CALL_TIMEOUT = 60.0  # seconds a plugin waits for the agent's answer


NO_ANSWER = (
    "the agent closed the connection without answering (it stopped, or it is older than"
    f" this plugin and does not speak wire protocol {VERSION})"
)


class WireError(Exception):
    """The peer sent something that is not this protocol, or went away mid-message."""


class TooLarge(WireError):
    """A request or one of its fields is over its limit (code 107)."""


class VersionMismatch(WireError):
    """A request of another protocol version; `legacy` for version 1."""

    def __init__(self, msg: str, legacy: bool) -> None:
        super().__init__(msg)
        self.legacy = legacy


def env_text(raw: bytes) -> str:
    """A variable's value as both paths see it (as Python decodes `os.environ`)."""
    return raw.decode("utf-8", "surrogateescape")


def environment(environ: Mapping[bytes, bytes]) -> dict[str, str]:
    """The FORWARDED variables of a process environment (`os.environb`), decoded."""
    return {n: env_text(environ[n.encode()]) for n in FORWARDED if n.encode() in environ}


def agent_socket(config: object) -> str | None:
    """The agent socket a parsed network configuration names: `ipam.agentSocket` (or
    `ipam.agent_socket`) and nowhere else. None when it names none, or nothing usable as
    a socket path: the in-process path then refuses the config, naming the field."""
    ipam = config.get("ipam") if isinstance(config, dict) else None
    if not isinstance(ipam, dict):
        return None
    path = ipam.get("agentSocket", ipam.get("agent_socket"))
    if path == "" or socket_path_problem(path) is not None:
        return None
    assert isinstance(path, str)
    return path


def socket_path_problem(path: object) -> str | None:
    """What makes `path` unusable as the agent's socket path, or None."""
    if not isinstance(path, str):
        return "must be a string"
    try:
        raw = path.encode()
    except UnicodeEncodeError:  # a JSON escape can make one: no path has it
        return "must be Unicode text (it has a lone surrogate)"
    if not raw.startswith(b"/"):
        return "must be an absolute path"
    if b"\0" in raw:
        return "must not contain a NUL byte"
    if len(raw) > MAX_SOCKET_PATH:
        return f"is longer than a Unix socket path can be ({MAX_SOCKET_PATH} bytes)"
    return None


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def encode_request(env: Mapping[str, str | bytes], stdin: bytes) -> bytes:
    """The request for one call: the FORWARDED variables found in `env` (bytes as they
    are; text encoded back as Python encodes `os.environ`) and stdin."""
    if len(stdin) > MAX_CONFIG:
        raise TooLarge(f"network configuration larger than {MAX_CONFIG} bytes")
    parts = []
    for name in FORWARDED:
        value = env.get(name)
        if value is None:
            continue
        raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
        if len(raw) > MAX_VALUE:
            raise TooLarge(f"{name} is larger than {MAX_VALUE} bytes")
        parts.append(_field(name.encode()) + _field(raw))
    body = bytes((len(parts),)) + b"".join(parts) + _field(stdin)
    return REQUEST_MAGIC + len(body).to_bytes(4, "big") + body


def body_length(head: bytes) -> int | None:
    """The body length a request beginning with `head` announces, or None until its
    header is complete. Raises as soon as `head` shows that it is no request of this
    version, or too large."""
    if head[:1] == b"\0":
        raise VersionMismatch("a version 1 request (KEY=VALUE lines)", legacy=True)
    known = head[: len(REQUEST_MAGIC) - 1]
    if known != REQUEST_MAGIC[: len(known)]:
        raise WireError("not an ipward request")
    if len(head) >= len(REQUEST_MAGIC) and head[len(REQUEST_MAGIC) - 1] != VERSION:
        version = head[len(REQUEST_MAGIC) - 1]
        raise VersionMismatch(f"a version {version} request", legacy=False)
    if len(head) < REQUEST_HEADER:
        return None
    length = int.from_bytes(head[len(REQUEST_MAGIC) : REQUEST_HEADER], "big")
    if length > MAX_REQUEST:
        raise TooLarge(f"a request of {length} bytes (the limit is {MAX_REQUEST})")
    return length


def decode_body(body: bytes) -> tuple[dict[str, str], bytes]:
    """The variables and stdin of a request's body."""
    if not body:
        raise WireError("empty request body")
    env: dict[str, str] = {}
    at = 1
    for _ in range(body[0]):
        raw_name, at = _take(body, at, "a variable name", 64)
        value, at = _take(body, at, "a variable", MAX_VALUE)
        name = raw_name.decode("ascii", "replace")
        if name not in FORWARDED:
            raise WireError(f"variable {name!r} is not one the plugin forwards")
        if name in env:
            raise WireError(f"variable {name} given twice")
        env[name] = env_text(value)
    stdin, at = _take(body, at, "the network configuration", MAX_CONFIG)
    if at != len(body):
        raise WireError(f"{len(body) - at} bytes after the network configuration")
    return env, stdin


def _take(data: bytes, at: int, what: str, limit: int) -> tuple[bytes, int]:
    """The field at offset `at` and the offset after it."""
    if at + 4 > len(data):
        raise WireError(f"request cut short before {what}")
    length = int.from_bytes(data[at : at + 4], "big")
    if length > limit:
        raise TooLarge(f"{what} of {length} bytes (the limit is {limit})")
    end = at + 4 + length
    if end > len(data):
        raise WireError(f"request cut short inside {what}")
    return data[at + 4 : end], end


def encode_answer(status: int, stdout: bytes) -> bytes:
    if len(stdout) > MAX_ANSWER:
        raise TooLarge(f"an answer of {len(stdout)} bytes (the limit is {MAX_ANSWER})")
    return ANSWER_MAGIC + bytes((status,)) + _field(stdout)


def encode_legacy_answer(status: int, stdout: bytes) -> bytes:
    """An answer a version 1 plugin reads: one frame of status and stdout."""
    return _field(bytes((status,)) + stdout)


def read_answer(recv: Callable[[int], bytes]) -> tuple[int, bytes]:
    """(exit status, stdout) of the answer read with `recv` (a socket's recv)."""
    head = _recv_exact(recv, ANSWER_HEADER, first=True)
    if head[: len(ANSWER_MAGIC)] != ANSWER_MAGIC:
        raise WireError("the answer is not ipward wire protocol 2 (another program there?)")
    length = int.from_bytes(head[len(ANSWER_MAGIC) + 1 :], "big")
    if length > MAX_ANSWER:
        raise WireError(f"an answer of {length} bytes (the limit is {MAX_ANSWER})")
    return head[len(ANSWER_MAGIC)], _recv_exact(recv, length)


def _recv_exact(recv: Callable[[int], bytes], n: int, first: bool = False) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = recv(min(n - got, 65536))
        if not chunk:
            if first and not got:
                raise WireError(NO_ANSWER)
            raise WireError("the agent's answer was cut short")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
