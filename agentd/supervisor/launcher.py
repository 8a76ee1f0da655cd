"""How the pool starts a child: the launcher seam, and the default launcher (an OS process).

A ``Child`` (``agentd.supervisor.child``) is the pool's view of one child — role, sessions, ping
loop, frame routing. What it talks to is a ``ChildLink``: the supervisor's end of one started child
runtime, with its control channel, its exit and the kill ladder. A ``Launcher`` makes links. The
pool is given one (``Pool(launcher=...)``):

- ``ProcessLauncher`` (the default) starts ``python -P -m agentd.child`` with the channel on an
  inherited fd (``ChildProcess``): the only launcher the daemon uses.
- ``agentd.supervisor.inprocess.InProcessLauncher`` runs the real child runtime as a task of this
  process over a socketpair, so the pool, the turn runner and the reload fan-out are tested
  without processes (RFC 0006 §12).

Both links run the same kill ladder (``KillLadder``): ``Shutdown{grace}`` → SIGTERM after the
grace → SIGKILL ``KILL_AFTER_TERM`` later → reap.

The control channel is one end of a unix socketpair, inherited by the child as a dedicated fd
(stdout stays free). The child starts with a safe ``sys.path`` (``python -P``: the daemon's working
directory is never on it; ``PYTHONPATH`` and installed packages are) and the environment the pool
gives it. A child's exit is its death, noticed at once whatever its descendants hold: a process a
tool forks inherits the channel, so its end of stream may never come. And a child is its process
group (it runs in a session of its own): the ladder's signals go to the whole group, and once the
child is reaped whatever it left in its group is killed, so nothing it started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.abc import Process, SocketStream
from anyio.streams.text import TextReceiveStream

from agentd import events
from agentd.obs import get_logger
from agentd.protocol import Failed, Frame, FrameChannel, ProtocolError, Ready, Shutdown, Spawn
from agentd.redact import SECRETS

__all__ = [
    "KILL_AFTER_TERM",
    "SHUTDOWN_SEND_TIMEOUT",
    "ChildLink",
    "ChildProcess",
    "KillLadder",
    "Launcher",
    "ProcessLauncher",
    "SpawnError",
    "handshake",
]

KILL_AFTER_TERM = 2.0
#: The ladder's own ``Shutdown`` is bounded: a hung child that does not read must still get the signals.
SHUTDOWN_SEND_TIMEOUT = 1.0
#: The longest stderr line passed on whole (more is cut into pieces; a log line shows 4000 of it).
MAX_STDERR_LINE = 64 * 1024
GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)

log = get_logger("supervisor")


class SpawnError(Exception):
    """A child that did not become Ready (refused the spawn, died, or timed out)."""


class ChildLink(Protocol):
    """The supervisor's end of one started child runtime, whatever runs it (a process, a task)."""

    @property
    def pid(self) -> int | None:
        """The child's process id; None for a child with no process of its own."""

    async def handshake(self, spawn: Spawn, timeout: float) -> Ready:  # noqa: ASYNC109 - the spawn_timeout is the API
        """Send Spawn and wait for Ready; SpawnError if refused, dead or late."""

    async def send(self, frame: Frame) -> None:
        """Send one frame (serialized with other senders); raises one of ``GONE`` once the child is gone."""

    async def receive(self) -> Frame | None:
        """The next frame, or None at a clean end of stream; ProtocolError for a broken one."""

    async def pump_stderr(self, line_sink: Callable[[str], None]) -> None:
        """Feed what the child writes to stderr to ``line_sink`` line by line; return once it closes."""

    async def exited(self) -> None:
        """Return once the child has exited, whatever still holds its channel."""

    def stop_reading(self) -> None:
        """Let ``receive`` read what the channel holds, then end: the child has exited."""

    def signal(self, signum: signal.Signals) -> None:
        """Send the child a signal (SIGSTOP and SIGCONT included); nothing once it is reaped."""

    async def stop(self, grace: float) -> int:
        """The kill ladder: Shutdown{grace} → SIGTERM → SIGKILL → reap. Returns the exit code."""

    async def kill(self) -> int:
        """SIGKILL and reap (a child that broke the protocol or stopped answering)."""


