"""The pool pass's decisions, as pure functions: a pool's state in (read from the view by
`PoolState.read`), typed actions out. No store, no clock, no logs: `now` and `mono` (the
pass's wall and monotonic times), the registered and gone nodes and the policy
(`ready_delay`, the spec's `warm` and `release_delay`) are arguments, so a test gives a
state and reads the actions. `ipward.controller.executor` applies them, fenced, and
updates the state with what it applied; the pass (`ipward.controller.passes`) plans in
three phases, each from the state the phase before left:

  1. `handshake_steps` and `ask_back_from_gone_nodes`: the next step of every block in
     the hand-back, and the emptied blocks of gone nodes asked back;
  2. `warm_round`, again until it plans nothing: one block per node and family short of
     the warm target (a block's size is known only once assigned);
  3. `surplus`: empty blocks beyond the warm target for `release_delay`, asked back;
     `prune` after a change of the pool's ranges.

What the pass remembers from one pass to the next (`PoolMemory`: since when a block is
empty, which blocks were in the hand-back) is also computed here, from the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipward.core.records import MARKED, READY, REFUSED, BlockRecord
from ipward.ipam.blocks import releasable

if TYPE_CHECKING:
    from collections.abc import Set

    from ipward.controller.view import PoolKeys
    from ipward.core.addr import Block
    from ipward.core.pool import PoolSpec
    from ipward.store.base import KeyValue

IN_HANDSHAKE = (MARKED, READY, REFUSED)
GONE = "its node is gone (lease expired, not listed by the cluster)"

NodeFamily = tuple[str, int]


class Layouts:
    """One pool's blocks by CIDR as its current layout has them (None: not one of it),
    with their usable address counts, kept from pass to pass while the pool's spec is
    the one read at `revision`: parsing and counting 5,000 blocks again was most of a
    steady pass at 5,000 nodes."""

    __slots__ = ("blocks", "revision")

    def __init__(self, revision: int | None) -> None:
        self.revision = revision
        self.blocks: dict[str, tuple[Block | None, int]] = {}


class PoolState:
    """One pool as a pass read it (blocks, their KeyValues, records per block, fills),
    and what the pass's applied actions changed since: a block changed this pass has no
    KeyValue (no step compares on it again this pass)."""

    __slots__ = ("_free", "_layout", "blocks", "fills", "kvs", "records", "spec")

    def __init__(
        self,
        spec: PoolSpec,
        blocks: dict[str, BlockRecord],
        kvs: dict[str, KeyValue],
        records: Mapping[str, int],
        fills: Mapping[tuple[int, str], str],
        layouts: Layouts | None = None,
    ) -> None:
        self.spec = spec
        self.blocks = blocks
        self.kvs = kvs
        self.records = records  # address records per block (read only)
        self.fills = fills  # (family, node) -> the block it fills fresh addresses from
        self._layout = layouts.blocks if layouts is not None else {}
        # free_per_node's last answer, for which nodes (an applied action forgets it)
        self._free: tuple[Set[str], dict[NodeFamily, int]] | None = None

    @classmethod
    def read(cls, spec: PoolSpec, keys: PoolKeys, layouts: Layouts | None = None) -> PoolState:
        """From the view's keys of the pool (one revision). The blocks are copied: the
        pass changes them; records and fills are only read. `layouts`: kept from the
        last pass, for this spec's revision."""
        blocks = {cidr: block for cidr, (_, block) in keys.blocks.items()}
        kvs = {cidr: kv for cidr, (kv, _) in keys.blocks.items()}
        return cls(spec, blocks, kvs, keys.records, keys.fills, layouts)

    def layout(self, cidr: str) -> Block | None:
        """The block of the pool's current layout with this CIDR (None: not one of it)."""
        return self._of_layout(cidr)[0]

    def usable(self, cidr: str) -> int:
        """Addresses of a block of the layout that may be handed out (0: not one of it)."""
        return self._of_layout(cidr)[1]

    def _of_layout(self, cidr: str) -> tuple[Block | None, int]:
        known = self._layout.get(cidr)
        if known is None:
            block = self.spec.block_by_cidr(cidr)
            known = self._layout[cidr] = (block, 0 if block is None else block.usable_count())
        return known

    def free_per_node(self, registered: Set[str]) -> dict[NodeFamily, int]:
        """Per registered node and family (in name order, then the pool's range sets):
        usable addresses of its active blocks of the current layout that no record
        holds. Kept for the next ask (several steps ask it) until an action changes the
        state: not to be changed by the caller."""
        if self._free is not None and self._free[0] == registered:
            return self._free[1]
        free = {(node, rs.family): 0 for node in sorted(registered) for rs in self.spec.range_sets}
        held = self.records.get
        for cidr, block in self.blocks.items():
            node = block.node
            if node not in registered or not block.active:
                continue
            layout, usable = self._of_layout(cidr)
            if layout is not None:
                free[(node, layout.range_set.family)] += max(0, usable - held(cidr, 0))
        self._free = (frozenset(registered), free)
        return free

    def changed(self, cidr: str, block: BlockRecord) -> None:
        self.blocks[cidr] = block
        self.kvs.pop(cidr, None)
        self._free = None

    def removed(self, cidr: str) -> None:
        del self.blocks[cidr]
        self.kvs.pop(cidr, None)
        self._free = None


