"""The pool with in-process children: the real child runtime as tasks over socketpairs, no processes.

The pool starts its children through the launcher it is given (RFC 0006 §12); here that is
``InProcessLauncher``, so every frame — Spawn/Ready, Ping/Pong, SwapIntel/SwapAck, Close — is real
and crosses a real socket, but a test takes milliseconds. Outcomes are decided by events (the
owner's notifications, a fan-out's ``done``), never by sleeping.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import msgspec
import pytest
from structlog.testing import capture_logs

from agentd import events
from agentd.config import SupervisorSettings, SwapPolicy, intelligence_map, parse_config
from agentd.protocol import Frame, Ready, Spawn, SwapIntel, SwapsApplied
from agentd.supervisor.child import Child
from agentd.supervisor.inprocess import EXIT_RUNTIME_CRASHED, InProcessChild, InProcessLauncher
from agentd.supervisor.launcher import Launcher
from agentd.supervisor.placement import ChildRole
from agentd.supervisor.pool import Fanout, Pool

pytestmark = pytest.mark.anyio

WAIT = 5.0  # the most any awaited fact may take; each test takes milliseconds when it holds

CONFIG = parse_config(
    """
[intelligence]
provider = "scripted"
model = "m1"

[[assistants]]
name = "main"
tools = []
"""
)


@dataclass
class Lost:
    child: str
    loaded: set[str]
    in_flight: set[str]
    crashed: bool


@dataclass
class Owner:
    """The pool's owner (``ChildFrames`` in the daemon), recording what the pool tells it."""

    ready: list[str] = field(default_factory=list)
    lost: list[Lost] = field(default_factory=list)
    acks: list[tuple[str, int]] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    idle: dict[str, float] = field(default_factory=dict)  # sessions with no turn in flight, since when
    _changed: anyio.Event = field(default_factory=anyio.Event)

    def _note(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, fact: Callable[[], bool]) -> None:
        """Wait until ``fact()`` holds, re-checked at each notification (not by polling a clock)."""
        with anyio.fail_after(WAIT):
            while not fact():
                await self._changed.wait()

    async def child_ready(self, child: Child) -> None:
        self.ready.append(child.id)
        self._note()

    async def child_lost(self, child: Child, loaded: set[str], in_flight: set[str], *, crashed: bool) -> None:
        self.lost.append(Lost(child.id, loaded, in_flight, crashed))
        self._note()

    def idle_since(self, session_id: str) -> float | None:
        return self.idle.get(session_id)

    def session_unloaded(self, session_id: str) -> None:
        self.unloaded.append(session_id)
        self._note()

    async def session_frame(self, child: Child, frame: Frame) -> None:
        self._note()

    def swap_acked(self, child: Child, generation: int) -> None:
        self.acks.append((child.id, generation))
        self._note()

    def swaps_applied(self, child: Child, frame: SwapsApplied) -> None:
        self._note()


def spawn_frame(child_id: str) -> Spawn:
    return Spawn(child_id=child_id, generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=CONFIG)


def swap(generation: int) -> SwapIntel:
    return SwapIntel(
        generation=generation,
        policy=SwapPolicy.FINISH_ON_OLD,
        intelligence=intelligence_map(CONFIG),
        limits=CONFIG.limits,
        config=CONFIG,
    )


@dataclass
class Running:
    pool: Pool
    owner: Owner
    launcher: InProcessLauncher

    def link(self, child: Child) -> InProcessChild:
        assert isinstance(child.process, InProcessChild)
        return child.process

    async def ready(self, count: int) -> list[Child]:
        """Wait until ``count`` children are Ready; they are returned oldest first."""
        await self.owner.until(lambda: sum(c.usable for c in self.pool.children.values()) >= count)
        return sorted((c for c in self.pool.children.values() if c.usable), key=lambda c: int(c.id[1:]))


@asynccontextmanager
async def running_pool(**settings: float) -> AsyncIterator[Running]:
    sup = SupervisorSettings(**settings)  # type: ignore[arg-type]
    owner = Owner()
    async with InProcessLauncher() as launcher:
        seam: Launcher = launcher  # the launcher protocol is all the pool needs
        pool = Pool(settings=lambda: sup, spawn=spawn_frame, env=lambda: {"PATH": "/bin"}, owner=owner, launcher=seam)
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            try:
                yield Running(pool, owner, launcher)
            finally:
                with anyio.fail_after(WAIT):
                    await pool.stop(0)
                tg.cancel_scope.cancel()


async def test_children_are_started_through_the_launcher_and_handshake_for_real() -> None:
    async with running_pool(children=0, spare_children=2) as run:
        children = await run.ready(2)
        assert [c.role for c in children] == [ChildRole.SPARE, ChildRole.SPARE]
        assert [link.child_id for link in run.launcher.started] == ["c1", "c2"]
        assert all(run.link(c).env == {"PATH": "/bin"} for c in children)  # the pool's allowlist, handed over
        assert all(c.generation == 1 for c in children)  # the Spawn's generation, Ready came back
        assert run.owner.ready == ["c1", "c2"]


