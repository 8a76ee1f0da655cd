"""Regression tests for races found in review: each drives the real code into the awkward moment
deterministically (a hook at the exact await), never by timing.

The turn-loop cases run ``run_turn`` in-process with the scripted model and a recording ``send``;
the supervisor cases run an in-process Supervisor with its real store and real child processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentd.budget import TurnStatus
from agentd.child.session import ChildSession
from agentd.child.turn import run_turn
from agentd.config import SwapPolicy, intelligence_map, parse_config, resolve_swap_policy
from agentd.messages import AssistantMessage, SystemMessage, ToolResult, UserMessage
from agentd.obs import configure_logging
from agentd.protocol import Event, Frame, SwapIntel, TurnDiscarded
from agentd.store import SqliteStore
from agentd.supervisor.core import Supervisor
from agentd.supervisor.options import DaemonOptions
from agentd.tools import resolve_tools
from agentd.views import PostMessage

pytestmark = pytest.mark.anyio

LOOP = """
[intelligence]
provider = "scripted"
model = "old-model"
options = { steps = 2 }

[[assistants]]
name = "a"
system = "s"
tools = ["clock"]
"""


async def test_a_cancel_during_a_restart_never_commits_the_discarded_attempt() -> None:
    config = parse_config(LOOP)
    new = parse_config(LOOP.replace("old-model", "new-model"))
    frame = SwapIntel(
        generation=2, policy=SwapPolicy.RESTART_TURN, intelligence=intelligence_map(new), limits=new.limits
    )
    session: ChildSession | None = None

    async def send(sent: Frame) -> None:
        assert session is not None
        if isinstance(sent, Event) and sent.name == "step.started" and session.parked is None:
            await session.park(frame)  # a reload lands while step 1's model call runs
        if isinstance(sent, TurnDiscarded):
            assert session.turn_scope is not None
            session.turn_scope.cancel()  # the user's Cancel arrives in the middle of the restart
        await anyio.lowlevel.checkpoint()

    session = ChildSession(
        "s", "a", [], config, intelligence_map(config), config.limits, 1, SwapPolicy.RESTART_TURN, send
    )
    done = await run_turn(session, "t1", UserMessage(content="go", turn="t1"), resolve_tools(["clock"]))
    assert done.record.status is TurnStatus.CANCELLED
    assert done.messages == [], "nothing of the discarded attempt is committed"
    assert done.record.restarts == 1 and [d.model for d in done.record.discarded] == ["old-model"]
    assert done.record.usage == done.record.discarded[0].usage, "the discarded attempt's spend is counted once"
    assert session.current_intelligence.model == "new-model"


TRANSFER = """
[intelligence]
provider = "scripted"
model = "m"

[limits]
deadline = "1s"

[[assistants]]
name = "a"
system = "I am A."

[[assistants.transfers]]
to = "b"

[[assistants]]
name = "b"
system = "I am B."
first_message_mode = "assistant-speaks-first-with-model-generated-message"
intelligence = { options = { hold_file = "HOLD" } }
"""


async def test_a_deadline_during_the_generated_opener_leaves_a_whole_handoff(tmp_path: Path) -> None:
    config = parse_config(TRANSFER.replace("HOLD", str(tmp_path / "never")))

    async def send(_: Frame) -> None:
        await anyio.lowlevel.checkpoint()

    session = ChildSession(
        "s",
        "a",
        [SystemMessage(content="I am A.", name="a")],
        config,
        intelligence_map(config),
        config.limits,
        1,
        SwapPolicy.FINISH_ON_OLD,
        send,
    )
    done = await run_turn(session, "t1", UserMessage(content="please transfer me to b", turn="t1"), resolve_tools([]))
    assert done.record.status is TurnStatus.DEADLINE
    assert done.assistant == "b"
    assert done.transcript is not None
    assert [m.content for m in done.transcript if isinstance(m, SystemMessage)] == ["I am A.", "I am B."]


@pytest.fixture
async def supervisor(tmp_path: Path) -> Any:
    configure_logging("json", "warning")
    store = await SqliteStore.open(tmp_path / "agentd.db")
    config = parse_config(quickstart_config_text(tmp_path))
    sup = Supervisor(DaemonOptions(), config, resolve_swap_policy(None, {}, config.model_swap), store)
    async with anyio.create_task_group() as tg:
        await sup.start(tg)
        try:
            yield sup
        finally:
            await sup.stop()
            tg.cancel_scope.cancel()
    await store.close()


def quickstart_config_text(tmp_path: Path) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "echo-small"
options = {{ hold_file = "{tmp_path / "gate"}" }}

[[assistants]]
name = "a"
system = "s"
first_message_mode = "assistant-waits-for-user"
"""


