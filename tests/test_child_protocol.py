"""The child process at the protocol level: real processes, real fd, real frames (RFC 0002, RFC 0007 §4, RFC 0001 §7).

"Mid-turn" is made deterministic with the scripted model's ``hold_file`` option and the
``tests.tooling.held`` tool: the test holds a model call (or a tool call) in flight until it has
seen the frames it needs, then creates the file. Nothing here waits on a sleep.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentd.budget import TurnStatus
from agentd.config import SwapPolicy, parse_config, quickstart_config
from agentd.messages import AssistantMessage, SystemMessage, ToolResult, UserMessage
from agentd.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Event,
    Failed,
    Input,
    Open,
    Ping,
    Pong,
    Spawn,
    SwapAck,
    SwapApplied,
    SwapKind,
    SwapsApplied,
    TurnDiscarded,
    TurnDone,
    Watch,
)
from agentd.supervisor.child import ChildProcess, SpawnError
from tests.child_harness import REPO, child_env, running_child, tool_log

pytestmark = pytest.mark.anyio

RESTART = SwapPolicy.RESTART_TURN
FINISH = SwapPolicy.FINISH_ON_OLD


def cfg(
    model: str = "old-model",
    *,
    options: str = "",
    tools: str = '["tests.tooling:record"]',
    limits: str = "",
    more: str = "",
) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "{model}"
options = {{ {options} }}

[limits]
{limits}

[[assistants]]
name = "main"
tools = {tools}
{more}
"""


def hold(path: Path) -> str:
    return f'hold_file = "{path}"'


def assistant_models(done: TurnDone) -> list[str | None]:
    return [m.model for m in done.messages if isinstance(m, AssistantMessage)]


# --------------------------------------------------------------------------- handshake and liveness


async def test_ready_after_spawn_and_ping_answered_during_model_call(tmp_path: Path) -> None:
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=hold(gate)), tmp_path) as child:
        await child.open()
        await child.say("hello", "t1")
        await child.event("step.started")
        await child.send(Ping(seq=7))
        pong = await child.expect(Pong)
        assert pong.seq == 7
        assert not child.of(TurnDone), "the model call is still held, yet the Ping was answered"
        gate.touch()
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED
        assert done.messages[-1].content == "[old-model] You said: hello"


async def test_spawn_with_other_protocol_version_is_refused(tmp_path: Path) -> None:
    child = await ChildProcess.start("v", env=child_env(tmp_path))
    spawn = Spawn(
        child_id="v", protocol_version=PROTOCOL_VERSION + 1, generation=1, policy=FINISH, config=quickstart_config()
    )
    with pytest.raises(SpawnError, match="protocol version"):
        await child.handshake(spawn, 30)
    assert await child.stop(grace=5) == 3


async def test_bad_tool_reference_fails_the_spawn_clearly(tmp_path: Path) -> None:
    child = await ChildProcess.start("t", env=child_env(tmp_path))
    spawn = Spawn(child_id="t", generation=1, policy=FINISH, config=parse_config(cfg(tools='["nosuchmodule:fn"]')))
    with pytest.raises(SpawnError, match="cannot import module 'nosuchmodule'"):
        await child.handshake(spawn, 30)
    assert await child.stop(grace=5) == 2


# --------------------------------------------------------------------------- RFC 0002


async def test_swap_ack_at_once_latest_wins_and_finish_on_old(tmp_path: Path) -> None:
    """RFC 0002 §1 ack on receipt, latest wins; §4 every step of the in-flight turn on the old model."""
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=f"steps = 2, {hold(gate)}"), tmp_path) as child:
        await child.open()
        await child.say("work please", "t1")
        await child.event("step.started")
        await child.send(child.swap(cfg("model-b"), 2, FINISH))
        await child.send(child.swap(cfg("model-c"), 3, FINISH))
        assert (await child.expect(SwapAck)).generation == 2
        assert (await child.expect(SwapAck)).generation == 3
        await child.event("swap.parked", lambda e: e.data["model_to"] == "model-c")
        gate.touch()
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED
        assert done.record.steps == 3
        assert assistant_models(done) == ["old-model"] * 3
        assert done.record.restarts == 0
        applied = await child.expect(SwapApplied)
        assert (applied.generation, applied.model_from, applied.model_to) == (3, "old-model", "model-c")
        assert applied.kind is SwapKind.MODEL
        # Exactly one swap was applied: generation 2 was superseded in the slot.
        await child.send(Ping(seq=1))
        await child.expect(Pong)
        assert len(child.of(SwapApplied)) == 1
        await child.say("next", "t2")
        second = await child.expect(TurnDone)
        assert set(assistant_models(second)) == {"model-c"}


