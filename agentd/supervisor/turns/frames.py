"""What children send about their sessions, and children coming and going: the pool's owner.

Every frame a child sends about a session comes here, routed by session id: progress events to
the session's subscribers (and the relay), a ``TurnDone`` to the turn runner's commit, a
``TurnParked`` to the approvals' parking steps, journal frames to the store and back as acks
(RFC 0008 §5), swaps to the session's state. A child that ends takes its sessions' places with it:
their turns are marked lost, and the runner re-runs them (RFC 0006).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from agentd import events
from agentd.budget import TurnStatus
from agentd.obs import get_logger
from agentd.protocol import (
    Event,
    Failed,
    Frame,
    JournalAck,
    JournalFinish,
    JournalStart,
    ProtocolError,
    SwapApplied,
    SwapsApplied,
    TurnDiscarded,
    TurnDone,
    TurnParked,
)
from agentd.store import LeaseLost, StoreError
from agentd.supervisor.child import Child
from agentd.supervisor.session import PendingTurn, SessionRuntime
from agentd.supervisor.turns.parking import on_parked
from agentd.supervisor.turns.runner import TurnRunner

__all__ = ["ChildFrames"]

log = get_logger("supervisor")


class ChildFrames:
    """The pool's owner (``agentd.supervisor.pool.PoolOwner``): children's session frames, their
    swap acks, and their ends, acted on through the turn runner."""

    def __init__(self, runner: TurnRunner, *, on_swap_acked: Callable[[Child, int], None]) -> None:
        self._runner = runner
        self.store = runner.store
        self.running = runner.running
        self.metrics = runner.metrics
        self.sessions = runner.sessions
        self._on_swap_acked = on_swap_acked

    async def session_frame(self, child: Child, frame: Frame) -> None:
        """A frame about one session, from ``child``."""
        session_id = getattr(frame, "session", None)
        runtime = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if runtime is None:
            log.debug(
                events.LOG_CHILD_FRAME_FOR_UNKNOWN_SESSION,
                child=child.id,
                session=session_id,
                frame=type(frame).__name__,
            )
            return
        match frame:
            case Event(name=name, turn=turn, data=data):
                if name in (events.DELTA, events.STEP_RESET):
                    self.metrics.labelled(self.metrics.delta_frames, name).inc()
                if name in (events.INTEL_WAITING, events.INTEL_RECOVERED):
                    runtime.waiting_for_intel(name == events.INTEL_WAITING)
                if not runtime.held(name, turn, data):  # after a TurnDone being committed: keep the order
                    self._runner.emit(runtime, name, turn, data)
            case TurnDone() | TurnParked():
                # Committed in a task of its own: this child's other sessions keep streaming meanwhile;
                # this session's later events wait in its backlog, so turn.done comes first.
                runtime.hold_events()
                self._runner.spawn(self._on_turn_done_in_order, runtime, child, frame)
            case TurnDiscarded(turn=turn, attempt=attempt):
                runtime.log.info(events.LOG_TURN_DISCARDED, turn=turn, model=attempt.model, steps=attempt.steps)
                if runtime.pending is not None and runtime.pending.id == turn:
                    runtime.pending.restarted_on_child()
            case JournalStart() | JournalFinish():
                # Written in a task of its own (the child's other frames keep flowing), counted on the
                # turn so that a re-run reads the journal only after the write has landed.
                pending = runtime.pending
                if pending is not None:
                    pending.journal_write_begins()
                self._runner.spawn(self._journal_counted, runtime, child, frame, pending)
            case SwapApplied():
                # Kept in memory only: a reload must not cost a store write per loaded session. The
                # row catches up when the session is next loaded or its turn commits, and a session
                # read from its row runs the current generation anyway (RFC 0006 §7).
                runtime.swapped(frame.generation, frame.model_to)
                self.metrics.swaps.labels(kind=frame.kind.value).inc()
            case Failed(turn=turn, error=error):
                runtime.log.error(events.LOG_CHILD_FAILED, child=child.id, turn=turn, error=error)
                if turn is None and runtime.child is child:  # it refused to open the session: not loaded there
                    runtime.unloaded()
                    if self._runner.pool is not None:
                        self._runner.pool.release(runtime.id, child)
                pending = runtime.pending
                if pending is not None and (turn is None or pending.id == turn) and pending.child is child:
                    await self._runner.end_without_result(runtime, pending, TurnStatus.FAILED, error)
            case _:
                raise ProtocolError(f"unexpected frame {type(frame).__name__!r} from child")

    async def _journal_counted(
        self, runtime: SessionRuntime, child: Child, frame: JournalStart | JournalFinish, pending: PendingTurn | None
    ) -> None:
        try:
            with anyio.CancelScope(shield=True):  # an acked write must land whatever else happens
                await self._on_journal(runtime, child, frame)
        finally:
            if pending is not None:
                pending.journal_landed()

    async def _on_turn_done_in_order(self, runtime: SessionRuntime, child: Child, done: TurnDone | TurnParked) -> None:
        try:
            if isinstance(done, TurnParked):
                await on_parked(self._runner, runtime, child.id, done)
            else:
                await self._runner.commit_done(runtime, child, done)
        finally:
            for name, turn, data in runtime.release_events():
                self._runner.emit(runtime, name, turn, data)

    async def _on_journal(self, runtime: SessionRuntime, child: Child, frame: JournalStart | JournalFinish) -> None:
        """Write a journal frame and ack it. The ack is what lets the child run (or go on past) the call."""
        finished = isinstance(frame, JournalFinish)
        entry = frame.entry
        pending = runtime.pending
        error: str | None = None
        if pending is None or pending.id != frame.turn or pending.child is not child:
            error = f"turn {frame.turn} is not running on this child"
        else:
            try:
                if finished:
                    await self.store.journal_finish(
                        runtime.id,
                        frame.turn,
                        entry.seq,
                        content=entry.content,
                        is_error=entry.is_error,
                        lease=runtime.lease,
                    )
                else:
                    await self.store.journal_start(runtime.id, frame.turn, entry, lease=runtime.lease)
            except LeaseLost as exc:
                error = str(exc)
                self._runner.spawn(self._runner.lease_lost, runtime, str(exc))
            except StoreError as exc:
                error = str(exc)
        if error is not None:
            runtime.log.error(events.LOG_TOOL_JOURNAL_REFUSED, turn=frame.turn, seq=entry.seq, error=error)
        await child.send(JournalAck(session=runtime.id, turn=frame.turn, seq=entry.seq, finished=finished, error=error))

    # ------------------------------------------------------------------ children coming and going

    async def child_ready(self, child: Child) -> None:
        """A child that started while a reload landed gets the newest generation at once."""
        if self.running.generation > child.generation:
            await child.send(self.running.swap_frame())

    async def child_lost(self, child: Child, loaded: set[str], in_flight: set[str], *, crashed: bool) -> None:
        """``child`` ended: its sessions are no longer loaded; its in-flight turns re-run elsewhere."""
        if crashed:
            self.metrics.child_crashes.inc()
        for session_id in loaded | in_flight:
            runtime = self.sessions.get(session_id)
            if runtime is None:
                continue
            runtime.unloaded(child)
            pending = runtime.pending
            if pending is not None and pending.child is child:
                pending.mark_lost(crashed=crashed)
            self.sessions.evict_if_cold(runtime)

    def swap_acked(self, child: Child, generation: int) -> None:
        """A child acknowledged a SwapIntel: its idle sessions run that generation from now on."""
        self._on_swap_acked(child, generation)
        hot = self.sessions.lookup  # a child hosts up to sessions_per_child sessions
        for session_id in child.loaded:
            runtime = hot(session_id)
            if runtime is not None and runtime.pending is None:
                runtime.took_generation(generation)

    def swaps_applied(self, child: Child, frame: SwapsApplied) -> None:
        """A child's idle sessions took a swap at once: in memory only, like ``SwapApplied``; the
        ``swap.applied`` event of a watched one is published here (the child sends none for them)."""
        for swap in frame.applied:
            self.metrics.swaps.labels(kind=swap.kind.value).inc(len(swap.sessions))
            data = {
                "generation": frame.generation,
                "kind": swap.kind.value,
                "model_from": swap.model_from,
                "model_to": swap.model_to,
                "policy": frame.policy.value,
            }
            hot = self.sessions.lookup
            for session_id in swap.sessions:
                runtime = hot(session_id)
                if runtime is None:
                    continue
                runtime.took_generation(frame.generation, swap.model_to)
                if runtime.watched or self._runner.watched_elsewhere(session_id):  # else nobody hears it
                    self._runner.emit(runtime, events.SWAP_APPLIED, None, dict(data))

    def idle_since(self, session_id: str) -> float | None:
        """When the session's last turn ended (monotonic), or None while one is in flight."""
        runtime = self.sessions.get(session_id)
        if runtime is None:
            return 0.0  # not hot any more: unload it
        return None if runtime.pending is not None else runtime.idle_since

    def session_unloaded(self, session_id: str) -> None:
        """The pool unloaded an idle session: it costs nothing until its next message."""
        self.metrics.session_unloads.inc()
        runtime = self.sessions.get(session_id)
        if runtime is None:
            log.info(events.LOG_SESSION_UNLOADED, session=session_id)
            return
        runtime.log.info(events.LOG_SESSION_UNLOADED)
        runtime.unloaded()
        self.sessions.evict_if_cold(runtime)
