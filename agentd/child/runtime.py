"""The child's runtime: reads control frames concurrently with the turns it runs.

The control reader is its own task, so a Ping or a SwapIntel is answered while a model call or a
tool call is in flight. Each turn runs in a task of the child's task group; sends are serialized
by the channel. A closed channel means the supervisor is gone: the child exits.

The child's MCP connections (``agentd.mcp.McpHub``) are shared by its sessions; a side-effecting
tool call waits for the supervisor's ``JournalAck`` before it runs (RFC 0008 §5).
"""

from __future__ import annotations

import os
import sys

import anyio

from agentd import events
from agentd.child.deltas import DeltaStream
from agentd.child.session import ChildSession
from agentd.child.spans import turn_done, turn_parked
from agentd.child.toolbox import Toolbox, build_toolbox
from agentd.child.turn import run_turn
from agentd.config import Config, Intelligence, intelligence_map
from agentd.environment import register_secrets
from agentd.mcp import McpHub
from agentd.obs import get_logger
from agentd.otel import setup as setup_tracing
from agentd.otel import tracing
from agentd.protocol import (
    PROTOCOL_VERSION,
    AppliedSwap,
    Cancel,
    Close,
    Failed,
    Frame,
    FrameChannel,
    Input,
    JournalAck,
    JournalFinish,
    JournalStart,
    Open,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    Spawn,
    SwapAck,
    SwapIntel,
    SwapsApplied,
    TurnDone,
    Watch,
)
from agentd.swap import classify_swap
from agentd.tools import AnyTool, ToolError

__all__ = ["EXIT_BAD_SPAWN", "EXIT_PROTOCOL_ERROR", "ChildRuntime", "serve_channel"]

EXIT_BAD_SPAWN = 2
EXIT_PROTOCOL_ERROR = 3
log = get_logger("child")