@dataclass(frozen=True, slots=True)
class PoolMemory:
    """What a pass keeps of a pool for the next: since when (monotonic) each active block
    has been empty, and the blocks in the hand-back (one of them active later, with no
    resume of ours, was taken back by its node). A new term starts without it."""

    empty_since: Mapping[str, float] = field(default_factory=dict)
    in_handshake: frozenset[str] = frozenset()


# -- the actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TakenBack:
    """No write: a block seen in the hand-back is active again, its node took it back."""

    cidr: str
    node: str
    why: str = "the node took the block back (it needs the space)"


@dataclass(frozen=True, slots=True)
class AnswerForGoneNode:
    """A gone node's marked block: answer for its agent, by the agent's compares."""

    cidr: str
    node: str
    kv: KeyValue
    at: float
    why: str = "node lease expired and the cluster no longer lists it"


@dataclass(frozen=True, slots=True)
class ResumeHandBack:
    """A refused block goes back to work (an aborted hand-back)."""

    cidr: str
    node: str
    kv: KeyValue
    why: str = "the node's agent refused: addresses allocated"


@dataclass(frozen=True, slots=True)
class CompleteHandBack:
    """A block answered ready past the ready delay: deleted, listed as released."""

    cidr: str
    node: str
    kv: KeyValue
    why: str


@dataclass(frozen=True, slots=True)
class MarkForHandBack:
    """Ask an active, empty block back (the hand-back starts)."""

    cidr: str
    node: str
    kv: KeyValue
    at: float
    why: str


@dataclass(frozen=True, slots=True)
class AssignBlock:
    """Give a node a block of a family (which one, the claim decides when applied)."""

    node: str
    family: int
    free: int  # the node's free addresses of that family before it
    why: str


@dataclass(frozen=True, slots=True)
class PruneLayouts:
    """Remove what the pool's current layout does not use (`ipam.pools.prune`)."""

    why: str


Action = (
    TakenBack
    | AnswerForGoneNode
    | ResumeHandBack
    | CompleteHandBack
    | MarkForHandBack
    | AssignBlock
    | PruneLayouts
)


# -- phase 1: the hand-back ---------------------------------------------------------------


