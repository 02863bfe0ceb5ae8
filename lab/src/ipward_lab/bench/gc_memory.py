"""Figures 6 and 7 (--report), how GC and memory grow with the number of records: one
GC pass (`gc.look` and its parts, the controller's `gc_pass`) next to the raw read of
the records, and a real agent's memory after its reconcile pass next to the same agent
on an empty store."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ipward.core import keys
from ipward.core.pool import PoolSpec
from ipward.core.records import PodInfo
from ipward.store import schema
from ipward.store.sqlite import SqliteStore
from ipward_lab.bench.common import (
    AGENT_READY_TIMEOUT,
    AGENT_STOP_TIMEOUT,
    NODE,
    BenchError,
    Results,
    Timer,
    count_label,
    settled_memory,
)
from ipward_lab.bench.fill import bulk_fill
from ipward_lab.simcluster import SimFileSource, write_sim_state

RECORD_COUNTS = (1_000, 10_000, 100_000)
GC_POOL = "benchgc"
GC_SUBNET = "10.0.0.0/8"
OTHER_NODE = "bench-other-node"
RECORD_AGE = 3600.0  # seconds since the ADD of every record of the GC stores (past the grace)
AGENT_RECONCILE_TIMEOUT = 300.0


class RecordStore:
    """A SQLite store holding `records` allocation records of one node (pool
    `benchgc`, 10.0.0.0/8), every record's sandbox listed ready in a simulated
    cluster's published state: `state` with the runtime's sandboxes and the cluster's
    pods (what the controller's GC reads), `runtime_state` with the sandboxes only (what
    its agent's runtime answers), `other_state` with another node's empty runtime."""

    def __init__(self, tmp: Path, records: int) -> None:
        self.records = records
        label = count_label(records)
        self.path = str(tmp / f"records-{label}.db")
        self.state = str(tmp / f"records-{label}.state.json")
        self.runtime_state = str(tmp / f"records-{label}.runtime.json")
        self.other_state = str(tmp / f"records-{label}.other.json")
        spec = PoolSpec(GC_POOL, [[{"subnet": GC_SUBNET}]])
        now = time.time()
        store = SqliteStore(self.path)
        try:
            schema.ensure(store, self.path, create=True)  # an agent opens it: as ipward makes it
            store._conn.execute("PRAGMA synchronous=OFF")
            bulk_fill(
                store,
                spec,
                records,
                network="benchgc",
                prefix="sandbox",
                pods=lambda i: PodInfo("bench", f"pod-{i}", f"uid-{i}"),
                created_at=now - RECORD_AGE,
            )
        finally:
            store.close()
        sandboxes = [
            {
                "id": f"sandbox-{i}",
                "ready": True,
                "namespace": "bench",
                "name": f"pod-{i}",
                "uid": f"uid-{i}",
                "created_at": now - RECORD_AGE,
            }
            for i in range(records)
        ]
        pods = [
            {
                "uid": f"uid-{i}",
                "namespace": "bench",
                "name": f"pod-{i}",
                "phase": "Running",
                "node": NODE,
            }
            for i in range(records)
        ]
        runtimes = {NODE: {"sandboxes": sandboxes}}
        write_sim_state(self.state, now, {"pods": pods, "nodes": [NODE]}, runtimes)
        write_sim_state(self.runtime_state, now, {"pods": [], "nodes": [NODE]}, runtimes)
        # Another node's runtime, which holds none of these sandboxes.
        write_sim_state(
            self.other_state, now, {"pods": [], "nodes": [NODE]}, {OTHER_NODE: {"sandboxes": []}}
        )


def gc_pass_times(stores: Sequence[RecordStore], repeats: int) -> dict[int, dict[str, float]]:
    """Per store, the median seconds (of `repeats`, the stores taking turns) of: the raw
    `store.range(keys.ADDRESSES)` (the reference), one `gc.look` pass (records, registrations,
    liveness, every record judged), its parts alone (`snapshot`, `gather`, `judge`),
    and the controller's own `gc_pass` (also the sticky reservations; first pass, so
    nothing is confirmed). Every record must be judged alive."""
    from ipward.controller.election import Election
    from ipward.controller.metrics import Metrics
    from ipward.controller.passes import Controller
    from ipward.core.policy import ADD_GRACE
    from ipward.gc import rules as gc

    samples: dict[int, dict[str, list[float]]] = {s.records: {} for s in stores}
    sessions = []
    try:
        for s in stores:
            store = SqliteStore(s.path)
            source = SimFileSource(s.state, timeout=30.0)
            controller = Controller(
                store,
                Election(store, "bench", 10),  # never started: gc_pass only reads
                Metrics("bench", lambda: False),
                interval=3600.0,
                ready_delay=3600.0,
                liveness=source,
            )
            sessions.append((s, store, source, controller))
        for _ in range(repeats):
            for s, store, source, controller in sessions:
                times = samples[s.records]

                def timed(name: str, times: dict[str, list[float]] = times) -> Timer:
                    return Timer(times.setdefault(name, []))

                with timed("raw_range_s"):
                    kvs, _ = store.range(keys.ADDRESSES)
                if len(kvs) != s.records:
                    raise BenchError(f"{len(kvs)} records in {s.path}, expected {s.records}")
                del kvs
                with timed("look_s"):
                    verdicts = gc.look(store, source, ADD_GRACE).verdicts
                leaked = sum(v.reason is not None for v in verdicts)
                if leaked or len(verdicts) != s.records:
                    raise BenchError(f"GC judged {leaked} of {len(verdicts)} records leaked")
                del verdicts
                with timed("snapshot_s"):
                    held = gc.snapshot(store)
                with timed("gather_s"):
                    evidence = gc.gather(
                        source,
                        sorted({h.node for h in held}),
                        grace=ADD_GRACE,
                        registered=gc.registrations(store).nodes,
                    )
                with timed("judge_s"):
                    for h in held:
                        gc.judge(h, evidence)
                del held, evidence
                with timed("controller_pass_s"):
                    freed = controller.gc_pass(source)
                if freed:
                    raise BenchError(f"the controller's GC pass freed {len(freed)} records")
    finally:
        for _, store, _, controller in sessions:
            controller.view.close()
            store.close()
    return {
        n: {name: statistics.median(values) for name, values in times.items()}
        for n, times in samples.items()
    }


def agent_memory(tmp: Path, records: RecordStore, other_node: bool = False) -> dict[str, float]:
    """A real `ipward agent` (fleet.Agent) of the records' node on their store, its
    runtime the simulated one listing every record's sandbox ready; once its first
    reconcile pass has read and judged every record of its node (its "reconciled" log
    line), its VmRSS and VmHWM in MiB. Then it is stopped. With `other_node`, the agent
    of another node (its pass reads every record and keeps none)."""
    from ipward_lab.fleet import Agent, FleetError

    label = f"{count_label(records.records)}{'-other' if other_node else ''}"
    node, state = (OTHER_NODE, records.other_state) if other_node else (NODE, records.runtime_state)
    expected = 0 if other_node else records.records
    sockets = Path(tempfile.mkdtemp(prefix="ipw-gcmem-"))  # AF_UNIX paths are short
    agent = Agent(
        node,
        f"sqlite://{records.path}",
        sockets / "agent.sock",
        tmp / "agent-logs",
        extra=("--liveness", f"sim://{state}", "--reconcile-interval", "3600"),
        metrics=False,
    )
    try:
        agent.wait_started(AGENT_READY_TIMEOUT)
        deadline = time.monotonic() + AGENT_RECONCILE_TIMEOUT
        while not (passes := agent.logged("reconciled")):
            if not agent.running or time.monotonic() > deadline:
                raise BenchError(f"agent on {label} records: no reconcile pass:\n{agent.output()}")
            time.sleep(0.05)
        if passes[0].get("records") != expected or passes[0].get("freed"):
            raise BenchError(f"agent on {label} records: unexpected pass {passes[0]}")
        # The line is logged before the pass lets go of what it read.
        return settled_memory(agent.pid)
    except FleetError as e:
        raise BenchError(str(e)) from None
    finally:
        try:
            agent.stop(AGENT_STOP_TIMEOUT)
        except (subprocess.TimeoutExpired, FleetError):
            agent.kill()
        shutil.rmtree(sockets, ignore_errors=True)


def gc_growth(
    tmp: Path, quick: bool, counts: Sequence[int] | None, out: Callable[[str], object], r: Results
) -> list[RecordStore]:
    """Figure 6 into `r` (figures `growth.gc.*`, series, table); the record stores made."""
    if counts is None:
        counts = RECORD_COUNTS[:2] if quick else RECORD_COUNTS
    repeats = 3
    out(
        f"  ... GC: stores of {', '.join(count_label(n) for n in counts)} records (bulk"
        f" written), every sandbox listed ready; {repeats} passes each, taking turns"
    )
    stores = [RecordStore(tmp, n) for n in counts]
    passes = gc_pass_times(stores, repeats)
    rows = [
        [
            f"6. GC pass, SQLite (median of {repeats})",
            "raw range ms",
            "gc.look ms",
            "vs range",
            "snapshot ms",
            "liveness ms",
            "judge ms",
            "controller ms",
        ]
    ]
    r.series["gc"] = []
    for n in counts:
        t = {key.removesuffix("_s") + "_ms": value * 1000 for key, value in passes[n].items()}
        t["look_vs_range"] = t["look_ms"] / t["raw_range_ms"]
        t["look_us_per_record"] = t["look_ms"] * 1000 / n
        label = count_label(n)
        for key, value in t.items():
            r.figures[f"growth.gc.{label}.{key}"] = value
        r.series["gc"].append({"records": n, **t})
        rows.append(
            [
                f"{n:,} records",
                f"{t['raw_range_ms']:.1f}",
                f"{t['look_ms']:.1f}",
                f"{t['look_vs_range']:.1f}x",
                f"{t['snapshot_ms']:.1f}",
                f"{t['gather_ms']:.1f}",
                f"{t['judge_ms']:.1f}",
                f"{t['controller_pass_ms']:.1f}",
            ]
        )
    r.tables["gc"] = rows

    return stores


def memory_growth(
    tmp: Path, stores: Sequence[RecordStore], out: Callable[[str], object], r: Results
) -> None:
    """Figure 7 into `r`: figures `growth.agent*`, series, table."""
    out(
        "  ... agent memory: a real agent on an empty store, then on each store (its own"
        " node's records, then another node's), after its first reconcile pass"
    )
    empty = RecordStore(tmp, 0)
    reference = agent_memory(tmp, empty)
    r.figures["growth.agent.empty.rss_mib"] = reference["rss_mib"]
    r.figures["growth.agent.empty.hwm_mib"] = reference["hwm_mib"]
    r.series["agent_empty"] = reference
    rows = [
        [
            "7. agent memory, after one reconcile pass",
            "VmRSS MiB",
            "VmHWM MiB",
            "peak vs empty",
            "peak KiB/record",
        ],
        [
            "empty store (reference)",
            f"{reference['rss_mib']:.1f}",
            f"{reference['hwm_mib']:.1f}",
            "1.00x",
            "",
        ],
    ]
    r.series["agent"] = []
    for whose in ("own", "other"):
        for s in stores:
            memory = agent_memory(tmp, s, other_node=whose == "other")
            memory["hwm_vs_empty"] = memory["hwm_mib"] / reference["hwm_mib"]
            memory["hwm_kib_per_record"] = (
                (memory["hwm_mib"] - reference["hwm_mib"]) * 1024 / s.records
            )
            label = count_label(s.records)
            prefix_name = "agent" if whose == "own" else "agent_other"
            for key, value in memory.items():
                r.figures[f"growth.{prefix_name}.{label}.{key}"] = value
            r.series["agent"].append({"records": s.records, "node": whose, **memory})
            rows.append(
                [
                    f"{s.records:,} records, {'its node' if whose == 'own' else 'another node'}",
                    f"{memory['rss_mib']:.1f}",
                    f"{memory['hwm_mib']:.1f}",
                    f"{memory['hwm_vs_empty']:.2f}x",
                    f"{memory['hwm_kib_per_record']:.2f}",
                ]
            )
    r.tables["agent"] = rows
