"""The unit layer's guard can fail: a process started or a socket opened in a unit test
is refused (`conftest.no_process_no_socket`)."""

from __future__ import annotations

import socket
import subprocess

import pytest


def test_a_process_is_refused() -> None:
    with pytest.raises(AssertionError, match="tests/system"):
        subprocess.run(["true"], check=False)


@pytest.mark.parametrize("family", [socket.AF_UNIX, socket.AF_INET])
def test_a_socket_is_refused(family: socket.AddressFamily) -> None:
    with socket.socket(family) as s, pytest.raises(AssertionError, match="tests/system"):
        s.connect("/nonexistent" if family == socket.AF_UNIX else ("127.0.0.1", 9))
