"""A turn that waits for approvals (RFC 0012 §3): how its run parks, how it waits, how it goes on.

When a run stops for approvals (``TurnParked``), they are stored, the turn gives up its lease and
its child slot, and its waiter is answered with the approvals; nothing of it is kept in memory.
When it runs again (every call decided, or a swap discarded the parked run), it resumes from its
parked run with the decisions (``load_parked``). The approvals themselves are owned by
``agentd.supervisor.approvals``; these steps are the turn's side of them.
"""

from __future__ import annotations

from typing import Protocol

import anyio

from agentd import events
from agentd.approvals import ApprovalStatus, ParkedRun
from agentd.budget import TurnStatus
from agentd.obs import get_logger
from agentd.protocol import TurnParked
from agentd.store import LeaseLost, StoreError
from agentd.supervisor.approvals import WAITING, Approvals
from agentd.supervisor.session import PendingTurn, SessionRuntime

__all__ = ["await_decisions", "load_parked", "on_parked"]

log = get_logger("supervisor")


class _Runner(Protocol):
    """What the parking steps need of the turn runner (``agentd.supervisor.turns.runner.TurnRunner``)."""

    approvals: Approvals | None

    async def end_without_result(
        self,
        runtime: SessionRuntime,
        turn: PendingTurn,
        status: TurnStatus,
        error: str,
        *,
        answered: bool = False,
        parked: ParkedRun | None = None,
    ) -> None: ...

    async def lease_lost(self, runtime: SessionRuntime, reason: str) -> None: ...

    async def release_lease(self, runtime: SessionRuntime) -> None: ...

    def turn_finished(self) -> None: ...

    def evict_if_cold(self, runtime: SessionRuntime) -> None: ...


async def load_parked(runner: _Runner, runtime: SessionRuntime, turn: PendingTurn) -> bool:
    """Before a turn that is not fresh runs: whether it runs now — from its start, or from its parked
    run with the decisions (its deadline going on from what it had used) — or waits on (RFC 0012 §3)."""
    if runner.approvals is None:
        return True
    try:
        how = await runner.approvals.load(runtime.id, turn.id)
    except StoreError as exc:
        await runner.end_without_result(runtime, turn, TurnStatus.FAILED, f"cannot read its approvals: {exc}")
        return False
    if how == WAITING:
        await await_decisions(runner, runtime, turn)
        return False
    if isinstance(how, tuple):
        turn.resume_from(*how)
    return True


async def await_decisions(runner: _Runner, runtime: SessionRuntime, turn: PendingTurn) -> None:
    """The turn waits for approvals: it gives up its lease and its child slot (the run settled), the
    session is ``awaiting_approval`` and may unload; its waiter is answered with the approvals."""
    if runtime.pending is not turn or turn.record is not None:
        return
    await runner.release_lease(runtime)
    runtime.turn_awaiting()
    turn.waits_for(turn.awaiting or [])
    turn.mark_done()
    runner.turn_finished()
    runner.evict_if_cold(runtime)


async def on_parked(runner: _Runner, runtime: SessionRuntime, child: str, frame: TurnParked) -> None:
    """A run stopped for approvals: they are stored first, then the turn waits, then they are announced."""
    pending = runtime.pending
    if (
        pending is None
        or pending.id != frame.turn
        or pending.child is None
        or pending.child.id != child
        or runner.approvals is None
    ):
        runtime.log.warning(events.LOG_TURN_UNEXPECTED, turn=frame.turn, child=child)
        return
    if pending.cancel_requested:  # cancelled while its last step ran: it ends, nothing waits
        await runner.end_without_result(
            runtime, pending, TurnStatus.CANCELLED, "cancelled before it could wait", parked=frame.run
        )
        return
    with anyio.CancelScope(shield=True):
        try:
            result = await runner.approvals.park(runtime, frame, runtime.lease)
        except LeaseLost as exc:
            await runner.lease_lost(runtime, str(exc))
            return
        except StoreError as exc:
            runtime.log.error(events.LOG_APPROVAL_FAILED, what="store the approvals", turn=frame.turn, error=str(exc))
            await runner.end_without_result(
                runtime, pending, TurnStatus.FAILED, f"cannot store its approvals: {exc}", parked=frame.run
            )
            return
        pending.waits_for(result.approvals)
        # Announced (they are stored) while the turn still holds its lease: a subscriber on another
        # replica hears of them through the relay, fenced like the turn's other events.
        runner.approvals.announce(runtime, result)
        await await_decisions(runner, runtime, pending)
        if all(a.status is not ApprovalStatus.PENDING for a in result.approvals):
            # Every call it waits on was decided already (while a swap's re-run ran): it goes on.
            await runner.approvals.resume_now(frame.session, frame.turn)
