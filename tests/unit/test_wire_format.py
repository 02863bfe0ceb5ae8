"""The plugin <-> agent wire format (`ipward.cni.wire`) cannot be confused by any byte of
any value: each comes out as exactly what went in, no other variable appears, and the
agent reads a call's environment as the in-process plugin does. (Through real agents
and the installed plugin: `tests/system/test_wire.py`.)"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from ipward.cni import wire

values = st.binary(max_size=300)


@given(env=st.dictionaries(st.sampled_from(wire.FORWARDED), values), stdin=st.binary(max_size=2000))
@settings(max_examples=300, deadline=None)
def test_any_bytes_in_any_value_round_trip(env: dict[str, bytes], stdin: bytes) -> None:
    """Newlines, '=', NULs, anything: each value comes out as exactly what went in, and
    no other variable appears."""
    request = wire.encode_request(env, stdin)
    length = wire.body_length(request[: wire.REQUEST_HEADER])
    assert length == len(request) - wire.REQUEST_HEADER
    decoded, got_stdin = wire.decode_body(request[wire.REQUEST_HEADER :])
    assert got_stdin == stdin
    assert decoded == {k: wire.env_text(v) for k, v in env.items()}
    # The same bytes through the in-process reading of an environment.
    assert wire.environment({k.encode(): v for k, v in env.items()}) == decoded


def test_the_agent_sees_what_the_in_process_plugin_sees() -> None:
    raw = b"caf\xc3\xa9\xff\n=CNI_COMMAND=DEL"
    request = wire.encode_request({"CNI_ARGS": raw}, b"{}")
    env, _ = wire.decode_body(request[wire.REQUEST_HEADER :])
    assert env == wire.environment({b"CNI_ARGS": raw}) == {"CNI_ARGS": os.fsdecode(raw)}
