"""The turn runner: every accepted turn from delivery to commit, across children that come and go.

A turn accepted by ``agentd.supervisor.turns.owner`` (its input stored) is driven here: the pool
gives the session a child (loading it there from the committed transcript if it was not), the
child gets ``Input``, and the turn ends when its ``TurnDone`` is committed (``commit_done``) — or
without a result (deadline, cancel, close, failure, ``end_without_result``), which is recorded as
such. A child that dies takes its in-flight turns with it; each re-runs on another child from the
committed transcript, unless the blame rules or the deadline say otherwise
(``agentd.supervisor.blame``). Every run of a turn is sent what earlier runs journaled (RFC 0008
§5). See RFC 0006.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import msgspec

from agentd import events
from agentd.approvals import ParkedRun, with_parked_spend
from agentd.budget import TurnStatus
from agentd.messages import UserMessage
from agentd.obs import Metrics, get_logger
from agentd.protocol import Cancel, Input, Open, ProtocolError, TurnDone
from agentd.records import JournalEntry, TurnRecord
from agentd.store import EVENTS, TURNS, CommittedTurn, LeaseLost, Store, StoreError, StoreUnavailable
from agentd.supervisor.approvals import Approvals
from agentd.supervisor.blame import CrashVerdict, blame, rerun_allowed
from agentd.supervisor.child import Child
from agentd.supervisor.pool import Pool
from agentd.supervisor.relay import EventRelay, relay_fence
from agentd.supervisor.running import Running
from agentd.supervisor.session import PendingTurn, SessionRuntime, SessionTable
from agentd.supervisor.turns.parking import load_parked
from agentd.usage import price_record
from agentd.views import entry_from_message

__all__ = ["DEADLINE_GRACE", "TurnRunner"]

log = get_logger("supervisor")

#: How long past a turn's deadline the supervisor waits for the child's own answer before it ends
#: the turn ``deadline`` itself (a child whose loop is blocked cannot answer).
DEADLINE_GRACE = 5.0
COMMIT_RETRY_START = 0.5
COMMIT_RETRY_MAX = 10.0
SHUTDOWN_CUT = "agentd is shutting down; the turn was not finished and re-runs at the next start"
LEASE_LOST_CUT = "another replica took the session over; the turn runs there and its result stands"
#: How long a turn's answer waits for its end notice to reach the replicas watching the session.
RELAY_FLUSH_BOUND = 2.0


class TurnRunner:
    """Drives turns on the pool, from delivery to their commit or their end without a result."""

    def __init__(
        self,
        *,
        store: Store,
        metrics: Metrics,
        running: Running,
        sessions: SessionTable,
        on_turn_finished: Callable[[], None],
        replica: str = "",
        relay: EventRelay | None = None,
        watched_elsewhere: Callable[[str], bool] = lambda _session: False,
        approvals: Approvals | None = None,
    ) -> None:
        self.store = store
        self.approvals = approvals
        self.replica = replica  # this replica's id, in the notifications it sends
        # On a shared store: what this replica sends other replicas, in order (RFC 0009 §7), and
        # whether another replica has subscribers for a session (its events are relayed there).
        self.relay = relay
        self.watched_elsewhere = watched_elsewhere
        self.metrics = metrics
        self.running = running
        self.sessions = sessions  # the hot sessions, by id
        self.pool: Pool | None = None
        self._on_turn_finished = on_turn_finished
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopped = anyio.Event()

    @property
    def stopping(self) -> bool:
        """The daemon is stopping: commits are no longer retried (the turn re-runs at the next start)."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop retrying commits."""
        self._stopped.set()

    def attach(self, pool: Pool, tg: anyio.abc.TaskGroup) -> None:
        """Start serving: turns are driven as tasks of ``tg``, on ``pool``."""
        self.pool, self._tg = pool, tg

    def spawn(self, task: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run ``task(*args)`` in the background, in the runner's task group (a commit, a journal write)."""
        assert self._tg is not None, "the runner is not attached"
        self._tg.start_soon(task, *args)

    def turn_finished(self) -> None:
        """A turn this replica ran is no longer in flight here (ended, parked, or taken over)."""
        self._on_turn_finished()

    # ------------------------------------------------------------------ driving a turn

    def start(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        """Drive ``turn`` (already stored and reserved as ``runtime.pending``) in the background."""
        assert self._tg is not None, "the runner is not attached"
        self._tg.start_soon(self.drive, runtime, turn)

    async def drive(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        """Deliver the turn until it ends. A bug here fails the turn, never the daemon or other turns."""
        try:
            await self._deliver_until_done(runtime, turn)
        except Exception as exc:
            runtime.log.exception(events.LOG_TURN_INTERNAL_ERROR, turn=turn.id)
            with anyio.CancelScope(shield=True):
                await self.end_without_result(runtime, turn, TurnStatus.FAILED, f"internal error: {exc!r}")

    async def _deliver_until_done(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        assert self.pool is not None
        if not turn.fresh and not await load_parked(self, runtime, turn):
            return
        while not turn.done.is_set():
            if turn.runs and not rerun_allowed(turn.budget_start, self.running.config.limits.deadline, time.time()):
                await self.end_without_result(
                    runtime, turn, TurnStatus.DEADLINE, "the turn's deadline passed while its child was replaced"
                )
                return
            runtime.place_quarantined(time.monotonic())
            # Waiting for a child counts against the deadline: a pool that cannot start one (a
            # tool that does not import, a spawn timeout too short) ends the turn, never strands it.
            waited_out = turn.budget_start + self.running.config.limits.deadline + DEADLINE_GRACE - time.time()
            child = None
            with anyio.move_on_after(max(0.0, waited_out)) as waiting:
                child = await self.pool.acquire(runtime.id, quarantined=runtime.quarantined)
            if waiting.cancelled_caught:
                reserved = self.pool.where(runtime.id)  # a place reserved on a child still starting
                if reserved is not None and runtime.child is not reserved:
                    self.pool.release(runtime.id, reserved)
                reason = self.pool.start_failure or "no child was free"
                await self.end_without_result(
                    runtime, turn, TurnStatus.DEADLINE, f"no child could take the turn by its deadline ({reason})"
                )
                return
            if child is None:  # the daemon is stopping: the turn stays stored and re-runs at the next start
                turn.cut_off(SHUTDOWN_CUT)
                return
            if await self._ended_meanwhile(runtime, turn, child):
                return
            if runtime.child is not child and not await self._open(runtime, child, turn):
                continue
            if await self._ended_meanwhile(runtime, turn, child):
                return
            await self._run_on(runtime, turn, child)
            if turn.done.is_set():
                return
            if turn.crashed and not await self._blame_crash(runtime, turn):
                return

    async def _ended_meanwhile(self, runtime: SessionRuntime, turn: PendingTurn, child: Child) -> bool:
        """Whether the turn ended (cancelled, closed) while it waited for ``child``; if so, give back
        what it took: the reservation, or — for a closed session — the session it loaded there."""
        if not (turn.done.is_set() or runtime.closing):
            return False
        assert self.pool is not None
        if runtime.child is child:
            if runtime.closing:
                runtime.unloaded()
                await self.pool.unload(runtime.id)  # Close: the child forgets the session
        else:
            self.pool.release(runtime.id, child)
        return True

    async def _run_on(self, runtime: SessionRuntime, turn: PendingTurn, child: Child) -> None:
        """Send the turn to ``child`` and wait until it ends there, the child goes, or the deadline passes."""
        if turn.cancel_requested:  # cancelled before it reached a child: it never starts
            await self.end_without_result(runtime, turn, TurnStatus.CANCELLED, "cancelled before it started")
            return
        turn.runs_on(child)
        # The deadline this run is sent with (a reload that changes it applies from the next run).
        deadline = self.running.config.limits.deadline
        assert self.pool is not None
        self.pool.turn_started(runtime.id, child)
        try:
            if turn.runs > 1:
                self.metrics.turn_reruns.inc()
                runtime.log.info(events.LOG_TURN_RERUN, turn=turn.id, child=child.id, run=turn.runs)
            journal = await self._journal_for(runtime, turn)
            if journal is None:
                return
            frame = Input(
                session=runtime.id,
                turn=turn.id,
                message=turn.message,
                started_at=turn.budget_start,
                watched=runtime.watched or self.watched_elsewhere(runtime.id),
                # Every earlier run — on a child that died, or thrown away by restart-turn — is void
                # for clients; this one streams under the next number (RFC 0005 §7). A turn this
                # process did not accept (resumed at start-up, adopted from a dead replica) may have
                # streamed elsewhere before: its runs here count from 1.
                run=turn.runs - 1 + turn.discards + (0 if turn.fresh else 1),
                journal=journal,
                trace=turn.trace,
                resumed=not turn.fresh,
                resume=turn.resume[0] if turn.resume is not None else None,
                decisions=turn.resume[1] if turn.resume is not None else [],
            )
            await child.send(frame)
            while not (turn.done.is_set() or turn.lost.is_set()):
                remaining = turn.budget_start + deadline + DEADLINE_GRACE - time.time()
                if remaining <= 0:
                    await child.send(Cancel(session=runtime.id, turn=turn.id))
                    await self.end_without_result(
                        runtime, turn, TurnStatus.DEADLINE, "the child did not end the turn by its deadline"
                    )
                    return
                with anyio.move_on_after(remaining):
                    await turn.settled.wait()
        finally:
            turn.left(child)
            self.pool.turn_ended(runtime.id, child)  # re-plans: room may have freed up

    async def _journal_for(self, runtime: SessionRuntime, turn: PendingTurn) -> list[JournalEntry] | None:
        """What earlier runs of the turn journaled, once every journal write of theirs has landed.

        A child that died may have sent journal frames still being written; the re-run must see
        them. None when the journal cannot be read: the turn ends failed rather than risk running
        a side-effecting call twice.
        """
        if turn.fresh and turn.runs == 1:  # its first run: nothing was journaled (a store read saved)
            return []
        await turn.journal_quiet()
        try:
            return await self.store.journal_entries(runtime.id, turn.id)
        except StoreError as exc:
            await self.end_without_result(runtime, turn, TurnStatus.FAILED, f"cannot read the tool journal: {exc}")
            return None

    async def _open(self, runtime: SessionRuntime, child: Child, turn: PendingTurn) -> bool:
        """Load the session on ``child`` from its committed transcript (the turn's own input left out)."""
        transcript = await self.store.transcript(runtime.id, exclude_turn=turn.id)
        frame = Open(session=runtime.id, assistant=runtime.assistant, transcript=transcript)
        try:
            sent = await child.send(frame)  # a transcript beyond one frame goes in parts
        except ProtocolError as exc:
            await self.end_without_result(runtime, turn, TurnStatus.FAILED, f"cannot load the session: {exc}")
            return False
        if not sent:
            return False
        runtime.loaded_on(child)
        self.metrics.session_loads.inc()
        runtime.log.info(events.LOG_SESSION_LOADED, child=child.id, pid=child.pid, entries=len(transcript))
        # A session loaded now runs the child's generation, the newest: it takes any swap it
        # missed while not loaded at once (it was idle).
        generation, model = self.running.generation, self.running.model_of(runtime.assistant, runtime.model)
        if (runtime.generation, runtime.model) != (generation, model):
            runtime.swapped(generation, model)
            await self._store_quietly(
                self.store.update_session(runtime.id, generation=generation, model=model, lease=runtime.lease),
                runtime,
            )
        return True

    async def _blame_crash(self, runtime: SessionRuntime, turn: PendingTurn) -> bool:
        """Count the crash against the session; False when it is now failed (its turn ended)."""
        verdict = blame(runtime.crashes, time.monotonic())
        newly_quarantined = runtime.blamed(verdict.crashes, quarantine=verdict.verdict is CrashVerdict.QUARANTINE)
        if verdict.verdict is CrashVerdict.FAIL:
            await self.fail(runtime, f"its turn was in flight during {len(verdict.crashes)} child crashes within 60s")
            return False
        if newly_quarantined:
            runtime.log.warning(events.LOG_SESSION_QUARANTINED, turn=turn.id, crashes=len(verdict.crashes))
        return True

    # ------------------------------------------------------------------ ending a turn

    async def end_without_result(
        self,
        runtime: SessionRuntime,
        turn: PendingTurn,
        status: TurnStatus,
        error: str,
        *,
        answered: bool = False,
        parked: ParkedRun | None = None,
    ) -> None:
        """End ``turn`` with no result from a child; its user message stays in the transcript.

        A turn whose waiter was answered already (``turn.done``) is left as it is — it ended, or was
        cut to re-run later — unless ``answered`` says that answer was only the 503 of a commit
        being retried: that turn has not ended and must end here, or its session stays busy.
        ``parked``: its run parked for approvals, whose priced spend the record keeps (RFC 0012 §5).
        """
        if runtime.pending is not turn or turn.record is not None or (turn.done.is_set() and not answered):
            return
        now = time.time()
        record = TurnRecord(id=turn.id, status=status, started_at=turn.started_at, ended_at=now, error=error)
        spent = None if parked is None else price_record(with_parked_spend(record, parked), self.running.config.prices)
        with anyio.CancelScope(shield=True):
            try:
                await self.store.abandon_turn(
                    runtime.id,
                    turn.id,
                    status=status.value,
                    error=error,
                    ended_at=now,
                    lease=runtime.lease,
                    spent=spent,
                )
            except LeaseLost as exc:
                await self.lease_lost(runtime, str(exc))
                return
            except StoreError as exc:  # e.g. its results were committed meanwhile: nothing to abandon
                runtime.log.warning(events.LOG_TURN_ABANDON_FAILED, turn=turn.id, error=str(exc))
                spent = None  # not stored: what was committed (or nothing) stands
            await self._finish(runtime, turn, record if spent is None else spent)

    async def fail(self, runtime: SessionRuntime, error: str) -> None:
        """Mark the session failed (kept, visible, resumable by a new message); its turn ends failed."""
        runtime.failed()
        runtime.log.error(events.LOG_SESSION_FAILED, error=error)
        self.emit(runtime, events.SESSION_FAILED, runtime.pending.id if runtime.pending else None, {"error": error})
        if runtime.pending is not None:
            await self.end_without_result(runtime, runtime.pending, TurnStatus.FAILED, error)
        await self._store_quietly(self.store.update_session(runtime.id, state="failed"), runtime)

    async def lease_lost(self, runtime: SessionRuntime, reason: str) -> None:
        """Another replica took the session over: stop acting for it, writing nothing (RFC 0009 §7).

        The turn in flight here (if any) is cancelled on its child and dropped: the replica that
        holds the lease now re-runs it and its result is the one that stands. The session is
        unloaded here, so a later turn on this replica loads what the store has.
        """
        # The stale lease stays: any write still made with it is refused by the store (never unfenced).
        lease = runtime.lease
        turn = runtime.pending
        runtime.log.warning(
            events.LOG_SESSION_LEASE_LOST,
            turn=turn.id if turn is not None else None,
            token=lease.token if lease is not None else None,
            reason=reason,
        )
        if turn is not None:
            child = turn.child
            runtime.turn_dropped()
            turn.cut_off(LEASE_LOST_CUT, "lease_lost")
            if child is not None and child.usable:
                await child.send(Cancel(session=runtime.id, turn=turn.id))
            self.turn_finished()
        if lease is not None:  # refused when truly lost; were it still ours, the turn is left to a scan
            with anyio.CancelScope(shield=True):
                try:
                    await self.store.release(lease)
                except StoreError as exc:
                    runtime.log.warning(events.LOG_SESSION_RELEASE_FAILED, error=str(exc))
        if self.pool is not None:
            runtime.unloaded()
            await self.pool.unload(runtime.id)
        self.evict_if_cold(runtime)

    async def release_lease(self, runtime: SessionRuntime) -> None:
        """Give the session's lease up once its turn ended, so any replica can run its next turn."""
        lease = runtime.give_up_lease()
        if lease is None:
            return
        try:
            await self.store.release(lease)
        except StoreError as exc:  # it expires by itself
            runtime.log.warning(events.LOG_SESSION_RELEASE_FAILED, error=str(exc))

    async def _finish(self, runtime: SessionRuntime, turn: PendingTurn, record: TurnRecord) -> None:
        if not turn.ended_with(record):  # before any await: a second ending stops here
            return
        # A shared store: other replicas' subscribers hear of the turn, after its progress events
        # (one ordered queue).
        relay = self.relay if runtime.lease is not None else None
        if relay is not None:
            relay.send(TURNS, f"{runtime.id} {record.id} {self.replica}")
        await self.release_lease(runtime)  # before the answer: the next message may go to any replica
        if relay is not None and self.watched_elsewhere(runtime.id):
            # A remote subscriber hears of this turn's end before the client can start the next
            # turn on yet another replica, so its stream stays in order across turns.
            await relay.flush(RELAY_FLUSH_BOUND)
        runtime.turn_ended()
        self.metrics.labelled(self.metrics.turns, record.status.value).inc()
        self.metrics.turn_seconds.observe(max(0.0, record.ended_at - record.started_at))
        self.metrics.count_spend(record.by_model)
        runtime.log.info(
            events.LOG_TURN_DONE,
            turn=record.id,
            status=record.status.value,
            models=list(record.models),
            restarts=record.restarts,
            steps=record.steps,
        )
        if runtime.watched:
            runtime.publish_turn_done(record, turn.entries)
        turn.mark_done()
        self.turn_finished()
        self.evict_if_cold(runtime)

    def emit(self, runtime: SessionRuntime, name: str, turn: str | None, data: dict[str, Any]) -> None:
        """Publish a session event to its subscribers here and, when another replica has
        subscribers for the session, relay it there (RFC 0009 §7)."""
        runtime.publish(name, turn, data)
        if self.relay is not None and self.watched_elsewhere(runtime.id):
            running = runtime.pending.id if runtime.pending is not None else None
            relayed, fence = relay_fence(turn, running, runtime.lease)
            if relayed:
                self.relay.send_event(EVENTS, runtime.id, turn, name, data, fence=fence)
            else:
                self.relay.fence_stale()

    async def commit_done(self, runtime: SessionRuntime, child: Child, done: TurnDone) -> None:
        """Commit what ``child`` sent as the turn's end, and end the turn with it."""
        pending = runtime.pending
        if pending is None or pending.id != done.record.id or done.session != runtime.id:
            runtime.log.warning(events.LOG_TURN_UNEXPECTED, turn=done.record.id, child=child.id)
            return
        # Priced once, now, at the prices running when it ended: a retried commit writes the same
        # costs, and a later reload prices later turns only (RFC 0011 §2).
        done = msgspec.structs.replace(done, record=price_record(done.record, self.running.config.prices))
        with anyio.CancelScope(shield=True):  # a turn's results are committed whatever else happens
            model = (
                self.running.model_of(done.assistant, runtime.model) if done.assistant != runtime.assistant else None
            )
            committed = await self._commit(runtime, pending, done, model)
            if committed is None:
                return
            added = done.transcript if done.transcript is not None else done.messages
            pending.added(
                [
                    entry_from_message(seq, message)
                    for seq, message in zip(committed.seqs, added, strict=True)
                    if done.transcript is None
                    or (message.turn == done.record.id and not isinstance(message, UserMessage))
                ]
            )
            if model is not None:  # a transfer: the session now runs on the destination's model
                runtime.transferred(done.assistant, model)
            await self._finish(runtime, pending, committed.record)

    async def _commit(
        self, runtime: SessionRuntime, pending: PendingTurn, done: TurnDone, model: str | None
    ) -> CommittedTurn | None:
        """Commit the turn's results, retrying while the database itself fails: a finished turn is never lost.

        The waiting client is answered at the first failure (503 naming the turn) and readiness
        reports the store meanwhile; the session stays busy with this turn until it is committed,
        then it is usable as before. A refusal that is not the database's fault ends the turn failed,
        on a retry too. A retry of a commit that had landed (its answer lost with the connection) is
        not refused: the store recognises it and returns what it committed (RFC 0003 §3).
        """
        backoff = COMMIT_RETRY_START
        retried = False  # the database failed before: the waiter was answered, the turn has not ended
        while True:
            try:
                return await self.store.commit_turn(
                    runtime.id,
                    done.record,
                    assistant=done.assistant,
                    messages=done.messages,
                    transcript=done.transcript,
                    model=model,
                    lease=runtime.lease,
                )
            except LeaseLost as exc:
                await self.lease_lost(runtime, str(exc))
                return None
            except StoreUnavailable as exc:
                if self.stopping:  # the turn stays stored as pending: it re-runs at the next start
                    return None
                runtime.log.error(
                    events.LOG_TURN_COMMIT_FAILED,
                    turn=done.record.id,
                    error=str(exc),
                    retry_in=backoff,
                )
                pending.cut_off(
                    f"the store could not commit the turn ({exc}); it is retried and kept",
                    "store_full" if exc.full else "store_unavailable",
                )
                retried = True
                with anyio.move_on_after(backoff):
                    await self._stopped.wait()  # a stop ends the wait at once
                backoff = min(backoff * 2, COMMIT_RETRY_MAX)
            except StoreError as exc:
                runtime.log.error(events.LOG_TURN_COMMIT_REFUSED, turn=done.record.id, error=str(exc))
                await self.end_without_result(
                    runtime,
                    pending,
                    TurnStatus.FAILED,
                    f"the store refused the turn's results: {exc}",
                    answered=retried,
                )
                return None

    # ------------------------------------------------------------------ helpers

    def evict_if_cold(self, runtime: SessionRuntime) -> None:
        """Forget a runtime that is no longer loaded, running or watched (the store has the session)."""
        self.sessions.evict_if_cold(runtime)

    async def _store_quietly(self, call: Awaitable[None], runtime: SessionRuntime) -> None:
        """Await a store update whose failure must not end the caller (it is logged)."""
        with anyio.CancelScope(shield=True):
            try:
                await call
            except StoreError as exc:
                runtime.log.error(events.LOG_SESSION_STORE_FAILED, error=str(exc))
