"""The one place the pool pass writes: each action `ipward.controller.plan` decided is
applied by its protocol (`ipward.ipam.blocks`' handshake steps and assignment,
`ipward.ipam.pools.prune`), every write carrying the leader fence; then counted, logged
with its reason (pool, block, node, why), and folded into the pass's `PoolState` so the
phases planned after it see it. A write that loses its compare is a race with the
node's agent (fine: the next pass reads again) or the fence (step down: `NotLeader`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, assert_never

from ipward.controller.plan import (
    Action,
    AnswerForGoneNode,
    AssignBlock,
    CompleteHandBack,
    MarkForHandBack,
    PoolState,
    PruneLayouts,
    ResumeHandBack,
    TakenBack,
)
from ipward.core import log
from ipward.core.keys import LEADER_KEY
from ipward.core.records import BlockRecord
from ipward.ipam import blocks, pools

if TYPE_CHECKING:
    import threading
    from collections.abc import Sequence

    from ipward.controller.election import Election
    from ipward.controller.metrics import Metrics
    from ipward.store import Store
    from ipward.store.base import Compare

A = TypeVar("A", bound=Action)


class NotLeader(Exception):
    """Leadership is gone (or the controller is stopping): abandon the pass."""


class Executor:
    """Applies the pass's actions, fenced. `apply` returns the actions that lost their
    compare (raising `NotLeader` instead when the fence is why)."""

    def __init__(
        self, store: Store, election: Election, metrics: Metrics, stopping: threading.Event
    ) -> None:
        self.store = store
        self.election = election
        self.metrics = metrics
        self.stopping = stopping

    def fence(self) -> list[Compare]:
        """The compares every controller write carries: they hold only while we lead."""
        fence = self.election.fence()
        if fence is None or self.stopping.is_set():
            raise NotLeader
        return fence

    def after_failed_write(self) -> None:
        """A write lost its compare-and-swap: a race with the node's agent (fine: the
        next pass reads again), or our fence (step down)."""
        mine = self.election.value()
        if mine is None:
            raise NotLeader
        kv = self.store.get(LEADER_KEY)
        if kv is None or kv.value != mine:
            self.election.step_down("fenced: a write failed and the leader key is not ours")
            raise NotLeader

    def apply(self, state: PoolState, actions: Sequence[A]) -> list[A]:
        lost = []
        for action in actions:
            if not self._apply(state, action):
                self.after_failed_write()  # before the next write: a fenced one stops here
                lost.append(action)
        return lost

    def _apply(self, state: PoolState, action: Action) -> bool:
        match action:
            case TakenBack():
                self._handshake_ended("aborted", state, action, "handshake aborted")
            case AnswerForGoneNode(cidr, node, kv, at, why):
                answer = blocks.answer(self.store, state.spec, kv, at, self.fence())
                if answer is None:
                    return False
                state.changed(cidr, state.blocks[cidr].answered(answer, at))
                _log("answered for a gone node", state, cidr, node, why, answer=answer)
            case ResumeHandBack(cidr, _, kv):
                if not blocks.resume(self.store, state.spec.name, kv, self.fence()):
                    return False
                state.changed(cidr, state.blocks[cidr].resumed())
                self._handshake_ended("aborted", state, action, "handshake aborted")
            case CompleteHandBack(cidr, _, kv):
                if not blocks.complete_hand_back(self.store, state.spec, kv, self.fence()):
                    return False
                state.removed(cidr)
                self._handshake_ended("completed", state, action, "handshake completed")
            case MarkForHandBack(cidr, node, kv, at, why):
                if not blocks.mark(self.store, state.spec.name, kv, at, self.fence()):
                    return False
                state.changed(cidr, state.blocks[cidr].marked(at))
                self.metrics.handshakes.labels(result="started").inc()
                _log("handshake started", state, cidr, node, why)
            case AssignBlock():
                return self._assign(state, action)
            case PruneLayouts():
                pools.prune(self.store, state.spec.name, self.fence())
            case _:
                assert_never(action)
        return True

    def _assign(self, state: PoolState, action: AssignBlock) -> bool:
        spec, node, family = state.spec, action.node, action.family
        given = blocks.assign(self.store, spec, family, node, self.fence())
        if given is None:
            log.debug(
                "no block assigned (pool exhausted or a race lost); next pass",
                pool=spec.name,
                node=node,
                family=family,
                free=action.free,
                warm=spec.warm,
            )
            return False
        state.changed(given, BlockRecord.claimed(node, 0, spec.version))
        self.metrics.assigned.inc()
        free = action.free + state.usable(given)
        _log("warm block assigned", state, given, node, action.why, free=free)
        return True

    def _handshake_ended(
        self,
        result: str,
        state: PoolState,
        action: TakenBack | ResumeHandBack | CompleteHandBack,
        message: str,
    ) -> None:
        self.metrics.handshakes.labels(result=result).inc()
        _log(message, state, action.cidr, action.node, action.why)


def _log(message: str, state: PoolState, cidr: str, node: str, why: str, **more: object) -> None:
    log.info(message, pool=state.spec.name, block=cidr, node=node, reason=why, **more)


__all__ = ["Executor", "NotLeader"]
