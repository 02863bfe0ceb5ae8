"""`ipward gc` and `ipward release --liveness` as subprocesses on a real SQLite store,
reading a simulated cluster's published state (`ipward_lab.simcluster`); the rules
they apply are tested on their own in `tests/unit/test_gc.py`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ipward.cluster.liveness import Pod, Sandbox
from ipward.core import records as rec
from ipward.core.pool import PoolSpec
from ipward.gc import rules as gc
from ipward.ipam.ledger import Ledger
from ipward.ipam.pools import create_pool
from ipward_lab.fleet import run_cli
from ipward_lab.simcluster import write_sim_state

SPEC = PoolSpec("p", [[{"subnet": "10.0.0.0/24"}]], cooldown=0)
WEB_0 = Pod(uid="u1", namespace="ns", name="web-0", phase="Running", node="n1")
READY = Sandbox("sb1", ready=True, namespace="ns", name="web-0", uid="u1")


def publish(path: Path, pods: list[Pod], sandboxes: list[Sandbox]) -> None:
    """Node n1's runtime and the cluster, as the simulated cluster publishes them."""
    cluster = {"pods": pods, "nodes": ["n1"], "statefulsets": {}}
    write_sim_state(str(path), time.time() + 1, cluster, {"n1": {"sandboxes": sandboxes}})


def test_ipward_gc_dry_run_then_run(tmp_path: Path, sqlite_url: str, sqlite_store) -> None:
    create_pool(sqlite_store, SPEC)
    ledger = Ledger(sqlite_store, "n1")
    live = rec.Attachment("net", "sb1", "eth0")
    leaked = rec.Attachment("net", "sbX", "eth0")
    live_ip = ledger.allocate([SPEC], live, rec.PodInfo("ns", "web-0", "u1"))[0].ip
    leaked_ip = ledger.allocate([SPEC], leaked, rec.PodInfo("ns", "old-0", "uX"))[0].ip
    state = tmp_path / "state.json"
    publish(state, [WEB_0], [READY])
    source = f"sim://{state}"
    before = sqlite_store.revision()
    dry = run_cli(
        "--json", "gc", "--dry-run", "--liveness", source, "--add-grace", "0", store=sqlite_url
    )
    assert dry.returncode == 0, dry.stderr
    out = json.loads(dry.stdout)
    assert [c["address"] for c in out["candidates"]] == [f"p/{leaked_ip}"]
    assert out["candidates"][0]["reason"] == gc.SANDBOX_GONE
    assert "sbX" in out["candidates"][0]["evidence"]
    assert out["freed"] == [] and sqlite_store.revision() == before
    # Within the grace: nothing is even a candidate.
    young = run_cli("--json", "gc", "--dry-run", "--liveness", source, store=sqlite_url)
    assert json.loads(young.stdout)["candidates"] == []
    human = run_cli(
        "gc", "--dry-run", "--all", "--liveness", source, "--add-grace", "0", store=sqlite_url
    )
    assert human.returncode == 0 and "sandbox-gone" in human.stdout and "kept" in human.stdout
    run = run_cli(
        "--json",
        "gc",
        "--liveness",
        source,
        "--add-grace",
        "0",
        "--confirm-after",
        "0.2",
        store=sqlite_url,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["freed"] == [f"p/{leaked_ip}"]
    assert [h.ip for h in gc.snapshot(sqlite_store)] == [live_ip]
    assert run_cli("check", store=sqlite_url).returncode == 0


def test_release_with_liveness_refuses_while_the_runtime_lists_the_sandbox(
    tmp_path: Path, sqlite_url: str, sqlite_store
) -> None:
    """Finding (issue 21, 7): `release --yes` freed a live pod's address. With
    `--liveness`, a sandbox its runtime lists ready keeps it (whatever the cluster
    says), as in garbage collection: exit 2, nothing changed; once the runtime no longer
    lists it, it is released, saying on what evidence."""
    create_pool(sqlite_store, SPEC)
    attachment = rec.Attachment("net", "sb1", "eth0")
    ip = Ledger(sqlite_store, "n1").allocate([SPEC], attachment, rec.PodInfo("ns", "web-0", "u1"))
    state = tmp_path / "state.json"
    publish(state, [], [READY])  # the cluster lists no pod
    release = (
        *("release", "--pool", "p", "--ip", ip[0].ip, "--yes", "--liveness", f"sim://{state}"),
        *("--node", "n1", "--add-grace", "0"),
    )
    before = sqlite_store.revision()
    refused = run_cli(*release, store=sqlite_url)
    assert refused.returncode == 2 and "not released: sandbox sb1 ready on n1" in refused.stderr
    assert sqlite_store.revision() == before
    publish(state, [], [])
    released = run_cli("--json", *release, store=sqlite_url)
    assert released.returncode == 0, released
    assert json.loads(released.stdout)["checked"].startswith(f"{gc.SANDBOX_GONE}: runtime of n1")
    assert gc.snapshot(sqlite_store) == []


def test_ipward_gc_with_unreachable_source_frees_nothing(
    tmp_path: Path, sqlite_url: str, sqlite_store
) -> None:
    create_pool(sqlite_store, SPEC)
    Ledger(sqlite_store, "n1").allocate([SPEC], rec.Attachment("net", "sb1", "eth0"), rec.PodInfo())
    before = sqlite_store.revision()
    run = run_cli(
        "--json",
        "gc",
        "--liveness",
        f"sim://{tmp_path}/never-published.json",
        "--add-grace",
        "0",
        "--confirm-after",
        "0",
        store=sqlite_url,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["candidates"] == [] and out["freed"] == []
    assert sqlite_store.revision() == before


def test_ipward_gc_bad_source_names_it(sqlite_url: str) -> None:
    res = run_cli("gc", "--dry-run", "--liveness", "k8s://cluster", store=sqlite_url)
    assert res.returncode == 2 and "k8s://cluster" in res.stderr and "Traceback" not in res.stderr
