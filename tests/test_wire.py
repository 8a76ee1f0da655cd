"""Wire conversion: lossless round trips (hypothesis), responses in any chunking, ids, think tags,
invalid arguments, options."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.budget import Usage
from agentd.intel.ollama import NDJSONReader
from agentd.intel.openai import SSEReader
from agentd.intel.wire import (
    IncompleteStream,
    OptionError,
    RemoteError,
    WireError,
    call_options,
    ensure_call_ids,
    pair_tool_results,
    parse_arguments,
    split_think,
)
from agentd.intel.wire_ollama import (
    OllamaStream,
    messages_from_ollama,
    messages_to_ollama,
    ollama_chat_request,
    ollama_response,
)
from agentd.intel.wire_openai import (
    OpenAIStream,
    image_url,
    messages_from_openai,
    messages_to_openai,
    openai_chat_request,
    openai_response,
)
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec
from tests.fakes.render import OpenAILayout, ollama_body, ollama_records, openai_body, openai_events
from tests.fakes.script import FakeCall, Reply

# --------------------------------------------------------------------------- strategies

_chars = st.characters(blacklist_categories=("Cs",))
# Content free of think tags (those are split on purpose; tested separately).
text = st.text(_chars, max_size=30).filter(lambda t: "think>" not in t.lower())
nonblank = text.filter(lambda t: t.strip() != "" and t == t.strip())
names = st.sampled_from(["clock", "search", "lookup", "get_weather"])  # few names: same-tool calls are common
optional_name = st.none() | st.sampled_from(["ana", "bob", "triage"])
base64ish = st.sampled_from(["iVBORw0KGgoAAAANSUhEUg==", "/9j/4AAQSkZJRg==", "R0lGODlhAQABAAAAACw=", "AAAA"])
json_scalar = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(_chars, max_size=10)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(_chars, max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(_chars, max_size=8), json_value, max_size=4)
bookkeeping = st.fixed_dictionaries({"turn": st.none() | st.just("t1")})


@st.composite
def tool_calls(draw: st.DrawFn, position: int) -> tuple[ToolCall, ...]:
    calls = draw(st.lists(st.tuples(names, arguments), max_size=3))
    return tuple(ToolCall(id=f"call_{position}_{k}", name=n, arguments=a) for k, (n, a) in enumerate(calls))


@st.composite
def transcripts(draw: st.DrawFn, *, images_everywhere: bool, with_thinking: bool) -> list[Message]:
    """A system prompt, then user / assistant (with calls answered in order) exchanges."""
    messages: list[Message] = []
    if draw(st.booleans()):
        messages.append(SystemMessage(content=draw(text), images=_images(draw, images_everywhere)))
    for _ in range(draw(st.integers(0, 4))):
        messages.append(
            UserMessage(
                content=draw(text),
                images=_images(draw, True),
                name=draw(optional_name),
                turn=draw(st.none() | st.just("t1")),
            )
        )
        calls = draw(tool_calls(len(messages)))
        messages.append(
            AssistantMessage(
                content=draw(text),
                thinking=draw(st.none() | nonblank) if with_thinking else None,
                images=_images(draw, images_everywhere),
                name=draw(optional_name),
                tool_calls=calls,
                model=draw(st.none() | st.just("llama3")),
                assistant=draw(st.none() | st.just("triage")),
            )
        )
        for call in calls:
            messages.append(ToolResult(name=call.name, content=draw(text), call_id=call.id))
    return messages


def _images(draw: st.DrawFn, allowed: bool) -> tuple[str, ...] | None:
    if not allowed:
        return None
    images = draw(st.lists(base64ish, max_size=2))
    return tuple(images) or None


def canonical(message: Message, *, thinking: bool = True) -> Message:
    """What survives a wire trip: bookkeeping and system names are not sent."""
    changes: dict[str, Any] = {"turn": None}
    if isinstance(message, AssistantMessage):
        changes.update(model=None, assistant=None)
        if not thinking:
            changes["thinking"] = None
    if isinstance(message, SystemMessage):
        changes["name"] = None
    return msgspec.structs.replace(message, **changes)


def encoded(value: Any) -> Any:
    """Through real JSON, as on the wire."""
    return json.loads(msgspec.json.encode(value))


# --------------------------------------------------------------------------- round trips


@given(transcripts(images_everywhere=True, with_thinking=True))
def test_ollama_history_round_trip_is_lossless(messages: list[Message]) -> None:
    back = messages_from_ollama(encoded(messages_to_ollama(messages)))
    assert back == [canonical(m) for m in messages]


@given(transcripts(images_everywhere=False, with_thinking=True))
def test_openai_history_round_trip_is_lossless_for_what_the_wire_carries(messages: list[Message]) -> None:
    # Thinking is not sent back on this wire (RFC 0005 §3); everything else survives, including the
    # tool result's name, recovered from its call id.
    back = messages_from_openai(encoded(messages_to_openai(messages)))
    assert back == [canonical(m, thinking=False) for m in messages]


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    calls = draw(st.lists(st.tuples(names, arguments), max_size=3))
    return Reply(
        content=draw(text),
        thinking=draw(st.none() | nonblank),
        tool_calls=tuple(FakeCall(n, a) for n, a in calls),
        input_tokens=draw(st.none() | st.integers(0, 5000)),
        output_tokens=draw(st.none() | st.integers(0, 5000)),
        pieces=draw(st.integers(1, 5)),
        think_tags=draw(st.booleans()),
    )


def _expected(reply: Reply, ids: list[str]) -> AssistantMessage:
    content = reply.content.lstrip() if reply.think_tags and reply.thinking else reply.content
    calls = zip(ids, reply.tool_calls, strict=True)
    return AssistantMessage(
        content=content,
        thinking=reply.thinking,
        tool_calls=tuple(ToolCall(id=i, name=c.name, arguments=c.arguments) for i, c in calls),  # type: ignore[arg-type]
    )


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=60)
@given(replies(), st.booleans(), st.lists(st.integers(min_value=0), max_size=10))
def test_ollama_stream_in_any_chunking_reads_back_the_reply(reply: Reply, with_ids: bool, cuts: list[int]) -> None:
    data = b"".join(line + b"\n" for line in ollama_records(reply, "m", with_ids=with_ids, seq=7))
    reader = NDJSONReader("call_3_")
    for piece in _split(data, cuts):
        reader.feed(piece)
    result = reader.finish()
    n = len(reply.tool_calls)
    ids = [f"call_fake7_{k}" for k in range(n)] if with_ids else [f"call_3_{k}" for k in range(n)]
    assert result.message == _expected(reply, ids)
    assert result.usage == Usage(reply.input_tokens or 0, reply.output_tokens or 0)
    # Non-stream body: same answer.
    assert (
        ollama_response(encoded(ollama_body(reply, "m", with_ids=with_ids, seq=7)), id_prefix="call_3_").message
        == result.message
    )


layouts = st.builds(
    OpenAILayout,
    split_finish=st.booleans(),
    reasoning_field=st.sampled_from(["reasoning_content", "reasoning"]),
    whole_calls=st.booleans(),
    with_ids=st.booleans(),
    crlf=st.booleans(),
    comments=st.booleans(),
)


@settings(max_examples=60)
@given(replies(), layouts, st.booleans(), st.lists(st.integers(min_value=0), max_size=10))
def test_openai_stream_in_any_chunking_reads_back_the_reply(
    reply: Reply, layout: OpenAILayout, usage: bool, cuts: list[int]
) -> None:
    data = b"".join(openai_events(reply, "m", layout=layout, include_usage=usage, seq=7))
    reader = SSEReader("call_3_")
    for piece in _split(data, cuts):
        reader.feed(piece)
    result = reader.finish()
    n = len(reply.tool_calls)
    ids = [f"call_fake7_{k}" for k in range(n)] if layout.with_ids else [f"call_3_{k}" for k in range(n)]
    assert result.message == _expected(reply, ids)
    assert result.usage == (Usage(reply.input_tokens or 0, reply.output_tokens or 0) if usage else Usage())
    body = openai_response(encoded(openai_body(reply, "m", layout=layout, seq=7)), id_prefix="call_3_")
    assert body.message == _expected(reply, [f"call_fake7_{k}" for k in range(n)])


def test_openai_fragments_without_index_are_stitched_by_id() -> None:
    reply = Reply(tool_calls=(FakeCall("clock", {"a": 1}), FakeCall("clock", {"b": "x"})))
    layout = OpenAILayout(omit_index=True)
    reader = SSEReader("call_0_")
    reader.feed(b"".join(openai_events(reply, "m", layout=layout)))
    calls = reader.finish().message.tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("clock", {"a": 1}), ("clock", {"b": "x"})]


# --------------------------------------------------------------------------- ids and pairing


def test_two_calls_to_the_same_tool_keep_their_order_and_pair_by_order_for_ollama() -> None:
    # An old Ollama history: no ids anywhere. Results pair with calls by name and order.
    history = [
        {"role": "user", "content": "weather in two cities"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "clock", "arguments": {}}},
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            ],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_name": "clock", "content": "noon"},
        {"role": "tool", "tool_name": "get_weather", "content": "snow"},
    ]
    messages = messages_from_ollama(history)
    assistant = messages[1]
    assert isinstance(assistant, AssistantMessage)
    assert [c.arguments for c in assistant.tool_calls] == [{"city": "Paris"}, {}, {"city": "Oslo"}]
    ids = [c.id for c in assistant.tool_calls]
    assert len(set(ids)) == 3 and all(ids)
    results = [m for m in messages if isinstance(m, ToolResult)]
    assert [r.call_id for r in results] == [ids[0], ids[1], ids[2]]
    # Out again (both wires), order and pairing are kept.
    wire = messages_to_ollama(messages)
    assert [c["function"]["arguments"] for c in wire[1]["tool_calls"]] == [{"city": "Paris"}, {}, {"city": "Oslo"}]
    assert [m["tool_call_id"] for m in messages_to_openai(messages)[2:]] == ids


def test_missing_ids_are_generated_stable_and_unique() -> None:
    assert ensure_call_ids([None, "", None], "call_4_") == ["call_4_0", "call_4_1", "call_4_2"]
    assert ensure_call_ids(["x", "x", None], "call_") == ["x", "call_1", "call_2"]
    assert ensure_call_ids(["call_1", None], "call_") == ["call_1", "call_1_"]
    stream = OllamaStream(id_prefix="call_9_")
    stream.feed(
        {
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "clock", "arguments": {}}}],
            }
        }
    )
    stream.feed({"done": True})
    assert stream.result().message.tool_calls[0].id == "call_9_0"


def test_tool_results_without_call_ids_are_paired_for_openai() -> None:
    calls = (ToolCall(id="a", name="clock"), ToolCall(id="b", name="clock"))
    history: list[Message] = [
        UserMessage(content="hi"),
        AssistantMessage(tool_calls=calls),
        ToolResult(name="clock", content="1"),
        ToolResult(name="clock", content="2"),
    ]
    assert [m.call_id for m in pair_tool_results(history) if isinstance(m, ToolResult)] == ["a", "b"]
    wire = messages_to_openai(history)
    assert [m["tool_call_id"] for m in wire[2:]] == ["a", "b"]


# --------------------------------------------------------------------------- think tags


@given(nonblank, text, st.sampled_from(["", " ", "\n", "\n\n"]), st.sampled_from(["", "\n", "  "]))
def test_think_tags_at_the_start_of_content_become_thinking(thinking: str, answer: str, pad: str, lead: str) -> None:
    content = f"{lead}<think>{pad}{thinking}{pad}</think>{pad}{answer}"
    assert split_think(content) == (thinking, answer.lstrip())


def test_think_tag_edge_cases() -> None:
    assert split_think("plain answer") == (None, "plain answer")
    # Only a block that opens the content is reasoning (RFC 0005 §3): a bare close tag is text.
    assert split_think("reasoning here</think>\n\nanswer") == (None, "reasoning here</think>\n\nanswer")
    assert split_think("In XML you close it with </think> and go on.") == (
        None,
        "In XML you close it with </think> and go on.",
    )
    assert split_think("<think>cut off by the length limit") == ("cut off by the length limit", "")
    assert split_think("<think></think>answer") == (None, "answer")
    assert split_think("an answer mentioning <think> later") == (None, "an answer mentioning <think> later")


def test_thinking_field_and_tags_both_count() -> None:
    stream = OllamaStream()
    stream.feed(
        {"message": {"role": "assistant", "thinking": "field", "content": "<think>tag</think>answer"}, "done": True}
    )
    message = stream.result().message
    assert (message.thinking, message.content) == ("field\ntag", "answer")


# --------------------------------------------------------------------------- invalid arguments


@pytest.mark.parametrize("raw", ['{"city": "Par', "[1, 2]", '"just a string"', "42", "not json at all"])
def test_invalid_argument_json_becomes_an_error_and_is_never_replayed(raw: str) -> None:
    arguments, error = parse_arguments(raw)
    assert arguments == {} and error
    assert raw not in error
    reader = SSEReader("call_0_")
    reader.feed(b"".join(openai_events(Reply(tool_calls=(FakeCall("lookup", raw),)), "m")))
    call = reader.finish().message.tool_calls[0]
    assert call.arguments == {} and call.arguments_error
    history: list[Message] = [
        UserMessage(content="q"),
        AssistantMessage(tool_calls=(call,)),
        ToolResult(name="lookup", content=call.arguments_error, call_id=call.id, is_error=True),
    ]
    for body in (
        openai_chat_request("m", history, [], {}, stream=True),
        ollama_chat_request("m", history, [], {}, stream=True),
    ):
        assert raw not in json.dumps(body)
    assert (
        openai_chat_request("m", history, [], {}, stream=True)["messages"][1]["tool_calls"][0]["function"]["arguments"]
        == "{}"
    )


def test_empty_argument_string_means_no_arguments() -> None:
    assert parse_arguments("") == ({}, None)
    assert parse_arguments(None) == ({}, None)
    assert parse_arguments({"a": 1}) == ({"a": 1}, None)


# --------------------------------------------------------------------------- requests and options


def test_ollama_request_shape_and_options() -> None:
    history: list[Message] = [
        SystemMessage(content="be brief", name="triage"),
        UserMessage(content="look", images=("iVBORw0KGgo=",)),
    ]
    spec = ToolSpec(name="clock", description="time", parameters={"type": "object", "properties": {}})
    options = {
        "think": "high",
        "temperature": 0.2,
        "num_ctx": 4096,
        "keep_alive": "5m",
        "stream": False,
        "read_timeout": 3,
    }
    body = ollama_chat_request("llama3", history, [spec], options, stream=False)
    assert body == {
        "model": "llama3",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "look", "images": ["iVBORw0KGgo="]},
        ],
        "stream": False,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "clock",
                    "description": "time",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
        "think": "high",
        "keep_alive": "5m",
        "options": {"temperature": 0.2, "num_ctx": 4096},
    }


def test_openai_request_shape_and_options() -> None:
    history: list[Message] = [
        SystemMessage(content="sys", name="triage"),
        UserMessage(content="look", images=("/9j/abc",)),
    ]
    body = openai_chat_request(
        "gpt", history, [], {"temperature": 0.5, "max_tokens": 9, "stream": True, "connect_timeout": "2s"}, stream=True
    )
    assert body == {
        "model": "gpt",
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/abc"}},
                ],
            },
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "max_tokens": 9,
    }
    assert "stream_options" not in openai_chat_request("gpt", history, [], {}, stream=False)
    assert image_url("https://example.invalid/a.png") == "https://example.invalid/a.png"


def test_call_options() -> None:
    assert call_options({}).stream is True
    options = call_options({"stream": False, "read_timeout": "250ms", "connect_timeout": 2})
    assert (options.stream, options.read_timeout, options.connect_timeout) == (False, 0.25, 2.0)
    for bad in ({"stream": "yes"}, {"read_timeout": 0}, {"read_timeout": "soon"}, {"connect_timeout": True}):
        with pytest.raises(OptionError):
            call_options(bad)


# --------------------------------------------------------------------------- bad responses


def test_streams_without_terminator_are_incomplete() -> None:
    ollama = NDJSONReader("c_")
    ollama.feed(b'{"message":{"role":"assistant","content":"partial"},"done":false}\n')
    with pytest.raises(IncompleteStream):
        ollama.finish()
    cut = NDJSONReader("c_")
    cut.feed(b'{"message":{"role":"assistant","content":"x"},"done":false}\n{"done":tr')
    with pytest.raises(IncompleteStream):
        cut.finish()
    openai = SSEReader("c_")
    openai.feed(b'data: {"choices":[{"index":0,"delta":{"content":"partial"}}]}\n\n')
    with pytest.raises(IncompleteStream):
        openai.finish()


def test_a_finish_without_done_is_complete() -> None:
    reader = SSEReader("c_")
    reader.feed(b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n')
    assert reader.finish().message.content == "ok"


def test_mid_stream_errors() -> None:
    with pytest.raises(RemoteError) as ollama_error:
        NDJSONReader("c_").feed(
            b'{"message":{"role":"assistant","content":"a"},"done":false}\n{"error":"runner died"}\n'
        )
    assert str(ollama_error.value) == "runner died" and not ollama_error.value.request_error
    with pytest.raises(RemoteError) as openai_error:
        SSEReader("c_").feed(b'data: {"error":{"message":"context too long","type":"invalid_request_error"}}\n\n')
    assert openai_error.value.request_error
    with pytest.raises(RemoteError):
        SSEReader("c_").feed(b'event: error\ndata: {"message":"overloaded"}\n\n')


@pytest.mark.parametrize("line", [b"<html>oops</html>\n", b'{"message": 5}\n', b"[1,2]\n"])
def test_malformed_ollama_lines(line: bytes) -> None:
    with pytest.raises(WireError):
        NDJSONReader("c_").feed(line)


@pytest.mark.parametrize("body", [[], {"choices": []}, {"object": "list"}, {"choices": [{"message": "text"}]}])
def test_malformed_openai_bodies(body: Any) -> None:
    with pytest.raises(WireError):
        openai_response(body)


def test_usage_chunk_before_finish_and_unknown_finish_reason() -> None:
    stream = OpenAIStream()
    stream.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    stream.feed({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "something_new"}]})
    result = stream.result()
    assert (result.usage, result.finish_reason, result.message.content) == (Usage(3, 4), "something_new", "hi")


def test_an_error_line_after_done_does_not_spoil_a_finished_ollama_answer() -> None:
    stream = OllamaStream()
    stream.feed_line(b'{"model":"m","message":{"role":"assistant","content":"all good"},"done":false}')
    stream.feed_line(b'{"model":"m","message":{"role":"assistant","content":""},"done":true,"eval_count":2}')
    stream.feed_line(b'{"error":"late noise"}')
    assert stream.result().message.content == "all good"