async def test_a_message_posted_while_the_child_starts_is_delivered_once(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    store = supervisor.store
    real_begin = store.begin_turn

    async def begin_until_the_child_is_ready(*args: Any, **kwargs: Any) -> Any:
        result = await real_begin(*args, **kwargs)
        while not any(c.usable for c in supervisor.pool.children.values()):  # a child becomes Ready mid-write
            await anyio.sleep(0.005)
        return result

    store.begin_turn = begin_until_the_child_is_ready  # type: ignore[method-assign]
    (tmp_path / "gate").touch()
    view = await supervisor.create_session(None)
    result = await supervisor.send_message(view.id, PostMessage(content="hello"))
    assert result.turn.status == "completed", result.turn.error
    stored = await store.load_session(view.id)
    assert stored is not None
    assert [t.status for t in stored.turns] == ["completed"]


async def test_closing_a_session_answers_its_waiting_client(supervisor: Supervisor) -> None:
    view = await supervisor.create_session(None)
    answers: list[str] = []

    async def wait_for_reply() -> None:
        answers.append((await supervisor.send_message(view.id, PostMessage(content="hi"))).turn.status)  # type: ignore[union-attr]

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_reply)
        while (
            (runtime := supervisor.sessions.get(view.id)) is None
            or runtime.pending is None
            or runtime.pending.child is None  # the turn is held in the child
        ):
            await anyio.sleep(0.01)
        await supervisor.close_session(view.id)
    assert answers == ["cancelled"]
    stored = await supervisor.store.load_session(view.id)
    assert stored is not None and stored.state == "closed"


HANDOFF = """
[intelligence]
provider = "scripted"
model = "m"

[[assistants]]
name = "a"
system = "I am A."

[[assistants.transfers]]
to = "b"
mode = "swap-system-message-in-history"

[[assistants]]
name = "b"
system = "I am B."
first_message = "B here."
"""


async def test_a_cancel_in_the_middle_of_a_handoff_commits_a_whole_one() -> None:
    config = parse_config(HANDOFF)
    session: ChildSession | None = None

    async def send(sent: Frame) -> None:
        if isinstance(sent, Event) and sent.name == "transfer":
            assert session is not None and session.turn_scope is not None
            session.turn_scope.cancel()  # the Cancel lands while the handoff is being announced
        await anyio.lowlevel.checkpoint()

    session = ChildSession(
        "s",
        "a",
        [SystemMessage(content="I am A.", name="a")],
        config,
        intelligence_map(config),
        config.limits,
        1,
        SwapPolicy.FINISH_ON_OLD,
        send,
    )
    done = await run_turn(session, "t1", UserMessage(content="please transfer me to b", turn="t1"), resolve_tools([]))
    assert done.record.status is TurnStatus.CANCELLED
    assert done.assistant == "b" and done.transcript is not None
    assert [m.content for m in done.transcript if isinstance(m, SystemMessage)] == ["I am B."]


async def test_a_reused_call_id_still_gets_its_result_when_the_turn_ends_early() -> None:
    from tests.fakes import FakeCall, FakeOpenAI, Reply

    with FakeOpenAI(default=Reply(content="done")) as server:
        # This server says "call_0" for every call, step after step.
        server.script(
            Reply(tool_calls=(FakeCall("clock", {"offset_hours": 1}, id="call_0"),), output_tokens=5),
            Reply(tool_calls=(FakeCall("clock", {"offset_hours": 2}, id="call_0"),), output_tokens=500),
        )
        config = parse_config(f"""
[intelligence]
provider = "openai"
endpoints = ["{server.url}/v1"]
model = "m"

[limits]
max_tokens = 100

[[assistants]]
name = "a"
system = "s"
tools = ["clock"]
""")

        async def send(_: Frame) -> None:
            await anyio.lowlevel.checkpoint()

        session = ChildSession(
            "s",
            "a",
            [SystemMessage(content="s", name="a")],
            config,
            intelligence_map(config),
            config.limits,
            1,
            SwapPolicy.FINISH_ON_OLD,
            send,
        )
        try:
            done = await run_turn(session, "t1", UserMessage(content="time twice", turn="t1"), resolve_tools(["clock"]))
        finally:
            await session.provider.aclose()
    assert done.record.status is TurnStatus.EXHAUSTED_TOKENS
    last = max(i for i, m in enumerate(done.messages) if isinstance(m, AssistantMessage))
    results = [m for m in done.messages[last + 1 :] if isinstance(m, ToolResult)]
    assert [r.call_id for r in results] == ["call_0"] and results[0].is_error


async def test_a_transfer_is_not_announced_when_another_call_of_its_step_ends_the_turn() -> None:
    from agentd.budget import Usage
    from agentd.intel.base import Completion, CompletionRequest
    from agentd.messages import ToolCall

    class LoopingThenTransferring:
        """One answer: a transfer call first, then the same clock call four times (a loop)."""

        intelligence = intelligence_map(parse_config(HANDOFF))["a"]
        failing = False

        async def complete(self, request: CompletionRequest) -> Completion:
            calls = (
                ToolCall(id="t", name="transfer_to_b"),
                *tuple(ToolCall(id=f"c{i}", name="clock", arguments={}) for i in range(4)),
            )
            return Completion(message=AssistantMessage(tool_calls=calls), usage=Usage(1, 1), model="m")

        async def aclose(self) -> None:
            return None

    config = parse_config(
        HANDOFF.replace('name = "a"\nsystem = "I am A."', 'name = "a"\nsystem = "I am A."\ntools = ["clock"]')
    )

    async def send(_: Frame) -> None:
        await anyio.lowlevel.checkpoint()

    session = ChildSession(
        "s", "a", [], config, intelligence_map(config), config.limits, 1, SwapPolicy.FINISH_ON_OLD, send
    )
    session.provider = LoopingThenTransferring()
    done = await run_turn(session, "t1", UserMessage(content="go", turn="t1"), resolve_tools(["clock"]))
    assert done.record.status is TurnStatus.LOOP_DETECTED
    assert done.assistant == "a"
    transfer_result = next(m for m in done.messages if isinstance(m, ToolResult) and m.call_id == "t")
    assert transfer_result.is_error and transfer_result.content.startswith("not run")
