"""The logs of one namespace's pods on every node of a cluster lab, followed from the
nodes' log directories (`/var/log/pods`, each node's own dir on the machine) while they
run: a kubelet removes a deleted pod's logs within a minute or so, and what a pod said
before it went (an agent rolled, killed or deleted) is what a story may need to know.

Only JSON lines are kept (ipward's logs are JSON lines, `ipward.core.log`), each with
where it came from (`LogLine`)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipward_lab.kubecluster.state import ClusterState

NODE_POD_LOGS = "var-log/pods"  # the node's /var/log/pods, in its dir on the machine


@dataclass(frozen=True)
class LogLine:
    node: str
    pod: str  # the pod's log directory: NAMESPACE_NAME_UID
    container: str
    fields: dict[str, Any]

    @property
    def ts(self) -> float:
        """When it was logged (ipward's `ts`, the writer's wall clock); 0 when not said."""
        ts = self.fields.get("ts")
        return float(ts) if isinstance(ts, int | float) else 0.0


class PodLogs:
    """The JSON log lines of the pods of `namespace` on every node, read every
    `interval` seconds in a thread (`start`, `stop`) and at once by `read`."""

    def __init__(self, lab: ClusterState, namespace: str, interval: float = 1.0) -> None:
        self.lab = lab
        self.namespace = namespace
        self.interval = interval
        self.lock = threading.Lock()
        self.lines: list[LogLine] = []
        self._files: dict[Path, tuple[int, bytes]] = {}  # offset read, a line not ended yet
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pod-logs", daemon=True)

    def start(self) -> PodLogs:
        self.read()
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):  # a directory removed mid-walk: next time
                self.read()

    def read(self) -> None:
        """Every line written since the last read, of every log file there is now."""
        with self.lock:
            for node in self.lab.nodes:
                base = Path(node.dir) / NODE_POD_LOGS
                for path in sorted(base.glob(f"{self.namespace}_*/*/*.log")):
                    self._read_file(node.name, path)

    def _read_file(self, node: str, path: Path) -> None:
        offset, partial = self._files.get(path, (0, b""))
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        *complete, rest = (partial + data).split(b"\n")
        self._files[path] = (offset + len(data), rest)
        pod, container = path.parent.parent.name, path.parent.name
        for entry in complete:
            # CRI log format: TIME STREAM TAG MESSAGE (tag P: a part, F: the full line's
            # last part); ipward's lines are short, written whole.
            parts = entry.decode(errors="replace").split(" ", 3)
            if len(parts) < 4 or parts[2] != "F":
                continue
            with contextlib.suppress(ValueError):
                fields = json.loads(parts[3])
                if isinstance(fields, dict):
                    self.lines.append(LogLine(node, pod, container, fields))

    def since(
        self, ts: float, keep: Callable[[LogLine], bool] = lambda line: True
    ) -> list[LogLine]:
        """The lines logged at wall time `ts` or later that `keep`, after a read now."""
        self.read()
        with self.lock:
            return [line for line in self.lines if line.ts >= ts and keep(line)]
