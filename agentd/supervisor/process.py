"""A child OS process as the supervisor sees it: spawn, handshake, frames, and the kill ladder.

The control channel is one end of a unix socketpair, inherited by the child as a dedicated fd
(stdout stays free). The kill ladder is RFC 0003 §2's: ``Shutdown{grace}`` → SIGTERM after the
grace → SIGKILL 2 s later → reap. Reaping always happens, so no zombie is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping

import anyio
from anyio.abc import Process, SocketStream
from anyio.streams.text import TextReceiveStream

from agentd.protocol import Failed, Frame, FrameChannel, ProtocolError, Ready, Shutdown, Spawn

__all__ = ["KILL_AFTER_TERM", "ChildProcess", "SpawnError"]

KILL_AFTER_TERM = 2.0


class SpawnError(Exception):
    """A child that did not become Ready (refused the spawn, died, or timed out)."""


class ChildProcess:
    """A running child and its control channel."""

    def __init__(self, child_id: str, process: Process, channel: FrameChannel) -> None:
        self.child_id = child_id
        self.process = process
        self.channel = channel

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls, child_id: str, *, env: Mapping[str, str] | None = None, python: str = sys.executable
    ) -> ChildProcess:
        """Start ``python -m agentd.child`` with the channel on an inherited fd."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await anyio.open_process(
                [python, "-m", "agentd.child", "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())],
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
        channel = FrameChannel(await SocketStream.from_socket(ours))
        return cls(child_id, process, channel)

    async def handshake(self, spawn: Spawn, timeout: float) -> Ready:
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
                        f"child {self.child_id} speaks protocol version {frame.protocol_version}, not {spawn.protocol_version}"
                    )
                return frame
            if isinstance(frame, Failed):
                raise SpawnError(f"child {self.child_id} refused the spawn: {frame.error}")
            if frame is None:
                raise SpawnError(f"child {self.child_id} exited before Ready")
            raise SpawnError(f"child {self.child_id} sent {type(frame).__name__} before Ready")
        raise SpawnError(f"child {self.child_id} was not Ready within {timeout:g}s")

    async def pump_stderr(self, line_sink: Callable[[str], None]) -> None:
        """Feed the child's stderr to ``line_sink`` line by line until it closes (keeps the pipe drained)."""
        assert self.process.stderr is not None
        async for line in TextReceiveStream(self.process.stderr):
            for part in line.splitlines():
                if part:
                    line_sink(part)

    async def send(self, frame: Frame) -> None:
        await self.channel.send(frame)

    async def receive(self) -> Frame | None:
        return await self.channel.receive()

    def signal(self, signum: int) -> None:
        """Send a signal unless the process is already reaped."""
        if self.process.returncode is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass

    async def stop(self, grace: float) -> int:
        """The kill ladder: Shutdown{grace} → SIGTERM → SIGKILL → reap. Returns the exit code."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    await self.channel.send(Shutdown(grace=grace))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
                with anyio.move_on_after(grace + 0.5):
                    return await self._reap()
                self.signal(signal.SIGTERM)
                with anyio.move_on_after(KILL_AFTER_TERM):
                    return await self._reap()
                self.signal(signal.SIGKILL)
            return await self._reap()

    async def kill(self) -> int:
        """SIGKILL and reap (for a child that broke the protocol or stopped answering)."""
        with anyio.CancelScope(shield=True):
            self.signal(signal.SIGKILL)
            return await self._reap()

    async def _reap(self) -> int:
        code = await self.process.wait()
        await self.channel.aclose()
        return code
