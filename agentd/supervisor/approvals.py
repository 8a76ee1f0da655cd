"""The supervisor's owner of approvals (RFC 0012): it stores them, decides them, expires them, and
says how a turn that parked for them goes on.

Nothing here is kept in memory per approval: the store is the one place they are (a turn that waits
holds no child slot, no lease, and — once its session unloads — no runtime). A decision is a
conditional update in the store, so exactly one wins on any replica; the replica whose decision
(or expiry) leaves the turn with nothing to wait for resumes it (``Resume``, given by the turns).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agentd import events
from agentd.approvals import Approval, ApprovalStatus, Decision, ParkedRun, check_arguments, decided_status
from agentd.config import SwapPolicy
from agentd.errors import BadInput, Conflict, NotFound, store_failure
from agentd.obs import Metrics, get_logger
from agentd.protocol import TurnParked
from agentd.store import AlreadyDecided, Lease, ParkResult, Store, StoreError, UnknownApproval
from agentd.supervisor.running import Running
from agentd.supervisor.session import SessionRuntime, SessionTable
from agentd.views import ApprovalView, approval_view

__all__ = ["EXPIRY_POLL", "WAITING", "Approvals", "Emit", "Resume", "decisions_of"]

log = get_logger("supervisor")

#: How often (at most) the store is asked whether an approval expired: parks of other replicas
#: are seen within this; this replica's own parks wake the wait at once.
EXPIRY_POLL = 5.0
#: ``load``'s answer for a turn that still waits for a decision.
WAITING = "waiting"

#: Publish a session event (``Turns.emit``).
Emit = Callable[[SessionRuntime, str, str | None, dict[str, Any]], None]
#: Resume a turn whose approvals are all decided: (session, turn).
Resume = Callable[[str, str], Awaitable[None]]


def decisions_of(run: ParkedRun, approvals: list[Approval]) -> list[Decision] | None:
    """What was decided for each call the run waits on (the newest approval per call id); None while
    one of them is still pending."""
    latest = {a.call_id: a for a in approvals}  # oldest first: the newest wins
    decisions = []
    for call_id in run.calls:
        approval = latest.get(call_id)
        if approval is None:  # no approval for it (cannot happen): it is not run
            decisions.append(Decision(call_id=call_id, status=ApprovalStatus.CANCELLED, reason="no approval found"))
            continue
        if approval.status is ApprovalStatus.PENDING:
            return None
        edited = approval.arguments if approval.status is ApprovalStatus.APPROVED else None
        decisions.append(Decision(call_id=call_id, status=approval.status, reason=approval.reason, arguments=edited))
    return decisions


class Approvals:
    """Approvals of tool calls, from the store; events through ``emit``; resumes through ``resume``."""

    def __init__(self, *, store: Store, running: Running, sessions: SessionTable, metrics: Metrics) -> None:
        self.store = store
        self.running = running
        self.sessions = sessions
        self.metrics = metrics
        self.emit: Emit = lambda _runtime, _name, _turn, _data: None
        self.resume: Resume | None = None
        self._wake = anyio.Event()

    def attach(self, *, emit: Emit, resume: Resume) -> None:
        """Wire the owner to the runner's events and the turns' resume (composition root)."""
        self.emit, self.resume = emit, resume

    # ------------------------------------------------------------------ a run parks

    async def park(self, runtime: SessionRuntime, frame: TurnParked, lease: Lease | None) -> ParkResult:
        """Store the parked run and its approvals (before anything announces them); StoreError as is."""
        timeout = self.running.config.limits.approval_timeout
        now = time.time()
        expires_at = now + timeout if timeout > 0 else None
        requests = [(new_approval_id(), request) for request in frame.requests]
        result = await self.store.park_turn(
            runtime.id, frame.turn, frame.run, requests, expires_at=expires_at, lease=lease
        )
        for approval in result.approvals:
            if approval.id in result.new:
                runtime.log.info(
                    events.LOG_APPROVAL_REQUESTED,
                    turn=frame.turn,
                    approval=approval.id,
                    tool=approval.tool,
                )
        self._wake.set()  # the expiry timer looks at the new deadlines
        return result

    def announce(self, runtime: SessionRuntime, result: ParkResult) -> None:
        """``approval.requested`` for the new approvals (stored already), ``approval.decided`` for cancelled ones."""
        for approval in result.cancelled:
            self.decided(runtime, approval)
        for approval in result.approvals:
            if approval.id in result.new:
                self.emit(
                    runtime,
                    events.APPROVAL_REQUESTED,
                    approval.turn,
                    {
                        "approval": approval.id,
                        "call_id": approval.call_id,
                        "tool": approval.tool,
                        "arguments": approval.arguments,
                    },
                )

    def decided(self, runtime: SessionRuntime | None, approval: Approval) -> None:
        """Count and announce one decision (the store has it)."""
        self.metrics.approvals.labels(decision=approval.status.value).inc()
        log.info(
            events.LOG_APPROVAL_DECIDED,
            session=approval.session,
            turn=approval.turn,
            approval=approval.id,
            status=approval.status.value,
            reason=approval.reason,
        )
        if runtime is not None:
            self.emit(
                runtime,
                events.APPROVAL_DECIDED,
                approval.turn,
                {"approval": approval.id, "status": approval.status.value, "reason": approval.reason},
            )

    # ------------------------------------------------------------------ a run goes on

    async def load(self, session_id: str, turn_id: str) -> tuple[ParkedRun, list[Decision]] | str | None:
        """How a pending turn runs now: from its start (None), from its parked run with the
        decisions, or not at all (``WAITING``: an approval is still pending). StoreError as is."""
        found = await self.store.parked_run(session_id, turn_id)
        if found is None:
            return None
        run, approvals = found
        decisions = decisions_of(run, approvals)
        if decisions is None:
            return WAITING
        return run, decisions

    # ------------------------------------------------------------------ the API

    async def decide(self, approval_id: str, decision: str, reason: str | None, arguments: Any | None) -> ApprovalView:
        """Decide once: 404 unknown, 409 decided before, 400 bad decision or arguments. The turn
        goes on when nothing of it waits any more."""
        try:
            status = decided_status(decision)
        except ValueError as exc:
            raise BadInput(str(exc), code="bad_decision") from None
        if arguments is not None and status is not ApprovalStatus.APPROVED:
            raise BadInput("arguments can only be edited by an approve", code="bad_arguments")
        approval = await self._get(approval_id)
        if arguments is not None:
            # In a worker thread: a tool's schema may hold a pattern that backtracks for seconds,
            # and the loop serves every other request, child frame and lease meanwhile.
            problem = await anyio.to_thread.run_sync(check_arguments, arguments, approval.parameters)
            if problem is not None:
                raise BadInput(f"arguments do not fit tool {approval.tool!r}: {problem}", code="bad_arguments")
        try:
            decided, ready = await self.store.decide_approval(
                approval_id, status.value, reason=reason, arguments=arguments
            )
        except UnknownApproval:
            raise NotFound(f"no approval {approval_id!r}") from None
        except AlreadyDecided as exc:
            raise Conflict(
                f"approval {approval_id} was {exc.approval.status.value} already", code="already_decided"
            ) from None
        except StoreError as exc:
            raise store_failure(exc) from None
        if ready:  # resumed first: the turn holds its lease again, so the event is relayed too
            await self._resume(decided.session, decided.turn)
        self.decided(self.sessions.get(decided.session), decided)
        return approval_view(decided)

    async def get(self, approval_id: str) -> ApprovalView:
        return approval_view(await self._get(approval_id))

    async def _get(self, approval_id: str) -> Approval:
        try:
            approval = await self.store.get_approval(approval_id)
        except StoreError as exc:
            raise store_failure(exc) from None
        if approval is None:
            raise NotFound(f"no approval {approval_id!r}")
        return approval

    async def page(
        self, *, status: str | None, session: str | None, limit: int, after: str | None
    ) -> list[ApprovalView]:
        if status is not None and status not in {s.value for s in ApprovalStatus}:
            accepted = ", ".join(s.value for s in ApprovalStatus)
            raise BadInput(f"status must be one of {accepted}, not {status!r}", code="bad_status")
        try:
            page = await self.store.list_approvals(status=status, session=session, limit=limit, after=after)
        except UnknownApproval as exc:
            raise BadInput(str(exc), code="bad_cursor") from None
        except StoreError as exc:
            raise store_failure(exc) from None
        return [approval_view(a) for a in page]

    async def pending(self) -> int:
        """How many approvals wait (``/v1/status``, the gauge)."""
        try:
            count = await self.store.pending_approvals()
        except StoreError as exc:
            raise store_failure(exc) from None
        self.metrics.approvals_pending.set(count)
        return count

    async def unpark_for_swap(self, assistants: list[str]) -> list[tuple[str, str]]:
        """Under restart-turn: drop the parked runs of ``assistants``' turns awaiting approval that
        ran on another model than the new one; those turns, to re-run now (RFC 0012 §5)."""
        if self.running.policy.policy is not SwapPolicy.RESTART_TURN:
            return []
        turns: list[tuple[str, str]] = []
        for assistant in assistants:
            model = self.running.model_of(assistant, "")
            try:
                dropped = await self.store.unpark_for_swap(assistant, model)
            except StoreError as exc:
                log.error(events.LOG_APPROVAL_FAILED, what="discard parked runs", assistant=assistant, error=str(exc))
                continue
            for session_id, turn_id in dropped:
                log.info(events.LOG_APPROVAL_DISCARDED, session=session_id, turn=turn_id, model_to=model)
            turns += dropped
        return turns

    # ------------------------------------------------------------------ expiry

    async def expire_forever(self) -> None:
        """Expire pending approvals past ``approval_timeout``, and resume the turns that then have
        nothing to wait for. Any replica may do it: the store's conditional update decides each once."""
        while True:
            try:
                due = await self.store.next_expiry()
            except StoreError as exc:
                log.warning(events.LOG_APPROVAL_FAILED, what="read the next expiry", error=str(exc))
                due = None
            if due is not None and due <= time.time() and await self.expire_due():
                continue  # a write only when something is due: waiting costs a read
            if due is not None and due <= time.time():
                due = None  # the store failed: try again after a poll interval
            wait = EXPIRY_POLL if due is None else min(EXPIRY_POLL, due - time.time())
            with anyio.move_on_after(max(0.0, wait)):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def expire_due(self) -> bool:
        """One pass of expiry; False when the store failed."""
        try:
            expired, ready = await self.store.expire_approvals(time.time())
        except StoreError as exc:
            log.warning(events.LOG_APPROVAL_FAILED, what="expire approvals", error=str(exc))
            return False
        for session_id, turn_id in ready:
            await self._resume(session_id, turn_id)
        for approval in expired:
            self.decided(self.sessions.get(approval.session), approval)
        return True

    async def resume_now(self, session_id: str, turn_id: str) -> None:
        """Resume a turn whose approvals are all decided (``Resume``)."""
        await self._resume(session_id, turn_id)

    async def _resume(self, session_id: str, turn_id: str) -> None:
        if self.resume is None:
            return
        log.info(events.LOG_APPROVAL_RESUMED, session=session_id, turn=turn_id)
        try:
            await self.resume(session_id, turn_id)
        except StoreError as exc:  # the turn stays pending with nothing to wait for: a restart or a scan runs it
            log.error(events.LOG_APPROVAL_FAILED, what="resume the turn", session=session_id, error=str(exc))


def new_approval_id() -> str:
    """A new approval id (``ap_…``)."""
    return f"ap_{secrets.token_hex(6)}"
