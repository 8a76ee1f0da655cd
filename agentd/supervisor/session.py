"""One session as the supervisor runs it: its child process, its in-flight turn, its subscribers.

``SessionRuntime.run`` is the session's task for its whole life: start a child (Ready handshake
within ``spawn_timeout``), open the session from its committed transcript, re-send an
interrupted turn, pump frames and ping until the child ends; on a crash, respawn with backoff
(0.5 s doubling to 30 s, jittered); more than 5 crashes in 60 s marks the session ``failed`` until
a new message resumes it.
"""

from __future__ import annotations

import collections
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentd import events
from agentd.budget import TurnStatus
from agentd.messages import Message, UserMessage
from agentd.obs import get_logger
from agentd.protocol import (
    Cancel,
    Event,
    Failed,
    Frame,
    Input,
    Open,
    Ping,
    Pong,
    ProtocolError,
    SwapAck,
    SwapApplied,
    SwapIntel,
    TurnDiscarded,
    TurnDone,
)
from agentd.records import SessionState, TurnRecord
from agentd.store import StoreError
from agentd.supervisor.process import ChildProcess, SpawnError
from agentd.views import Entry, entry_from_message, turn_done_event

if TYPE_CHECKING:
    from agentd.supervisor.core import Supervisor

__all__ = ["PendingTurn", "SessionRuntime"]

log = get_logger("supervisor")

CRASH_WINDOW = 60.0
MAX_CRASHES = 5
BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
SUBSCRIBER_BUFFER = 1024
_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class PendingTurn:
    """A turn that was accepted (its input is stored) and has not ended yet."""

    id: str
    message: UserMessage | None
    started_at: float
    stored: bool = False  # its input is in the store: only then may it be delivered
    done: anyio.Event = field(default_factory=anyio.Event)
    result: TurnRecord | None = None  # as committed (or, for a turn ended without results, as abandoned)
    entries: list[Entry] = field(default_factory=list)  # what the turn added, as the API shows it
    sent_to: ChildProcess | None = None  # the child it was delivered to (delivered once per child)
    cancel_requested: bool = False


