"""The clock rules of the ADD grace (`ipward.gc.clocks`) on given clocks: a writer's
measured offset corrects a record's age, when a judge first saw a record bounds it, and
an offset is skew only beyond its bounds (end to end, with agents on clocks of their
own: `tests/system/test_clock_skew.py`)."""

from __future__ import annotations

from ipward.cluster.liveness import ClusterView, NodeView
from ipward.core import keys
from ipward.core.records import AddressRecord, Attachment, NodeRegistration, PodInfo
from ipward.gc import clocks
from ipward.gc import rules as gc
from ipward.store.base import KeyValue

HOUR = 3600.0
GRACE = 60.0  # the judges' ADD grace
NODE = "n1"


def held(created_at: float, seen: float | None = None) -> gc.Held:
    record = AddressRecord.new(
        Attachment("net", "sb-1", "eth0"), PodInfo("ns", "web-0", "u1"), NODE, "10.0.0.0/28",
        created_at, None,
    )  # fmt: skip
    return gc.Held("p", "10.0.0.2", 7, record, seen)


def evidence(as_of: float, clock: clocks.Clock) -> gc.Evidence:
    view = NodeView(NODE, as_of, {})  # the runtime lists no sandbox
    cluster = ClusterView(as_of, {}, frozenset({NODE}))
    return gc.Evidence(GRACE, {NODE: view}, cluster, frozenset({NODE}), clock=clock)


def test_a_writers_measured_offset_corrects_the_age_both_ways() -> None:
    """A record stamped by a writer an hour behind, read two seconds after the ADD on
    the judge's clock: kept within the grace, a candidate once it has passed; and one of
    a writer an hour ahead is not kept an hour longer."""
    now = 1_000_000.0
    behind = clocks.Clock(now, 0.0, {NODE: clocks.Offset(-HOUR, -HOUR)})
    young = held(now - 2 - HOUR)
    assert gc.judge(young, evidence(now, behind)).reason is None
    assert gc.judge(young, evidence(now + GRACE, behind)).reason == gc.SANDBOX_GONE
    ahead = clocks.Clock(now, 0.0, {NODE: clocks.Offset(HOUR, HOUR)})
    assert gc.judge(held(now + HOUR - GRACE - 1), evidence(now, ahead)).reason == gc.SANDBOX_GONE
    unmeasured = gc.judge(held(now - 2 * GRACE), evidence(now, clocks.Clock(now, 0.0)))
    assert unmeasured.reason == gc.SANDBOX_GONE
    assert f"{NODE}'s clock not measured" in unmeasured.evidence


def test_when_a_judge_first_saw_a_record_bounds_its_age() -> None:
    """The judge's own clock stepped an hour forward after it saw the record (or the
    writer's stepped back since its registration): the record, seen 2 s ago on the
    monotonic clock, is kept until the grace has passed since."""
    now, mono = 1_000_000.0 + HOUR, 500.0
    record = held(now - HOUR - 2, seen=mono - 2)
    clock = clocks.Clock(now, mono, {NODE: clocks.OWN_CLOCK})
    verdict = gc.judge(record, evidence(now, clock))
    assert verdict.reason is None and "first seen 2.0s ago" in verdict.evidence
    later = clocks.Clock(now + GRACE, mono + GRACE, {NODE: clocks.OWN_CLOCK})
    assert gc.judge(record, evidence(now + GRACE, later)).reason == gc.SANDBOX_GONE


def test_an_offset_is_certain_skew_only_beyond_its_bounds() -> None:
    at = 2_000.0

    def offset(clock: float, refresh: float | None, fresh: bool) -> clocks.Offset:
        value = NodeRegistration(NODE, 1, 0.0, clock, refresh).encode()
        measured = clocks.measure(KeyValue(keys.node_key(NODE), value, 1, 1, 1), at, fresh=fresh)
        assert measured is not None
        return measured

    assert offset(at - 10, None, fresh=True) == clocks.Offset(-10, -10)
    assert offset(at - 10, None, fresh=True).skewed  # tight: 10 s behind
    read_whole = offset(at - 10, 60.0, fresh=False)  # written up to 61 s before the read
    assert read_whole == clocks.Offset(-10, 51) and not read_whole.skewed
    assert offset(at - HOUR, 60.0, fresh=False).skewed
    assert offset(at + 10, None, fresh=False).skewed  # ahead: `low` alone says it
    assert not offset(at - HOUR, None, fresh=False).skewed  # no refresh: never "behind"
    assert offset(at - HOUR, 60.0, fresh=False).describe() == "between 3539s and 3600s behind"
