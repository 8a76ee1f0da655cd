"""Turns over in-process children: a real store, the real child runtime, no processes.

``Turns`` accepts turns and its runner drives them on a pool whose launcher runs each child runtime as a task
(``InProcessLauncher``, RFC 0006 §12): delivery, the committed result, and a re-run on another child
after a crash are exercised in well under a second. Outcomes are decided by events (a session's
progress events, a turn's ``done``), never by sleeping.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from agentd import events
from agentd.budget import TurnStatus
from agentd.config import Config, PolicyChoice, SwapPolicy, parse_config
from agentd.messages import AssistantMessage, UserMessage
from agentd.obs import Metrics
from agentd.store.sqlite import SqliteStore
from agentd.supervisor.inprocess import InProcessChild, InProcessLauncher
from agentd.supervisor.membership import LocalMembership
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.pool import Pool
from agentd.supervisor.running import Running
from agentd.supervisor.session import PendingTurn, SessionRuntime, SessionTable
from agentd.supervisor.turns import Turns

pytestmark = pytest.mark.anyio

WAIT = 10.0


def config(hold: Path | None = None, model: str = "m1") -> Config:
    options = f'options = {{ hold_file = "{hold}" }}' if hold else ""
    return parse_config(
        f"""
[intelligence]
provider = "scripted"
model = "{model}"
{options}

[supervisor]
children = 2
spare_children = 0

[[assistants]]
name = "main"
tools = []
"""
    )


@dataclass
class Harness:
    running: Running
    store: SqliteStore
    turns: Turns
    pool: Pool
    launcher: InProcessLauncher
    metrics: Metrics
    sessions: SessionTable

    async def turn(self, session_id: str, text: str, turn_id: str) -> tuple[SessionRuntime, PendingTurn]:
        """Accept a turn as the API does (stored first, then driven)."""
        if session_id not in self.sessions:
            await self.store.create_session(
                session_id, assistant="main", generation=1, model="m1", created_at=time.time()
            )
            self.sessions.add(SessionRuntime(session_id, "main", "idle", 1, "m1"))
        runtime = self.sessions[session_id]
        turn = await self.turns.accept(runtime, UserMessage(content=text, turn=turn_id))
        return runtime, turn


@asynccontextmanager
async def harness(tmp_path: Path, cfg: Config) -> AsyncIterator[Harness]:
    store = await SqliteStore.open(tmp_path / "agentd.db")
    running = Running(DaemonOptions(), cfg, PolicyChoice(SwapPolicy.FINISH_ON_OLD, "default"))
    metrics = Metrics()
    sessions = SessionTable(running)
    turns = Turns(
        store=store,
        running=running,
        metrics=metrics,
        sessions=sessions,
        membership=LocalMembership(store, running, sessions),
        approvals=None,
        on_swap_acked=lambda _child, _generation: None,
        on_turn_finished=lambda: None,
    )
    try:
        async with InProcessLauncher() as launcher:
            pool = Pool(
                settings=lambda: cfg.supervisor,
                spawn=running.spawn_frame,
                env=lambda: {},
                owner=turns.frames,
                launcher=launcher,
            )
            async with anyio.create_task_group() as tg:
                await tg.start(pool.run)
                turns.attach(pool, tg)
                try:
                    yield Harness(running, store, turns, pool, launcher, metrics, sessions)
                finally:
                    turns.stop()
                    with anyio.fail_after(WAIT):
                        await pool.stop(0)
                    tg.cancel_scope.cancel()
    finally:
        await store.close()


async def test_a_turn_is_delivered_to_an_in_process_child_and_committed(tmp_path: Path) -> None:
    async with harness(tmp_path, config()) as h:
        runtime, turn = await h.turn("s1", "hello there", "t1")
        with anyio.fail_after(WAIT):
            await turn.done.wait()
        assert turn.record is not None and turn.record.status is TurnStatus.COMPLETED
        assert turn.runs == 1
        child = runtime.child
        assert child is not None and isinstance(child.process, InProcessChild)
        await anyio.wait_all_tasks_blocked()  # the runner has handed the turn's end to the pool
        assert child.loaded == {"s1"} and child.in_flight == set()  # sticky, and idle again
        replies = [m for m in await h.store.transcript("s1") if isinstance(m, AssistantMessage)]
        assert len(replies) == 1 and "hello there" in str(replies[0].content)


async def test_a_turn_whose_child_crashes_reruns_on_another_and_blames_its_session(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    async with harness(tmp_path, config(hold)) as h:
        runtime, turn = await h.turn("s1", "hello", "t1")
        # Watched, so the child streams the turn's progress: its model call is held in flight.
        with runtime.subscribe() as subscriber:
            with anyio.fail_after(WAIT):
                while (await subscriber.receive())[0] != events.STEP_STARTED:
                    pass
            first = turn.child
            assert first is not None and first.in_flight == {"s1"}
            assert isinstance(first.process, InProcessChild)

            first.process.signal(signal.SIGKILL)  # the child dies mid-turn
            with anyio.fail_after(WAIT):
                while (await subscriber.receive())[0] != events.STEP_STARTED:
                    pass  # the turn's second run reached its model call
            second = turn.child
            assert second is not None and second is not first
            hold.touch()  # let the held model call answer
            with anyio.fail_after(WAIT):
                await turn.done.wait()

        assert turn.record is not None and turn.record.status is TurnStatus.COMPLETED
        assert turn.runs == 2
        await anyio.wait_all_tasks_blocked()
        assert len(runtime.crashes) == 1  # blamed once: its turn was in flight on the crashed child
        assert h.metrics.turn_reruns._value.get() == 1
        assert h.metrics.child_crashes._value.get() == 1
        assert runtime.child is second and second.loaded == {"s1"}
        assert first.loaded == set() and first.in_flight == set()


async def test_a_reload_broadcast_is_acked_by_every_child_and_swaps_an_idle_loaded_session(tmp_path: Path) -> None:
    async with harness(tmp_path, config()) as h:
        runtime, turn = await h.turn("s1", "hello", "t1")
        with anyio.fail_after(WAIT):
            await turn.done.wait()
        assert runtime.pending is None and runtime.child is not None  # idle, and loaded on its child
        h.running.apply(config(model="m2"), h.running.policy)  # generation 2
        with runtime.subscribe() as subscriber:
            fanout = await h.pool.broadcast(lambda _child: h.running.swap_frame())
            assert sorted(c.id for c in fanout.sent) == sorted(h.pool.children)  # every child, loaded or not
            with anyio.fail_after(WAIT):
                await fanout.done.wait()
                name, data = await subscriber.receive()  # the idle session swapped at once (SwapsApplied)
        assert fanout.complete
        assert name == events.SWAP_APPLIED and data["model_to"] == "m2"
        assert (runtime.generation, runtime.model) == (2, "m2")
        assert all(c.generation == 2 for c in h.pool.children.values())
