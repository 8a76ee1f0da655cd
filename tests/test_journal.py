"""The tool ledger (agentd.child.journal) as pure logic: what is replayed, what is unknown, what runs."""

from __future__ import annotations

from typing import Any

import pytest

from agentd.child.journal import OUTCOME_UNKNOWN, REPLAYED, ToolLedger
from agentd.intel.scripted import ScriptedOptions, scripted_reply
from agentd.messages import ToolCall, UserMessage
from agentd.protocol import JournalFinish, JournalStart
from agentd.records import JournalEntry
from agentd.tools import ToolOutcome, ToolSpec

pytestmark = pytest.mark.anyio


class Counting:
    """A tool that counts its runs."""

    def __init__(self, name: str = "refund", *, pure: bool = False) -> None:
        self.name = name
        self.spec = ToolSpec(name=name, side_effect_free=pure)
        self.runs = 0

    async def invoke(self, arguments: dict[str, Any]) -> ToolOutcome:
        self.runs += 1
        return ToolOutcome(f"ran {self.runs} with {arguments}")


def call(order: int = 7, name: str = "refund") -> ToolCall:
    return ToolCall(id=f"c{order}", name=name, arguments={"order": order})


async def test_a_journaled_result_is_replayed_and_an_unfinished_call_is_unknown() -> None:
    journaled = [
        JournalEntry(seq=1, call="c7", tool="refund", arguments={"order": 7}, finished=True, content="refunded"),
        JournalEntry(seq=2, call="c8", tool="refund", arguments={"order": 8}),
    ]
    writes: list[JournalStart | JournalFinish] = []

    async def write(frame: JournalStart | JournalFinish) -> str | None:
        writes.append(frame)
        return None

    ledger, tool = ToolLedger("s", "t", journaled, write), Counting()
    assert await ledger.run(call(7), tool) == (ToolOutcome("refunded"), REPLAYED)
    outcome, how = await ledger.run(call(8), tool)
    assert how == OUTCOME_UNKNOWN and outcome.is_error and "outcome is unknown" in outcome.content
    assert tool.runs == 0 and not writes
    # A second identical call in the same attempt is a new call: journaled first, then run.
    outcome, how = await ledger.run(call(7), tool)
    assert how is None and tool.runs == 1
    assert [type(w).__name__ for w in writes] == ["JournalStart", "JournalFinish"]
    assert writes[0].entry.seq == 3 and writes[1].entry.content == outcome.content
    # The next attempt (restart-turn) reuses all three.
    ledger.new_attempt()
    assert (await ledger.run(call(7), tool))[1] == REPLAYED
    assert (await ledger.run(call(8), tool))[1] == OUTCOME_UNKNOWN
    assert (await ledger.run(call(7), tool)) == (ToolOutcome(outcome.content), REPLAYED)
    assert tool.runs == 1


async def test_side_effect_free_tools_run_again_and_are_not_journaled() -> None:
    async def write(frame: JournalStart | JournalFinish) -> str | None:
        raise AssertionError("journaled a side-effect-free call")

    ledger, tool = ToolLedger("s", "t", [], write), Counting(pure=True)
    await ledger.run(call(), tool)
    ledger.new_attempt()
    assert (await ledger.run(call(), tool))[1] is None and tool.runs == 2


async def test_a_call_that_cannot_be_journaled_is_not_run() -> None:
    async def write(frame: JournalStart | JournalFinish) -> str | None:
        return "the store is unavailable"

    ledger, tool = ToolLedger("s", "t", [], write), Counting()
    outcome, how = await ledger.run(call(), tool)
    assert tool.runs == 0 and how is None and outcome.is_error and "could not be journaled" in outcome.content


def test_the_scripted_model_passes_json_arguments() -> None:
    text = 'call tool time__get_current_time {"timezone": "UTC"} and call tool other {not json}'
    reply = scripted_reply(
        "m", [UserMessage(content=text)], [ToolSpec(name="time__get_current_time")], ScriptedOptions()
    )
    assert [(c.name, c.arguments) for c in reply.message.tool_calls] == [
        ("time__get_current_time", {"timezone": "UTC"}),
        ("other", {}),
    ]
