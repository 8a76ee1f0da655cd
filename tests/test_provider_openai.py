"""The openai provider against a fake OpenAI-compatible server over real HTTP on loopback,
including the secrets rule: the API key never shows in an error, a repr or a log event."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog

from agentd.budget import Usage
from agentd.config import Intelligence, intelligence_map, load_config
from agentd.intel import build_provider
from agentd.intel.base import CompletionRequest, IntelError, IntelErrorKind
from agentd.intel.endpoints import BreakerState, RetryPolicy
from agentd.intel.openai import OpenAIProvider
from agentd.messages import AssistantMessage, Message, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec
from tests.fakes import (
    FakeCall,
    FakeOpenAI,
    OpenAILayout,
    Reply,
    drop_mid_stream,
    malformed_chunk,
    raw,
    refused_url,
    stall,
    status,
    stream_error,
    truncated,
)

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(rounds=3, backoff=0.01, max_backoff=0.02, jitter=0.0, max_wait=5.0)
KEY_ENV = "AGENTD_TEST_OPENAI_KEY"
KEY = "sk-test-9f8e7d6c5b4a-SECRET"
LOOKUP = ToolSpec(
    name="lookup",
    description="Look a word up",
    parameters={"type": "object", "properties": {"word": {"type": "string"}}},
)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def make(*urls: str, model: str = "gpt-test", options: dict[str, Any] | None = None, **kwargs: Any) -> OpenAIProvider:
    intelligence = Intelligence(
        provider="openai", endpoints=urls, model=model, api_key_env=KEY_ENV, options=options or {}
    )
    return OpenAIProvider(intelligence, retry=kwargs.pop("retry", FAST), **kwargs)


@asynccontextmanager
async def opened(provider: OpenAIProvider) -> AsyncIterator[OpenAIProvider]:
    try:
        yield provider
    finally:
        await provider.aclose()


def ask(*messages: Message, tools: tuple[ToolSpec, ...] = (), deadline: float | None = None) -> CompletionRequest:
    return CompletionRequest(messages=list(messages) or [UserMessage(content="hi")], tools=tools, deadline=deadline)


async def fails(provider: OpenAIProvider, request: CompletionRequest | None = None) -> IntelError:
    with pytest.raises(IntelError) as caught:
        await provider.complete(request or ask())
    return caught.value


TOOL_REPLY = Reply(
    content="Looking both up.",
    thinking="Two words, two lookups.",
    tool_calls=(FakeCall("lookup", {"word": "alpha"}), FakeCall("lookup", {"word": "beta", "lang": ["en", "fr"]})),
    input_tokens=30,
    output_tokens=12,
)


# --------------------------------------------------------------------------- the happy paths


@pytest.mark.parametrize(
    "layout",
    [
        OpenAILayout(),
        OpenAILayout(split_finish=True, reasoning_field="reasoning", whole_calls=True),  # Ollama compat, Aug 2026
        OpenAILayout(split_finish=False, reasoning_field="reasoning", whole_calls=True),  # Ollama compat, before
        OpenAILayout(crlf=True, comments=True, with_ids=False),
    ],
    ids=["classic", "ollama-compat-split-finish", "ollama-compat-classic", "crlf-no-ids"],
)
async def test_streaming_with_tools_thinking_and_usage(layout: OpenAILayout) -> None:
    with FakeOpenAI(default=TOOL_REPLY, layout=layout, api_key=KEY) as server:
        async with opened(make(server.url + "/v1")) as provider:
            completion = await provider.complete(ask(UserMessage(content="define alpha and beta"), tools=(LOOKUP,)))
    message = completion.message
    assert (message.content, message.thinking) == ("Looking both up.", "Two words, two lookups.")
    assert [(c.name, c.arguments) for c in message.tool_calls] == [
        ("lookup", {"word": "alpha"}),
        ("lookup", {"word": "beta", "lang": ["en", "fr"]}),
    ]
    expected_ids = ["call_fake1_0", "call_fake1_1"] if layout.with_ids else ["call_1_0", "call_1_1"]
    assert [c.id for c in message.tool_calls] == expected_ids
    assert completion.usage == Usage(30, 12) and completion.model == "gpt-test"
    request = server.chat_requests[0]
    assert request.headers["authorization"] == f"Bearer {KEY}" and request.headers["accept"] == "text/event-stream"
    assert request.body["stream"] is True and request.body["stream_options"] == {"include_usage": True}
    assert request.body["tools"][0]["function"]["name"] == "lookup"


async def test_history_goes_out_in_the_openai_shape() -> None:
    with FakeOpenAI(default=Reply(content="alpha means first")) as server:
        async with opened(make(server.url, options={"temperature": 0.3, "max_tokens": 64})) as provider:
            call = ToolCall(id="call_1_0", name="lookup", arguments={"word": "alpha"})
            history: list[Message] = [
                UserMessage(content="define alpha", name="ana"),
                AssistantMessage(content="", thinking="hmm", tool_calls=(call,), model="gpt-test", assistant="triage"),
                ToolResult(name="lookup", content="first letter", call_id="call_1_0"),
            ]
            await provider.complete(ask(*history))
    body = server.chat_requests[0].body
    assert body["messages"] == [
        {"role": "user", "content": "define alpha", "name": "ana"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1_0", "type": "function", "function": {"name": "lookup", "arguments": '{"word":"alpha"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1_0", "content": "first letter"},
    ]
    assert (body["temperature"], body["max_tokens"], body["model"]) == (0.3, 64, "gpt-test")
    assert server.chat_requests[0].path == "/v1/chat/completions"  # a bare root gets /v1


async def test_non_stream_mode() -> None:
    with FakeOpenAI(default=TOOL_REPLY) as server:
        async with opened(make(server.url + "/v1/", options={"stream": False})) as provider:
            completion = await provider.complete(ask())
    body = server.chat_requests[0].body
    assert body["stream"] is False and "stream_options" not in body
    assert completion.message.thinking == "Two words, two lookups." and len(completion.message.tool_calls) == 2
    assert completion.usage == Usage(30, 12)


async def test_think_tags_from_a_server_without_a_reasoning_parser() -> None:
    with FakeOpenAI(default=Reply(content="42.", thinking="six times seven", think_tags=True)) as server:
        async with opened(make(server.url)) as provider:
            message = (await provider.complete(ask())).message
    assert (message.thinking, message.content) == ("six times seven", "42.")


async def test_invalid_argument_json_is_an_argument_error_never_replayed() -> None:
    broken = '{"word": "alpha", '
    with FakeOpenAI(default=Reply(tool_calls=(FakeCall("lookup", broken),))) as server:
        async with opened(make(server.url)) as provider:
            call = (await provider.complete(ask())).message.tool_calls[0]
            assert call.arguments == {} and call.arguments_error
            history: list[Message] = [
                UserMessage(content="q"),
                AssistantMessage(tool_calls=(call,)),
                ToolResult(name="lookup", content=call.arguments_error, call_id=call.id, is_error=True),
            ]
            await provider.complete(ask(*history))
    sent = server.chat_requests[1].body["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert broken not in str(sent)


async def test_discovery_lists_models() -> None:
    with FakeOpenAI(models=("gpt-a", "gpt-b"), api_key=KEY) as server:
        async with opened(make(server.url + "/v1")) as provider:
            assert await provider.models() == ["gpt-a", "gpt-b"]
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


async def test_build_provider() -> None:
    provider = build_provider(Intelligence(provider="openai", endpoints=("http://127.0.0.1:9/v1",), model="m"))
    assert isinstance(provider, OpenAIProvider)
    await provider.aclose()


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    "fault",
    [
        status(500, "internal"),
        status(502, "bad gateway"),
        status(503, "overloaded", retry_after="0"),
        status(429, "rate limited", retry_after="0"),
        drop_mid_stream(after=3),
        truncated(after=3),
        stream_error("the engine died"),
    ],
    ids=["500", "502", "503", "429", "dropped", "truncated", "mid-stream-error"],
)
async def test_retryable_faults_are_retried(fault: Any) -> None:
    with FakeOpenAI(default=Reply(content="recovered")) as server:
        server.script(fault)
        async with opened(make(server.url)) as provider:
            assert (await provider.complete(ask())).message.content == "recovered"
    assert [r.outcome for r in server.chat_requests] == [fault.kind, "reply"]


@pytest.mark.parametrize(
    "fault", [drop_mid_stream(), stall(), stream_error("engine died")], ids=["dropped", "stall", "error-body"]
)
async def test_non_stream_faults_are_retried(fault: Any) -> None:
    with FakeOpenAI(default=Reply(content="recovered")) as server:
        server.script(fault)
        async with opened(make(server.url, options={"stream": False, "read_timeout": 0.3})) as provider:
            assert (await provider.complete(ask())).message.content == "recovered"


async def test_stall_past_the_read_timeout_fails_over() -> None:
    with FakeOpenAI() as primary, FakeOpenAI(default=Reply(content="secondary answered")) as secondary:
        primary.script(stall(after=2))
        async with opened(make(primary.url, secondary.url, options={"read_timeout": 0.3})) as provider:
            completion = await provider.complete(ask())
        assert primary.stalled.is_set()
    assert completion.message.content == "secondary answered"


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (status(401, "Incorrect API key provided"), IntelErrorKind.AUTH),
        (status(403, "not allowed"), IntelErrorKind.AUTH),
        (status(400, "max_tokens is too large"), IntelErrorKind.REQUEST),
        (status(404, "The model `gpt-test` does not exist"), IntelErrorKind.REQUEST),
        (malformed_chunk(after=2), IntelErrorKind.MALFORMED),
        (raw(200, b'{"not": "a completion"}'), IntelErrorKind.MALFORMED),
        (
            raw(
                200,
                b'data: {"error": {"message": "prompt too long", "type": "invalid_request_error"}}\n\n',
                "text/event-stream",
            ),
            IntelErrorKind.REQUEST,
        ),
    ],
    ids=["401", "403", "400", "404", "malformed-chunk", "wrong-json", "mid-stream-request-error"],
)
async def test_errors_that_are_not_failed_over(fault: Any, kind: IntelErrorKind) -> None:
    with FakeOpenAI() as primary, FakeOpenAI(default=Reply(content="never")) as secondary:
        primary.script(fault)
        async with opened(make(primary.url, secondary.url)) as provider:
            error = await fails(provider)
    assert error.kind is kind
    assert len(primary.chat_requests) == 1 and secondary.chat_requests == []


async def test_missing_key_env_is_an_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    with FakeOpenAI() as server:
        async with opened(make(server.url)) as provider:
            error = await fails(provider)
    assert error.kind is IntelErrorKind.AUTH and KEY_ENV in str(error) and server.requests == []


async def test_all_endpoints_down_is_unavailable_and_the_breakers_open() -> None:
    with FakeOpenAI(default=status(503, "down")) as second:
        async with opened(make(refused_url(), second.url)) as provider:
            error = await fails(provider, ask(deadline=anyio.current_time() + 20))
            states = [provider.endpoints.state(i) for i in range(2)]
    assert error.kind is IntelErrorKind.UNAVAILABLE
    assert states == [BreakerState.OPEN, BreakerState.OPEN] and len(second.chat_requests) == 3


# --------------------------------------------------------------------------- secrets


async def test_the_api_key_appears_in_no_error_repr_or_log() -> None:
    """Drive every kind of failure, with a server that echoes the key back, and look for the key."""
    faults = [
        status(401, "Incorrect API key provided", echo_auth=True),
        status(500, "upstream failed", echo_auth=True),
        status(400, "bad request", echo_auth=True),
        stream_error(f"engine died holding {KEY}"),
        malformed_chunk(),
        drop_mid_stream(),
        stall(),
    ]
    seen: list[str] = []
    with FakeOpenAI(default=Reply(content="fine")) as server, structlog.testing.capture_logs() as logs:
        async with opened(
            make(refused_url(), server.url, options={"read_timeout": 0.3}, retry=RetryPolicy(rounds=1))
        ) as provider:
            seen.append(repr(provider))
            for fault in faults:
                server.script(fault)
                try:
                    await provider.complete(ask())
                except IntelError as error:
                    seen += [str(error), repr(error), repr(error.args)]
                provider.endpoints.health = [
                    type(h)() for h in provider.endpoints.health
                ]  # keep both endpoints in play
    assert any("[redacted]" in text for text in seen)  # the echo was there, and was scrubbed
    assert len(seen) > len(faults) // 2
    rendered = [repr(event) for event in logs]
    assert rendered and all(KEY not in text for text in seen + rendered)
    assert all(r.headers.get("authorization") == f"Bearer {KEY}" for r in server.chat_requests)


async def test_connections_are_reused_across_steps() -> None:
    with FakeOpenAI(default=Reply(content="ok", pieces=8)) as server:
        async with opened(make(server.url)) as provider:
            for _ in range(4):
                await provider.complete(ask())
    assert server.stats.connections == 1


async def test_the_openai_example_config_works_against_the_fake() -> None:
    config = load_config(Path(__file__).parent.parent / "examples" / "openai.toml")
    intelligences = intelligence_map(config)
    assert intelligences["triage"].api_key_env is None and intelligences["billing"].api_key_env == "OPENAI_API_KEY"
    with FakeOpenAI(default=Reply(content="Hello from the example.")) as server:
        for intelligence in intelligences.values():
            # Keep the example's failover shape: a dead first endpoint, then the fake.
            local = msgspec.structs.replace(
                intelligence, endpoints=(refused_url(), server.url + "/v1"), api_key_env=KEY_ENV
            )
            provider = build_provider(local)
            assert isinstance(provider, OpenAIProvider)
            async with opened(provider):
                assert (await provider.complete(ask())).message.content == "Hello from the example."
    assert server.models_served() == ["Qwen/Qwen3-4B-Instruct-2507", "gpt-4o-mini"]
    body = server.chat_requests[0].body
    assert (body["temperature"], body["max_tokens"]) == (0.2, 1024) and "read_timeout" not in body


async def test_fake_server_gate_holds_a_step_in_flight() -> None:
    gate = threading.Event()
    with FakeOpenAI(default=Reply(content="released", gate=gate)) as server:
        async with opened(make(server.url)) as provider:
            async with anyio.create_task_group() as group:
                results: list[str] = []

                async def step() -> None:
                    results.append((await provider.complete(ask())).message.content)

                group.start_soon(step)
                assert await anyio.to_thread.run_sync(server.wait_for_received, 1)
                assert results == [] and server.models_served() == ["gpt-test"]
                gate.set()
    assert results == ["released"]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def test_parallel_calls_all_at_index_0_stay_separate_calls() -> None:
    """Ollama's compat layer streams each whole parallel call with index 0 and its own id."""

    def call(n: int, path: str) -> dict[str, Any]:
        return {
            "id": f"call_{n}",
            "index": 0,
            "type": "function",
            "function": {"name": "lookup", "arguments": msgspec.json.encode({"word": path}).decode()},
        }

    body = (
        _chunk({"role": "assistant", "content": "", "tool_calls": [call(1, "alpha")]})
        + _chunk({"role": "assistant", "content": "", "tool_calls": [call(2, "beta")]})
        + _chunk({"role": "assistant", "content": ""}, "tool_calls")
        + b"data: [DONE]\n\n"
    )
    with FakeOpenAI() as server:
        server.script(raw(200, body, "text/event-stream"))
        async with opened(make(server.url)) as provider:
            completion = await provider.complete(ask(tools=(LOOKUP,)))
    assert [(c.id, c.arguments, c.arguments_error) for c in completion.message.tool_calls] == [
        ("call_1", {"word": "alpha"}, None),
        ("call_2", {"word": "beta"}, None),
    ]


async def test_a_stream_of_keepalive_comments_that_ends_fails_over() -> None:
    with FakeOpenAI() as primary, FakeOpenAI(default=Reply(content="from backup")) as backup:
        primary.script(raw(200, b": PROCESSING\n\n: PROCESSING\n\n", "text/event-stream"))
        async with opened(make(primary.url, backup.url)) as provider:
            assert (await provider.complete(ask())).message.content == "from backup"
