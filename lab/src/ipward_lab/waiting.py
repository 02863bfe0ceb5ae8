"""Waiting for a condition, bounded: what the tests and the labs' scenario worlds wait
with instead of a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    condition: Callable[[], Any],
    what: str,
    timeout: float = 60.0,
    poll: float = 0.05,
    *,
    failure: type[Exception] = AssertionError,
    passing: tuple[type[Exception], ...] = (),
) -> Any:
    """Poll until `condition()` is truthy; its value. The timeout bounds a wait, it never
    asserts a speed: on a loaded machine things are slow, not wrong. `failure`: what is
    raised after the timeout (a test's AssertionError, a lab's own error); `passing`:
    errors a poll may raise that mean "not yet" (the last is named in the failure)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = condition()
        except passing as e:
            last, value = e, None
        if value:
            return value
        if time.monotonic() > deadline:
            raise failure(
                f"gave up after {timeout:g}s waiting for {what}" + (f" ({last})" if last else "")
            )
        time.sleep(poll)
