"""Transfers inside a real child process (RFC 0004): the transfer tool, the history modes as the
loop applies them, first-message modes, and how transfers compose with swaps."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd.budget import TurnStatus
from agentd.config import SwapPolicy
from agentd.messages import AssistantMessage, SystemMessage, ToolResult, UserMessage
from agentd.protocol import Event, Ping, Pong, SwapAck, SwapApplied, TurnDone
from tests.child_harness import running_child, tool_log

pytestmark = pytest.mark.anyio


def squad(
    mode: str = "rolling-history",
    *,
    billing_first: str = 'first_message = "Billing here."',
    billing_mode: str = "assistant-speaks-first",
    billing_model: str = "billing-model",
    message: str = "Connecting you.",
) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "triage-model"

[[assistants]]
name = "triage"
system = "You route."
tools = ["tests.tooling:record"]

[[assistants.transfers]]
to = "billing"
description = "Invoices"
message = "{message}"
mode = "{mode}"

[[assistants]]
name = "billing"
system = "You bill."
{billing_first}
first_message_mode = "{billing_mode}"
intelligence = {{ model = "{billing_model}" }}
"""


def shape(messages: list) -> list[str]:
    """A compact picture of a transcript: role, and who spoke / whose prompt."""
    out = []
    for m in messages:
        match m:
            case SystemMessage():
                out.append(f"S:{m.name}")
            case UserMessage():
                out.append("U")
            case AssistantMessage() if m.tool_calls:
                out.append("TT:" + ",".join(c.name for c in m.tool_calls))
            case AssistantMessage():
                out.append(f"A:{m.assistant}")
            case ToolResult():
                out.append(f"TR:{m.name}")
    return out


async def transfer_turn(
    tmp_path: Path, config_text: str, text: str = "please transfer me to billing"
) -> tuple[TurnDone, object]:
    async with running_child(config_text, tmp_path) as child:
        from agentd.messages import system
        from agentd.protocol import Open

        await child.send(Open(session="s1", assistant="triage", transcript=[system("You route.", name="triage")]))
        await child.say(text, "t1")
        done = await child.expect(TurnDone)
        return done, child


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (
            "rolling-history",
            ["S:triage", "U", "TT:transfer_to_billing", "TR:transfer_to_billing", "A:triage", "S:billing", "A:billing"],
        ),
        (
            "swap-system-message-in-history",
            ["S:billing", "U", "TT:transfer_to_billing", "TR:transfer_to_billing", "A:triage", "A:billing"],
        ),
        (
            "swap-system-message-in-history-and-remove-transfer-tool-messages",
            ["S:billing", "U", "A:triage", "A:billing"],
        ),
        ("delete-history", ["S:billing", "A:billing"]),
    ],
)
async def test_transfer_rewrites_history_per_mode(tmp_path: Path, mode: str, expected: list[str]) -> None:
    done, _ = await transfer_turn(tmp_path, squad(mode))
    assert done.record.status is TurnStatus.TRANSFERRED
    assert done.assistant == "billing"
    assert done.transcript is not None
    assert shape(done.transcript) == expected
    opener = done.transcript[-1]
    assert (
        isinstance(opener, AssistantMessage) and opener.content == "Billing here." and opener.model == "billing-model"
    )
    spoken = [m for m in done.transcript if isinstance(m, AssistantMessage) and m.content == "Connecting you."]
    if mode != "delete-history":
        assert spoken and spoken[0].assistant == "triage" and spoken[0].model == "triage-model"


async def test_parallel_call_beside_the_transfer_runs_and_keeps_its_result(tmp_path: Path) -> None:
    mode = "swap-system-message-in-history-and-remove-transfer-tool-messages"
    done, _ = await transfer_turn(tmp_path, squad(mode), "record this and transfer me to billing")
    assert done.record.status is TurnStatus.TRANSFERRED
    assert tool_log(tmp_path) == ["record step 1"]
    # Only the transfer call and its result went; the record call stays paired with its result.
    assert shape(done.transcript) == ["S:billing", "U", "TT:record", "TR:record", "A:triage", "A:billing"]


@pytest.mark.parametrize("message", ["", None])
async def test_no_destination_message_when_empty_or_unset(tmp_path: Path, message: str | None) -> None:
    text = squad().replace('message = "Connecting you."\n', "" if message is None else 'message = ""\n')
    done, _ = await transfer_turn(tmp_path, text)
    assert shape(done.transcript) == [
        "S:triage",
        "U",
        "TT:transfer_to_billing",
        "TR:transfer_to_billing",
        "S:billing",
        "A:billing",
    ]


async def test_model_generated_opener_is_one_call_by_the_new_assistant(tmp_path: Path) -> None:
    config = squad(billing_first="", billing_mode="assistant-speaks-first-with-model-generated-message")
    done, _ = await transfer_turn(tmp_path, config)
    opener = done.transcript[-1]
    assert isinstance(opener, AssistantMessage)
    assert opener.content == "[billing-model] Hello, billing here. How can I help?"
    assert (opener.model, opener.assistant) == ("billing-model", "billing")
    assert "billing-model" in done.record.models


async def test_waits_for_user_means_no_opener(tmp_path: Path) -> None:
    done, _ = await transfer_turn(tmp_path, squad(billing_mode="assistant-waits-for-user"))
    assert shape(done.transcript)[-1] == "S:billing"


async def test_after_a_transfer_the_session_runs_on_the_new_assistant(tmp_path: Path) -> None:
    async with running_child(squad(), tmp_path) as child:
        await child.open(assistant="triage")
        await child.say("transfer me to billing", "t1")
        await child.expect(TurnDone)
        transfer = await child.event("transfer")
        assert transfer.data == {"from": "triage", "to": "billing", "mode": "rolling-history"}
        await child.say("what do I owe?", "t2")
        done = await child.expect(TurnDone)
        assert done.assistant == "billing"
        assert done.messages[-1].content == "[billing-model] You said: what do I owe?"
        assert done.messages[-1].assistant == "billing"


async def test_reload_of_another_assistant_does_not_swap_but_a_later_transfer_uses_it(tmp_path: Path) -> None:
    async with running_child(squad(), tmp_path) as child:
        await child.open(assistant="triage")
        await child.send(child.swap(squad(billing_model="billing-v2"), 2, SwapPolicy.RESTART_TURN))
        await child.expect(SwapAck)
        await child.send(Ping(seq=1))
        await child.expect(Pong)
        assert not child.of(SwapApplied), "the session is on triage, whose intelligence did not change"
        await child.say("transfer me to billing", "t1")
        done = await child.expect(TurnDone)
        assert done.transcript[-1].model == "billing-v2"
        await child.say("hello", "t2")
        assert (await child.expect(TurnDone)).messages[-1].model == "billing-v2"
        assert [e for e in child.of(Event) if e.name == "swap.applied"] == []
