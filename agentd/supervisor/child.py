"""One child of the pool, as the supervisor runs it: handshake, ping, and the frames it sends,
routed by session id.

``Child`` is the pool's view of one child: its role, the sessions loaded on it and running a turn
there (kept by the pool: ``Pool.place``/``release``/``unload``, ``turn_started``/``turn_ended``),
its generation, and the tasks that keep it alive. What it talks to is a ``ChildLink`` made by the
pool's launcher (``agentd.supervisor.launcher``): a ``python -P -m agentd.child`` process by
default (``ChildProcess``: spawn, pidfd exit watch, process group, kill ladder), or the child
runtime as a task of this process in tests (``agentd.supervisor.inprocess``).

Liveness is per child, not per session: one ``Ping`` every ``ping_interval``; no ``Pong`` within
``ping_timeout`` starts the kill ladder — ``Shutdown{grace}`` → SIGTERM after the grace → SIGKILL
2 s later → reap. Reaping always happens, so no zombie is left. See rfcs/0006-pool.md.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Mapping, Set
from typing import Protocol

import anyio
import msgspec

from agentd import events
from agentd.config import SupervisorSettings
from agentd.obs import LogLimiter, get_logger
from agentd.protocol import (
    Failed,
    Frame,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Spawn,
    SwapAck,
    SwapsApplied,
)
from agentd.redact import SECRETS
from agentd.supervisor.launcher import (
    GONE,
    KILL_AFTER_TERM,
    SHUTDOWN_SEND_TIMEOUT,
    ChildLink,
    ChildProcess,
    Launcher,
    SpawnError,
)
from agentd.supervisor.placement import ChildRole, ChildSnapshot

# ChildProcess, SpawnError and the ladder's timings live in agentd.supervisor.launcher; they are
# named here too, where tests and benches have always imported them from.
__all__ = ["KILL_AFTER_TERM", "SHUTDOWN_SEND_TIMEOUT", "Child", "ChildProcess", "FrameSink", "SpawnError"]

#: Per child and kind: at most this many stderr lines (raw, or a library's log records) per window;
#: the rest are counted and reported as ``log.dropped`` (a flooding MCP server, RFC 0008 §3).
STDERR_LINES_PER_WINDOW = 100
STDERR_WINDOW = 10.0
_LEVELS = ("debug", "info", "warning", "error", "critical")
_STDLIB_EVENT = "stdlib.log"  # what agentd.obs names a standard-library log record

log = get_logger("supervisor")


class FrameSink(Protocol):
    """Where a child's session frames go (``agentd.supervisor.turns.frames.ChildFrames``)."""

    async def session_frame(self, child: Child, frame: Frame) -> None:
        """A frame about one session (Event, TurnDone, TurnDiscarded, SwapApplied, Failed with a session)."""

    def swap_acked(self, child: Child, generation: int) -> None:
        """The child acknowledged the SwapIntel of ``generation``."""

    def swaps_applied(self, child: Child, frame: SwapsApplied) -> None:
        """The child's idle sessions swapped at once (one frame for all of them)."""


