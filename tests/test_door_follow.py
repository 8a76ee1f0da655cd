"""What a door stream says for a turn's native events (``agentd.door.follow``, RFC 0010 §7), and
how the OpenAPI document names the streamed answers."""

from __future__ import annotations

from typing import Any

import msgspec

from agentd import events
from agentd.api import ALL_ROUTES, DOCS
from agentd.door.follow import Happening, Rerun, Sent, StepEnded, TakenBack, Text, ToolEnded, ToolStarted, follow
from agentd.door.responsestream import ItemWriter, Numbered, stream_end
from agentd.door.shapes import McpCall, OutputMessage, OutputText, ResponseObject
from agentd.openapi import document


def run(script: list[tuple[str, dict[str, Any]]], *, shows_tools: bool = True) -> list[Happening]:
    sent = Sent(shows_tools=shows_tools)
    said: list[Happening] = []
    for name, data in script:
        sent, happened = follow(sent, name, data)
        said += happened
    return said


def test_steps_text_and_tools_in_order() -> None:
    said = run(
        [
            (events.STEP_STARTED, {"run": 0, "step": 0}),
            (events.DELTA, {"run": 0, "step": 0, "thinking": "hmm"}),
            (events.STEP_DONE, {"run": 0, "step": 0, "content": ""}),
            (events.TOOL_CALL, {"id": "c1", "name": "clock", "arguments": {"tz": "UTC"}}),
            (events.TOOL_RESULT, {"id": "c1", "name": "clock", "content": "noon", "is_error": False}),
            (events.DELTA, {"run": 0, "step": 1, "content": "It is "}),
            (events.DELTA, {"run": 0, "step": 1, "content": "noon."}),
            (events.STEP_DONE, {"run": 0, "step": 1, "content": "It is noon."}),
        ]
    )
    assert said == [
        StepEnded(step=0, content=""),
        ToolStarted(id="c1", name="clock", arguments='{"tz":"UTC"}'),
        ToolEnded(id="c1", content="noon", is_error=False),
        Text(step=1, text="It is "),
        Text(step=1, text="noon."),
        StepEnded(step=1, content="It is noon."),
    ]


def test_a_reset_takes_back_only_what_went_out() -> None:
    before_text = run(
        [
            (events.STEP_RESET, {"run": 0, "step": 0, "reason": "failover"}),
            (events.DELTA, {"run": 0, "step": 0, "content": "a"}),
        ]
    )
    assert before_text == [Text(step=0, text="a")]
    after_text = run(
        [
            (events.DELTA, {"run": 0, "step": 0, "content": "a"}),
            (events.STEP_RESET, {"run": 0, "step": 0, "reason": "x"}),
        ]
    )
    assert isinstance(after_text[-1], TakenBack)


def test_a_rerun_takes_back_what_went_out_else_the_stream_goes_on() -> None:
    quiet = run(
        [(events.TURN_RESTARTED, {"run": 1, "model_to": "b"}), (events.DELTA, {"run": 1, "step": 0, "content": "b"})]
    )
    assert quiet == [Rerun(run=1), Text(step=0, text="b")]
    loud = run([(events.DELTA, {"run": 0, "step": 0, "content": "a"}), (events.TURN_RESTARTED, {"run": 1})])
    assert isinstance(loud[-1], TakenBack)
    crashed = run(
        [(events.DELTA, {"run": 0, "step": 0, "content": "a"}), (events.DELTA, {"run": 1, "step": 0, "content": "b"})]
    )
    assert isinstance(crashed[-1], TakenBack)
    stale = run([(events.TURN_RESTARTED, {"run": 1}), (events.DELTA, {"run": 0, "step": 0, "content": "late"})])
    assert stale == [Rerun(run=1)]


def test_a_tool_is_output_only_where_tools_are_shown() -> None:
    script = [(events.TOOL_CALL, {"id": "c", "name": "clock", "arguments": {}}), (events.TURN_RESTARTED, {"run": 1})]
    assert isinstance(run(script, shows_tools=True)[-1], TakenBack)
    assert run(script, shows_tools=False)[-1] == Rerun(run=1)


def test_the_openapi_document_names_the_streamed_answers() -> None:
    paths = document(ALL_ROUTES, DOCS, version="test")["paths"]
    for path, first, last in (
        ("/v1/chat/completions", "chat.completion.chunk", "[DONE]"),
        ("/v1/responses", "response.created", "error"),
    ):
        answer = paths[path]["post"]["responses"]["200"]
        assert set(answer["content"]) == {"application/json", "text/event-stream"}
        assert answer["x-agentd-events"][0] == first and answer["x-agentd-events"][-1] == last


def _final(*items: OutputMessage | McpCall) -> ResponseObject:
    return ResponseObject(id="resp_t_1", created_at=0, status="completed", model="main", output=list(items), usage=None)


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    return [msgspec.json.decode(chunk.split(b"data: ", 1)[1]) for chunk in raw]


def test_the_end_of_a_response_stream_sends_what_it_did_not_show() -> None:
    writer = ItemWriter(Numbered())
    writer.open_message("msg_t_1_3")
    writer.text("msg_t_1_3", "It is ")
    answer = OutputMessage(id="msg_t_1_3", role="assistant", content=[OutputText(text="It is noon.")])
    opener = OutputMessage(id="msg_t_1_5", role="assistant", content=[OutputText(text="Hello.")])
    sent = _events(stream_end(writer, _final(answer, opener)))
    assert [e["type"] for e in sent] == [
        "response.output_text.delta",  # the rest of the open message
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # a message that did not stream
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sent[0]["delta"] == "noon." and sent[6]["delta"] == "Hello."
    assert [e["sequence_number"] for e in sent] == list(range(3, 3 + len(sent)))


def test_a_response_stream_that_showed_what_the_answer_has_not_ends_with_stream_reset() -> None:
    writer = ItemWriter(Numbered())
    writer.open_message("msg_t_1_3")
    writer.text("msg_t_1_3", "Old words")
    answer = OutputMessage(id="msg_t_1_3", role="assistant", content=[OutputText(text="New words")])
    [error] = _events(stream_end(writer, _final(answer)))
    assert (error["type"], error["code"]) == ("error", "stream_reset")
    other = ItemWriter(Numbered())
    other.tool(McpCall(id="mcp_t_1_c9", server_label="agentd", name="clock", arguments="{}"), done=False)
    [error] = _events(stream_end(other, _final(answer)))
    assert error["code"] == "stream_reset"
