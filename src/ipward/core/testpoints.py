"""Test-only pauses at named points, so race tests can make two processes' steps land
exactly together: an agent between reading a block and committing an allocation in it
(`allocate`), a controller between reading a block and marking it (`mark`), garbage
collection between judging a record and its compare-and-delete (`gc-free`), `pool
delete` between its check for allocations and removing the pool's keys (`pool-delete`),
`pool create` between its overlap test and the transaction that stores the pool
(`pool-create`), an IPPool object's finalizer between its pool's removal from the ledger
and the object's release (`pool-object-release`); the Kubernetes store's commit
protocol after a transaction's first lock (`kube-locking`), after all of them
(`kube-locked`), after its commit (`kube-committed`), and after marking another's
transaction aborted (`kube-aborted`).

Set in a process's environment, e.g. `IPWARD_TEST_PAUSES="allocate=0.003"` (seconds),
or as a gate, `IPWARD_TEST_GATES="pool-delete=/tmp/gates"`: at the point the process
creates `/tmp/gates/pool-delete.reached` and waits until the test creates
`/tmp/gates/pool-delete.open` (at most GATE_LIMIT seconds), so a test acts in the window
knowing it is open, without guessing a duration. Unset (as in production) a point is one
dict lookup.
"""

from __future__ import annotations

import posix
import time

GATE_LIMIT = 120.0


def _points(variable: str) -> dict[str, str]:
    points = {}
    # `posix`, not `os` (~0.5 ms per plugin exec): its environment is bytes.
    raw = posix.environ.get(variable.encode(), b"").decode(errors="surrogateescape")
    for item in raw.split(","):
        point, _, value = item.partition("=")
        if point and value:
            points[point.strip()] = value
    return points


_PAUSES = {point: float(value) for point, value in _points("IPWARD_TEST_PAUSES").items()}
_GATES = _points("IPWARD_TEST_GATES")


def pause(point: str) -> None:
    seconds = _PAUSES.get(point)
    if seconds:
        time.sleep(seconds)
    gates = _GATES.get(point)
    if gates:
        base = f"{gates}/{point}"
        with open(f"{base}.reached", "w"):
            pass
        deadline = time.monotonic() + GATE_LIMIT
        while not _exists(f"{base}.open") and time.monotonic() < deadline:
            time.sleep(0.01)


def _exists(path: str) -> bool:
    try:
        posix.stat(path)
    except OSError:
        return False
    return True
