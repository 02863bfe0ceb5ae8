"""Real processes behind a simulated cluster: one `ipward agent` per simulated node, all
on one store, so the simulated kubelets' plugin calls allocate for real; and a clock
that moves only when told."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ipward import fleet


@contextmanager
def agents(
    tmp: Path, store: str, nodes: list[str], extra: tuple[str, ...] = ()
) -> Iterator[dict[str, fleet.Agent]]:
    """An agent per node (started together, then waited for), stopped at the end."""
    # Sockets in a short directory: a pytest tmp path can pass AF_UNIX's 108 bytes.
    run_dir = Path(tempfile.mkdtemp(prefix="ipw-"))
    started = {
        node: fleet.Agent(node, store, run_dir / node / "agent.sock", tmp, extra) for node in nodes
    }
    try:
        for agent in started.values():
            agent.wait_ready()
        yield started
    finally:
        for agent in started.values():
            try:
                agent.stop()
            except Exception:
                agent.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


class ManualClock:
    """A clock that moves only when told: the simulated cluster's deadlines, and the
    `as_of` it publishes, become exact."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
