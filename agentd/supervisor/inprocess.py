"""Children without processes: the real child runtime as a task of this process, for tests.

``InProcessLauncher`` is the second launcher behind the pool's seam (``agentd.supervisor.launcher``).
Each child it starts is a socketpair: the supervisor's ``Child`` reads and writes one end through an
``InProcessChild`` link, and a task runs the child runtime itself (``agentd.child.runtime.
serve_channel``: the handshake, ``ChildRuntime``, real frames) against the other end. So the pool,
the turn runner and the reload fan-out are tested in milliseconds, with every frame real.

What a process would do is mapped onto the task, so tests written against ``Child.signal`` mean the
same thing with either launcher:

- SIGSTOP freezes the runtime — it neither reads nor writes its channel, like a stopped process:
  pings go unanswered, the socket fills up and then blocks the sender — and SIGCONT thaws it.
- Any other signal (SIGTERM, SIGKILL, …) ends the task at once: the runtime is cancelled, its end
  of the socket closes and it "exits" with ``-signum``. A stopped runtime ends too (a stopped
  process would wait for SIGKILL; the task need not make a test wait for that step of the ladder).
- A runtime that raises exits 1 (``child.runtime_crashed``); a protocol error from the supervisor
  exits 3, as ``python -m agentd.child`` does.
- ``sever()`` closes the runtime's end of the channel under it: the supervisor sees end of stream,
  the runtime sees its parent gone.

Not modelled: the environment (the runtime shares this process's ``os.environ``; the allowlist the
pool computed is kept as ``InProcessChild.env`` for a test to read), ``python -P``, the process group
and the pidfd (there is no process: ``pid`` is None), and stderr (the runtime logs straight into this
process's log).
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.abc import ByteStream, SocketStream

from agentd import events
from agentd.child.runtime import EXIT_PROTOCOL_ERROR, serve_channel
from agentd.obs import get_logger
from agentd.protocol import Frame, FrameChannel, ProtocolError, Ready, Spawn
from agentd.supervisor.launcher import KillLadder, Launcher, handshake

__all__ = ["EXIT_RUNTIME_CRASHED", "InProcessChild", "InProcessLauncher"]

#: The exit code of an in-process runtime that raised (a process would die of the traceback with 1).
EXIT_RUNTIME_CRASHED = 1

log = get_logger("supervisor")


class _StoppableStream(ByteStream):
    """The runtime's end of the socketpair, read and written only while the child is not stopped.

    Plain non-blocking socket calls, no buffering of its own: while the child is stopped nothing is
    read, so the socket fills up and a sender blocks, as with a stopped process (an asyncio stream
    would keep reading into memory on its own).
    """

    def __init__(self, sock: socket.socket, link: InProcessChild) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._link = link

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            await self._link.running()
            try:
                data = self._sock.recv(max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            return data

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            await self._link.running()
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self._sock)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            view = view[sent:]

    async def send_eof(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if self._sock.fileno() != -1:
            anyio.notify_closing(self._sock)
            self._sock.close()


class InProcessChild(KillLadder):
    """The supervisor's end of a child runtime running as a task of this process (a ``ChildLink``)."""

    def __init__(
        self, child_id: str, channel: FrameChannel, ours: socket.socket, theirs: socket.socket, env: Mapping[str, str]
    ) -> None:
        self.child_id = child_id
        self.channel = channel  # the supervisor's end
        self.env = dict(env)  # what a process would have been started with (not applied)
        self.returncode: int | None = None
        self.signals: list[signal.Signals] = []  # every signal sent to it, in order
        self._ours = ours
        self._theirs = theirs  # the runtime's end, to sever it
        self._exited = anyio.Event()
        self._scope = anyio.CancelScope()  # the runtime's task: cancelled by a fatal signal
        self._killed_by: signal.Signals | None = None
        self._thawed: anyio.Event | None = None  # while stopped: set by SIGCONT

    @property
    def pid(self) -> None:
        """None: the child has no process of its own."""
        return None

    @property
    def alive(self) -> bool:
        """The runtime's task has not ended."""
        return self.returncode is None

    @property
    def stopped(self) -> bool:
        """Frozen by SIGSTOP (and not thawed by SIGCONT)."""
        return self._thawed is not None

    async def running(self) -> None:
        """Return at once, or — while the child is stopped — once it is thawed."""
        while self._thawed is not None:
            await self._thawed.wait()

    async def serve(self) -> None:
        """The runtime's task: the child runtime against its end of the channel, until it ends."""
        code = 0
        stream = _StoppableStream(self._theirs, self)
        try:
            with self._scope:
                try:
                    code = await serve_channel(FrameChannel(stream))
                except ProtocolError:
                    code = EXIT_PROTOCOL_ERROR
                except Exception:
                    log.exception(events.LOG_CHILD_RUNTIME_CRASHED, child=self.child_id)
                    code = EXIT_RUNTIME_CRASHED
            if self._killed_by is not None:
                code = -int(self._killed_by)
        finally:
            # Its end closes with it, as a process's fds do when it exits: the supervisor sees EOF.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            self.returncode = code if self.returncode is None else self.returncode
            self._exited.set()

    async def handshake(self, spawn: Spawn, timeout: float) -> Ready:  # noqa: ASYNC109 - the spawn_timeout is the API
        """Send Spawn and wait for Ready; SpawnError if refused, dead or late."""
        return await handshake(self.channel, self.child_id, spawn, timeout)

    async def send(self, frame: Frame) -> None:
        """Send one frame to the runtime."""
        await self.channel.send(frame)

    async def receive(self) -> Frame | None:
        """The next frame from the runtime, or None at end of stream."""
        return await self.channel.receive()

    async def pump_stderr(self, line_sink: Callable[[str], None]) -> None:
        """Nothing to pump (the runtime logs straight into this process's log): return at its exit."""
        await self.exited()

    async def exited(self) -> None:
        """Return once the runtime's task has ended."""
        await self._exited.wait()

    def stop_reading(self) -> None:
        """Read what the channel holds, then end of stream."""
        with contextlib.suppress(OSError):
            self._ours.shutdown(socket.SHUT_RD)

    def signal(self, signum: signal.Signals) -> None:
        """SIGSTOP freezes the runtime, SIGCONT thaws it, any other signal ends it (module docstring)."""
        if not self.alive:
            return
        self.signals.append(signum)
        if signum == signal.SIGSTOP:
            if self._thawed is None:
                self._thawed = anyio.Event()
        elif signum == signal.SIGCONT:
            if self._thawed is not None:
                self._thawed.set()
                self._thawed = None
        else:
            if self._killed_by is None:
                self._killed_by = signum
            self._scope.cancel()

    def sever(self) -> None:
        """Close the runtime's end of the channel under it: the supervisor sees end of stream."""
        with contextlib.suppress(OSError):
            self._theirs.shutdown(socket.SHUT_RDWR)

    async def _reap(self) -> int:
        await self._exited.wait()
        await self.channel.aclose()
        assert self.returncode is not None
        return self.returncode