class ChildRuntime:
    """Hosts sessions for one child process until Shutdown or the channel closes."""

    def __init__(self, channel: FrameChannel, spawn: Spawn) -> None:
        self.channel = channel
        self.child_id = spawn.child_id
        self.config = spawn.config
        self.generation = spawn.generation
        self.policy = spawn.policy
        self.limits = spawn.config.limits
        self.intelligence: dict[str, Intelligence] = intelligence_map(spawn.config)
        # Resolved once: a tool that cannot be imported fails the spawn, not a turn.
        self.toolboxes: dict[str, Toolbox] = {a.name: build_toolbox(a, spawn.config) for a in spawn.config.assistants}
        self.environ = (
            dict(spawn.secrets.values) if spawn.secrets else {}
        )  # the values of the env vars the config names (RFC 0008 §3)
        # Before any tool runs or anything is logged: what this child holds is scrubbed everywhere.
        register_secrets({**os.environ, **self.environ}, spawn.config)
        # Tracing on only when the supervisor handed OTEL_* variables over (RFC 0011 §4).
        setup_tracing(spawn.telemetry.values if spawn.telemetry else {})
        self.hub: McpHub | None = None
        # Journal frames waiting for their ack: (session, turn, seq, finished) → (event, [error]).
        self._journal_waits: dict[tuple[str, str, int, bool], tuple[anyio.Event, list[str | None]]] = {}
        self.sessions: dict[str, ChildSession] = {}
        self.draining = False
        self.exit_code = 0
        self._done = anyio.Event()
        self._idle = anyio.Event()
        self._turn_tasks = 0  # turn tasks not yet ended (their TurnDone sent): what a drain waits for
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self) -> int:
        """Serve until told to stop; return the process exit code."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self.hub = McpHub(tg, self.environ)
            self.hub.configure(self.config.mcp_servers)
            tg.start_soon(self._read_control)
            await self._done.wait()
            self.hub.close()
            tg.cancel_scope.cancel()
        # Export the spans still buffered (bounded by the exporter's own timeout); off, a no-op.
        if tracing().enabled:
            await anyio.to_thread.run_sync(tracing().shutdown)
        return self.exit_code

    def _stop(self, code: int) -> None:
        self.exit_code = code
        self._done.set()

    async def send(self, frame: Frame) -> None:
        """Send a frame; a broken channel means the supervisor is gone, so stop."""
        try:
            await self.channel.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self._stop(0)

    async def _read_control(self) -> None:
        while True:
            try:
                frame = await self.channel.receive()
            except ProtocolError as exc:
                print(f"agentd.child: protocol error from supervisor: {exc}", file=sys.stderr, flush=True)
                self._stop(EXIT_PROTOCOL_ERROR)
                return
            if frame is None:
                log.info(events.LOG_CHILD_PARENT_GONE, child=self.child_id)
                self._stop(0)
                return
            try:
                await self._dispatch(frame)
            except ProtocolError as exc:
                print(f"agentd.child: protocol error from supervisor: {exc}", file=sys.stderr, flush=True)
                self._stop(EXIT_PROTOCOL_ERROR)
                return

    async def _dispatch(self, frame: Frame) -> None:
        match frame:
            case Ping(seq=seq):
                await self.send(Pong(seq=seq))
            case SwapIntel():
                await self._on_swap(frame)
            case Input():
                await self._on_input(frame)
            case Cancel(session=session_id, turn=turn):
                session = self.sessions.get(session_id)
                if session and session.turn_scope and (turn is None or turn == session.turn_id):
                    session.turn_scope.cancel()
            case JournalAck():
                self._on_journal_ack(frame)
            case Watch(session=session_id, watched=watched):
                if (watched_session := self.sessions.get(session_id)) is not None:
                    watched_session.watched = watched
            case Open():
                await self._on_open(frame)
            case Close(session=session_id):
                session = self.sessions.pop(session_id, None)
                if session and session.turn_scope:
                    session.turn_scope.cancel()
            case Shutdown(grace=grace):
                assert self._tg is not None
                self._tg.start_soon(self._drain, grace)
            case _:
                raise ProtocolError(f"unexpected frame {type(frame).__name__!r} from the supervisor")

    async def _on_swap(self, frame: SwapIntel) -> None:
        # Ack first: receipt is acknowledged at once; applying waits for each session's boundary.
        await self.send(SwapAck(generation=frame.generation))
        self.generation, self.policy, self.limits = frame.generation, frame.policy, frame.limits
        before = self.intelligence
        self.intelligence = {**self.intelligence, **frame.intelligence}
        if frame.env is not None:
            os.environ.update(frame.env.values)  # before providers and tools of the generation start
        if frame.config is not None:
            self.environ = dict(frame.secrets.values) if frame.secrets else {}
            register_secrets({**os.environ, **self.environ}, frame.config)  # a reload's new secrets
            self._adopt_config(frame.config)
        # Which assistants swapped is decided once per assistant, not per session.
        swapped = {
            name: (kind, before[name].model, new.model)
            for name, new in self.intelligence.items()
            if name in before and (kind := classify_swap(before[name], new)) is not None
        }
        idle: dict[str, list[str]] = {name: [] for name in swapped}
        parked = 0
        for session in list(self.sessions.values()):
            if session.running:
                parked += await session.park(frame)  # applied at the turn's next boundary
            else:
                # Idle: its boundary is now (RFC 0002 §3). Parking is all the work per session, so a
                # reload costs a child one pass and one frame, whatever it hosts (RFC 0006 §8).
                session.park_idle(frame)
                if session.assistant in idle:
                    idle[session.assistant].append(session.id)
        applied = tuple(
            AppliedSwap(assistant=name, kind=kind, model_from=old, model_to=new, sessions=tuple(idle[name]))
            for name, (kind, old, new) in swapped.items()
            if idle[name]
        )
        if parked:
            log.info(
                events.LOG_SWAP_PARKED_RUNNING,
                child=self.child_id,
                generation=frame.generation,
                sessions=parked,
                policy=frame.policy.value,
            )
        if applied:
            log.info(
                events.LOG_SWAP_APPLIED_IDLE,
                child=self.child_id,
                generation=frame.generation,
                sessions=sum(len(a.sessions) for a in applied),
                policy=frame.policy.value,
            )
            await self.send(SwapsApplied(generation=frame.generation, policy=frame.policy, applied=applied))

    def _adopt_config(self, config: Config) -> None:
        """A new generation's prompts, tools and transfers: sessions opened from now on, and each
        session's next turn, use them. Tools are resolved once per generation, not per turn."""
        self.config = config
        toolboxes = dict(self.toolboxes)
        for assistant in config.assistants:
            try:
                toolboxes[assistant.name] = build_toolbox(assistant, config)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # validated by the supervisor first; never take the child down
                log.error(
                    events.LOG_CHILD_TOOLS_UNRESOLVED, child=self.child_id, assistant=assistant.name, error=str(exc)
                )
        self.toolboxes = toolboxes
        if self.hub is not None:  # servers changed or dropped: their old connections close once unused
            self.hub.configure(config.mcp_servers, self.environ)

    async def _on_open(self, frame: Open) -> None:
        if frame.session in self.sessions:
            await self.send(Failed(session=frame.session, error=f"session {frame.session} is already open here"))
            return
        try:
            session = ChildSession(
                frame.session,
                frame.assistant,
                list(frame.transcript),
                self.config,
                self.intelligence,
                self.limits,
                self.generation,
                self.policy,
                self.send,
            )
        except KeyError:
            await self.send(Failed(session=frame.session, error=f"unknown assistant {frame.assistant!r}"))
            return
        except Exception as exc:  # a provider it cannot build (validation refuses its options first)
            intelligence = self.intelligence[frame.assistant]
            error = f"cannot build the {intelligence.provider} provider for assistant {frame.assistant!r}: {exc}"
            await self.send(Failed(session=frame.session, error=error))
            return
        self.sessions[frame.session] = session
        toolbox = self.toolboxes.get(frame.assistant)
        if toolbox is not None and self.hub is not None:
            self.hub.warm(toolbox.servers)  # connect while the session waits for its first message

    async def _on_input(self, frame: Input) -> None:
        session = self.sessions.get(frame.session)
        if session is not None and session.running and session.turn_id == frame.turn:
            return  # the same turn delivered again (a supervisor retry): it is already running
        reason = None
        if self.draining:
            reason = "the child is shutting down"
        elif session is None:
            reason = f"session {frame.session} is not open in this child"
        elif session.running:
            reason = f"session {frame.session} already runs turn {session.turn_id}"
        if reason is not None or session is None:
            await self.send(Failed(session=frame.session, turn=frame.turn, error=reason or "no session"))
            return
        # Mark busy before the task starts: a second Input is refused, and a Cancel that arrives
        # before the turn's first step still finds a scope to cancel.
        session.turn_id = frame.turn
        session.turn_scope = anyio.CancelScope()
        session.watched = frame.watched
        session.turn_run = frame.run
        assert self._tg is not None
        self._turn_tasks += 1  # counted before it starts: a drain that begins now waits for it
        self._tg.start_soon(self._turn_task, session, frame)

    async def _turn_task(self, session: ChildSession, frame: Input) -> None:
        try:
            toolbox = self.toolboxes[session.assistant]
            assert self.hub is not None
            async with self.hub.hold(toolbox.servers) as connections:

                async def tools() -> dict[str, AnyTool]:
                    return await toolbox.tools(connections)

                with tracing().invoke_agent(
                    assistant=session.assistant,
                    session=session.id,
                    turn=frame.turn,
                    generation=session.generation,
                    run=frame.run,
                    carrier=frame.trace,
                ) as span:
                    if frame.resumed:
                        span.event(events.SPAN_TURN_RESUMED)
                    if frame.run > 0:
                        span.event(events.SPAN_TURN_RERUN, {"agentd.turn.run": frame.run})
                    # The turn's deltas are flushed by a task of their own: a slow channel to the
                    # supervisor never holds the model call up (agentd.child.deltas).
                    assert self._tg is not None
                    deltas = DeltaStream(session, frame.turn, self._tg.start_soon)
                    try:
                        done = await run_turn(
                            session,
                            frame.turn,
                            frame.message,
                            tools,
                            accepted_at=frame.started_at,
                            journal=frame.journal,
                            write=self._journal,
                            run=frame.run,
                            deltas=deltas,
                            resume=frame.resume,
                            decisions=frame.decisions,
                        )
                    finally:
                        deltas.close()
                    if isinstance(done, TurnDone):
                        turn_done(span, done.record)
                    else:  # parked for approvals: the run stops here, the turn goes on later
                        turn_parked(span, len(done.requests))
            await self.send(done)
            await session.apply_parked(turn=None)  # idle now: its boundary is now
        except Exception as exc:  # a loop bug must not take the other sessions down
            session.log.exception(events.LOG_TURN_CRASHED, turn=frame.turn)
            await self.send(Failed(session=session.id, turn=frame.turn, error=f"{type(exc).__name__}: {exc}"))
        finally:
            # Counted to the end of the task, past the send of its TurnDone: a session stops
            # ``running`` before that, and a drain must not stop the child under the send.
            self._turn_tasks -= 1
            if self._turn_tasks == 0:
                self._idle.set()

    async def _journal(self, frame: JournalStart | JournalFinish) -> str | None:
        """Send a journal frame and wait for its ack: None once it is durable, else why not."""
        key = (frame.session, frame.turn, frame.entry.seq, isinstance(frame, JournalFinish))
        waiter: tuple[anyio.Event, list[str | None]] = (anyio.Event(), [None])
        self._journal_waits[key] = waiter
        try:
            await self.send(frame)
            await waiter[0].wait()  # a gone supervisor stops the child, which ends this wait
            return waiter[1][0]
        finally:
            self._journal_waits.pop(key, None)

    def _on_journal_ack(self, ack: JournalAck) -> None:
        waiter = self._journal_waits.get((ack.session, ack.turn, ack.seq, ack.finished))
        if waiter is not None:
            waiter[1][0] = ack.error
            waiter[0].set()

    async def _drain(self, grace: float) -> None:
        """Start nothing new; let running turns end within ``grace``; then exit 0."""
        self.draining = True
        log.info(events.LOG_CHILD_SHUTDOWN, child=self.child_id, grace=grace)
        with anyio.move_on_after(grace):
            while self._turn_tasks:
                self._idle = anyio.Event()
                await self._idle.wait()
        self._stop(0)


async def serve_channel(channel: FrameChannel) -> int:
    """Handshake on ``channel``, then run until Shutdown or EOF; return the exit code.

    The whole child runtime behind one channel: ``agentd.child.__main__.serve`` runs it in a child process, and the
    in-process launcher (``agentd.supervisor.inprocess``) runs it as a task for tests.
    """
    first = await channel.receive()
    if first is None:
        return 0
    if not isinstance(first, Spawn):
        raise ProtocolError(f"expected a spawn frame first, got {type(first).__name__!r}")
    if first.protocol_version != PROTOCOL_VERSION:
        await channel.send(
            Failed(
                error=f"protocol version {first.protocol_version} is not supported; this child speaks {PROTOCOL_VERSION}"
            )
        )
        return EXIT_PROTOCOL_ERROR
    try:
        runtime = ChildRuntime(channel, first)
    except ToolError as exc:
        await channel.send(Failed(error=str(exc)))
        return EXIT_BAD_SPAWN
    await channel.send(Ready(child_id=first.child_id, pid=os.getpid()))
    log.info(events.LOG_CHILD_READY, child=first.child_id, generation=first.generation)
    return await runtime.run()
