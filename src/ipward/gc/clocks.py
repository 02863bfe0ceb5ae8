"""A record's age for the ADD grace, whatever the machines' clocks say.

A record's `created_at` is its writer's wall clock (the agent of the record's node; the
plugin in single-node mode); a judge reads liveness, and stamps `as_of`, on its own. An
agent an hour behind would make a record two seconds old look an hour old. So a judge
takes the ADD to have committed at the latest time it can prove, on its own wall clock
(`Clock.added_at`), the later of:

* `created_at` less the writer's offset as measured through the store: an agent puts
  its wall clock into its registration (`nodes/<node>`, `NodeRegistration.clock`) when
  it registers and every `refresh` seconds (and at once when its clock steps). A judge
  that reads it at its own time `read_at` knows the put came first, so the writer's
  clock minus its own is at least `clock - read_at` (`Offset.low`), and the ADD
  committed no later than `created_at - low`. From a watch's event the bound is tight;
  from a whole read it may be up to `refresh` low, which only makes records look younger
  (freed up to that much later). A writer with no registration (its node gone; single-
  node mode) is not measured: its `created_at` is taken as it is, and the verdict says
  so.
* when the judge first saw the record's revision (`Held.seen`, on its monotonic clock):
  the judges that follow a watch (the controller's view, the agent's node index) note
  it, and the ADD came before. It holds across clock steps of the judge and of the
  writer while the judge runs. The records of a judge's first read have none: the
  offsets it measures then are on its clock as it is, so a step of either clock before
  is already in them, but for a writer's step in the seconds before it publishes its
  clock again (what `ipward gc` is exposed to as well); counting them as seen at that
  read would stop a judge that just started, or took the lead, from freeing anything
  for a grace and then until its sources' `as_of` passed its start (a minute more with
  `k8s://`'s defaults).

The offset is also what is reported: one certainly beyond `CLOCK_SKEW_BOUND` is logged,
counted by the controller and shown by `ipward status` (`Offset.skewed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ipward.core import keys, log
from ipward.core.policy import CLOCK_SKEW_BOUND
from ipward.core.records import NodeRegistration
from ipward.store.base import KeyValue

# Seconds an agent's put may come after its refresh was due (its duties thread is woken
# for it; a store round trip).
LATE = 1.0


@dataclass(frozen=True, slots=True)
class Offset:
    """A writer's wall clock minus a judge's: at least `low` (its registration was put
    before the judge read it); at most `high` if it refreshes on time (None: it does
    not say how often)."""

    low: float
    high: float | None

    @property
    def skewed(self) -> bool:
        """Certainly off by more than `CLOCK_SKEW_BOUND`."""
        behind = self.high is not None and self.high < -CLOCK_SKEW_BOUND
        return self.low > CLOCK_SKEW_BOUND or behind

    @property
    def estimate(self) -> float:
        """The middle of what is known (`low` when there is no upper bound)."""
        return self.low if self.high is None else (self.low + self.high) / 2

    def describe(self) -> str:
        """In words, e.g. "3600s behind", "between 40s and 101s behind"."""
        low, high = self.low, self.high
        if high is None:
            return f"at least {low:.0f}s ahead" if low >= 0 else f"at most {-low:.0f}s behind"
        if round(low) == round(high):
            return f"{abs(low):.0f}s {'ahead' if low >= 0 else 'behind'}"
        if high < 0:
            return f"between {-high:.0f}s and {-low:.0f}s behind"
        if low > 0:
            return f"between {low:.0f}s and {high:.0f}s ahead"
        return f"between {-low:.0f}s behind and {high:.0f}s ahead"


# The offset of a writer that is the judge itself (an agent and its node's records).
OWN_CLOCK = Offset(0.0, 0.0)


def measure(kv: KeyValue, read_at: float, *, fresh: bool) -> Offset | None:
    """The offset registration `kv` shows, read at `read_at` (the judge's wall clock,
    taken after the read). `fresh`: read as it was put (a watch's event). None when the
    value says nothing (logged)."""
    try:
        registration = NodeRegistration.decode(kv.value)
    except ValueError as e:
        log.warning(
            "registration unreadable; its node's clock is not measured", key=kv.key, error=str(e)
        )
        return None
    low = registration.clock - read_at
    if fresh:
        return Offset(low, low)
    refresh = registration.refresh
    return Offset(low, None if refresh is None else low + refresh + LATE)


def measure_all(kvs: Iterable[KeyValue], read_at: float) -> dict[str, Offset]:
    """The offsets of registrations `kvs` (`nodes/`), read whole at `read_at`."""
    out = {}
    for kv in kvs:
        node = keys.registered_node(kv.key)
        if node is not None and (offset := measure(kv, read_at, fresh=False)) is not None:
            out[node] = offset
    return out


@dataclass(frozen=True)
class Clock:
    """A judge's clocks at one look, read together (`wall`, `mono`), and the writers'
    offsets it knows (by node)."""

    wall: float
    mono: float
    offsets: Mapping[str, Offset] = field(default_factory=dict)

    def added_at(self, node: str, created_at: float, seen: float | None) -> tuple[float, str]:
        """The latest time on this judge's wall clock at which a record of `node`
        stamped `created_at`, first seen at monotonic `seen` (None: not followed), may
        have been added; and a note for its verdict when that is not `created_at`."""
        added, note = created_at, ""
        offset = self.offsets.get(node)
        if offset is None:
            note = f"{node}'s clock not measured"
        elif offset.low != 0:
            added = created_at - offset.low
            note = f"{node}'s clock {offset.describe()}" if offset.skewed else ""
        if seen is not None:
            seen_at = self.wall - (self.mono - seen)
            if seen_at > added:
                added, note = seen_at, f"first seen {self.wall - seen_at:.1f}s ago"
        return added, note