async def test_loaded_sets_are_the_pools_and_read_only_for_everyone_else() -> None:
    async with running_pool(children=1, spare_children=0) as run:
        child = await run.pool.acquire("s1")
        assert child is not None
        assert child.loaded == {"s1"}
        run.pool.turn_started("s1", child)
        assert child.in_flight == {"s1"}
        run.pool.turn_ended("s1", child)
        assert child.in_flight == set()
        # A reservation given back: no longer there, and the next acquire places it again.
        run.pool.release("s1", child)
        assert run.pool.where("s1") is None
        assert child.loaded == set()
        again = await run.pool.acquire("s1")
        assert again is child
        await run.pool.unload("s1")
        assert child.loaded == set()


async def test_placement_under_load_across_in_process_children() -> None:
    """One session per child: busy children are spread over, a spare is promoted, the pool grows to
    its cap, and then a session waits until the longest-idle one is evicted."""
    async with running_pool(children=2, spare_children=1, max_children=3, sessions_per_child=1) as run:
        c1, c2, spare = await run.ready(3)
        assert spare.role is ChildRole.SPARE
        placed: dict[str, Child] = {}
        for session in ("s1", "s2", "s3"):
            child = await run.pool.acquire(session)
            assert child is not None
            run.pool.turn_started(session, child)  # busy: its turn runs there
            placed[session] = child
        assert [placed[s].id for s in ("s1", "s2", "s3")] == [c1.id, c2.id, spare.id]
        assert spare.role is ChildRole.ACTIVE  # promoted: every active child was full

        # Every child is full and the pool is at max_children: s4 waits for room...
        got: list[Child] = []

        async def place_s4() -> None:
            child = await run.pool.acquire("s4")
            assert child is not None
            got.append(child)

        async with anyio.create_task_group() as tg:
            tg.start_soon(place_s4)
            await anyio.wait_all_tasks_blocked()
            assert not got and run.owner.unloaded == []  # every loaded session runs a turn: nothing to evict
            # ...until s2's turn ends: s2 is the one idle session, it is unloaded (Close) and s4 takes its place.
            run.owner.idle["s2"] = time.monotonic()
            run.pool.turn_ended("s2", c2)
        assert got == [c2]
        assert run.owner.unloaded == ["s2"]
        assert c2.loaded == {"s4"}
        assert len(run.launcher.started) == 3  # no child beyond max_children


@pytest.mark.parametrize(
    ("how", "code"),
    [
        pytest.param(lambda link: link.signal(signal.SIGKILL), -signal.SIGKILL, id="task-killed"),
        pytest.param(lambda link: link.sever(), 0, id="socket-closed"),
    ],
)
async def test_a_child_that_crashes_is_reported_with_its_sessions_and_replaced(
    how: Callable[[InProcessChild], None], code: int
) -> None:
    async with running_pool(children=1, spare_children=0) as run:
        (child,) = await run.ready(1)
        for session in ("s1", "s2"):
            assert await run.pool.acquire(session) is child
        run.pool.turn_started("s1", child)

        how(run.link(child))

        await run.owner.until(lambda: bool(run.owner.lost))
        assert run.owner.lost == [Lost(child.id, {"s1", "s2"}, {"s1"}, crashed=True)]
        assert child.exit_code == code
        assert child.loaded == set() and child.in_flight == set()
        assert run.pool.where("s1") is None
        # A replacement takes its place and carries the crash count.
        (replacement,) = await run.ready(1)
        assert replacement.id == "c2" and replacement.restarts == 1


async def test_a_runtime_that_dies_of_a_protocol_error_is_a_crash() -> None:
    async with running_pool(children=1, spare_children=0) as run:
        (child,) = await run.ready(1)
        assert await run.pool.acquire("s1") is child
        # A frame no supervisor sends: the real runtime stops with its protocol-error exit code.
        assert await child.send(Ready(child_id=child.id, pid=0))
        await run.owner.until(lambda: bool(run.owner.lost))
        assert run.owner.lost == [Lost(child.id, {"s1"}, set(), crashed=True)]
        assert child.exit_code == 3
        assert child.exit_code != EXIT_RUNTIME_CRASHED