async def test_transcript_survives_a_swap(tmp_path: Path) -> None:
    """RFC 0002 §2: the next turn runs on the new model over the full transcript."""
    async with running_child(cfg(), tmp_path) as child:
        await child.open()
        await child.say("one two three", "t1")
        first = await child.expect(TurnDone)
        await child.send(child.swap(cfg("model-b"), 2, FINISH))
        await child.expect(SwapsApplied)
        await child.say("four", "t2")
        second = await child.expect(TurnDone)
        # The scripted model counts every history word as an input token.
        history_words = len(["one", "two", "three"]) + len(first.messages[-1].content.split()) + 1
        assert second.record.usage.input_tokens == history_words
        assert assistant_models(second) == ["model-b"]


async def test_idle_session_applies_swap_at_once(tmp_path: Path) -> None:
    """RFC 0002 §3"""
    async with running_child(cfg(), tmp_path) as child:
        await child.open()
        await child.send(child.swap(cfg("model-b"), 2, RESTART))
        ack = await child.expect(SwapAck)
        batch = await child.expect(SwapsApplied)
        assert ack.generation == batch.generation == 2
        [applied] = batch.applied
        assert (applied.assistant, applied.model_from, applied.model_to) == ("main", "old-model", "model-b")
        assert applied.sessions == ("s1",)
        # Reported once, in the batch: no per-session frame or event now, and none at the next turn.
        await child.say("next", "t1")
        done = await child.expect(TurnDone)
        assert assistant_models(done) == ["model-b"]
        assert not child.of(SwapApplied), "an idle session's swap is reported in the child's one batch"
        assert not [e for e in child.of(Event) if e.name == "swap.applied"]


async def test_restart_turn_discards_and_reruns_without_starting_requested_tools(tmp_path: Path) -> None:
    """RFC 0002 §5: the in-flight model call completes, the tool it asked for never starts, the turn re-runs."""
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=f"steps = 1, {hold(gate)}"), tmp_path, policy=RESTART) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("step.started", lambda e: e.data["model"] == "old-model")
        await child.send(child.swap(cfg("model-b", options="steps = 1"), 2, RESTART))
        await child.expect(SwapAck)
        gate.touch()
        discarded = await child.expect(TurnDiscarded)
        assert (discarded.attempt.model, discarded.attempt.steps) == ("old-model", 1)
        assert discarded.attempt.usage.output_tokens > 0
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED
        assert done.record.restarts == 1
        assert [d.model for d in done.record.discarded] == ["old-model"]
        assert done.record.models == ("model-b",)
        assert set(assistant_models(done)) == {"model-b"}
        assert all(m.turn == "t1" for m in done.messages)
        # One tool call ran: the re-run's. The discarded step's call never started.
        assert tool_log(tmp_path) == ["record step 1"]
        await child.event("turn.restarted")
        assert len([e for e in child.of(Event) if e.name == "tool.call"]) == 1


async def test_restart_turn_never_tears_a_running_tool_and_replays_its_result(tmp_path: Path) -> None:
    """RFC 0002 §5: a tool in flight completes; in the re-run the same call reuses the recorded result."""
    async with running_child(
        cfg(options="steps = 1", tools='["tests.tooling:held"]'), tmp_path, policy=RESTART
    ) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("tool.call")
        await child.send(child.swap(cfg("model-b", options="steps = 1", tools='["tests.tooling:held"]'), 2, RESTART))
        await child.expect(SwapAck)
        (tmp_path / "tool.gate").touch()
        done = await child.expect(TurnDone)
        assert done.record.restarts == 1 and done.record.models == ("model-b",)
        assert tool_log(tmp_path) == ["held-start step 1", "held-end step 1"]
        results = [m for m in done.messages if isinstance(m, ToolResult)]
        assert [r.content for r in results] == ["held step 1"]
        replayed = await child.event("tool.result", lambda e: e.turn == "t1" and e.data["replayed"])
        assert replayed.data["name"] == "held"


async def test_restart_turn_reruns_side_effect_free_tools(tmp_path: Path) -> None:
    async with running_child(
        cfg(options="steps = 1", tools='["tests.tooling:held_pure"]'), tmp_path, policy=RESTART
    ) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("tool.call")
        await child.send(
            child.swap(cfg("model-b", options="steps = 1", tools='["tests.tooling:held_pure"]'), 2, RESTART)
        )
        await child.expect(SwapAck)
        (tmp_path / "tool.gate").touch()
        done = await child.expect(TurnDone)
        assert done.record.restarts == 1
        assert tool_log(tmp_path).count("held-start step 1") == 2


