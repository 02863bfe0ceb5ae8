"""Test-only pauses at named points, so race tests can make two processes' steps land
exactly together: an agent between reading a block and committing an allocation in it
(`allocate`), a controller between reading a block and marking it (`mark`), garbage
collection between judging a record and its compare-and-delete (`gc-free`).

Set in a process's environment, e.g. `IPWARD_TEST_PAUSES="allocate=0.003"`; unset (as
in production) a pause is one dict lookup.
"""

from __future__ import annotations

import os
import time

_PAUSES: dict[str, float] = {}
for _item in os.environ.get("IPWARD_TEST_PAUSES", "").split(","):
    _point, _, _seconds = _item.partition("=")
    if _point and _seconds:
        _PAUSES[_point.strip()] = float(_seconds)


def pause(point: str) -> None:
    seconds = _PAUSES.get(point)
    if seconds:
        time.sleep(seconds)