async def test_a_child_that_stops_answering_pings_is_killed_with_the_ladder_and_replaced() -> None:
    async with running_pool(children=1, spare_children=0, ping_interval=0.02, ping_timeout=0.1) as run:
        (child,) = await run.ready(1)
        assert await run.pool.acquire("s1") is child
        run.pool.turn_started("s1", child)
        link = run.link(child)
        with capture_logs() as logs:
            link.signal(signal.SIGSTOP)  # its loop no longer reads: the next Ping goes unanswered
            await run.owner.until(lambda: bool(run.owner.lost))
        assert run.owner.lost == [Lost(child.id, {"s1"}, {"s1"}, crashed=True)]
        unresponsive = [e for e in logs if e["event"] == events.LOG_CHILD_UNRESPONSIVE]
        assert [e["child"] for e in unresponsive] == [child.id]
        assert link.signals == [signal.SIGSTOP, signal.SIGTERM]  # the kill ladder, not an exit of its own
        assert child.exit_code == -signal.SIGTERM
        (replacement,) = await run.ready(1)
        assert replacement.restarts == 1


async def test_broadcast_sends_to_every_child_and_collects_their_acks() -> None:
    async with running_pool(children=3, spare_children=0) as run:
        children = await run.ready(3)
        fanout = await run.pool.broadcast(lambda _child: swap(2))
        assert sorted(c.id for c in fanout.sent) == [c.id for c in children]
        with anyio.fail_after(WAIT):
            await fanout.done.wait()
        assert fanout.complete
        assert sorted(fanout.acked) == [c.id for c in children]
        assert fanout.seconds is not None
        assert all(c.generation == 2 for c in children)
        # The owner still hears every ack (the supervisor's per-generation bookkeeping).
        assert sorted(run.owner.acks) == [(c.id, 2) for c in children]


async def test_broadcast_waits_for_a_stopped_child_until_it_acks_or_is_gone() -> None:
    async with running_pool(children=3, spare_children=0) as run:
        c1, c2, c3 = await run.ready(3)
        run.link(c2).signal(signal.SIGSTOP)
        run.link(c3).signal(signal.SIGSTOP)
        fanout = await run.pool.broadcast(lambda _child: swap(2))
        assert len(fanout.sent) == 3  # a stopped child's socket still takes the frame
        await run.owner.until(lambda: (c1.id, 2) in run.owner.acks)
        assert set(fanout.waiting) == {c2.id, c3.id} and not fanout.done.is_set()

        run.link(c2).signal(signal.SIGCONT)  # thawed: it reads the frame and acks
        await run.owner.until(lambda: (c2.id, 2) in run.owner.acks)
        assert set(fanout.waiting) == {c3.id}

        run.link(c3).signal(signal.SIGKILL)  # gone: it will never ack, and the fan-out is done without it
        with anyio.fail_after(WAIT):
            await fanout.done.wait()
        assert fanout.missed == {c3.id}
        assert not fanout.complete
        assert sorted(fanout.acked) == [c1.id, c2.id]


async def test_broadcast_counts_a_child_that_does_not_take_its_frame_as_unsent() -> None:
    """A child that stops reading with its socket full is killed by the bounded send: the frame is
    unsent, the child never acks, and the others' acks still complete the fan-out."""
    big = msgspec.structs.replace(
        CONFIG, assistants=(msgspec.structs.replace(CONFIG.assistants[0], system="x" * 4_000_000),)
    )
    async with running_pool(children=2, spare_children=0, ping_interval=3600, ping_timeout=0.2) as run:
        c1, c2 = await run.ready(2)
        run.link(c2).signal(signal.SIGSTOP)

        def frame(child: Child) -> SwapIntel:  # more than a socket buffer holds, for the stopped child
            return msgspec.structs.replace(swap(2), config=big) if child is c2 else swap(2)

        fanout = await run.pool.broadcast(frame)
        assert [c.id for c in fanout.sent] == [c1.id]
        assert [c.id for c in fanout.unsent] == [c2.id]
        with anyio.fail_after(WAIT):
            await fanout.done.wait()
        assert fanout.acked.keys() == {c1.id} and fanout.missed == {c2.id}
        await run.owner.until(lambda: bool(run.owner.lost))
        assert run.owner.lost[0].child == c2.id and run.owner.lost[0].crashed


async def test_broadcast_with_no_children_is_done_at_once() -> None:
    async with running_pool(children=0, spare_children=0) as run:
        fanout = await run.pool.broadcast(lambda _child: swap(2))
        assert fanout.done.is_set() and fanout.complete and fanout.sent == []


def test_fanout_takes_a_later_generations_ack_and_ignores_an_earlier_one() -> None:
    fanout = Fanout({"c1": 3, "c2": 3, "c3": 3})
    fanout.ack("c1", 2)  # an older reload's ack says nothing about this frame
    fanout.ack("c2", 4)  # a newer one does: frames reach a child in order
    fanout.ack("c9", 3)  # not one of its children
    assert set(fanout.waiting) == {"c1", "c3"}
    fanout.ack("c1", 3)
    fanout.forget("c3")
    assert fanout.done.is_set()
    assert set(fanout.acked) == {"c1", "c2"} and fanout.missed == {"c3"}
    assert not fanout.complete
