"""The unit layer starts no process and opens no socket: a test that tries fails,
naming what it tried (such a test belongs in `tests/system`)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import pytest


def _refused(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a unit test {what}: it belongs in tests/system")

    return refuse


@pytest.fixture(autouse=True)
def no_process_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, _refused(f"starts a process (os.{name})"))
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refused("starts a process"))
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _refused(f"opens a socket ({name})"))