async def test_restarts_are_bounded_then_fall_back_to_finish_on_old(tmp_path: Path) -> None:
    """RFC 0002 §5: at most max_turn_restarts; after that the turn finishes on its model."""
    gate_a, gate_b = tmp_path / "a.gate", tmp_path / "b.gate"
    limits = "max_turn_restarts = 1"
    async with running_child(cfg(options=hold(gate_a), limits=limits), tmp_path, policy=RESTART) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("step.started", lambda e: e.data["model"] == "old-model")
        await child.send(child.swap(cfg("model-b", options=hold(gate_b), limits=limits), 2, RESTART))
        await child.expect(SwapAck)
        gate_a.touch()
        await child.expect(TurnDiscarded)
        await child.event("step.started", lambda e: e.data["model"] == "model-b")
        await child.send(child.swap(cfg("model-c", limits=limits), 3, RESTART))
        await child.expect(SwapAck)
        gate_b.touch()
        done = await child.expect(TurnDone)
        assert done.record.restarts == 1
        assert done.record.models == ("model-b",)
        applied = await child.expect(SwapApplied, lambda a: a.generation == 3)
        assert applied.model_to == "model-c"
        assert len(child.of(TurnDiscarded)) == 1


async def test_repoint_never_restarts(tmp_path: Path) -> None:
    """RFC 0002 §6: same model, other endpoints/options → finish-on-old even under restart-turn."""
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=f"steps = 1, {hold(gate)}"), tmp_path, policy=RESTART) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("step.started")
        await child.send(child.swap(cfg(options=f"steps = 1, temperature = 0.5, {hold(gate)}"), 2, RESTART))
        await child.expect(SwapAck)
        gate.touch()
        done = await child.expect(TurnDone)
        assert done.record.restarts == 0 and not done.record.discarded
        applied = await child.expect(SwapApplied)
        assert applied.kind is SwapKind.REPOINT
        assert tool_log(tmp_path) == ["record step 1"]


async def test_swap_of_another_assistant_leaves_the_session_alone(tmp_path: Path) -> None:
    more = '[[assistants]]\nname = "other"\n'
    async with running_child(cfg(more=more), tmp_path) as child:
        await child.open(assistant="main")
        other = cfg(more=more + 'intelligence = { model = "other-new" }\n')
        await child.send(child.swap(other, 2, RESTART))
        await child.expect(SwapAck)
        await child.send(Ping(seq=2))  # frames are handled in order: anything applied is sent before this Pong
        await child.expect(Pong)
        assert not child.of(SwapApplied) and not child.of(SwapsApplied)
        await child.say("hi", "t1")
        assert assistant_models(await child.expect(TurnDone)) == ["old-model"]


async def test_every_assistant_message_records_model_and_turn(tmp_path: Path) -> None:
    """RFC 0002 §8"""
    async with running_child(cfg(options="steps = 2, think = true"), tmp_path) as child:
        await child.open()
        await child.say("go", "t9")
        done = await child.expect(TurnDone)
        assistants = [m for m in done.messages if isinstance(m, AssistantMessage)]
        assert len(assistants) == 3
        assert all(m.model == "old-model" and m.turn == "t9" and m.assistant == "main" for m in assistants)
        assert all(m.thinking for m in assistants)


# --------------------------------------------------------------------------- budgets (RFC 0007 §3–§6)


