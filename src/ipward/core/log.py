"""Structured logs: one JSON object per line, naming the attachment, address and reason.

Our own few lines rather than `logging`, whose import costs ~6 ms on every CNI plugin
exec. The CLI, the agent and the controller use the same calls, so there is one way to
log.
"""

from __future__ import annotations

import sys
import time

from ipward.core.startpath import json_dumps

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_threshold = LEVELS["warning"]
_sink = sys.stderr
_component = "ipward"
_PLAIN = (str, int, float, bool, list, dict, type(None))


def configure(path: str | None = None, level: str = "info", component: str = "ipward") -> None:
    """Send logs at `level` and above to `path` (appended), or to stderr when None."""
    global _sink, _threshold, _component
    _threshold = LEVELS.get(level, LEVELS["info"])
    _component = component
    _sink = sys.stderr
    if path:
        try:
            _sink = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as e:  # a log that cannot be written must not fail an allocation
            warning("cannot open log file; logging to stderr", path=path, error=str(e))


def event(level: str, msg: str, **fields: object) -> None:
    if LEVELS[level] < _threshold:
        return
    line = {"ts": round(time.time(), 3), "level": level, "component": _component, "msg": msg}
    line.update(fields)
    try:
        text = json_dumps({k: v if isinstance(v, _PLAIN) else str(v) for k, v in line.items()})
        _sink.write(text + "\n")
        _sink.flush()
    except (OSError, ValueError):
        pass  # a full disk or closed log must not fail an allocation


def debug(msg: str, **fields: object) -> None:
    event("debug", msg, **fields)


def info(msg: str, **fields: object) -> None:
    event("info", msg, **fields)


def warning(msg: str, **fields: object) -> None:
    event("warning", msg, **fields)


def error(msg: str, **fields: object) -> None:
    event("error", msg, **fields)
