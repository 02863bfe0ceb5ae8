"""The plugin <-> agent protocol over a Unix stream socket: one request, one answer.

    request  = frame(env) frame(stdin)
    answer   = frame(status + stdout)
    frame(b) = 4-byte big-endian length, then b

`env` is the call's CNI_* variables as `KEY=VALUE` lines (UTF-8); `stdin` is the
network configuration exactly as the runtime gave it; the answer's first byte is the
plugin's exit status and the rest is what it prints on stdout, verbatim. Nothing to
parse on the plugin's side, so its hot path needs neither `json` nor `struct`.
"""

from __future__ import annotations

MAX_FRAME = 1 << 20  # a network config or an answer is a few KiB; refuse anything absurd
CNI_ENV = (
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
)


class WireError(Exception):
    """The peer sent something that is not our protocol, or went away mid-message."""


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise WireError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return len(payload).to_bytes(4, "big") + payload


def encode_env(env: dict[str, str]) -> bytes:
    return "".join(f"{k}={env[k]}\n" for k in CNI_ENV if k in env).encode()


def decode_env(raw: bytes) -> dict[str, str]:
    env = {}
    for line in raw.decode().split("\n"):
        if line:
            key, sep, value = line.partition("=")
            if not sep or key not in CNI_ENV:
                raise WireError(f"bad environment line {line!r}")
            env[key] = value
    return env


def recv_exact(recv: object, n: int) -> bytes:
    """Read exactly `n` bytes with `recv` (a socket's recv)."""
    chunks = []
    while n:
        chunk = recv(min(n, 65536))  # type: ignore[operator]
        if not chunk:
            raise WireError("connection closed mid-message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(recv: object) -> bytes:
    size = int.from_bytes(recv_exact(recv, 4), "big")
    if size > MAX_FRAME:
        raise WireError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return recv_exact(recv, size)
