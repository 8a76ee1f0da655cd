"""Drive a real child process over its real control channel, from a test.

The harness is the supervisor's own ``ChildProcess`` plus a reader that keeps every frame the
child sends, so a test can wait for "the next TurnDone" or "a Pong with seq 7" by events, never
by sleeping.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio

from agentd.config import Config, SwapPolicy, intelligence_map, parse_config
from agentd.messages import UserMessage
from agentd.protocol import Event, Frame, Input, JournalAck, JournalFinish, JournalStart, Open, Spawn, SwapIntel
from agentd.supervisor.child import ChildProcess

F = TypeVar("F")
TIMEOUT = 30.0
REPO = Path(__file__).resolve().parent.parent


class ChildHarness:
    """A started child plus every frame it has sent so far."""

    def __init__(self, child: ChildProcess, config: Config) -> None:
        self.child = child
        self.config = config
        self.frames: list[Frame] = []
        self.stderr: list[str] = []
        self._consumed: set[int] = set()
        self._arrived = anyio.Event()
        self.closed = False
        self.ack_journal = True

    async def read_frames(self) -> None:
        try:
            while (frame := await self.child.receive()) is not None:
                self.frames.append(frame)
                self._arrived.set()
                if isinstance(frame, JournalStart | JournalFinish) and self.ack_journal:
                    # Playing the supervisor: every journal write "is durable" at once.
                    await self.child.send(
                        JournalAck(
                            session=frame.session,
                            turn=frame.turn,
                            seq=frame.entry.seq,
                            finished=isinstance(frame, JournalFinish),
                        )
                    )
        except Exception:
            pass
        finally:
            self.closed = True
            self._arrived.set()

    async def expect(self, kind: type[F], where: Callable[[F], bool] = lambda _: True) -> F:
        """The first frame of ``kind`` matching ``where`` not returned before (waits up to TIMEOUT for it;
        a caller wanting a shorter wait wraps the call in its own ``anyio.fail_after``)."""
        with anyio.fail_after(TIMEOUT):
            while True:
                for index, frame in enumerate(self.frames):
                    if index not in self._consumed and isinstance(frame, kind) and where(frame):
                        self._consumed.add(index)
                        return frame
                if self.closed:
                    raise AssertionError(f"channel closed before a {kind.__name__}; stderr: {self.stderr[-5:]}")
                self._arrived = anyio.Event()
                await self._arrived.wait()

    async def event(self, name: str, where: Callable[[Event], bool] = lambda _: True) -> Event:
        """The next session event called ``name``."""
        return await self.expect(Event, lambda e: e.name == name and where(e))

    def of(self, kind: type[F]) -> list[F]:
        """Every frame of ``kind`` received so far."""
        return [f for f in self.frames if isinstance(f, kind)]

    async def send(self, frame: Frame) -> None:
        await self.child.send(frame)

    async def open(self, session: str = "s1", assistant: str | None = None) -> None:
        await self.send(Open(session=session, assistant=assistant or self.config.assistants[0].name))

    async def say(self, text: str, turn: str, session: str = "s1") -> None:
        await self.send(Input(session=session, turn=turn, message=UserMessage(content=text, turn=turn)))

    def swap(self, config_text: str, generation: int, policy: SwapPolicy) -> SwapIntel:
        """The SwapIntel a reload to ``config_text`` would send."""
        config = parse_config(config_text)
        return SwapIntel(
            generation=generation, policy=policy, intelligence=intelligence_map(config), limits=config.limits
        )


def child_env(tmp: Path, **extra: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["AGENTD_TEST_TOOL_LOG"] = str(tmp / "tools.log")
    env["AGENTD_TEST_GATE"] = str(tmp / "tool.gate")
    env.update(extra)
    return env


@asynccontextmanager
async def running_child(
    config_text: str, tmp: Path, policy: SwapPolicy = SwapPolicy.FINISH_ON_OLD, **env: str
) -> AsyncIterator[ChildHarness]:
    """Start a child, complete the Spawn/Ready handshake, and stop it (kill ladder) afterwards."""
    config = parse_config(config_text)
    child = await ChildProcess.start("test-child", env=child_env(tmp, **env))
    harness = ChildHarness(child, config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(child.pump_stderr, harness.stderr.append)
        try:
            await child.handshake(Spawn(child_id="test-child", generation=1, policy=policy, config=config), TIMEOUT)
            tg.start_soon(harness.read_frames)
            yield harness
        finally:
            # No grace: a test that leaves a turn held must not wait it out (Shutdown{0} still exits 0).
            await child.stop(grace=0)
            tg.cancel_scope.cancel()


def tool_log(tmp: Path) -> list[str]:
    path = tmp / "tools.log"
    return path.read_text().splitlines() if path.exists() else []