class InProcessLauncher:
    """Starts each child as a task running the real child runtime (tests). Use it as an async
    context manager that outlives the pool: leaving it ends every runtime still running."""

    def __init__(self) -> None:
        self.started: list[InProcessChild] = []  # every child started, in order
        self.fail_starts = 0  # the next this many starts fail with OSError (as a failed exec would)
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> InProcessLauncher:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        return await self._tg.__aexit__(kind, exc, tb)

    def link(self, child_id: str) -> InProcessChild:
        """The newest child started as ``child_id``."""
        return next(c for c in reversed(self.started) if c.child_id == child_id)

    async def start(self, child_id: str, env: Mapping[str, str]) -> InProcessChild:
        """Start a child runtime task on one end of a new socketpair; return the other end's link."""
        assert self._tg is not None, "enter the launcher (async with) before the pool starts children"
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise OSError(f"in-process launcher told to fail starting {child_id}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            channel = FrameChannel(await SocketStream.from_socket(ours))
        except BaseException:
            ours.close()
            theirs.close()
            raise
        link = InProcessChild(child_id, channel, ours, theirs, env)
        self.started.append(link)
        self._tg.start_soon(link.serve)
        return link


if TYPE_CHECKING:  # mypy holds both halves to the seam's protocols
    from agentd.supervisor.launcher import ChildLink

    _link: type[ChildLink] = InProcessChild
    _launcher: type[Launcher] = InProcessLauncher
