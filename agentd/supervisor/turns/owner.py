"""``Turns``: the one owner of every turn, from acceptance to commit, and of what is done to a hot
session outside a child.

A turn is accepted here (``accept``: reserved on its session, its input stored, the session's
lease claimed when replicas share the store) and driven by this owner's turn runner
(``agentd.supervisor.turns.runner``) to its commit; what children send about it comes through
this owner's ``frames`` (``agentd.supervisor.turns.frames``, the pool's owner). Turns a restart
interrupted, or that the failover scan adopted, are registered here again (``resume``), and so
are turns that waited for approvals (``resume_parked``, ``agentd.supervisor.turns.parking``).
Cancelling a turn, closing a session, unloading a copy that may be stale: here too. What a
waiting client is answered with once the turn ended (or did not) is ``result``/``wait_elsewhere``.
Nothing outside this package starts, ends or commits a turn.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import msgspec

from agentd import events
from agentd.approvals import ApprovalStatus
from agentd.budget import TurnStatus
from agentd.errors import NotEnded, StoreDown, StoreFull, TurnRefused, store_failure
from agentd.messages import UserMessage
from agentd.obs import Metrics, get_logger
from agentd.protocol import Cancel, Watch
from agentd.records import StartedTurn, TurnRecord
from agentd.store import Store, StoredSession, StoreError, StoreUnavailable
from agentd.supervisor.approvals import Approvals
from agentd.supervisor.child import Child
from agentd.supervisor.membership import Membership
from agentd.supervisor.pool import Pool
from agentd.supervisor.running import Running
from agentd.supervisor.session import PendingTurn, SessionRuntime, SessionTable, added_entries
from agentd.supervisor.turns.frames import ChildFrames
from agentd.supervisor.turns.runner import TurnRunner
from agentd.views import Entry, MessageResult, approval_view, turn_view

__all__ = ["ELSEWHERE_POLL", "RESUME_CONCURRENCY", "Turns", "new_id"]

log = get_logger("supervisor")

#: Interrupted turns re-run after a restart at most this many at a time (new work is served meanwhile).
RESUME_CONCURRENCY = 16
#: How often a ``wait`` for a turn that another replica runs looks at the store (seconds).
ELSEWHERE_POLL = 0.1


def new_id(prefix: str) -> str:
    """A new session (``s_…``) or turn (``t_…``) id."""
    return f"{prefix}_{secrets.token_hex(6)}"


class Turns:
    """Accepts turns and drives them to their end; resumes interrupted ones; cancels, closes and
    unloads hot sessions. ``frames`` is the pool's owner: what children send comes in there."""

    def __init__(
        self,
        *,
        store: Store,
        running: Running,
        metrics: Metrics,
        sessions: SessionTable,
        membership: Membership,
        approvals: Approvals | None,
        on_swap_acked: Callable[[Child, int], None],
        on_turn_finished: Callable[[], None],
    ) -> None:
        self.store = store
        self.running = running
        self.sessions = sessions
        self.membership = membership
        self.runner = TurnRunner(
            store=store,
            metrics=metrics,
            running=running,
            sessions=sessions,
            on_turn_finished=on_turn_finished,
            replica=membership.replica,
            relay=membership.relay,
            watched_elsewhere=membership.watched_elsewhere,
            approvals=approvals,
        )
        self.frames = ChildFrames(self.runner, on_swap_acked=on_swap_acked)
        self.lease_time = running.config.store.lease  # restart-only, like the store itself
        self._pool: Pool | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def attach(self, pool: Pool, tg: anyio.abc.TaskGroup) -> None:
        """Start serving: turns run on ``pool``; they and other background work run in ``tg``."""
        self._pool, self._tg = pool, tg
        self.runner.attach(pool, tg)

    def stop(self) -> None:
        """The daemon stops: commits are no longer retried (their turns re-run at the next start)."""
        self.runner.stop()

    @property
    def pool(self) -> Pool:
        """The pool the turns run on (given by ``attach``)."""
        assert self._pool is not None, "turns are not attached"
        return self._pool

    def emit(self, runtime: SessionRuntime, name: str, turn: str | None, data: dict[str, Any]) -> None:
        """Publish a session event here and, when another replica watches the session, there."""
        self.runner.emit(runtime, name, turn, data)

    # ------------------------------------------------------------------ acceptance

    async def accept(
        self,
        runtime: SessionRuntime,
        message: UserMessage | None,
        *,
        durable: bool = True,
        trace: Mapping[str, str] | None = None,
    ) -> PendingTurn:
        """Reserve the session for a new turn, store its input, and hand it to the runner (or leave
        it to the replica that holds the session). Conflict while a turn runs; a store failure
        raises as the operation answers it."""
        turn = PendingTurn(
            id=message.turn if message and message.turn else new_id("t"),
            message=message,
            started_at=time.time(),
            fresh=True,
            trace=dict(trace or {}),
        )
        runtime.reserve(turn)  # synchronously: a concurrent request gets 409
        # Stored before delivered: the runner only sees the turn once begin_turn has committed its input.
        with anyio.CancelScope(shield=True):
            try:
                await self.store.begin_turn(
                    runtime.id, turn.id, message, turn.started_at, durable=durable, trace=turn.trace
                )
            except StoreUnavailable as exc:
                if not await self._begun_after_all(runtime, turn, exc):
                    runtime.unreserve(turn)
                    raise store_failure(exc) from None
            except StoreError as exc:
                runtime.unreserve(turn)
                raise TurnRefused(str(exc)) from None
            if not await self.membership.claim(runtime, turn.id):
                # Another replica holds the session (its previous turn is ending, or its failover
                # scan took this one — and may have ended it already): the turn is stored, and the
                # holder or the scan runs it, once.
                runtime.unreserve(turn)
                turn.run_elsewhere()
                runtime.log.info(events.LOG_SESSION_ELSEWHERE, turn=turn.id)
                self.sessions.evict_if_cold(runtime)
                return turn
        self.runner.start(runtime, turn)
        return turn

    async def _begun_after_all(self, runtime: SessionRuntime, turn: PendingTurn, failure: StoreUnavailable) -> bool:
        """Whether the failed ``begin_turn`` stored the turn after all (``Membership.begun_after_all``);
        when the store cannot say, the client is answered naming the turn, which may have been
        stored (and then runs, once)."""
        try:
            return await self.membership.begun_after_all(runtime, turn, failure)
        except StoreError:
            runtime.unreserve(turn)
            raise StoreDown(
                f"the store failed while storing the message, and may have stored it as turn {turn.id}"
                f" (then it runs, once; GET the session to see): {failure}",
                turn=turn.id,
            ) from None

    async def resume(self, runtime: SessionRuntime, stored: StoredSession, started: StartedTurn) -> PendingTurn | None:
        """Register an interrupted turn on its runtime; the turn to drive, or None if it ended now."""
        # A restart (or failover) is not the turn's fault: its deadline starts again now.
        turn = PendingTurn(
            id=started.id,
            message=started.message,
            started_at=started.started_at,
            budget_start=time.time(),
            trace=dict(started.trace),
        )
        runtime.restore(turn)
        if stored.state == "failed":  # it failed before the restart: its turn ends as it would have
            await self.runner.end_without_result(runtime, turn, TurnStatus.FAILED, "the session had failed")
            return None
        if started.cancel_requested:  # asked on a replica that did not run it (RFC 0009 §7)
            await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, "cancelled before it resumed")
            return None
        runtime.run_restored()
        return turn

    async def resume_interrupted(self) -> None:
        """Re-run the turns a restart interrupted (their input stored, their results not), at most
        ``RESUME_CONCURRENCY`` at a time, while new work is served."""
        try:
            interrupted = await self.store.interrupted_turns()
        except StoreError as exc:
            log.error(events.LOG_SUPERVISOR_RESUME_FAILED, error=str(exc))
            return
        log.info(events.LOG_SUPERVISOR_RESTORED, pending=len(interrupted))
        limiter = anyio.CapacityLimiter(RESUME_CONCURRENCY)
        # Every interrupted turn is registered at once — so a cancel, a close or a new message sees
        # it while it waits for its turn to resume — and driven at most RESUME_CONCURRENCY at a time.
        queued: list[tuple[SessionRuntime, PendingTurn]] = []
        for stored, started in interrupted:
            runtime = self.sessions.hot(stored)
            if runtime.pending is not None:
                continue
            turn = await self.resume(runtime, stored, started)
            if turn is not None:
                queued.append((runtime, turn))

        async def resume(runtime: SessionRuntime, turn: PendingTurn) -> None:
            async with limiter:
                if not turn.done.is_set() and not runtime.closing:
                    await self.runner.drive(runtime, turn)

        async with anyio.create_task_group() as tg:
            for runtime, turn in queued:
                tg.start_soon(resume, runtime, turn)

    async def resume_parked(self, session_id: str, turn_id: str) -> PendingTurn | None:
        """A turn that waited for approvals goes on (they are all decided, or a restart-turn swap
        discarded its parked run): registered here and driven, unless another replica holds the
        session (its failover scan runs it) or it ended. StoreError as is."""
        stored = await self.store.session_summary(session_id)
        started = await self.store.pending_turn(session_id)
        if stored is None or stored.state == "closed" or started is None or started.id != turn_id:
            return None
        runtime = self.sessions.hot(stored)
        if runtime.pending is not None or runtime.closing:
            return None
        if not await self.membership.claim(runtime, turn_id):
            self.sessions.evict_if_cold(runtime)
            return None
        # The awaits above may have let the runtime go cold (its child ended): it is hot again now.
        if self.sessions.add(runtime) is not runtime or runtime.pending is not None:
            return None
        turn = PendingTurn(id=turn_id, message=started.message, started_at=started.started_at, budget_start=time.time())
        runtime.restore(turn)
        if started.cancel_requested:
            found = await self.store.parked_run(session_id, turn_id)  # what it spent before it waited counts
            parked = found[0] if found else None
            await self.runner.end_without_result(
                runtime, turn, TurnStatus.CANCELLED, "cancelled while it waited", parked=parked
            )
            return None
        runtime.run_restored()
        self.runner.start(runtime, turn)
        return turn

    async def end_awaiting(self, runtime: SessionRuntime, reason: str) -> str | None:
        """End the session's turn that awaits approvals ``cancelled`` (a cancel, a close): its
        pending approvals are cancelled with it. The turn's id, or None if none awaits."""
        turn_id = await self.store.awaiting_turn(runtime.id)
        if turn_id is None or runtime.pending is not None:
            return None
        started = await self.store.pending_turn(runtime.id)
        if started is None or started.id != turn_id or not await self.membership.claim(runtime, turn_id):
            return None
        found = await self.store.parked_run(runtime.id, turn_id)
        if self.sessions.add(runtime) is not runtime or runtime.pending is not None:
            return None  # it went cold meanwhile and another request took it up
        waiting = [a for a in (found[1] if found else []) if a.status is ApprovalStatus.PENDING]
        turn = PendingTurn(id=turn_id, message=started.message, started_at=started.started_at)
        runtime.restore(turn)
        approvals = self.runner.approvals
        if approvals is not None:  # told before turn.done (nothing of a turn is published after it)
            now = time.time()
            for approval in waiting:
                cancelled = msgspec.structs.replace(
                    approval,
                    status=ApprovalStatus.CANCELLED,
                    reason=f"the turn ended (cancelled): {reason}",
                    decided_at=now,
                )
                approvals.decided(runtime, cancelled)
        # The transaction that abandons the turn cancels its pending approvals (RFC 0012 §4).
        parked = found[0] if found else None  # what it spent before it waited counts (RFC 0012 §5)
        await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, reason, parked=parked)
        return turn_id

    def drive(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        """Run ``turn`` (registered on ``runtime``) in the background."""
        self.runner.start(runtime, turn)

    async def lease_lost(self, runtime: SessionRuntime, reason: str) -> None:
        await self.runner.lease_lost(runtime, reason)

    # ------------------------------------------------------------------ answers

    def result(self, turn: PendingTurn) -> MessageResult:
        """What a waiting client is answered once ``turn`` has its answer."""
        if turn.record is None and turn.awaiting is not None:  # it waits for approvals (RFC 0012)
            started = StartedTurn(id=turn.id, message=turn.message, started_at=turn.started_at)
            return MessageResult(turn=turn_view(started), approvals=[approval_view(a) for a in turn.awaiting])
        if turn.record is None:  # stopped without ending: the daemon is shutting down
            error = StoreFull if turn.cut_code == "store_full" else NotEnded
            raise error(f"turn {turn.id}: {turn.cut or 'not finished'}", code=turn.cut_code, turn=turn.id)
        # The record as stored, so this answer and GET /v1/sessions show the same turn (same started_at).
        return MessageResult(turn=turn_view(turn.record), messages=turn.entries)

    async def wait_elsewhere(self, session_id: str, turn_id: str) -> MessageResult:
        """``wait`` for a turn another replica runs: poll the store until the turn has ended there."""
        bound = self.running.config.limits.deadline + 3 * self.lease_time + 10.0
        try:
            with anyio.move_on_after(bound):
                while True:
                    pending = await self.store.pending_turn(session_id)
                    if pending is None or pending.id != turn_id:
                        break
                    if (awaiting := await self.awaiting_result(session_id, pending)) is not None:
                        return awaiting  # it parked there: answered with its approvals, as here
                    await anyio.sleep(ELSEWHERE_POLL)
            found = await self.ended_turn(session_id, turn_id)
        except StoreError as exc:
            raise store_failure(exc) from None
        if found is None:
            raise NotEnded(
                f"turn {turn_id} runs on another replica and has not ended yet", code="turn_elsewhere", turn=turn_id
            )
        record, entries = found
        return MessageResult(turn=turn_view(record), messages=entries)

    async def awaiting_result(self, session_id: str, started: StartedTurn) -> MessageResult | None:
        """The answer to a client waiting on a stored pending turn that waits for approvals (RFC 0012
        §3: the turn ``pending`` and its pending approvals), or None if it does not wait. StoreError as is."""
        if await self.store.awaiting_turn(session_id) != started.id:
            return None
        found = await self.store.parked_run(session_id, started.id)
        waiting = [approval_view(a) for a in (found[1] if found else []) if a.status is ApprovalStatus.PENDING]
        return MessageResult(turn=turn_view(started), approvals=waiting)

    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[Entry]] | None:
        """A turn that ended, as committed (its record and the entries it added), or None if it has not."""
        found = await self.store.ended_turn(session_id, turn_id)
        if found is None:
            return None
        record, stored = found
        return record, added_entries(stored)

    # ------------------------------------------------------------------ cancels, closes, unloads

    async def cancel_here(self, runtime: SessionRuntime) -> str:
        """Cancel the turn this replica runs for ``runtime``."""
        turn = runtime.pending
        assert turn is not None
        turn.request_cancel()
        if turn.child is not None:
            await turn.child.send(Cancel(session=runtime.id, turn=turn.id))
        else:  # not on a child yet (waiting for one, or being loaded): it ends now and never starts
            await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, "cancelled before it started")
        return turn.id

    async def end_closed(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        """The session is closed here while ``turn`` runs: it ends ``cancelled`` (its child got Close)."""
        await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, "the session was closed")

    def stop_streaming(self, runtime: SessionRuntime) -> None:
        """The session's last subscriber here left: its child stops streaming the turn in flight
        (deltas and progress events, RFC 0005 §8) unless someone watches it elsewhere."""
        child = runtime.pending.child if runtime.pending is not None else None
        if child is not None and self._tg is not None:
            self._tg.start_soon(self._unwatch_child, runtime, child)

    async def _unwatch_child(self, runtime: SessionRuntime, child: Child) -> None:
        # Checked here, not when scheduled: a subscriber that came back meanwhile keeps it streaming
        # (its own watch frame, if any, follows this one on the channel).
        if not (runtime.watched or self.membership.watched_elsewhere(runtime.id)):
            await child.send(Watch(session=runtime.id, watched=False))
            turn = runtime.pending.id if runtime.pending is not None else None
            runtime.log.info(events.LOG_SESSION_UNWATCHED, turn=turn, child=child.id)

    async def close_here(self, session_id: str) -> None:
        """Another replica closed the session: end its turn here (cancelled), unload it, end its streams."""
        runtime = self.sessions.get(session_id)
        if runtime is None or runtime.closing:
            return
        runtime.closing_begins()
        turn = runtime.pending
        if turn is not None:
            await self.cancel_here(runtime)
            assert self._tg is not None
            self._tg.start_soon(self._forget_closed, runtime, turn)
        else:
            await self._forget_closed(runtime, None)

    async def _forget_closed(self, runtime: SessionRuntime, turn: PendingTurn | None) -> None:
        if turn is not None:
            await turn.done.wait()
        await self.pool.unload(runtime.id)
        runtime.unloaded()
        runtime.closed()
        self.sessions.forget(runtime)
        runtime.log.info(events.LOG_SESSION_CLOSED, elsewhere=True)

    async def unload(self, runtime: SessionRuntime) -> None:
        """Unload the session from its child: the next turn loads what the store has."""
        runtime.unloaded()
        await self.pool.unload(runtime.id)