def handshake_steps(
    state: PoolState,
    seen_in_handshake: Set[str],
    registered: Set[str],
    gone: Set[str],
    now: float,
    ready_delay: float,
) -> list[Action]:
    """The next step of every block in the hand-back: a gone node's marked block
    answered for it, a refused one resumed, a ready one past `ready_delay` completed; a
    block of a node neither registered nor gone is left alone. A block remembered in the
    hand-back and active now was taken back by its node."""
    actions: list[Action] = []
    for cidr, block in state.blocks.items():
        st, node = block.state, block.node
        if block.active:
            if cidr in seen_in_handshake:
                actions.append(TakenBack(cidr, node))
            continue
        kv = state.kvs.get(cidr)
        if st not in IN_HANDSHAKE or kv is None:
            continue
        if node in gone and st == MARKED:
            actions.append(AnswerForGoneNode(cidr, node, kv, now))
        elif node not in registered and node not in gone:
            continue  # an unregistered node's block: left alone until known gone
        elif st == REFUSED:
            actions.append(ResumeHandBack(cidr, node, kv))
        elif st == READY:
            answered = block.answered_at
            waited = now - answered if answered is not None else 0.0
            if waited >= ready_delay:
                why = f"answered ready {waited:.1f}s ago (ready delay {ready_delay:g}s)"
                actions.append(CompleteHandBack(cidr, node, kv, why))
    return actions


def ask_back_from_gone_nodes(state: PoolState, gone: Set[str], now: float) -> list[Action]:
    """Active blocks of gone nodes that garbage collection has emptied: asked back at
    once (their agent will never use them again)."""
    actions: list[Action] = []
    for cidr, block in state.blocks.items():
        kv = state.kvs.get(cidr)
        if (
            block.node in gone
            and block.active
            and not state.records.get(cidr)
            and kv is not None
            and (layout := state.layout(cidr)) is not None
            and releasable(layout)
        ):
            actions.append(MarkForHandBack(cidr, block.node, kv, now, GONE))
    return actions


# -- since when a block is empty ---------------------------------------------------------


def empty_since(
    state: PoolState, registered: Set[str], before: Mapping[str, float], mono: float
) -> dict[str, float]:
    """Since when each active block of a registered node has been empty and unchanged
    this pass: as remembered, else from `mono`. A block that holds a record, changed
    this pass or left the layout starts again; an unregistered node's block keeps what
    was remembered, without counting on."""
    since: dict[str, float] = {}
    held = state.records.get
    blocks = state.blocks
    # Only an empty block or a remembered one can be in the answer.
    for cidr in [*(c for c in blocks if not held(c)), *(c for c in before if held(c))]:
        block = blocks.get(cidr)
        if block is None or not block.active:
            continue
        if block.node not in registered or state.layout(cidr) is None:
            if cidr in before:
                since[cidr] = before[cidr]
        elif not held(cidr) and cidr in state.kvs:
            since[cidr] = before.get(cidr, mono)
    return since


# -- phase 2: the warm target -------------------------------------------------------------


def warmed(state: PoolState, registered: Set[str]) -> set[str]:
    """The registered nodes whose free count is kept at the pool's warm target: those it
    serves (`--node`, when it names any); of a pool a network config declares (inline
    ranges), only those that hold a block of it. Such a pool is used by the nodes whose
    config declares it, often one (a node's own range, as with host-local), and a block
    given to a node that never allocates from it would only take the pool's room (found
    on a real cluster: every node's /24 split between three nodes). A node takes its
    first block itself, at its first ADD."""
    spec = state.spec
    nodes = {n for n in registered if not spec.nodes or n in spec.nodes}
    if not spec.inline:
        return nodes
    return nodes & {block.node for block in state.blocks.values()}


def warm_round(
    state: PoolState, registered: Set[str], passed: Set[NodeFamily]
) -> list[AssignBlock]:
    """One block for every registered node and family short of the warm target, except
    those `passed` (an assignment of theirs failed this pass: the pool is exhausted or a
    race lost). Planned again after each round, so a pool running out is shared rather
    than given to the first nodes in name order."""
    warm = state.spec.warm
    return [
        AssignBlock(node, family, free, f"{free} free < warm target {warm}")
        for (node, family), free in state.free_per_node(registered).items()
        if free < warm and (node, family) not in passed
    ]


# -- phase 3: surplus and layouts ---------------------------------------------------------


