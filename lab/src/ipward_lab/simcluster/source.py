"""The `sim://` liveness source: the state file the simulated cluster publishes, its
reader (`SimFileSource`) and writer (`write_sim_state`). The product finds it through the
`ipward.liveness_sources` entry point group (`open_sim_source`), so agents and
controllers started by tests and by the soak read it with `--liveness sim:///PATH`."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from functools import partial
from typing import Any, NamedTuple

from ipward.cluster.liveness import (
    ClusterView,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    Pod,
    Sandbox,
    string_dict,
    views_or_why,
)
from ipward.core.errors import InvalidConfig


def open_sim_source(url: str, node: str = "", timeout: float = 2.0) -> SimFileSource:
    """`sim:///PATH` (every node's runtime and the cluster are in the one file: `node`
    is not needed)."""
    path = url.partition("://")[2]
    if not path:
        raise InvalidConfig(f"liveness source {url!r}: expected sim:///PATH")
    return SimFileSource(path, timeout)


class _Parsed(NamedTuple):
    """One version of the state file: (inode, mtime, size), its JSON, and the views
    built from it (by node name; "" the cluster's)."""

    version: tuple[int, int, int]
    state: dict[str, Any]
    views: dict[str, NodeView | ClusterView]


class SimFileSource(LivenessSource):
    """Reads the state the simulated cluster publishes (atomically, by rename) as JSON:

        {"as_of": <time the state reflects>,
         "cluster": {"pods": [Pod...], "nodes": [name...], "statefulsets": {"ns/n": 3},
                     "namespaces": {"ns": {annotation: value}}}
                    | {"fail": "why"} | {"stall_until": <time>},
         "runtimes": {"<node>": {"sandboxes": [Sandbox...]} | {"fail": "why"}
                                | {"stall_until": <time>}}}

    A node missing from `runtimes` is a runtime that cannot be reached (node down). A
    stall makes the call wait (at most `timeout`) and then fail, as a hung runtime does.
    """

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        self.path = path
        self.timeout = timeout
        # The file is replaced by rename, so (inode, mtime, size) names one version:
        # a pass asking for N nodes and the cluster parses it once, not N + 1 times,
        # and each view is built once per version (an unchanged pod stays the same
        # object, which is what tells the controller's collection it did not change).
        # One attribute, replaced whole: a view built from a version's state goes into
        # that version's own cache, whichever thread reads the next version meanwhile.
        self._parsed: _Parsed | None = None

    def _read(self) -> _Parsed:
        try:
            st = os.stat(self.path)
            parsed = self._parsed
            if parsed is not None and (st.st_ino, st.st_mtime_ns, st.st_size) == parsed.version:
                return parsed
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
                state = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise LivenessUnavailable(f"simulated cluster state {self.path}: {e}") from e
        if not isinstance(state, dict) or "as_of" not in state:
            raise LivenessUnavailable(f"simulated cluster state {self.path}: no as_of")
        self._parsed = _Parsed(version, state, {})
        return self._parsed

    def _answer(self, part: object, what: str) -> dict[str, Any]:
        if not isinstance(part, dict):
            raise LivenessUnavailable(f"{what}: unreachable")
        if "fail" in part:
            raise LivenessUnavailable(f"{what}: {part['fail']}")
        stall_until = part.get("stall_until")
        if stall_until is not None:
            wait = min(float(stall_until) - time.time(), self.timeout)
            if wait > 0:
                time.sleep(wait)
            raise LivenessUnavailable(f"{what}: no answer within {self.timeout:g}s")
        return part

    def node_view(self, node: str) -> NodeView:
        return self._node_view(self._read(), node)

    def node_views(self, nodes: Iterable[str]) -> dict[str, NodeView | str]:
        """All from one version of the file (one stat, not one a node)."""
        try:
            parsed = self._read()
        except LivenessUnavailable as e:
            return dict.fromkeys(nodes, str(e))
        return views_or_why(nodes, partial(self._node_view, parsed))

    def _node_view(self, parsed: _Parsed, node: str) -> NodeView:
        state = parsed.state
        built = parsed.views.get(node)
        if isinstance(built, NodeView):
            return built
        part = self._answer(state.get("runtimes", {}).get(node), f"runtime of node {node}")
        sandboxes = [Sandbox.from_dict(d) for d in part.get("sandboxes", [])]
        view = NodeView(node, float(state["as_of"]), {s.id: s for s in sandboxes})
        parsed.views[node] = view
        return view

    def cluster_view(self) -> ClusterView:
        parsed = self._read()
        state = parsed.state
        built = parsed.views.get("")
        if isinstance(built, ClusterView):
            return built
        part = self._answer(state.get("cluster"), "cluster")
        pods = [Pod.from_dict(d) for d in part.get("pods", [])]
        view = ClusterView(
            as_of=float(state["as_of"]),
            pods={p.uid: p for p in pods},
            nodes=frozenset(str(n) for n in part.get("nodes", [])),
            statefulsets={str(k): int(v) for k, v in part.get("statefulsets", {}).items()},
            namespaces={str(k): string_dict(v) for k, v in part.get("namespaces", {}).items()},
        )
        parsed.views[""] = view
        return view


def write_sim_state(
    path: str,
    as_of: float,
    cluster: dict[str, Any],
    runtimes: dict[str, dict[str, Any]],
) -> None:
    """Publish a simulated state for `SimFileSource` readers: write aside, then rename,
    so a reader sees the old state or the new one, never half of one."""
    body = {"as_of": as_of, "cluster": cluster, "runtimes": runtimes}
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, default=_encode))  # one write: json.dump writes in chunks
    os.replace(tmp, path)


def _encode(obj: object) -> object:
    if isinstance(obj, Sandbox | Pod):
        return asdict(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")
