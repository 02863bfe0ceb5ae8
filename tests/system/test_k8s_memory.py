"""The memory lab's pieces work (the figures themselves are measured by
`python -m ipward_lab.bench.k8s_memory`, never asserted: they depend on the machine)."""

from __future__ import annotations

from ipward_lab.bench.k8s_memory import measure


def test_memory_lab_measures_both_scopes() -> None:
    figures = measure(pods=330, per_node=110, namespaces=3)
    assert figures["nodes"] == 3
    assert figures["controller"]["pods"] == 330  # the whole cluster cached
    assert figures["agent"]["pods"] == 110  # node-0's pods only
    for scope in ("controller", "agent"):
        f = figures[scope]
        assert 0 < f["baseline"] <= f["rss"] <= f["peak"]
