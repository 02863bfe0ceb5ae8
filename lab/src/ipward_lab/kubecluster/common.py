"""What every part of the cluster lab uses: its error, a command run, a wait."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Sequence
from typing import Any

from ipward_lab import waiting

CALL_TIMEOUT = 60.0
READY_TIMEOUT = 180.0  # a daemon of the lab, or every node, ready


class ClusterError(RuntimeError):
    """The cluster could not be made, reached or removed; the message says why."""


def run(args: Sequence[str], timeout: float = CALL_TIMEOUT, **kw: Any) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(args)} timed out after {timeout:g}s") from e
    if proc.returncode != 0:
        out = proc.stderr.strip() or proc.stdout.strip()
        raise ClusterError(f"{' '.join(args)} exited {proc.returncode}: {out[-3000:]}")
    return proc.stdout


# The lab's waits: a ClusterError after the timeout; a poll failing to reach a daemon
# yet (an OSError, a refused call, half-written output) means "not yet".
wait_for = functools.partial(
    waiting.wait_for, failure=ClusterError, passing=(OSError, ValueError, ClusterError)
)