class Launcher(Protocol):
    """Starts children for the pool (``Pool(launcher=...)``)."""

    async def start(self, child_id: str, env: Mapping[str, str]) -> ChildLink:
        """Start one child runtime with ``env`` as its environment; OSError if it cannot be started.

        Returns before the handshake: the caller sends ``Spawn`` (``ChildLink.handshake``).
        """


async def handshake(channel: FrameChannel, child_id: str, spawn: Spawn, timeout: float) -> Ready:  # noqa: ASYNC109
    """Send Spawn on ``channel`` and wait for Ready; SpawnError if refused, dead or late."""
    await channel.send(spawn)
    with anyio.move_on_after(timeout):
        try:
            frame = await channel.receive()
        except ProtocolError as exc:
            raise SpawnError(f"child {child_id}: {exc}") from None
        if isinstance(frame, Ready):
            if frame.protocol_version != spawn.protocol_version:
                raise SpawnError(
                    f"child {child_id} speaks protocol version {frame.protocol_version}, not {spawn.protocol_version}"
                )
            return frame
        if isinstance(frame, Failed):
            raise SpawnError(f"child {child_id} refused the spawn: {frame.error}")
        if frame is None:
            raise SpawnError(f"child {child_id} exited before Ready")
        raise SpawnError(f"child {child_id} sent {type(frame).__name__} before Ready")
    raise SpawnError(f"child {child_id} was not Ready within {timeout:g}s")


class KillLadder:
    """The kill ladder, shared by every kind of link: each provides ``alive``, ``signal`` and ``_reap``."""

    channel: FrameChannel

    @property
    def alive(self) -> bool:
        """Not exited yet."""
        raise NotImplementedError

    def signal(self, signum: signal.Signals) -> None:
        """Send the child a signal."""
        raise NotImplementedError

    async def _reap(self) -> int:
        """Wait for the exit, release what the child held, return its exit code."""
        raise NotImplementedError

    async def stop(self, grace: float) -> int:
        """The kill ladder: Shutdown{grace} → SIGTERM → SIGKILL → reap. Returns the exit code."""
        with anyio.CancelScope(shield=True):
            if self.alive:
                # Bounded: a hung child that does not read its channel must still reach SIGTERM/SIGKILL.
                with contextlib.suppress(*GONE), anyio.move_on_after(SHUTDOWN_SEND_TIMEOUT):
                    await self.channel.send(Shutdown(grace=grace))
                # 0.5 s past the grace, then SIGTERM. A literal: tests/test_deploy.py reads it here
                # to check the shutdown arithmetic of the deployment files.
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


class ChildProcess(KillLadder):
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

    @property
    def alive(self) -> bool:
        """Not reaped yet."""
        return self.process.returncode is None

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
        return await handshake(self.channel, self.child_id, spawn, timeout)

    async def pump_stderr(self, line_sink: Callable[[str], None]) -> None:
        """Feed the child's stderr to ``line_sink`` line by line until it closes (keeps the pipe drained).

        A line read in two chunks is joined first: split, a secret in it could not be recognised
        (and scrubbed) in either half. A line longer than ``MAX_STDERR_LINE`` is passed on in pieces,
        scrubbed before it is cut (``agentd.redact.SECRETS``).
        """
        assert self.process.stderr is not None
        pending = ""
        async for chunk in TextReceiveStream(self.process.stderr):
            *lines, pending = (pending + chunk).split("\n")
            # Cut only once every secret across the cut can have arrived whole, and scrubbed first:
            # a secret cut in two would be recognised in neither piece.
            while len(pending) > MAX_STDERR_LINE + SECRETS.longest:
                pending = SECRETS.scrub(pending)
                if len(pending) <= MAX_STDERR_LINE + SECRETS.longest:
                    break
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


class ProcessLauncher:
    """The default launcher: every child is ``python -P -m agentd.child`` in a process group of its own."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    async def start(self, child_id: str, env: Mapping[str, str]) -> ChildProcess:
        """Start one child process with exactly ``env`` (the pool's allowlist) as its environment."""
        return await ChildProcess.start(child_id, env=env, python=self.python)


if TYPE_CHECKING:  # mypy holds the default launcher to the seam's protocols
    _link: type[ChildLink] = ChildProcess
    _launcher: type[Launcher] = ProcessLauncher
