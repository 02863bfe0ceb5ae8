"""Waiting for a condition, bounded: what the tests and the labs' scenario worlds wait
with instead of a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    condition: Callable[[], Any], what: str, timeout: float = 60.0, poll: float = 0.05
) -> Any:
    """Poll until `condition()` is truthy; its value. The timeout bounds a wait, it never
    asserts a speed: on a loaded machine things are slow, not wrong."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")
        time.sleep(poll)