class Child:
    """One pooled child: its process, its role in the pool, and the sessions it hosts.

    ``loaded`` are the sessions opened (or reserved) here; ``in_flight`` those with a turn running
    here. Both belong to the pool, which gives the child read-only views of its own sets: no one
    else edits them (``Pool.acquire``, ``release``, ``unload``, ``turn_started``, ``turn_ended``).
    This class only routes frames and keeps the child alive.
    """

    def __init__(
        self,
        child_id: str,
        role: ChildRole = ChildRole.STARTING,
        *,
        loaded: Set[str] = frozenset(),
        in_flight: Set[str] = frozenset(),
    ) -> None:
        self.id = child_id
        self.role = role
        self.process: ChildLink | None = None  # made by the pool's launcher
        self.generation = 0  # the newest generation this child runs or has acknowledged
        self.restarts = 0  # how many crashed children this one's place in the pool has seen
        self._loaded = loaded
        self._in_flight = in_flight
        # Monotonic time it last hosted a session (or was started): the pool retires an empty child
        # it grew for load once it has stayed empty for idle_unload (RFC 0006 §4).
        self.used_at = 0.0
        self.ready = anyio.Event()
        self.gone = anyio.Event()
        self.exit_code: int | None = None
        self.start_error: str | None = None  # why it never became Ready, if it did not
        self._pong = anyio.Event()
        self._stopping: float | None = None  # the grace of a requested stop
        self.send_timeout = 10.0  # how long a frame may wait to be taken (the running ping_timeout)
        self._stderr_limiter = LogLimiter(STDERR_LINES_PER_WINDOW, STDERR_WINDOW)

    @property
    def loaded(self) -> Set[str]:
        """The sessions loaded (or reserved) here: read-only, the pool keeps it."""
        return self._loaded

    @property
    def in_flight(self) -> Set[str]:
        """The sessions with a turn running here: read-only, the pool keeps it."""
        return self._in_flight

    @property
    def pid(self) -> int | None:
        """The process id, once started."""
        return self.process.pid if self.process is not None else None

    @property
    def usable(self) -> bool:
        """Ready, not gone and not being stopped: frames sent now will be read."""
        return self.ready.is_set() and not self.gone.is_set() and self._stopping is None

    def snapshot(self, *, idle_for: float = 0.0) -> ChildSnapshot:
        """This child as the placement decisions see it (``idle_for``: seconds it has hosted nothing)."""
        return ChildSnapshot(
            id=self.id, role=self.role, loaded=len(self.loaded), in_flight=len(self.in_flight), idle_for=idle_for
        )

    async def run(
        self,
        launcher: Launcher,
        spawn: Callable[[str], Spawn],
        settings: Callable[[], SupervisorSettings],
        env: Mapping[str, str],
        sink: FrameSink,
        on_ready: Callable[[Child], Awaitable[None]],
    ) -> None:
        """The child's whole life: start, handshake, then ping and route frames until it ends.

        ``launcher`` starts the child runtime (a process, by default); ``spawn`` builds the Spawn frame (always the newest generation); ``settings`` reads the
        running ``[supervisor]`` section at each use, so a reload of the timings applies at once.
        Returns when the process is gone (reaped); never raises for anything the child does.
        """
        try:
            self.process = await launcher.start(self.id, env)
        except OSError as exc:
            log.error(events.LOG_CHILD_START_FAILED, child=self.id, error=str(exc))
            self.start_error = str(exc)
            self.gone.set()
            return
        except BaseException:
            # Cancelled while starting (the pool stops): whoever waits for this child to go
            # (``stop``) must not wait for ever.
            self.start_error = "the pool stopped while it started"
            self.gone.set()
            raise
        process = self.process
        self.send_timeout = settings().ping_timeout
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(process.pump_stderr, self._stderr_line)
                tg.start_soon(self._watch_exit, process)
                if await self._handshake(process, spawn, settings().spawn_timeout):
                    self.ready.set()
                    log.info(events.LOG_CHILD_READY, child=self.id, pid=process.pid, generation=self.generation)
                    await on_ready(self)
                    tg.start_soon(self._ping_loop, process, settings)
                    await self._read_frames(process, sink)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                # A child still alive here broke the protocol, stopped answering or never became
                # Ready; a requested stop already ran its ladder. Either way: reap, no zombie.
                self.exit_code = await process.stop(grace=0)
            self._report_dropped(everything=True)
            log.info(events.LOG_CHILD_EXIT, child=self.id, pid=process.pid, code=self.exit_code)
            self.gone.set()

    async def _handshake(self, process: ChildLink, spawn: Callable[[str], Spawn], limit: float) -> bool:
        frame = spawn(self.id)
        try:
            await process.handshake(frame, limit)
        except (SpawnError, *GONE) as exc:
            log.error(events.LOG_CHILD_SPAWN_FAILED, child=self.id, pid=process.pid, error=str(exc))
            self.start_error = str(exc)
            return False
        self.generation = frame.generation
        return True

    async def _watch_exit(self, process: ChildLink) -> None:
        """The child's exit is its death even while its channel is still open (a process it forked
        inherited the socket): the frames it wrote before it died are read, then the channel ends."""
        await process.exited()
        process.stop_reading()

    async def _ping_loop(self, process: ChildLink, settings: Callable[[], SupervisorSettings]) -> None:
        seq = 0
        while True:
            current = settings()
            self.send_timeout = current.ping_timeout
            await anyio.sleep(current.ping_interval)
            self._report_dropped()  # the lines a flood cost in windows that have ended, even if it stopped
            seq += 1
            self._pong = anyio.Event()
            if not await self.send(Ping(seq=seq)):
                return
            with anyio.move_on_after(current.ping_timeout):
                await self._pong.wait()
                continue
            log.error(events.LOG_CHILD_UNRESPONSIVE, child=self.id, pid=process.pid, timeout=current.ping_timeout)
            await process.stop(grace=0)  # the kill ladder: a hung child gets SIGTERM, then SIGKILL
            return

    async def _read_frames(self, process: ChildLink, sink: FrameSink) -> None:
        while True:
            try:
                frame = await process.receive()
                if frame is None:
                    return
                await self._route(frame, sink)
            except ProtocolError as exc:
                log.error(events.LOG_PROTOCOL_ERROR, child=self.id, pid=process.pid, error=str(exc))
                await process.kill()
                return
            except GONE:
                return

    async def _route(self, frame: Frame, sink: FrameSink) -> None:
        match frame:
            case Pong():
                self._pong.set()
            case SwapAck(generation=generation):
                self.generation = max(self.generation, generation)
                sink.swap_acked(self, generation)
            case SwapsApplied():
                sink.swaps_applied(self, frame)
            case Failed(session=None, error=error):
                log.error(events.LOG_CHILD_FAILED, child=self.id, pid=self.pid, error=error)
            case Ready() | Spawn():
                raise ProtocolError(f"unexpected frame {type(frame).__name__!r} from a running child")
            case _ if getattr(frame, "session", None) is not None:
                await sink.session_frame(self, frame)
            case _:
                raise ProtocolError(f"unexpected frame {type(frame).__name__!r} from child")

    async def send(self, frame: Frame) -> bool:
        """Send a frame; False when the child is gone (its sessions are then handled by the pool)."""
        process = self.process
        if process is None or self.gone.is_set():
            return False
        # A child that stops reading (stopped, or its loop blocked) must not hold up the sender:
        # a frame it does not take within ping_timeout means it is hung, and it is killed.
        with anyio.move_on_after(self.send_timeout) as waited:
            try:
                await process.send(frame)
            except GONE:
                return False
            return True
        if waited.cancelled_caught:
            log.error(
                events.LOG_CHILD_UNRESPONSIVE,
                child=self.id,
                pid=process.pid,
                timeout=self.send_timeout,
                frame=type(frame).__name__,
            )
            process.signal(signal.SIGKILL)  # the channel may hold half a frame: nothing more can be sent
        return False

    async def stop(self, grace: float) -> None:
        """Stop the child with the kill ladder (its running turns get ``grace`` to end) and wait until reaped."""
        self._stopping = grace
        if self.process is not None:
            await self.process.stop(grace)
        await self.gone.wait()

    def signal(self, signum: signal.Signals) -> None:
        """Send the process a signal (tests and the ladder)."""
        if self.process is not None:
            self.process.signal(signum)

    def _stderr_line(self, line: str) -> None:
        """Re-emit the child's structured log lines as our own; anything else as ``child.stderr``.

        Raw lines and the child's ``stdlib.log`` records (a library's, whose number a server it
        talks to may decide) are rate-limited per kind (``STDERR_LINES_PER_WINDOW``); agentd's own
        events never are. Secrets are scrubbed by the log processor (``agentd.redact``), and from a
        raw line before it is cut to length, so no piece of one survives the cut.
        """
        try:
            fields = msgspec.json.decode(line)
        except msgspec.DecodeError:
            fields = None
        key: tuple[str, ...] | None = None
        if not (isinstance(fields, dict) and isinstance(fields.get("event"), str)):
            fields, key = None, (events.LOG_CHILD_STDERR,)
        elif fields["event"] == _STDLIB_EVENT:
            key = (_STDLIB_EVENT, str(fields.get("logger", "")), str(fields.get("message", ""))[:200])
        if key is not None and not self._stderr_limiter.admit(key):
            return
        self._report_dropped()
        if fields is not None:
            level = str(fields.pop("level", "info"))
            fields.pop("timestamp", None)
            emit = getattr(log, level if level in _LEVELS else "info")
            emit(fields.pop("event"), **{"child_" + k if k == "component" else k: v for k, v in fields.items()})
            return
        log.info(events.LOG_CHILD_STDERR, child=self.id, pid=self.pid, line=SECRETS.scrub(line)[:4000])

    def _report_dropped(self, *, everything: bool = False) -> None:
        """Log how many lines of each kind the limit dropped, for every window that has ended."""
        for key, dropped in self._stderr_limiter.due(everything=everything):
            assert isinstance(key, tuple)
            where = dict(zip(("logger", "message"), key[1:], strict=False))
            log.warning(
                events.LOG_DROPPED,
                child=self.id,
                pid=self.pid,
                of=key[0],
                **where,
                dropped=dropped,
                window=self._stderr_limiter.window,
            )