class SessionRuntime:
    """Supervisor-side state of one open session."""

    def __init__(
        self,
        host: Supervisor,
        session_id: str,
        assistant: str,
        state: SessionState,
        generation: int,
        model: str,
        transcript: list[Message],
    ) -> None:
        self.host = host
        self.id = session_id
        self.assistant = assistant
        self.state: SessionState = state
        self.generation = generation
        self.model = model
        self.transcript = transcript  # committed transcript (the child is opened from it)
        self.pending: PendingTurn | None = None
        self.child: ChildProcess | None = None
        self.child_state = "stopped"
        self.child_generation = 0  # the newest generation the child has acknowledged
        self.child_restarts = 0
        self.intel_waiting = False  # a turn is waiting because every endpoint is down
        self.closing = False
        self._crashes: collections.deque[float] = collections.deque()
        self._resume = anyio.Event()
        self._subscribers: set[MemoryObjectSendStream[tuple[str, dict[str, Any]]]] = set()
        self._pong = anyio.Event()
        self._cancel_scope: anyio.CancelScope | None = None

    # ------------------------------------------------------------------ events

    def subscribe(self) -> MemoryObjectReceiveStream[tuple[str, dict[str, Any]]]:
        """A stream of (event name, data) for this session; closed when the session is."""
        send, receive = anyio.create_memory_object_stream[tuple[str, dict[str, Any]]](SUBSCRIBER_BUFFER)
        self._subscribers.add(send)
        return receive

    def publish(self, name: str, turn: str | None, data: dict[str, Any]) -> None:
        """Fan an event out to subscribers; a subscriber too slow to keep up is dropped, never waited for."""
        payload = {"session": self.id, "turn": turn, **data}
        for subscriber in list(self._subscribers):
            try:
                subscriber.send_nowait((name, payload))
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.discard(subscriber)
                subscriber.close()

    def _close_subscribers(self) -> None:
        for subscriber in self._subscribers:
            subscriber.close()
        self._subscribers.clear()

    # ------------------------------------------------------------------ turns

    async def deliver(self, turn: PendingTurn) -> None:
        """A turn's input is now stored: send it (or leave it for the child being started to pick up)."""
        turn.stored = True
        if self.pending is turn:
            await self._send_input(turn)

    async def _send_input(self, turn: PendingTurn) -> None:
        """Send ``turn`` to the current child unless it is not ready, not stored, or already has it.

        The one place an Input is sent: a turn accepted while a child starts is sent exactly once,
        whichever of deliver() and the child's start-up gets here first.
        """
        child = self.child
        if child is None or self.child_state != "ready" or not turn.stored or turn.sent_to is child:
            return
        turn.sent_to = child
        await self._send(Input(session=self.id, turn=turn.id, message=turn.message))
        if turn.cancel_requested:
            await self._send(Cancel(session=self.id, turn=turn.id))

    async def cancel_turn(self) -> str:
        """Ask the child to cancel the in-flight turn; the turn then ends ``cancelled``. Returns its id.

        A turn not yet delivered (its child is starting) is cancelled right after delivery.
        """
        assert self.pending is not None
        turn = self.pending
        turn.cancel_requested = True
        if turn.sent_to is not None and turn.sent_to is self.child:
            await self._send(Cancel(session=self.id, turn=turn.id))
        return turn.id

    async def abandon(self, status: TurnStatus, error: str) -> None:
        """End the pending turn without results (the session is closing); its waiter gets the status."""
        await self._end_pending_without_result(status, error)

    def resume(self) -> None:
        """A failed session got a new message: start a child again."""
        self._crashes.clear()
        self.state = "idle"
        self._resume.set()

    async def close(self) -> None:
        """Stop the session's child; the task ends."""
        self.closing = True
        self._resume.set()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    # ------------------------------------------------------------------ the session task

    async def run(self) -> None:
        """The session's life: keep a child running for it until it is closed or the daemon stops."""
        backoff = BACKOFF_START
        while not self.closing:
            if self.state == "failed":
                self._resume = anyio.Event()
                await self._resume.wait()
                continue
            started = time.monotonic()
            clean = await self._one_child()
            if self.closing or clean:
                break
            backoff = BACKOFF_START if time.monotonic() - started > CRASH_WINDOW else backoff
            if self._record_crash():
                await self.fail(f"its child crashed {len(self._crashes)} times within {CRASH_WINDOW:g}s")
                continue
            await anyio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, BACKOFF_MAX)
        self._close_subscribers()

    def _record_crash(self) -> bool:
        """Count a crash; True when the session must be marked failed (more than 5 crashes in 60 s)."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > CRASH_WINDOW:
            self._crashes.popleft()
        self.child_restarts += 1
        return len(self._crashes) > MAX_CRASHES

    async def _one_child(self) -> bool:
        """Run one child to its end. True when it ended because we stopped it (not a crash)."""
        settings = self.host.config.supervisor
        self.child_state = "starting"
        try:
            child = await ChildProcess.start(f"{self.id}-{self.child_restarts}", env=self.host.child_env())
        except OSError as exc:
            log.error("child.start_failed", session=self.id, error=str(exc))
            self.child_state = "stopped"
            return False
        self.child = child
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(child.pump_stderr, self._child_stderr)
                with anyio.CancelScope() as scope:
                    self._cancel_scope = scope
                    if self.closing:
                        scope.cancel()
                    await self._serve_child(child, settings.spawn_timeout, tg)
                tg.cancel_scope.cancel()
        finally:
            self._cancel_scope = None
            self.child_state = "stopped"
            self.child = None
            # No grace here: a child still alive at this point is closing with its session, cut off
            # after the daemon's drain, or one that never became Ready (or broke the protocol).
            code = await child.stop(grace=0)
            log.info(events.LOG_CHILD_EXIT, session=self.id, pid=child.pid, code=code)
        return self.closing or self.host.stopping

    async def _serve_child(self, child: ChildProcess, spawn_timeout: float, tg: anyio.abc.TaskGroup) -> None:
        generation, spawn = self.host.spawn_frame(child.child_id)
        try:
            await child.handshake(spawn, spawn_timeout)
        except (SpawnError, OSError, anyio.BrokenResourceError) as exc:
            log.error("child.spawn_failed", session=self.id, pid=child.pid, error=str(exc))
            return
        self.child_generation = generation
        # A new child runs the generation it was spawned with (the config may have changed while
        # the session had no child, e.g. across a daemon restart): report what it runs.
        model = self.host.model_of(self.assistant, self.model)
        if (self.generation, self.model) != (generation, model):
            self.generation, self.model = generation, model
            await self.host.store.update_session(self.id, generation=generation, model=model)
        log.info(events.LOG_CHILD_READY, session=self.id, pid=child.pid, generation=generation)
        await child.send(Open(session=self.id, assistant=self.assistant, transcript=self.transcript))
        self.child_state = "ready"
        # A reload that landed while this child was starting: give it the newest generation now.
        latest = self.host.swap_frame()
        if latest.generation > generation:
            await child.send(latest)
        if self.pending is not None:  # an accepted turn (new, or interrupted by a crash) runs here
            await self._send_input(self.pending)
        tg.start_soon(self._ping_loop, child)
        await self._read_frames(child)

    async def _ping_loop(self, child: ChildProcess) -> None:
        settings = self.host.config.supervisor
        seq = 0
        while True:
            await anyio.sleep(settings.ping_interval)
            seq += 1
            self._pong = anyio.Event()
            try:
                await child.send(Ping(seq=seq))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            with anyio.move_on_after(settings.ping_timeout):
                await self._pong.wait()
                continue
            log.error("child.unresponsive", session=self.id, pid=child.pid, timeout=settings.ping_timeout)
            await child.stop(grace=0)  # the kill ladder; a hung child gets SIGTERM, then SIGKILL
            return

    async def _read_frames(self, child: ChildProcess) -> None:
        while True:
            try:
                frame = await child.receive()
            except ProtocolError as exc:
                log.error(events.LOG_PROTOCOL_ERROR, session=self.id, pid=child.pid, error=str(exc))
                await child.kill()
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            if frame is None:
                return
            try:
                await self._on_frame(frame)
            except ProtocolError as exc:
                log.error(events.LOG_PROTOCOL_ERROR, session=self.id, pid=child.pid, error=str(exc))
                await child.kill()
                return

    async def _send(self, frame: Frame) -> None:
        child = self.child
        if child is None:
            return
        # A child that is gone is respawned by the session task, which re-sends the pending turn.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await child.send(frame)

    async def send_swap(self, frame: SwapIntel) -> bool:
        """Send a SwapIntel if a child is up; False when none is (a new child starts on the newest generation)."""
        if self.child is None or self.child_state != "ready":
            return False
        await self._send(frame)
        return True

    def _child_stderr(self, line: str) -> None:
        """Re-emit the child's structured log lines as our own; anything else as ``child.stderr``."""
        try:
            fields = msgspec.json.decode(line)
        except msgspec.DecodeError:
            fields = None
        if isinstance(fields, dict) and isinstance(fields.get("event"), str):
            level = str(fields.pop("level", "info"))
            fields.pop("timestamp", None)
            emit = getattr(log, level if level in _LEVELS else "info")
            emit(fields.pop("event"), **{"child_" + k if k in ("component",) else k: v for k, v in fields.items()})
            return
        log.info(events.LOG_CHILD_STDERR, session=self.id, line=line[:4000])

    # ------------------------------------------------------------------ frames from the child

    async def _on_frame(self, frame: Frame) -> None:
        match frame:
            case Pong():
                self._pong.set()
            case Event(name=name, turn=turn, data=data):
                if name in (events.INTEL_WAITING, events.INTEL_RECOVERED):
                    self.intel_waiting = name == events.INTEL_WAITING
                self.publish(name, turn, data)
            case TurnDone():
                await self._on_turn_done(frame)
            case TurnDiscarded():
                log.info(
                    events.LOG_TURN_DISCARDED,
                    session=self.id,
                    turn=frame.turn,
                    model=frame.attempt.model,
                    steps=frame.attempt.steps,
                )
            case SwapAck(generation=generation):
                self.child_generation = max(self.child_generation, generation)
                self.host.swap_acked(self, generation)
            case SwapApplied():
                self.generation, self.model = frame.generation, frame.model_to
                self.host.metrics.swaps.labels(kind=frame.kind.value).inc()
                with anyio.CancelScope(shield=True):
                    await self.host.store.update_session(self.id, generation=frame.generation, model=frame.model_to)
            case Failed(turn=turn, error=error):
                log.error("child.failed", session=self.id, turn=turn, error=error)
                if turn is not None and self.pending is not None and self.pending.id == turn:
                    await self._end_pending_without_result(TurnStatus.FAILED, error)
            case _:
                raise ProtocolError(f"unexpected frame {type(frame).__name__!r} from child")

    async def _on_turn_done(self, done: TurnDone) -> None:
        pending, turn_id = self.pending, done.record.id
        if pending is None or pending.id != turn_id or done.session != self.id:
            log.warning("turn.unexpected", session=self.id, turn=turn_id, for_session=done.session)
            return
        with anyio.CancelScope(shield=True):  # a turn's results are committed whatever else happens
            model = self.host.model_of(done.assistant, self.model) if done.assistant != self.assistant else None
            try:
                committed = await self.host.store.commit_turn(
                    self.id,
                    done.record,
                    assistant=done.assistant,
                    messages=done.messages,
                    transcript=done.transcript,
                    model=model,
                )
            except StoreError as exc:
                log.error("turn.commit_failed", session=self.id, turn=turn_id, error=str(exc))
                return
            self._adopt(pending, done, committed.seqs, model)
        self._finish(pending, committed.record)

    def _adopt(self, pending: PendingTurn, done: TurnDone, seqs: Sequence[int], model: str | None) -> None:
        """Take a committed turn in: the session's transcript, the turn's entries, and a transfer's assistant."""
        if done.transcript is not None:  # a transfer rewrote the history
            self.transcript = list(done.transcript)
            pending.entries = [
                entry_from_message(seq, m)
                for seq, m in zip(seqs, done.transcript, strict=True)
                if m.turn == done.record.id and not isinstance(m, UserMessage)
            ]
        else:
            self.transcript = self.transcript + ([pending.message] if pending.message else []) + list(done.messages)
            pending.entries = [entry_from_message(seq, m) for seq, m in zip(seqs, done.messages, strict=True)]
        if model is not None:  # a transfer: the session now runs on the destination's model
            self.assistant, self.model = done.assistant, model

    async def fail(self, error: str) -> None:
        """Mark the session failed (kept, visible, resumable by a new message); its waiting turn ends failed."""
        self.state = "failed"
        log.error("session.failed", session=self.id, error=error)
        self.publish(events.SESSION_FAILED, self.pending.id if self.pending else None, {"error": error})
        await self._end_pending_without_result(TurnStatus.FAILED, error)
        try:
            await self.host.store.update_session(self.id, state="failed")
        except StoreError as exc:
            log.error("session.store_failed", session=self.id, error=str(exc))

    async def _end_pending_without_result(self, status: TurnStatus, error: str) -> None:
        pending = self.pending
        if pending is None:
            return
        now = time.time()
        with anyio.CancelScope(shield=True):
            try:
                await self.host.store.abandon_turn(self.id, pending.id, status=status.value, error=error, ended_at=now)
            except StoreError as exc:  # e.g. its results were committed meanwhile: nothing to abandon
                log.warning("turn.abandon_failed", session=self.id, turn=pending.id, error=str(exc))
        if pending.message is not None:
            self.transcript = [*self.transcript, pending.message]
        self._finish(
            pending, TurnRecord(id=pending.id, status=status, started_at=pending.started_at, ended_at=now, error=error)
        )

    def _finish(self, pending: PendingTurn, record: TurnRecord) -> None:
        """The turn has ended (``record`` as stored): free the session, count it, tell subscribers and the waiter."""
        self.pending = None
        self.intel_waiting = False
        if self.state != "failed":
            self.state = "idle"
        pending.result = record
        self.host.metrics.turns.labels(status=record.status.value).inc()
        self.host.metrics.turn_seconds.observe(max(0.0, record.ended_at - record.started_at))
        log.info(
            events.LOG_TURN_DONE,
            session=self.id,
            turn=record.id,
            status=record.status.value,
            models=list(record.models),
            restarts=record.restarts,
            steps=record.steps,
        )
        self.publish(events.TURN_DONE, record.id, turn_done_event(record, pending.entries))
        pending.done.set()
        self.host.turn_finished()