def surplus(
    state: PoolState, registered: Set[str], since: Mapping[str, float], now: float, mono: float
) -> list[Action]:
    """Per registered node and family: each active block empty for at least the pool's
    `release_delay`, small enough for the agent's one-transaction answer, whose
    addresses the node can do without (free less its size stays at or above warm), is
    asked back. The block the node fills goes last: its agent is likely about to use it.
    Only nodes with an empty block are looked at: a pass costs the empty blocks, not
    the nodes."""
    spec = state.spec
    empty: dict[NodeFamily, list[tuple[str, Block]]] = {}  # (cidr, its layout's block)
    for cidr in since:
        block = state.blocks.get(cidr)
        if (
            block is None
            or not block.active
            or block.node not in registered
            or cidr not in state.kvs
            or state.records.get(cidr)
            or (layout := state.layout(cidr)) is None
        ):
            continue
        empty.setdefault((block.node, layout.range_set.family), []).append((cidr, layout))
    free_per_node = state.free_per_node(registered)
    order = {rs.family: i for i, rs in enumerate(spec.range_sets)}
    actions: list[Action] = []
    for node, family in sorted(empty, key=lambda nf: (nf[0], order[nf[1]])):
        free = free_per_node[(node, family)]
        filling = state.fills.get((family, node))
        for cidr, layout in sorted(empty[(node, family)], key=lambda e: (e[0] == filling, e[0])):
            size = state.usable(cidr)
            empty_for = mono - since[cidr]
            too_soon = empty_for < spec.release_delay
            if not releasable(layout) or too_soon or free - size < spec.warm:
                continue
            free -= size
            why = (
                f"surplus: empty for {empty_for:.1f}s (release delay {spec.release_delay:g}s);"
                f" {free} free without it, warm {spec.warm}"
            )
            actions.append(MarkForHandBack(cidr, node, state.kvs[cidr], now, why))
    return actions


def prune(state: PoolState) -> list[Action]:
    """After a change of the pool's ranges: what its new layout does not use, and earlier
    layouts no record holds any more."""
    if state.spec.retired:
        return [PruneLayouts("earlier layouts are kept")]
    if any(state.layout(cidr) is None for cidr in state.blocks):
        return [PruneLayouts("blocks outside the current layout")]
    return []


# -- what a pass leaves -------------------------------------------------------------------


def remember(state: PoolState, since: Mapping[str, float]) -> PoolMemory:
    """The pool's memory for the next pass, from the state the pass left: the blocks in
    the hand-back, and the empty-since times of blocks still active (one asked back this
    pass and taken back later starts counting again)."""
    in_handshake = frozenset(c for c, b in state.blocks.items() if b.state in IN_HANDSHAKE)
    active = {c: t for c, t in since.items() if c in state.blocks and state.blocks[c].active}
    return PoolMemory(active, in_handshake)


def block_counts(state: PoolState) -> dict[tuple[str, str, str], int]:
    """Blocks per (pool, node, state), every node's."""
    counts: dict[tuple[str, str, str], int] = {}
    for block in state.blocks.values():
        labels = (state.spec.name, block.node, block.state)
        counts[labels] = counts.get(labels, 0) + 1
    return counts


def deficits(state: PoolState, registered: Set[str]) -> dict[tuple[str, str, str], int]:
    """Per (pool, registered node, family): addresses short of the warm target."""
    warm = state.spec.warm
    return {
        (state.spec.name, node, str(family)): max(0, warm - free)
        for (node, family), free in state.free_per_node(registered).items()
    }


__all__ = [
    "Action",
    "AnswerForGoneNode",
    "AssignBlock",
    "CompleteHandBack",
    "Layouts",
    "MarkForHandBack",
    "PoolMemory",
    "PoolState",
    "PruneLayouts",
    "ResumeHandBack",
    "TakenBack",
    "ask_back_from_gone_nodes",
    "block_counts",
    "deficits",
    "empty_since",
    "handshake_steps",
    "prune",
    "remember",
    "surplus",
    "warm_round",
    "warmed",
]
