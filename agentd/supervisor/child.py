"""One child process of the pool, as the supervisor runs it: spawn, handshake, ping, kill ladder,
and the frames it sends, routed by session id.

The control channel is one end of a unix socketpair, inherited by the child as a dedicated fd
(stdout stays free). The child starts with a safe ``sys.path`` (``python -P``: the daemon's working
directory is never on it; ``PYTHONPATH`` and installed packages are) and the environment the pool
gives it.

Liveness is per child, not per session: one ``Ping`` every ``ping_interval``; no ``Pong`` within
``ping_timeout`` starts the kill ladder — ``Shutdown{grace}`` → SIGTERM after the grace → SIGKILL
2 s later → reap. Reaping always happens, so no zombie is left. See rfcs/0006-pool.md.

A child's exit is its death, noticed at once whatever its descendants hold: a process a tool forks
inherits the channel, so its end of stream may never come. And a child is its process group (it
runs in a session of its own): the ladder's signals go to the whole group, and once the child is
reaped whatever it left in its group is killed, so nothing it started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import anyio
import msgspec
from anyio.abc import Process, SocketStream
from anyio.streams.text import TextReceiveStream

from agentd import events
from agentd.config import SupervisorSettings
from agentd.obs import LogLimiter, get_logger
from agentd.protocol import (
    Failed,
    Frame,
    FrameChannel,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    Spawn,
    SwapAck,
    SwapsApplied,
)
from agentd.redact import SECRETS
from agentd.supervisor.placement import ChildRole, ChildSnapshot

__all__ = ["KILL_AFTER_TERM", "Child", "ChildProcess", "FrameSink", "SpawnError"]

KILL_AFTER_TERM = 2.0
#: The longest stderr line passed on whole (more is cut into pieces; a log line shows 4000 of it).
MAX_STDERR_LINE = 64 * 1024
#: Per child and kind: at most this many stderr lines (raw, or a library's log records) per window;
#: the rest are counted and reported as ``log.dropped`` (a flooding MCP server, RFC 0008 §3).
STDERR_LINES_PER_WINDOW = 100
STDERR_WINDOW = 10.0
SHUTDOWN_SEND_TIMEOUT = 1.0
_LEVELS = ("debug", "info", "warning", "error", "critical")
_STDLIB_EVENT = "stdlib.log"  # what agentd.obs names a standard-library log record
_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)

log = get_logger("supervisor")


class SpawnError(Exception):
    """A child that did not become Ready (refused the spawn, died, or timed out)."""


class ChildProcess:
    """A started ``python -m agentd.child`` and its control channel: the OS-level half of a child."""

    def __init__(
        self,
        child_id: str,
        process: Process,
        channel: FrameChannel,
        sock: socket.socket | None = None,
        pidfd: int | None = None,
    ) -> None:
        self.child_id = child_id
        self.process = process
        self.channel = channel
        self._sock = sock  # our end of the channel, to stop reading it once the child has exited
        self._pidfd = pidfd  # to see the child exit (None: asyncio's wait tells)
        self._group_killed = False  # the child was reaped and its process group killed after it

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    @classmethod
    async def start(
        cls, child_id: str, *, env: Mapping[str, str] | None = None, python: str = sys.executable
    ) -> ChildProcess:
        """Start a child with the channel on an inherited fd; ``-P`` keeps the working directory off ``sys.path``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await anyio.open_process(
                [python, "-P", "-m", "agentd.child", "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=[theirs.fileno()],
                env=dict(env) if env is not None else None,
                # Its own session: a Ctrl-C at the terminal (or a signal to our process group) reaches
                # only the supervisor, which then drains and stops children itself. Children still
                # die with the supervisor: parent-death signal and channel EOF.
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        pidfd = _open_pidfd(process)  # before any other await: the pid is surely still the child's
        channel = FrameChannel(await SocketStream.from_socket(ours))
        return cls(child_id, process, channel, ours, pidfd)

    async def handshake(self, spawn: Spawn, timeout: float) -> Ready:  # noqa: ASYNC109 - the spawn_timeout is the API
        """Send Spawn and wait for Ready; SpawnError if refused, dead or late."""
        await self.channel.send(spawn)
        with anyio.move_on_after(timeout):
            try:
                frame = await self.channel.receive()
            except ProtocolError as exc:
                raise SpawnError(f"child {self.child_id}: {exc}") from None
            if isinstance(frame, Ready):
                if frame.protocol_version != spawn.protocol_version:
                    raise SpawnError(
                        f"child {self.child_id} speaks protocol version {frame.protocol_version}, "
                        f"not {spawn.protocol_version}"
                    )
                return frame
            if isinstance(frame, Failed):
                raise SpawnError(f"child {self.child_id} refused the spawn: {frame.error}")
            if frame is None:
                raise SpawnError(f"child {self.child_id} exited before Ready")
            raise SpawnError(f"child {self.child_id} sent {type(frame).__name__} before Ready")
        raise SpawnError(f"child {self.child_id} was not Ready within {timeout:g}s")

    async def pump_stderr(self, line_sink: Callable[[str], None]) -> None:
        """Feed the child's stderr to ``line_sink`` line by line until it closes (keeps the pipe drained).

        A line read in two chunks is joined first: split, a secret in it could not be recognised
        (and scrubbed) in either half. A line longer than ``MAX_STDERR_LINE`` is passed on in pieces.
        """
        assert self.process.stderr is not None
        pending = ""
        async for chunk in TextReceiveStream(self.process.stderr):
            *lines, pending = (pending + chunk).split("\n")
            while len(pending) > MAX_STDERR_LINE:
                lines.append(pending[:MAX_STDERR_LINE])
                pending = pending[MAX_STDERR_LINE:]
            for line in lines:
                if line.strip():
                    line_sink(line.rstrip("\r"))
        if pending.strip():
            line_sink(pending)

    async def send(self, frame: Frame) -> None:
        """Send one frame (serialized with other senders by the channel)."""
        await self.channel.send(frame)

    async def receive(self) -> Frame | None:
        """The next frame, or None at a clean end of stream."""
        return await self.channel.receive()

    def signal(self, signum: signal.Signals) -> None:
        """Send a signal to the child's process group: the child and whatever it started that is still
        in its group (a tool's subprocess). Nothing once the child is reaped and its group killed."""
        if self._group_killed:
            return
        # killpg, not Popen.send_signal: the latter polls first and may reap the child itself, and
        # then asyncio's watcher reports a made-up exit status 255. The child leads its own group
        # (start_new_session), so the group id is its pid, and that id is not given to another
        # process while anyone in the group is alive.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    async def exited(self) -> None:
        """Return once the child process has exited, whatever still holds its channel or stderr.

        A pidfd becomes readable when the process exits. Without pidfds (Linux before 5.3) this is
        asyncio's wait, which on some versions also waits for the child's pipes to close.
        """
        if self._pidfd is None:
            await self.process.wait()
            return
        fd = os.dup(self._pidfd)  # one fd per waiter: anyio lets one task at a time wait on an fd
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)

    def stop_reading(self) -> None:
        """Read what the channel holds, then end of stream, even though another process (a fork of
        the child) keeps the other end open: the child has exited and can write no more."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RD)

    async def stop(self, grace: float) -> int:
        """The kill ladder: Shutdown{grace} → SIGTERM → SIGKILL → reap. Returns the exit code."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                # Bounded: a hung child that does not read its channel must still reach SIGTERM/SIGKILL.
                with contextlib.suppress(*_GONE), anyio.move_on_after(SHUTDOWN_SEND_TIMEOUT):
                    await self.channel.send(Shutdown(grace=grace))
                with anyio.move_on_after(grace + 0.5):
                    return await self._reap()
                self.signal(signal.SIGTERM)
                with anyio.move_on_after(KILL_AFTER_TERM):
                    return await self._reap()
                self.signal(signal.SIGKILL)
            code = await self._reap()
        return code

    async def kill(self) -> int:
        """SIGKILL and reap (for a child that broke the protocol or stopped answering)."""
        with anyio.CancelScope(shield=True):
            self.signal(signal.SIGKILL)
            code = await self._reap()
        return code

    async def _reap(self) -> int:
        await self.exited()
        # Whatever the child left in its group dies with it: a process a tool forked may hold the
        # channel and stderr open (and on Python 3.11 asyncio's wait() waits for stderr to close).
        if not self._group_killed:
            self._group_killed = True
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty: the child left nothing behind
            else:
                log.warning(events.LOG_CHILD_LEFTOVERS_KILLED, child=self.child_id, pid=self.process.pid)
        code = await self.process.wait()
        await self.channel.aclose()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code


def _open_pidfd(process: Process) -> int | None:
    """A pidfd of the just-started child; None without pidfds, or if it is already gone."""
    if not hasattr(os, "pidfd_open") or process.returncode is not None:
        return None
    try:
        return os.pidfd_open(process.pid)
    except OSError:
        return None


class FrameSink(Protocol):
    """Where a child's session frames go (the supervisor's turn runner)."""

    async def session_frame(self, child: Child, frame: Frame) -> None:
        """A frame about one session (Event, TurnDone, TurnDiscarded, SwapApplied, Failed with a session)."""

    def swap_acked(self, child: Child, generation: int) -> None:
        """The child acknowledged the SwapIntel of ``generation``."""

    def swaps_applied(self, child: Child, frame: SwapsApplied) -> None:
        """The child's idle sessions swapped at once (one frame for all of them)."""


class Child:
    """One pooled child: its process, its role in the pool, and the sessions it hosts.

    ``loaded`` are the sessions opened here; ``in_flight`` those with a turn running here. Both are
    kept by the pool and the turn runner; this class only routes frames and keeps the child alive.
    """

    def __init__(self, child_id: str, role: ChildRole = ChildRole.STARTING) -> None:
        self.id = child_id
        self.role = role
        self.process: ChildProcess | None = None
        self.generation = 0  # the newest generation this child runs or has acknowledged
        self.restarts = 0  # how many crashed children this one's place in the pool has seen
        self.loaded: set[str] = set()
        self.in_flight: set[str] = set()
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
        spawn: Callable[[str], Spawn],
        settings: Callable[[], SupervisorSettings],
        env: Mapping[str, str],
        sink: FrameSink,
        on_ready: Callable[[Child], Awaitable[None]],
    ) -> None:
        """The child's whole life: start, handshake, then ping and route frames until it ends.

        ``spawn`` builds the Spawn frame (always the newest generation); ``settings`` reads the
        running ``[supervisor]`` section at each use, so a reload of the timings applies at once.
        Returns when the process is gone (reaped); never raises for anything the child does.
        """
        try:
            self.process = await ChildProcess.start(self.id, env=env)
        except OSError as exc:
            log.error(events.LOG_CHILD_START_FAILED, child=self.id, error=str(exc))
            self.start_error = str(exc)
            self.gone.set()
            return
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

    async def _handshake(self, process: ChildProcess, spawn: Callable[[str], Spawn], limit: float) -> bool:
        frame = spawn(self.id)
        try:
            await process.handshake(frame, limit)
        except (SpawnError, *_GONE) as exc:
            log.error(events.LOG_CHILD_SPAWN_FAILED, child=self.id, pid=process.pid, error=str(exc))
            self.start_error = str(exc)
            return False
        self.generation = frame.generation
        return True

    async def _watch_exit(self, process: ChildProcess) -> None:
        """The child's exit is its death even while its channel is still open (a process it forked
        inherited the socket): the frames it wrote before it died are read, then the channel ends."""
        await process.exited()
        process.stop_reading()

    async def _ping_loop(self, process: ChildProcess, settings: Callable[[], SupervisorSettings]) -> None:
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

    async def _read_frames(self, process: ChildProcess, sink: FrameSink) -> None:
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
            except _GONE:
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
            except _GONE:
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
