"""Swap decisions and the scripted model's choices as pure functions (no process, no I/O)."""

from __future__ import annotations

import msgspec

from agentd.config import Intelligence, Limits, SwapPolicy
from agentd.intel.scripted import ScriptedOptions, scripted_reply
from agentd.messages import AssistantMessage, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.protocol import SwapIntel, SwapKind
from agentd.swap import classify_swap, restart_due
from agentd.tools import ToolSpec, resolve_tool

OLD = Intelligence(provider="ollama", endpoints=("http://a:1",), model="m1", options={"temperature": 0.1})


def frame(policy: SwapPolicy, **intel: Intelligence) -> SwapIntel:
    return SwapIntel(generation=2, policy=policy, intelligence=intel, limits=Limits())


def test_classify_swap() -> None:
    assert classify_swap(OLD, OLD) is None
    assert classify_swap(OLD, msgspec.structs.replace(OLD, model="m2")) is SwapKind.MODEL
    assert classify_swap(OLD, msgspec.structs.replace(OLD, provider="openai")) is SwapKind.MODEL
    assert classify_swap(OLD, msgspec.structs.replace(OLD, endpoints=("http://b:1",))) is SwapKind.REPOINT
    assert classify_swap(OLD, msgspec.structs.replace(OLD, options={"temperature": 0.9})) is SwapKind.REPOINT
    assert classify_swap(OLD, msgspec.structs.replace(OLD, api_key_env="KEY")) is SwapKind.REPOINT


def test_restart_due_only_for_a_model_swap_of_the_current_assistant_under_restart_turn() -> None:
    new_model = msgspec.structs.replace(OLD, model="m2")
    repoint = msgspec.structs.replace(OLD, endpoints=("http://b:1",))
    assert restart_due(frame(SwapPolicy.RESTART_TURN, a=new_model), "a", OLD, restarts=0, max_restarts=2)
    assert not restart_due(None, "a", OLD, restarts=0, max_restarts=2)
    assert not restart_due(frame(SwapPolicy.FINISH_ON_OLD, a=new_model), "a", OLD, restarts=0, max_restarts=2)
    assert not restart_due(frame(SwapPolicy.RESTART_TURN, a=repoint), "a", OLD, restarts=0, max_restarts=2)
    assert not restart_due(frame(SwapPolicy.RESTART_TURN, b=new_model), "a", OLD, restarts=0, max_restarts=2)
    assert not restart_due(frame(SwapPolicy.RESTART_TURN, a=new_model), "a", OLD, restarts=2, max_restarts=2)
    assert not restart_due(frame(SwapPolicy.RESTART_TURN, a=new_model), "a", OLD, restarts=0, max_restarts=0)


CLOCK = resolve_tool("clock").spec
TRANSFER = ToolSpec(name="transfer_to_billing", description="billing")


def test_scripted_answers_quoting_the_user_and_naming_the_model() -> None:
    reply = scripted_reply("echo-small", [UserMessage(content="hello")], [CLOCK], ScriptedOptions())
    assert reply.message.content == "[echo-small] You said: hello"
    assert reply.model == "echo-small"
    assert reply.usage.input_tokens == 1 and reply.usage.output_tokens == 4


def test_scripted_calls_named_tools_then_the_transfer_in_one_step() -> None:
    reply = scripted_reply(
        "m", [UserMessage(content="clock please, then transfer me to billing")], [CLOCK, TRANSFER], ScriptedOptions()
    )
    assert [c.name for c in reply.message.tool_calls] == ["clock", "transfer_to_billing"]
    assert reply.message.content == ""


def test_scripted_tool_steps_differ_unless_looping() -> None:
    history = [UserMessage(content="go")]
    first = scripted_reply("m", history, [CLOCK], ScriptedOptions(steps=2)).message
    call = first.tool_calls[0]
    history2 = [*history, first, ToolResult(name="clock", content="now", call_id=call.id)]
    second = scripted_reply("m", history2, [CLOCK], ScriptedOptions(steps=2)).message
    assert call.arguments == {"offset_hours": 0} and second.tool_calls[0].arguments == {"offset_hours": 1}
    looping = scripted_reply("m", history2, [CLOCK], ScriptedOptions(steps=2, loop=True)).message
    assert looping.tool_calls[0].arguments == {"offset_hours": 0}
    history3 = [*history2, second, ToolResult(name="clock", content="later", call_id=second.tool_calls[0].id)]
    final = scripted_reply("m", history3, [CLOCK], ScriptedOptions(steps=2)).message
    assert final.content == "[m] You said: go (after 2 tool results)"


def test_scripted_opener_greets_as_the_assistant_whose_prompt_is_last() -> None:
    history = [
        SystemMessage(content="a", name="triage"),
        UserMessage(content="hi"),
        AssistantMessage(content="", tool_calls=(ToolCall(id="1", name="transfer_to_billing"),)),
        ToolResult(name="transfer_to_billing", content="ok", call_id="1"),
        SystemMessage(content="b", name="billing"),
    ]
    reply = scripted_reply("m", history, [], ScriptedOptions())
    assert reply.message.content == "[m] Hello, billing here. How can I help?"


def test_scripted_unknown_tool_on_request_and_thinking() -> None:
    reply = scripted_reply("m", [UserMessage(content="call tool nosuch")], [], ScriptedOptions(think=True))
    assert [c.name for c in reply.message.tool_calls] == ["nosuch"]
    assert reply.message.thinking == "[m] step 1: deciding how to answer"