async def test_max_steps_exhausted(tmp_path: Path) -> None:
    async with running_child(cfg(options="steps = 5", limits="max_steps = 2"), tmp_path) as child:
        await child.open()
        await child.say("go", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.EXHAUSTED_STEPS
        assert done.record.steps == 2
        assert tool_log(tmp_path) == ["record step 1", "record step 2"]


async def test_max_tokens_exhausted(tmp_path: Path) -> None:
    async with running_child(cfg(options="steps = 3", limits="max_tokens = 5"), tmp_path) as child:
        await child.open()
        await child.say("a fairly long message that costs more than five tokens", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.EXHAUSTED_TOKENS
        assert done.record.steps == 1
        # The unrun call is answered so the history stays valid; the tool itself never ran.
        assert tool_log(tmp_path) == []
        assert isinstance(done.messages[-1], ToolResult) and done.messages[-1].is_error


async def test_deadline(tmp_path: Path) -> None:
    never = tmp_path / "never.gate"
    async with running_child(cfg(options=hold(never), limits='deadline = "300ms"'), tmp_path) as child:
        await child.open()
        await child.say("go", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.DEADLINE
        assert done.messages == []


async def test_loop_detected_on_fourth_identical_call(tmp_path: Path) -> None:
    async with running_child(cfg(options="steps = 6, loop = true"), tmp_path) as child:
        await child.open()
        await child.say("go", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.LOOP_DETECTED
        assert tool_log(tmp_path) == ["record step 1"] * 3


async def test_unknown_tool_becomes_an_error_result_and_the_turn_continues(tmp_path: Path) -> None:
    async with running_child(cfg(), tmp_path) as child:
        await child.open()
        await child.say("please call tool nosuch", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED
        result = next(m for m in done.messages if isinstance(m, ToolResult))
        assert result.is_error and "unknown tool 'nosuch'" in result.content
        assert done.messages[-1].content.startswith("[old-model] You said:")


async def test_cancel_mid_turn(tmp_path: Path) -> None:
    never = tmp_path / "never.gate"
    async with running_child(cfg(options=hold(never)), tmp_path) as child:
        await child.open()
        await child.say("go", "t1")
        await child.event("step.started")
        await child.send(Cancel(session="s1", turn="t1"))
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.CANCELLED
        await child.say("again", "t2")  # the session stays usable
        await child.event("step.started", lambda e: e.turn == "t2")


async def test_second_input_while_running_is_refused(tmp_path: Path) -> None:
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=hold(gate)), tmp_path) as child:
        await child.open()
        await child.say("go", "t1")
        await child.say("again", "t2")
        failed = await child.expect(Failed)
        assert failed.turn == "t2" and "already runs turn t1" in failed.error
        gate.touch()
        assert (await child.expect(TurnDone)).record.id == "t1"


# --------------------------------------------------------------------------- failure modes (RFC 0001 §7, RFC 0003 §2)


async def test_malformed_frame_from_parent_exits_nonzero_with_a_clear_line(tmp_path: Path) -> None:
    async with running_child(cfg(), tmp_path) as child:
        await child.child.channel._stream.send(b"\x00\x00\x00\x03abc")
        code = await child.child.process.wait()
        with anyio.fail_after(30):
            while not any("protocol error" in line for line in child.stderr):
                await anyio.sleep(0.05)
        assert code == 3
        assert any("agentd.child: protocol error from supervisor: undecodable frame" in line for line in child.stderr)


async def test_oversize_frame_header_is_refused(tmp_path: Path) -> None:
    async with running_child(cfg(), tmp_path) as child:
        await child.child.channel._stream.send((64 * 1024 * 1024).to_bytes(4, "big"))
        assert await child.child.process.wait() == 3


_ORPHAN_PARENT = """
import anyio
from agentd.config import SwapPolicy, quickstart_config
from agentd.protocol import Spawn
from agentd.supervisor.child import ChildProcess

async def main():
    child = await ChildProcess.start("orphan")
    await child.handshake(Spawn(child_id="orphan", generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=quickstart_config()), 30)
    print(child.pid, flush=True)
    await anyio.sleep_forever()

anyio.run(main)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_child_exits_when_its_parent_dies(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE, text=True, env=child_env(tmp_path), cwd=REPO
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert _alive(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    killed_at = time.monotonic()
    while _alive(child_pid) and time.monotonic() - killed_at < 30:
        time.sleep(0.02)
    gone_after = time.monotonic() - killed_at
    assert not _alive(child_pid)
    assert gone_after < 2.0, f"child outlived its parent by {gone_after:.2f}s"


async def test_a_transcript_larger_than_one_frame_is_loaded_and_its_turn_runs(tmp_path: Path) -> None:
    """A conversation that grew past 16 MiB is still loaded (in parts) and answered, also in parts."""
    big = "y" * (MAX_FRAME_BYTES + 1_000_000)
    history = [SystemMessage(content="s", name="main"), UserMessage(content=big, turn="t0")]
    async with running_child(cfg(tools="[]"), tmp_path) as child:
        await child.send(Open(session="s1", assistant="main", transcript=history))
        await child.say(f"again: {big}", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED
        assert done.record.usage.input_tokens > 0 and done.messages[-1].content.endswith("y")  # type: ignore[union-attr]


async def test_an_unwatched_session_sends_only_what_the_supervisor_needs_until_watched(tmp_path: Path) -> None:
    gate = tmp_path / "model.gate"
    async with running_child(cfg(options=hold(gate), tools="[]"), tmp_path) as child:
        await child.open()
        await child.send(Input(session="s1", turn="t1", message=UserMessage(content="one", turn="t1"), watched=False))
        gate.touch()
        first = await child.expect(TurnDone)
        assert first.record.id == "t1" and child.of(Event) == []
        gate.unlink()
        await child.send(Input(session="s1", turn="t2", message=UserMessage(content="two", turn="t2"), watched=False))
        await child.send(Watch(session="s1"))  # someone subscribed mid-turn (its model call is held)
        await child.send(Ping(seq=1))
        await child.expect(Pong)  # the Watch was read before this
        gate.touch()
        assert (await child.expect(TurnDone)).record.id == "t2"
        assert "step.done" in {e.name for e in child.of(Event) if e.turn == "t2"}
